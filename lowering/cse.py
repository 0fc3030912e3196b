"""Common kernels: a node that computes exactly what an earlier node computes is dropped, and its readers read the
earlier node's outputs instead.

Two nodes are the same computation when they are of one archetype with equal fields and expressions (loads of the
same values at the same coordinates) and outputs of the same shapes and dtypes; labels do not count. A node with a
graph output is kept (outputs are named by position before compiling, and resident outputs own their buffers), but
what it reads is rewired like any other node's. The pass runs after fusion, on whole kernels: before it, a repeated
cheap producer inlines into each of its consumers, where one shared copy would have to be stored. Traced training
steps repeat work (SmolLM2's resident step: 28 of 2,285 dispatches). Nodes are visited in order, each with the
earlier replacements applied, so a chain of repeated nodes collapses whole.
"""
from __future__ import annotations

import dataclasses

from . import expr as E
from .ir import Graph, Input

UNCOUNTED_FIELDS = ("outs", "label")


def eliminate_common_nodes(graph: Graph) -> int:
    """Drop each node that repeats an earlier one and has no graph output, rewiring its readers; the number dropped."""
    first: dict[tuple, object] = {}
    renamed: dict[int, int] = {}  # value id of a dropped node's output -> the earlier node's output
    outputs = {v.id for v in graph.outputs}
    kept = []
    for node in graph.nodes:
        if any(ld.args[0] in renamed for e in node.exprs() for ld in E.loads_of(e)):
            node.set_exprs([_rename(e, renamed) for e in node.exprs()])
        if isinstance(node, Input):
            kept.append(node)
            continue
        twin = first.setdefault(_key(node), node)
        if twin is node or any(v.id in outputs for v in node.outs):
            kept.append(node)
        else:
            renamed.update({mine.id: theirs.id for mine, theirs in zip(node.outs, twin.outs)})
    dropped = len(graph.nodes) - len(kept)
    graph.nodes = kept
    return dropped


def _rename(e: E.Expr, renamed: dict[int, int]) -> E.Expr:
    def rewrite(n: E.Expr):
        if n.op == "load" and n.args[0] in renamed:
            return E.load(renamed[n.args[0]], n.args[1], n.dtype)
        return None

    return E.substitute(e, rewrite)


def _key(node) -> tuple:
    fields = tuple((f.name, _frozen(getattr(node, f.name))) for f in dataclasses.fields(node)
                   if f.name not in UNCOUNTED_FIELDS)
    return (type(node), fields, tuple((v.shape, v.dtype) for v in node.outs))


def _frozen(x):
    """``x`` as a hashable value: lists become tuples and dataclass instances their type and fields."""
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(y) for y in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in x.items()))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x), tuple(_frozen(getattr(x, f.name)) for f in dataclasses.fields(x)))
    return x
