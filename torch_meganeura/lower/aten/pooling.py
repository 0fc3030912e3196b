"""Pooling on the device: max pooling with torch's flat arg-max indices, average pooling, and the adaptive forms
of both; forward and backward.

A forward is a Reduce over ``lead + (OH, OW, KH, KW)``: each output element reduces over the taps of its
window, and a tap in the padding (or past an adaptive window's end) is masked out. A backward is gathered
from the input side, without atomics: each input element reduces over the outputs whose window may cover it
(``lead + (H, W, TH, TW)``), adding the output gradient where the saved arg-max is this element (max) or the
gradient over the window's divisor (average). Loads always use clamped coordinates: a ``where`` evaluates
both of its sides.

Max pooling follows eager on the CPU: the first maximum in window scan order wins, a NaN beats any number and
the last NaN wins, and a window whose values are all -inf reports its first tap inside the input.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meganeura.lowering import expr as E
from meganeura.lowering.ir import RowOutput, Value

from ..registry import DEVICE_FLOATS, lowering

aten = torch.ops.aten


def _i32(n: int) -> E.Expr:
    return E.const(n, E.I32)


def _and(*conds: E.Expr) -> E.Expr:
    out = conds[0]
    for c in conds[1:]:
        out = E.binary("and", out, c)
    return out


def _clamp(i: E.Expr, size: int) -> E.Expr:
    return E.binary("minimum", E.binary("maximum", i, _i32(0)), _i32(size - 1))


# ------------------------------------------------------------------------------------------- window axes
@dataclass(frozen=True)
class Strided:
    """One spatial axis of a window with kernel size, stride, padding and dilation."""

    size: int  # input positions
    out: int  # output positions
    kernel: int
    stride: int
    pad: int
    dilation: int = 1

    @property
    def taps(self) -> int:
        return self.kernel

    @property
    def covers(self) -> int:
        """Candidate outputs per input position in a backward: one per tap."""
        return self.kernel

    def _start(self, o: E.Expr) -> E.Expr:
        return E.binary("sub", E.mul(o, _i32(self.stride)), _i32(self.pad))

    def source(self, o: E.Expr, k: E.Expr) -> tuple[E.Expr, E.Expr]:
        """Input position of tap ``k`` of output ``o`` (clamped), and whether it lies inside the input."""
        i = E.add(self._start(o), E.mul(k, _i32(self.dilation)))
        inside = _and(E.binary("ge", i, _i32(0)), E.binary("lt", i, _i32(self.size)))
        return _clamp(i, self.size), inside

    def first(self, o: E.Expr) -> E.Expr:
        """The first tap of output ``o`` inside the input: ceil(max(pad - o * stride, 0) / dilation)."""
        before = E.binary("maximum", E.binary("sub", _i32(0), self._start(o)), _i32(0))
        return E.binary("idiv", E.add(before, _i32(self.dilation - 1)), _i32(self.dilation))

    def target(self, i: E.Expr, t: E.Expr) -> tuple[E.Expr, E.Expr]:
        """The output whose tap ``t`` is input position ``i`` (clamped), and whether there is one."""
        num = E.binary("sub", E.add(i, _i32(self.pad)), E.mul(t, _i32(self.dilation)))
        safe = E.binary("maximum", num, _i32(0))  # idiv/imod need non-negative operands
        o = E.binary("idiv", safe, _i32(self.stride))
        exact = E.binary("eq", E.binary("imod", safe, _i32(self.stride)), _i32(0))
        valid = _and(E.binary("ge", num, _i32(0)), exact, E.binary("lt", o, _i32(self.out)))
        return E.binary("minimum", o, _i32(self.out - 1)), valid

    def count(self, o: E.Expr, include_pad: bool) -> E.Expr:
        """Taps of output ``o`` that an average divides by (eager's pool size along this axis)."""
        start = self._start(o)
        end = E.add(start, _i32(self.kernel))
        if include_pad:
            return E.binary("sub", E.binary("minimum", end, _i32(self.size + self.pad)), start)
        return E.binary("sub", E.binary("minimum", end, _i32(self.size)), E.binary("maximum", start, _i32(0)))


@dataclass(frozen=True)
class Adaptive:
    """One spatial axis of an adaptive window: output ``o`` covers [floor(o*size/out), ceil((o+1)*size/out))."""

    size: int
    out: int

    def _start(self, o: E.Expr) -> E.Expr:
        return E.binary("idiv", E.mul(o, _i32(self.size)), _i32(self.out))

    def _end(self, o: E.Expr) -> E.Expr:
        return E.binary("idiv", E.add(E.mul(o, _i32(self.size)), _i32(self.size + self.out - 1)), _i32(self.out))

    @property
    def taps(self) -> int:
        return max(-(-(o + 1) * self.size // self.out) - o * self.size // self.out for o in range(self.out))

    @property
    def covers(self) -> int:
        return max(-(-(i + 1) * self.out // self.size) - i * self.out // self.size for i in range(self.size))

    def source(self, o: E.Expr, k: E.Expr) -> tuple[E.Expr, E.Expr]:
        i = E.add(self._start(o), k)
        return _clamp(i, self.size), E.binary("lt", i, self._end(o))

    def first(self, o: E.Expr) -> E.Expr:
        return _i32(0)

    def target(self, i: E.Expr, t: E.Expr) -> tuple[E.Expr, E.Expr]:
        """Candidate ``t`` among the outputs covering ``i``: the first is floor(i * out / size)."""
        o = E.add(E.binary("idiv", E.mul(i, _i32(self.out)), _i32(self.size)), t)
        valid = _and(E.binary("lt", o, _i32(self.out)), E.binary("le", self._start(o), i))
        return E.binary("minimum", o, _i32(self.out - 1)), valid

    def count(self, o: E.Expr, include_pad: bool) -> E.Expr:
        return E.binary("sub", self._end(o), self._start(o))


def _pair(v, default=None) -> tuple[int, int]:
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return default
    if isinstance(v, int):
        return v, v
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def _strided_axes(x: Value, out_hw, kernel, stride, padding, dilation=1) -> tuple[Strided, Strided]:
    kernel = _pair(kernel)
    stride, padding, dilation = _pair(stride, kernel), _pair(padding), _pair(dilation)
    return tuple(Strided(x.shape[-2 + j], out_hw[j], kernel[j], stride[j], padding[j], dilation[j]) for j in range(2))


def _adaptive_axes(x: Value, out_hw) -> tuple[Adaptive, Adaptive]:
    return Adaptive(x.shape[-2], out_hw[0]), Adaptive(x.shape[-1], out_hw[1])


def _out_hw(ctx) -> tuple[int, int]:
    val = ctx.val[0] if isinstance(ctx.val, (tuple, list)) else ctx.val
    return tuple(int(s) for s in val.shape[-2:])


# --------------------------------------------------------------------------------------------- forwards
def _max_pool(ctx, x: Value, ah, aw, label: str) -> tuple[Value, Value]:
    """Values and flat input indices (ih * W + iw) of the window maxima."""
    b, lead = ctx.b, len(x.shape) - 2
    batch = [E.coord(d) for d in range(lead)]
    oh, ow, kh, kw = (E.coord(lead + j) for j in range(4))
    ih, h_in = ah.source(oh, kh)
    iw, w_in = aw.source(ow, kw)
    value = b.load(x, batch + [ih, iw])
    inside = _and(h_in, w_in)
    tap = E.add(E.mul(kh, _i32(aw.taps)), kw)
    phases = [("argmax", E.where(inside, value, E.const(float("-inf"), E.F32))),
              ("max", E.where(_and(inside, E.unary("isnan", value)), tap, _i32(-1)))]  # the last NaN
    best = E.where(E.binary("ge", E.acc(1, E.I32), _i32(0)), E.acc(1, E.I32), E.acc(0, E.I32))
    ih, iw = _tap_position(ah, aw, oh, ow, best)
    results = [RowOutput(False, b.load(x, batch + [ih, iw])), RowOutput(False, E.add(E.mul(ih, _i32(aw.size)), iw))]
    domain = x.shape[:-2] + (ah.out, aw.out, ah.taps, aw.taps)
    values, indices = b.reduce(domain, (lead + 2, lead + 3), phases, results, ctx.out_dtypes(), label)
    return values, indices


def _tap_position(ah, aw, oh: E.Expr, ow: E.Expr, tap: E.Expr) -> tuple[E.Expr, E.Expr]:
    """Input position of window tap ``tap`` (flat over KH x KW); a tap in the padding (the arg-max of a window
    whose values are all -inf) is replaced by the window's first tap inside the input, as eager reports."""
    ih, h_in = ah.source(oh, E.binary("idiv", tap, _i32(aw.taps)))
    iw, w_in = aw.source(ow, E.binary("imod", tap, _i32(aw.taps)))
    ih0, _ = ah.source(oh, ah.first(oh))
    iw0, _ = aw.source(ow, aw.first(ow))
    inside = _and(h_in, w_in)
    return E.where(inside, ih, ih0), E.where(inside, iw, iw0)


def _avg_pool(ctx, x: Value, ah, aw, divisor, label: str) -> Value:
    """Window sums over ``divisor(oh, ow)`` (an i32 expression)."""
    b, lead = ctx.b, len(x.shape) - 2
    oh, ow, kh, kw = (E.coord(lead + j) for j in range(4))
    ih, h_in = ah.source(oh, kh)
    iw, w_in = aw.source(ow, kw)
    value = b.load(x, [E.coord(d) for d in range(lead)] + [ih, iw])
    phases = [("sum", E.where(_and(h_in, w_in), value, E.const(0.0, E.F32)))]
    mean = E.binary("div", E.acc(0), E.cast(divisor(oh, ow), E.F32))
    domain = x.shape[:-2] + (ah.out, aw.out, ah.taps, aw.taps)
    (out,) = b.reduce(domain, (lead + 2, lead + 3), phases, [RowOutput(False, mean)], ["float32"], label)
    return out


def _avg_divisor(ah, aw, count_include_pad: bool, divisor_override):
    if divisor_override:
        return lambda oh, ow: _i32(divisor_override)
    return lambda oh, ow: E.mul(ah.count(oh, count_include_pad), aw.count(ow, count_include_pad))


# -------------------------------------------------------------------------------------------- backwards
def _gather_grad(ctx, x: Value, ah, aw, contribution, label: str) -> Value:
    """dL/dx: each input element sums ``contribution(batch, oh, ow, ih, iw)`` over its candidate outputs."""
    b, lead = ctx.b, len(x.shape) - 2
    batch = [E.coord(d) for d in range(lead)]
    ih, iw, th, tw = (E.coord(lead + j) for j in range(4))
    oh, h_ok = ah.target(ih, th)
    ow, w_ok = aw.target(iw, tw)
    phases = [("sum", E.where(_and(h_ok, w_ok), contribution(batch, oh, ow, ih, iw), E.const(0.0, E.F32)))]
    domain = x.shape + (ah.covers, aw.covers)
    (grad,) = b.reduce(domain, (lead + 2, lead + 3), phases, [RowOutput(False, E.acc(0))], ["float32"], label)
    return grad


def _max_pool_backward(ctx, grad: Value, x: Value, indices: Value, ah, aw, label: str) -> Value:
    def routed(batch, oh, ow, ih, iw):
        here = E.binary("eq", ctx.b.load(indices, batch + [oh, ow]), E.add(E.mul(ih, _i32(aw.size)), iw))
        return E.where(here, ctx.b.load(grad, batch + [oh, ow]), E.const(0.0, E.F32))

    return _gather_grad(ctx, x, ah, aw, routed, label)


def _avg_pool_backward(ctx, grad: Value, x: Value, ah, aw, divisor, label: str) -> Value:
    def share(batch, oh, ow, ih, iw):
        return E.binary("div", ctx.b.load(grad, batch + [oh, ow]), E.cast(divisor(oh, ow), E.F32))

    return _gather_grad(ctx, x, ah, aw, share, label)


# ------------------------------------------------------------------------------------------- lowerings
def _floating(node) -> str | None:
    """Pooling loads compute in f32 (-inf and NaN masks): other input dtypes stay in eager PyTorch."""
    dtype = node.args[0].meta["val"].dtype
    return None if dtype in DEVICE_FLOATS else f"{node.target} on {dtype} is not lowered"


@lowering(aten.max_pool2d_with_indices.default, supports=_floating)
def _max_pool2d(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    ah, aw = _strided_axes(x, _out_hw(ctx), kernel_size, stride, padding, dilation)
    return _max_pool(ctx, x, ah, aw, "max_pool2d")


@lowering(aten.max_pool2d_with_indices_backward.default, supports=_floating)
def _max_pool2d_backward(ctx, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    ah, aw = _strided_axes(x, grad.shape[-2:], kernel_size, stride, padding, dilation)
    return _max_pool_backward(ctx, grad, x, indices, ah, aw, "max_pool2d_backward")


@lowering(aten.adaptive_max_pool2d.default, supports=_floating)
def _adaptive_max_pool2d(ctx, x, output_size):
    ah, aw = _adaptive_axes(x, _out_hw(ctx))
    return _max_pool(ctx, x, ah, aw, "adaptive_max_pool2d")


@lowering(aten.adaptive_max_pool2d_backward.default, supports=_floating)
def _adaptive_max_pool2d_backward(ctx, grad, x, indices):
    ah, aw = _adaptive_axes(x, grad.shape[-2:])
    return _max_pool_backward(ctx, grad, x, indices, ah, aw, "adaptive_max_pool2d_backward")


@lowering(aten.avg_pool2d.default, supports=_floating)
def _avg_pool2d(ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    ah, aw = _strided_axes(x, _out_hw(ctx), kernel_size, stride, padding)
    return _avg_pool(ctx, x, ah, aw, _avg_divisor(ah, aw, count_include_pad, divisor_override), "avg_pool2d")


@lowering(aten.avg_pool2d_backward.default, supports=_floating)
def _avg_pool2d_backward(ctx, grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                         divisor_override):
    ah, aw = _strided_axes(x, grad.shape[-2:], kernel_size, stride, padding)
    divisor = _avg_divisor(ah, aw, count_include_pad, divisor_override)
    return _avg_pool_backward(ctx, grad, x, ah, aw, divisor, "avg_pool2d_backward")


@lowering(aten._adaptive_avg_pool2d.default, supports=_floating)
def _adaptive_avg_pool2d(ctx, x, output_size):
    ah, aw = _adaptive_axes(x, _out_hw(ctx))
    return _avg_pool(ctx, x, ah, aw, _avg_divisor(ah, aw, False, None), "adaptive_avg_pool2d")


@lowering(aten._adaptive_avg_pool2d_backward.default, supports=_floating)
def _adaptive_avg_pool2d_backward(ctx, grad, x):
    ah, aw = _adaptive_axes(x, grad.shape[-2:])
    divisor = _avg_divisor(ah, aw, False, None)
    return _avg_pool_backward(ctx, grad, x, ah, aw, divisor, "adaptive_avg_pool2d_backward")
