"""Shared WGSL rendering: storage types, binding declarations, the op table and expression emission.

Expressions arrive as plain tuples-of-nodes from ``meganeura.lowering.expr`` (duck-typed: ``op``, ``args``,
``dtype``), with loads already turned into ``read(slot, index)``. ``emit`` renders a DAG as ``let``
statements, one per distinct subexpression, so shared subtrees are computed once.

Index math is the per-element cost of a gather (a convolution's patch read inside its GEMM), so two forms are
cheapened where their form proves them safe: a division or remainder by a positive constant of an expression that
is non-negative by construction (coordinates, their sums, products and quotients) runs unsigned, a multiply-high
and a shift without the sign's corrections; and ``x >= 0 && x < n`` is one unsigned comparison. With the index
simplifier's unravel folding, on an H200 (untuned, GPU ms per inference call): ResNet-50 3.15 -> 2.91, SD U-Net
2.75 -> 2.30.
"""
from __future__ import annotations

import math
import struct

from .sizes import ceil_div, is_size, size_min
from .wgsl_functions import HELPER_DEPS, HELPERS

# Storage kind -> WGSL element type of its buffers. Half precisions are two to a u32 word (see ``HALF_HELPERS``).
STORAGE_TYPE = {"f32": "f32", "i32": "i32", "bool": "u32", "u32": "u32", "bf16": "u32", "f16": "u32"}
HALF_STORAGE = ("bf16", "f16")
VALUE_TYPE = {"f32": "f32", "i32": "i32", "bool": "bool"}
STATUS_VAR = "mg_status"
# A dynamic graph's size buffer: a uniform array of vec4s, the value of symbol k (``sizes``) at component k % 4 of
# element k / 4, bound in a group of its own (group 1), so that it takes none of a kernel's storage bindings.
SIZES_VAR = "mg_sizes"
SIZES_GROUP = 1
# Kernels cut their work (K of a matmul, long rows of a reduction, attention's other sequence) into slices merged by
# a second pass until the first pass has this many workgroups: on an H200 splits past about 1,000 workgroups gained
# nothing (Whisper's 1500x1536 @ 1536x384 196 -> 122 us from split 1 to 4; 50x720 @ 720x2048 43.5 -> 27.6 us).
SPLIT_TARGET_WORKGROUPS = 1024
# Not a wgpu limit: set in a device's limits when its adapter has the "subgroup" feature, so that kernel generators
# may use subgroup operations (whatever the subgroup size).
SUBGROUP_OPS = "meganeura-subgroup-ops"

# op -> format string over arguments {0}, {1}, {2}; helpers named in the string are emitted on demand.
FLOAT_OPS = {
    "neg": "(-{0})", "abs": "abs({0})", "exp": "mg_exp({0})", "exp2": "mg_exp2({0})", "expm1": "mg_expm1({0})",
    "log": "mg_log({0})", "log2": "mg_log2({0})",
    "log10": "mg_log10({0})",
    "log1p": "mg_log1p({0})", "sqrt": "sqrt({0})", "rsqrt": "inverseSqrt({0})", "sin": "sin({0})",
    "cos": "cos({0})", "tan": "tan({0})", "asin": "mg_asin({0})", "acos": "mg_acos({0})", "atan": "mg_atan({0})",
    "sinh": "mg_sinh({0})", "cosh": "mg_cosh({0})", "tanh": "mg_tanh({0})", "asinh": "asinh({0})",
    "acosh": "acosh({0})", "atanh": "atanh({0})", "erf": "mg_erf({0})", "erfc": "mg_erfc({0})",
    "sigmoid": "mg_sigmoid({0})", "floor": "floor({0})", "ceil": "ceil({0})", "round": "round({0})",
    "trunc": "trunc({0})",
    "round_bf16": "mg_round_bf16({0})", "round_f16": "mg_round_f16({0})",
    "sign": "mg_sign({0})", "reciprocal": "(1.0 / {0})", "frac": "({0} - trunc({0}))",
    "isnan": "mg_isnan({0})", "isinf": "mg_isinf({0})", "isfinite": "(!mg_isnan({0}) && !mg_isinf({0}))",
    "signbit": "((bitcast<u32>({0}) & 0x80000000u) != 0u)",
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    "pow": "mg_pow({0}, {1})", "maximum": "mg_max({0}, {1})", "minimum": "mg_min({0}, {1})",
    "fmod": "({0} % {1})", "remainder": "mg_remainder({0}, {1})", "floordiv": "mg_floordiv({0}, {1})",
    "atan2": "mg_atan2({0}, {1})", "fma": "fma({0}, {1}, {2})",
}
INT_OPS = {
    "neg": "(-{0})", "abs": "abs({0})", "sign": "sign({0})",
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "idiv": "({0} / {1})", "imod": "({0} % {1})",
    "floordiv": "mg_ifloordiv({0}, {1})", "remainder": "mg_iremainder({0}, {1})", "fmod": "mg_ifmod({0}, {1})",
    "maximum": "max({0}, {1})", "minimum": "min({0}, {1})", "uniform": "mg_uniform({0}, {1}, {2}, {3})",
    "fma": "({0} * {1} + {2})", "bitand": "({0} & {1})", "bitor": "({0} | {1})", "bitxor": "({0} ^ {1})",
    "bitnot": "(~{0})", "signbit": "({0} < 0i)",
}
COMPARE_OPS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
BOOL_OPS = {"and": "({0} && {1})", "or": "({0} || {1})", "xor": "({0} != {1})", "not": "(!{0})",
            "eq": "({0} == {1})", "ne": "({0} != {1})", "maximum": "({0} || {1})", "minimum": "({0} && {1})",
            "mul": "({0} && {1})", "add": "({0} || {1})"}  # torch's bool * and + (isfinite's decomposition)


def literal(value, dtype: str) -> str:
    if dtype == "bool":
        return "true" if value else "false"
    if dtype == "i32":
        if not -(2**31) <= value < 2**31:
            raise ValueError(f"integer constant {value} does not fit in int32")
        return f"i32({value + 1} - 1)" if value == -(2**31) else f"{value}i"
    if math.isnan(value):
        return "bitcast<f32>(0x7fc00000u)"
    if math.isinf(value) or abs(value) >= 3.4028235677973366e38:
        return "bitcast<f32>(0xff800000u)" if value < 0 else "bitcast<f32>(0x7f800000u)"
    text = repr(struct.unpack("<f", struct.pack("<f", value))[0])
    if "e" not in text and "." not in text:
        text += ".0"
    return text + "f"


def binding_decls(bindings) -> str:
    """``bindings``: list of (slot, name, storage type) -> WGSL declarations, all storage read_write."""
    lines = []
    for slot, name, stype in bindings:
        lines.append(f"@group(0) @binding({slot}) var<storage, read_write> {name}: array<{stype}>;")
    return "\n".join(lines)


def helpers_for(code: str) -> str:
    """WGSL source of the helper functions that ``code`` calls (with their dependencies)."""
    needed = []

    def add(name):
        for dep in HELPER_DEPS.get(name, []):
            add(dep)
        if name not in needed:
            needed.append(name)

    for name in HELPERS:
        if name + "(" in code:
            add(name)
    return "\n".join(HELPERS[n] for n in needed)


class Emitter:
    """Renders expressions to WGSL ``let`` statements, sharing equal subexpressions."""

    def __init__(self, coord_names, acc_names=(), buffer_names=None, indent="  "):
        self.coord_names = list(coord_names)
        self.acc_names = list(acc_names)
        self.buffer_names = buffer_names or (lambda slot: f"b{slot}")
        self.indent = indent
        self.lines: list[str] = []
        self._names: dict = {}
        self._signs: dict = {}  # i32 expression -> whether it is known to be at least 0
        self._count = 0

    def known(self, e, text: str) -> None:
        """Render ``e`` as ``text`` (a value the caller has in scope, such as a component of a vec4 load)."""
        self._names[e] = text

    def value(self, e) -> str:
        """WGSL for ``e`` (a name or an inline leaf), emitting any statements it needs."""
        if e in self._names:
            return self._names[e]
        if e.op == "const":
            return literal(e.args[0], e.dtype)
        if e.op == "coord":
            return self.coord_names[e.args[0]]
        if e.op == "acc":
            return self.acc_names[e.args[0]]
        text = size_i32(e.args[0].size) if e.op == "size" else self._render(e)
        name = f"t{self._count}"
        self._count += 1
        self.lines.append(f"{self.indent}let {name}: {VALUE_TYPE[e.dtype]} = {text};")
        self._names[e] = name
        return name

    def _render(self, e) -> str:
        op, dt = e.op, e.dtype
        if op == "read":
            slot, index, *half = e.args
            if half:  # two elements to a word: the word, then the element's half of it
                at = f"u32({self.value(index)})"
                return f"mg_widen_{half[0]}({self.buffer_names(slot)}[{at} >> 1u], {at} & 1u)"
            ref = f"{self.buffer_names(slot)}[{self.value(index)}]"
            return f"({ref} != 0u)" if dt == "bool" else ref
        if op == "call":  # a WGSL function the kernel defines beside its prelude (lowering.slice_merges)
            name, *args = e.args
            return f"{name}({', '.join(self.value(a) for a in args)})"
        if op == "check":
            value, cond, code = e.args
            c = self.value(cond)
            self.lines.append(f"{self.indent}if (!{c}) {{ atomicMax(&{STATUS_VAR}[0], {int(code)}u); }}")
            return self.value(value)
        if op == "cast":
            return _cast(self.value(e.args[0]), e.args[0].dtype, dt)
        if op == "where":
            c, a, b = (self.value(x) for x in e.args)
            return f"select({b}, {a}, {c})"
        if op == "and" and (bounded := _range_check(*e.args)) is not None:
            return f"(u32({self.value(bounded[0])}) < {bounded[1]}u)"  # 0 <= x < n in one unsigned comparison
        if op in ("idiv", "imod") and dt == "i32" and _positive_constant(e.args[1]) and self._non_negative(e.args[0]):
            # unsigned: a division by a constant is a multiply-high and a shift, without the sign's corrections
            return f"i32(u32({self.value(e.args[0])}) {'/' if op == 'idiv' else '%'} {e.args[1].args[0]}u)"
        args = [self.value(a) for a in e.args if not isinstance(a, (int, float, str))]
        if op in COMPARE_OPS and e.args[0].dtype != "bool":
            return f"({args[0]} {COMPARE_OPS[op]} {args[1]})"
        table = {"f32": FLOAT_OPS, "i32": INT_OPS, "bool": BOOL_OPS}[e.args[0].dtype if e.args else dt]
        if op in ("isnan", "isinf", "isfinite") and e.args[0].dtype != "f32":
            return "false" if op != "isfinite" else "true"
        if op not in table:
            raise NotImplementedError(f"no WGSL for {op} on {e.args[0].dtype if e.args else dt}")
        return table[op].format(*args)

    def _non_negative(self, e) -> bool:
        """Whether an i32 expression is at least 0 by its form: coordinates, non-negative constants, and sums,
        products, quotients, remainders, minima of such (maxima of any with one such)."""
        known = self._signs.get(e)
        if known is None:
            if e.op == "const":
                known = e.args[0] >= 0
            elif e.op in ("coord", "size"):
                known = True
            elif e.op in ("add", "mul", "idiv", "imod", "minimum"):
                known = all(self._non_negative(a) for a in e.args)
            elif e.op == "maximum":
                known = any(self._non_negative(a) for a in e.args)
            else:
                known = False
            self._signs[e] = known
        return known


def _positive_constant(e) -> bool:
    return e.op == "const" and e.args[0] > 0


def _range_check(a, b):
    """(x, n) where ``a and b`` is ``x >= 0 and x < n`` (either order) for an i32 x and a constant n > 0, else None."""
    for low, high in ((a, b), (b, a)):
        if (low.op == "ge" and high.op == "lt" and low.args[0] == high.args[0] and low.args[0].dtype == "i32"
                and low.args[1].op == "const" and low.args[1].args[0] == 0 and _positive_constant(high.args[1])):
            return low.args[0], high.args[1].args[0]
    return None


def _cast(x: str, src: str, dst: str) -> str:
    if src == dst:
        return x
    if dst == "bool":
        return f"({x} != {'0.0' if src == 'f32' else '0i'})"
    if src == "bool":
        return f"select({'0.0, 1.0' if dst == 'f32' else '0i, 1i'}, {x})"
    return f"{VALUE_TYPE[dst]}({x})"


def store(value: str, dtype: str) -> str:
    """Convert a computed value to its storage representation."""
    return f"select(0u, 1u, {value})" if dtype == "bool" else value


def size_i32(x) -> str:
    """WGSL i32 text of a size: a literal, or a symbolic size over the plan's size buffer."""
    return f"{x}i" if isinstance(x, int) else x.wgsl(lambda k: f"{SIZES_VAR}[{k // 4}][{k % 4}]")


def sizes_declaration(symbols: int) -> str:
    """The declaration of the size buffer of a plan over ``symbols`` symbols (``SIZES_VAR``)."""
    return (f"@group({SIZES_GROUP}) @binding(0) var<uniform> {SIZES_VAR}: "
            f"array<vec4<i32>, {sizes_vec4s(symbols)}>;\n")


def sizes_vec4s(symbols: int) -> int:
    return max(-(-symbols // 4), 1)


def size_u32(x) -> str:
    return f"{x}u" if isinstance(x, int) else f"u32({size_i32(x)})"


SIZE_INIT = "// mg-init: "  # marks a private variable that ``with_size_inits`` sets at the top of ``main``


def size_constant(name: str, value, kind: str = "u32") -> str:
    """The module-scope declaration of a kernel's size ``name`` of WGSL type ``kind`` ("u32" or "i32"): a ``const``
    where it is a number; where it is symbolic, a private variable that ``with_size_inits`` sets from the size
    buffer (or from the workgroup counts: ``value`` may be WGSL text) when ``main`` starts."""
    if isinstance(value, str) or is_size(value):
        text = value if isinstance(value, str) else size_u32(value) if kind == "u32" else size_i32(value)
        return f"var<private> {name}: {kind};  {SIZE_INIT}{text}\n"
    return f"const {name}: {kind} = {size_u32(value) if kind == 'u32' else size_i32(value)};\n"


def grid_constants(grid) -> str:
    """GRID_X and GRID_XY (workgroups in x, and in an x-y layer) of a kernel over a folded ``grid``."""
    if is_size(grid[0]):
        return size_constant("GRID_X", "nwg.x") + size_constant("GRID_XY", "nwg.x * nwg.y")
    return f"const GRID_X: u32 = {grid[0]}u;\nconst GRID_XY: u32 = {grid[0] * grid[1]}u;\n"


def with_size_inits(source: str, symbols: int) -> str:
    """``source`` with its symbolic sizes (``size_constant``) set at the top of ``main``, which then takes the
    workgroup counts where anything reads them (``nwg``), and the size buffer declared where it is read."""
    if f"{SIZES_VAR}[" in source:
        source = sizes_declaration(symbols) + source
    inits = [line.split(SIZE_INIT) for line in source.splitlines() if SIZE_INIT in line]
    if not inits and "nwg." not in source:
        return source
    close = _closing_paren(source, source.index("fn main(") + len("fn main"))
    params = "" if "num_workgroups" in source else f", {NUM_WORKGROUPS}"
    body = source.index("{", close) + 1
    sets = "".join(f"\n  {decl.split()[1].rstrip(':')} = {text};" for decl, text in inits)
    return source[:close] + params + source[close:body] + sets + source[body:]


def grid(groups, max_per_dim: int) -> tuple:
    """Fold a 1-D workgroup count into (x, y, 1) with x, y within the per-dimension limit. A symbolic count folds
    when the plan runs (the kernel's ``flat_workgroup(max_per_dim)`` reads either form)."""
    if is_size(groups):
        return size_min(groups, max_per_dim), ceil_div(groups, max_per_dim), 1
    groups = max(groups, 1)
    if groups <= max_per_dim:
        return groups, 1, 1
    y = -(-groups // max_per_dim)
    if y > max_per_dim:
        raise ValueError(f"{groups} workgroups exceed the device limit of {max_per_dim}² per dispatch")
    return max_per_dim, y, 1


def _closing_paren(text: str, opening: int) -> int:
    depth = 0
    for at in range(opening, len(text)):
        depth += {"(": 1, ")": -1}.get(text[at], 0)
        if depth == 0:
            return at
    raise ValueError("unbalanced parentheses in a kernel's entry point")


NUM_WORKGROUPS = "@builtin(num_workgroups) nwg: vec3<u32>"  # the entry point's parameter a symbolic grid reads


def flat_workgroup(gx) -> str:
    """WGSL expression for the linear workgroup index under ``grid``'s folding (needs ``wid``); under a symbolic x
    count, the entry point takes ``NUM_WORKGROUPS`` too."""
    if is_size(gx):
        return "(wid.x + wid.y * nwg.x)"
    return "wid.x" if gx == 1 else f"(wid.x + wid.y * {gx}u)"


def unravel_lines(var: str, names, shape, indent="  ") -> list[str]:
    """``let`` lines binding ``names[d]`` to the row-major coordinates of i32 ``var`` in ``shape``."""
    lines, stride = [], 1
    strides = []
    for s in reversed(shape):
        strides.append(stride)
        stride *= s
    strides.reverse()
    for d, (name, s, st) in enumerate(zip(names, shape, strides)):
        expr = var if st == 1 else f"({var} / {size_i32(st)})"
        if d > 0 and s != 1:
            expr = f"({expr} % {size_i32(s)})"
        if s == 1:
            expr = "0i"
        lines.append(f"{indent}let {name}: i32 = {expr};")
    return lines
