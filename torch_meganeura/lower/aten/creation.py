"""Tensor factories: full, scalar_tensor, arange, the empty family (zero-filled: torch leaves it uninitialised)."""
from __future__ import annotations

import torch

from meganeura.kernels.sizes import ceil_div, concrete, is_size, size_max
from meganeura.lowering import expr as E
from meganeura.lowering.ir import FLOAT_DTYPES

from ..registry import lowering

aten = torch.ops.aten


@lowering(aten.full.default, aten.empty.memory_format, aten.empty_permuted.default, aten.full_like.default,
          aten.empty_like.default, aten.scalar_tensor.default, aten.zeros_like.default, aten.ones_like.default,
          aten.empty_strided.default, aten._efficientzerotensor.default)
def _full(ctx, first, value=0, **kwargs):
    target = ctx.node.target
    if target in (aten.empty.memory_format, aten.empty_permuted.default, aten.empty_strided.default,
                  aten._efficientzerotensor.default):  # (size, ...): a layout or strides are not observable here
        shape, value = first, 0
    elif target in (aten.full_like.default,):
        shape = first.shape
    elif target in (aten.empty_like.default, aten.zeros_like.default):
        shape, value = first.shape, 0
    elif target is aten.ones_like.default:
        shape, value = first.shape, 1
    elif target is aten.scalar_tensor.default:
        shape, value = (), first
    else:
        shape = first
    return ctx.b.full(tuple(shape), value, ctx.out_dtype)


@lowering(aten.new_empty_strided.default)
def _new_empty_strided(ctx, x, size, stride, **kwargs):
    return ctx.b.full(tuple(size), 0, ctx.out_dtype)


@lowering(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(ctx, start, end=None, step=1, **kwargs):
    if end is None:
        start, end = 0, start
    if is_size(end) and isinstance(start, int) and isinstance(step, int) and step > 0:  # a dynamic graph's length
        n = ceil_div(size_max(end - start, 0), step)
    else:
        start, end, step = (concrete(v) for v in (start, end, step))
        n = len(range(start, end, step)) if all(isinstance(v, int) for v in (start, end, step)) \
            else int(torch.arange(start, end, step).numel())
    dtype = ctx.out_dtype
    kind = E.F32 if dtype in FLOAT_DTYPES else E.I32
    expr = E.add(E.mul(E.cast(E.coord(0), kind), E.const(step, kind)), E.const(start, kind))
    return ctx.b.pointwise((n,), dtype, expr, "arange")
