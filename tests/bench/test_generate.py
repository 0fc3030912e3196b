"""bench.generate at smoke scale: every row's greedy tokens equal eager's (the backend's with both caches among
them, and the batched bundles', each prompt's with that prompt alone), and the report is written."""
import argparse
import json

import pytest

from bench import generate


def test_generate_benchmark_smoke(tmp_path):
    """Every row group, the bundle at batches 1, 2 and 3 (``--batch 1,2,3``): each batch's aggregate tokens/s and its
    ratio to batch 1 in the JSON and the by-batch table, and the plot against batch written."""
    out = tmp_path / "generate"
    assert generate.main(["--out", str(out), "--smoke", "--new-tokens", "12", "--max-cache-len", "32",
                          "--batch", "1,2,3"]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["competitor"], r["cache"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {("torch-cpu-eager", "dynamic", 1), ("torch-cpu-eager", "static", 1),
                         ("meganeura-backend", "dynamic", 1), ("meganeura-backend", "static", 1),
                         ("meganeura-bundle", "static", 1), ("meganeura-bundle", "static", 2),
                         ("meganeura-bundle", "static", 3)}
    assert all(r["equal"] and r["agreeing_tokens"] == 12 for r in rows.values()), rows
    bundle = rows["meganeura-bundle", "static", 1]
    assert bundle["bundle_bytes"] > 0 and len(bundle["decode_by_context"]) == 11  # the first token is prefill's
    speedups = {b: rows["meganeura-bundle", "static", b]["tokens_per_second"] / bundle["tokens_per_second"]
                for b in (2, 3)}
    assert result["batch_speedups"] == {str(b): s for b, s in speedups.items()}
    assert result["batch"] == 3 and result["batch_speedup"] == speedups[3]
    report = out.with_suffix(".md").read_text()
    assert "| meganeura-bundle | static | 1 |" in report and "| meganeura-bundle | static | 3 |" in report
    for batch, ratio in ((1, 1.0), *speedups.items()):
        r = rows["meganeura-bundle", "static", batch]
        assert (f"| {batch} | {r['tokens_per_second']:.1f} | {r['decode_tokens_per_second']:.1f} | {ratio:.2f}x | "
                "yes |") in report
    assert len(rows["meganeura-backend", "dynamic", 1]["decode_by_context"]) == 11
    assert out.with_suffix(".png").stat().st_size > 0 and (tmp_path / "generate-batch.png").stat().st_size > 0


def test_generate_benchmark_other_model_half_bundle_and_prefix_comparison(tmp_path):
    """Llama-3.2-1B's proportions at smoke scale, the bundle rows only (``--rows``), its float32 bundle (also reading
    each decode step before the next: ``--bundle-synchronous``) and one exported in bfloat16 beside it (each compared
    with eager in its dtype), tokens compared over a prefix; the plot is written."""
    out = tmp_path / "generate"
    assert generate.main(["--out", str(out), "--smoke", "--model", "llama-3.2-1b", "--rows", "bundle", "--half-bundle",
                          "--bundle-synchronous", "--new-tokens", "10", "--max-cache-len", "32", "--batch", "1",
                          "--compare-tokens", "6"]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["competitor"], r["dtype"]): r for r in result["rows"]}
    assert set(rows) == {("meganeura-bundle", "float32"), ("meganeura-bundle", "bfloat16"),
                         ("meganeura-bundle-synchronous", "float32")}
    assert all(r["equal"] and r["agreeing_tokens"] == 6 for r in rows.values()), rows
    assert result["bfloat16_speedup"] == (rows["meganeura-bundle", "bfloat16"]["tokens_per_second"]
                                          / rows["meganeura-bundle", "float32"]["tokens_per_second"])
    assert result["run_ahead_speedup"] == (rows["meganeura-bundle", "float32"]["tokens_per_second"]
                                           / rows["meganeura-bundle-synchronous", "float32"]["tokens_per_second"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| meganeura-bundle static batch 1 bfloat16 |" in out.with_suffix(".md").read_text()


def test_generate_batch_sizes_parse():
    """``--batch`` takes one size or several, sorted and without repeats; a size under 1 or not a number is refused."""
    assert generate._batch_sizes("8") == (8,)
    assert generate._batch_sizes("8,1,2,2") == (1, 2, 8)
    for wrong in ("0,2", "two", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            generate._batch_sizes(wrong)


def test_generate_benchmark_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """A run cut short (here: the bundle's row failing) has written the rows before it, checked against eager."""
    out = tmp_path / "generate"

    def cut_short(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "_bundle_row", cut_short)
    with pytest.raises(KeyboardInterrupt):
        generate.main(["--out", str(out), "--smoke", "--new-tokens", "6", "--max-cache-len", "32", "--batch", "1",
                       "--caches", "static", "--rows", "eager,bundle"])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["competitor"], r["cache"], r["equal"]) for r in rows] == [("torch-cpu-eager", "static", True)]
    assert "| torch-cpu-eager | static | 1 |" in out.with_suffix(".md").read_text()
