"""bench.generate at smoke scale: every row's greedy tokens equal eager's (the backend's with both caches among
them), and the report is written."""
import json

from bench import generate


def test_generate_benchmark_smoke(tmp_path):
    out = tmp_path / "generate"
    assert generate.main(["--out", str(out), "--smoke", "--new-tokens", "12", "--max-cache-len", "32"]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["competitor"], r["cache"]): r for r in result["rows"]}
    assert set(rows) == {("torch-cpu-eager", "dynamic"), ("torch-cpu-eager", "static"),
                         ("meganeura-backend", "dynamic"), ("meganeura-backend", "static"),
                         ("meganeura-bundle", "static")}
    assert all(r["equal"] for r in rows.values()), rows
    bundle = rows["meganeura-bundle", "static"]
    assert bundle["bundle_bytes"] > 0 and len(bundle["decode_by_context"]) == 11  # the first token is prefill's
    assert "| meganeura-bundle | static |" in out.with_suffix(".md").read_text()
    assert len(rows["meganeura-backend", "dynamic"]["decode_by_context"]) == 11
