"""Scalar expression trees: the body of every fused kernel, as plain, hashable data.

An ``Expr`` computes one element. Its leaves are constants, symbolic sizes (``size``: a dynamic graph's, read from
the plan's size buffer), iteration coordinates (``coord``), reduction or matmul accumulators (``acc``) and loads. Before
planning a load names an IR value and gives one coordinate expression per dimension of that value (``load``); after
planning it names a binding slot and a linear element index (``read``). Expressions are hash-consed by structure, so
equal subtrees compare equal cheaply and code generation can share them.

Compute dtypes: ``f32``, ``i32`` and ``bool``. Integer index math is i32 (tensors are bounded by 2**31 elements).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

from meganeura.kernels.sizes import Size

F32, I32, BOOL = "f32", "i32", "bool"

UNARY_FLOAT = {
    "neg", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "sigmoid",
    "floor", "ceil", "round", "trunc", "sign", "reciprocal", "isnan", "isinf", "isfinite", "frac", "signbit",
    "round_bf16", "round_f16",  # to the nearest bfloat16 / float16 (ties to even), kept in f32
}
UNARY_BOOL_RESULT = {"isnan", "isinf", "isfinite", "signbit"}
BITWISE = {"bitand", "bitor", "bitxor", "bitnot"}  # on i32 (int64 values that fit, sign-extended: exact)
BINARY_ARITH = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "fmod", "remainder", "floordiv", "atan2"}
BINARY_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge"}
BINARY_LOGIC = {"and", "or", "xor"}
INDEX_OPS = {"idiv", "imod"}  # i32 division and remainder of non-negative index math (truncating)


class Expr:
    """An immutable expression node. Build with the helpers below, never mutate."""

    # _loads, _size, _depth, _checks: caches of loads_of, size, depth and has_check (fusion passes ask again and again)
    __slots__ = ("op", "args", "dtype", "_hash", "_loads", "_size", "_depth", "_checks")

    def __init__(self, op: str, args: tuple, dtype: str):
        self.op = op
        self.args = args
        self.dtype = dtype
        self._hash = hash((op, dtype, args))
        self._loads = self._size = self._depth = self._checks = None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Expr) or self._hash != other._hash:
            return False
        return self.op == other.op and self.dtype == other.dtype and self.args == other.args

    def __repr__(self) -> str:
        if self.op == "const":
            return repr(self.args[0])
        if self.op == "coord":
            return f"c{self.args[0]}"
        if self.op == "acc":
            return f"acc{self.args[0]}"
        inner = ", ".join(repr(a) for a in self.args)
        return f"{self.op}({inner})"

    def children(self) -> Iterable["Expr"]:
        return _flat_args(self.args)


class SizeLeaf:
    """A symbolic size (``meganeura.kernels.sizes.Size``) inside an expression, compared and hashed by its structure
    (comparing the Size itself would be a decision, recorded as a guard)."""

    __slots__ = ("size", "_key")

    def __init__(self, size: Size):
        self.size, self._key = size, size.key()

    def __eq__(self, other) -> bool:
        return isinstance(other, SizeLeaf) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"size{self.size!r}"


# ----------------------------------------------------------------------------------------- leaves
def const(value, dtype: str) -> Expr:
    if isinstance(value, Size):  # read from the plan's size buffer when the kernel runs
        return cast(Expr("size", (SizeLeaf(value),), I32), dtype)
    if dtype == F32:
        value = float(value)
    elif dtype == I32:
        value = int(value)
    else:
        value = bool(value)
    return Expr("const", (value,), dtype)


def coord(dim: int) -> Expr:
    return Expr("coord", (dim,), I32)


def acc(i: int, dtype: str = F32) -> Expr:
    return Expr("acc", (i,), dtype)


def load(value_id: int, coords: tuple[Expr, ...], dtype: str) -> Expr:
    return Expr("load", (value_id, tuple(coords)), dtype)


def read(slot: int, index: Expr, dtype: str, storage: str = "") -> Expr:
    """Element ``index`` of the buffer bound at ``slot``; ``storage`` names a half precision ("bf16", "f16") that
    the kernel widens to f32 as it loads."""
    return Expr("read", (slot, index, storage) if storage else (slot, index), dtype)


def call(function: str, *args: Expr, dtype: str = F32) -> Expr:
    """A call of WGSL function ``function`` that the kernel defines beside its prelude, after planning (a read that
    merges an attention pass's slices as it loads: ``slice_merges``)."""
    return Expr("call", (function, *args), dtype)


def uniform(key0: Expr, key1: Expr, stream: int, counter: Expr) -> Expr:
    """A uniform float in [0, 1): element ``counter`` of random stream ``stream`` under the i32 key (key0, key1).

    Counter-based: the same key, stream and counter give the same number on every device and every run."""
    return Expr("uniform", (key0, key1, const(stream, I32), counter), F32)


def is_const(e: Expr, value=None) -> bool:
    return e.op == "const" and (value is None or e.args[0] == value)


# ------------------------------------------------------------------------------------- operators
def cast(x: Expr, dtype: str) -> Expr:
    if x.dtype == dtype:
        return x
    if x.op == "const":
        v = x.args[0]
        if dtype == I32 and isinstance(v, float) and not math.isfinite(v):
            return Expr("cast", (x,), dtype)
        return const(int(v) if dtype == I32 else v, dtype)
    return Expr("cast", (x,), dtype)


def unary(op: str, x: Expr) -> Expr:
    dtype = BOOL if op in UNARY_BOOL_RESULT else x.dtype
    if op == "not":
        return Expr("not", (cast(x, BOOL),), BOOL)
    return Expr(op, (x,), dtype)


def binary(op: str, x: Expr, y: Expr) -> Expr:
    if op in BINARY_COMPARE:
        return Expr(op, (x, y), BOOL)
    if op in INDEX_OPS and (x.dtype != I32 or y.dtype != I32):
        raise TypeError(f"{op} is index arithmetic on i32 only")
    if op in BINARY_LOGIC:
        return Expr(op, (cast(x, BOOL), cast(y, BOOL)), BOOL)
    if op in BITWISE and (x.dtype != I32 or y.dtype != I32):
        raise TypeError(f"{op} is on i32 only")
    if x.dtype != y.dtype:
        raise TypeError(f"binary {op} on mixed dtypes {x.dtype} and {y.dtype}: cast first")
    if x.dtype == I32:
        folded = _fold_int(op, x, y)
        if folded is not None:
            return folded
    return Expr(op, (x, y), x.dtype)


def where(c: Expr, a: Expr, b: Expr) -> Expr:
    if a.dtype != b.dtype:
        raise TypeError(f"where on mixed dtypes {a.dtype} and {b.dtype}")
    if is_const(c):
        return a if c.args[0] else b
    if a == b:
        return a
    return Expr("where", (cast(c, BOOL), a, b), a.dtype)


def fma(x: Expr, y: Expr, z: Expr) -> Expr:
    """x * y + z (one fused operation where the device has it)."""
    if not x.dtype == y.dtype == z.dtype:
        raise TypeError(f"fma on mixed dtypes {x.dtype}, {y.dtype}, {z.dtype}: cast first")
    return Expr("fma", (x, y, z), x.dtype)


def add(x, y):
    return binary("add", x, y)


def mul(x, y):
    return binary("mul", x, y)


def _fold_int(op: str, x: Expr, y: Expr):
    """Constant folding and identities for i32 index arithmetic."""
    if is_const(x) and is_const(y):
        a, b = x.args[0], y.args[0]
        if op == "add":
            return const(a + b, I32)
        if op == "sub":
            return const(a - b, I32)
        if op == "mul":
            return const(a * b, I32)
        if op in ("idiv", "floordiv") and b > 0 and a >= 0:
            return const(a // b, I32)
        if op in ("imod", "remainder") and b > 0 and a >= 0:
            return const(a % b, I32)
    if op == "add":
        if is_const(y, 0):
            return x
        if is_const(x, 0):
            return y
    if op == "sub" and is_const(y, 0):
        return x
    if op == "mul":
        if is_const(y, 1):
            return x
        if is_const(x, 1):
            return y
        if is_const(x, 0) or is_const(y, 0):
            return const(0, I32)
    if op in ("idiv", "floordiv") and is_const(y, 1):
        return x
    if op in ("imod", "remainder") and is_const(y, 1):
        return const(0, I32)
    return None


# ------------------------------------------------------------------------------------ traversal
def substitute(e: Expr, rewrite: Callable[[Expr], Expr | None], memo: dict | None = None) -> Expr:
    """Rebuild ``e`` bottom-up; ``rewrite(node)`` may return a replacement for a node (children first). Each node
    of ``e`` is rewritten once: where rebuilding a node folds it into one of its new children (``add(x, 0)`` is
    ``x``), that child is the result as it stands, not rewritten again (a coordinate renaming applied twice would
    rename a renamed coordinate)."""
    memo = {} if memo is None else memo  # id(node) -> its result
    kept = []  # the nodes visited, alive while their ids key ``memo`` (an id is not reused)

    def visit(node: Expr) -> Expr:
        found = memo.get(id(node))
        if found is not None:
            return found
        kept.append(node)
        rebuilt = node
        new_args = tuple([_visit_arg(a, visit) for a in node.args])
        if new_args != node.args:
            rebuilt = _rebuild(node, new_args)
            if any(rebuilt is child for child in _flat_args(new_args)):
                memo[id(node)] = rebuilt
                return rebuilt
        out = rewrite(rebuilt)
        out = rebuilt if out is None else out
        memo[id(node)] = out
        return out

    return visit(e)


def _visit_arg(a, visit):
    if isinstance(a, Expr):
        return visit(a)
    if isinstance(a, tuple):
        return tuple([visit(x) if isinstance(x, Expr) else x for x in a])
    return a


def _flat_args(args: tuple):
    for a in args:
        if isinstance(a, Expr):
            yield a
        elif isinstance(a, tuple):
            yield from (x for x in a if isinstance(x, Expr))


def _rebuild(node: Expr, args: tuple) -> Expr:
    if node.dtype == I32 and node.op in ("add", "sub", "mul", "idiv", "imod", "floordiv", "remainder"):
        return binary(node.op, args[0], args[1])
    if node.op == "where":
        return where(*args)
    return Expr(node.op, args, node.dtype)


def walk(e: Expr, skip=None) -> list[Expr]:
    """All distinct nodes of ``e``, children before parents; with ``skip`` (node -> bool), none of the nodes it
    holds for, nor their subtrees."""
    seen: set[int] = set()
    order: list[Expr] = []
    stack: list = [e]  # nodes to visit; a None above a node: its children are done, it comes next in ``order``
    push, pop = stack.append, stack.pop
    while stack:
        node = pop()
        if node is None:
            order.append(pop())
            continue
        if id(node) in seen or (skip is not None and skip(node)):
            continue
        seen.add(id(node))
        push(node)
        push(None)
        for child in node.children():
            if id(child) not in seen:
                push(child)
    return order


def loads_of(e: Expr) -> list[Expr]:
    """The distinct load nodes of ``e`` (computed once per expression: fusion passes ask again and again)."""
    if e._loads is None:
        _walk_once(e)
    return list(e._loads)


def size(e: Expr) -> int:
    if e._size is None:
        _walk_once(e)
    return e._size


def _walk_once(e: Expr) -> None:
    """``loads_of`` and ``size`` of ``e`` kept on it from one walk (fusion asks both of each new expression)."""
    nodes = walk(e)
    e._loads = tuple(n for n in nodes if n.op == "load")
    e._size = len(nodes)


def depth(e: Expr) -> int:
    """The longest path from ``e`` down to a leaf, in nodes (computed without recursion: it bounds recursion; kept
    on each node, so a node asked again, or inside another asked later, is not walked again)."""
    if e._depth is None:
        for node in walk(e, lambda n: n._depth is not None):
            node._depth = 1 + max((c._depth for c in node.children()), default=0)
    return e._depth


def has_check(e: Expr) -> bool:
    """Whether ``e`` checks something (holds a ``check`` node), kept on each node as ``depth`` is."""
    if e._checks is None:
        for node in walk(e, lambda n: n._checks is not None):
            node._checks = node.op == "check" or any(c._checks for c in node.children())
    return e._checks


def shift_coords(e: Expr, mapping: dict[int, Expr]) -> Expr:
    """Replace coordinate ``d`` by ``mapping[d]`` (coordinates missing from the mapping stay)."""
    def rewrite(node):
        if node.op == "coord" and node.args[0] in mapping:
            return mapping[node.args[0]]
        return None

    return substitute(e, rewrite)
