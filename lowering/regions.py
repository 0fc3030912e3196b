"""Updates run over their regions: a pointwise update whose outputs are all stored over the inputs it updates
computes only the elements it changes.

A decode step writes one new key and value per head into each layer's static KV cache: HF's cache layer traced out
of place is an ``index_put`` whose pointwise kernel computes every element of the cache (``where(written, new,
old)``), and the plan stores it over the old cache (``in_place``). Its unchanged elements then cost a read and a
write each (SmolLM2 at 1,024 positions: 3 MB a layer and token) for nothing: the buffer holds them already. Such a
node carries the elements it changes (``ir.Region``, from the lowering: ``index_put``); where each of its outputs is
granted the buffer of its base, the node becomes a ``Scatter`` that runs over the region alone, one thread per new
element, storing it at its place (``kernels.pointwise.scattered_kernel``): a dispatch whose size follows the new
tokens, not the cache's length. The region's own lookups replace the full kernel's, and nodes nothing reads then are
dropped (an ``index_put``'s lookup of the entry landing on each position, where one entry needs none), and so are
checks that a node that stays makes too (where the region is refused, its own check of the targets).

Refused (the node keeps its pointwise kernel over the whole output, its region dropped): an output not stored over
its base (``in_place``: the input read again later, a value returned twice...), and a half
precision output whose region's elements do not come by pairs of one 32-bit word: half precisions are stored two
elements to a u32 word, and a thread storing one element would race with the thread storing its neighbour. A thread
then stores a pair of neighbouring elements along the region's last axis, which must be the output's last axis
itself (``at`` its own coordinate there, nothing else reading it), both of even length, so that each pair is one
whole word.
"""
from __future__ import annotations

from meganeura.kernels.sizes import is_size
from meganeura.runtime.dtypes import HALF_STORAGE, STORAGE

from . import expr as E
from .in_place import in_place_outputs
from .ir import Graph, Input, Pointwise, Scatter


def keep_requested_regions(graph: Graph) -> None:
    """Drop the regions of the nodes none of whose outputs the caller asks to store over an input (``Graph.in_place``):
    they would only cost the passes before ``run_over_regions`` work (a training step's slice scatters)."""
    requested = {graph.outputs[p].id for p in graph.in_place}
    for node in graph.nodes:
        if isinstance(node, Pointwise) and node.region is not None and not any(v.id in requested for v in node.outs):
            node.region = None


def run_over_regions(graph: Graph) -> dict[str, str]:
    """Make each pointwise update with a region a ``Scatter`` where the rules allow (the module docstring), drop the
    region of the others and the nodes that nothing reads then; returns {label#value: why not} of those refused."""
    kernels = [n for n in graph.nodes if not isinstance(n, Input)]
    granted, _ = in_place_outputs(graph, kernels)
    over = {graph.outputs[p].id: target.out.id for p, target in granted.items()}
    refused = {}
    for i, node in enumerate(graph.nodes):
        if not isinstance(node, Pointwise) or node.region is None:
            continue
        reason = region_refusal(node, over)
        if reason is None:
            graph.nodes[i] = Scatter(node.outs, region=node.region, label=node.label)
        else:
            refused[f"{node.label}#v{node.out.id}"] = reason
            node.region = None
    if any(isinstance(n, Scatter) for n in graph.nodes) or refused:
        _drop_unread(graph)
    return refused


def region_refusal(node: Pointwise, over: dict[int, int]) -> str | None:
    """Why ``node`` may not run over its region, or None; ``over``: output value id -> id of the input it is stored
    over."""
    region = node.region
    for v, base in zip(node.outs, region.bases):
        if over.get(v.id) != base:
            return "an output is not stored over the input it updates"
    if any(ld.args[0] in region.bases for e in region.exprs() for ld in E.loads_of(e)):
        return "the region reads an input it updates (another thread's element)"
    if STORAGE[node.out.dtype] in HALF_STORAGE:
        return _pair_refusal(node)
    return None


def _pair_refusal(node: Pointwise) -> str | None:
    """Why a thread of ``node``'s region kernel may not store a pair of neighbouring half precision elements as one
    whole u32 word of each output, or None."""
    region, last = node.region, len(node.region.shape) - 1
    if any(is_size(s) or s % 2 for s in (region.shape[-1], node.out.shape[-1])):
        return "half precision elements by pairs: a region or output of an odd or symbolic last axis"
    if region.at[-1] != E.coord(last):
        return "half precision elements by pairs: the region's last axis is not the output's"
    if any(n.op == "coord" and n.args[0] == last for e in (*region.at[:-1], region.keep) for n in E.walk(e)):
        return "half precision elements by pairs: where the region lands depends on its last coordinate"
    return None


def _drop_unread(graph: Graph) -> None:
    """Drop the nodes whose values nothing reads and no output is, the latest first; one that checks data only where
    a node that stays makes each of its checks too (``_check_key``: an index_put's look-up table checks the indices
    that its region, run in its place, checks itself). Each node's checks are keyed once, and the nodes making each
    key kept by key: compared node by node, the checks of every other node were walked again for each check of
    each candidate (SmolLM2's static cache prefill: 2 minutes of a cold generate's 3 on the CPU machine)."""
    outputs = {v.id for v in graph.outputs}
    nodes = list(graph.nodes)  # (alive while their ids key ``keys``)
    keys = {id(n): [_check_key(check) for check in _checks_of(n)] for n in nodes}
    makers: dict[tuple, set[int]] = {}  # check key -> ids of the nodes that make it
    for node in nodes:
        for key in filter(None, keys[id(node)]):
            makers.setdefault(key, set()).add(id(node))
    dropped = True
    while dropped:
        dropped = False
        read = {ld.args[0] for n in graph.nodes for e in n.exprs() for ld in E.loads_of(e)}
        for node in reversed(graph.nodes):
            if isinstance(node, Input) or any(v.id in read or v.id in outputs for v in node.outs):
                continue
            mine = keys[id(node)]
            if all(key is not None and makers[key] - {id(node)} for key in mine):
                graph.remove(node)
                for key in mine:
                    makers[key].discard(id(node))
                dropped = True
                break


def _checks_of(node) -> list[tuple]:
    """(status code, condition, domain) of each check ``node``'s expressions make."""
    return [(n.args[2], n.args[1], domain) for e, domain in zip(node.exprs(), node.domains())
            for n in E.walk(e) if n.op == "check"]


def _check_key(check: tuple) -> tuple | None:
    """What two nodes' checks share where both make the same one: the same code, and the same condition over the same
    values of the coordinate it reads (at most one, of equal extents, renamed: to coordinate 0 here). None for a
    condition over several coordinates, which no other check stands for."""
    code, condition, domain = check
    mine = _coords(condition)
    if not mine:
        return code, None, condition
    if len(mine) > 1:
        return None
    return code, domain[mine[0]], E.shift_coords(condition, {mine[0]: E.coord(0)})


def _coords(e: E.Expr) -> list[int]:
    return sorted({n.args[0] for n in E.walk(e) if n.op == "coord"})
