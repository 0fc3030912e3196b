"""Index arithmetic: turn coordinate loads into linear buffer reads and simplify the i32 math.

Chains of views (reshape after permute after reshape...) compose into ``idiv``/``imod`` trees. ``simplify``
rewrites them with the coordinates' bounds: affine terms are collected, divisions and remainders by a
constant split off the multiples of the divisor, drop when the remainder is provably in range, and
``c*a*(x idiv a) + c*(x imod a)`` folds back to ``c*x``, also where the division is written as one by a product
(``x idiv 9`` beside ``(x idiv 3) imod 3``): the unravel of one flat coordinate into several, such as a
convolution filter's taps read as one GEMM row, folds back to that coordinate.
"""
from __future__ import annotations

import math

from meganeura.kernels.sizes import floordiv, is_size

from . import expr as E

Affine = tuple[dict, int]  # ({atom: coefficient}, constant)


def linear_index(coords, shape) -> E.Expr:
    """Row-major linear element index of ``coords`` in a contiguous tensor of ``shape``."""
    index = E.const(0, E.I32)
    stride = 1
    for c, s in reversed(list(zip(coords, shape))):
        if s != 1:
            index = E.add(index, E.mul(c, E.const(stride, E.I32)))
        stride *= s
    return index


def unit_stride_coord(e: E.Expr, coords: tuple[int, ...]) -> int | None:
    """The first of ``coords`` that steps the buffer reads of ``e`` by one element (the largest read decides)."""
    reads = sorted((n for n in E.walk(e) if n.op == "read"), key=lambda n: -E.size(n))
    for node in reads:
        terms, _ = _affine(node.args[1])
        for d in coords:
            if terms.get(E.coord(d)) == 1:
                return d
    return None


def quad_row_index(index: E.Expr, coord: int, group: int = 4) -> E.Expr | None:
    """``(index - c) / group`` where ``index`` is coordinate ``c`` (coefficient 1) plus a multiple of ``group`` that
    does not involve ``c``: then elements c = 4 q .. 4 q + 3 of a row are vec4 number ``(index - c) / 4 + q`` of the
    buffer (group 4), or elements 8 q .. 8 q + 7 of a row of halves vec4<u32> number ``(index - c) / 8 + q`` (group
    8). None for any other index."""
    terms, const = _affine(index)
    c = E.coord(coord)
    rest = {atom: k for atom, k in terms.items() if atom != c}
    if terms.get(c) != 1 or const % group or any(
            k % group or any(n.op == "coord" and n.args[0] == coord for n in E.walk(atom)) for atom, k in rest.items()):
        return None
    return _build({atom: k // group for atom, k in rest.items()}, const // group)


def simplify(e: E.Expr, bounds: dict[int, int]) -> E.Expr:
    """Simplify the i32 index math inside ``e``; ``bounds[d]`` is the size of coordinate ``d``."""
    memo: dict = {}

    def rewrite(node: E.Expr):
        if node.dtype != E.I32 or node.op not in ("add", "sub", "mul", "idiv", "imod"):
            return None
        if node.op in ("idiv", "imod") and E.is_const(node.args[1]) and node.args[1].args[0] > 0:
            terms, const = _affine(node.args[0])
            return _divide_or_modulo(node.op, terms, const, node.args[1].args[0], bounds)
        terms, const = _affine(node)
        return _build(_fold_div_mod(terms), const)

    return E.substitute(e, rewrite, memo)


def _affine(e: E.Expr) -> Affine:
    if e.op == "const":
        return {}, e.args[0]
    if e.op in ("add", "sub"):
        (ta, ca), (tb, cb) = _affine(e.args[0]), _affine(e.args[1])
        sign = 1 if e.op == "add" else -1
        terms = dict(ta)
        for atom, coef in tb.items():
            terms[atom] = terms.get(atom, 0) + sign * coef
        return {a: c for a, c in terms.items() if c}, ca + sign * cb
    if e.op == "mul":
        for x, y in (e.args, e.args[::-1]):
            if y.op == "const":
                t, c = _affine(x)
                k = y.args[0]
                return ({a: v * k for a, v in t.items()} if k else {}), c * k
        return _product_of_terms(e)
    if e.op == "size":
        return _size_terms(e)
    return {e: 1}, 0


def _size_terms(e: E.Expr) -> Affine:
    """The affine form of a symbolic size: its constant apart, and the rest as the common factor of its
    coefficients times a size (``s0 * 8`` is 8 times ``s0``)."""
    size = e.args[0].size
    const = sum(c for m, c in size.terms if not m)
    rest = size - const
    if not is_size(rest):
        return {e: 1}, 0
    factor = math.gcd(*(c for _, c in rest.terms))
    return {E.const(floordiv(rest, factor), E.I32): factor}, const


def _product_of_terms(e: E.Expr) -> Affine:
    """The affine form of a product of two factors, neither a constant: where each is one term (an atom times a
    coefficient), the atoms' product times the coefficients' (a row of a head of a dynamic KV cache, ``(h / 3) *
    (s0 * 8)``, is then 8 times an atom, which ``quad_row_index`` reads by vec4); else the product is the atom."""
    (ta, ca), (tb, cb) = _affine(e.args[0]), _affine(e.args[1])
    if ca or cb or len(ta) != 1 or len(tb) != 1:
        return {e: 1}, 0
    (a, ka), (b, kb) = *ta.items(), *tb.items()
    if ka == 1 and kb == 1:
        return {e: 1}, 0
    return {E.mul(a, b): ka * kb}, 0


def _build(terms: dict, const: int) -> E.Expr:
    out = E.const(0, E.I32)
    for atom, coef in sorted(terms.items(), key=lambda kv: repr(kv[0])):
        out = E.add(out, E.mul(atom, E.const(coef, E.I32)))
    return E.add(out, E.const(const, E.I32))


def _range(e: E.Expr, bounds) -> tuple[int, int] | None:
    """Inclusive [lo, hi] of an i32 expression, or None when unknown."""
    if e.op == "const":
        return e.args[0], e.args[0]
    if e.op == "coord":
        size = bounds.get(e.args[0])
        return None if size is None or is_size(size) else (0, max(size - 1, 0))  # (symbolic: unknown)
    if e.op in ("add", "sub", "mul"):
        ra, rb = _range(e.args[0], bounds), _range(e.args[1], bounds)
        if ra is None or rb is None:
            return None
        if e.op == "add":
            return ra[0] + rb[0], ra[1] + rb[1]
        if e.op == "sub":
            return ra[0] - rb[1], ra[1] - rb[0]
        corners = [x * y for x in ra for y in rb]
        return min(corners), max(corners)
    if e.op in ("idiv", "imod") and E.is_const(e.args[1]):
        r, d = _range(e.args[0], bounds), e.args[1].args[0]
        if r is None or r[0] < 0 or d <= 0:
            return None
        return (r[0] // d, r[1] // d) if e.op == "idiv" else (0, min(d - 1, r[1]))
    return None


def _affine_range(terms, const, bounds):
    lo = hi = const
    for atom, coef in terms.items():
        r = _range(atom, bounds)
        if r is None:
            return None
        lo += min(coef * r[0], coef * r[1])
        hi += max(coef * r[0], coef * r[1])
    return lo, hi


def _split(terms, const, d):
    """Split an affine form into (multiple of d, d-quotient part, remainder part)."""
    quotient = {a: c // d for a, c in terms.items() if c % d == 0}
    rest = {a: c for a, c in terms.items() if c % d != 0}
    return quotient, const // d, rest, const % d


def _divide_or_modulo(op, terms, const, d, bounds):
    """The affine form ``terms + const`` ``op`` ("idiv" or "imod") ``d`` > 0. Where the form is non-negative, split it
    (``_split``) into d * quotient + rest: with the rest in [0, d), the quotient (idiv) or the rest (imod) alone; with
    the rest non-negative, quotient + rest idiv d, or rest imod d. Otherwise unchanged."""
    full_range = _affine_range(terms, const, bounds)
    if full_range is not None and full_range[0] >= 0:
        quotient, qconst, rest, rconst = _split(terms, const, d)
        rest_range = _affine_range(rest, rconst, bounds)
        if rest_range is not None and 0 <= rest_range[0] and rest_range[1] < d:
            return _build(quotient, qconst) if op == "idiv" else _build(rest, rconst)
        if rest_range is not None and rest_range[0] >= 0:
            part = E.binary(op, _build(rest, rconst), E.const(d, E.I32))
            return E.add(_build(quotient, qconst), part) if op == "idiv" else part
    return E.binary(op, _build(terms, const), E.const(d, E.I32))


def _fold_div_mod(terms: dict) -> dict:
    """c*a*(x idiv a) + c*(x imod a) -> c*x, c*b*(x idiv a*b) + c*((x idiv a) imod b) -> c*(x idiv a), and
    c*(x imod a) + c*a*((x idiv a) imod b) -> c*(x imod a*b), repeatedly: a flattened unravel
    ((p idiv 9)*9 + ((p idiv 3) imod 3)*3 + p imod 3) folds back to p, and its trailing part alone to p imod 9."""
    changed = True
    while changed:
        changed = False
        for atom, coef in list(terms.items()):
            if atom.op != "imod" or not E.is_const(atom.args[1]):
                continue
            y, b = atom.args[0], atom.args[1].args[0]
            whole = _whole_of(y, b, terms, coef)
            if whole is None:
                wider = _wider_remainder(y, b, terms, coef)
                if wider is not None:  # c*(y imod b) + c*b*((y idiv b) imod d) -> c*(y imod b*d)
                    del terms[atom]
                    del terms[wider]
                    merged = E.binary("imod", y, E.const(b * wider.args[1].args[0], E.I32))
                    terms[merged] = terms.get(merged, 0) + coef
                    changed = True
                    break
                continue
            del terms[atom]
            del terms[whole]
            yt, yc = _affine(y)
            for t, c in yt.items():
                terms[t] = terms.get(t, 0) + c * coef
            terms = {t: c for t, c in terms.items() if c}
            if yc:
                terms[E.const(1, E.I32)] = terms.get(E.const(1, E.I32), 0) + yc * coef
            changed = True
            break
    return terms


def _wider_remainder(y: E.Expr, b: int, terms: dict, coef: int) -> E.Expr | None:
    """An atom ((y idiv b) imod d) at coefficient coef*b: with coef*(y imod b) it makes coef*(y imod b*d)."""
    quotient = E.binary("idiv", y, E.const(b, E.I32))
    for atom, c in terms.items():
        if (c == coef * b and atom.op == "imod" and atom.args[0] == quotient and E.is_const(atom.args[1])
                and atom.args[1].args[0] > 0):
            return atom
    return None


def _whole_of(y: E.Expr, b: int, terms: dict, coef: int) -> E.Expr | None:
    """The atom that adds up with coef*(y imod b) to coef*y: (y idiv b) at coefficient coef*b, or, for y = (x idiv
    a), (x idiv a*b) at that coefficient (the same value: nested divisions by positive constants compose)."""
    wanted = [E.binary("idiv", y, E.const(b, E.I32))]
    if y.op == "idiv" and E.is_const(y.args[1]) and y.args[1].args[0] > 0:
        wanted.append(E.binary("idiv", y.args[0], E.const(y.args[1].args[0] * b, E.I32)))
    return next((w for w in wanted if terms.get(w) == coef * b), None)
