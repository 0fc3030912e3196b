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
