"""Batch norm in eval mode: one pointwise expression over the running statistics (no reduction).

Train-mode batch norm arrives decomposed (torch's decomposition of ``_native_batch_norm_legit_functional``, with
the running-stat updates as graph outputs). Eval mode cannot use torch's decomposition of the no-training op:
it calls the mutating ``_native_batch_norm_legit`` again, which aot_autograd refuses after functionalisation.
A consumer-side pointwise op, it fuses into the convolution before it as an epilogue.
"""
from __future__ import annotations

import torch

from meganeura.lowering import expr as E

from ..registry import lowering

aten = torch.ops.aten


@lowering(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_eval(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    b = ctx.b
    rank = len(x.shape)

    def channel(v):
        return E.cast(b.load(v, [E.coord(1)]), E.F32)

    value = E.cast(b.load(x, [E.coord(d) for d in range(rank)]), E.F32)
    scale = E.unary("rsqrt", E.add(channel(running_var), E.const(eps, E.F32)))
    out = E.mul(E.binary("sub", value, channel(running_mean)), scale)
    if weight is not None:
        out = E.mul(out, channel(weight))
    if bias is not None:
        out = E.add(out, channel(bias))
    y = b.pointwise(x.shape, x.dtype, out, "batch_norm")
    empty = [b.full(tuple(v.shape), 0.0, "float32") for v in ctx.val[1:]]
    return (y, *empty)
