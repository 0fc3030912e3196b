"""Indexed loads: embedding, index_select, gather and advanced indexing (``x[idx]``).

Each is a pointwise expression whose load coordinate comes from another tensor. Indices are checked on
the device: an index out of range raises a clear error after the call instead of reading garbage.
"""
from __future__ import annotations

import torch

from meganeura.lowering import expr as E
from meganeura.lowering.builder import broadcast_shapes

from ..registry import lowering

aten = torch.ops.aten


def _checked(ctx, index: E.Expr, size, what: str, wrap_negative: bool) -> E.Expr:
    index = E.cast(index, E.I32)
    if wrap_negative:
        index = E.where(E.binary("lt", index, E.const(0, E.I32)), E.add(index, E.const(size, E.I32)), index)
    ok = E.binary("and", E.binary("ge", index, E.const(0, E.I32)), E.binary("lt", index, E.const(size, E.I32)))
    bound = size if isinstance(size, int) else "the dimension's size"  # (a dynamic graph's: one message for all)
    return ctx.b.check(index, ok, f"index out of range in {what}: indices must lie in [0, {bound})")


@lowering(aten.embedding.default)
def _embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    b = ctx.b
    rank = len(indices.shape)
    shape = indices.shape + weight.shape[1:]
    row = b.load(indices, [E.coord(d) for d in range(rank)])
    row = _checked(ctx, row, weight.shape[0], "embedding", wrap_negative=False)
    expr = b.load(weight, [row] + [E.coord(rank + d) for d in range(len(weight.shape) - 1)])
    return b.pointwise(shape, weight.dtype, expr, "embedding")


@lowering(aten.index_select.default)
def _index_select(ctx, x, dim, index):
    b = ctx.b
    dim %= max(len(x.shape), 1)
    shape = list(x.shape)
    if x.shape:
        shape[dim] = index.numel
    coords = [E.coord(d) for d in range(len(shape))]
    picked = b.load(index, [E.coord(dim)] if index.shape else [])
    if x.shape:
        coords[dim] = _checked(ctx, picked, x.shape[dim], "index_select", wrap_negative=False)
    return b.pointwise(shape, x.dtype, b.load(x, coords), "index_select")


@lowering(aten.gather.default)
def _gather(ctx, x, dim, index, sparse_grad=False):
    b = ctx.b
    rank = len(index.shape)
    dim %= max(rank, 1)
    coords = [E.coord(d) for d in range(rank)]
    picked = b.load(index, coords)
    if x.shape:
        coords = list(coords)
        coords[dim] = _checked(ctx, picked, x.shape[dim], "gather", wrap_negative=False)
    return b.pointwise(index.shape, x.dtype, b.load(x, coords), "gather")


def _no_bool_index(node) -> str | None:
    for i in node.args[1]:
        if i is not None and i.meta["val"].dtype == torch.bool:
            return "boolean mask indexing has a data-dependent output shape"
    return None


@lowering(aten.index.Tensor, supports=_no_bool_index)
def _index(ctx, x, indices):
    """x[i0, i1, ...] with some indices None (full slices); numpy's rules for where the new dims go."""
    b = ctx.b
    indices = list(indices) + [None] * (len(x.shape) - len(indices))
    positions = [d for d, i in enumerate(indices) if i is not None]
    idx_shape = broadcast_shapes(*[indices[d].shape for d in positions])
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    lead = positions[0] if adjacent else 0
    rest = [d for d in range(len(x.shape)) if indices[d] is None]
    before = [d for d in rest if d < lead] if adjacent else []
    after = [d for d in rest if d not in before]
    shape = [x.shape[d] for d in before] + list(idx_shape) + [x.shape[d] for d in after]
    k = len(idx_shape)
    coords = [None] * len(x.shape)
    for j, d in enumerate(before):
        coords[d] = E.coord(j)
    for j, d in enumerate(after):
        coords[d] = E.coord(len(before) + k + j)
    idx_coords_shape = tuple(range(len(before), len(before) + k))
    for d in positions:
        t = indices[d]
        off = k - len(t.shape)
        tc = [E.const(0, E.I32) if s == 1 and idx_shape[off + j] != 1 else E.coord(idx_coords_shape[off + j])
              for j, s in enumerate(t.shape)]
        value = b.load(t, tc)
        if t.dtype == "bool":
            raise NotImplementedError("boolean mask indexing has a data-dependent shape")
        coords[d] = _checked(ctx, value, x.shape[d], "index", wrap_negative=True)
    return b.pointwise(shape, x.dtype, b.load(x, coords), "index")
