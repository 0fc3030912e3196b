"""bench.cold at smoke scale: a fresh process's cold first call is split into the plans' share and the rest, and the
table compares it with Inductor's."""
import json

import pytest

from bench import cold


@pytest.mark.slow  # 12 s on the 2-core machine: fresh processes (the slow stage: docs/architecture.md, Tests)
def test_cold_first_call_is_measured_in_a_fresh_process_and_split(tmp_path):
    out = tmp_path / "cold"
    assert cold.main(["--out", str(out), "--smoke", "--workloads", "whisper_tiny", "--competitors", "meganeura"]) == 0
    (result,) = json.loads(out.with_suffix(".json").read_text())["results"]
    assert "error" not in result, result
    assert 0 < result["plans_s"] < result["first_s"]
    assert abs(result["plans_s"] + result["rest_s"] - result["first_s"]) < 1e-9
    assert result["kernels"] > 0 and result["fallback_ops"] == []
    assert "| whisper_tiny | " in out.with_suffix(".md").read_text()


def test_cold_table_gives_the_ratio_to_inductor_and_shows_errors():
    results = [
        {"workload": "a", "competitor": "meganeura", "first_s": 3.0, "plans_s": 1.0, "rest_s": 2.0, "kernels": 7},
        {"workload": "a", "competitor": "torch-cuda-inductor", "first_s": 12.0},
        {"workload": "b", "competitor": "meganeura", "error": "RuntimeError: boom"},
    ]
    table = cold._table(results)
    assert "| a | 3.00 | 1.00 | 2.00 | 12.00 | 0.25 | 7 |" in table
    assert "| b | error: RuntimeError: boom | - | - | - | - | - |" in table


@pytest.mark.slow  # a fresh process compiling a tiny Llama's prefill and decode
def test_cold_generate_counts_frames_and_splits_the_call_by_profile(tmp_path):
    """``--generate``: a tiny Llama's first HF generate with the static cache, in a fresh process: two frames (the
    prefill and the decode), and the profile's shares add up to the call."""
    out = tmp_path / "cold"
    assert cold.main(["--out", str(out), "--smoke", "--workloads", "smollm2", "--generate", "3", "--caches", "static",
                      "--competitors", "meganeura", "--profile"]) == 0
    (result,) = json.loads(out.with_suffix(".json").read_text())["results"]
    assert "error" not in result, result
    assert result["cache"] == "static" and result["frames"] == 2 and 0 < result["plans_s"] < result["first_s"]
    shares = result["profile_s"]
    assert min(shares.values()) >= 0 and shares["dynamo"] > 0 and shares["plans_lowering"] > 0
    assert sum(shares.values()) == pytest.approx(result["first_s"])
    assert "| smollm2 generate, static cache | " in out.with_suffix(".md").read_text()


def test_cold_table_gives_medians_of_rounds_by_cache():
    results = [{"workload": "a", "competitor": "meganeura", "cache": "static", "first_s": s, "plans_s": 1.0,
                "rest_s": s - 1.0, "kernels": 3} for s in (5.0, 2.0, 3.0)]
    assert "| a generate, static cache | 3.00 | 1.00 | 2.00 | - | - | 3 |" in cold._table(results)
