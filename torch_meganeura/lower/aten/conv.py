"""Convolution as implicit GEMM: forward, input gradient and weight gradient are Matmul nodes whose operands
gather from the image and the filter with index math (no im2col buffer anywhere), plus transposed convolution.

Layout is NCHW; 1-D convolutions run as 2-D ones of height 1. Groups fold into the GEMM batch. For a regular
convolution y = conv(x, w) with G groups (per image n and group g):
  forward      y[n, g]  (Co/G x OH*OW)      = w[g] (Co/G x Ci/G*KH*KW) . patches of x[n, g]
  input grad   dx[n, g] (Ci/G x IH*IW)      = w[g] read transposed      . taps of dy[n, g] that reach each pixel
  weight grad  dw[g]    (Co/G x Ci/G*KH*KW) = dy[g] (Co/G x N*OH*OW)     . patches of x[g]
Every product lands in PyTorch's contiguous layout, so no permute follows; bias and any pointwise consumer
(residual add, activation) run in the GEMM's epilogue. A transposed convolution's forward is the input gradient
of the regular convolution it transposes; its gradients are that convolution's forward and weight gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meganeura.lowering import expr as E
from meganeura.lowering.builder import unravel
from meganeura.lowering.ir import Value

from ..registry import DEVICE_FLOATS, lowering, tensor_inputs

aten = torch.ops.aten


def _i(v: int) -> E.Expr:
    return E.const(v, E.I32)


def _all(conds) -> E.Expr:
    out = E.const(True, E.BOOL)
    for c in conds:
        out = c if E.is_const(out) else E.binary("and", out, c)
    return out


@dataclass(frozen=True)
class Geometry:
    """A regular 2-D convolution: x (n, cin, ih, iw) * w (cout, cin/groups, kh, kw) -> y (n, cout, oh, ow)."""

    n: int
    groups: int
    cin: int
    cout: int
    ih: int
    iw: int
    oh: int
    ow: int
    kh: int
    kw: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]

    @property
    def cin_g(self) -> int:
        return self.cin // self.groups

    @property
    def cout_g(self) -> int:
        return self.cout // self.groups

    @property
    def taps(self) -> tuple[int, int, int]:
        """The reduction extent of one filter: (input channels per group, kh, kw)."""
        return (self.cin_g, self.kh, self.kw)


def _pixel(g: Geometry, out_pos, tap, axis: int) -> tuple[E.Expr, E.Expr | None]:
    """Input coordinate of output position ``out_pos`` under filter tap ``tap`` along ``axis`` (0: h, 1: w),
    clamped into the image, and the condition that it lies inside (None when it always does)."""
    size = (g.ih, g.iw)[axis]
    pos = E.add(E.mul(out_pos, _i(g.stride[axis])), E.binary("sub", E.mul(tap, _i(g.dilation[axis])),
                                                                _i(g.padding[axis])))
    if g.padding[axis] == 0:
        return pos, None
    inside = E.binary("and", E.binary("ge", pos, _i(0)), E.binary("lt", pos, _i(size)))
    return E.binary("maximum", E.binary("minimum", pos, _i(size - 1)), _i(0)), inside


def _image_tap(b, x: Value, g: Geometry, n, channel, oh, ow, kh, kw) -> E.Expr:
    """x at the input pixel under filter tap (kh, kw) of output pixel (oh, ow); 0 in the padding."""
    ih, in_h = _pixel(g, oh, kh, 0)
    iw, in_w = _pixel(g, ow, kw, 1)
    value = E.cast(b.load(x, [n, channel, ih, iw]), E.F32)
    inside = [c for c in (in_h, in_w) if c is not None]
    return E.where(_all(inside), value, E.const(0.0, E.F32)) if inside else value


def _output_tap(g: Geometry, pixel, tap, axis: int) -> tuple[E.Expr, E.Expr]:
    """The output coordinate whose filter tap ``tap`` reads input ``pixel`` along ``axis``, clamped, and whether
    one exists: pixel + padding - tap * dilation must be a non-negative multiple of the stride below the size."""
    size, stride = (g.oh, g.ow)[axis], g.stride[axis]
    t = E.binary("sub", E.add(pixel, _i(g.padding[axis])), E.mul(tap, _i(g.dilation[axis])))
    safe = E.binary("maximum", t, _i(0))
    pos = E.binary("idiv", safe, _i(stride))
    # (at stride 1 the bound is on t itself: with t >= 0 beside it, one unsigned comparison in WGSL)
    conds = [E.binary("ge", t, _i(0)), E.binary("lt", t if stride == 1 else pos, _i(size))]
    if stride > 1:
        conds.append(E.binary("eq", E.binary("imod", safe, _i(stride)), _i(0)))
    return E.binary("minimum", pos, _i(size - 1)), _all(conds)


def _bias_epilogue(b, bias: Value | None, group_of_batch: E.Expr, per_group: int) -> E.Expr | None:
    """acc + bias[channel] for GEMM row i of group ``group_of_batch`` (``per_group`` channels a group)."""
    if bias is None:
        return None
    channel = E.add(E.mul(group_of_batch, _i(per_group)), E.coord(1))
    return E.add(E.acc(0), E.cast(b.load(bias, [channel]), E.F32))


def conv_forward(b, x: Value, w: Value, bias: Value | None, g: Geometry) -> Value:
    group_of_batch = E.binary("imod", E.coord(0), _i(g.groups))
    ci, kh, kw = unravel(E.coord(2), g.taps)
    a = E.cast(b.load(w, [E.add(E.mul(group_of_batch, _i(g.cout_g)), E.coord(1)), ci, kh, kw]), E.F32)
    n = E.binary("idiv", E.coord(0), _i(g.groups))
    ci, kh, kw = unravel(E.coord(1), g.taps)
    oh, ow = unravel(E.coord(2), (g.oh, g.ow))
    patch = _image_tap(b, x, g, n, E.add(E.mul(group_of_batch, _i(g.cin_g)), ci), oh, ow, kh, kw)
    out = b.gemm(g.n * g.groups, g.cout_g, g.oh * g.ow, g.cin_g * g.kh * g.kw, a, patch,
                 epilogue=_bias_epilogue(b, bias, group_of_batch, g.cout_g), label="conv")
    return b.reshape(out, (g.n, g.cout, g.oh, g.ow))


def conv_input_grad(b, dy: Value, w: Value, bias: Value | None, g: Geometry) -> Value:
    """dx of y = conv(x, w) given dy; with ``bias`` (over x's channels) it is a transposed convolution."""
    group_of_batch = E.binary("imod", E.coord(0), _i(g.groups))
    co, kh, kw = unravel(E.coord(2), (g.cout_g, g.kh, g.kw))
    a = E.cast(b.load(w, [E.add(E.mul(group_of_batch, _i(g.cout_g)), co), E.coord(1), kh, kw]), E.F32)
    n = E.binary("idiv", E.coord(0), _i(g.groups))
    co, kh, kw = unravel(E.coord(1), (g.cout_g, g.kh, g.kw))
    ih, iw = unravel(E.coord(2), (g.ih, g.iw))
    oh, reach_h = _output_tap(g, ih, kh, 0)
    ow, reach_w = _output_tap(g, iw, kw, 1)
    value = E.cast(b.load(dy, [n, E.add(E.mul(group_of_batch, _i(g.cout_g)), co), oh, ow]), E.F32)
    taps = E.where(E.binary("and", reach_h, reach_w), value, E.const(0.0, E.F32))
    out = b.gemm(g.n * g.groups, g.cin_g, g.ih * g.iw, g.cout_g * g.kh * g.kw, a, taps,
                 epilogue=_bias_epilogue(b, bias, group_of_batch, g.cin_g), label="conv_input_grad")
    return b.reshape(out, (g.n, g.cin, g.ih, g.iw))


def conv_weight_grad(b, dy: Value, x: Value, g: Geometry) -> Value:
    n, oh, ow = unravel(E.coord(2), (g.n, g.oh, g.ow))
    a = E.cast(b.load(dy, [n, E.add(E.mul(E.coord(0), _i(g.cout_g)), E.coord(1)), oh, ow]), E.F32)
    n, oh, ow = unravel(E.coord(1), (g.n, g.oh, g.ow))
    ci, kh, kw = unravel(E.coord(2), g.taps)
    patch = _image_tap(b, x, g, n, E.add(E.mul(E.coord(0), _i(g.cin_g)), ci), oh, ow, kh, kw)
    out = b.gemm(g.groups, g.cout_g, g.cin_g * g.kh * g.kw, g.n * g.oh * g.ow, a, patch, label="conv_weight_grad")
    return b.reshape(out, (g.cout, g.cin_g, g.kh, g.kw))


# ----------------------------------------------------------------------------------------- aten ops
def _pair(v, fill: int) -> tuple[int, int]:
    """A 1-D argument as a 2-D one with height ``fill`` (1-D convolutions run at height 1)."""
    v = list(v)
    return (fill, v[0]) if len(v) == 1 else (v[0], v[1])


def _as_2d(b, t: Value | None) -> Value | None:
    return t if t is None or len(t.shape) == 4 else b.unsqueeze(t, 2)


def _geometry(x_shape, w_shape, stride, padding, dilation, groups, transposed, output_padding) -> Geometry:
    stride, padding, dilation = _pair(stride, 1), _pair(padding, 0), _pair(dilation, 1)
    kh, kw = w_shape[2], w_shape[3]
    n, c, h, w = x_shape
    if not transposed:
        oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        return Geometry(n, groups, c, w_shape[0], h, w, oh, ow, kh, kw, stride, padding, dilation)
    extra = _pair(output_padding, 0)
    out_h = (h - 1) * stride[0] - 2 * padding[0] + dilation[0] * (kh - 1) + extra[0] + 1
    out_w = (w - 1) * stride[1] - 2 * padding[1] + dilation[1] * (kw - 1) + extra[1] + 1
    # the regular convolution this one transposes maps (.., out_h, out_w) back to x's (.., h, w)
    return Geometry(n, groups, w_shape[1] * groups, c, out_h, out_w, h, w, kh, kw, stride, padding, dilation)


def _back_to_rank(b, v: Value | None, rank: int) -> Value | None:
    return v if v is None or rank == 4 else b.reshape(v, v.shape[:2] + v.shape[3:])


def _supported(weight_arg: int):
    """The support check of a convolution op whose weight is argument ``weight_arg``."""
    def check(node) -> str | None:
        if any(t.dtype not in DEVICE_FLOATS for t in tensor_inputs(node)):
            return "convolution on the device takes floating point operands only"
        rank = node.args[weight_arg].meta["val"].dim()
        return None if rank in (3, 4) else f"{rank - 2}-D convolution (only 1-D and 2-D are lowered)"
    return check


@lowering(aten.convolution.default, supports=_supported(1))
def _convolution(ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    b, rank = ctx.b, len(x.shape)
    x2, w2 = _as_2d(b, x), _as_2d(b, w)
    g = _geometry(x2.shape, w2.shape, stride, padding, dilation, groups, transposed, output_padding)
    out = conv_input_grad(b, x2, w2, bias, g) if transposed else conv_forward(b, x2, w2, bias, g)
    return _back_to_rank(b, out, rank)


@lowering(aten.convolution_backward.default, supports=_supported(2))
def _convolution_backward(ctx, grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask):
    b, rank = ctx.b, len(x.shape)
    dy, x2, w2 = _as_2d(b, grad), _as_2d(b, x), _as_2d(b, w)
    g = _geometry(x2.shape, w2.shape, stride, padding, dilation, groups, transposed, output_padding)
    want_input, want_weight, want_bias = output_mask
    if transposed:  # x is the regular convolution's output, grad its input
        grad_x = conv_forward(b, dy, w2, None, g) if want_input else None
        grad_w = conv_weight_grad(b, x2, dy, g) if want_weight else None
    else:
        grad_x = conv_input_grad(b, dy, w2, None, g) if want_input else None
        grad_w = conv_weight_grad(b, dy, x2, g) if want_weight else None
    grad_b = b.reduce_simple(dy, (0, 2, 3), "sum", "float32", label="conv_bias_grad") if want_bias else None
    return _back_to_rank(b, grad_x, rank), _back_to_rank(b, grad_w, rank), grad_b
