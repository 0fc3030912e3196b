"""Sibling pointwise kernels (lowering/sibling_pointwise.py): pointwise nodes over one shape that read a value at the
same index merge into one kernel; the others, and merges past a limit, stay apart with the reason recorded."""
import numpy as np
import pytest

from meganeura.lowering import compile_graph, sibling_pointwise
from meganeura.lowering import expr as E
from meganeura.lowering.builder import GraphBuilder
from meganeura.lowering.ir import Pointwise
from meganeura.runtime.device import get_device
from meganeura.runtime.program import Program

from helpers.recording_device import RecordingDevice

RNG = np.random.default_rng(5)
SHAPE = (6, 8)
WEBGPU_DEFAULT_BINDINGS = 8  # WebGPU's default max-storage-buffers-per-shader-stage (MEGANEURA_LIMITS=webgpu-default)


def _sigmoid(v: E.Expr) -> E.Expr:
    one = E.const(1.0, E.F32)
    return E.binary("div", one, E.add(one, E.unary("exp", E.unary("neg", v))))


def _products(b: GraphBuilder, values) -> list:
    """Each of ``values`` times a weight of its own: matmul operands take views only, so a computing pointwise value
    that a matmul reads stays a kernel of its own."""
    return [b.matmul(v, b.input(f"w{i}", (SHAPE[1], 3), "float32")) for i, v in enumerate(values)]


def test_siblings_reading_one_value_share_one_kernel():
    """sigmoid(x), silu(x) and x + 1 (each read by a matmul) read x at the same element: one kernel stores all three.
    exp(y) reads another input and exp(x flipped) reads x at other elements: kernels of their own. Every output as
    numpy's (f64 reference, rtol 1e-5)."""
    b = GraphBuilder()
    x = b.input("x", SHAPE, "float32")
    y = b.input("y", SHAPE, "float32")
    flipped = b.view(x, SHAPE, [E.binary("sub", E.const(SHAPE[0] - 1, E.I32), E.coord(0)), E.coord(1)], "flip")
    siblings = [b.map(_sigmoid, x, dtype="float32"), b.map(lambda v: E.mul(v, _sigmoid(v)), x, dtype="float32"),
                b.map(lambda v: E.add(v, E.const(1.0, E.F32)), x, dtype="float32")]
    apart = [b.map(lambda v: E.unary("exp", v), v, dtype="float32") for v in (y, flipped)]
    for v in _products(b, [*siblings, *apart]):
        b.output(v)
    plan, report = compile_graph(b.graph, get_device().limits)
    kernels = [n for n in b.graph.nodes if isinstance(n, Pointwise)]
    assert sorted(len(n.outs) for n in kernels) == [1, 1, 3], [n.label for n in kernels]
    assert len(plan.dispatches) == 3 + len(siblings) + len(apart)  # 3 pointwise kernels, a matmul per product
    data = {spec.name: RNG.standard_normal(spec.shape).astype(np.float32) for spec in plan.inputs}
    out = Program(get_device(), plan).run(data)
    x64, y64 = data["x"].astype(np.float64), data["y"].astype(np.float64)
    sig = 1 / (1 + np.exp(-x64))
    operands = [sig, x64 * sig, x64 + 1, np.exp(y64), np.exp(x64[::-1])]
    for spec, operand, i in zip(plan.outputs, operands, range(len(operands))):
        expected = operand @ data[f"w{i}"]
        np.testing.assert_allclose(out[spec.name].reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)


def _wide_pair() -> GraphBuilder:
    """x + a + b + c and x * d * e * f, each read by a matmul: siblings that share x and read 7 inputs together."""
    b = GraphBuilder()
    x = b.input("x", SHAPE, "float32")
    others = [b.input(name, SHAPE, "float32") for name in "abcdef"]
    summed = b.map(lambda *v: E.add(E.add(E.add(v[0], v[1]), v[2]), v[3]), x, *others[:3], dtype="float32")
    product = b.map(lambda *v: E.mul(E.mul(E.mul(v[0], v[1]), v[2]), v[3]), x, *others[3:], dtype="float32")
    for v in _products(b, [summed, product]):
        b.output(v)
    return b


@pytest.mark.parametrize("limit", [None, "bindings", "expression"])
def test_siblings_past_a_limit_stay_apart_with_the_reason(monkeypatch, limit):
    """``_wide_pair``'s siblings merged would bind 7 inputs, 2 outputs and the status buffer: past WebGPU's default 8
    storage bindings; with a room of 16 they merge (one pointwise kernel, two products), unless the expression limit
    (``fusion.MAX_EXPR_NODES``, here lowered below the two expressions' size) refuses. A refusal is recorded with its
    reason, and each sibling stays a kernel of its own (planned on a recording device: no GPU needed)."""
    if limit == "expression":
        monkeypatch.setattr(sibling_pointwise, "MAX_EXPR_NODES", 20)
    b = _wide_pair()
    room = WEBGPU_DEFAULT_BINDINGS if limit == "bindings" else 2 * WEBGPU_DEFAULT_BINDINGS
    plan, report = compile_graph(b.graph, RecordingDevice({"max-storage-buffers-per-shader-stage": room}).limits)
    reason = {None: None, "bindings": f"more than {room} storage bindings", "expression": "expression too large"}[limit]
    assert any(why == reason for *_, why in report.refused) == (reason is not None), report.refused
    kernels = 1 if limit is None else 2
    assert len([n for n in b.graph.nodes if isinstance(n, Pointwise)]) == kernels
    assert len(plan.dispatches) == kernels + 2


@pytest.mark.parametrize("rows", [768, 256])
def test_siblings_whose_merge_would_move_a_reader_of_a_large_operand_stay_apart(rows):
    """relu(x) and x + 1 share x; between them a product reads relu(x) and g = a @ w (rows x 1024, its last reader).
    Merged, that product would move after the merged kernel, and g stay in the arena until there: at 768 rows (3 MiB,
    over ``siblings.KEEP_ALIVE_BYTES``) they stay apart with the reason recorded, at 256 rows (1 MiB) they merge (as
    ResNet-50's recomputed ReLUs and BatchNorm backwards would have, its backward's arena 98.0 -> 140.9 MiB)."""
    b = GraphBuilder()
    x, a = b.input("x", (rows, 1024), "float32"), b.input("a", (rows, 16), "float32")
    g = b.matmul(a, b.input("w", (16, 1024), "float32"))
    relu = b.map(lambda v: E.binary("maximum", v, E.const(0.0, E.F32)), x, dtype="float32")
    b.output(b.matmul(b.permute(relu, (1, 0)), g))
    plus_one = b.map(lambda v: E.add(v, E.const(1.0, E.F32)), x, dtype="float32")
    b.output(b.matmul(b.permute(plus_one, (1, 0)), a))
    _, report = compile_graph(b.graph, RecordingDevice().limits)
    moved = "that the nodes it moves read alive past the merged node"
    kept = [why for *_, why in report.refused if why.endswith(moved)]
    assert kept == ([f"it would keep {rows * 1024 * 4} bytes {moved}"] if rows == 768 else [])
    assert len([n for n in b.graph.nodes if isinstance(n, Pointwise)]) == (2 if rows == 768 else 1)
