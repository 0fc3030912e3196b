"""Reductions and row programs: sum/mean/prod/amax/amin/max/min/argmax/var/any, softmax, layer norm."""
from __future__ import annotations

import torch

from meganeura.kernels.sizes import is_size
from meganeura.lowering import expr as E
from meganeura.lowering.ir import FLOAT_DTYPES, RowOutput, Value, numel

from ..registry import lowering
from .norms import normalized_rows

aten = torch.ops.aten


def _axes(x: Value, dims) -> tuple[int, ...]:
    rank = len(x.shape)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({d % rank for d in dims})) if rank else ()


def _keep(ctx, v: Value, x: Value, axes, keepdim: bool) -> Value:
    if not keepdim:
        return v
    return ctx.b.reshape(v, [1 if d in axes else s for d, s in enumerate(x.shape)])


def _element(ctx, x: Value, compute: str) -> E.Expr:
    return E.cast(ctx.b.load(x, [E.coord(d) for d in range(len(x.shape))]), compute)


def _reduce(ctx, x, dims, keepdim, phases_fn, result_fn, dtype=None, compute=None):
    """One-output reduction; ``phases_fn(value)`` -> phases, ``result_fn(n)`` -> row result expr.

    Elements are loaded as ``compute`` (default: the compute type of the output dtype)."""
    axes = _axes(x, dims)
    dtype = dtype or ctx.out_dtype
    n = numel([x.shape[a] for a in axes])
    compute = compute or (E.F32 if dtype in FLOAT_DTYPES else E.I32 if dtype != "bool" else E.BOOL)
    value = _element(ctx, x, compute)
    (out,) = ctx.b.reduce(x.shape, axes, phases_fn(value), [RowOutput(False, result_fn(n))], [dtype],
                          str(ctx.node.target).split(".")[1])
    return _keep(ctx, out, x, axes, keepdim)


@lowering(aten.sum.dim_IntList, aten.sum.default)
def _sum(ctx, x, dims=None, keepdim=False, dtype=None):
    return _reduce(ctx, x, dims, keepdim, lambda v: [("sum", v)],
                   lambda n: E.acc(0, E.F32 if ctx.out_dtype in FLOAT_DTYPES else E.I32))


@lowering(aten.mean.dim, aten.mean.default)
def _mean(ctx, x, dims=None, keepdim=False, dtype=None):
    return _reduce(ctx, x, dims, keepdim, lambda v: [("sum", v)],
                   lambda n: E.binary("div", E.acc(0), E.const(n, E.F32)))


@lowering(aten.prod.dim_int, aten.prod.default)
def _prod(ctx, x, dim=None, keepdim=False, dtype=None):
    return _reduce(ctx, x, dim, keepdim, lambda v: [("prod", v)],
                   lambda n: E.acc(0, E.F32 if ctx.out_dtype in FLOAT_DTYPES else E.I32))


def _extreme(op):
    def lower(ctx, x, dims=None, keepdim=False):
        kind = E.F32 if x.dtype in FLOAT_DTYPES else E.I32 if x.dtype != "bool" else E.BOOL
        return _reduce(ctx, x, dims, keepdim, lambda v: [(op, v)], lambda n: E.acc(0, kind))
    return lower


lowering(aten.amax.default)(_extreme("max"))
lowering(aten.amin.default)(_extreme("min"))
lowering(aten.max.default)(_extreme("max"))
lowering(aten.min.default)(_extreme("min"))


@lowering(aten.any.dim, aten.any.dims, aten.any.default)
def _any(ctx, x, dims=None, keepdim=False):
    return _reduce(ctx, x, dims, keepdim, lambda v: [("max", E.cast(v, E.BOOL))], lambda n: E.acc(0, E.BOOL), "bool")


def _arg(op):
    def lower(ctx, x, dim=None, keepdim=False):
        kind = E.F32 if x.dtype in FLOAT_DTYPES else E.I32
        if dim is None:
            flat = ctx.b.reshape(x, [x.numel])
            out = _reduce(ctx, flat, [0], False, lambda v: [(op, v)], lambda n: E.acc(0, E.I32), compute=kind)
            return ctx.b.reshape(out, [1] * len(x.shape)) if keepdim else out
        # the values compare in the input's type (the int64 output type would truncate float inputs)
        return _reduce(ctx, x, [dim], keepdim, lambda v: [(op, v)], lambda n: E.acc(0, E.I32), compute=kind)
    return lower


lowering(aten.argmax.default)(_arg("argmax"))
lowering(aten.argmin.default)(_arg("argmin"))


def _value_and_index(op):
    def lower(ctx, x, dim, keepdim=False):
        axes = _axes(x, dim)
        kind = E.F32 if x.dtype in FLOAT_DTYPES else E.I32
        value = _element(ctx, x, kind)
        results = [RowOutput(False, E.acc(0, kind)), RowOutput(False, E.acc(1, E.I32))]
        outs = ctx.b.reduce(x.shape, axes, [(op, value), ("arg" + op, value)], results, ctx.out_dtypes(), op)
        return tuple(_keep(ctx, o, x, axes, keepdim) for o in outs)
    return lower


lowering(aten.max.dim)(_value_and_index("max"))
lowering(aten.min.dim)(_value_and_index("min"))


def _moments(ctx, x, dims, correction, keepdim, want_mean):
    axes = _axes(x, dims)
    n = numel([x.shape[a] for a in axes])
    value = _element(ctx, x, E.F32)
    mean = E.binary("div", E.acc(0), E.const(n, E.F32))
    dev = E.binary("sub", value, mean)
    phases = [("sum2", value), ("sum2", E.mul(dev, dev))]  # eager accumulates both in double
    correction = 1 if correction is None else correction
    if is_size(n):  # a dynamic graph's row length: n - correction counted when the kernel runs
        divisor = E.binary("maximum", E.binary("sub", E.const(n, E.F32), E.const(correction, E.F32)),
                           E.const(0.0, E.F32))
    else:
        divisor = E.const(max(n - correction, 0), E.F32)
    var = E.binary("div", E.acc(1), divisor)
    results = [RowOutput(False, var)] + ([RowOutput(False, mean)] if want_mean else [])
    outs = ctx.b.reduce(x.shape, axes, phases, results, ["float32"] * len(results), "var")
    return tuple(_keep(ctx, o, x, axes, keepdim) for o in outs)


@lowering(aten.var.correction)
def _var(ctx, x, dims=None, *, correction=None, keepdim=False):
    return _moments(ctx, x, dims, correction, keepdim, False)[0]


@lowering(aten.var_mean.correction)
def _var_mean(ctx, x, dims=None, *, correction=None, keepdim=False):
    return _moments(ctx, x, dims, correction, keepdim, True)


def _softmax_like(log: bool):
    def lower(ctx, x, dim, half_to_float=False):
        rank = len(x.shape)
        axes = (dim % rank,) if rank else ()
        v = _element(ctx, x, E.F32)
        shifted = E.binary("sub", v, E.acc(0))
        phases = [("max", v), ("sum", E.unary("exp", shifted))]
        out = E.binary("sub", shifted, E.unary("log", E.acc(1))) if log else \
            E.binary("div", E.unary("exp", shifted), E.acc(1))
        (res,) = ctx.b.reduce(x.shape, axes, phases, [RowOutput(True, out)], ["float32"],
                              "log_softmax" if log else "softmax")
        return res
    return lower


lowering(aten._softmax.default)(_softmax_like(False))
lowering(aten._log_softmax.default)(_softmax_like(True))


@lowering(aten.native_layer_norm.default)
def _layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    b = ctx.b
    rank, k = len(x.shape), len(normalized_shape)
    axes = tuple(range(rank - k, rank))
    n = numel(normalized_shape)
    v = _element(ctx, x, E.F32)
    phases, results = normalized_rows(b, v, n, eps, weight, bias, [E.coord(d) for d in axes])
    y, m, r = b.reduce(x.shape, axes, phases, results, ["float32"] * 3, "layer_norm")
    stat_shape = list(x.shape[: rank - k]) + [1] * k
    return y, b.reshape(m, stat_shape), b.reshape(r, stat_shape)


@lowering(aten.linalg_vector_norm.default)
def _vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    def magnitude(v):
        return E.unary("abs", v)

    if ord == 2:
        phases, finish = (lambda v: [("sum", E.mul(v, v))]), (lambda n: E.unary("sqrt", E.acc(0)))
    elif ord == 1:
        phases, finish = (lambda v: [("sum", magnitude(v))]), (lambda n: E.acc(0))
    elif ord == float("inf"):
        phases, finish = (lambda v: [("max", magnitude(v))]), (lambda n: E.acc(0))
    elif ord == float("-inf"):
        phases, finish = (lambda v: [("min", magnitude(v))]), (lambda n: E.acc(0))
    elif ord == 0:
        phases = lambda v: [("sum", E.cast(E.binary("ne", v, E.const(0.0, E.F32)), E.F32))]  # noqa: E731
        finish = lambda n: E.acc(0)  # noqa: E731
    else:
        p = E.const(float(ord), E.F32)
        phases = lambda v: [("sum", E.binary("pow", magnitude(v), p))]  # noqa: E731
        finish = lambda n: E.binary("pow", E.acc(0), E.const(1.0 / float(ord), E.F32))  # noqa: E731
    return _reduce(ctx, x, dim, keepdim, phases, finish, compute=E.F32)


def _scan(op: str, identity):
    """Inclusive scan along ``dim`` as a reduction over a second copy of that axis: element k counts towards
    output position i when k <= i. O(n^2) per row; fine for the short axes models scan (positions, masks)."""
    def lower(ctx, x, dim, dtype=None):
        rank = len(x.shape)
        if rank == 0:
            return ctx.b.map(lambda v: v, x, dtype=ctx.out_dtype)
        dim %= rank
        kind = E.F32 if ctx.out_dtype in FLOAT_DTYPES else E.I32
        coords = [E.coord(rank) if d == dim else E.coord(d) for d in range(rank)]
        value = E.cast(ctx.b.load(x, coords), kind)
        inside = E.binary("le", E.coord(rank), E.coord(dim))
        element = E.where(inside, value, E.const(identity, kind))
        (out,) = ctx.b.reduce(x.shape + (x.shape[dim],), (rank,), [(op, element)], [RowOutput(False, E.acc(0, kind))],
                              [ctx.out_dtype], "cum" + op)
        return out
    return lower


lowering(aten.cumsum.default)(_scan("sum", 0))
lowering(aten.cumprod.default)(_scan("prod", 1))
