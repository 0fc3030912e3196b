"""bench.decode_profile at smoke scale: every dtype and plan kind gets a row whose profiled steps are the decode
plan's dispatches, and the report is written."""
import json

import pytest

from bench import decode_profile


def test_decode_profile_smoke(tmp_path):
    from meganeura.runtime.device import get_device

    if "timestamp-query" not in get_device().features:
        pytest.skip("the adapter offers no timestamp queries")
    out = tmp_path / "profile"
    assert decode_profile.main(["--out", str(out), "--smoke", "--new-tokens", "6", "--max-cache-len", "40"]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["dtype"], r["plans"]): r for r in result["rows"]}
    assert set(rows) == {(d, p) for d in ("float32", "bfloat16") for p in ("portable", "adapter")}
    for row in rows.values():
        assert row["steps"] == decode_profile.PROFILED_STEPS
        assert 0 < row["gpu_ms"] <= row["span_ms"] and row["wall_ms"] > 0
        assert len(row["top_us"]) <= decode_profile.TOP_KERNELS
    assert rows["float32", "adapter"]["dispatches"] <= rows["float32", "portable"]["dispatches"]
    assert "| bfloat16 | adapter |" in out.with_suffix(".md").read_text()


def test_decode_profile_of_hf_generate_through_the_backend(tmp_path):
    """The backend rows: HF ``generate`` with each cache, its profiled steps the decode plan's runs."""
    from meganeura.runtime.device import get_device

    if "timestamp-query" not in get_device().features:
        pytest.skip("the adapter offers no timestamp queries")
    out = tmp_path / "profile"
    plans = ",".join(decode_profile.BACKEND_CACHES)
    assert decode_profile.main(["--out", str(out), "--smoke", "--dtypes", "float32", "--plans", plans]) == 0
    rows = {r["plans"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == set(decode_profile.BACKEND_CACHES)
    for row in rows.values():
        assert row["steps"] == decode_profile.PROFILED_STEPS
        assert 0 < row["gpu_ms"] <= row["span_ms"] and row["wall_ms"] > 0
        assert any(name == "attention" for name, _ in row["top_us"])
