"""Sibling outputs: pointwise nodes of one shape whose outputs are all graph outputs become one kernel.

A decode step writes each layer's new key and new value into the layer's two caches: with a static cache two updates
stored over the caches (``Graph.in_place``), with HF's default cache two new tensors, each cache concatenated with its
new row. Either way two pointwise nodes over the cache's shape that do not read each other. Merged, one kernel stores
both (the later node computes the earlier one's expressions as further outputs, ``Pointwise.also``), one dispatch per
layer fewer. Only nodes whose every output is a graph output are merged (what they store lives past the plan whatever
the kernels' order, so the arena keeps nothing longer for it), so that other pointwise kernels keep their plans; the
merged kernel stays within the binding limit (``siblings``, which also moves what depends on the earlier node). An
output stored over its input reads the input's old value through its own binding (``in_place``), so where nothing else
reads that old value and the kernel may store over it whatever the kernels' order (``in_place.writer_refusal``), the
two count as one binding, and the status buffer, which a writer binds where the plan checks data, counts always: a
Llama layer's two cache writes, with the rotary embedding of the key (the updated position, the new key and value,
cosine and sine, the two caches, status), fit a portable plan's 8. Updates that carry the elements they change
(``ir.Region``) merge where those are the same elements (the region's shape, places and choice of entries), and the
merged node changes them in every output (``regions``).

Whether an output is stored over its input is decided only when the plan is scheduled (``in_place``), against the
kernels' final order: a data check placed after the merged kernel (a loss's target index, read at the end of a
training forward) refuses every request before it. A merged kernel that counted on shared bindings is then cut back
into kernels that fit without them (``split_overfull_updates``), each output computed as it was before the merge.
"""
from __future__ import annotations

from . import expr as E
from .fusion import FusionReport
from .in_place import writer_refusal
from .ir import Graph, Input, Node, Pointwise, kernel_forms
from .siblings import fuse_siblings, merge_pointwise


def fuse_sibling_updates(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Merge each pointwise node whose outputs are graph outputs into the next such node of the same shape and
    dtype, where the rules allow."""
    outputs = {v.id for v in graph.outputs}

    def key(node) -> tuple | None:
        if not isinstance(node, Pointwise) or not all(v.id in outputs for v in node.outs):
            return None
        region = node.region and (node.region.shape, node.region.at, node.region.keep)
        return node.out.shape, node.out.dtype, region

    def bindings(earlier: Node, later: Node, loaded: set) -> int:
        stored_over = _stored_over(graph, [earlier, later])
        forms = zip(kernel_forms(earlier), kernel_forms(later))  # (the same forms: ``key``)
        most = max(len({ld.args[0] for e in (*a, *b) for ld in E.loads_of(e)} - stored_over) for a, b in forms)
        return most + len(earlier.outs) + len(later.outs) + 1

    fuse_siblings(graph, max_bindings, report, key, merge_pointwise, bindings)


def _stored_over(graph: Graph, writers: list[Node]) -> set[int]:
    """Ids of the inputs that the merged kernel of ``writers`` reads through the bindings of outputs stored over them:
    those it may store over whatever the order (``in_place.writer_refusal``) and that no other node reads."""
    outs = {v.id: (v, w) for w in writers for v in w.outs}
    requests = [(outs[graph.outputs[p].id], name) for p, name in graph.in_place.items() if graph.outputs[p].id in outs]
    if not requests:  # (the readers are counted only of the inputs that the writers ask to store over)
        return set()
    inputs = {n.name: n for n in graph.nodes if isinstance(n, Input)}
    targets = [(out, inputs[name]) for out, name in requests if name in inputs]
    ids = {target.out.id for _, target in targets}
    read_elsewhere = {ld.args[0] for n in graph.nodes if not any(n is w for w in writers)
                      for e in n.exprs() for ld in E.loads_of(e) if ld.args[0] in ids}
    return {target.out.id for (v, writer), target in targets
            if target.out.id not in read_elsewhere and writer_refusal(v, target, writer) is None}


def split_overfull_updates(graph: Graph, kernels: list[Node], stored_over: dict[int, int],
                           max_bindings: int) -> list[Node]:
    """``kernels`` with each merged update that exceeds ``max_bindings`` once ``stored_over`` (output value id -> id of
    the input it is stored over, as scheduled) is known cut into consecutive kernels within it, whatever is stored
    over what (the same cut in ``graph.nodes``); the caller decides the in-place outputs again."""
    result = []
    for node in kernels:
        if isinstance(node, Pointwise) and node.also and _bindings_as_stored(node, stored_over) > max_bindings:
            parts = _parts_within(node, max_bindings)
            at = graph.position(node)
            graph.nodes[at : at + 1] = parts
            result += parts
        else:
            result.append(node)
    return result


def _bindings_as_stored(node: Pointwise, stored_over: dict[int, int]) -> int:
    """The storage bindings of ``node``'s kernel: an input that one of its outputs is stored over shares that output's
    binding; the status buffer counts always (a writer binds it where the plan checks data)."""
    loaded = {ld.args[0] for e in node.exprs() for ld in E.loads_of(e)}
    shared = {stored_over[v.id] for v in node.outs if v.id in stored_over}
    return len(loaded - shared) + len(node.outs) + 1


def _parts_within(node: Pointwise, max_bindings: int) -> list[Pointwise]:
    """``node``'s outputs in order, as pointwise kernels of as many consecutive outputs as fit ``max_bindings`` with a
    binding of their own each (at least one output a kernel)."""
    parts, outs, exprs, loaded = [], [], [], set()
    for out, expr in zip(node.outs, [node.expr, *node.also]):
        loads = {ld.args[0] for ld in E.loads_of(expr)}
        if outs and len(loaded | loads) + len(outs) + 2 > max_bindings:
            parts.append(Pointwise(outs, expr=exprs[0], also=exprs[1:], label=node.label))
            outs, exprs, loaded = [], [], set()
        outs, exprs, loaded = [*outs, out], [*exprs, expr], loaded | loads
    parts.append(Pointwise(outs, expr=exprs[0], also=exprs[1:], label=node.label))
    return parts
