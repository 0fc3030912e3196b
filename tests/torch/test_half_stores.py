"""Half precision outputs stored by the matmul and reduction kernels themselves: the gemv (one row), the tiled kernel
and split K's pass summing the slices store bfloat16 and float16 by pairs of neighbouring columns
(``kernels.prelude.pair_store_function``), a row program its element results (a norm's, a softmax's) by pairs of
neighbouring elements of its rows (``kernels.reduce``), each u32 word written by one thread, with no narrowing copy
("narrow") after them. Where the column count or the row length is odd, the reduced axis not the last, or the
output a row result, the narrowing copy stays, with its reason in the plan's stats.

Tolerances: operands of small integers make every f32 sum exact in any order, so each value is the float64 result
rounded once to the dtype (to nearest even): compared bit for bit with that, and with torch on the CPU where torch
rounds once too (a plain or biased F.linear; with a fused residual, eager rounds the projection before adding, and
the backend keeps it in f32 until the store). Operands of random normals are judged against float64 within eager's
own error in the dtype; a reduction's outputs at most 1 ulp of the dtype from torch's on the CPU."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.compare import assert_within_eager_error, meganeura_warnings
from helpers.compiled_plans import record_compiled_plans

HALVES = [torch.bfloat16, torch.float16]
NARROW = "narrow"  # the label of the narrowing copy (lowering/schedule.py)
SUM_OF_SLICES = "(sum of slices)"  # the label suffix of split K's second pass


@pytest.fixture
def plans(monkeypatch):
    """The plans compiled while the test runs."""
    return record_compiled_plans(monkeypatch)


def _compiled(fn, *args):
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(fn, backend="meganeura")(*args)
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    return got


def _integers(shape, dtype, bound=4, scale=1.0):
    return (torch.randint(-bound, bound + 1, shape) * scale).to(dtype)


def _labels(plans) -> list[str]:
    (plan,) = plans
    return [d.label for d in plan.dispatches]


def _linear(x, w):
    return F.linear(x, w)


def _biased(x, w, b):
    return F.linear(x, w, b)


def _residual(x, w, b, r):
    return F.linear(x, w, b) + r


EPILOGUES = {"plain": (_linear, 0), "bias": (_biased, 1), "residual": (_residual, 2)}


def _operands(m, k, n, dtype, extra: int) -> list[torch.Tensor]:
    """x (m, k), w (n, k) of integers in [-4, 4]; a bias of halves in [-4, 4]; a residual of integers in [-64, 64]."""
    found = [_integers((m, k), dtype), _integers((n, k), dtype)]
    return found + [_integers((n,), dtype, 8, 0.5), _integers((m, n), dtype, 64)][:extra]


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("m, k, n", [(1, 64, 40), (1, 33, 18), (96, 40, 24), (96, 33, 22)],
                         ids=["gemv", "gemv-odd-k", "tiled", "tiled-odd-k"])
def test_an_even_column_count_stores_half_precision_from_the_matmul(dtype, epilogue, m, k, n, plans):
    """One dispatch: the matmul stores the dtype itself; each value is the exact result rounded once."""
    torch.manual_seed(m * k + n)
    fn, extra = EPILOGUES[epilogue]
    args = _operands(m, k, n, dtype, extra)
    got = _compiled(fn, *args)
    exact = fn(*(a.double() for a in args)).to(dtype)
    assert got.dtype == dtype and torch.equal(got, exact), (got != exact).sum()
    if epilogue != "residual":
        assert torch.equal(got, fn(*args))
    assert len(_labels(plans)) == 1 and NARROW not in _labels(plans), _labels(plans)


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("epilogue", ["plain", "residual"])
def test_split_k_stores_half_precision_from_its_sum_of_slices(dtype, epilogue, plans):
    """K of 1024 over a 16 x 32 output: the slices' pass and the pass adding them up, which stores the dtype."""
    torch.manual_seed(5)
    fn, extra = EPILOGUES[epilogue]
    args = _operands(16, 1024, 32, dtype, extra)
    got = _compiled(fn, *args)
    assert torch.equal(got, fn(*(a.double() for a in args)).to(dtype))
    labels = _labels(plans)
    assert len(labels) == 2 and labels[1].endswith(SUM_OF_SLICES), labels


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("m", [1, 50])
def test_an_odd_column_count_keeps_the_narrowing_copy(dtype, m, plans):
    """13 columns: a row's last element shares its word with the next row's first; the copy stays, and the tail
    word's padding half is left as the copy writes it."""
    torch.manual_seed(m)
    args = _operands(m, 21, 13, dtype, 1)
    got = _compiled(_biased, *args)
    assert torch.equal(got, _biased(*args))
    assert _labels(plans)[1:] == [NARROW]
    assert "odd" in plans[0].stats["narrowed_outputs"]["out0"]


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("m", [1, 40])
def test_sibling_projections_store_their_blocks_by_pairs(dtype, m, plans):
    """Three projections of one input merged into one matmul of blocks of 24, 16 and 16 columns, the first returned,
    the others summed by a later kernel (read from the arena in f32): the first stored in the dtype by the matmul.
    Operands in [-2, 2]: every projection is an integer within 128, exact in either dtype (eager rounds the summed
    ones, the backend does not)."""
    torch.manual_seed(m)
    x = _integers((m, 32), dtype, 2)
    ws = [_integers((n, 32), dtype, 2) for n in (24, 16, 16)]

    def fn(x, a, b, c):
        return F.linear(x, a), F.linear(x, b).float().sum() + F.linear(x, c).float().sum()

    got = _compiled(fn, x, *ws)
    want = fn(x, *ws)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    matmuls = [label for label in _labels(plans) if label.startswith("matmul")]
    assert matmuls == [f"matmul {m}x56x32"], _labels(plans)
    assert "out0" not in plans[0].stats.get("narrowed_outputs", {})


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("m, k, n", [(1, 72, 48), (128, 72, 48)])
def test_random_projections_are_within_eager_error(dtype, m, k, n, plans):
    """Random normal operands and bias, plus a residual: within eager's error of float64 in the dtype."""
    torch.manual_seed(k + m)
    args = [torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype) / 8, torch.randn(n).to(dtype),
            torch.randn(m, n).to(dtype)]
    got = _compiled(_residual, *args)
    assert_within_eager_error(got, _residual(*args), _residual(*(a.double() for a in args)), floor=1e-6)
    assert len(_labels(plans)) == 1, _labels(plans)


def test_an_output_stored_over_an_input_keeps_the_narrowing_copy():
    """``out = a @ w + p`` in bfloat16, asked to be stored over p: only a pointwise kernel may store over an input,
    so the matmul leaves it to the narrowing copy, which is stored over p; the values are right."""
    from meganeura.lowering import compile_graph
    from meganeura.lowering import expr as E
    from meganeura.lowering.builder import GraphBuilder
    from meganeura.runtime.device import get_device
    from meganeura.runtime.dtypes import bfloat16_bits, bfloat16_values
    from meganeura.runtime.program import Program
    from meganeura.runtime.resident import DeviceArray

    b = GraphBuilder()
    a, w, p = b.input("a", (4, 8), "bfloat16"), b.input("w", (8, 6), "bfloat16"), b.input("p", (4, 6), "bfloat16")
    b.output(b.map(lambda x, y: E.add(x, y), b.matmul(a, w, "bfloat16"), p, dtype="bfloat16"))
    b.graph.in_place = {0: "p"}
    device = get_device()
    plan, _ = compile_graph(b.graph, device.limits)
    assert plan.in_place == {"out0": "p"}
    assert "over an input" in plan.stats["narrowed_outputs"]["out0"]
    values = {name: _integers(shape, torch.bfloat16) for name, shape in (("a", (4, 8)), ("w", (8, 6)), ("p", (4, 6)))}
    want = (values["a"].double() @ values["w"].double() + values["p"].double()).to(torch.bfloat16)
    bits = {name: bfloat16_bits(v.float().numpy()) for name, v in values.items()}
    array = DeviceArray.upload(device, bits.pop("p"), "bfloat16")
    out = Program(device, plan, device_only_inputs=["p"]).run(bits, device_inputs={"p": array})["out0"]
    assert out is array
    np.testing.assert_array_equal(bfloat16_values(array.numpy()), want.float().numpy())


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Units in the last place of the dtype between two half precision tensors of finite values: the distance of
    their bit patterns, ordered as the values are (-0 and +0 alike)."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -32768 - bits, bits)
    return (ordered(got) - ordered(want)).abs()


def _norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def _softmax(x):
    return torch.softmax(x, -1)


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("fn, shape, labels", [
    (_norm, (6, 40), ["layer_norm"]), (_softmax, (6, 40), ["softmax"]), (_softmax, (30, 8), ["softmax"]),
    (_softmax, (2, 8192), ["softmax", "softmax (merge of slices)"]),
], ids=["layer-norm", "softmax", "softmax-serial", "softmax-split"])
def test_a_reduction_stores_its_element_results_in_half_precision(dtype, fn, shape, labels, plans):
    """A norm and a softmax over rows of 40 (a workgroup a row), of 8 (a thread a row) and of 8192 (cut into slices,
    merged by a second pass that stores): no narrowing copy; each value within 1 ulp of torch's, the whole within
    eager's error of float64."""
    torch.manual_seed(shape[-1])
    args = [torch.randn(shape).to(dtype)] + ([torch.randn(shape[-1]).to(dtype)] * 2 if fn is _norm else [])
    got = _compiled(fn, *args)
    want = fn(*args)
    assert int(_ulps(got, want).max()) <= 1
    assert_within_eager_error(got, want, fn(*(a.double() for a in args)), floor=1e-6)
    assert _labels(plans) == labels


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("fn, shape, reason", [
    (lambda x: torch.softmax(x, 0), (6, 40), "not the last"), (_softmax, (6, 41), "odd"),
    (lambda x: x.sum(-1), (6, 40), "a row result"),
], ids=["first-axis", "odd-row", "row-sum"])
def test_a_reduction_keeps_the_narrowing_copy_where_pairs_do_not_fit(dtype, fn, shape, reason, plans):
    """A softmax over the first axis (a pair's elements in different rows), over rows of 41 (a row's last element
    shares its word with the next row's first), and a row sum (neighbouring rows' results come from other threads):
    the copy stays, with its reason."""
    torch.manual_seed(1)
    x = torch.randn(shape).to(dtype)
    got = _compiled(fn, x)
    assert int(_ulps(got, fn(x)).max()) <= 1
    assert _labels(plans)[1:] == [NARROW]
    assert reason in plans[0].stats["narrowed_outputs"]["out0"]


@pytest.mark.parametrize("k_contiguous", [True, False], ids=["k-contiguous", "n-contiguous"])
def test_a_gemv_of_64_threads_keeps_an_even_count_of_outputs_per_workgroup(k_contiguous):
    """An adapter of 64 invocations per workgroup: a gemv over K of 2048 would give one output all 64 threads as lanes
    (and leave a pair's two outputs to two workgroups); storing pairs, it keeps two outputs a workgroup, read by
    groups of 8 along K or by elements along N. Values exact
    (operands of small integers) against float64 rounded once to bfloat16."""
    from meganeura.lowering import compile_graph
    from meganeura.lowering.builder import GraphBuilder
    from meganeura.runtime.device import get_device
    from meganeura.runtime.dtypes import bfloat16_bits, bfloat16_values
    from meganeura.runtime.program import Program

    b = GraphBuilder()
    a = b.input("a", (1, 2048), "bfloat16")
    w = b.input("w", (40, 2048), "bfloat16") if k_contiguous else b.input("w", (2048, 40), "bfloat16")
    b.output(b.matmul(a, b.permute(w, (1, 0)) if k_contiguous else w, "bfloat16"))
    device = get_device()
    limits = dict(device.limits, **{"max-compute-invocations-per-workgroup": 64, "max-compute-workgroup-size-x": 64})
    plan, _ = compile_graph(b.graph, limits)
    assert [d.label for d in plan.dispatches] == ["matmul 1x40x2048"]
    assert "2 outputs x 32 K lanes" in plan.kernels[plan.dispatches[0].kernel]
    values = {"a": _integers((1, 2048), torch.bfloat16), "w": _integers((40, 2048), torch.bfloat16)}
    if not k_contiguous:
        values["w"] = values["w"].T.contiguous()
    weights = values["w"].double().T if k_contiguous else values["w"].double()
    want = (values["a"].double() @ weights).to(torch.bfloat16)
    got = Program(device, plan).run({name: bfloat16_bits(v.float().numpy()) for name, v in values.items()})["out0"]
    np.testing.assert_array_equal(bfloat16_values(got), want.float().numpy())


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
def test_a_half_weight_gradient_is_stored_by_its_matmul(dtype, plans):
    """Training a half precision projection: the backward's weight gradient (48 x 64 over a batch of 1024, its K cut
    into slices) is stored in the dtype by the slices' sum, with no narrowing copy; the gradient, exact in f32 (small
    integers), is float64's rounded once."""
    torch.manual_seed(3)
    x, g = _integers((1024, 64), dtype), _integers((1024, 48), torch.float32)
    w = _integers((48, 64), dtype).requires_grad_()
    torch._dynamo.reset()
    torch.compile(lambda x, w: (F.linear(x, w).float() * g).sum(), backend="meganeura")(x, w).backward()
    assert w.grad.dtype == dtype and torch.equal(w.grad, (g.double().T @ x.double()).to(dtype))
    backward = plans[-1]
    labels = [d.label for d in backward.dispatches]
    assert NARROW not in labels and any(label.endswith(SUM_OF_SLICES) for label in labels), labels
