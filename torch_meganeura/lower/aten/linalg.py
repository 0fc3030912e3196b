"""Matrix products: mm, bmm, addmm (bias and scaling fused into the matmul epilogue), dot, mv."""
from __future__ import annotations

import torch

from meganeura.lowering import expr as E

from ..registry import DEVICE_FLOATS, lowering

aten = torch.ops.aten


def _float_only(node) -> str | None:
    return None if node.meta["val"].dtype in DEVICE_FLOATS else "integer matmul is not lowered"


@lowering(aten.mm.default, aten.bmm.default, aten.dot.default, aten.mv.default, supports=_float_only)
def _mm(ctx, a, b):
    return ctx.b.matmul(a, b)


@lowering(aten.addmm.default, supports=_float_only)
def _addmm(ctx, bias, a, b, beta=1, alpha=1):
    m, n = a.shape[0], b.shape[1]
    acc = E.acc(0)
    if alpha != 1:
        acc = E.mul(acc, E.const(alpha, E.F32))
    if beta == 0:
        return ctx.b.matmul(a, b, epilogue=acc, label="addmm")
    term = E.cast(ctx.b.load_broadcast(bias, (1, m, n)), E.F32)
    if beta != 1:
        term = E.mul(term, E.const(beta, E.F32))
    return ctx.b.matmul(a, b, epilogue=E.add(acc, term), label="addmm")
