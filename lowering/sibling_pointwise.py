"""Sibling pointwise kernels: two pointwise nodes over one shape that read a value at the same index become one.

After fusion a backward keeps pairs of element-wise kernels that read the same tensor and neither reads the other:
SiLU's backward recomputes ``sigmoid(x)`` beside a kernel that stores ``silu(x)`` or a copy of ``x``. Inlining copies
a producer only into a single reader and multi-output fusion (``multi_output``) only merges a producer into its
reader, so each stays a dispatch. Merged, one kernel loads the shared element once and stores both: the later node
computes the earlier one's expressions as further outputs (``Pointwise.also``, ``siblings.merge_pointwise``), in the
later one's place (``siblings`` moves what depends on the earlier one). Full-size SD U-Net's loop backward on the null
device: 702 -> 665 dispatches, its arena the same.

Candidates are pointwise nodes that walk the same shape (their first outputs': every output is stored at the walk's
linear index), with the same answer to whether every output is f32 (an all-f32 kernel may load and store vec4s,
``kernels.pointwise``'s quads, which one output of another storage turns off for the whole kernel), and that share a
load: the same value at the same coordinates (one element). Sharing a read, not the walk alone: the walk alone merged 17
more of that backward's kernels (to 648 dispatches) but nearly doubled its arena (40.9 -> 79.0 MiB: the earlier nodes'
operands kept alive up to later, unrelated kernels; measured before ``_moved_keep_alive``), and only a shared read saves
the device a load. Not candidates: an update over the elements it changes (``ir.Region``: ``sibling_updates`` merges
those), and a node that checks data (``data_checks`` runs each check before any input is overwritten and inlines the
index arithmetic it guarded into its readers: merged, the check would move to the later node's place and the index stay
a kernel).

Refused, with the reason recorded (``siblings``): a node that reads the other's result, a merge that would keep more
than ``siblings.KEEP_ALIVE_BYTES`` alive, of what the earlier node reads (``siblings``) or of what the nodes it moves
read (``_moved_keep_alive``), a kernel past the binding limit (each value read or stored once, and the status buffer,
which a kernel that stores over its input binds where the plan checks data: as ``multi_output`` counts) or past
``fusion.MAX_EXPR_NODES``.
"""
from __future__ import annotations

from meganeura.runtime.dtypes import STORAGE

from . import expr as E
from .bindings import checks
from .fusion import MAX_EXPR_NODES, FusionReport
from .ir import Graph, Node, Pointwise
from .siblings import KEEP_ALIVE_BYTES, _kept_alive, fuse_siblings, merge_pointwise


def fuse_sibling_pointwise(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Merge each pointwise node into the next one of the same walk that reads a value at the same index, where the
    rules allow."""
    keys: dict[int, tuple[Node, list | None]] = {}  # node id -> (the node, its keys): nodes held, so no id is reused
    loads = {id(n): {ld.args[0] for e in n.exprs() for ld in E.loads_of(e)} for n in graph.nodes}

    def key_of(node) -> list | None:
        if id(node) not in keys:
            candidate = isinstance(node, Pointwise) and node.region is None and not checks(node.exprs())
            keys[id(node)] = (node, _shared_reads(node) if candidate else None)
        return keys[id(node)][1]

    def merge(earlier: Pointwise, later: Pointwise) -> None:
        merge_pointwise(earlier, later)
        keys.pop(id(later))  # (it reads what both read now)
        loads[id(later)] |= loads[id(earlier)]

    def refusal(earlier: Pointwise, later: Pointwise) -> str | None:
        return _too_large(earlier, later) or _moved_keep_alive(graph, earlier, later, loads)

    fuse_siblings(graph, max_bindings, report, key_of, merge, _bindings, refusal)


def _shared_reads(node: Pointwise) -> list[tuple]:
    """A key for each distinct read of ``node``: its walk, whether every output is f32, the value read and the
    coordinates it reads at (as fusion simplified them over the walk: the loads of one element by two nodes of one
    walk compare equal; their linear indices simplified again cost SmolLM2's resident step 0.4 s a compile)."""
    f32 = all(STORAGE[v.dtype] == "f32" for v in node.outs)
    reads = dict.fromkeys((ld.args[0], ld.args[1]) for e in node.exprs() for ld in E.loads_of(e))
    return [(node.out.shape, f32, value, coords) for value, coords in reads]


def _bindings(earlier: Node, later: Node, loaded: set) -> int:
    """The merged kernel's storage bindings: each value read or stored once, and the status buffer."""
    return len(loaded) + len(earlier.outs) + len(later.outs) + 1


def _too_large(earlier: Pointwise, later: Pointwise) -> str | None:
    size = sum(E.size(e) for e in (*earlier.exprs(), *later.exprs()))
    return "expression too large" if size > MAX_EXPR_NODES else None


def _moved_keep_alive(graph: Graph, earlier: Pointwise, later: Pointwise, loads: dict[int, set]) -> str | None:
    """Why the merge would keep too much alive through the nodes it moves, or None. The nodes between the two that
    read the earlier one's results move to after the merged node (``siblings``), and what they read besides stays
    alive until there: ResNet-50's backward recomputes a ReLU for a weight gradient's product early, where it reads
    the layer's output gradient, and a BatchNorm backward reads the ReLU's operand much later; merged, each such
    product waited with its gradient, and the loop's backward arena grew 98.0 -> 140.9 MiB. ``loads``: node id -> the
    values it reads. (A later node that reads what they compute is ``siblings``' to refuse.)"""
    nodes = graph.nodes
    start, end = graph.position(earlier), graph.position(later)
    tainted, read = {v.id for v in earlier.outs}, set()
    for n in nodes[start + 1 : end]:
        if loads[id(n)] & tainted:
            read |= loads[id(n)]
            tainted |= {v.id for v in n.outs}
    if not read or loads[id(later)] & tainted:
        return None
    kept = sum(_kept_alive(graph, end, read - tainted, loads).values())
    if kept > KEEP_ALIVE_BYTES:
        return f"it would keep {kept} bytes that the nodes it moves read alive past the merged node"
    return None
