"""Torch-free tests of the index simplifier, the memory planner and fusion decisions."""
import itertools
import random

import numpy as np
import pytest

from meganeura.lowering import compile_graph
from meganeura.lowering import expr as E
from meganeura.lowering.builder import GraphBuilder, reshape_coords, unravel
from meganeura.lowering.epilogues import fuse_epilogues
from meganeura.lowering.fusion import fuse
from meganeura.lowering.indexing import linear_index, quad_row_index, simplify
from meganeura.lowering.ir import Matmul, Pointwise, Reduce, RowOutput
from meganeura.lowering.planner import Interval, place
from meganeura.runtime.device import get_device
from meganeura.runtime.program import Program

from helpers.recording_device import RecordingDevice

RNG = np.random.default_rng(11)


def evaluate(e: E.Expr, coords, sizes: dict | None = None) -> int:
    """The value of index ``e`` at ``coords``; ``sizes``: the value of each symbolic size it reads (by its
    ``expr.SizeLeaf``)."""
    if e.op == "const":
        return e.args[0]
    if e.op == "coord":
        return coords[e.args[0]]
    if e.op == "size":
        return sizes[e.args[0]]
    a, b = (evaluate(x, coords, sizes) for x in e.args)
    ops = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "idiv": lambda: a // b,
           "imod": lambda: a % b}
    return ops[e.op]()


@pytest.mark.parametrize("old,new", [((2, 3), (6,)), ((6,), (2, 3)), ((2, 1, 3), (3, 2)), ((4, 6), (2, 2, 3, 2)),
                                     ((2, 3, 1), (6, 1)), ((1,), ()), ((), (1, 1))])
def test_reshape_then_simplify_keeps_every_index(old, new):
    coords = reshape_coords(old, new)
    index = linear_index(coords, old)
    simple = simplify(index, dict(enumerate(new)))
    for c in itertools.product(*[range(s) for s in new]):
        assert evaluate(simple, c) == evaluate(index, c)
    assert E.size(simple) <= E.size(index)


@pytest.mark.parametrize("shape, view, quad", [
    ((2, 3, 5, 8), None, True),  # rows of 8: vec4 q of row r is 2 r + q
    ((2, 3, 5, 6), None, False),  # rows of 6 start at odd multiples of 2
    ((2, 3, 5, 8), "offset", False),  # rows start 1 element in
    ((2, 3, 5, 8), "transposed", False),  # c steps by 5 rows
    ((2, 3, 5, 8), "heads", True),  # head h // 2 of a grouped layout: an idiv atom, coefficient 160
    ((2, 3, 5, 8), "split_c", True),  # c read through c // 2 and c % 2: folds back to c
    ((2, 3, 5, 8), "reversed", False),  # c read from the row's end
])
def test_quad_row_index_only_where_a_row_is_whole_vec4s(shape, view, quad):
    """``quad_row_index`` gives the vec4 index of a row's first element exactly where element c of every row is
    component c % 4 of vec4 (start / 4 + c // 4), and None wherever that does not hold."""
    coords = [E.coord(d) for d in range(4)]
    if view == "offset":
        index = E.add(linear_index(coords, shape), E.const(1, E.I32))
    elif view == "transposed":
        index = linear_index([coords[0], coords[1], coords[3], coords[2]], (2, 3, 8, 5))
    elif view == "heads":
        index = linear_index([coords[0], E.binary("idiv", coords[1], E.const(2, E.I32)), coords[2], coords[3]], shape)
    elif view == "split_c":
        two = E.const(2, E.I32)
        halves = [E.binary("idiv", coords[3], two), E.binary("imod", coords[3], two)]
        index = linear_index([*coords[:3], *halves], (*shape[:3], 4, 2))
    elif view == "reversed":
        index = linear_index([*coords[:3], E.binary("sub", E.const(shape[3] - 1, E.I32), coords[3])], shape)
    else:
        index = linear_index(coords, shape)
    index = simplify(index, dict(enumerate(shape)))
    row = quad_row_index(index, 3)
    assert (row is not None) == quad
    if row is not None:
        for c in itertools.product(*[range(s) for s in shape]):
            flat = evaluate(index, c)
            assert flat == 4 * evaluate(row, c) + c[3]


def test_quad_row_index_of_a_grouped_cache_of_symbolic_length():
    """Rows of KV head h // 3 of a cache of symbolic length L, 8 wide (a dynamic graph's grouped-query cache: the
    head's offset ``(h // 3) * (L * 8)``): whole vec4s, read as such at every length, and no decision about L."""
    from meganeura.kernels import sizes as S

    length = S.symbol(0, 20)
    with S.Guards({0: 2}).recording():
        coords = [E.coord(d) for d in range(4)]
        index = linear_index([coords[0], E.binary("idiv", coords[1], E.const(3, E.I32)), *coords[2:]],
                             (1, 3, length, 8))
        index = simplify(index, {0: 1, 1: 9, 2: length, 3: 8})
        row = quad_row_index(index, 3)
    assert row is not None
    for value in (2, 5, 20):
        at = {leaf.args[0]: S.evaluator([leaf.args[0].size])((value,))[0]
              for e in (index, row) for leaf in E.walk(e) if leaf.op == "size"}
        for c in itertools.product(range(1), range(9), range(value), range(8)):
            assert evaluate(index, c, at) == 4 * evaluate(row, c, at) + c[3], (value, c)


def test_reshape_round_trip_simplifies_to_identity():
    inner = reshape_coords((2, 3), (6,))  # coords of [2, 3] from [6]
    outer = reshape_coords((6,), (2, 3))  # coords of [6] from [2, 3]
    composed = [E.shift_coords(x, {0: outer[0]}) for x in inner]
    assert [simplify(x, {0: 2, 1: 3}) for x in composed] == [E.coord(0), E.coord(1)]


@pytest.mark.parametrize("shape", [(64, 3, 3), (2, 5, 7, 3), (4, 1, 6), (3, 4)])
def test_flattened_unravel_folds_back_to_the_flat_index(shape):
    """A contiguous tensor read through the unravel of one flat coordinate (a convolution's filter taps as one
    GEMM row) is read at that coordinate, also inside a larger affine index."""
    size = int(np.prod(shape))
    flat = linear_index(unravel(E.coord(1), shape), shape)
    row = E.add(E.mul(E.coord(0), E.const(size, E.I32)), flat)
    assert simplify(flat, {1: size}) == E.coord(1)
    simple = simplify(row, {0: 5, 1: size})
    assert E.size(simple) <= 5
    for c in itertools.product(range(5), range(size)):
        assert evaluate(simple, c) == evaluate(row, c)


def test_unravel_split_around_another_axis_keeps_one_remainder():
    """A flat coordinate unravelled over (n, h, w) and read with another axis between n and (h, w) (a convolution's
    output gradient as a GEMM operand) needs one division and one remainder, not three of each."""
    n, h, w = unravel(E.coord(1), (4, 7, 7))
    index = linear_index([n, E.coord(0), h, w], (4, 64, 7, 7))
    simple = simplify(index, {0: 64, 1: 196})
    assert sum(node.op in ("idiv", "imod") for node in E.walk(simple)) == 2
    for c in itertools.product(range(64), range(196)):
        assert evaluate(simple, c) == evaluate(index, c)


def test_renaming_coordinates_renames_each_one_once():
    """select(0) of reshape(8, 1000 -> 1, 8, 1000): the reshape's row ``c1 + c0 * 8`` read at (0, c0, c1) is ``c0``.
    Renaming c1 -> c0 folds ``add(c0, mul(0, 8))`` into the renamed ``c0``, which must not be renamed again (to 0):
    the bug gave every row of a selected matmul output the first row's values."""
    row = E.add(E.coord(1), E.mul(E.coord(0), E.const(8, E.I32)))
    renamed = E.shift_coords(row, {0: E.const(0, E.I32), 1: E.coord(0), 2: E.coord(1)})
    assert renamed == E.coord(0)
    swapped = E.shift_coords(E.add(E.coord(0), E.mul(E.coord(1), E.const(0, E.I32))), {0: E.coord(1), 1: E.coord(0)})
    assert swapped == E.coord(1)


@pytest.mark.parametrize("seed", range(40))
def test_random_view_chains_read_the_elements_numpy_reads(seed):
    """A random chain of reshapes, permutes, selects and slices composed by fusion's coordinate renaming and
    simplified reads, at every output element, the element numpy's views of the same chain read."""
    rng = random.Random(seed)
    shape, flat = (2, 3, 4), np.arange(24).reshape(2, 3, 4)
    coords = [E.coord(d) for d in range(3)]  # source coordinates as expressions of the current view's
    for _ in range(5):
        kind = rng.choice(["reshape", "permute", "select", "slice"])
        rank = len(shape)
        if kind == "reshape" or rank == 0:
            new = _random_reshape(rng, shape)
            mapping = dict(enumerate(reshape_coords(shape, new)))
            flat = flat.reshape(new)
        elif kind == "permute":
            dims = rng.sample(range(rank), rank)
            mapping = {d: E.coord(dims.index(d)) for d in range(rank)}
            new, flat = tuple(shape[d] for d in dims), flat.transpose(dims)
        elif kind == "select":
            d = rng.randrange(rank)
            index = rng.choice([0, rng.randrange(shape[d])])  # index 0 zeroes the terms of its coordinate
            mapping = {k: E.coord(k if k < d else k - 1) for k in range(rank)}
            mapping[d] = E.const(index, E.I32)
            new, flat = shape[:d] + shape[d + 1:], np.take(flat, index, axis=d)
        else:
            d = rng.randrange(rank)
            start = rng.randrange(shape[d])
            mapping = {k: E.coord(k) for k in range(rank)}
            mapping[d] = E.add(E.coord(d), E.const(start, E.I32))
            new = shape[:d] + (shape[d] - start,) + shape[d + 1:]
            flat = flat[(slice(None),) * d + (slice(start, None),)]
        bounds = dict(enumerate(new))
        coords = [simplify(E.shift_coords(c, mapping), bounds) for c in coords]
        shape = tuple(new)
    index = linear_index(coords, (2, 3, 4))
    for c in itertools.product(*(range(s) for s in shape)):
        assert evaluate(index, c) == flat[c]


def _random_reshape(rng, shape):
    n = int(np.prod(shape))
    factors = [f for f in range(1, n + 1) if n % f == 0]
    new, left = [], n
    while left > 1 and len(new) < 3:
        f = rng.choice([f for f in factors if left % f == 0])
        new.append(f)
        left //= f
    return tuple(new + ([left] if left > 1 or not new else []))


def test_planner_never_overlaps_live_tensors_and_beats_unplanned():
    rng = random.Random(0)
    intervals = []
    for key in range(60):
        first = rng.randrange(40)
        intervals.append(Interval(key, rng.randrange(4, 4000, 4), first, first + rng.randrange(5)))
    offsets, size = place(intervals, 32)
    for a, b in itertools.combinations(intervals, 2):
        live_together = a.first <= b.last and b.first <= a.last
        apart = offsets[a.key] + a.size <= offsets[b.key] or offsets[b.key] + b.size <= offsets[a.key]
        assert not live_together or apart
    assert all(off % 32 == 0 for off in offsets.values())
    assert size < sum(i.size for i in intervals) / 2


def test_pointwise_chain_fuses_into_one_kernel_and_epilogues_into_reduce():
    b = GraphBuilder()
    x = b.input("x", (4, 8), "float32")
    y = b.map(lambda a: E.unary("exp", a), x, dtype="float32")
    y = b.map(lambda a: E.mul(a, E.const(2.0, E.F32)), b.permute(y, (1, 0)), dtype="float32")
    s = b.reduce_simple(y, (1,), "sum", "float32")
    z = b.map(lambda a, c: E.binary("div", a, c), y, b.reshape(s, (8, 1)), dtype="float32")
    b.output(z)
    report = fuse(b.graph, 8)
    fuse_epilogues(b.graph, 8, report)
    kernels = [n for n in b.graph.nodes if isinstance(n, (Pointwise, Reduce, Matmul))]
    # y has two readers, so it is computed once (exp, permute and scale in one kernel); the division
    # then moves into the reduction's kernel as an element result.
    assert [type(k) for k in kernels] == [Pointwise, Reduce]
    assert kernels[1].outs[-1] is b.graph.outputs[0]


def test_computed_value_with_two_consumers_is_materialised_once():
    b = GraphBuilder()
    x = b.input("x", (16,), "float32")
    y = b.map(lambda a: E.unary("tanh", a), x, dtype="float32")
    b.output(b.map(lambda a: E.add(a, a), y, dtype="float32"))
    b.output(b.map(lambda a: E.mul(a, a), y, dtype="float32"))
    report = fuse(b.graph, 8)
    assert sum(isinstance(n, Pointwise) for n in b.graph.nodes) == 3
    assert any("2 consumers" in reason for _, _, reason in report.refused)


def test_epilogue_reading_two_row_results_takes_both_from_registers():
    """Layer norm's shape: one reduction yields a mean and an rstd per row, and x_hat = (x - mean) * rstd reads
    both. The consumer moves into the reduction, and both results become expressions there: a load of the
    kernel's own rstd would race with the thread that writes it (wrong gradients on an H200, right on lavapipe)."""
    b = GraphBuilder()
    x = b.input("x", (4, 8), "float32")
    row = [E.coord(0), E.coord(1)]
    value = b.load(x, row)
    centred = E.binary("sub", value, E.binary("div", E.acc(0), E.const(8.0, E.F32)))
    mean, rstd = b.reduce(
        (4, 8), (1,), [("sum", value), ("sum", E.mul(centred, centred))],
        [RowOutput(False, E.binary("div", E.acc(0), E.const(8.0, E.F32))),
         RowOutput(False, E.unary("rsqrt", E.binary("div", E.acc(1), E.const(8.0, E.F32))))],
        ["float32", "float32"], "layer_norm")
    b.output(rstd)  # rstd stays a result of its own; the mean is read by the consumer only
    xhat = b.map(lambda a, m, r: E.mul(E.binary("sub", a, m), r), x, b.reshape(mean, (4, 1)), b.reshape(rstd, (4, 1)),
                 dtype="float32")
    b.output(xhat)
    report = fuse(b.graph, 8)
    fuse_epilogues(b.graph, 8, report)
    (reduce_node,) = [n for n in b.graph.nodes if isinstance(n, Reduce)]
    assert len(b.graph.nodes) == 2  # the input and the reduction
    own = {v.id for v in reduce_node.outs}
    assert not own & {ld.args[0] for e in reduce_node.exprs() for ld in E.loads_of(e)}
    plan, _ = compile_graph(b.graph, get_device().limits)
    data = RNG.standard_normal((4, 8)).astype(np.float32)
    out = Program(get_device(), plan).run({"x": data})
    mu, sd = data.mean(1, keepdims=True), data.std(1, keepdims=True)
    np.testing.assert_allclose(out[plan.outputs[1].name], (data - mu) / sd, rtol=1e-5, atol=1e-5)


def test_value_read_by_a_later_kernel_is_stored_by_its_first_elementwise_reader():
    """An optimizer's shape: the new moment is a graph output and an input of the new parameter. Its reader
    computes it in registers and stores it too (one kernel, not two); a reader at other elements (a transpose)
    cannot, and loads what that kernel stored."""
    b = GraphBuilder()
    g = b.input("g", (6, 4), "float32")
    m = b.input("m", (24,), "float32")
    p = b.input("p", (24,), "float32")
    m_new = b.map(lambda a, c: E.add(E.mul(a, E.const(0.9, E.F32)), c), m, b.reshape(g, (24,)), dtype="float32")
    p_new = b.map(lambda a, c: E.binary("sub", a, E.mul(c, E.const(0.1, E.F32))), p, m_new, dtype="float32")
    flipped = b.map(lambda a: E.unary("exp", a), b.permute(b.reshape(m_new, (6, 4)), (1, 0)), dtype="float32")
    for v in (p_new, m_new, flipped):
        b.output(v)
    plan, report = compile_graph(b.graph, get_device().limits)
    kernels = [n for n in b.graph.nodes if isinstance(n, Pointwise)]
    assert [len(k.outs) for k in kernels] == [2, 1]
    assert kernels[0].outs[1] is m_new
    assert any("at other elements" in reason for _, _, reason in report.refused)
    data = {"g": RNG.standard_normal((6, 4)).astype(np.float32), "m": RNG.standard_normal(24).astype(np.float32),
            "p": RNG.standard_normal(24).astype(np.float32)}
    out = Program(get_device(), plan).run(data)
    want_m = data["m"] * np.float32(0.9) + data["g"].reshape(24)
    got = [out[spec.name] for spec in plan.outputs]
    np.testing.assert_allclose(got[1], want_m, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[0], data["p"] - want_m * np.float32(0.1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[2], np.exp(want_m.reshape(6, 4).T), rtol=1e-6, atol=1e-6)


def test_large_pointwise_outputs_take_several_elements_per_thread():
    """A large output gives each thread several elements (it stores them after computing all); a size that is no
    multiple of the workgroup's elements leaves a partial last workgroup. A transposed read and a broadcast row
    check that every copy decodes its own coordinates. (Rows of an odd length: no quads.)"""
    from meganeura.kernels import pointwise

    rows, cols = 1031, 2 * pointwise.WORKGROUP * pointwise.MIN_WORKGROUPS // 1000 + 1
    assert pointwise.elements_per_thread(rows * cols) == 2
    b = GraphBuilder()
    x = b.input("x", (cols, rows), "float32")
    bias = b.input("bias", (cols,), "float32")
    flipped = b.permute(x, (1, 0))
    shifted = b.map(lambda a, c: E.add(E.unary("exp", a), c), flipped,
                    b.expand(b.reshape(bias, (1, cols)), (rows, cols)), dtype="float32")
    doubled = b.map(lambda a: E.mul(a, E.const(2.0, E.F32)), shifted, dtype="float32")
    b.output(shifted)
    b.output(doubled)
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert len(plan.dispatches) == 1
    source = plan.kernels[plan.dispatches[0].kernel]
    assert "r1_1" in source and "r1_2" not in source
    data = {"x": RNG.standard_normal((cols, rows)).astype(np.float32),
            "bias": RNG.standard_normal(cols).astype(np.float32)}
    out = Program(get_device(), plan).run(data)
    want = np.exp(data["x"].T) + data["bias"]
    np.testing.assert_allclose(out[plan.outputs[0].name], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[plan.outputs[1].name], 2 * want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, copies", [((37, 12), 1), ((2, 1100), 2), ((3, 171, 8), 4), ((3, 1031, 8), 8)])
def test_pointwise_rows_of_whole_vec4s_take_quads(shape, copies, monkeypatch):
    """Outputs whose rows are whole vec4s: each copy of a thread is a quad of 4 elements, the reads of whole vec4
    rows (the input itself, a broadcast row) one vec4 load each, a transposed read and a broadcast column element by
    element. Fewer workgroups per copy (a smaller MIN_WORKGROUPS) give small shapes several copies per thread and a
    ragged last workgroup."""
    from meganeura.kernels import pointwise

    monkeypatch.setattr(pointwise, "MIN_WORKGROUPS", 1)
    units = int(np.prod(shape)) // 4
    assert pointwise.elements_per_thread(units) == copies
    flat = (int(np.prod(shape[:-1])), shape[-1])
    b = GraphBuilder()
    x = b.input("x", shape, "float32")
    xt = b.input("xt", flat[::-1], "float32")
    row = b.input("row", (shape[-1],), "float32")
    column = b.input("column", (flat[0], 1), "float32")
    flipped = b.reshape(b.permute(xt, (1, 0)), shape)
    spread_row = b.expand(b.reshape(row, (1,) * (len(shape) - 1) + (shape[-1],)), shape)
    spread_column = b.reshape(b.expand(column, flat), shape)
    mixed = b.map(lambda a, t, r, c: E.add(E.mul(E.unary("sigmoid", a), r), E.binary("sub", t, c)), x, flipped,
                  spread_row, spread_column, dtype="float32")
    doubled = b.map(lambda a: E.mul(a, E.const(2.0, E.F32)), mixed, dtype="float32")
    b.output(mixed)
    b.output(doubled)
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert len(plan.dispatches) == 1
    source = plan.kernels[plan.dispatches[0].kernel]
    assert source.count("array<vec4<f32>>") == 4  # x, the row and the two outputs; xt and the column stay scalar
    assert f"r1_{copies - 1}_3" in source and f"r1_{copies}_0" not in source
    data = {"x": RNG.standard_normal(shape).astype(np.float32),
            "xt": RNG.standard_normal(flat[::-1]).astype(np.float32),
            "row": RNG.standard_normal(shape[-1]).astype(np.float32),
            "column": RNG.standard_normal((flat[0], 1)).astype(np.float32)}
    out = Program(get_device(), plan).run(data)
    want = (1 / (1 + np.exp(-data["x"].astype(np.float64))) * data["row"]
            + (data["xt"].T - data["column"]).reshape(shape))
    np.testing.assert_allclose(out[plan.outputs[0].name], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[plan.outputs[1].name], 2 * want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(6, 10), (5,), (7, 0)])
def test_pointwise_rows_of_partial_vec4s_stay_element_by_element(shape):
    """An output whose rows are not whole vec4s (or one with no elements) is stored element by element, and is right."""
    b = GraphBuilder()
    x = b.input("x", shape, "float32")
    b.output(b.map(lambda a: E.add(a, E.const(1.0, E.F32)), x, dtype="float32"))
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert all("vec4" not in source for source in plan.kernels.values())
    data = RNG.standard_normal(shape).astype(np.float32)
    if data.size:
        np.testing.assert_array_equal(Program(get_device(), plan).run({"x": data})[plan.outputs[0].name], data + 1)


@pytest.mark.parametrize("shape,axes", [((3, 10000), (1,)), ((10000, 2), (0,)), ((5, 1000, 9), (0, 1))])
def test_few_long_rows_are_reduced_in_slices_then_combined(shape, axes):
    """Two independent phases (a sum and a max) over few long rows: the rows are cut into slices whose partial
    results a second dispatch combines, then writes a row result and an element result over every slice."""
    b = GraphBuilder()
    x = b.input("x", shape, "float32")
    value = b.load(x, [E.coord(d) for d in range(len(shape))])
    length = int(np.prod([shape[a] for a in axes]))
    mean, scaled = b.reduce(
        shape, axes, [("sum", value), ("max", E.mul(value, value))],
        [RowOutput(False, E.binary("div", E.acc(0), E.const(float(length), E.F32))),
         RowOutput(True, E.binary("sub", E.mul(value, E.acc(1)), E.acc(0)))],
        ["float32", "float32"], "two_phases")
    b.output(mean)
    b.output(scaled)
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert [d.label for d in plan.dispatches] == ["two_phases", "two_phases (merge of slices)"]
    data = RNG.standard_normal(shape).astype(np.float32)
    out = Program(get_device(), plan).run({"x": data})
    total = data.astype(np.float64).sum(axis=axes, keepdims=True)
    biggest = (data.astype(np.float64) ** 2).max(axis=axes, keepdims=True)
    np.testing.assert_allclose(out[plan.outputs[0].name], (total / length).squeeze(axes), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[plan.outputs[1].name], data * biggest - total, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("shape, axes", [
    ((6, 1028), (1,)), ((3, 10000), (1,)),  # few rows (the softmax's dependent phases are not cut into slices)
    ((4, 3, 8), (0, 2)),  # two reduced axes, the last one of 2 quads per row
    ((4, 8, 3), (1,)),  # reduced along an axis that is not the last
])
def test_row_programs_of_several_phases_read_element_by_element(shape, axes):
    """A sum and a softmax's two dependent phases (a max, then a sum of exp(x - max), then each element's share), one
    row program of three phases, read their rows element by element, not a quad at a time: phases read by quads
    added up 3x eager's error from float64 in the bias gradients of a VAE trained 8 steps (test_trajectory; one
    phase's sums read by quads are ``test_slices_of_long_rows_read_quads_where_each_is_whole_vec4s``'s). Every result
    against float64."""
    b = GraphBuilder()
    x = b.input("x", shape, "float32")
    coords = [E.coord(d) for d in range(len(shape))]
    value = b.load(x, coords)
    order = tuple(reversed(range(len(shape))))
    xt = b.input("xt", tuple(shape[d] for d in order), "float32")
    flipped = b.load(xt, [coords[d] for d in order])
    mixed = E.add(value, E.mul(flipped, E.const(0.5, E.F32)))
    total, = b.reduce(shape, axes, [("sum", value)], [RowOutput(False, E.acc(0))], ["float32"], "sum")
    shifted = E.unary("exp", E.binary("sub", mixed, E.acc(0)))
    largest, share = b.reduce(
        shape, axes, [("max", mixed), ("sum", shifted)],
        [RowOutput(False, E.acc(0)), RowOutput(True, E.binary("div", shifted, E.acc(1)))],
        ["float32", "float32"], "softmax")
    for out in (total, largest, share):
        b.output(out)
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert not any("array<vec4<f32>>" in plan.kernels[d.kernel] for d in plan.dispatches)
    data = {"x": RNG.standard_normal(shape).astype(np.float32)}
    data["xt"] = RNG.standard_normal(tuple(shape[d] for d in order)).astype(np.float32)
    out = Program(get_device(), plan).run(data)
    x64 = data["x"].astype(np.float64)
    mixed64 = x64 + 0.5 * data["xt"].astype(np.float64).transpose(order)
    want_max = mixed64.max(axis=axes, keepdims=True)
    exp = np.exp(mixed64 - want_max)
    got = [out[spec.name] for spec in plan.outputs]
    np.testing.assert_allclose(got[0], x64.sum(axis=axes), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(got[1], want_max.squeeze(axes), rtol=1e-6)
    np.testing.assert_allclose(got[2], exp / exp.sum(axis=axes, keepdims=True), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("length, quads", [(5000, True), (4100, True), (4102, False)])
def test_slices_of_long_rows_read_quads_where_each_is_whole_vec4s(length, quads):
    """Few long rows summed in 2 slices merged by a second pass: rows of whole vec4s read quads, in slices of 2500
    elements, or of 2052 and 2048 (2050 rounded up to whole quads); rows of 4102 element by element. Each against
    float64."""
    b = GraphBuilder()
    x = b.input("x", (3, length), "float32")
    total, = b.reduce((3, length), (1,), [("sum", b.load(x, [E.coord(0), E.coord(1)]))],
                      [RowOutput(False, E.acc(0))], ["float32"], "sum")
    b.output(total)
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert [d.label for d in plan.dispatches] == ["sum", "sum (merge of slices)"]
    assert ("array<vec4<f32>>" in plan.kernels[plan.dispatches[0].kernel]) == quads
    data = RNG.standard_normal((3, length)).astype(np.float32)
    got = Program(get_device(), plan).run({"x": data})[plan.outputs[0].name]
    np.testing.assert_allclose(got, data.astype(np.float64).sum(axis=1), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("length, slices", [(20000, 8), (9000, 4), (1000, 1)])
def test_softmax_over_few_long_rows_is_cut_into_slices(length, slices):
    """A softmax's max phase and its sum of exp(x - max) over few long rows: each slice sums over its own maximum,
    the merge rescales the sums to the row's. Row 0 is -inf past its first fifth (slices of -inf add nothing), row 1
    holds +inf (NaN, as eager), row 2 is all -inf (NaN), row 3 plain; the row's logsumexp and every element's share
    against float64. Short rows are not cut."""
    shape = (4, length)
    b = GraphBuilder()
    x = b.input("x", shape, "float32")
    value = b.load(x, [E.coord(0), E.coord(1)])
    shifted = E.binary("sub", value, E.acc(0))
    lse, share = b.reduce(shape, (1,), [("max", value), ("sum", E.unary("exp", shifted))],
                          [RowOutput(False, E.add(E.acc(0), E.unary("log", E.acc(1)))),
                           RowOutput(True, E.binary("div", E.unary("exp", shifted), E.acc(1)))],
                          ["float32", "float32"], "softmax")
    b.output(lse)
    b.output(share)
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert [d.label for d in plan.dispatches] == ["softmax"] + ["softmax (merge of slices)"] * (slices > 1)
    if slices > 1:
        assert plan.dispatches[0].workgroups[0] * plan.dispatches[0].workgroups[1] == 4 * slices
    data = (RNG.standard_normal(shape) * 4).astype(np.float32)
    data[0, length // 5:] = -np.inf
    data[1, length // 2] = np.inf
    data[2] = -np.inf
    out = Program(get_device(), plan).run({"x": data})
    x64 = data.astype(np.float64)
    with np.errstate(invalid="ignore"):
        peak = x64.max(axis=1, keepdims=True)
        exp = np.exp(x64 - peak)
        total = exp.sum(axis=1, keepdims=True)
        want_lse, want_share = (peak + np.log(total)).squeeze(1), exp / total
    np.testing.assert_allclose(out[plan.outputs[0].name], want_lse, rtol=1e-5)
    np.testing.assert_allclose(out[plan.outputs[1].name], want_share, rtol=1e-4, atol=1e-9)
    assert np.isnan(out[plan.outputs[1].name][1:3]).all() and np.isfinite(out[plan.outputs[1].name][[0, 3]]).all()


@pytest.mark.parametrize("length, slices", [(20000, 8), (1000, 1)])
def test_argmax_and_argmin_over_few_long_rows_are_cut_into_slices(length, slices):
    """An argmax, an argmin and a sum over few long rows, one row program: each slice keeps its best value and
    index, the merge takes the slices in order. Row 0 has its maximum twice, in different slices (the lower index
    wins, as eager), row 1 NaN twice in later slices (the first NaN wins), row 2 is all -inf (index 0), row 3 plain.
    Against numpy, whose argmax and argmin follow the same rules. Short rows are not cut."""
    shape = (4, length)
    b = GraphBuilder()
    x = b.input("x", shape, "float32")
    value = b.load(x, [E.coord(0), E.coord(1)])
    results = [RowOutput(False, E.acc(p, E.I32 if p < 2 else E.F32)) for p in range(3)]
    outs = b.reduce(shape, (1,), [("argmax", value), ("argmin", value), ("sum", value)], results,
                    ["int32", "int32", "float32"], "arg")
    for out in outs:
        b.output(out)
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert [d.label for d in plan.dispatches] == ["arg"] + ["arg (merge of slices)"] * (slices > 1)
    data = RNG.standard_normal(shape).astype(np.float32)
    data[0, [length // 3, length - 5]] = 9.0
    data[1, [length // 2, length - 3]] = np.nan
    data[2] = -np.inf
    got = Program(get_device(), plan).run({"x": data})
    largest, smallest, total = (got[spec.name] for spec in plan.outputs)
    np.testing.assert_array_equal(largest, np.argmax(data, axis=1))
    np.testing.assert_array_equal(smallest, np.argmin(data, axis=1))
    assert list(largest[:3]) == [length // 3, length // 2, 0]
    np.testing.assert_allclose(total[[0, 3]], data[[0, 3]].astype(np.float64).sum(1), rtol=1e-4, atol=1e-3)


def test_sums_use_subgroup_operations_where_the_device_has_them_and_trees_otherwise():
    """The same row sums generated with and without subgroup operations give numpy's result; only the first uses
    them (and a portable export, generated for WebGPU's defaults, never does)."""
    from meganeura.runtime.requirements import SUBGROUP_OPS, compile_limits

    device = get_device()
    if SUBGROUP_OPS not in device.limits:
        pytest.skip(f"{device.name} has no subgroup operations")
    data = RNG.standard_normal((37, 1000)).astype(np.float32)
    for limits, uses in ((device.limits, True), (compile_limits(device.limits, portable=True), False)):
        b = GraphBuilder()
        x = b.input("x", data.shape, "float32")
        b.output(b.reduce_simple(x, (1,), "sum", "float32"))
        plan, _ = compile_graph(b.graph, limits)
        assert any("subgroupAdd" in k for k in plan.kernels.values()) == uses
        out = Program(device, plan).run({"x": data})
        np.testing.assert_allclose(out[plan.outputs[0].name], data.astype(np.float64).sum(1), rtol=1e-5, atol=1e-4)


def test_batch_norm_shaped_reductions_share_one_kernel():
    """BatchNorm's shape, over columns: a mean and a variance (which recomputes the mean), rsqrt(var + eps) and a
    running-mean update over the rows' shape, and two gradient sums with a reader of the first in between. The
    sibling reductions merge (the variance's mean computed once; the reader of the first sum moves after the merged
    node) and the per-row consumers become row results: one kernel, every result as numpy's."""
    b = GraphBuilder()
    x = b.input("x", (8, 300), "float32")
    dy = b.input("dy", (8, 300), "float32")
    running = b.input("running", (300,), "float32")
    xs, dys = (b.load(v, [E.coord(0), E.coord(1)]) for v in (x, dy))
    n = E.const(8.0, E.F32)
    mean = b.reduce_simple(x, (0,), "sum", "float32", finish=lambda a: E.binary("div", a, n), label="mean")
    (var,) = b.reduce((8, 300), (0,), [("sum", xs), ("sum", E.mul(E.binary("sub", xs, E.binary("div", E.acc(0), n)),
                                                                 E.binary("sub", xs, E.binary("div", E.acc(0), n))))],
                      [RowOutput(False, E.binary("div", E.acc(1), n))], ["float32"], "var")
    rstd = b.map(lambda v: E.unary("rsqrt", E.add(v, E.const(1e-5, E.F32))), var, dtype="float32")
    new_running = b.map(lambda r, m: E.add(E.mul(r, E.const(0.9, E.F32)), E.mul(m, E.const(0.1, E.F32))),
                        running, mean, dtype="float32")
    grad_bias = b.reduce_simple(dy, (0,), "sum", "float32", label="sum")
    scaled = b.map(lambda g: E.mul(g, E.const(3.0, E.F32)), grad_bias, dtype="float32")
    (grad_weight,) = b.reduce((8, 300), (0,), [("sum", E.mul(dys, xs))], [RowOutput(False, E.acc(0))], ["float32"],
                              "sum")
    for v in (rstd, new_running, scaled, grad_weight):
        b.output(v)
    plan, report = compile_graph(b.graph, get_device().limits)
    (merged,) = [node for node in b.graph.nodes if isinstance(node, Reduce)]
    assert len(merged.phases) == 4  # the variance's sum(x) is the mean's
    assert len(plan.dispatches) == 1
    data = {k: RNG.standard_normal(s).astype(np.float32) for k, s in (("x", (8, 300)), ("dy", (8, 300)),
                                                                        ("running", (300,)))}
    out = [Program(get_device(), plan).run(data)[t.name] for t in plan.outputs]
    x64 = data["x"].astype(np.float64)
    want = [1 / np.sqrt(x64.var(0) + 1e-5), 0.9 * data["running"] + 0.1 * x64.mean(0), 3 * data["dy"].sum(0),
            (data["dy"].astype(np.float64) * x64).sum(0)]
    for got, expected in zip(out, want):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _projections(b, x, weights, k: int):
    """One gemm per weight (n, k) with the same A operand ``x`` (m, k): linear layers on one input."""
    a = E.cast(b.load(x, [E.coord(1), E.coord(2)]), E.F32)
    return [b.gemm(1, x.shape[0], w.shape[0], k, a, E.cast(b.load(w, [E.coord(2), E.coord(1)]), E.F32))
            for w in weights]


@pytest.mark.parametrize("m,k", [(70, 40), (70, 512), (1, 40)])  # 512: K in slices; m = 1: the matrix-vector kernel
def test_sibling_matmuls_share_one_kernel(m, k):
    """Three products of one input with three weights (widths 50, 3 and 130: blocks straddle tiles), the first with
    a bias and the second with a relu epilogue, merge into one matmul node whose kernel writes each output; a
    fourth product of another input stays apart. Every output as numpy's."""
    widths = (50, 3, 130)
    b = GraphBuilder()
    x = b.input("x", (m, k), "float32")
    other = b.input("other", (m, k), "float32")
    weights = [b.input(f"w{i}", (n, k), "float32") for i, n in enumerate(widths)]
    bias = b.input("bias", (50,), "float32")
    first, second, third = _projections(b, x, weights, k)
    (fourth,) = _projections(b, other, weights[:1], k)
    with_bias = b.map(lambda v, c: E.add(v, c), first, b.reshape(bias, (1, 1, 50)), dtype="float32")
    relu = b.map(lambda v: E.binary("maximum", v, E.const(0.0, E.F32)), second, dtype="float32")
    for v in (with_bias, relu, third, fourth):
        b.output(v)
    plan, report = compile_graph(b.graph, get_device().limits)
    matmuls = [node for node in b.graph.nodes if isinstance(node, Matmul)]
    assert sorted(len(node.outs) for node in matmuls) == [1, 3]
    merged = next(node for node in matmuls if len(node.outs) == 3)
    assert merged.sizes == list(widths) and merged.block_axis == "j"
    data = {"x": RNG.standard_normal((m, k)), "other": RNG.standard_normal((m, k)), "bias": RNG.standard_normal(50),
            **{f"w{i}": RNG.standard_normal((n, k)) for i, n in enumerate(widths)}}
    data = {name: a.astype(np.float32) for name, a in data.items()}
    out = Program(get_device(), plan).run(data)
    x64, o64 = data["x"].astype(np.float64), data["other"].astype(np.float64)
    w64 = [data[f"w{i}"].astype(np.float64) for i in range(3)]
    want = [x64 @ w64[0].T + data["bias"], np.maximum(x64 @ w64[1].T, 0), x64 @ w64[2].T, o64 @ w64[0].T]
    for spec, expected in zip(plan.outputs, want):
        np.testing.assert_allclose(out[spec.name].reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,k", [(70, 40), (16, 512)])  # 512: K in slices
def test_many_sibling_matmuls_fetch_their_weights_in_a_loop(m, k):
    """Five products of one input (LOOPED_FETCH_BLOCKS or more) merge into one kernel that fetches the weights in a
    loop, one call of their loader's chain; every output as numpy's. ``on_kernel`` hears of each kernel once, with
    the binding count of its dispatches."""
    from meganeura.lowering.node_kernels import LOOPED_FETCH_BLOCKS

    widths = (50, 3, 130, 64, 20)
    assert len(widths) >= LOOPED_FETCH_BLOCKS
    b = GraphBuilder()
    x = b.input("x", (m, k), "float32")
    weights = [b.input(f"w{i}", (n, k), "float32") for i, n in enumerate(widths)]
    for v in _projections(b, x, weights, k):
        b.output(v)
    heard = []
    plan, _ = compile_graph(b.graph, get_device().limits, on_kernel=lambda *kernel: heard.append(kernel))
    assert sorted(key for _, _, key in heard) == sorted(plan.kernels)
    assert all(plan.kernels[key] == source for source, _, key in heard)
    assert all(len(d.bindings) == dict((key, n) for _, n, key in heard)[d.kernel] for d in plan.dispatches)
    (merged,) = [node for node in b.graph.nodes if isinstance(node, Matmul)]
    assert merged.sizes == list(widths)
    products = [source for source in plan.kernels.values() if "// ---- matmul: tiled" in source]
    assert products and all("switch t" in source for source in products)
    data = {"x": RNG.standard_normal((m, k)), **{f"w{i}": RNG.standard_normal((n, k)) for i, n in enumerate(widths)}}
    data = {name: a.astype(np.float32) for name, a in data.items()}
    out = Program(get_device(), plan).run(data)
    x64 = data["x"].astype(np.float64)
    for spec, i in zip(plan.outputs, range(len(widths))):
        expected = x64 @ data[f"w{i}"].astype(np.float64).T
        np.testing.assert_allclose(out[spec.name].reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)


def test_sibling_matmul_reading_the_first_result_is_not_merged():
    """A product whose B operand is the first product's result cannot run in the first one's kernel."""
    b = GraphBuilder()
    x = b.input("x", (16, 16), "float32")
    w = b.input("w", (16, 16), "float32")
    (first,) = _projections(b, x, [w], 16)
    (second,) = _projections(b, x, [b.reshape(first, (16, 16))], 16)
    b.output(second)
    plan, report = compile_graph(b.graph, RecordingDevice().limits)  # no GPU needed
    assert len([node for node in b.graph.nodes if isinstance(node, Matmul)]) == 2
    assert any("reads a result of the first" in reason for *_, reason in report.refused)


def test_repeated_nodes_are_computed_once():
    """A matmul written twice (another label) with a relu of each as graph outputs, and an exp of the input at other
    coordinates: the second matmul and its reshape are dropped (the second relu, a graph output, stays and reads the
    first matmul), the exp at other coordinates stays. Outputs as numpy's."""
    from meganeura.lowering.cse import eliminate_common_nodes

    b = GraphBuilder()
    x = b.input("x", (6, 6), "float32")
    w = b.input("w", (6, 6), "float32")
    products = [b.matmul(x, w, label=label) for label in ("matmul", "again")]
    relus = [b.map(lambda v: E.binary("maximum", v, E.const(0.0, E.F32)), p, dtype="float32") for p in products]
    straight = b.map(lambda v: E.unary("exp", v), x, dtype="float32")
    other = b.map(lambda v: E.unary("exp", v), b.view(x, (6, 6), [E.coord(1), E.coord(0)], "t"), dtype="float32")
    for v in (*relus, straight, other):
        b.output(v)
    assert eliminate_common_nodes(b.graph) == 2
    assert len([n for n in b.graph.nodes if isinstance(n, Matmul)]) == 1
    assert len([n for n in b.graph.nodes if isinstance(n, Pointwise) and n.expr.op != "load"]) == 4
    plan, _ = compile_graph(b.graph, get_device().limits)
    data = {"x": RNG.standard_normal((6, 6)).astype(np.float32), "w": RNG.standard_normal((6, 6)).astype(np.float32)}
    out = Program(get_device(), plan).run(data)
    x64, w64 = data["x"].astype(np.float64), data["w"].astype(np.float64)
    relu = np.maximum(x64 @ w64, 0)
    for spec, want in zip(plan.outputs, (relu, relu, np.exp(x64), np.exp(x64.T))):
        np.testing.assert_allclose(out[spec.name].reshape(want.shape), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens,width", [(90, 24), (600, 24), (90, 1)])  # 600: K in slices; width 1: matrix-vector
def test_sibling_matmuls_sharing_b_stack_their_rows(tokens, width):
    """Weight gradients of three projections of one input: dW_k = dY_k^T X share B (X) and merge into one matmul
    whose output rows are stacked (sizes 40, 3 and 70), each block with its own A and a scaled second one; the result
    of every block as numpy's."""
    sizes = (40, 3, 70)
    b = GraphBuilder()
    x = b.input("x", (tokens, width), "float32")
    grads = [b.input(f"dy{i}", (tokens, s), "float32") for i, s in enumerate(sizes)]
    x_op = E.cast(b.load(x, [E.coord(1), E.coord(2)]), E.F32)  # B over (b, p = token, j = feature)
    outs = [b.gemm(1, s, width, tokens, E.cast(b.load(dy, [E.coord(2), E.coord(1)]), E.F32), x_op,
                   epilogue=E.mul(E.acc(0), E.const(0.5, E.F32)) if i == 1 else None)
            for i, (s, dy) in enumerate(zip(sizes, grads))]
    for v in outs:
        b.output(v)
    plan, _ = compile_graph(b.graph, get_device().limits)
    (merged,) = [node for node in b.graph.nodes if isinstance(node, Matmul)]
    assert merged.block_axis == "i" and merged.sizes == list(sizes)
    assert len(plan.dispatches) == (2 if tokens == 600 else 1)
    data = {"x": RNG.standard_normal((tokens, width)).astype(np.float32),
            **{f"dy{i}": RNG.standard_normal((tokens, s)).astype(np.float32) for i, s in enumerate(sizes)}}
    out = Program(get_device(), plan).run(data)
    x64 = data["x"].astype(np.float64)
    want = [data[f"dy{i}"].astype(np.float64).T @ x64 * (0.5 if i == 1 else 1.0) for i in range(3)]
    for spec, expected in zip(plan.outputs, want):
        np.testing.assert_allclose(out[spec.name].reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)


def test_compile_graph_runs_a_repeated_kernel_once():
    """(x @ w) written twice, each feeding another matmul (matmul operands take no producers, so both survive
    fusion whole): compile_graph drops the second, and both products read the first one. Outputs as numpy's."""
    b = GraphBuilder()
    x, w, v1, v2 = (b.input(name, (8, 8), "float32") for name in ("x", "w", "v1", "v2"))
    for v in (v1, v2):
        b.output(b.matmul(b.matmul(x, w, label="repeated"), v))
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert plan.stats["common_nodes"] == 1
    assert sum(d.label.startswith("repeated") for d in plan.dispatches) == 1
    data = {name: RNG.standard_normal((8, 8)).astype(np.float32) for name in ("x", "w", "v1", "v2")}
    out = Program(get_device(), plan).run(data)
    xw = data["x"].astype(np.float64) @ data["w"]
    for spec, v in zip(plan.outputs, ("v1", "v2")):
        np.testing.assert_allclose(out[spec.name].reshape(8, 8), xw @ data[v], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [768, 256])
def test_sibling_reductions_far_apart_keep_no_large_operand_alive(rows):
    """Bias-gradient-like sums of two "layers" over the same rows, with four unrelated kernels between them: merged,
    the first layer's (rows, 1024) operand would stay in the arena until the second's sum. At 768 rows (3 MiB, over
    ``KEEP_ALIVE_BYTES``) they stay apart, the reason recorded, and the operand's range is reused; at 256 rows (1 MiB)
    they merge (full-size Whisper-tiny's backward arena held its four layers' FFN gradients so: 141.6 MiB, 69.1
    without)."""
    b = GraphBuilder()
    chain = b.input("c", (64, 64), "float32")
    sums = []
    for layer in range(2):
        grad = b.matmul(b.input(f"a{layer}", (rows, 16), "float32"), b.input(f"w{layer}", (16, 1024), "float32"))
        sums.append(b.reduce_simple(grad, (0,), "sum", "float32", label="sum"))
        for _ in range(4 if layer == 0 else 0):
            chain = b.matmul(chain, b.input(f"v{len(b.graph.nodes)}", (64, 64), "float32"))
    for v in (*sums, chain):
        b.output(v)
    plan, report = compile_graph(b.graph, RecordingDevice().limits)
    labels = [d.label.split()[0] for d in plan.dispatches]
    grad_bytes = rows * 1024 * 4
    if rows == 768:
        assert labels.count("sum") == 2
        assert any(f"it would keep {grad_bytes} bytes that the first reads last in memory across" in why
                   for *_, why in report.refused)
        assert plan.stats["arena_bytes"] < 2 * grad_bytes
    else:
        assert labels.count("sum") == 1
        assert plan.stats["arena_bytes"] >= 2 * grad_bytes


@pytest.mark.parametrize("k, room, vec4_bindings", [(40, 8, 1), (42, 8, 0), (40, 2, 0)])
def test_quad_staged_matmuls_read_rows_of_whole_vec4s_through_one_vec4_binding(k, room, vec4_bindings):
    """x @ x.T with a quad-staged variant forced: both operands read x along K, so where K is whole vec4s one vec4
    binding of x serves both loaders; none where K is not (42) or no binding is left (the adapter's limit). Every
    output as numpy's (f64, rtol 1e-4)."""
    from meganeura.kernels.matmul_plans import MatmulChoice

    m = 70
    b = GraphBuilder()
    x = b.input("x", (m, k), "float32")
    b.output(_projections(b, x, [x], k)[0])
    limits = {**get_device().limits, "max-storage-buffers-per-shader-stage": room}
    choice = MatmulChoice((64, 64), (4, 4), 1, quads=True, patches=True)
    plan, _ = compile_graph(b.graph, limits, choose_matmuls=lambda problems: [choice] * len(problems))
    (source,) = [s for s in plan.kernels.values() if "// ---- matmul: tiled" in s]
    assert source.count("array<vec4<f32>>") == vec4_bindings and "quad staging" in source
    assert ("vec4 loads of AB" in source) == (vec4_bindings == 1)
    data = {"x": RNG.standard_normal((m, k)).astype(np.float32)}
    (out,) = Program(get_device(), plan).run(data).values()
    x64 = data["x"].astype(np.float64)
    np.testing.assert_allclose(out.reshape(m, m), x64 @ x64.T, rtol=1e-4, atol=1e-4)


def test_sibling_outputs_of_one_shape_share_one_kernel():
    """Two graph outputs of one shape, each a pointwise node of its own inputs (a KV cache's key and value, each
    concatenated with its new row), are stored by one kernel (lowering/sibling_updates.py); an output of another
    shape keeps its own. Every output as numpy's."""
    b = GraphBuilder()
    k, v, w = (b.input(name, (3, 5), "float32") for name in ("k", "v", "w"))
    b.output(b.map(lambda a: E.mul(a, E.const(2.0, E.F32)), k, dtype="float32"))
    b.output(b.map(lambda a: E.add(a, E.const(1.0, E.F32)), v, dtype="float32"))
    b.output(b.reshape(b.map(lambda a: E.unary("neg", a), w, dtype="float32"), (15,)))
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert len(plan.dispatches) == 2, [d.label for d in plan.dispatches]
    data = {name: RNG.standard_normal((3, 5)).astype(np.float32) for name in ("k", "v", "w")}
    out = Program(get_device(), plan).run(data)
    want = [data["k"] * 2, data["v"] + 1, -data["w"].reshape(15)]
    for spec, expected in zip(plan.outputs, want):
        np.testing.assert_array_equal(out[spec.name].reshape(expected.shape), expected)


def test_loads_and_size_of_an_expression_take_one_walk(monkeypatch):
    """Fusion asks the loads and the size of each new expression: one walk gives both (``expr._walk_once``), kept
    on the expression, and neither asks again; the loads are those of a walk, in its order."""
    walks = []
    walk = E.walk
    monkeypatch.setattr(E, "walk", lambda e, skip=None: walks.append(e) or walk(e, skip))
    x = E.load(1, (E.coord(0),), E.F32)
    e = E.add(E.mul(x, E.load(2, (E.add(E.coord(0), E.const(1, E.I32)),), E.F32)), x)
    assert E.size(e) == 8 and E.loads_of(e) == [n for n in walk(e) if n.op == "load"]  # (the two c0 apart)
    assert E.size(e) == 8 and len(walks) == 1


def test_adjacent_sibling_reductions_sum_no_bytes_kept_alive(monkeypatch):
    """The bytes a merge of two sibling reductions would keep alive are summed only where more than
    ``KEEP_ALIVE_ACROSS`` kernels lie between them: two sums one after the other merge without it, every result as
    numpy's."""
    from meganeura.lowering import siblings

    summed = []
    kept_alive = siblings._kept_alive
    monkeypatch.setattr(siblings, "_kept_alive", lambda *a: summed.append(a) or kept_alive(*a))
    b = GraphBuilder()
    xs = [b.input(name, (8, 300), "float32") for name in ("x", "y")]
    for v in xs:
        b.output(b.reduce_simple(v, (0,), "sum", "float32", label="sum"))
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert len(plan.dispatches) == 1 and not summed
    data = {name: RNG.standard_normal((8, 300)).astype(np.float32) for name in ("x", "y")}
    out = Program(get_device(), plan).run(data)
    for spec, name in zip(plan.outputs, ("x", "y")):
        np.testing.assert_allclose(out[spec.name], data[name].astype(np.float64).sum(0), rtol=1e-5, atol=1e-4)
