"""Ops without a lowering run in eager PyTorch visibly; unusual inputs give eager's result or a clear error."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_meganeura
from helpers.compare import assert_same, check_against_eager, meganeura_warnings

NAN, INF = float("nan"), float("inf")


def with_sort(x):
    y = torch.sort(x * 2, dim=-1).values
    return y + x.sum(dim=-1, keepdim=True)


def _compile_and_call_twice(fn, *inputs, **options):
    """Compile after a reset, call twice; return (first result, meganeura warnings of both calls)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="meganeura", **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = compiled(*inputs)
            compiled(*inputs)
    return out, meganeura_warnings(caught)


# ---------------------------------------------------------------------------------------------- fallback
def test_sort_falls_back_with_one_warning():
    x = torch.randn(4, 6)
    compiled = check_against_eager(with_sort, x, allow_fallback=True)  # the sum still runs on the device
    assert len(compiled.meganeura_warnings) == 1, compiled.meganeura_warnings
    assert "aten.sort" in compiled.meganeura_warnings[0]
    with warnings.catch_warnings(record=True) as caught:  # warned once per op per process
        warnings.simplefilter("always")
        with torch.no_grad():
            assert_same(compiled(x), with_sort(x), rtol=1e-4, atol=1e-5)
    assert meganeura_warnings(caught) == []
    out, again = _compile_and_call_twice(with_sort, x)  # torch._dynamo.reset() re-arms the warning
    assert len(again) == 1 and "aten.sort" in again[0]
    assert_same(out, with_sort(x), rtol=1e-4, atol=1e-5)


def test_explain_lists_fallback_op():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            report = torch_meganeura.explain(with_sort, torch.randn(4, 6))
    assert list(report.fallback_ops) == ["aten.sort.default"], report.fallback_ops
    assert report.partitions >= 1 and report.lowered_ops, report
    assert "aten.sort.default" in str(report)


def test_a_graph_without_fallback_is_one_partition_without_the_partitioner(monkeypatch):
    from torch_meganeura.lower import partition

    def refuse(*args, **kwargs):
        raise AssertionError("the capability partitioner ran for a graph the device runs whole")

    monkeypatch.setattr(partition, "CapabilityBasedPartitioner", refuse)
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3)).eval()
    x = torch.randn(5, 12)
    check_against_eager(model, x)
    torch._dynamo.reset()
    with torch.no_grad():
        report = torch_meganeura.explain(model, x)
    assert report.partitions == 1 and not report.fallback_ops, report


def test_device_regions_on_both_sides_of_a_fallback_are_two_partitions():
    def around_sort(x):
        return torch.sort(x.exp() * 2, dim=-1).values.tanh() + 1

    x = torch.randn(4, 6)
    check_against_eager(around_sort, x, allow_fallback=True)
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        report = torch_meganeura.explain(around_sort, x)
    assert report.partitions == 2 and list(report.fallback_ops) == ["aten.sort.default"], report


def test_fallback_error_names_the_op():
    torch._dynamo.reset()
    compiled = torch.compile(with_sort, backend="meganeura", options={"fallback": "error"})
    # dynamo wraps backend exceptions in BackendCompilerFailed; the op must be named either way
    with pytest.raises((torch_meganeura.FallbackError, torch._dynamo.exc.BackendCompilerFailed)) as info:
        compiled(torch.randn(4, 6))
    assert "aten.sort" in str(info.value)


def test_tensor_over_the_binding_limit_gives_eager_result_and_names_the_limit():
    """A 300 MiB tensor: on an adapter whose storage bindings are smaller (lavapipe's are 128 MiB) the partition
    runs in eager PyTorch with a warning naming the limit (the buffer size's, where WebGPU's default 256 MiB holds
    it); where it fits, it runs on the device. Either way the results are eager's."""
    from meganeura.runtime.device import get_device

    x = torch.randn(300 * (1 << 20) // 4)

    def fn(t):
        return t * 2.0 + 1.0, t.sum()

    (doubled, total), caught = _compile_and_call_twice(fn, x)
    assert torch.equal(doubled, x * 2.0 + 1.0)
    torch.testing.assert_close(total, x.double().sum().float(), rtol=1e-5, atol=1e-2)
    device = get_device()
    if x.numel() * 4 > min(device.max_binding_size, device.max_buffer_size):
        limit = "max-buffer-size" if x.numel() * 4 > device.max_buffer_size else "max-storage-buffer-binding-size"
        assert len(caught) == 1 and limit in caught[0], caught
    else:
        assert caught == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_other_float_dtypes_fall_back_visibly(dtype):
    """Dtypes the device does not compute (half precisions do: tests/torch/test_half_precision.py) run in eager
    PyTorch, once named in a warning, never downcast."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype).eval()
    x = torch.randn(4, 6, dtype=dtype)
    out, caught = _compile_and_call_twice(model, x)
    assert out.dtype == dtype, "the result was downcast"
    assert len(caught) == 1 and str(dtype) in caught[0], caught
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-6, atol=1e-6)


def test_float64_island_keeps_its_precision():
    """A float64 computation inside a float32 model runs in eager float64, not downcast on the device."""
    def fn(x):
        big = (x.double() * 1e8 + 1.0).sum(dim=-1)  # needs float64: 1 + 1e8 * x is not exact in float32
        return big - (x.double() * 1e8).sum(dim=-1), torch.relu(x) * 2

    x = torch.randn(3, 5)
    compiled = check_against_eager(fn, x, rtol=0, atol=1e-6, allow_fallback=True)
    assert compiled.meganeura_warnings and "float64" in compiled.meganeura_warnings[0]


# ----------------------------------------------------------------------------------------- int64 range
def index_arith(idx):
    return (idx + 1) * 2


def test_int64_input_outside_int32_is_refused():
    torch._dynamo.reset()
    compiled = torch.compile(index_arith, backend="meganeura")
    small = torch.randint(0, 1000, (5,))
    torch.testing.assert_close(compiled(small), index_arith(small), rtol=0, atol=0)
    big = torch.tensor([3, 2**31, 7])
    with pytest.raises(ValueError, match="int32"):
        compiled(big)
    with pytest.raises(ValueError, match="int32"):
        compiled(torch.tensor([-(2**31) - 1, 0, 1]))


def test_int64_constant_outside_int32_falls_back():
    def fn(idx):
        return idx + 2**40

    idx = torch.randint(-5, 5, (4,))
    out, caught = _compile_and_call_twice(fn, idx)
    torch.testing.assert_close(out, fn(idx), rtol=0, atol=0)
    assert len(caught) == 1 and "int32" in caught[0], caught


def test_int64_result_outside_int32_is_not_silently_wrapped():
    """Inputs inside int32 whose int64 result leaves it: eager's result, or an error that mentions int32."""
    torch._dynamo.reset()
    compiled = torch.compile(index_arith, backend="meganeura")
    idx = torch.tensor([2**30, 5, -(2**30) - 7])
    try:
        out = compiled(idx)
    except Exception as err:  # noqa: BLE001 - any clear error is acceptable
        assert "int32" in str(err), f"unclear error: {err}"
        return
    torch.testing.assert_close(out, index_arith(idx), rtol=0, atol=0)


# --------------------------------------------------------------------------------------- empty tensors
def test_empty_batch():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval()

    def fn(x):
        y = model(x)
        return y, torch.cat([x, x * 2], dim=0), x.sum(dim=0), (x + 1).amax(dim=1)

    x = torch.randn(0, 4)
    check_against_eager(fn, x)


# ---------------------------------------------------------------------------------- out-of-range indices
def _embedding_case():
    emb = nn.Embedding(10, 4)
    return emb, torch.tensor([[1, 9], [0, 3]]), [torch.tensor([[1, 10], [0, 3]]), torch.tensor([[1, -1], [0, 3]])]


def _gather_case():
    x = torch.randn(3, 4)
    def fn(i):
        return torch.gather(x, 1, i) * 2
    good = torch.tensor([[0, 3], [1, 1], [2, 0]])
    return fn, good, [torch.tensor([[0, 4], [1, 1], [2, 0]]), torch.tensor([[0, 1], [-1, 1], [2, 0]])]


def _index_case():
    x = torch.randn(4, 3)
    def fn(i):
        return x[i] + 1
    return fn, torch.tensor([0, 3, -1]), [torch.tensor([0, 4, 1]), torch.tensor([-5, 0, 1])]


@pytest.mark.parametrize("case", [_embedding_case, _gather_case, _index_case], ids=["embedding", "gather", "index"])
def test_index_out_of_range(case):
    fn, good, bads = case()
    compiled = check_against_eager(fn, good)
    for bad in bads:
        with pytest.raises((IndexError, RuntimeError)):
            fn(bad)
        with pytest.raises(RuntimeError, match="index out of range"):
            with torch.no_grad():
                compiled(bad)
    with torch.no_grad():  # the error state does not stick to later calls
        assert_same(compiled(good), fn(good), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------- NaN and inf
def _special_inputs():
    x = torch.randn(4, 6)
    x[0, 1], x[1, 2], x[2, 3], x[3, 0], x[3, 5] = NAN, INF, -INF, NAN, INF
    x[2, 0] = INF  # row 2 holds both infinities
    y = torch.randn(4, 6)
    y[0, 0], y[2, 3], y[1, 4] = NAN, INF, -INF
    y[3] = -INF  # a row of -inf: softmax gives NaN
    return x, y


NAN_CASES = {
    "relu": lambda x, y: torch.relu(x) + F.relu(y),
    "max_amax": lambda x, y: (x.max(), x.max(dim=1), x.amax(dim=0), y.amin(dim=1), x.argmax(dim=1), y.argmin(dim=1)),
    "softmax": lambda x, y: (torch.softmax(x, dim=1), torch.softmax(y, dim=1), torch.log_softmax(y, dim=0)),
    "exp_log": lambda x, y: (torch.exp(x), torch.log(x), torch.log(y.abs()), torch.exp(-y)),
    "sum": lambda x, y: (x.sum(dim=1), y.sum(dim=0), x.mean(), (x + y).sum()),
    "maximum_minimum": lambda x, y: (torch.maximum(x, y), torch.minimum(x, y), torch.clamp(x, -1, 1)),
    "where": lambda x, y: (torch.where(x > 0, x, y), torch.where(torch.isnan(y), 0.0, y), x == y),
}


@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_inf_propagate(name):
    check_against_eager(NAN_CASES[name], *_special_inputs())


def test_losses_over_a_long_vocabulary_for_few_tokens_match_eager():
    """A vocabulary of 9,000 for 4 tokens: few long rows, whose softmax phases are cut into slices merged by a second
    pass. Cross-entropy, log-softmax and softmax against eager, with a masked tail of -inf, a row of -inf and +inf."""
    logits = torch.randn(4, 9000) * 4
    logits[0, 2000:] = -INF  # a masked vocabulary: whole slices of -inf
    logits[1, 4500] = INF
    logits[2] = -INF
    target = torch.tensor([5, 4500, 7, 8999])
    check_against_eager(lambda x, t: (F.cross_entropy(x[[0, 3]], t[[0, 3]]), torch.log_softmax(x, dim=1),
                                      torch.softmax(x, dim=1)), logits, target)
