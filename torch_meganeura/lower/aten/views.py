"""View and layout ops: they change index math only and fold into their consumers (no copies).

cat and constant_pad_nd are selects between such loads (and a constant), still one pointwise expression."""
from __future__ import annotations

import torch

from meganeura.lowering import expr as E

from ..registry import lowering

aten = torch.ops.aten


@lowering(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(ctx, x, shape):
    return ctx.b.reshape(x, shape)


@lowering(aten.permute.default)
def _permute(ctx, x, dims):
    return ctx.b.permute(x, dims)


@lowering(aten.transpose.int)
def _transpose(ctx, x, d0, d1):
    rank = len(x.shape)
    if rank == 0:
        return x
    dims = list(range(rank))
    dims[d0 % rank], dims[d1 % rank] = dims[d1 % rank], dims[d0 % rank]
    return ctx.b.permute(x, dims)


@lowering(aten.t.default)
def _t(ctx, x):
    return ctx.b.permute(x, [1, 0]) if len(x.shape) == 2 else x


@lowering(aten.expand.default)
def _expand(ctx, x, shape, implicit=False):
    return ctx.b.expand(x, shape)


@lowering(aten.unsqueeze.default)
def _unsqueeze(ctx, x, dim):
    return ctx.b.unsqueeze(x, dim)


@lowering(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(ctx, x, dims=None):
    rank = len(x.shape)
    if dims is None:
        dims = range(rank)
    elif isinstance(dims, int):
        dims = [dims]
    drop = {d % rank for d in dims if rank and x.shape[d % rank] == 1}
    return ctx.b.reshape(x, [s for d, s in enumerate(x.shape) if d not in drop])


@lowering(aten.slice.Tensor)
def _slice(ctx, x, dim=0, start=None, end=None, step=1):
    size = x.shape[dim]
    start = 0 if start is None else start
    end = size if end is None else end
    return ctx.b.slice(x, dim, start, end, step)


@lowering(aten.select.int)
def _select(ctx, x, dim, index):
    return ctx.b.select(x, dim, index)


@lowering(aten.diagonal.default)
def _diagonal(ctx, x, offset=0, dim1=0, dim2=1):
    """The other dims in order, then the diagonal, whose element i is x[..., i + max(-offset, 0), ...,
    i + max(offset, 0), ...] (at dim1 and dim2)."""
    rank = len(x.shape)
    d1, d2 = dim1 % rank, dim2 % rank
    rest = [d for d in range(rank) if d not in (d1, d2)]
    length = max(0, min(x.shape[d1] + min(offset, 0), x.shape[d2] - max(offset, 0)))
    coords = [None] * rank
    for k, d in enumerate(rest):
        coords[d] = E.coord(k)
    i = E.coord(len(rest))
    coords[d1] = E.add(i, E.const(max(-offset, 0), E.I32))
    coords[d2] = E.add(i, E.const(max(offset, 0), E.I32))
    return ctx.b.view(x, [x.shape[d] for d in rest] + [length], coords, "diagonal")


@lowering(aten.unfold.default)
def _unfold(ctx, x, dim, size, step):
    """Windows of ``size`` every ``step`` along ``dim`` (which becomes the window count), a new last dim inside
    each window: x[..., w * step + k, ...]."""
    rank = len(x.shape)
    if rank == 0:  # one window of size 1, or an empty one
        return ctx.b.reshape(x, [1]) if size else ctx.b.full((0,), 0, x.dtype)
    dim %= rank
    shape = list(x.shape) + [size]
    shape[dim] = (x.shape[dim] - size) // step + 1
    coords = [E.coord(d) for d in range(rank)]
    coords[dim] = E.add(E.mul(E.coord(dim), E.const(step, E.I32)), E.coord(rank))
    return ctx.b.view(x, shape, coords, "unfold")


@lowering(aten.split_with_sizes.default, aten.split.Tensor)
def _split(ctx, x, sizes, dim=0):
    total = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, total - s) for s in range(0, total, sizes)] or [0]
    out, start = [], 0
    for s in sizes:
        out.append(ctx.b.slice(x, dim, start, start + s))
        start += s
    return out


@lowering(aten.cat.default)
def _cat(ctx, tensors, dim=0):
    out = ctx.out_dtype
    same = [t if t.dtype == out else ctx.b.map(lambda a: a, t, dtype=out, compute="keep") for t in tensors]
    return ctx.b.cat(same, dim)


@lowering(aten.unbind.int)
def _unbind(ctx, x, dim=0):
    return [ctx.b.select(x, dim, i) for i in range(x.shape[dim])]


@lowering(aten.constant_pad_nd.default)
def _constant_pad_nd(ctx, x, pad, value=0):
    """Pad (or, for negative pads, crop) the last len(pad)//2 dims: one select between x and ``value``."""
    b, rank = ctx.b, len(x.shape)
    fill = E.const(value, x.compute_dtype)
    shape, coords, inside = list(x.shape), [E.coord(d) for d in range(rank)], []
    for i in range(len(pad) // 2):
        d, lo, hi = rank - 1 - i, pad[2 * i], pad[2 * i + 1]
        shape[d] = x.shape[d] + lo + hi
        src = E.binary("sub", E.coord(d), E.const(lo, E.I32))
        if lo > 0:  # a select evaluates both sides: the load coordinate must stay in range
            inside.append(E.binary("ge", src, E.const(0, E.I32)))
            src = E.binary("maximum", src, E.const(0, E.I32))
        if hi > 0:
            inside.append(E.binary("lt", src, E.const(x.shape[d], E.I32)))
            src = E.binary("minimum", src, E.const(x.shape[d] - 1, E.I32))
        coords[d] = src
    if x.numel == 0 or 0 in shape:
        return b.full(shape, value, x.dtype)
    expr = b.load(x, coords)
    for cond in inside:
        expr = E.where(cond, expr, fill)
    return b.pointwise(shape, x.dtype, expr, "constant_pad_nd")


@lowering(aten.flip.default)
def _flip(ctx, x, dims):
    rank = len(x.shape)
    flipped = {d % rank for d in dims} if rank else set()
    coords = [E.binary("sub", E.const(x.shape[d] - 1, E.I32), E.coord(d)) if d in flipped else E.coord(d)
              for d in range(rank)]
    return ctx.b.view(x, x.shape, coords, "flip")


@lowering(aten.repeat.default)
def _repeat(ctx, x, repeats):
    lead = len(repeats) - len(x.shape)
    shape = [r * (x.shape[d - lead] if d >= lead else 1) for d, r in enumerate(repeats)]
    coords = [E.binary("imod", E.coord(lead + d), E.const(s, E.I32)) for d, s in enumerate(x.shape)]
    return ctx.b.view(x, shape, coords, "repeat")
