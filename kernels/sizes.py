"""Sizes as values: tensor sizes that stay symbolic through a compile and are evaluated when a plan runs.

A ``Size`` is an integer polynomial over symbols (the dynamic dimensions of a graph, numbered from 0) and atoms
(a floor division, remainder, maximum or minimum of other sizes, kept whole), with a hint: its value at the sizes
the graph is being compiled for. Arithmetic with Sizes and ints gives Sizes, or plain ints where the symbols cancel.

Code that must decide something from a Size (a comparison, ``int()``, ``range()``, an f-string) gets the hint's
answer, and the answer is recorded as a guard in the active ``Guards``: the compiled plan holds for the sizes that
give every guard the same answer, and for no others (``Guards.check``). Code that was never taught about sizes thus
specialises a plan to the hint, correctly; code that was (index math over a size uniform, grids evaluated at replay)
keeps it general. A decision that the symbols' lower bounds settle (``s0 + 1 > 0``) records nothing.

The runtime evaluates Sizes from the symbols' values (``evaluator``), and kernels read them as WGSL over the
plan's size buffer (``Size.wgsl``). Sizes live in ``meganeura.kernels``, the package that the compiler and the
runtime both import; this module imports nothing.
"""
from __future__ import annotations

import contextlib
import operator

# Atom operators: name -> (Python evaluation, WGSL i32 form)
ATOM_OPS = {"floordiv": (operator.floordiv, "({a} / {b})"), "mod": (operator.mod, "({a} % {b})"),
            "max": (max, "max({a}, {b})"), "min": (min, "min({a}, {b})")}
_COMPARE = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
            "ne": operator.ne}


class SizeError(ValueError):
    """A size was decided outside a compile (no ``Guards`` recording), or sizes broke an invariant."""


class Size:
    """A symbolic integer size (see the module's docstring). Build symbols with ``symbol``; never mutate."""

    __slots__ = ("terms", "hint", "_hash")

    def __init__(self, terms: tuple, hint: int):
        self.terms = terms  # ((monomial, coefficient), ...) sorted; a monomial is a sorted tuple of atoms
        self.hint = hint
        self._hash = hash(terms)

    # ---- construction
    @staticmethod
    def _make(terms: dict, hint: int):
        items = tuple(sorted(((m, c) for m, c in terms.items() if c), key=lambda mc: _monomial_key(mc[0])))
        if not items:
            return 0
        if len(items) == 1 and items[0][0] == ():
            return items[0][1]
        return Size(items, hint)

    # ---- arithmetic
    def __add__(self, other):
        other = _terms_of(other)
        if other is None:
            return NotImplemented
        terms = dict(self.terms)
        for m, c in other[0].items():
            terms[m] = terms.get(m, 0) + c
        return Size._make(terms, self.hint + other[1])

    __radd__ = __add__

    def __neg__(self):
        return Size._make({m: -c for m, c in self.terms}, -self.hint)

    def __sub__(self, other):
        if not isinstance(other, (int, Size)):
            return NotImplemented
        return self + (-other)

    def __rsub__(self, other):
        return (-self) + other

    def __mul__(self, other):
        other = _terms_of(other)
        if other is None:
            return NotImplemented
        terms: dict = {}
        for m1, c1 in self.terms:
            for m2, c2 in other[0].items():
                m = tuple(sorted(m1 + m2, key=_atom_key))
                terms[m] = terms.get(m, 0) + c1 * c2
        return Size._make(terms, self.hint * other[1])

    __rmul__ = __mul__

    def __floordiv__(self, other):
        return floordiv(self, other)

    def __rfloordiv__(self, other):
        return floordiv(other, self)

    def __mod__(self, other):
        return mod(self, other)

    def __rmod__(self, other):
        return mod(other, self)

    # ---- decisions (guarded)
    def __lt__(self, other):
        return decide("lt", self, other)

    def __le__(self, other):
        return decide("le", self, other)

    def __gt__(self, other):
        return decide("gt", self, other)

    def __ge__(self, other):
        return decide("ge", self, other)

    def __eq__(self, other):
        if not isinstance(other, (int, Size)) or isinstance(other, bool):
            return NotImplemented
        return decide("eq", self, other)

    def __ne__(self, other):
        if not isinstance(other, (int, Size)) or isinstance(other, bool):
            return NotImplemented
        return decide("ne", self, other)

    def __bool__(self):
        return decide("ne", self, 0)

    def __int__(self):
        return self.concrete()

    __index__ = __int__

    def __float__(self):
        return float(self.concrete())

    def __format__(self, spec: str) -> str:
        return format(self.concrete(), spec)

    # Anything else a size meets (true division, powers, bit operations...) takes its concrete value.
    def __truediv__(self, other):
        return self.concrete() / other

    def __rtruediv__(self, other):
        return other / self.concrete()

    def __divmod__(self, other):
        return divmod(self.concrete(), other)

    def __rdivmod__(self, other):
        return divmod(other, self.concrete())

    def __pow__(self, other):
        return self.concrete() ** other

    def __abs__(self):
        return abs(self.concrete())

    def __round__(self, digits=None):
        return self.concrete()

    def __and__(self, other):
        return self.concrete() & other

    def __or__(self, other):
        return self.concrete() | other

    def __lshift__(self, other):
        return self.concrete() << other

    def __rshift__(self, other):
        return self.concrete() >> other

    def __getattr__(self, name: str):  # int's other methods (bit_length...) on the concrete value
        if not name.startswith("_") and hasattr(int, name):
            return getattr(self.concrete(), name)
        raise AttributeError(f"'Size' object has no attribute {name!r}")

    def __hash__(self):
        return self._hash

    def concrete(self) -> int:
        """The hint, guarded: the plan then holds only where this size equals it."""
        decide("eq", self, self.hint)
        return self.hint

    # ---- reading
    def __repr__(self) -> str:
        return self.python("s")

    def symbols(self) -> set[int]:
        out: set[int] = set()
        for m, _ in self.terms:
            for atom in m:
                out |= {atom} if isinstance(atom, int) else _symbols_of_atom(atom)
        return out

    def python(self, var: str) -> str:
        """A Python expression of the size over ``var[k]``, the value of symbol k (``var`` "s" reads as s[0]...)."""
        return _render(self, lambda k: f"{var}[{k}]", lambda c: str(c), "python")

    def wgsl(self, symbol) -> str:
        """An i32 WGSL expression of the size; ``symbol(k)`` is the WGSL text of symbol k's value."""
        return _render(self, symbol, lambda c: f"{c}i", "wgsl")

    def key(self) -> tuple:
        """The size's structure as plain data (equal for equal sizes; no decision): for hashing and comparing
        expressions that hold sizes."""
        return tuple((tuple(a if isinstance(a, int) else (a[0], _key(a[1]), _key(a[2])) for a in m), c)
                     for m, c in self.terms)

    def to_json(self):
        return [[[_atom_json(a) for a in m], c] for m, c in self.terms]


def _key(x):
    return x.key() if isinstance(x, Size) else x


def active() -> "Guards | None":
    """The guards of the compile under way, if any."""
    return _active[-1] if _active else None


def size_json(x):
    """``x`` as JSON data: an int, or a symbolic size's ``to_json`` form."""
    return x.to_json() if isinstance(x, Size) else x


def symbol(index: int, hint: int) -> Size:
    """Symbol ``index`` (a dynamic dimension), whose value at this compile is ``hint``."""
    return Size((((index,), 1),), hint)


def is_size(x) -> bool:
    return isinstance(x, Size)


def concrete(x) -> int:
    """``x``'s value at this compile, guarded (see ``Size.concrete``): for code that needs an int."""
    return x.concrete() if isinstance(x, Size) else x


def hint(x) -> int:
    """``x``'s value at this compile, unguarded: for estimates (costs, heuristics) only, never for a decision that
    changes what is computed."""
    return x.hint if isinstance(x, Size) else x


def from_json(data, hints) -> int | Size:
    """A size written by ``Size.to_json`` (or an int), its hint taken from ``hints[k]`` for symbol k. Read from a
    file: anything but ints, lists of them and the atom operators' names is refused (``SizeError``)."""
    if _is_int(data):
        return data
    if not isinstance(data, list):
        raise SizeError(f"a size is an int or a list of terms, not {type(data).__name__}")
    total = 0
    for term_data in data:
        if not (isinstance(term_data, list) and len(term_data) == 2 and isinstance(term_data[0], list)
                and _is_int(term_data[1])):
            raise SizeError(f"a size's term is [atoms, coefficient], not {term_data!r}")
        term = term_data[1]
        for atom in term_data[0]:
            term = term * _atom_from_json(atom, hints)
        total = total + term
    return total


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------------------------- atoms and helpers
def floordiv(a, b):
    """``a // b`` of non-negative sizes: exact where ``b`` is one term (a constant, or a monomial times one) that
    divides every term of ``a``, else an atom."""
    if not isinstance(a, Size) and not isinstance(b, Size):
        return a // b
    quotient = _exact_quotient(a, b)
    if quotient is not None:
        return quotient
    if not _non_negative(a) or not _positive(b):  # (WGSL's division truncates: only these agree with Python's)
        return concrete(a) // concrete(b)
    return _atom("floordiv", a, b)


def _exact_quotient(a, b):
    """``a / b`` where ``b`` is a single positive term dividing each term of ``a`` exactly, else None."""
    if isinstance(b, int):
        divisor, coef = (), b
    elif len(b.terms) == 1:
        divisor, coef = b.terms[0]
    else:
        return None
    if coef <= 0:
        return None
    terms = {}
    for m, c in (a.terms if isinstance(a, Size) else (((), a),)):
        rest = list(m)
        for atom in divisor:
            if atom not in rest:
                return None
            rest.remove(atom)
        if c % coef:
            return None
        terms[tuple(rest)] = c // coef
    return Size._make(terms, hint(a) // hint(b))


def mod(a, b):
    """``a % b`` of non-negative sizes (0 where ``b`` is a constant dividing every coefficient of ``a``)."""
    if not isinstance(a, Size) and not isinstance(b, Size):
        return a % b
    if isinstance(b, int) and b > 0 and isinstance(a, Size) and all(c % b == 0 for _, c in a.terms):
        return 0
    if not _non_negative(a) or not _positive(b):
        return concrete(a) % concrete(b)
    return _atom("mod", a, b)


def _non_negative(x) -> bool:
    low = lower_bound(x)
    return low is not None and low >= 0


def _positive(x) -> bool:
    low = lower_bound(x)
    return low is not None and low > 0


def ceil_div(a, b):
    """``-(-a // b)`` for a positive ``b``, symbolic where ``a`` or ``b`` is."""
    return floordiv(a + b - 1, b) if isinstance(a, Size) or isinstance(b, Size) else -(-a // b)


def size_max(a, b):
    """The larger of two sizes, without a decision (an atom where the bounds do not settle it)."""
    return _extreme("max", a, b)


def size_min(a, b):
    """The smaller of two sizes, without a decision."""
    return _extreme("min", a, b)


def _extreme(op: str, a, b):
    if not isinstance(a, Size) and not isinstance(b, Size):
        return ATOM_OPS[op][0](a, b)
    settled = _settled("ge" if op == "max" else "le", a, b)
    if settled is not None:
        return a if settled else b
    return _atom(op, a, b)


def product(values):
    out = 1
    for v in values:
        out = out * v
    return out


def _atom(op: str, a, b) -> Size:
    value = ATOM_OPS[op][0](hint(a), hint(b))
    return Size((((( op, a, b),), 1),), value)


def _terms_of(x):
    """(terms dict, hint) of an int or a Size; None for anything else."""
    if isinstance(x, Size):
        return dict(x.terms), x.hint
    if isinstance(x, int):
        return ({(): int(x)} if x else {}), int(x)
    return None


def _atom_key(atom):
    return (0, atom, "") if isinstance(atom, int) else (1, 0, repr(atom))


def _monomial_key(m):
    return (len(m), [_atom_key(a) for a in m])


def _symbols_of_atom(atom) -> set[int]:
    out: set[int] = set()
    for x in atom[1:]:
        if isinstance(x, Size):
            out |= x.symbols()
    return out


def _render(size: Size, symbol, number, style: str) -> str:
    parts = []
    for m, c in size.terms:
        factors = [symbol(a) if isinstance(a, int) else _render_atom(a, symbol, number, style) for a in m]
        if c != 1 or not factors:
            factors.append(number(c))
        parts.append(" * ".join(factors))
    return "(" + " + ".join(parts) + ")"


def _render_atom(atom, symbol, number, style: str) -> str:
    op, a, b = atom
    args = [_render(x, symbol, number, style) if isinstance(x, Size) else number(x) for x in (a, b)]
    if style == "python":
        return {"floordiv": "({a} // {b})", "mod": "({a} % {b})", "max": "max({a}, {b})",
                "min": "min({a}, {b})"}[op].format(a=args[0], b=args[1])
    return ATOM_OPS[op][1].format(a=args[0], b=args[1])


def _atom_json(atom):
    if isinstance(atom, int):
        return atom
    op, a, b = atom
    return [op, a.to_json() if isinstance(a, Size) else a, b.to_json() if isinstance(b, Size) else b]


def _atom_from_json(atom, hints):
    if _is_int(atom):
        if not 0 <= atom < len(hints):
            raise SizeError(f"size refers to symbol {atom}, of {len(hints)}")
        return symbol(atom, hints[atom])
    if not (isinstance(atom, list) and len(atom) == 3):
        raise SizeError(f"a size's atom is a symbol or [operator, size, size], not {atom!r}")
    op, a, b = atom
    if op not in ATOM_OPS:
        raise SizeError(f"unknown size operator {op!r}")
    a, b = from_json(a, hints), from_json(b, hints)
    return {"floordiv": floordiv, "mod": mod, "max": size_max, "min": size_min}[op](a, b)


# ------------------------------------------------------------------------------------------ decisions
def lower_bound(x) -> int | None:
    """A lower bound of ``x`` over every value of its symbols (each at least its ``Guards`` lower bound, default 0;
    atoms at least 0), where the polynomial's form gives one: no negative coefficient but the constant's. None
    otherwise."""
    if not isinstance(x, Size):
        return x
    lower = _active[-1].lower if _active else {}
    total = 0
    for m, c in x.terms:
        if c < 0 and m:
            return None
        term = c
        for atom in m:
            term *= lower.get(atom, 0) if isinstance(atom, int) else 0
        total += term
    return total


def _settled(op: str, a, b) -> bool | None:
    """The answer of ``a op b`` where the bounds of the symbols settle it for all their values, else None."""
    diff = a - b
    if not isinstance(diff, Size):
        return _COMPARE[op](diff, 0)
    low, negated = lower_bound(diff), lower_bound(-diff)
    if low is not None and low > 0:
        return op in ("gt", "ge", "ne")
    if low == 0 and op in ("lt", "ge"):
        return op == "ge"
    if negated is not None and negated > 0:
        return op in ("lt", "le", "ne")
    if negated == 0 and op in ("gt", "le"):
        return op == "le"
    return None


def decide(op: str, a, b) -> bool:
    """``a op b`` for sizes: settled by the symbols' bounds, or the hint's answer recorded as a guard."""
    settled = _settled(op, a, b)
    if settled is not None:
        return settled
    answer = _COMPARE[op](hint(a), hint(b))
    if not _active:
        raise SizeError(f"the size comparison {a!r} {op} {b!r} was made outside a compile")
    _active[-1].record(op, a - b, answer)
    return answer


_active: list["Guards"] = []


class Guards:
    """The decisions a compile took from its symbols' hints: the sizes its plan holds for. ``lower[k]`` is a lower
    bound of symbol k known in advance (dynamo specialises sizes 0 and 1, so its dynamic sizes are at least 2).

    ``bounds[k]``, once ``bound`` set it, is the largest value of symbol k the plan's buffers are sized for
    (``upper``): buffers, bindings and the memory plan take the sizes at the bounds, and every smaller value fits."""

    def __init__(self, lower: dict[int, int] | None = None, hints: dict[int, int] | None = None,
                 bounds: dict[int, int] | None = None):
        self.lower = dict(lower or {})
        self.hints = dict(hints or {})  # each symbol's value at this compile
        self.declared = dict(bounds or {})  # bounds given in advance (a bundle's declared ranges)
        self.bounds: dict[int, int] = {}
        self.items: list[tuple[str, Size, bool]] = []  # (op, a - b, answer of a - b op 0)
        self._seen: set = set()
        self._check = None

    def bound(self, k: int) -> int:
        """Symbol k's bound: the one declared, else the next power of two above its hint (room to grow before a new
        plan), recorded."""
        if k not in self.bounds:
            self.bounds[k] = self.declared.get(k) or 1 << max(self.hints[k], 1).bit_length()
            self.record("le", symbol(k, self.hints[k]) - self.bounds[k], True)
        return self.bounds[k]

    @contextlib.contextmanager
    def recording(self):
        _active.append(self)
        try:
            yield self
        finally:
            _active.pop()

    def record(self, op: str, diff: Size, answer: bool) -> None:
        key = (op, diff)
        if key not in self._seen:
            self._seen.add(key)
            self.items.append((op, diff, answer))
            self._check = None

    def check(self, values) -> bool:
        """Whether the symbols' ``values`` give every guard its recorded answer (and meet the lower bounds)."""
        if self._check is None:
            self._check = _compile_check(self.items, self.lower)
        return self._check(values)

    def to_json(self) -> dict:
        """The guards as JSON data (a bundle's manifest), for ``from_json``."""
        return {"lower": [[k, low] for k, low in sorted(self.lower.items())],
                "guards": [[op, diff.to_json(), answer] for op, diff, answer in self.items]}

    @staticmethod
    def from_json(data: dict, symbols: int) -> "Guards":
        """Guards written by ``to_json`` for ``symbols`` symbols; refuses anything else (``SizeError``)."""
        try:
            lower = {int(k): int(low) for k, low in data["lower"]}
            items = data["guards"]
            guards = Guards(lower)
            for op, diff, answer in items:
                size = from_json(diff, [1] * symbols)
                if op not in _COMPARE or not isinstance(answer, bool) or not isinstance(size, Size):
                    raise SizeError(f"a guard is [comparison, symbolic size, bool], not {[op, diff, answer]!r}")
                guards.record(op, size, answer)
        except (KeyError, TypeError, ValueError) as err:
            raise SizeError(f"guards are not valid: {err}") from err
        return guards

    def describe(self, values=None) -> list[str]:
        """Each guard as the condition it asks (``(-16 + s[1]) <= 0``); with ``values``, only those they fail."""
        symbols = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
        flip = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
        return [f"{diff!r} {symbols[op if answer else flip[op]]} 0" for op, diff, answer in self.items
                if values is None or _COMPARE[op](evaluator([diff])(tuple(values))[0], 0) is not answer]


def _compile_check(items, lower: dict[int, int]):
    symbols = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
    terms = [f"s[{k}] >= {low}" for k, low in sorted(lower.items())]
    terms += [f"(({diff.python('s')} {symbols[op]} 0) is {answer})" for op, diff, answer in items]
    return eval(f"lambda s: {' and '.join(terms) or 'True'}")  # noqa: S307 - text built here from Sizes, not input


def upper(x) -> int:
    """``x`` at the active compile's bounds (``Guards.bound``), the most it is for any value the plan serves: a size
    is a polynomial of non-negative coefficients and atoms that grow with their arguments (a remainder counts as its
    divisor less one). Records no guard."""
    if not isinstance(x, Size):
        return x
    guards = _active[-1] if _active else None
    if guards is None:
        raise SizeError(f"the bound of {x!r} was asked outside a compile")
    total = 0
    for m, c in x.terms:
        if c < 0 and m:
            raise SizeError(f"{x!r} does not grow with its symbols: it has no bound at the symbols' bounds")
        term = c
        for atom in m:
            term *= guards.bound(atom) if isinstance(atom, int) else _upper_atom(atom)
        total += term
    return total


def _upper_atom(atom) -> int:
    op, a, b = atom
    if op == "mod":
        return upper(b) - 1
    if op == "floordiv":
        return upper(a) // max(lower_bound(b) or 1, 1)
    return ATOM_OPS[op][0](upper(a), upper(b))


def evaluator(sizes):
    """A function of the symbols' values giving the tuple of ``sizes`` (ints pass through)."""
    parts = [s.python("s") if isinstance(s, Size) else str(int(s)) for s in sizes]
    return eval(f"lambda s: ({', '.join(parts)}{',' if len(parts) == 1 else ''})")  # noqa: S307 - built from Sizes
