"""Sibling reductions: row programs over the same domain and axes that do not read each other become one.

Backward graphs reduce several values over the same rows: BatchNorm's and LayerNorm's weight and bias gradients
are sum(dy * x_hat) and sum(dy) over the same axes, and BatchNorm's forward takes a mean and a variance of the same
input. Each is a Reduce node of its own after inlining; merged, one kernel walks the rows once with all the phases
(the later node's ``acc(i)`` renumbered after the earlier node's phases) and writes every result. The merged node
takes the later node's place, and the nodes between the two that depend on the earlier one's results move to just
after it; the later node may not depend on them, and the kernel must stay within the binding limit. Every refusal
is recorded with its reason.
"""
from __future__ import annotations

from . import expr as E
from .fusion import FusionReport, _name
from .ir import Graph, Reduce


def fuse_sibling_reductions(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Merge each Reduce into the next one over the same domain and axes, where the rules allow."""
    loads = {id(n): {ld.args[0] for e in n.exprs() for ld in E.loads_of(e)} for n in graph.nodes}
    refused: set[tuple[int, int]] = set()
    merged = True
    while merged:  # a merge reorders nodes: walk again from the start
        merged = False
        latest: dict[tuple, Reduce] = {}  # (domain, axes) -> the latest reduction a later one may join
        for node in graph.nodes:
            if not isinstance(node, Reduce) or not node.phases:
                continue
            key = (node.domain, node.axes)
            earlier, latest[key] = latest.get(key), node
            if earlier is None or (id(earlier), id(node)) in refused:
                continue
            reason = _merge_into(graph, earlier, node, loads, max_bindings)
            if reason is not None:
                refused.add((id(earlier), id(node)))
                report.refused.append((_name(earlier), _name(node), reason))
                continue
            report.fused.append((_name(earlier), _name(node)))
            merged = True
            break


def _merge_into(graph: Graph, earlier: Reduce, later: Reduce, loads, max_bindings) -> str | None:
    """Merge ``earlier`` into ``later``, moving the nodes between them that depend on ``earlier`` to after the
    merged node; None when done, else why not."""
    nodes = graph.nodes
    start, end = nodes.index(earlier), nodes.index(later)
    tainted = {v.id for v in earlier.outs}
    dependent = set()
    for n in nodes[start + 1 : end]:
        if loads[id(n)] & tainted:
            dependent.add(id(n))
            tainted |= {v.id for v in n.outs}
    if loads[id(later)] & tainted:
        return "the second reads a result of the first"
    if len(loads[id(earlier)] | loads[id(later)]) + len(earlier.outs) + len(later.outs) + 2 > max_bindings:
        return f"more than {max_bindings} storage bindings"
    between = nodes[start + 1 : end]
    graph.nodes = (nodes[:start] + [n for n in between if id(n) not in dependent] + [later]
                   + [n for n in between if id(n) in dependent] + nodes[end + 1 :])
    _merge(earlier, later)
    loads[id(later)] |= loads.pop(id(earlier))
    return None


def _merge(earlier: Reduce, later: Reduce) -> None:
    """``later`` takes ``earlier``'s phases first, then those of its own that ``earlier`` does not already compute
    (BatchNorm's mean before its variance), and all the results."""
    phases = list(earlier.phases)
    index: dict[int, int] = {}  # later's phase -> its phase in the merged node

    def renumber(e: E.Expr) -> E.Expr:
        return E.substitute(e, lambda n: E.acc(index[n.args[0]], n.dtype) if n.op == "acc" else None)

    for i, (op, e) in enumerate(later.phases):
        phase = (op, renumber(e))
        if phase not in phases:
            phases.append(phase)
        index[i] = phases.index(phase)
    later.phases = phases
    later.results = list(earlier.results) + [type(r)(r.per_element, renumber(r.expr)) for r in later.results]
    later.outs = list(earlier.outs) + list(later.outs)
    later.label = "+".join(dict.fromkeys(earlier.label.split("+") + later.label.split("+")))
