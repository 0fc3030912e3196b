"""Elementwise aten ops: each is one expression; broadcasting and type promotion follow torch."""
from __future__ import annotations

import math

import torch

from meganeura.lowering import expr as E
from meganeura.lowering.ir import FLOAT_DTYPES, LOGICAL_TO_COMPUTE, Value

from ..registry import LowerCtx, lowering

aten = torch.ops.aten

COMPUTE = LOGICAL_TO_COMPUTE
ROUND_TO = {"bfloat16": "round_bf16", "float16": "round_f16"}  # a cast to half precision rounds (kept in f32)


def promoted(*operands) -> str:
    """Compute dtype of torch's type promotion for tensors and Python scalars (dims don't matter here)."""
    kinds = set()
    for o in operands:
        if isinstance(o, Value):
            kinds.add(COMPUTE[o.dtype])
        elif isinstance(o, bool):
            kinds.add(E.BOOL)
        elif isinstance(o, int):
            kinds.add(E.I32)
        elif isinstance(o, float):
            kinds.add(E.F32)
    for kind in (E.F32, E.I32, E.BOOL):
        if kind in kinds:
            return kind
    return E.F32


def elementwise(ctx: LowerCtx, fn, *operands, compute: str | None = None) -> Value:
    dtype = ctx.out_dtype
    compute = compute or (COMPUTE[dtype] if dtype != "bool" else promoted(*operands))
    return ctx.b.map(fn, *operands, dtype=dtype, compute=compute, label=str(ctx.node.target).split(".")[1])


def _unary(op):
    def lower(ctx, x):
        return elementwise(ctx, lambda a: E.unary(op, a), x, compute=E.F32 if op not in INT_SAFE else None)
    return lower


INT_SAFE = {"neg", "abs", "sign"}
UNARY = {
    aten.neg: "neg", aten.abs: "abs", aten.exp: "exp", aten.exp2: "exp2", aten.expm1: "expm1", aten.log: "log",
    aten.log2: "log2", aten.log10: "log10", aten.log1p: "log1p", aten.sqrt: "sqrt", aten.rsqrt: "rsqrt",
    aten.sin: "sin", aten.cos: "cos", aten.tan: "tan", aten.asin: "asin", aten.acos: "acos", aten.atan: "atan",
    aten.sinh: "sinh", aten.cosh: "cosh", aten.tanh: "tanh", aten.asinh: "asinh", aten.acosh: "acosh",
    aten.atanh: "atanh", aten.erf: "erf", aten.erfc: "erfc", aten.sigmoid: "sigmoid", aten.floor: "floor",
    aten.ceil: "ceil", aten.round: "round", aten.trunc: "trunc", aten.sign: "sign", aten.reciprocal: "reciprocal",
}
for _op, _name in UNARY.items():
    lowering(_op.default)(_unary(_name))


@lowering(aten.isnan.default, aten.isinf.default)
def _isnan(ctx, x):
    op = str(ctx.node.target).split(".")[1]
    if x.dtype not in FLOAT_DTYPES:
        return ctx.b.map(lambda a: E.const(False, E.BOOL), x, dtype="bool")
    return ctx.b.map(lambda a: E.unary(op, a), x, dtype="bool", compute=E.F32)


@lowering(aten.logical_not.default)
def _not(ctx, x):
    return ctx.b.map(lambda a: E.unary("not", a), x, dtype="bool", compute=E.BOOL)


@lowering(aten.bitwise_not.default)
def _bitwise_not(ctx, x):
    if ctx.out_dtype == "bool":
        return _not(ctx, x)
    return elementwise(ctx, lambda a: E.unary("bitnot", a), x)


@lowering(aten.signbit.default)
def _signbit(ctx, x):
    return ctx.b.map(lambda a: E.unary("signbit", a), x, dtype="bool", compute=COMPUTE[x.dtype])


def _binary(op):
    def lower(ctx, x, y, alpha=1):
        def fn(a, b):
            if alpha != 1:
                b = _int64_checked(ctx, "mul", b, E.const(alpha, b.dtype))
            return _int64_checked(ctx, op, a, b)
        return elementwise(ctx, fn, x, y)
    return lower


def _int64_checked(ctx, op: str, a: E.Expr, b: E.Expr) -> E.Expr:
    """``a op b``; for int64 results computed in int32, raise on the device when the result overflows."""
    r = E.binary(op, a, b)
    if ctx.out_dtype != "int64" or op not in ("add", "sub", "mul"):
        return r
    zero = E.const(0, E.I32)
    if op == "mul":
        exact = E.binary("eq", E.binary("idiv", r, a), b)
        min_by_minus_one = E.binary("and", E.binary("eq", a, E.const(-1, E.I32)),
                                    E.binary("eq", b, E.const(-(2**31), E.I32)))
        ok = E.binary("or", E.binary("eq", a, zero), E.binary("and", exact, E.unary("not", min_by_minus_one)))
    else:
        grows = E.binary("ge", r, a) if op == "add" else E.binary("le", r, a)
        shrinks = E.binary("lt", r, a) if op == "add" else E.binary("gt", r, a)
        ok = E.binary("or", E.binary("and", E.binary("ge", b, zero), grows),
                      E.binary("and", E.binary("lt", b, zero), shrinks))
    return ctx.b.check(r, ok, f"int64 {op} overflowed the int32 range the device computes int64 in "
                              f"({ctx.node.target})")


for _op, _name in {aten.add: "add", aten.sub: "sub", aten.mul: "mul"}.items():
    lowering(_op.Tensor, _op.Scalar)(_binary(_name))
lowering(aten.maximum.default)(_binary("maximum"))
lowering(aten.minimum.default)(_binary("minimum"))
lowering(aten.atan2.default)(_binary("atan2"))
lowering(aten.fmod.Tensor, aten.fmod.Scalar)(_binary("fmod"))
lowering(aten.remainder.Tensor, aten.remainder.Scalar)(_binary("remainder"))


@lowering(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div(ctx, x, y, rounding_mode=None):
    if rounding_mode is None:
        return elementwise(ctx, lambda a, b: E.binary("div", a, b), x, y, compute=E.F32)
    if rounding_mode == "floor":
        return elementwise(ctx, lambda a, b: E.binary("floordiv", a, b), x, y)
    if COMPUTE[ctx.out_dtype] == E.I32:
        return elementwise(ctx, lambda a, b: E.binary("idiv", a, b), x, y)  # i32 division truncates
    return elementwise(ctx, lambda a, b: E.unary("trunc", E.binary("div", a, b)), x, y)


def _compare(op):
    def lower(ctx, x, y):
        return elementwise(ctx, lambda a, b: E.binary(op, a, b), x, y, compute=promoted(x, y))
    return lower


for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    lowering(getattr(aten, _op).Tensor, getattr(aten, _op).Scalar)(_compare(_op))
for _op, _name in {"logical_and": "and", "logical_or": "or", "logical_xor": "xor"}.items():
    lowering(getattr(aten, _op).default)(
        lambda ctx, x, y, _n=_name: ctx.b.map(lambda a, b: E.binary(_n, a, b), x, y, dtype="bool",
                                             compute=promoted(x, y)))


def _bitwise(op):
    """Logical on bools; on integers bitwise in i32 (int64 values there are sign-extended, so exact)."""
    def lower(ctx, x, y):
        if ctx.out_dtype == "bool":
            return elementwise(ctx, lambda a, b: E.binary(op, a, b), x, y, compute=E.BOOL)
        return elementwise(ctx, lambda a, b: E.binary("bit" + op, a, b), x, y)
    return lower


for _name in ("and", "or", "xor"):
    _op = getattr(aten, f"bitwise_{_name}")
    lowering(_op.Tensor, _op.Scalar)(_bitwise(_name))


@lowering(aten.copysign.Tensor, aten.copysign.Scalar)
def _copysign(ctx, x, y):
    def fn(a, b):
        magnitude = E.unary("abs", a)
        return E.where(E.unary("signbit", b), E.unary("neg", magnitude), magnitude)
    return elementwise(ctx, fn, x, y, compute=E.F32)


def _nan_ignoring(op):
    """fmax / fmin: like maximum / minimum, but a NaN loses to a number."""
    def lower(ctx, x, y):
        def fn(a, b):
            if a.dtype != E.F32:
                return E.binary(op, a, b)
            return E.where(E.unary("isnan", a), b, E.where(E.unary("isnan", b), a, E.binary(op, a, b)))
        return elementwise(ctx, fn, x, y)
    return lower


lowering(aten.fmax.default)(_nan_ignoring("maximum"))
lowering(aten.fmin.default)(_nan_ignoring("minimum"))


@lowering(aten.round.decimals)
def _round_decimals(ctx, x, decimals=0):
    """As eager's kernel: round(x * 10^d) / 10^d, or round(x / 10^-d) * 10^-d for negative d."""
    scale = E.const(10.0 ** abs(decimals), E.F32)
    inner, outer = ("mul", "div") if decimals >= 0 else ("div", "mul")
    return elementwise(ctx, lambda a: E.binary(outer, E.unary("round", E.binary(inner, a, scale)), scale), x)


@lowering(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(ctx, x, y):
    if isinstance(y, (int, float)) and not isinstance(y, bool) and COMPUTE[ctx.out_dtype] == E.F32:
        special = {1: lambda a: a, 2: lambda a: E.mul(a, a), 3: lambda a: E.mul(E.mul(a, a), a),
                   0.5: lambda a: E.unary("sqrt", a), -0.5: lambda a: E.unary("rsqrt", a),
                   -1: lambda a: E.unary("reciprocal", a), 0: lambda a: E.const(1.0, E.F32)}
        if y in special:
            return elementwise(ctx, special[y], x)
    if COMPUTE[ctx.out_dtype] != E.F32:
        raise NotImplementedError("integer pow")
    return elementwise(ctx, lambda a, b: E.binary("pow", a, b), x, y)


@lowering(torch.ops.prims.fma.default)
def _fma(ctx, x, y, z):  # torch.optim's compiled lerp / addcmul decompose to it
    return elementwise(ctx, E.fma, x, y, z)


@lowering(aten.where.self)
def _where(ctx, cond, x, y):
    compute = COMPUTE[ctx.out_dtype]
    return ctx.b.map(lambda c, a, b: E.where(E.cast(c, E.BOOL), E.cast(a, compute), E.cast(b, compute)),
                     cond, x, y, dtype=ctx.out_dtype, compute="keep", label="where")


@lowering(aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
          aten.clamp_min.Tensor, aten.clamp_max.Tensor)
def _clamp(ctx, x, lo=None, hi=None):
    target = ctx.node.target
    if target in (aten.clamp_max.default, aten.clamp_max.Tensor):
        lo, hi = None, lo
    operands = [x] + [v for v in (lo, hi) if v is not None]

    def fn(a, *bounds):
        it = iter(bounds)
        if lo is not None:
            a = E.binary("maximum", a, next(it))
        if hi is not None:
            a = E.binary("minimum", a, next(it))
        return a

    return elementwise(ctx, fn, *operands)


@lowering(aten.relu.default)
def _relu(ctx, x):
    return elementwise(ctx, lambda a: E.where(E.binary("gt", a, E.const(0, a.dtype)), a,
                                              E.where(E.unary("isnan", a), a, E.const(0, a.dtype))) if a.dtype == E.F32
                       else E.binary("maximum", a, E.const(0, a.dtype)), x)


@lowering(aten.silu.default)
def _silu(ctx, x):
    return elementwise(ctx, lambda a: E.mul(a, E.unary("sigmoid", a)), x)


@lowering(aten.gelu.default)
def _gelu(ctx, x, approximate="none"):
    half = E.const(0.5, E.F32)

    def exact(a):
        return E.mul(E.mul(half, a),
                     E.add(E.const(1.0, E.F32), E.unary("erf", E.mul(a, E.const(math.sqrt(0.5), E.F32)))))

    def tanh(a):
        inner = E.mul(E.const(math.sqrt(2 / math.pi), E.F32),
                      E.add(a, E.mul(E.const(0.044715, E.F32), E.mul(E.mul(a, a), a))))
        return E.mul(E.mul(half, a), E.add(E.const(1.0, E.F32), E.unary("tanh", inner)))

    return elementwise(ctx, tanh if approximate == "tanh" else exact, x)


@lowering(aten.leaky_relu.default)
def _leaky_relu(ctx, x, slope=0.01):
    return elementwise(ctx, lambda a: E.where(E.binary("gt", a, E.const(0.0, E.F32)), a,
                                              E.mul(a, E.const(slope, E.F32))), x)


@lowering(aten.hardtanh.default)
def _hardtanh(ctx, x, lo=-1.0, hi=1.0):
    return elementwise(ctx, lambda a: E.binary("minimum", E.binary("maximum", a, E.const(lo, a.dtype)),
                                               E.const(hi, a.dtype)), x)


@lowering(aten.elu.default)
def _elu(ctx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    def fn(a):
        neg = E.mul(E.const(alpha, E.F32), E.unary("expm1", E.mul(a, E.const(input_scale, E.F32))))
        return E.mul(E.const(scale, E.F32), E.where(E.binary("gt", a, E.const(0.0, E.F32)), a, neg))
    return elementwise(ctx, fn, x)


@lowering(aten._to_copy.default, aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default,
          aten.detach.default)
def _copy(ctx, x, **kwargs):
    return ctx.b.map(lambda a: _converted(a, ctx.out_dtype), x, dtype=ctx.out_dtype, compute=COMPUTE[x.dtype],
                     label="copy")


@lowering(aten.copy.default)
def _copy_into(ctx, dst, src, non_blocking=False):
    return ctx.b.map(lambda d, s: _converted(s, ctx.out_dtype), dst, src, dtype=ctx.out_dtype, compute="keep",
                     label="copy")


def _converted(e: E.Expr, dtype: str) -> E.Expr:
    """``e`` converted to logical ``dtype`` as torch converts: to the compute dtype, and to the nearest half
    precision value for bfloat16 and float16."""
    e = E.cast(e, COMPUTE[dtype])
    return E.unary(ROUND_TO[dtype], e) if dtype in ROUND_TO else e

