"""The dynamic sizes of a graph that dynamo compiled with symbolic shapes, as ``meganeura.kernels.sizes`` symbols.

Dynamo hands a graph whose placeholders carry SymInt sizes (its automatic dynamic shapes, after a second distinct
shape, or ``dynamic=True``): tensors with symbolic dimensions, and SymInt arguments (``2*s27``). ``DynamicSizes.of``
finds the graph's sympy symbols and, for each, where a call's arguments hold its value (a tensor's dimension, or an
int argument); ``example`` gives the placeholders' sizes as ``Size`` polynomials over them, hinted with a call's
concrete values, for lowering; ``values`` reads a call's symbol values. A graph whose symbols cannot all be read
from its arguments, or whose sizes use a function we do not model, is compiled for concrete sizes, as before.

Sizes that an op's eager kernel requires equal though its meta function adds no guard for them (``EQUAL_SIZES``:
attention's key and value lengths) are taken as one where one of them is fixed: the other's symbol becomes that
size, guarded. A static KV cache whose length dynamo made symbolic (traced again at a second length, or marked where
it came back from a prefill as long as its prompt: ``per_call._may_come_back``) has its key length fixed by the
attention mask's, and its value length, left a symbol, would otherwise give the value cache's write other bounds and
another shape than the key cache's.

``output_dims_that_vary`` says which sizes of a graph's outputs may differ at later calls: those an output that
comes back as an input is marked dynamic in, and no others (each symbolic size costs guards run as Python).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
from torch.utils._sympy.functions import CleanDiv, FloorDiv, Max, Min, Mod, PythonMod

from meganeura.kernels import sizes as S

DYNAMO_LOWER_BOUND = 2  # dynamo specialises sizes 0 and 1: its dynamic sizes are at least 2
# Sizes an op's eager kernel checks equal (else it raises) that its meta function leaves unrelated: each op's
# (argument index, dimension) pairs, all equal. Attention's: the key's and the value's lengths.
EQUAL_SIZES = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: ((1, 2), (2, 2)),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ((2, 2), (3, 2)),
}


class NotModelled(Exception):
    """A symbolic size uses something ``to_size`` does not model."""


@dataclass(frozen=True)
class DynamicSizes:
    """The symbols of a graph: ``names[k]`` (sympy's, e.g. "s27") is symbol k, read from ``sources[k]``: (placeholder
    index, dimension) of a tensor, or (placeholder index, None) of an int argument. ``dynamic`` maps each placeholder
    with a symbolic size to its symbolic dimensions (None for an int argument)."""

    names: tuple[str, ...]
    sources: tuple[tuple[int, int | None], ...]
    lower: tuple[int, ...]
    dynamic: tuple[tuple[int, frozenset | None], ...]
    upper: tuple[int | None, ...] = ()  # declared largest values (an exported program's ranges): the plan's bounds
    fixed: tuple[tuple[str, int], ...] = ()  # (symbol, size) an op requires equal (``EQUAL_SIZES``): taken as one
    _dims: dict = field(init=False, compare=False, repr=False)  # ``dynamic`` as a dict, for ``abstract_item``

    def __post_init__(self):
        object.__setattr__(self, "_dims", dict(self.dynamic))  # (frozen: set once here)

    @staticmethod
    def of(gm: torch.fx.GraphModule, ranges: dict | None = None) -> "DynamicSizes | None":
        """The graph's symbols, or None where it has none, or one that no argument holds as it is. ``ranges`` (an
        exported program's ``range_constraints``) give each symbol's declared lower and upper bounds."""
        sources: dict[sympy.Symbol, tuple[int, int | None]] = {}
        wanted: set[sympy.Symbol] = set()
        lower: dict[sympy.Symbol, int] = {}
        dynamic = []
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            dims = _symbolic_dims(node.meta.get("val"))
            if dims:
                dynamic.append((i, None if dims[0][0] is None else frozenset(d for d, _ in dims)))
            for d, expr in dims:
                wanted |= expr.free_symbols
                if isinstance(expr, sympy.Symbol):
                    sources.setdefault(expr, (i, d))
                    lower[expr] = _lower_bound(node.meta.get("val"), d)
        if not wanted or wanted - set(sources):
            return None
        order = sorted(wanted, key=lambda s: sources[s])
        declared = {str(s): r for s, r in (ranges or {}).items()}
        lows = tuple(_declared(declared.get(str(s)), "lower", lower[s]) for s in order)
        highs = tuple(_declared(declared.get(str(s)), "upper", None) for s in order) if ranges is not None else ()
        return DynamicSizes(tuple(str(s) for s in order), tuple(sources[s] for s in order), lows, tuple(dynamic),
                            highs, _fixed_by_ops(gm))

    def abstract(self, key: tuple) -> tuple:
        """A call's signature (``compiled.signature``) with the symbolic sizes left out: what selects the plans
        that may serve it, whose guards then decide."""
        key = list(key)
        for i, _ in self.dynamic:
            key[i] = self.abstract_item(i, key[i])
        return tuple(key)

    def abstract_item(self, i: int, item):
        """Item ``i`` of a call's signature with its symbolic sizes left out (``abstract``)."""
        dims = self._dims.get(i, ())
        if dims is None:
            return None
        if not dims:
            return item
        shape, *rest = item
        return (tuple(None if d in dims else s for d, s in enumerate(shape)), *rest)

    def values(self, args) -> tuple[int, ...]:
        """The symbols' values in a call with placeholder values ``args``."""
        with torch._C.DisableTorchFunctionSubclass():  # (a kept tensor's shape: no override needed)
            return tuple(int(args[i]) if d is None else args[i].shape[d] for i, d in self.sources)

    def pin(self, args) -> list:
        """``args`` as they are, with every symbol's value recorded as a guard: a plan for these sizes alone."""
        for k, value in enumerate(self.values(args)):
            S.symbol(k, value).concrete()
        return list(args)

    def guards(self, args) -> S.Guards:
        """The guards of a compile for a call with placeholder values ``args`` (its symbols' hints), with the
        declared upper bounds as the plan's bounds where there are any."""
        bounds = {k: high for k, high in enumerate(self.upper) if high is not None}
        return S.Guards(dict(enumerate(self.lower)), dict(enumerate(self.values(args))), bounds)

    def example(self, gm: torch.fx.GraphModule, args) -> list:
        """``args`` with the sizes of tensors and the int arguments of the graph's placeholders as Sizes, hinted with
        this call's values: tensors as ``SymbolicExample``s."""
        by_name = self._fixed(dict(zip(self.names, self._unified(self.values(args)))))
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        out = []
        for node, arg in zip(placeholders, args):
            val = node.meta.get("val")
            if isinstance(arg, torch.Tensor) and isinstance(val, torch.Tensor):
                shape = tuple(to_size(_expr(s), by_name) if isinstance(s, torch.SymInt) else int(s) for s in val.shape)
                out.append(SymbolicExample(arg, shape))
            elif isinstance(val, torch.SymInt):
                out.append(to_size(_expr(val), by_name))
            else:
                out.append(arg)
        return out


    def _unified(self, hints: tuple) -> list[S.Size]:
        """Each symbol's Size, symbols of equal values taken as one, with a guard that they are equal (the plan's
        kernels then read one size, not one per tensor: dynamo gives each layer's KV cache a symbol of its own, 30
        where one serves, and 30 times the kernels). A call where they differ compiles another plan."""
        first: dict[int, S.Size] = {}
        sizes = []
        for k, h in enumerate(hints):
            own = S.symbol(k, h)
            if h in first:
                S.decide("eq", own, first[h])
            sizes.append(first.setdefault(h, own))
        return sizes

    def _fixed(self, by_name: dict) -> dict:
        """``by_name`` (symbol name -> Size) with each symbol that an op requires equal to a fixed size (``fixed``)
        made that size, guarded, where this call's value is that size (where it is not, eager raises): with it every
        symbol ``_unified`` took as one with it."""
        fixed = [by_name[name] for name, size in self.fixed if S.hint(by_name[name]) == size]
        return {name: S.concrete(size) if any(size is f for f in fixed) else size for name, size in by_name.items()}


def _fixed_by_ops(gm: torch.fx.GraphModule) -> tuple[tuple[str, int], ...]:
    """(symbol name, size) for each size of an op's operand (``EQUAL_SIZES``) that is a lone symbol where another
    size it must equal is fixed."""
    out = []
    for node in gm.graph.nodes:
        group = EQUAL_SIZES.get(node.target) if node.op == "call_function" else None
        if group is None:
            continue
        exprs = [_operand_size(node, i, d) for i, d in group]
        ints = {int(e) for e in exprs if isinstance(e, sympy.Integer)}
        if len(ints) == 1:
            out += [(str(e), *ints) for e in exprs if isinstance(e, sympy.Symbol)]
    return tuple(dict.fromkeys(out))


def _operand_size(node: torch.fx.Node, i: int, d: int):
    """Dimension ``d`` of operand ``i`` of ``node`` as a sympy expression (None where it has no tensor value)."""
    val = node.args[i].meta.get("val") if len(node.args) > i and isinstance(node.args[i], torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    size = val.shape[d]
    return _expr(size) if isinstance(size, torch.SymInt) else sympy.Integer(size)


@dataclass(frozen=True)
class SymbolicExample:
    """A call's tensor argument with its sizes as Sizes (``shape``): what lowering reads of it."""

    tensor: torch.Tensor
    shape: tuple

    @property
    def dtype(self):
        return self.tensor.dtype


def _declared(value_range, end: str, default):
    """A declared range's finite ``end`` ("lower" or "upper") as an int, else ``default``."""
    value = getattr(value_range, end, None)
    try:
        return int(value) if value is not None and value.is_finite else default
    except (TypeError, AttributeError):
        return default


def output_dims_that_vary(gm: torch.fx.GraphModule, fixed_inputs) -> list[tuple[int, ...]]:
    """Each output's dimensions (by position; none for a value that is not a tensor) whose size may differ at a later
    call, for dynamo to take as symbols where the output comes back as an input (``per_call._may_come_back``). In a
    graph with symbolic sizes, its symbolic ones: dynamo found what varies (the KV cache's length, one longer each
    decode step), and its other sizes (heads, head size) have not varied. In a graph traced with concrete sizes
    (dynamo's first trace of a frame), those of a size above 1 that an input other than ``fixed_inputs`` (the
    parameters and buffers, by placeholder index) has too: the call's data (a prompt's length, which the default
    cache's prefill returns its keys and values at). A size that only the graph makes (a static cache's
    ``max_cache_len``, its heads and head size) stays concrete: marked, each would cost guards run as Python at every
    call of the graph it comes back to; one that varies after all makes dynamo trace that graph again."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    returned = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    values = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None
              for n in (returned if isinstance(returned, (tuple, list)) else (returned,))]
    if any(_symbolic_dims(n.meta.get("val")) for n in placeholders):
        return [tuple(d for d, _ in _symbolic_dims(v)) if isinstance(v, torch.Tensor) else () for v in values]
    data = {int(s) for i, n in enumerate(placeholders) if i not in fixed_inputs and isinstance(n.meta.get("val"),
            torch.Tensor) for s in n.meta["val"].shape if int(s) > 1}
    return [tuple(d for d, s in enumerate(v.shape) if int(s) in data) if isinstance(v, torch.Tensor) else ()
            for v in values]


def _expr(s: torch.SymInt) -> sympy.Expr:
    return s.node.expr


def _symbolic_dims(val):
    if isinstance(val, torch.Tensor):
        return [(d, _expr(s)) for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt) and not _is_int(s)]
    if isinstance(val, torch.SymInt) and not _is_int(val):
        return [(None, _expr(val))]
    return []


def _is_int(s: torch.SymInt) -> bool:
    return isinstance(_expr(s), sympy.Integer)


def _lower_bound(val, d) -> int:
    s = val if d is None else val.shape[d]
    node = s.node
    try:
        low = node.shape_env.var_to_range[node.expr].lower
        return max(int(low), 0)
    except (KeyError, AttributeError, TypeError, ValueError):
        return DYNAMO_LOWER_BOUND


def to_size(expr: sympy.Expr, symbols: dict[str, S.Size]):
    """A sympy size expression as a ``Size`` over ``symbols`` (by name); raises NotModelled for what it cannot."""
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        if str(expr) not in symbols:
            raise NotModelled(f"symbol {expr} is not among the graph's")
        return symbols[str(expr)]
    args = [to_size(a, symbols) for a in expr.args]
    if isinstance(expr, sympy.Add):
        return sum(args[1:], args[0])
    if isinstance(expr, sympy.Mul):
        return S.product(args)
    if isinstance(expr, sympy.Pow) and isinstance(args[1], int) and args[1] >= 0:
        return S.product([args[0]] * args[1])
    if isinstance(expr, (FloorDiv, CleanDiv)):
        return S.floordiv(args[0], args[1])
    if isinstance(expr, (Mod, PythonMod)):
        return S.mod(args[0], args[1])
    if isinstance(expr, Max):
        return _fold(S.size_max, args)
    if isinstance(expr, Min):
        return _fold(S.size_min, args)
    raise NotModelled(f"size expression {expr} ({type(expr).__name__})")


def _fold(fn, args):
    out = args[0]
    for a in args[1:]:
        out = fn(out, a)
    return out
