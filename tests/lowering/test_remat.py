"""Rematerialization (lowering/remat.py): a cheap pointwise value read again far later is computed again there,
not kept in the arena from its first reader to its last; values whose lifetimes would grow are not copied."""
import numpy as np

from meganeura.lowering import compile_graph
from meganeura.lowering import expr as E
from meganeura.lowering.builder import GraphBuilder
from meganeura.lowering.remat import REMAT_DISTANCE, rematerialize
from meganeura.runtime.device import get_device
from meganeura.runtime.program import Program

from helpers.recording_device import RecordingDevice

RNG = np.random.default_rng(17)
N = 256


def graph(source_is_input: bool):
    """y = 2 s + 1 read by a sum at once and by another sum after a long unrelated chain; s is an input, or a
    computed value of y's size (exp(x), not cheap to compute again) that nothing reads late."""
    b = GraphBuilder()
    x, z = b.input("x", (N,), "float32"), b.input("z", (N,), "float32")
    s = x if source_is_input else b.map(lambda a: E.unary("exp", a), x, dtype="float32")
    y = b.map(lambda a: E.add(E.mul(a, E.const(2.0, E.F32)), E.const(1.0, E.F32)), s, dtype="float32")
    b.output(b.reduce_simple(y, (0,), "sum", "float32"))
    for _ in range(REMAT_DISTANCE):  # the distance, in nodes, between the two readers
        z = b.map(lambda a: E.unary("sin", a), z, dtype="float32")
    b.output(z)
    b.output(b.reduce_simple(b.map(lambda a, c: E.mul(a, c), y, z, dtype="float32"), (0,), "sum", "float32"))
    return b.graph


def test_a_far_reader_computes_the_value_again_instead_of_reading_it_from_the_arena():
    plan, _ = compile_graph(graph(True), RecordingDevice().limits)
    assert plan.stats["rematerialized"] == 1
    assert plan.stats["arena_bytes"] == 0  # y is stored by no kernel (kept, it took the arena: N floats)
    assert len(plan.dispatches) == 2  # the sin chain; both sums, each computing y
    device = get_device()
    plan, _ = compile_graph(graph(True), device.limits)
    x, z = RNG.standard_normal(N, dtype=np.float32), RNG.standard_normal(N, dtype=np.float32)
    out = Program(device, plan).run({"x": x, "z": z})
    y, zz = 2 * x.astype(np.float64) + 1, z.astype(np.float64)
    for _ in range(REMAT_DISTANCE):
        zz = np.sin(zz)
    np.testing.assert_allclose(out["out0"], y.sum(), rtol=1e-5)
    np.testing.assert_allclose(out["out2"], (y * zz).sum(), rtol=1e-4)


def test_a_small_value_may_live_longer_for_the_copies():
    """y = x - mean(x): the copy for the far reader reads the mean (one number) there, kept that long for it."""
    b = GraphBuilder()
    x, z = b.input("x", (N,), "float32"), b.input("z", (N,), "float32")
    mean = b.expand(b.reshape(b.reduce_simple(x, (0,), "sum", "float32"), (1,)), (N,))
    y = b.map(lambda a, m: E.binary("sub", a, m), x, mean, dtype="float32")
    b.output(b.reduce_simple(b.map(lambda a: E.mul(a, a), y, dtype="float32"), (0,), "sum", "float32"))
    for _ in range(REMAT_DISTANCE):
        z = b.map(lambda a: E.unary("sin", a), z, dtype="float32")
    b.output(z)
    b.output(b.reduce_simple(b.map(lambda a, c: E.mul(a, c), y, z, dtype="float32"), (0,), "sum", "float32"))
    plan, _ = compile_graph(b.graph, RecordingDevice().limits)
    assert plan.stats["rematerialized"] == 1 and plan.stats["arena_bytes"] < N * 4


def test_a_transcendental_is_not_computed_twice():
    b = GraphBuilder()
    x, z = b.input("x", (N,), "float32"), b.input("z", (N,), "float32")
    y = b.map(lambda a: E.unary("exp", a), x, dtype="float32")
    b.output(b.map(lambda a: E.unary("neg", a), y, dtype="float32"))
    for _ in range(REMAT_DISTANCE):
        z = b.map(lambda a: E.unary("sin", a), z, dtype="float32")
    b.output(b.map(lambda a, c: E.mul(a, c), y, z, dtype="float32"))
    assert rematerialize(b.graph) == 0


def test_a_value_from_a_computed_source_read_no_later_is_kept():
    """Copying y would keep exp(x), as large, alive to the far reader: no copy, y stays in the arena."""
    plan, _ = compile_graph(graph(False), RecordingDevice().limits)
    assert plan.stats["rematerialized"] == 0 and plan.stats["arena_bytes"] >= N * 4


def test_a_long_chain_of_cheap_values_is_given_up_on_without_following_it():
    """A residual stream: h = 1.5 h + 1, hundreds of times, then h read at once and far later. Following the chain
    to its end (past Python's recursion limit, as it once did on a 30-layer Llama) would not fit the copy anyway."""
    b = GraphBuilder()
    h, z = b.input("x", (N,), "float32"), b.input("z", (N,), "float32")
    for _ in range(600):
        h = b.map(lambda a: E.add(E.mul(a, E.const(1.5, E.F32)), E.const(1.0, E.F32)), h, dtype="float32")
    b.output(b.reduce_simple(h, (0,), "sum", "float32"))
    for _ in range(REMAT_DISTANCE):
        z = b.map(lambda a: E.unary("sin", a), z, dtype="float32")
    b.output(b.reduce_simple(b.map(lambda a, c: E.mul(a, c), h, z, dtype="float32"), (0,), "sum", "float32"))
    assert rematerialize(b.graph) == 0


def test_a_copy_read_by_a_value_that_is_copied_in_turn():
    """y = 2x + 1 is copied for r = y * z, far after it; r is read far later again, so the pass weighs copying r in
    turn, whose expression now reads y's copy, a value the pass made (a KeyError once: HF ResNet-50's training
    graph through the backend). r reads z, which is not kept that long, so r itself stays."""
    b = GraphBuilder()
    x, z = b.input("x", (N,), "float32"), b.input("z", (N,), "float32")
    y = b.map(lambda a: E.add(E.mul(a, E.const(2.0, E.F32)), E.const(1.0, E.F32)), x, dtype="float32")
    b.output(b.reduce_simple(y, (0,), "sum", "float32"))
    for _ in range(REMAT_DISTANCE):
        z = b.map(lambda a: E.unary("sin", a), z, dtype="float32")
    r = b.map(lambda a, c: E.mul(a, c), y, z, dtype="float32")
    b.output(b.reduce_simple(r, (0,), "sum", "float32"))
    w = z
    for _ in range(REMAT_DISTANCE):
        w = b.map(lambda a: E.unary("cos", a), w, dtype="float32")
    b.output(b.reduce_simple(b.map(lambda a, c: E.add(a, c), r, w, dtype="float32"), (0,), "sum", "float32"))
    plan, _ = compile_graph(b.graph, get_device().limits)
    assert plan.stats["rematerialized"] == 1
    xs, zs = RNG.standard_normal(N, dtype=np.float32), RNG.standard_normal(N, dtype=np.float32)
    out = Program(get_device(), plan).run({"x": xs, "z": zs})
    zz = zs.astype(np.float64)
    for _ in range(REMAT_DISTANCE):
        zz = np.sin(zz)
    ww = zz
    for _ in range(REMAT_DISTANCE):
        ww = np.cos(ww)
    np.testing.assert_allclose(out["out2"], ((2 * xs.astype(np.float64) + 1) * zz + ww).sum(), rtol=1e-4)


def test_a_value_read_three_times_is_taken_in_once():
    """ReLU as torch decomposes it, ``where(isnan(y), y, max(y, 0))``, loads y three times (equal loads, distinct
    objects). y is a chain of five cheap nodes from the input: taken in once it fits the copy's budget, charged
    three times it did not (HF ResNet-50's ReLU outputs stayed in the arena from the forward to the backward)."""
    b = GraphBuilder()
    y, z = b.input("x", (N,), "float32"), b.input("z", (N,), "float32")
    for _ in range(5):
        y = b.map(lambda a: E.add(E.mul(a, E.const(1.5, E.F32)), E.const(1.0, E.F32)), y, dtype="float32")

    def relu(a):
        again, once_more = (E.Expr(a.op, a.args, a.dtype) for _ in range(2))
        return E.where(E.unary("isnan", a), again, E.binary("maximum", once_more, E.const(0.0, E.F32)))

    r = b.map(relu, y, dtype="float32")
    b.output(b.reduce_simple(r, (0,), "sum", "float32"))
    for _ in range(REMAT_DISTANCE):
        z = b.map(lambda a: E.unary("sin", a), z, dtype="float32")
    b.output(b.reduce_simple(b.map(lambda a, c: E.mul(a, c), r, z, dtype="float32"), (0,), "sum", "float32"))
    assert rematerialize(b.graph) == 1
