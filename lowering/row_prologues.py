"""Row prologues: a one-row normalisation moves into the matrix-vector products that read it.

A pre-norm transformer normalises the hidden state before each projection: RMS norm (Llama, Qwen2, Gemma, Phi-3)
``x * rsqrt(mean(x^2) + eps) * w``, layer norm (GPT-2) the same with a mean taken out first. After epilogue fusion
that is a Reduce node whose one result is the normalised row, element by element. With one row (a decode step) and
only single-row matmuls reading it, each as its vector A at the element it multiplies (p), the reduction's phases
become the matmul's row prologue (``Matmul.row_phases``): every workgroup of the matrix-vector kernel sums the
row's statistics over K itself (a row the dot products read anyway), then A reads the normalised element. The
norm's dispatch, and its store and load of the row, go.

Refused, with the reason recorded: a reduction with other results (or a graph output), with phases other than sums,
over more than one row, or read by anything but single-row matmuls' A at p; a matmul with a prologue already, or
whose merged kernel would pass the storage-binding limit (WebGPU's default of 8, a portable bundle's, holds a
merged query, key and value projection's three outputs and weights with the norm's input and weight, but not the
status buffer too: the first layer's norm, which checks the token ids of the embedding it reads, stays apart).
"""
from __future__ import annotations

from . import expr as E
from .builder import unravel
from .fusion import FusionReport, _name
from .indexing import linear_index, simplify
from .ir import Graph, Matmul, Reduce, numel
from .paired_matmuls import gemv_bindings, is_single_row

PROLOGUE_OPS = ("sum",)  # the gemv kernel's prologue sums: a tree over the workgroup, like its dot products


def fuse_row_prologues(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Move each one-row normalisation that only single-row matmuls read into their prologues."""
    outputs = {v.id for v in graph.outputs}
    users = graph.users()
    for norm in [n for n in graph.nodes if isinstance(n, Reduce)]:
        if len(norm.results) != 1 or not norm.results[0].per_element or norm.out.id in outputs:
            continue
        readers = users.get(norm.out.id, [])
        reason = _refusal(norm, readers, max_bindings)
        if reason is not None:
            report.refused.extend((_name(norm), _name(r), reason) for r in readers)
            continue
        for reader in readers:
            _move(norm, reader)
            report.fused.append((_name(norm), _name(reader)))
        graph.remove(norm)


def _refusal(norm: Reduce, readers: list, max_bindings: int) -> str | None:
    if any(op not in PROLOGUE_OPS for op, _ in norm.phases):
        return "a reduction other than a sum"
    if numel(norm.row_shape) != 1:
        return "more than one row"
    for reader in readers:
        if not is_single_row(reader) or reader.batch != 1 or reader.k != norm.row_length:
            return "read by other than a one-row matmul over the row"
        if reader.row_phases:
            return "the matmul has a prologue already"
        vid = norm.out.id
        if any(ld.args[0] == vid for e in reader.exprs()[1:] for ld in E.loads_of(e)):
            return "read by the matmul other than as its vector"
        bounds = dict(enumerate(reader.domains()[0]))
        if any(simplify(linear_index(ld.args[1], norm.out.shape), bounds) != E.coord(2)
               for ld in E.loads_of(reader.a) if ld.args[0] == vid):
            return "read at other elements than the product's"
        exprs = (*reader.exprs(), *norm.exprs())
        if gemv_bindings(exprs, reader.outs, {vid}) > max_bindings:
            return f"more than {max_bindings} storage bindings"
    return None


def _move(norm: Reduce, reader: Matmul) -> None:
    """``norm``'s phases become ``reader``'s row prologue and its result what A reads: with one row, the element
    at p of the row is the reduction's element at linear index p."""
    bounds = dict(enumerate(reader.domains()[0]))
    at_p = dict(enumerate(unravel(E.coord(2), norm.domain)))
    reader.row_phases = [simplify(E.shift_coords(e, at_p), bounds) for _, e in norm.phases]
    element = simplify(E.shift_coords(norm.results[0].expr, at_p), bounds)
    reader.a = simplify(E.substitute(reader.a, lambda n: element if n.op == "load" and n.args[0] == norm.out.id
                                     else None), bounds)
