"""Scatters, computed from the output side: scatter, scatter_add, scatter_reduce, index_put, and the
slice/select/diagonal scatters.

No atomics and no write races: each output element gathers its own contributions. A scatter into ``self``
is a Reduce over the domain ``self.shape + (K,)`` whose last axis enumerates K candidate source entries
(the positions along ``dim`` for scatter, the broadcast index positions for index_put); a candidate counts
where its index equals the element's coordinate. Sums give scatter_add and accumulating index_put; an
overwrite takes the last matching candidate (the ``max`` of its position), as eager does on the CPU. The
cost is O(numel(self) * K), fine for embedding and loss backward at moderate sizes. Indices are checked
on the device like gather's. The slice/select/diagonal scatters are pointwise selects.

An overwriting index_put with fewer entries than indexed positions (a KV cache's ``index_copy`` at the new tokens'
positions) and the slice and select scatters (an assignment to a slice, traced) also tell the elements they change
(``ir.Region``): where the output is stored over its input, the update runs over those alone
(``meganeura.lowering.regions``), a dispatch the size of its new values, not of the whole tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from meganeura.lowering import expr as E
from meganeura.lowering.builder import broadcast_shapes, unravel
from meganeura.kernels.sizes import is_size
from meganeura.lowering.ir import Region, RowOutput, Value, numel

from ..registry import lowering
from .indexing import _checked, _no_bool_index

aten = torch.ops.aten

# An overwriting index_put of at most this many entries tells whether an entry is the last one landing on its element
# by comparing it with each later one (a thread's work grows with the entries, its kernel's text too; the prefill
# of a generation bundle writes 32 cache positions a run), past it by a look-up in a table over the indexed positions.
UNROLLED_ENTRIES = 64
LOWEST = {E.F32: float("-inf"), E.I32: -(2**31)}
HIGHEST = {E.F32: float("inf"), E.I32: 2**31 - 1}


def _i32(n: int) -> E.Expr:
    return E.const(n, E.I32)


def _all(conds) -> E.Expr:
    out = E.const(True, E.BOOL)
    for c in conds:
        out = c if E.is_const(out, True) else E.binary("and", out, c)
    return out


@dataclass
class Candidates:
    """The K source entries that may land on an output element (coordinates 0..rank-1 of the domain).

    ``match(k)``: candidate k lands on this element; ``value(k)``: its value (in the output's compute
    dtype). ``k`` is an i32 expression: the reduction coordinate in phases, an accumulator in results."""

    count: int
    match: Callable[[E.Expr], E.Expr]
    value: Callable[[E.Expr], E.Expr]


def _combine(ctx, x: Value, cand: Candidates, reduce: str, include_self: bool = True, label: str = "") -> Value:
    """The output of scattering ``cand`` into ``x`` with ``reduce``: sum | prod | amax | amin | mean | overwrite."""
    b, rank = ctx.b, len(x.shape)
    kind = x.compute_dtype
    k = E.coord(rank)
    old = b.load(x, [E.coord(d) for d in range(rank)])
    if reduce == "overwrite":
        last = E.acc(0, E.I32)
        picked = cand.value(E.binary("maximum", last, _i32(0)))
        result = E.where(E.binary("ge", last, _i32(0)), picked, old)
        phases = [("max", E.where(cand.match(k), k, _i32(-1)))]
    else:
        op, identity = {"sum": ("sum", 0), "mean": ("sum", 0), "prod": ("prod", 1),
                        "amax": ("max", LOWEST[kind]), "amin": ("min", HIGHEST[kind])}[reduce]
        phases = [(op, E.where(cand.match(k), cand.value(k), E.const(identity, kind)))]
        acc = E.acc(0, kind)
        count = E.acc(1, E.I32)
        if reduce == "mean" or not include_self:
            phases.append(("sum", E.where(cand.match(k), _i32(1), _i32(0))))
        if reduce == "mean":
            total = E.add(acc, old) if include_self else acc
            n = E.add(count, _i32(1)) if include_self else E.binary("maximum", count, _i32(1))
            divide = "div" if kind == E.F32 else "floordiv"
            result = E.binary(divide, total, E.cast(n, kind))
        else:
            merge = {"sum": "add", "prod": "mul", "amax": "maximum", "amin": "minimum"}[reduce]
            result = E.binary(merge, old, acc) if include_self else acc
        if not include_self:
            result = E.where(E.binary("gt", count, _i32(0)), result, old)
    (out,) = b.reduce(tuple(x.shape) + (cand.count,), [rank], phases, [RowOutput(False, result)], [x.dtype],
                      label or reduce)
    return out


# ------------------------------------------------------------------------------------ scatter along dim
def _along_dim(ctx, x: Value, dim: int, index: Value, src, what: str) -> Candidates:
    """Candidates of scatter(x, dim, index, src): for element c, index[c with c_dim := k] for k < index.shape[dim]."""
    b, rank = ctx.b, len(x.shape)
    limits = index.shape
    inside = [E.binary("lt", E.coord(d), _i32(limits[d])) for d in range(rank) if d != dim and limits[d] < x.shape[d]]

    def coords(k):  # clamped into index's shape: a select evaluates both sides, loads must stay in range
        return [k if d == dim else E.coord(d) if limits[d] >= x.shape[d] else
                E.binary("minimum", E.coord(d), _i32(limits[d] - 1)) for d in range(rank)]

    def match(k):
        target = _checked(ctx, b.load(index, coords(k)), x.shape[dim], what, wrap_negative=False)
        return _all(inside + [E.binary("eq", target, E.coord(dim))])

    def value(k):
        if isinstance(src, Value):
            return E.cast(b.load(src, coords(k)), x.compute_dtype)
        return E.const(src, x.compute_dtype)

    return Candidates(limits[dim], match, value)


def _scatter_like(ctx, x, dim, index, src, reduce, include_self=True):
    what = str(ctx.node.target).split(".")[1]
    if index.numel == 0:
        return x
    if not x.shape:  # 0-d: the same scatter on one-element vectors
        x1, index1 = ctx.b.reshape(x, [1]), ctx.b.reshape(index, [1])
        src1 = ctx.b.reshape(src, [1]) if isinstance(src, Value) else src
        return ctx.b.reshape(_scatter_like(ctx, x1, 0, index1, src1, reduce, include_self), [])
    dim %= len(x.shape)
    return _combine(ctx, x, _along_dim(ctx, x, dim, index, src, what), reduce, include_self, what)


def _no_bool_sum(node) -> str | None:
    if node.args[0].meta["val"].dtype == torch.bool:
        return f"{node.target} on bool tensors is not lowered"
    return None


@lowering(aten.scatter.src, aten.scatter.value)
def _scatter(ctx, x, dim, index, src):
    return _scatter_like(ctx, x, dim, index, src, "overwrite")


@lowering(aten.scatter_add.default, supports=_no_bool_sum)
def _scatter_add(ctx, x, dim, index, src):
    return _scatter_like(ctx, x, dim, index, src, "sum")


@lowering(aten.scatter_reduce.two, supports=_no_bool_sum)
def _scatter_reduce(ctx, x, dim, index, src, reduce, *, include_self=True):
    return _scatter_like(ctx, x, dim, index, src, reduce, include_self)


# ----------------------------------------------------------------------------------------- index_put
def _index_put_supported(node) -> str | None:
    reason = _no_bool_index(node)
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if reason is None and accumulate:
        reason = _no_bool_sum(node)
    return reason


@lowering(aten.index_put.default, supports=_index_put_supported)
def _index_put(ctx, x, indices, values, accumulate=False):
    """x[i0, i1, ...] = values (or +=): numpy's placement of the index dims, as in ``indexing._index``."""
    b, rank = ctx.b, len(x.shape)
    indices = list(indices) + [None] * (rank - len(indices))
    positions = [d for d, i in enumerate(indices) if i is not None]
    if not positions:
        raise NotImplementedError("index_put without index tensors")
    idx_shape = broadcast_shapes(*[indices[d].shape for d in positions])
    if numel(idx_shape) == 0:
        return x
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    lead = positions[0] if adjacent else 0
    rest = [d for d in range(rank) if indices[d] is None]
    before = [d for d in rest if d < lead] if adjacent else []
    after = [d for d in rest if d not in before]
    shape = [x.shape[d] for d in before] + list(idx_shape) + [x.shape[d] for d in after]  # shape of x[indices]

    def target(k, d):
        kc = unravel(k, idx_shape)
        t = indices[d]
        off = len(idx_shape) - len(t.shape)
        tc = [_i32(0) if s == 1 else kc[off + j] for j, s in enumerate(t.shape)]
        return _checked(ctx, b.load(t, tc), x.shape[d], "index_put", wrap_negative=True)

    def value(k, at=E.coord):  # at(d): the coordinate of x's non-indexed dim d
        coords = [at(d) for d in before] + unravel(k, idx_shape) + [at(d) for d in after]
        off = len(shape) - len(values.shape)
        vc = [_i32(0) if s == 1 else coords[off + j] for j, s in enumerate(values.shape)]
        return E.cast(b.load(values, vc), x.compute_dtype)

    reduce = "sum" if accumulate else "overwrite"
    if numel(idx_shape) < numel([x.shape[d] for d in positions]):
        written = (before, after) if reduce == "overwrite" else None
        return _index_put_sparse(ctx, x, positions, numel(idx_shape), target, value, reduce, written)
    cand = Candidates(numel(idx_shape), lambda k: _all(E.binary("eq", target(k, d), E.coord(d)) for d in positions),
                      value)
    return _combine(ctx, x, cand, reduce, label="index_put")


def _index_put_sparse(ctx, x: Value, positions: list[int], count: int, target, value, reduce: str,
                      written: tuple | None = None) -> Value:
    """index_put with fewer index entries (``count``) than indexed positions, in O(positions * count +
    count^2 * rest + numel(x)) instead of O(numel(x) * count) (an embedding's backward: a few tokens, a large
    table). Three race-free steps:
      1. ``rep[r]`` per indexed position r: the entry that represents it (the first entry targeting r for a
         sum, the last for an overwrite, as eager does), or none;
      2. for a sum, ``total[k, rest]``: the sum of every entry with the same target as entry k;
      3. the output: x where no entry lands, else x + total[rep] (sum) or the value of entry rep (overwrite).
    ``written``: an overwrite's (before, after), the dims it does not index before its entries and after them: the
    output carries the elements it changes (``_written_region``).
    """
    b, rank = ctx.b, len(x.shape)
    rest = [d for d in range(rank) if d not in positions]
    pos_shape = [x.shape[d] for d in positions]
    first = reduce == "sum"
    none = count if first else -1

    k = E.coord(len(positions))
    lands = _all(E.binary("eq", target(k, d), E.coord(j)) for j, d in enumerate(positions))
    (rep,) = b.reduce(tuple(pos_shape) + (count,), [len(positions)],
                      [("min" if first else "max", E.where(lands, k, _i32(none)))],
                      [RowOutput(False, E.acc(0, E.I32))], ["int32"], "index_put_rep")

    here = [E.coord(d) for d in positions]
    picked = b.load(rep, here)
    hit = E.binary("lt", picked, _i32(count)) if first else E.binary("ge", picked, _i32(0))
    old = b.load(x, [E.coord(d) for d in range(rank)])
    if not first:
        new = value(E.binary("maximum", picked, _i32(0)))
        region = _written_region(ctx, x, *written, positions, count, target, value, rep) if written else None
        return b.pointwise(x.shape, x.dtype, E.where(hit, new, old), "index_put", region)

    other = E.coord(1 + len(rest))
    same = _all(E.binary("eq", target(other, d), target(E.coord(0), d)) for d in positions)
    at_rest = {d: E.coord(1 + i) for i, d in enumerate(rest)}
    contribution = E.where(same, value(other, at_rest.__getitem__), E.const(0, x.compute_dtype))
    total_shape = (count,) + tuple(x.shape[d] for d in rest)
    (total,) = b.reduce(total_shape + (count,), [len(total_shape)], [("sum", contribution)],
                        [RowOutput(False, E.acc(0, x.compute_dtype))], [x.dtype], "index_put_sum")
    row = E.binary("minimum", picked, _i32(count - 1))
    added = E.add(old, b.load(total, [row] + [E.coord(d) for d in rest]))
    return b.pointwise(x.shape, x.dtype, E.where(hit, added, old), "index_put")


def _written_region(ctx, x: Value, before: list[int], after: list[int], positions: list[int], count: int, target,
                    value, rep: Value) -> Region:
    """The elements an overwriting index_put changes: one per entry k and coordinate of the dims it does not index
    (the region's coordinates: ``before``'s, k, ``after``'s), at the entry's target, stored where k is the last entry
    landing there, as eager takes it: a comparison with each later entry where they are few (``UNROLLED_ENTRIES``;
    one entry needs none), else a look-up in ``rep``. The region checks its targets as ``rep`` does, so where it does
    not read ``rep``, ``rep`` may go (``meganeura.lowering.regions``); where it does, ``rep`` checks them."""
    k = E.coord(len(before))
    place = {d: E.coord(i) for i, d in enumerate(before)}
    place.update({d: E.coord(len(before) + 1 + i) for i, d in enumerate(after)})
    at = tuple(target(k, d) if d in positions else place[d] for d in range(len(x.shape)))
    if is_size(count) or count > UNROLLED_ENTRIES:
        at = tuple(map(_unchecked, at))
        keep = E.binary("eq", ctx.b.load(rep, [at[d] for d in positions]), k)
    else:
        keep = _all(E.binary("or", E.binary("le", _i32(j), k), _any(
            E.binary("ne", _unchecked(target(_i32(j), d)), _unchecked(at[d])) for d in positions))
            for j in range(1, count))
    shape = (*(x.shape[d] for d in before), count, *(x.shape[d] for d in after))
    return Region(shape, at, keep, [value(k, place.__getitem__)], [x.id])


def _unchecked(e: E.Expr) -> E.Expr:
    return E.substitute(e, lambda n: n.args[0] if n.op == "check" else None)


def _any(conds) -> E.Expr:
    out = E.const(False, E.BOOL)
    for c in conds:
        out = c if E.is_const(out, False) else E.binary("or", out, c)
    return out


# ------------------------------------------------------------------------- slice/select/diagonal scatter
def _clamp(i: int, size: int) -> int:
    if i < 0:
        i += size
    return min(max(i, 0), size)


@lowering(aten.slice_scatter.default)
def _slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    """x with x[..., start:end:step, ...] = src (along ``dim``); its region: src's elements, at their slice's
    places."""
    b, rank = ctx.b, len(x.shape)
    dim %= rank
    start = _clamp(0 if start is None else start, x.shape[dim])
    length = src.shape[dim]
    if length == 0:
        return x
    offset = E.binary("sub", E.coord(dim), _i32(start))
    safe = E.binary("maximum", offset, _i32(0))
    j = E.binary("idiv", safe, _i32(step))
    hit = _all([E.binary("ge", offset, _i32(0)), E.binary("eq", E.binary("imod", safe, _i32(step)), _i32(0)),
                E.binary("lt", j, _i32(length))])
    coords = [E.coord(d) for d in range(rank)]
    coords[dim] = E.binary("minimum", j, _i32(length - 1))
    expr = E.where(hit, E.cast(b.load(src, coords), x.compute_dtype), b.load(x, [E.coord(d) for d in range(rank)]))
    own = [E.coord(d) for d in range(rank)]
    at = tuple(E.add(_i32(start), E.mul(E.coord(d), _i32(step))) if d == dim else own[d] for d in range(rank))
    region = Region(tuple(src.shape), at, E.const(True, E.BOOL), [b.load(src, own)], [x.id])
    return b.pointwise(x.shape, x.dtype, expr, "slice_scatter", region)


@lowering(aten.select_scatter.default)
def _select_scatter(ctx, x, src, dim, index):
    """x with x[..., index, ...] = src (along ``dim``); its region: src's elements, at ``index``."""
    b, rank = ctx.b, len(x.shape)
    dim %= rank
    index %= x.shape[dim]
    src_coords = [E.coord(d) for d in range(rank) if d != dim]
    hit = E.binary("eq", E.coord(dim), _i32(index))
    expr = E.where(hit, E.cast(b.load(src, src_coords), x.compute_dtype), b.load(x, [E.coord(d) for d in range(rank)]))
    at = tuple(_i32(index) if d == dim else E.coord(d) for d in range(rank))
    region = Region(tuple(1 if d == dim else x.shape[d] for d in range(rank)), at, E.const(True, E.BOOL),
                    [b.load(src, src_coords)], [x.id])
    return b.pointwise(x.shape, x.dtype, expr, "select_scatter", region)


@lowering(aten.diagonal_scatter.default)
def _diagonal_scatter(ctx, x, src, offset=0, dim1=0, dim2=1):
    b, rank = ctx.b, len(x.shape)
    dim1, dim2 = dim1 % rank, dim2 % rank
    length = src.shape[-1]
    if length == 0:
        return x
    on_diagonal = E.binary("eq", E.binary("sub", E.coord(dim2), E.coord(dim1)), _i32(offset))
    position = E.coord(dim1 if offset >= 0 else dim2)
    src_coords = [E.coord(d) for d in range(rank) if d not in (dim1, dim2)]
    src_coords.append(E.binary("minimum", position, _i32(length - 1)))
    expr = E.where(on_diagonal, E.cast(b.load(src, src_coords), x.compute_dtype),
                   b.load(x, [E.coord(d) for d in range(rank)]))
    return b.pointwise(x.shape, x.dtype, expr, "diagonal_scatter")
