"""Random ops on the device: dropout, uniform and Bernoulli samples from the counter-based RNG.

Each random op is one stream of ``GraphBuilder.uniform`` under a per-run seed that the device partition draws
from torch's default generator, so ``torch.manual_seed`` makes compiled runs reproducible. The numbers differ
from eager PyTorch's (a different generator); the distributions are the same. Dropout's mask is an output,
which the backward reuses.
"""
from __future__ import annotations

import torch

from meganeura.lowering import expr as E

from ..registry import lowering

aten = torch.ops.aten


@lowering(aten.native_dropout.default)
def _native_dropout(ctx, x, p, train):
    b = ctx.b
    if not train or p == 0:
        return b.map(lambda v: v, x, dtype=x.dtype), b.full(x.shape, True, "bool")
    keep = E.binary("lt", b.uniform(x.shape), E.const(1.0 - p, E.F32))
    scale = E.const(1.0 / (1.0 - p), E.F32) if p < 1 else E.const(0.0, E.F32)
    value = E.cast(b.load_broadcast(x, x.shape), E.F32)
    out = b.pointwise(x.shape, x.dtype, E.where(keep, E.mul(value, scale), E.const(0.0, E.F32)), "dropout")
    return out, b.pointwise(x.shape, "bool", keep, "dropout_mask")


@lowering(aten.rand.default, aten.rand_like.default)
def _rand(ctx, first, **kwargs):
    shape = first.shape if ctx.node.target is aten.rand_like.default else tuple(first)
    return ctx.b.pointwise(shape, ctx.out_dtype, ctx.b.uniform(shape), "rand")


@lowering(aten.bernoulli.p)
def _bernoulli(ctx, x, p=0.5, **kwargs):
    hit = E.binary("lt", ctx.b.uniform(x.shape), E.const(p, E.F32))
    return ctx.b.pointwise(x.shape, ctx.out_dtype, hit, "bernoulli")
