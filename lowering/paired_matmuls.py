"""Paired matmuls: a matrix-vector product whose epilogue reads another product of the same vector, at its own
element, computes both in one kernel.

A gated MLP multiplies the normalised hidden state by its gate and its up weights and combines the two
element by element: silu(x @ gate) * (x @ up) (Llama, Qwen2, Phi-3), gelu(x @ gate) * (x @ up) (Gemma). After
epilogue fusion the second product's epilogue reads the first one's output, so the two cannot be siblings (one
depends on the other). With one row (the matrix-vector kernel: a decode step), the reader takes the first
product's B as a further product (``Matmul.products``): each lane loads the vector once and sums it against both
matrices, and the first product's epilogue moves into the reader's, reading its sum as acc(k). One dispatch and
one store and load of the first product fewer. The first product must be read by nothing else, share A (and any
row prologue) and the output extents, and the merged kernel must stay within the storage-binding limit.
"""
from __future__ import annotations

from . import expr as E
from .bindings import checks
from .fusion import FusionReport, _name
from .indexing import linear_index, simplify
from .ir import Graph, Matmul


def fuse_paired_matmuls(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Merge each single-row product read only by another one's epilogue, at the reader's own elements, into it."""
    outputs = {v.id for v in graph.outputs}
    merged = True
    while merged:
        merged = False
        users, producers = graph.users(), graph.producers()
        for reader in [n for n in graph.nodes if is_single_row(n)]:
            for vid in dict.fromkeys(ld.args[0] for ld in E.loads_of(reader.epilogue)):
                first = producers.get(vid)
                if not _may_pair(reader, first):
                    continue
                reason = _refusal(reader, first, vid, users, outputs, max_bindings)
                if reason is not None:
                    report.refused.append((_name(first), _name(reader), reason))
                    continue
                _merge(graph, reader, first, vid)
                report.fused.append((_name(first), _name(reader)))
                merged = True
                break
            if merged:
                break


def is_single_row(node) -> bool:
    """A matmul the matrix-vector kernel computes over columns: one row of one batch (``kernels.matmul``'s gemv)."""
    return isinstance(node, Matmul) and node.m == 1 and node.block_axis == "j"


def gemv_bindings(exprs, outs, dropped: set[int]) -> int:
    """Storage bindings of a matrix-vector kernel over ``exprs`` writing ``outs``, ``dropped`` values no longer read:
    those it reads and writes, and the status buffer where it checks something. Exact, with no spare for the scratch
    of K slices that the fusion passes keep elsewhere (``bindings``): the gemv kernel is never cut into slices."""
    loaded = {ld.args[0] for e in exprs for ld in E.loads_of(e)} - dropped
    return len(loaded | {v.id for v in outs}) + checks(exprs)


def _may_pair(reader: Matmul, first) -> bool:
    """Whether ``first`` is a product of ``reader``'s vector with the same output extents (the rest is checked and
    a refusal recorded)."""
    return (is_single_row(first) and first is not reader and not first.products and not first.more_blocks
            and not reader.more_blocks and (first.batch, first.n, first.k) == (reader.batch, reader.n, reader.k)
            and first.a == reader.a and first.row_phases == reader.row_phases)


def _refusal(reader: Matmul, first: Matmul, vid: int, users, outputs, max_bindings: int) -> str | None:
    if vid in outputs or [id(u) for u in users.get(vid, [])] != [id(reader)]:
        return "the product has other readers"
    domain = (reader.batch, reader.m, reader.n)
    bounds = dict(enumerate(domain))
    here = simplify(linear_index([E.coord(d) for d in range(3)], domain), bounds)
    if any(simplify(linear_index(ld.args[1], first.out.shape), bounds) != here
           for ld in E.loads_of(reader.epilogue) if ld.args[0] == vid):
        return "the reader reads the product at other elements"
    if gemv_bindings((*reader.exprs(), first.b, first.epilogue), reader.outs, {vid}) > max_bindings:
        return f"more than {max_bindings} storage bindings"
    return None


def _merge(graph: Graph, reader: Matmul, first: Matmul, vid: int) -> None:
    """``first``'s B becomes a further product of ``reader``, its epilogue (reading that product's sum) inlined
    where ``reader`` loaded its output."""
    index = 1 + len(reader.products)
    moved = E.substitute(first.epilogue, lambda n: E.acc(index, n.dtype) if n.op == "acc" and n.args[0] == 0 else None)
    reader.products.append(first.b)
    reader.epilogue = simplify(E.substitute(reader.epilogue, lambda n: moved if n.op == "load" and n.args[0] == vid
                                            else None), dict(enumerate((reader.batch, reader.m, reader.n))))
    reader.label = "+".join(dict.fromkeys(first.label.split("+") + reader.label.split("+")))
    graph.remove(first)
