"""Outputs stored over an input's buffer (``Graph.in_place``, lowering/in_place.py): granted where the writing kernel is
pointwise, reads the input only at the element it stores and is its last reader; refused otherwise, with the reason.
Plans on the recording device (WebGPU's default limits, no GPU) for what is bound; the real adapter for the values."""
import numpy as np
import pytest

from meganeura.lowering import compile_graph
from meganeura.lowering import expr as E
from meganeura.lowering.builder import GraphBuilder
from meganeura.lowering.ir import RowOutput
from meganeura.runtime.device import get_device
from meganeura.runtime.errors import InputError, KernelStatusError
from meganeura.runtime.program import Program
from meganeura.runtime.resident import DeviceArray

from helpers.recording_device import RecordingDevice

RNG = np.random.default_rng(11)
LR = 0.5


def sgd_graph(n=(4, 6), read=None, extra=None):
    """p' = p - LR * g, requested over p. ``read(b, p)`` replaces the load of p in the update; ``extra(b, p)`` adds an
    output after it."""
    b = GraphBuilder()
    p, g = b.input("p", n, "float32"), b.input("g", n, "float32")
    old = read(b, p) if read is not None else p
    b.output(b.map(lambda a, d: E.binary("sub", a, E.mul(d, E.const(LR, E.F32))), old, g, dtype="float32"))
    if extra is not None:
        b.output(extra(b, p))
    b.graph.in_place = {0: "p"}
    return b.graph


def plan_of(graph):
    plan, _ = compile_graph(graph, RecordingDevice().limits)
    return plan


def test_an_update_is_stored_over_its_input_and_bound_once():
    plan = plan_of(sgd_graph())
    assert plan.in_place == {"out0": "p"} and plan.stats["in_place_bytes"] == 4 * 6 * 4
    assert [b.role for b in plan.buffers] == ["input", "input"]  # no buffer of its own
    ((dispatch),) = plan.dispatches
    assert [b.buffer for b in dispatch.bindings] == ["input:p", "input:g"]  # read and written through one binding


@pytest.mark.parametrize("read, extra, reason", [
    (lambda b, p: b.permute(p, (1, 0)), None, "reads the input at other elements"),
    (None, lambda b, p: b.reshape(b.map(lambda a: E.mul(a, E.const(2.0, E.F32)), p, dtype="float32"), (36,)),
     "a later kernel reads the input"),  # (of another shape: an output of the update's would join its kernel)
    (lambda b, p: b.map(lambda a, s: E.add(a, s), p, b.reshape(b.reduce_simple(p, (1,), "sum", "float32"), (6, 1)),
                        dtype="float32"), None, "its kernel is a Reduce"),
], ids=["transposed", "read-later", "reduction"])
def test_unsafe_requests_keep_a_buffer_of_their_own(read, extra, reason):
    n = (6, 6)
    plan = plan_of(sgd_graph(n, read, extra))
    assert plan.in_place == {}
    assert reason in plan.stats["in_place_refused"]["out0"]
    assert plan.buffer("out0").role == "output"


def test_another_shape_is_refused():
    b = GraphBuilder()
    p = b.input("p", (4, 6), "float32")
    b.output(b.reshape(b.map(lambda a: E.unary("neg", a), p, dtype="float32"), (24,)))
    b.graph.in_place = {0: "p"}
    assert "is not stored as the input" in plan_of(b.graph).stats["in_place_refused"]["out0"]


def test_the_run_returns_the_input_array_overwritten_and_reads_nothing_back():
    device = get_device()
    plan, _ = compile_graph(sgd_graph(), device.limits)
    program = Program(device, plan, device_only_inputs=["p"])
    p, g = RNG.standard_normal((4, 6), dtype=np.float32), RNG.standard_normal((4, 6), dtype=np.float32)
    array = DeviceArray.upload(device, p, "float32")
    before = device.counters.snapshot()
    for step in range(3):
        out = program.run({"g": g}, device_inputs={"p": array})["out0"]
        assert out is array
    assert device.counters.snapshot()["buffers_created"] == before["buffers_created"]
    np.testing.assert_allclose(array.numpy(), p - 3 * LR * g, rtol=1e-6, atol=1e-6)


def test_the_input_must_come_from_the_device_and_alone():
    device = get_device()
    plan, _ = compile_graph(sgd_graph(), device.limits)
    with pytest.raises(InputError, match="must be device-only inputs"):
        Program(device, plan)
    program = Program(device, plan, device_only_inputs=["p", "g"])
    shared = DeviceArray.upload(device, np.ones((4, 6), np.float32), "float32")
    with pytest.raises(InputError, match="bound to one array"):
        program.run({}, device_inputs={"p": shared, "g": shared})


def test_a_failed_check_leaves_the_input_as_it_was():
    """An index out of range in a gather before the update: the run raises, and the writer, guarded by the status
    word, stored nothing. (p is shorter than the gather, so the update is a kernel of its own.)"""
    b = GraphBuilder()
    p, i = b.input("p", (5,), "float32"), b.input("i", (8,), "int32")
    table = b.input("table", (4,), "float32")
    index = b.load(i, [E.coord(0)])
    inside = E.binary("and", E.binary("ge", index, E.const(0, E.I32)), E.binary("lt", index, E.const(4, E.I32)))
    gathered = b.pointwise((8,), "float32", b.check(b.load(table, [index]), inside, "index out of range"))
    total = b.reduce_simple(gathered, (0,), "sum", "float32")
    b.output(b.map(lambda a, s: E.binary("sub", a, s), p, b.expand(b.reshape(total, (1,)), (5,)), dtype="float32"))
    b.graph.in_place = {0: "p"}
    device = get_device()
    plan, _ = compile_graph(b.graph, device.limits)
    assert plan.in_place == {"out0": "p"}
    program = Program(device, plan, device_only_inputs=["p"])
    assert "atomicLoad" in plan.kernels[plan.dispatches[-1].kernel]
    start = RNG.standard_normal(5, dtype=np.float32)
    array = DeviceArray.upload(device, start, "float32")
    entries = np.arange(4, dtype=np.float32)
    program.run({"i": np.array([0, 1, 2, 3, 4, 0, 1, 2], np.int32), "table": entries}, device_inputs={"p": array})
    with pytest.raises(KernelStatusError, match="index out of range"):  # (no host output: raised at the next wait)
        device.synchronize()
    np.testing.assert_array_equal(array.numpy(), start)
    program.run({"i": np.array([0, 1, 2, 3, 3, 0, 1, 2], np.int32), "table": entries}, device_inputs={"p": array})
    np.testing.assert_allclose(array.numpy(), start - 12.0, rtol=1e-6)


def test_a_writer_that_checks_has_its_checks_run_first():
    """An update whose own expression checks its input (a static KV cache's position check): the checks become a
    kernel of their own before it, the request is granted, and a failing check leaves the input as it was."""
    n = (6, 6)
    plan = plan_of(sgd_graph(n, lambda b, p: b.map(
        lambda a: b.check(a, E.binary("lt", a, E.const(100.0, E.F32)), "too large"), p, dtype="float32")))
    assert plan.in_place == {"out0": "p"} and plan.stats["separated_checks"] == 1
    device = get_device()
    program = Program(device, compile_graph(sgd_graph(n, lambda b, p: b.map(
        lambda a: b.check(a, E.binary("lt", a, E.const(100.0, E.F32)), "too large"), p, dtype="float32")),
        device.limits)[0], device_only_inputs=["p"])
    start = RNG.standard_normal(n, dtype=np.float32)
    start[2, 3] = 500.0
    array = DeviceArray.upload(device, start, "float32")
    program.run({"g": np.ones(n, np.float32)}, device_inputs={"p": array})
    with pytest.raises(KernelStatusError, match="too large"):  # (no host output: raised at the next wait)
        array.numpy()
    np.testing.assert_array_equal(array.numpy(), start)


def test_updates_move_up_to_free_their_gradients_early():
    """Two 'layers' whose gradients come from matmuls, the optimizer traced after both (as a training step traces
    it): each Adam-like update (m' = 0.9 m + g, v' = 0.9 v + g g, p' = p - LR m' / sqrt(v' + 1), each over its input)
    moves up to just after its gradient, so the arena holds one gradient at a time, not both."""
    b = GraphBuilder()
    grads, states = [], []
    for layer in range(2):
        a, x = b.input(f"a{layer}", (32, 16), "float32"), b.input(f"x{layer}", (16, 32), "float32")
        grads.append(b.matmul(a, x))
        states.append([b.input(f"{s}{layer}", (32, 32), "float32") for s in "pmv"])
    for layer, (g, (p, m, v)) in enumerate(zip(grads, states)):
        new_m = b.map(lambda s, d: E.add(E.mul(s, E.const(0.9, E.F32)), d), m, g, dtype="float32")
        new_v = b.map(lambda s, d: E.add(E.mul(s, E.const(0.9, E.F32)), E.mul(d, d)), v, g, dtype="float32")
        step = b.map(lambda w, s, t: E.binary("sub", w, E.binary("div", E.mul(s, E.const(LR, E.F32)),
                                                                  E.unary("sqrt", E.add(t, E.const(1.0, E.F32))))),
                     p, new_m, new_v, dtype="float32")
        for out, name in zip((new_m, new_v, step), "mvp"):
            b.graph.in_place[len(b.graph.outputs)] = f"{name}{layer}"
            b.output(out)
    plan = plan_of(b.graph)
    assert sorted(plan.in_place.values()) == ["m0", "m1", "p0", "p1", "v0", "v1"]
    assert plan.stats["hoisted_writers"] == 1
    assert plan.stats["arena_bytes"] == 32 * 32 * 4  # one gradient at a time
    assert [d.label.split()[0] for d in plan.dispatches] == ["matmul", "pointwise", "matmul", "pointwise"]


def epilogue_graph(transposed: bool = False):
    """S = A B, then Y = (C D) * S in the epilogue of a second matmul (the last reader of S), then the row sums of Y:
    Y may be stored over S, where its epilogue reads S at the element it stores (``transposed``: at another)."""
    b = GraphBuilder()
    a, bb, c, d = (b.input(name, shape, "float32") for name, shape in
                   (("a", (2, 12, 4)), ("b", (2, 4, 12)), ("c", (2, 12, 4)), ("d", (2, 4, 12))))
    s = b.matmul(a, bb)
    at = [E.coord(0), E.coord(2), E.coord(1)] if transposed else [E.coord(0), E.coord(1), E.coord(2)]
    y = b.gemm(2, 12, 12, 4, b.load(c, [E.coord(0), E.coord(1), E.coord(2)]),
               b.load(d, [E.coord(0), E.coord(1), E.coord(2)]), epilogue=E.mul(E.acc(0), b.load(s, at)))
    b.output(b.reduce_simple(y, (2,), "sum", "float32"))
    return b.graph


@pytest.mark.parametrize("transposed", [False, True], ids=["same-element", "transposed"])
def test_a_matmul_epilogue_stores_over_the_arena_operand_it_reads_last(transposed):
    """``arena_aliases``: Y's epilogue is the last reader of S and reads it only at the element it stores, so Y takes
    S's arena range, bound once in Y's dispatch, and the arena holds one 2x12x12 matrix, not two (the unfused
    attention backward so stores dS over its score matrix); read transposed, S keeps a range of its own. Values on
    the adapter."""
    graph = epilogue_graph(transposed)
    plan = plan_of(epilogue_graph(transposed))
    one = 2 * 12 * 12 * 4  # bytes; ranges start at multiples of 256 under WebGPU's default limits
    assert plan.stats["arena_aliases"] == (0 if transposed else 1)
    assert plan.stats["arena_bytes"] == (1280 + one if transposed else one)
    first, second, _ = plan.dispatches
    arena = [(b.offset, b.size) for b in second.bindings if b.buffer == "arena"]
    assert arena == ([(0, one), (1280, one)] if transposed else [(0, one)])
    device = get_device()
    plan, _ = compile_graph(graph, device.limits)
    x = {name: RNG.standard_normal(shape, dtype=np.float32) for name, shape in
         (("a", (2, 12, 4)), ("b", (2, 4, 12)), ("c", (2, 12, 4)), ("d", (2, 4, 12)))}
    s = x["a"] @ x["b"]
    want = ((x["c"] @ x["d"]) * (s.transpose(0, 2, 1) if transposed else s)).sum(axis=2)
    np.testing.assert_allclose(Program(device, plan).run(x)["out0"], want, rtol=1e-5, atol=1e-5)


def running_mean_graph(length: int, read=None, checked: bool = False):
    """BatchNorm's running mean: r' = 0.9 r + 0.1 mean(x) over rows of ``length``, requested over r, its row result
    in the reduction's kernel; ``read(b, r)`` replaces the load of r there (at the row's own element by default).
    ``checked``: a gather of ``table`` at indices ``i`` (checked to be in range) is the plan's second output."""
    b = GraphBuilder()
    x, r = b.input("x", (4, length), "float32"), b.input("r", (4,), "float32")
    old = read(b, r) if read is not None else b.load(r, [E.coord(0)])
    update = E.add(E.mul(old, E.const(0.9, E.F32)), E.mul(E.acc(0), E.const(0.1 / length, E.F32)))
    (new,) = b.reduce((4, length), (1,), [("sum", b.load(x, [E.coord(0), E.coord(1)]))], [RowOutput(False, update)],
                      ["float32"], "running_mean")
    b.output(new)
    if checked:
        i, table = b.input("i", (8,), "int32"), b.input("table", (4,), "float32")
        index = b.load(i, [E.coord(0)])
        inside = E.binary("and", E.binary("ge", index, E.const(0, E.I32)), E.binary("lt", index, E.const(4, E.I32)))
        b.output(b.pointwise((8,), "float32", b.check(b.load(table, [index]), inside, "index out of range")))
    b.graph.in_place = {0: "r"}
    return b.graph


@pytest.mark.parametrize("length", [64, 16384], ids=["one-pass", "cut-rows"])
def test_a_reduction_stores_a_row_result_over_the_input_it_reads_at_that_row(length):
    """A row result reading its input only at its own row (BatchNorm's running statistics, updated from the batch's)
    is stored over it, in one pass and where rows are cut into slices merged by a second pass (one thread of the
    row's first slice stores it, after every phase); the values are the reduction's."""
    device = get_device()
    plan, _ = compile_graph(running_mean_graph(length), device.limits)
    assert plan.in_place == {"out0": "r"} and plan.stats["in_place_refused"] == {}
    assert len(plan.dispatches) == (1 if length == 64 else 2)
    program = Program(device, plan, device_only_inputs=["r"])
    x, start = RNG.standard_normal((4, length), dtype=np.float32), RNG.standard_normal(4, dtype=np.float32)
    array = DeviceArray.upload(device, start, "float32")
    for _ in range(2):
        assert program.run({"x": x}, device_inputs={"r": array})["out0"] is array
    mean = x.astype(np.float64).mean(axis=1)
    np.testing.assert_allclose(array.numpy(), 0.81 * start + 0.19 * mean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("read, reason", [
    (lambda b, r: b.load(r, [E.binary("sub", E.const(3, E.I32), E.coord(0))]), "reads the input at other rows"),
    (lambda b, r: E.acc(0), None),
], ids=["reversed", "not-read"])
def test_a_row_result_reading_other_rows_keeps_a_buffer_of_its_own(read, reason):
    plan = plan_of(running_mean_graph(64, read))
    if reason is None:
        assert plan.in_place == {"out0": "r"}
    else:
        assert plan.in_place == {} and reason in plan.stats["in_place_refused"]["out0"]


def test_an_element_result_or_a_phase_reading_the_input_is_refused():
    """Element results and phases run in every thread of a row, so a reduction whose output stored over an input is
    an element result, or whose phase reads that input, keeps a buffer of its own."""
    b = GraphBuilder()
    x = b.input("x", (4, 8), "float32")
    (y,) = b.reduce((4, 8), (1,), [("sum", b.load(x, [E.coord(0), E.coord(1)]))],
                    [RowOutput(True, E.mul(b.load(x, [E.coord(0), E.coord(1)]), E.acc(0)))], ["float32"], "scaled")
    b.output(y)
    b.graph.in_place = {0: "x"}
    assert "element results" in plan_of(b.graph).stats["in_place_refused"]["out0"]
    b = GraphBuilder()
    x, r = b.input("x", (4, 8), "float32"), b.input("r", (4,), "float32")
    phase = E.mul(b.load(x, [E.coord(0), E.coord(1)]), b.load(r, [E.coord(0)]))
    (s,) = b.reduce((4, 8), (1,), [("sum", phase)], [RowOutput(False, E.acc(0))], ["float32"], "weighted")
    b.output(s)
    b.graph.in_place = {0: "r"}
    assert "phases or element results read the input" in plan_of(b.graph).stats["in_place_refused"]["out0"]


def assert_a_failed_run_leaves(program, inputs: dict, name: str, array, start, error: str) -> None:
    """A run of ``program`` on ``inputs`` raises ``error`` and leaves its device input ``name`` (``array``, holding
    ``start``) as it was."""
    with pytest.raises(KernelStatusError, match=error):
        program.run(inputs, device_inputs={name: array})
    np.testing.assert_array_equal(array.numpy(), start)


def test_a_failed_check_leaves_a_row_result_stored_over_its_input_as_it_was():
    """The gather's index check runs first (a kernel of its own); the reduction stores its row result over r only
    while the status word is clear: a failing run leaves r as it was, the next one updates it."""
    device = get_device()
    plan, _ = compile_graph(running_mean_graph(64, checked=True), device.limits)
    assert plan.in_place == {"out0": "r"}
    program = Program(device, plan, device_only_inputs=["r"])
    x, start = RNG.standard_normal((4, 64), dtype=np.float32), RNG.standard_normal(4, dtype=np.float32)
    array = DeviceArray.upload(device, start, "float32")
    table = np.arange(4, dtype=np.float32)
    assert_a_failed_run_leaves(program, {"x": x, "i": np.array([0, 1, 2, 3, 4, 0, 1, 2], np.int32), "table": table},
                               "r", array, start, "index out of range")
    program.run({"x": x, "i": np.zeros(8, np.int32), "table": table}, device_inputs={"r": array})
    np.testing.assert_allclose(array.numpy(), 0.9 * start + 0.1 * x.astype(np.float64).mean(axis=1), rtol=1e-5,
                               atol=1e-5)


def test_a_check_on_a_cheap_value_of_an_input_runs_before_the_writers():
    """A loss's target check reads ``target != ignore_index``, a pointwise value of the target that the loss computes
    late in the node order (and returns): the check kernel computes that condition from the target itself and runs
    first, so it no longer refuses an update before it (BatchNorm's ``num_batches_tracked`` in a training forward);
    a target out of range still raises, and leaves the input as it was."""
    b = GraphBuilder()
    p, g = b.input("p", (6,), "float32"), b.input("g", (6,), "float32")
    b.output(b.map(lambda a, d: E.binary("sub", a, E.mul(d, E.const(LR, E.F32))), p, g, dtype="float32"))
    target, table = b.input("target", (8,), "int32"), b.input("table", (4,), "float32")
    valid = b.map(lambda t: E.binary("ne", t, E.const(-100, E.I32)), target, dtype="bool", compute="keep")
    index = b.load(target, [E.coord(0)])
    inside = E.binary("and", E.binary("ge", index, E.const(0, E.I32)), E.binary("lt", index, E.const(4, E.I32)))
    ok = E.binary("or", inside, E.unary("not", b.load(valid, [E.coord(0)])))
    picked = b.pointwise((8,), "float32", b.check(b.load(table, [E.where(inside, index, E.const(0, E.I32))]), ok,
                                                  "target out of range"))
    b.output(b.reduce_simple(picked, (0,), "sum", "float32"))
    b.output(valid)
    b.graph.in_place = {0: "p"}
    device = get_device()
    plan, _ = compile_graph(b.graph, device.limits)
    assert plan.in_place == {"out0": "p"} and plan.stats["separated_checks"] == 1, plan.stats
    program = Program(device, plan, device_only_inputs=["p"])
    start, grad = RNG.standard_normal(6, dtype=np.float32), np.ones(6, np.float32)
    array = DeviceArray.upload(device, start, "float32")
    entries = np.arange(4, dtype=np.float32)
    assert_a_failed_run_leaves(program, {"g": grad, "target": np.array([0, 1, 2, 3, 9, 0, 1, 2], np.int32),
                                         "table": entries}, "p", array, start, "target out of range")
    out = program.run({"g": grad, "target": np.array([0, 1, -100, 3, 3, 0, 1, 2], np.int32), "table": entries},
                      device_inputs={"p": array})
    np.testing.assert_allclose(array.numpy(), start - LR, rtol=1e-6)
    assert float(out["out1"]) == 10.0
