"""``python -m bench.matmul_candidates`` on the CPU driver at small sizes: every candidate's plan runs and matches
float64, the tuner's times and choice are reported, the default is timed twice, the tables and files are written
(under the adapter's limits and WebGPU's defaults); a wrong result is marked. No timing is asserted."""
import json

import pytest
import torch

from bench import matmul_candidates
from meganeura.kernels import matmul_tuning
from meganeura.runtime.device import get_device
from meganeura.runtime.matmul_tuner import MatmulTuner


@pytest.fixture
def few_candidates(monkeypatch):
    """Two tile shapes, one of them big enough for the double-buffered and quad-staged candidates, and two splits:
    few pipelines for a CPU driver."""
    monkeypatch.setattr(matmul_tuning, "CONFIGS", (((64, 64), (4, 4)), ((32, 32), (4, 4))))
    monkeypatch.setattr(matmul_tuning, "SPLITS", (1, 2))
    monkeypatch.setattr(matmul_candidates, "WARM_SECONDS", 0.0)
    monkeypatch.setattr(matmul_candidates, "GPU_CALLS", 2)


def test_every_candidate_runs_correctly_and_is_timed(few_candidates):
    device = get_device()
    a = b = torch.zeros(72, 72)
    choices, _ = MatmulTuner(device, None).time_candidates(
        matmul_candidates.matmul_problem(matmul_candidates.traced(a, b), a, b, device.limits))
    rows = matmul_candidates.size_rows(72, device, MatmulTuner(device, None), torch.Generator().manual_seed(0))
    ours = rows[:len(choices)]
    assert len(choices) > 4 and any(c.double for c in choices) and any(c.quads for c in choices)
    assert [r.index for r in rows] == [*range(len(choices)), 0] + ([-1] if torch.cuda.is_available() else [])
    for row in rows[:len(choices) + 1]:
        assert row.error is None, row.error
        assert row.rel_l2 < matmul_candidates.TOLERANCE and row.variant.count("tiled") == 1
        if "timestamp-query" in device.features:
            assert row.gpu_us > 0 and row.tflops > 0
    assert all(r.tuner_us > 0 for r in ours) and sum(r.kept for r in ours) == 1
    assert rows[len(choices)].variant.startswith("default, again: ") and "double-buffered" in " ".join(
        r.variant for r in ours)


def test_main_writes_the_table_and_the_results_under_webgpu_default_limits(few_candidates, tmp_path, capsys):
    out = tmp_path / "candidates"
    assert matmul_candidates.main(["--sizes", "40", "--limits", "webgpu-default", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(webgpu-default limits)" in printed and "| 40 | 0" in printed and "n=40: fastest #" in printed
    assert "FAILED" not in printed
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["limits"] == "webgpu-default" and data["rows"][0]["choice"]["split"] >= 1
    written = out.with_suffix(".md").read_text()
    assert written.splitlines()[0] == printed.splitlines()[0] and "| 40 | 0" in written and "n=40: fastest #" in written


def test_tiles_keep_the_default_and_those_tiles_candidates_alone(few_candidates, capsys):
    assert matmul_candidates.main(["--sizes", "72", "--tiles", "32x32"]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| 72 |")]
    assert rows[0].startswith("| 72 | 0") and rows[-1].startswith("| 72 | 0") and "default, again" in rows[-1]
    assert len(rows) > 3 and all("tiled 32x32" in line for line in rows[1:-1])


def test_a_wrong_result_is_marked_and_left_out_of_the_summary():
    good = matmul_candidates.Row(8, 0, "tiled a", gpu_us=2.0, tflops=1.0, rel_l2=1e-7, kept=True)
    wrong = matmul_candidates.Row(8, 1, "tiled b", gpu_us=1.0, tflops=2.0, rel_l2=0.5)
    assert "5.0e-01 FAILED" in matmul_candidates.table([good, wrong])
    assert matmul_candidates.summary([good, wrong]).startswith("n=8: fastest #0,")
