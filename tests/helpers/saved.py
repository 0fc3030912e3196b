"""What a compiled training graph saved for its backward, found from the loss (``SavedPack``s: backend/packed.py)."""
from torch_meganeura.tensors.saved_pack import SavedPack


def saved_packs(loss) -> list[SavedPack]:
    """The packs among the saved tensors of ``loss``'s autograd graph, each once."""
    packs, seen, todo = {}, set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        packs.update({id(t): t for t in getattr(node, "saved_tensors", ()) if isinstance(t, SavedPack)})
        todo.extend(n for n, _ in node.next_functions)
    return list(packs.values())
