"""Storage bindings of a kernel, and passes that keep every kernel within the adapter's limit of them.

A kernel binds each value it reads or writes (several outputs of one node laid side by side once: ``packed``), the
status buffer where an expression checks something, and the scratch of partial results where it is cut into slices;
the scheduler cuts a kernel into slices only where a binding is left for that scratch, and the fusion passes keep one
spare for it. WebGPU's default limit is 8 storage buffers per shader stage; ``fit_bindings`` (before fusion) brings
the nodes that lowering made wider within it, and does nothing on an adapter with room for them (its plans stay as
they were):

- a pointwise node reading more values (a concatenation of many tensors) computes a part of its expression, the
  widest that fits, as a node of its own first, until it fits;
- an attention gradient pass reads q, k, v, the bias, dout and two values per query row (lse and delta) and writes
  one or two gradients (grad_kv with a bias binds 9 values, without one 8, leaving none for slices): where it has
  no binding to spare, it reads lse and delta from one value of shape (batch, heads, lq, 2), stored side by side by
  a small pointwise node before it.

Fusion does not inline such a part back: that would take the bindings again.
"""
from __future__ import annotations

import itertools

from . import expr as E
from .ir import Attention, Graph, Node, Pointwise, Scatter, Value, kernel_forms
from .packed import binding_count

_LOGICAL = {E.F32: "float32", E.I32: "int32", E.BOOL: "bool"}  # a part's value type from its expression's


def checks(exprs) -> bool:
    """Whether any of ``exprs`` checks something (its kernel then binds the status buffer)."""
    return any(E.has_check(e) for e in exprs)


def kernel_bindings(node: Node, grouped: dict | None = None) -> int:
    """Storage bindings of ``node``'s kernel before any scratch: the values it reads and writes, and the status
    buffer where an expression checks something (of its largest form: ``ir.kernel_forms``). An attention pass that
    stores an update over the inputs it reads (``Attention.writes``: a ``Scatter``) reads them through its outputs'
    bindings, and binds the status buffer (where the plan checks data, it stores only while no check failed).
    ``grouped``: outputs that lie side by side (``packed.groups``), several of which one binding reads."""
    outs = {v.id for v in node.outs}
    writes = getattr(node, "writes", None)
    shared = set(writes.region.bases) if isinstance(writes, Scatter) else set()
    return max(binding_count({ld.args[0] for e in form for ld in E.loads_of(e)} - shared - outs, grouped or {})
               + len(outs) + (checks(form) or bool(shared)) for form in kernel_forms(node))


def fit_bindings(graph: Graph, max_bindings: int) -> int:
    """Bring the nodes over ``max_bindings`` bindings within it (an attention pass with one to spare for the scratch
    of slices), as the module docstring says; returns how many nodes were added."""
    ids = itertools.count(1 + max((v.id for n in graph.nodes for v in n.outs), default=0))
    nodes = []
    for node in graph.nodes:
        if isinstance(node, Pointwise) and kernel_bindings(node) > max_bindings:
            nodes += _split_pointwise(node, max_bindings, ids)
        elif (isinstance(node, Attention) and node.lse is not None and node.delta is not None
              and kernel_bindings(node) >= max_bindings):
            nodes.append(_pack_rows(node, next(ids)))
        nodes.append(node)
    added = len(nodes) - len(graph.nodes)
    graph.nodes = nodes
    return added


def _split_pointwise(node: Pointwise, max_bindings: int, ids) -> list[Pointwise]:
    """Nodes that compute parts of ``node``'s expressions (each within ``max_bindings``), ``node`` then loading them,
    until ``node`` too is within it or no part of two or more values fits."""
    parts = []
    node.region = None  # (its expressions are over other coordinates than the parts': the node runs whole)
    while kernel_bindings(node) > max_bindings:
        part = _widest_part(node.exprs(), max_bindings)
        if part is None:
            break
        value = Value(next(ids), node.out.shape, _LOGICAL[part.dtype])
        parts.append(Pointwise([value], expr=part, label=f"{node.label or 'pointwise'} (part)"))
        whole = E.load(value.id, tuple(E.coord(d) for d in range(len(value.shape))), part.dtype)
        node.set_exprs([E.substitute(e, lambda n: whole if n == part else None) for e in node.exprs()])
    return parts


def _widest_part(exprs: list[E.Expr], max_bindings: int) -> E.Expr | None:
    """The subexpression of ``exprs`` that loads the most values, at least 2, while its own node (those values, its
    output, and the status buffer if it checks something) stays within ``max_bindings``."""
    best, most = None, 1
    for e in exprs:
        for n in E.walk(e):
            loaded = len({ld.args[0] for ld in E.loads_of(n)})
            if most < loaded <= max_bindings - 1 - checks([n]) and n is not e:
                best, most = n, loaded
    return best


def _pack_rows(node: Attention, value_id: int) -> Pointwise:
    """The node storing ``node``'s lse and delta side by side in one value, which ``node`` then reads."""
    rows = Value(value_id, (node.batch, node.heads, node.lq, 2), "float32")
    first = E.binary("eq", E.coord(3), E.const(0, E.I32))
    packing = Pointwise([rows], expr=E.where(first, node.lse, node.delta), label="attention_rows")
    coords = [E.coord(0), E.coord(1), E.coord(2)]
    node.lse = E.load(rows.id, (*coords, E.const(0, E.I32)), E.F32)
    node.delta = E.load(rows.id, (*coords, E.const(1, E.I32)), E.F32)
    return packing
