"""Merging sibling nodes: two nodes of one archetype that do the same walk over the same data and do not read each
other become one node, placed where the later one was.

``fuse_siblings`` walks the graph and offers each node to the latest earlier node with the same key; a pass gives
the key (None: not a candidate; a list: several, the node offered to the latest earlier one of each in turn) and the
merge, and may refuse a pair for a reason of its own. The nodes between the two that depend on the earlier one move
to just after the merged node; the later node may not depend on them, and the merged kernel must stay within the
binding limit. Every refusal is recorded with its reason. ``sibling_reductions``, ``sibling_matmuls``,
``sibling_updates`` and ``sibling_pointwise`` use it; the last two merge pointwise nodes with ``merge_pointwise``.
"""
from __future__ import annotations

from typing import Callable

from . import expr as E
from .bindings import checks
from .fusion import FusionReport, _name
from .ir import Graph, Input, Node, Pointwise, Region

# Siblings are not merged where the merge would keep more than KEEP_ALIVE_BYTES of the first one's operands alive
# across more than KEEP_ALIVE_ACROSS other kernels (in the arena, where the planner could not reuse them). Full-size
# Whisper-tiny's bias gradient reductions of different layers kept each layer's 1500x1536 and 1500x384 gradients
# (2.2-9.2 MB each, 9 to 46 kernels apart) until the last layer's: refused, its backward's arena 141.6 -> 69.1 MiB
# for 28 more dispatches (161 -> 189). ResNet-50's BatchNorm reductions, one kernel apart, and SD U-Net's
# reductions, which keep 1 MiB or less, merge as before (refusing those cost SD U-Net's backward 184 dispatches for
# 7.6 MiB of arena).
KEEP_ALIVE_ACROSS = 2
KEEP_ALIVE_BYTES = 2 << 20


def fuse_siblings(graph: Graph, max_bindings: int, report: FusionReport, key_of: Callable[[Node], object],
                  merge: Callable[[Node, Node], None],
                  bindings: Callable[[Node, Node, set], int] | None = None,
                  refusal: Callable[[Node, Node], str | None] | None = None) -> None:
    """Merge each node into the next one with the same ``key_of`` (a key, None, or a list of keys: the latest earlier
    node of each tried in the list's order), where the rules allow; ``merge(earlier, later)`` makes ``later`` compute
    both. ``bindings(earlier, later, loaded)`` counts the merged kernel's storage bindings (``loaded``: the values the
    two read), by default each value read or written once, the status buffer where an expression checks something
    and, but for a pointwise kernel (never cut into slices), one spare for partial results (``bindings``).
    ``refusal(earlier, later)`` gives the pass's own reason to keep a pair apart, or None."""
    loads = {id(n): {ld.args[0] for e in n.exprs() for ld in E.loads_of(e)} for n in graph.nodes}
    refused: set[tuple[int, int]] = set()
    merged = True
    while merged:  # a merge reorders nodes: walk again from the start
        merged = False
        latest: dict = {}  # key -> (position, the latest node a later one may join)
        for position, node in enumerate(graph.nodes):
            earlier_ones = {}  # (the earlier nodes in the order of their keys)
            for key in _keys(key_of(node)):
                if key in latest:
                    earlier_ones.setdefault(id(latest[key][1]), latest[key])
                latest[key] = (position, node)
            for start, earlier in earlier_ones.values():
                if (id(earlier), id(node)) in refused:
                    continue
                reason = (refusal and refusal(earlier, node)) or _place(
                    graph, (start, position), loads, max_bindings, bindings or merged_bindings)
                if reason is not None:
                    refused.add((id(earlier), id(node)))
                    report.refused.append((_name(earlier), _name(node), reason))
                    continue
                merge(earlier, node)
                report.fused.append((_name(earlier), _name(node)))
                merged = True
                break
            if merged:
                break


def _keys(key) -> list:
    """A pass's ``key_of`` answer as a list of keys."""
    return [] if key is None else key if isinstance(key, list) else [key]


def merge_pointwise(earlier: Pointwise, later: Pointwise) -> None:
    """``later`` stores ``earlier``'s outputs first, then its own, at the same linear index: ``later``'s expressions
    and ``earlier``'s are over the same coordinates (one output shape). Updates over regions must change the same
    elements (``sibling_updates``), and each output of the merged node changes them."""
    later.outs = list(earlier.outs) + list(later.outs)
    later.expr, later.also = earlier.expr, [*earlier.also, later.expr, *later.also]
    if later.region is not None:
        first, second = earlier.region, later.region
        later.region = Region(second.shape, second.at, second.keep, [*first.values, *second.values],
                              [*first.bases, *second.bases])
    later.label = "+".join(dict.fromkeys(earlier.label.split("+") + later.label.split("+")))


def _kept_alive(graph: Graph, end: int, read: set, loads) -> dict[int, int]:
    """{value id: arena bytes} of the intermediates among ``read`` (the earlier node's) that neither the later node,
    at ``end``, nor any node after it reads: the merged node, in the later one's place, would keep them alive until
    there. Inputs and outputs have buffers of their own."""
    own = {v.id for v in graph.outputs} | {n.out.id for n in graph.nodes if isinstance(n, Input)}
    ended = set(read) - own
    for n in graph.nodes[end:]:
        ended -= loads[id(n)]
    return {v.id: 4 * v.numel for n in graph.nodes for v in n.outs if v.id in ended}


def merged_bindings(earlier: Node, later: Node, loaded: set) -> int:
    """``fuse_siblings``' default count of the merged kernel's storage bindings."""
    status = checks([*earlier.exprs(), *later.exprs()])
    spare = not isinstance(later, Pointwise)
    return len(loaded) + len(earlier.outs) + len(later.outs) + spare + status


def _place(graph: Graph, positions: tuple[int, int], loads, max_bindings, bindings) -> str | None:
    """Remove the earlier of the nodes at ``positions`` and move the nodes between the two that depend on it to after
    the later one; None when done, else why the two cannot merge."""
    nodes = graph.nodes
    start, end = positions
    earlier, later = nodes[start], nodes[end]
    tainted = {v.id for v in earlier.outs}
    dependent = set()
    for n in nodes[start + 1 : end]:
        if loads[id(n)] & tainted:
            dependent.add(id(n))
            tainted |= {v.id for v in n.outs}
    if loads[id(later)] & tainted:
        return "the second reads a result of the first"
    across = end - start - 1 - len(dependent)
    if across > KEEP_ALIVE_ACROSS:  # (the bytes kept alive are summed only where they may refuse the merge)
        kept = sum(_kept_alive(graph, end, loads[id(earlier)], loads).values())
        if kept > KEEP_ALIVE_BYTES:
            return f"it would keep {kept} bytes that the first reads last in memory across {across} other kernels"
    if bindings(earlier, later, loads[id(earlier)] | loads[id(later)]) > max_bindings:
        return f"more than {max_bindings} storage bindings"
    between = nodes[start + 1 : end]
    graph.nodes = (nodes[:start] + [n for n in between if id(n) not in dependent] + [later]
                   + [n for n in between if id(n) in dependent] + nodes[end + 1 :])
    loads[id(later)] |= loads.pop(id(earlier))
    return None
