"""The benchmark's path at smoke scale (CI): cells compile, run and pass their correctness gates against eager
float64, the gates reject a wrong result, and the report renders from the JSON. No timing is asserted."""
import dataclasses
import json

import pytest
import torch

from bench import cells, gates, report
from bench.workloads import WORKLOADS

COMPETITORS = ["meganeura", "torch-cpu-eager"]


def _report(results, done):
    """Write ``done``'s cells as a results file at ``results`` and render its report next to it; returns the path."""
    results.write_text(json.dumps({
        "machine": {"processor": "x", "cpu_count": 2, "torch_threads": 2, "cuda_device": None, "date": "-",
                    "versions": {"torch": torch.__version__}, "adapter": {"name": "test"}},
        "settings": {"warmup": 1, "repeats": 1}, "cells": [dataclasses.asdict(c) for c in done], "micro": []}))
    report.write(results)
    return results


@pytest.mark.parametrize("workload, mode", [("smollm2", "training"), ("resnet50", "inference"),
                                            ("smolvla_expert", "latency")])
def test_smoke_cells_pass_their_gates(workload, mode, tmp_path):
    done = cells.measure(WORKLOADS[workload], mode, COMPETITORS, warmup=1, repeats=1, smoke=True)
    for cell in done:
        assert cell.error is None, cell.error
        assert cell.gate["passed"], cell.gate["reason"]
        assert len(cell.samples_ms) == 1
    ours = done[0]
    assert ours.dispatches and ours.dispatches > 0
    if mode == "training":
        assert ours.gate["gradients"] == sum(1 for p in WORKLOADS[workload].build(True).parameters())
    results = _report(tmp_path / "smoke.json", done)
    table = results.with_suffix(".md").read_text()
    assert f"| {workload} | {mode} |" in table and "all pass" in table
    assert results.with_suffix(".png").stat().st_size > 0


def test_gates_reject_a_wrong_gradient_and_accept_eager_level_error():
    gen = torch.Generator().manual_seed(0)
    exact = {"w": torch.randn(64, 64, generator=gen, dtype=torch.float64)}
    eager = {"w": exact["w"].float()}
    loss = torch.tensor(1.0)
    assert gates.gate_gradients(loss, eager, loss.double(), exact, loss, eager).passed
    wrong = {"w": eager["w"] * 1.01}
    verdict = gates.gate_gradients(loss, wrong, loss.double(), exact, loss, eager)
    assert not verdict.passed and verdict.worst_grad == "w"
    # an ill-conditioned tensor: eager f32 itself is 5% off, so a competitor 8% off passes and 12% off fails
    noisy = {"w": exact["w"] * 1.05}
    assert gates.gate_gradients(loss, {"w": exact["w"] * 1.08}, loss.double(), exact, loss, noisy).passed
    assert not gates.gate_gradients(loss, {"w": exact["w"] * 1.12}, loss.double(), exact, loss, noisy).passed
    assert not gates.gate_output(torch.full((3,), float("nan")), torch.ones(3, dtype=torch.float64),
                                 torch.ones(3)).passed


def test_fast_precision_cell_is_gated_at_its_tolerance_and_reported_beside_strict(tmp_path):
    done = cells.measure(WORKLOADS["smolvla_expert"], "inference", ["meganeura", "meganeura-fast", "torch-cpu-eager"],
                         warmup=1, repeats=1, smoke=True)
    strict, fast, _ = done
    assert all(c.error is None and c.gate["passed"] for c in done), [c.error or c.gate["reason"] for c in done]
    assert fast.gate["output_rel_l2"] > 10 * strict.gate["output_rel_l2"]  # f16 products, not the strict plan
    results = _report(tmp_path / "fast.json", done)
    table = results.with_suffix(".md").read_text()
    assert "speedup over strict" in table and "| smolvla_expert | inference |" in table


def test_fast_tolerance_admits_f16_rounding_only():
    exact = torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    eager, off = exact.float(), (exact * (1 + 5e-3)).float()  # 5e-3 relative: f16-product level
    assert not gates.gate_output(off, exact, eager).passed
    assert gates.gate_output(off, exact, eager, gates.FAST_TOLERANCE).passed
    assert not gates.gate_output((exact * 1.02).float(), exact, eager, gates.FAST_TOLERANCE).passed


def test_half_dtype_cells_are_gated_at_their_dtype_and_reported_beside_float32(tmp_path):
    """A bfloat16 cell: model and float inputs cast (token ids kept), only the competitors that take a half model
    run, the gate compares with eager bf16's own error (not f32's), and the report shows the dtype, the ratio to
    our float32 cell of the same run and the ratio to eager at the same dtype."""
    workload, competitors = WORKLOADS["smollm2"], ["meganeura", "meganeura-fast", "torch-cpu-eager"]
    f32 = cells.measure(workload, "latency", competitors[::2], warmup=1, repeats=1, smoke=True)
    half = cells.measure(workload, "latency", competitors, warmup=1, repeats=1, smoke=True, dtype="bfloat16")
    assert [(c.competitor, c.dtype) for c in half] == [("meganeura", "bfloat16"), ("torch-cpu-eager", "bfloat16")]
    for cell in f32 + half:
        assert cell.error is None and cell.gate["passed"], cell.error or cell.gate["reason"]
    ours, eager = half
    assert eager.gate["output_rel_l2"] == eager.gate["eager_rel_l2"]  # eager bf16 is the yardstick itself
    assert eager.gate["eager_rel_l2"] > 10 * f32[0].gate["eager_rel_l2"]  # rounded to bf16, not f32
    assert ours.gate["output_rel_l2"] < gates.HALF_FACTOR * ours.gate["eager_rel_l2"]
    with pytest.raises(ValueError, match="bfloat16"):
        cells.measure(workload, "training", competitors, warmup=1, repeats=1, smoke=True, dtype="bfloat16")
    results = _report(tmp_path / "dtypes.json", f32 + half)
    table = results.with_suffix(".md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| smollm2 | latency | bfloat16 |"))
    cols = [c.strip() for c in row.split("|")[1:-1]]
    assert cols[3] == f"{ours.median_ms:.2f}" and cols[4] == f"{f32[0].median_ms:.2f}"
    assert cols[5] == f"{ours.median_ms / f32[0].median_ms:.2f}"  # vs our own float32
    assert cols[7] == f"{ours.median_ms / eager.median_ms:.2f}" and cols[-1] == "all pass"  # vs eager bf16
    assert "| smollm2 | latency, bfloat16 |" in report.summary(json.loads(results.read_text()), "x.png")


def test_half_gate_allows_one_and_a_half_times_eager_error_at_the_dtype():
    exact = torch.randn(1000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    eager = exact * (1 + 4e-3)  # eager's own error at the dtype: 4e-3 relative
    half = (gates.HALF_TOLERANCE, gates.HALF_FACTOR)
    assert gates.gate_output(exact * (1 + 5e-3), exact, eager, *half).passed
    assert not gates.gate_output(exact * (1 + 7e-3), exact, eager, *half).passed  # 1.75x eager's
    assert gates.gate_output(exact, exact, exact, *half).passed  # exact, where eager is exact too


def test_micro_benchmarks_check_every_row_and_keep_back_to_back_products_apart(tmp_path):
    """Each micro benchmark's meganeura result matches PyTorch (the attention rows' plans at the device's workgroup
    storage and at WebGPU's 16 KiB too; the projections in float32 and bfloat16, one dispatch per projection of a
    row: MAX_PROJECTIONS for these small ones); the throughput row's products run as separate dispatches (distinct
    operands, so the compiler cannot merge them into one wider GEMM), and the report renders every row. No timing
    is asserted."""
    from bench import micro

    shapes = micro.parse_attention_shapes("2x70x64,2x80x128c")
    assert shapes == ((2, 70, 64, False), (2, 80, 128, True))
    projections = micro.parse_projections("1x64x40,8x64x40")
    assert projections == ((1, 64, 40), (8, 64, 40))
    done = micro.run_all(["meganeura", "torch-cpu-eager"], [32], stream_mib=1, warmup=0, repeats=1,
                         attention_shapes=shapes, projections=projections)
    names = {r.name for r in done}
    copies = micro.MAX_PROJECTIONS
    assert {f"linear {shape} {dtype} x{copies}" for shape in ("1x64x40", "8x64x40")
            for dtype in micro.PROJECTION_DTYPES} <= names
    assert f"matmul 32 x{micro.BACK_TO_BACK} back to back" in names and "matmul 32" in names
    assert {"attention 2x70x64", "attention 2x70x64 at 16 KiB", "attention 2x80x128 causal"} <= names
    for r in done:
        assert r.error is None, r.error
        assert r.correct, f"{r.name} {r.competitor}"
    ours = {r.name: r for r in done if r.competitor == "meganeura"}
    assert ours[f"matmul 32 x{micro.BACK_TO_BACK} back to back"].dispatches == \
        micro.BACK_TO_BACK * ours["matmul 32"].dispatches
    assert ours[f"linear 1x64x40 float32 x{copies}"].dispatches == copies
    from meganeura.runtime.device import get_device

    if "timestamp-query" in get_device().features:  # (lavapipe offers it) each row's kernels timed on the GPU
        for r in ours.values():
            assert len(r.gpu_samples_ms) == micro.GPU_CALLS and r.gpu_median_ms > 0, r.name
    for r in done:
        if r.competitor == "torch-cpu-eager":
            assert r.gpu_median_ms is None  # (no GPU timer on the CPU)
    results = _report(tmp_path / "micro.json", [])
    data = json.loads(results.read_text())
    data["micro"] = [dataclasses.asdict(r) for r in done]
    results.write_text(json.dumps(data))
    report.write(results)
    table = results.with_suffix(".md").read_text()
    assert all(f"| {r.name} | {r.competitor} | {r.median_ms:.3f} |" in table for r in done)
    assert all(f"| {r.gpu_median_ms:.3f} |" in table for r in ours.values() if r.gpu_median_ms is not None)
