"""GraphBuilder: the vocabulary that op lowerings use to add archetype nodes to a Graph.

Views never copy: ``permute``, ``expand``, ``reshape``, ``slice``... return Pointwise nodes made of a single
load with remapped coordinates, which the fusion pass folds into their consumers' index math.
"""
from __future__ import annotations

from typing import Callable, Sequence

from meganeura.kernels.sizes import is_size

from . import expr as E
from .ir import FLOAT_DTYPES, Attention, Graph, Input, Matmul, Node, Pointwise, Reduce, Region, RowOutput, Value, numel


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        sizes = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


class GraphBuilder:
    RNG_SEED = "rng_seed"  # the input that random ops draw their key from: two int32, new for every run

    def __init__(self):
        self.graph = Graph()
        self._next_id = 0
        self._seed: Value | None = None
        self._streams = 0
        self._input_ids: set[int] = set()  # values produced by Input nodes

    # ------------------------------------------------------------------------------- nodes
    def _value(self, shape, dtype) -> Value:
        v = Value(self._next_id, tuple(s if is_size(s) else int(s) for s in shape), dtype)
        self._next_id += 1
        return v

    def _add(self, node: Node) -> Node:
        self.graph.nodes.append(node)
        return node

    def input(self, name: str, shape, dtype: str, role: str = "input") -> Value:
        v = self._add(Input([self._value(shape, dtype)], name=name, role=role)).out
        self._input_ids.add(v.id)
        return v

    def pointwise(self, shape, dtype: str, expr: E.Expr, label: str = "", region: Region | None = None) -> Value:
        """A pointwise node's value; ``region``: the elements it changes where it updates an input (``ir.Region``,
        its values cast as ``expr`` is)."""
        v = self._value(shape, dtype)
        expr = E.cast(expr, v.compute_dtype)
        if region is not None:
            region = region.with_exprs([*region.at, region.keep, *(E.cast(e, v.compute_dtype) for e in region.values)])
        return self._add(Pointwise([v], expr=expr, label=label, region=region)).out

    @property
    def rng_seed(self) -> str | None:
        """The name of the seed input once a random op was added, else None."""
        return None if self._seed is None else self.RNG_SEED

    def uniform(self, shape) -> E.Expr:
        """A fresh uniform [0, 1) number per element of ``shape``: a stream of its own under the run's seed."""
        if self._seed is None:
            self._seed = self.input(self.RNG_SEED, (2,), "int32")
        key = [self.load(self._seed, [E.const(i, E.I32)]) for i in range(2)]
        strides = contiguous_strides(shape)
        counter = E.const(0, E.I32)
        for d, st in enumerate(strides):
            counter = E.add(counter, E.mul(E.coord(d), E.const(st, E.I32)))
        self._streams += 1
        return E.uniform(key[0], key[1], self._streams, counter)

    def output(self, v: Value) -> None:
        """Mark ``v`` as a graph output (inputs returned as outputs are copied, so outputs own buffers)."""
        if v.id in self._input_ids:
            v = self.view(v, v.shape, [E.coord(d) for d in range(len(v.shape))], "copy")
        self.graph.outputs.append(v)

    def check(self, value: E.Expr, cond: E.Expr, message: str) -> E.Expr:
        """``value``, after raising status ``message`` on the device when ``cond`` is false."""
        codes = self.graph.status_messages
        code = next((c for c, m in codes.items() if m == message), len(codes) + 1)
        codes[code] = message
        return E.Expr("check", (value, cond, code), value.dtype)

    # ------------------------------------------------------------------------------- loads
    def load(self, v: Value, coords: Sequence[E.Expr]) -> E.Expr:
        if len(coords) != len(v.shape):
            raise ValueError(f"load of v{v.id} with shape {v.shape} needs {len(v.shape)} coords, got {len(coords)}")
        return E.load(v.id, tuple(coords), v.compute_dtype)

    def load_broadcast(self, v: Value, shape) -> E.Expr:
        """Element of ``v`` at the output coordinates of ``shape``, numpy broadcasting rules."""
        offset = len(shape) - len(v.shape)
        coords = [E.const(0, E.I32) if s == 1 and shape[offset + d] != 1 else E.coord(offset + d)
                  for d, s in enumerate(v.shape)]
        return self.load(v, coords)

    def map(self, fn: Callable[..., E.Expr], *operands, dtype: str, compute: str | None = None,
            label: str = "") -> Value:
        """Broadcasting elementwise op: ``fn`` gets one Expr per operand (Values or Python scalars), each
        cast to ``compute`` (default: the compute dtype of ``dtype``; "keep": each operand's own dtype)."""
        shape = broadcast_shapes(*[o.shape for o in operands if isinstance(o, Value)])
        compute = compute or Value(0, (), dtype).compute_dtype
        args = []
        for o in operands:
            if isinstance(o, Value):
                loaded = self.load_broadcast(o, shape)
                args.append(loaded if compute == "keep" else E.cast(loaded, compute))
            else:
                kind = compute if compute != "keep" else (E.BOOL if isinstance(o, bool)
                                                          else E.I32 if isinstance(o, int) else E.F32)
                args.append(E.const(o, kind))
        return self.pointwise(shape, dtype, fn(*args), label)

    def full(self, shape, value, dtype: str) -> Value:
        return self.pointwise(shape, dtype, E.const(value, Value(0, (), dtype).compute_dtype), "full")

    # ------------------------------------------------------------------------------- views
    def view(self, v: Value, shape, coords: Sequence[E.Expr], label: str) -> Value:
        return self.pointwise(shape, v.dtype, self.load(v, coords), label)

    def permute(self, v: Value, dims: Sequence[int]) -> Value:
        dims = [d % max(len(v.shape), 1) for d in dims]
        coords = [None] * len(dims)
        for out_dim, in_dim in enumerate(dims):
            coords[in_dim] = E.coord(out_dim)
        return self.view(v, [v.shape[d] for d in dims], coords, "permute")

    def expand(self, v: Value, shape) -> Value:
        shape = [v.shape[d - (len(shape) - len(v.shape))] if s == -1 else s for d, s in enumerate(shape)]
        return self.view(v, shape, self.load_broadcast(v, shape).args[1], "expand")

    def reshape(self, v: Value, shape) -> Value:
        shape = infer_shape(shape, v.numel)
        if tuple(shape) == v.shape:
            return v
        return self.view(v, shape, reshape_coords(v.shape, shape), "reshape")

    def slice(self, v: Value, dim: int, start: int, end: int, step: int = 1) -> Value:
        dim %= len(v.shape)
        size = v.shape[dim]
        start, end = _clamp_index(start, size), _clamp_index(end, size)
        length = max(0, (end - start + step - 1) // step)
        coords = [E.coord(d) for d in range(len(v.shape))]
        coords[dim] = E.add(E.mul(E.coord(dim), E.const(step, E.I32)), E.const(start, E.I32))
        shape = list(v.shape)
        shape[dim] = length
        return self.view(v, shape, coords, "slice")

    def select(self, v: Value, dim: int, index: int) -> Value:
        dim %= len(v.shape)
        if not -v.shape[dim] <= index < v.shape[dim]:
            raise IndexError(f"select index {index} is out of range for dimension {dim} of size {v.shape[dim]}")
        if index < 0:  # (a symbolic size's modulo would take its value)
            index += v.shape[dim]
        coords = [E.coord(d if d < dim else d - 1) for d in range(len(v.shape))]
        coords[dim] = E.const(index, E.I32)
        return self.view(v, v.shape[:dim] + v.shape[dim + 1:], coords, "select")

    def unsqueeze(self, v: Value, dim: int) -> Value:
        dim %= len(v.shape) + 1
        return self.reshape(v, v.shape[:dim] + (1,) + v.shape[dim:])

    def cat(self, values: Sequence[Value], dim: int) -> Value:
        """Concatenation as one pointwise select chain over the output coordinate along ``dim``."""
        values = [v for v in values if v.numel > 0 or len(v.shape) > 1]
        dim %= len(values[0].shape)
        total = sum(v.shape[dim] for v in values)
        shape = list(values[0].shape)
        shape[dim] = total
        result, start = None, total
        for v in reversed(values):
            start -= v.shape[dim]
            coords = [E.coord(d) for d in range(len(shape))]
            coords[dim] = E.binary("sub", E.coord(dim), E.const(start, E.I32))
            piece = self.load(v, coords)
            before_end = E.binary("lt", E.coord(dim), E.const(start + v.shape[dim], E.I32))
            result = piece if result is None else E.where(before_end, piece, result)
        return self.pointwise(shape, values[0].dtype, result, "cat")

    # ---------------------------------------------------------------------------- reductions
    def reduce(self, domain, axes, phases, results, out_dtypes, label: str) -> list[Value]:
        """Add a Reduce node; ``results`` are RowOutputs, one per output value."""
        axes = tuple(sorted(a % max(len(domain), 1) for a in axes))
        row_shape = tuple(s for d, s in enumerate(domain) if d not in axes)
        outs = [self._value(domain if r.per_element else row_shape, dt) for r, dt in zip(results, out_dtypes)]
        results = [RowOutput(r.per_element, E.cast(r.expr, o.compute_dtype)) for r, o in zip(results, outs)]
        self._add(Reduce(outs, domain=tuple(domain), axes=axes, phases=list(phases), results=results, label=label))
        return outs

    def reduce_simple(self, v: Value, axes, op: str, dtype: str, finish=None, label: str = "") -> Value:
        """Reduce ``v`` over ``axes`` with ``op``; ``finish(acc)`` post-processes the row result."""
        value = E.cast(self.load(v, [E.coord(d) for d in range(len(v.shape))]),
                       E.F32 if dtype in FLOAT_DTYPES else v.compute_dtype)
        acc_dtype = E.I32 if op in ("argmax", "argmin") else value.dtype
        result = E.acc(0, acc_dtype)
        if finish is not None:
            result = finish(result)
        (out,) = self.reduce(v.shape, axes, [(op, value)], [RowOutput(False, result)], [dtype], label or op)
        return out

    # ----------------------------------------------------------------------------- attention
    def attention(self, kind: str, outs: list[tuple[tuple[int, ...], str]], **fields) -> list[Value]:
        """Add an ``Attention`` pass of ``kind`` with outputs of the given (shape, dtype) and node ``fields``."""
        values = [self._value(shape, dtype) for shape, dtype in outs]
        self._add(Attention(values, kind=kind, **fields))
        return values

    # -------------------------------------------------------------------------------- matmul
    def gemm(self, batch: int, m: int, n: int, k: int, a: E.Expr, b: E.Expr, dtype: str = "float32",
             epilogue: E.Expr | None = None, label: str = "matmul") -> Value:
        """out[b, i, j] = epilogue(sum_p a(b, i, p) * b(b, p, j)) with shape (batch, m, n).

        ``a`` is an f32 expression of coordinates (0: b, 1: i, 2: p), ``b`` of (0: b, 1: p, 2: j), ``epilogue``
        of (0: b, 1: i, 2: j) and ``E.acc(0)`` (the sum). Any index math works: implicit-GEMM convolutions
        gather their operands here."""
        epi = E.acc(0) if epilogue is None else epilogue
        out = self._value((batch, m, n), dtype)
        self._add(Matmul([out], batch=batch, m=m, n=n, k=k, a=a, b=b, epilogue=epi, label=label))
        return out

    def matmul(self, a: Value, b: Value, dtype: str = "float32", epilogue=None, label: str = "matmul") -> Value:
        """Batched matmul with numpy broadcasting of batch dims; 1-D operands like torch.matmul."""
        a2 = self.unsqueeze(a, 0) if len(a.shape) == 1 else a
        b2 = self.unsqueeze(b, 1) if len(b.shape) == 1 else b
        (m, k), (k2, n) = a2.shape[-2:], b2.shape[-2:]
        if k != k2:
            raise ValueError(f"matmul shapes {a.shape} and {b.shape} do not agree on the inner dimension")
        batch_shape = broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
        batch = numel(batch_shape)
        batch_coords = unravel(E.coord(0), batch_shape)

        def operand(v, inner):
            lead = len(v.shape) - 2
            offset = len(batch_shape) - lead
            coords = [E.const(0, E.I32) if v.shape[d] == 1 else batch_coords[offset + d] for d in range(lead)]
            return E.cast(self.load(v, coords + inner), E.F32)

        a_expr = operand(a2, [E.coord(1), E.coord(2)])
        b_expr = operand(b2, [E.coord(1), E.coord(2)])
        out = self.gemm(batch, m, n, k, a_expr, b_expr, dtype, epilogue, label)
        shape = batch_shape + ((m,) if len(a.shape) > 1 else ()) + ((n,) if len(b.shape) > 1 else ())
        return self.reshape(out, shape)


# ------------------------------------------------------------------------------------ helpers
def _clamp_index(i: int, size: int) -> int:
    if i < 0:
        i += size
    return min(max(i, 0), size)


def infer_shape(shape, total: int) -> tuple[int, ...]:
    shape = [s if is_size(s) else int(s) for s in shape]
    if -1 in shape:
        known = numel([s for s in shape if s != -1])
        shape[shape.index(-1)] = total // known if known else 0
    if numel(shape) != total:
        raise ValueError(f"cannot reshape {total} elements into {tuple(shape)}")
    return tuple(shape)


def unravel(linear: E.Expr, shape) -> list[E.Expr]:
    """Coordinates of a row-major linear index in ``shape`` (the first needs no modulo)."""
    coords = []
    strides = contiguous_strides(shape)
    for d, (s, st) in enumerate(zip(shape, strides)):
        c = E.binary("idiv", linear, E.const(st, E.I32))
        if d > 0:
            c = E.binary("imod", c, E.const(s, E.I32))
        coords.append(c)
    return coords


def reshape_coords(old, new) -> list[E.Expr]:
    """Old coordinates as expressions of the new ones, grouping dims whose sizes multiply to the same count."""
    old, new = list(old), list(new)
    if numel(old) == 0:
        return [E.const(0, E.I32)] * len(old)
    coords: list[E.Expr] = []
    i = j = 0
    while i < len(old) or j < len(new):
        group_old, group_new, prod_old, prod_new = [], [], 1, 1
        if i < len(old):
            group_old.append(i)
            prod_old *= old[i]
            i += 1
        if j < len(new):
            group_new.append(j)
            prod_new *= new[j]
            j += 1
        while prod_old != prod_new:
            if prod_old < prod_new:
                group_old.append(i)
                prod_old *= old[i]
                i += 1
            else:
                group_new.append(j)
                prod_new *= new[j]
                j += 1
        linear = E.const(0, E.I32)
        stride = 1
        for d in reversed(group_new):
            linear = E.add(linear, E.mul(E.coord(d), E.const(stride, E.I32)))
            stride *= new[d]
        coords.extend(unravel(linear, [old[d] for d in group_old]))
    return coords[: len(old)]
