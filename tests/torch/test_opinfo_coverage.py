"""The OpInfo coverage runner on a CI subset, and regression tests for what its full sweep found.

Each op of the subset runs its first OpInfo sample through ``torch_meganeura.coverage`` (compiled, forward and
backward, against eager float32 and float64): ops in ``LOWERED`` must run entirely on the device, ops in
``MAY_FALL_BACK`` may run some aten ops in eager PyTorch (visibly); none may be wrong or raise. The ops of
``STEP_OPS`` also run their first sample through the resident training step (``coverage_step``: loss, gradients and
one SGD step against eager), where only ``MAY_FALL_BACK`` ops may be refused. The full sweep is
``python -m torch_meganeura.coverage`` (report in coverage/opinfo.md; ``--path step`` or ``both`` for the step).
"""
import json

import pytest
import torch

from helpers.compare import check_against_eager
from torch_meganeura.backend import entry as backend
from torch_meganeura.coverage import (sweep as coverage, compare as coverage_compare, report as coverage_report,
                                      step as coverage_step)
from torch_meganeura.lower import registry
from torch_meganeura.training import step as train_step

LOWERED = [
    # pointwise
    "abs", "acos", "acosh", "add", "addcdiv", "addcmul", "asin", "asinh", "atan", "atan2", "atanh", "bitwise_and",
    "bitwise_not", "ceil", "clamp", "copysign", "cos", "cosh", "div.no_rounding_mode", "div.floor_rounding",
    "div.trunc_rounding", "eq", "erf", "erfc", "exp", "exp2", "expm1", "floor", "fmax", "fmod", "frac", "ge",
    "heaviside", "isfinite", "isnan", "lerp", "log", "log10", "log1p", "log2", "logical_and", "logical_not", "logit",
    "lt", "maximum", "minimum", "mul", "ne", "neg", "pow", "reciprocal", "remainder", "round", "round.decimals_3",
    "rsqrt", "sigmoid", "sign", "signbit", "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh", "trunc", "where",
    "xlogy", "nn.functional.elu", "nn.functional.gelu", "nn.functional.hardswish", "nn.functional.hardtanh",
    "nn.functional.leaky_relu", "nn.functional.logsigmoid", "nn.functional.mish", "nn.functional.relu",
    "nn.functional.silu", "nn.functional.softplus",
    # reductions and scans
    "all", "amax", "amin", "aminmax", "any", "argmax", "argmin", "count_nonzero", "cumprod", "cumsum",
    "linalg.vector_norm", "logsumexp", "max.reduction_with_dim", "mean", "nansum", "norm", "prod", "std", "sum", "var",
    "var_mean",
    # views and layout
    "cat", "chunk", "diagonal", "expand", "flatten", "flip", "movedim", "permute", "repeat", "reshape", "roll",
    "select", "slice", "split", "squeeze", "stack", "t", "tile", "transpose", "unbind", "unfold", "unsqueeze", "view",
    # matmul-like
    "addmm", "addmv", "baddbmm", "bmm", "dot", "einsum", "linalg.multi_dot", "matmul", "mm", "mv",
    "nn.functional.linear", "outer", "tensordot",
    # norms and softmax
    "log_softmax", "nn.functional.batch_norm", "nn.functional.group_norm", "nn.functional.instance_norm",
    "nn.functional.layer_norm", "nn.functional.normalize", "nn.functional.rms_norm", "softmax",
    # indexing and scatter
    "__getitem__", "gather", "index_add", "index_select", "masked_fill", "nn.functional.embedding", "scatter",
    "scatter_add", "select_scatter", "slice_scatter", "take_along_dim",
    # convolution, pooling, losses, creation
    "nn.functional.adaptive_avg_pool2d", "nn.functional.avg_pool2d", "nn.functional.conv2d",
    "nn.functional.conv_transpose1d", "nn.functional.max_pool2d", "nn.functional.binary_cross_entropy_with_logits",
    "nn.functional.cross_entropy", "nn.functional.mse_loss", "nn.functional.nll_loss", "nn.functional.smooth_l1_loss",
    "arange", "full", "linspace", "tril", "triu", "zeros_like",
]
MAY_FALL_BACK = [
    "cummax", "digamma", "erfinv", "isin", "linalg.det", "median", "nn.functional.conv3d",
    "nn.functional.pad.replicate", "searchsorted", "sort", "topk",
]
HALF_OPS = ["add", "mul", "exp", "softmax", "nn.functional.layer_norm", "nn.functional.rms_norm", "matmul",
            "nn.functional.linear", "sum", "amax", "transpose", "nn.functional.silu", "nn.functional.embedding",
            "nn.functional.conv2d", "nn.functional.cross_entropy"]  # what half-precision models are made of
STEP_OPS = ["add", "mul", "sum", "amax", "softmax", "matmul", "nn.functional.linear", "select", "transpose",
            "logsumexp", "exp", "nn.functional.batch_norm", "cummax"]  # batch_norm: running statistics as buffers


@pytest.fixture(scope="module")
def op_infos():
    return {coverage.full_name(op): op for op in coverage.select_ops(LOWERED + MAY_FALL_BACK)}  # HALF_OPS among them


def describe(name: str, sample: dict) -> str:
    details = {k: v for k, v in sample.items() if k in ("mismatch", "error", "where", "reason", "fallback_ops",
                                                           "max_abs_error", "rel_l2")}
    return f"{name}: {sample['status']} {details}"


@pytest.mark.parametrize("name", LOWERED + MAY_FALL_BACK)
def test_opinfo_sample(name, op_infos):
    allowed = ("lowered",) if name in LOWERED else ("lowered", "fell-back")
    entry = coverage.run_op(op_infos[name], max_samples=1, backward=True)
    for sample in entry["samples"]:
        assert sample["status"] in allowed, describe(name, sample)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", HALF_OPS)
def test_opinfo_sample_in_half_precision(name, dtype, op_infos):
    """A half-precision sample runs on the device, forward and backward, within one unit in the last place of eager
    in that dtype or of float64 by eager's own error (``coverage_compare``); the full sweep is ``--dtype``."""
    entry = coverage.run_op(op_infos[name], max_samples=1, backward=True, sweep_dtype=coverage.DTYPES[dtype])
    assert entry["dtype"] == dtype
    for sample in entry["samples"]:
        assert sample["status"] == "lowered", describe(name, sample)


@pytest.mark.parametrize("name", STEP_OPS)
def test_opinfo_sample_train_step(name, op_infos):
    allowed = ("lowered",) if name in LOWERED else ("lowered", "fell-back")
    entry = coverage.run_op(op_infos[name], max_samples=1, backward=False, paths=("step",))
    for sample in entry["samples"]:
        assert sample["step"]["status"] in allowed, describe(name, sample["step"])
    assert "status" not in entry and entry["step"]["status"] in allowed


def test_a_wrong_step_gradient_is_reported_wrong(monkeypatch, op_infos):
    gradients = train_step.TrainStep.gradients

    def doubled(self, *batch):
        loss, grads = gradients(self, *batch)
        return loss, {name: 2 * g for name, g in grads.items()}

    monkeypatch.setattr(train_step.TrainStep, "gradients", doubled)
    sample = coverage.run_op(op_infos["mul"], max_samples=1, backward=False, paths=("step",))["samples"][0]["step"]
    assert sample["status"] == "wrong" and sample["mismatch"].startswith("grad of t0: "), sample


def test_step_refusals_and_graph_breaks_are_fell_back():
    """compile_train_step's refusal names each op and why; where dynamo breaks the loss's graph (corrcoef's
    data-dependent op) the step runs segments with eager PyTorch between them: correct, but fell-back."""
    err = NotImplementedError(coverage_step.REFUSAL + "aten.sort.default (no lowering), aten.cummax.default "
                                                      "(dtype torch.float64 (double) is not computed on the device)")
    assert coverage_step.refusal(err) == {"status": "fell-back", "fallback_ops": {
        "aten.sort.default": "no lowering",
        "aten.cummax.default": "dtype torch.float64 (double) is not computed on the device"}}
    (corrcoef,) = coverage.select_ops(["corrcoef"])
    sample = coverage.run_op(corrcoef, max_samples=1, backward=False, paths=("step",))["samples"][0]["step"]
    assert sample["status"] == "fell-back", sample
    assert any(key.startswith("<graph break> ") for key in sample["fallback_ops"]), sample


def test_command_writes_both_reports(tmp_path):
    """The command line end to end: a worker process, the JSON report and the markdown table."""
    json_path, md_path = tmp_path / "r.json", tmp_path / "r.md"
    coverage.main(["--ops", "abs", "nonzero", "--max-samples", "1", "--json", str(json_path),
                   "--markdown", str(md_path)])
    report = json.loads(json_path.read_text())
    assert report["counts"]["ops"]["lowered"] == 1 and report["counts"]["ops"]["fell-back"] == 1, report["counts"]
    assert report["ops"]["nonzero"]["samples"][0]["fallback_ops"]
    table = md_path.read_text()
    assert "generated by `python -m torch_meganeura.coverage --ops abs nonzero --max-samples 1" in table
    assert "| abs | lowered |" in table


def test_command_with_both_paths(tmp_path):
    """--path both: each sample has the backend's result and the step's (under "step"), and so do the counts,
    the summary and the markdown (the step's in a section of its own)."""
    json_path, md_path = tmp_path / "r.json", tmp_path / "r.md"
    coverage.main(["--ops", "abs", "sort", "--max-samples", "1", "--path", "both", "--json", str(json_path),
                   "--markdown", str(md_path)])
    report = json.loads(json_path.read_text())
    assert report["paths"] == ["backend", "step"]
    assert report["counts"]["ops"]["lowered"] == 1 and report["counts"]["ops"]["fell-back"] == 1, report["counts"]
    assert report["step"]["counts"]["ops"]["lowered"] == 1 and report["step"]["counts"]["ops"]["fell-back"] == 1
    assert report["ops"]["sort"]["samples"][0]["step"]["fallback_ops"] == {"aten.sort.default": "no lowering"}
    table = md_path.read_text()
    assert "backend ops:" in table and "step ops:" in table
    assert "| abs | lowered |" in table and "| op | step status |" in table and "| sort | fell-back |" in table


def test_a_wrong_lowering_is_reported_wrong(monkeypatch, op_infos):
    aten = torch.ops.aten
    monkeypatch.setitem(registry.LOWERINGS, aten.abs.default, registry.LOWERINGS[aten.neg.default])
    sample = coverage.run_op(op_infos["abs"], max_samples=1, backward=True)["samples"][0]
    assert sample["status"] == "wrong" and "elements off" in sample["mismatch"], sample


def test_a_backend_exception_hidden_by_dynamo_is_an_error(monkeypatch, op_infos):
    """dynamo turns an exception of the backend into a graph break and runs the frame eagerly: still an error."""
    def broken(gm, *_):
        raise RuntimeError("partitioner broken on purpose")

    monkeypatch.setattr(backend, "partition", broken)
    sample = coverage.run_op(op_infos["abs"], max_samples=1, backward=False)["samples"][0]
    assert sample["status"] == "error" and "partitioner broken on purpose" in sample["error"], sample


# ---------------------------------------------------------------------------------------- regressions of the sweep

def test_asin_acos_as_precise_as_eager():
    """lavapipe's asin/acos builtins were off by up to 4e-4; they now go through atan2."""
    x = torch.rand(1000) * 1.998 - 0.999
    check_against_eager(lambda t: (torch.asin(t), torch.acos(t)), x)


def test_zero_dim_bool_output():
    """A 0-d bool result came back from the runtime as a numpy scalar and was taken for a resident array."""
    check_against_eager(lambda a, b: (a == b, torch.logical_and(a > 0, b > 0)), torch.randn(()), torch.randn(()))


def test_precision_is_our_distance_from_float64_over_eagers():
    """A result correct by the tolerances but three times farther from float64 than eager's is reported as such;
    where eager is exact, an error up to PRECISION_FLOOR counts as exact too."""
    exact = torch.randn(1000, dtype=torch.float64)
    noise = torch.randn(1000, dtype=torch.float64) * exact.norm() / 1000 ** 0.5
    eager, ours = (exact + 1e-6 * noise).float(), (exact + 3e-6 * noise).float()
    result = coverage_compare.compare_pairs([("output 0", ours, eager, exact)])
    assert result["status"] == "ok" and 2.9 < result["precision"] < 3.1, result
    exact32 = exact.float()
    at_floor = coverage_compare.compare_pairs([("output 0", exact32, exact32, exact32.double())])
    assert at_floor["precision"] == 0.0
    report = {"paths": ["backend"], "ops": {"exp": {"samples": [{"status": "lowered", "precision": 3.0}]},
                                            "add": {"samples": [{"status": "lowered", "precision": 1.2}]}}}
    assert coverage_report.imprecise_samples(report) == [(3.0, "exp", 0)]
