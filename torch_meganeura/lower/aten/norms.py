"""Group norm forward as one row program (instance and batch norm arrive decomposed into reductions we lower;
group norm's backward arrives decomposed too), and the normalisation it shares with layer norm (``reductions``)."""
from __future__ import annotations

import torch

from meganeura.lowering import expr as E
from meganeura.lowering.ir import RowOutput

from ..registry import lowering

aten = torch.ops.aten


def normalized_rows(b, v, length: int, eps: float, weight, bias, at: list) -> tuple[list, list]:
    """The phases and results of a row program that normalises rows of ``length`` elements ``v``: the sum, then the
    sum of squared deviations from the mean; the element normalised, times ``weight`` and plus ``bias`` (each
    loaded at ``at``, where given), and the row's mean and reciprocal standard deviation (layer and group norm)."""
    mean = E.binary("div", E.acc(0), E.const(length, E.F32))
    dev = E.binary("sub", v, mean)
    rstd = E.unary("rsqrt", E.add(E.binary("div", E.acc(1), E.const(length, E.F32)), E.const(eps, E.F32)))
    out = E.mul(dev, rstd)
    if weight is not None:
        out = E.mul(out, b.load(weight, at))
    if bias is not None:
        out = E.add(out, b.load(bias, at))
    phases = [("sum", v), ("sum", E.mul(dev, dev))]
    return phases, [RowOutput(True, out), RowOutput(False, mean), RowOutput(False, rstd)]


@lowering(aten.native_group_norm.default)
def _group_norm(ctx, x, weight, bias, n, c, hw, groups, eps):
    """Rows (n, group) of ``c // groups * hw`` elements: mean, then variance around it, then the normalised
    elements scaled by their channel's weight and bias; returns (y, mean, rstd) with statistics of shape (n, groups)."""
    b = ctx.b
    per_group = c // groups
    length = per_group * hw
    rows = b.reshape(x, [n, groups, length])
    v = E.cast(b.load(rows, [E.coord(0), E.coord(1), E.coord(2)]), E.F32)
    channel = [E.add(E.mul(E.coord(1), E.const(per_group, E.I32)), E.binary("idiv", E.coord(2), E.const(hw, E.I32)))]
    phases, results = normalized_rows(b, v, length, eps, weight, bias, channel)
    y, m, r = b.reduce((n, groups, length), (2,), phases, results, ["float32"] * 3, "group_norm")
    return b.reshape(y, x.shape), m, r
