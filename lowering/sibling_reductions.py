"""Sibling reductions: row programs over the same domain and axes that do not read each other become one.

Backward graphs reduce several values over the same rows: BatchNorm's and LayerNorm's weight and bias gradients
are sum(dy * x_hat) and sum(dy) over the same axes, and BatchNorm's forward takes a mean and a variance of the same
input. Each is a Reduce node of its own after inlining; merged, one kernel walks the rows once with all the phases
(the later node's ``acc(i)`` renumbered after the earlier node's phases) and writes every result. The merged node
takes the later node's place (``siblings`` moves what depends on the earlier one and checks the binding limit).
"""
from __future__ import annotations

from . import expr as E
from .fusion import FusionReport
from .ir import Graph, Reduce
from .siblings import fuse_siblings


def fuse_sibling_reductions(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Merge each Reduce into the next one over the same domain and axes, where the rules allow."""
    fuse_siblings(graph, max_bindings, report, _key, _merge)


def _key(node) -> tuple | None:
    return (node.domain, node.axes) if isinstance(node, Reduce) and node.phases else None


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
