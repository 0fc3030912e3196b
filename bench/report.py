"""``python -m bench.report RESULTS.json [--readme docs/performance.md]``: the markdown table and the PNG plot of a
results file, next to it; with ``--readme``, also the compact table between that page's ``<!-- bench:TAG -->`` and
``<!-- /bench:TAG -->`` markers (TAG is the results file's name).

All of it is generated from the JSON only. Ratios are meganeura's median time over a competitor's (below 1: meganeura
is faster). A cell whose gate failed, or that raised, shows as such and has no ratio. The float32 cells make the main
tables; cells in a half dtype (``--dtypes``; a cell without a ``dtype`` is float32) have a table of their own, each
beside the competitors at the same dtype and beside meganeura's float32 time of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

MODES = ("latency", "inference", "training")
BASELINES = ("torch-cpu-eager", "torch-cuda-eager", "torch-cuda-inductor")


def _dtype(cell: dict) -> str:
    return cell.get("dtype", "float32")  # results from before the dtype axis are float32


def _cells(data: dict, dtype: str = "float32") -> dict:
    """The cells of one dtype by (workload, mode, competitor)."""
    return {(c["workload"], c["mode"], c["competitor"]): c for c in data["cells"] if _dtype(c) == dtype}


def _half_dtypes(data: dict) -> list[str]:
    return list(dict.fromkeys(_dtype(c) for c in data["cells"] if _dtype(c) != "float32"))


def _baselines(data: dict) -> list[str]:
    return [b for b in BASELINES if any(c["competitor"] == b for c in data["cells"])]


def _what(cell: dict) -> str:
    """A cell's name in lists: workload, mode, competitor, and the dtype where it is not float32."""
    dtype = "" if _dtype(cell) == "float32" else f" {_dtype(cell)}"
    return f"{cell['workload']} {cell['mode']}{dtype} {cell['competitor']}"


def _ok(cell: dict | None) -> bool:
    return bool(cell and not cell["error"] and cell["gate"] and cell["gate"]["passed"])


def _status(cell: dict | None) -> str:
    if cell is None:
        return "-"
    if cell["error"]:
        return "error"
    return f"{cell['median_ms']:.2f}" if cell["gate"]["passed"] else f"{cell['median_ms']:.2f} (gate failed)"


def ratio(cells: dict, workload: str, mode: str, baseline: str, ours: str = "meganeura") -> float | None:
    ours, theirs = cells.get((workload, mode, ours)), cells.get((workload, mode, baseline))
    if not (_ok(ours) and _ok(theirs)):
        return None
    return ours["median_ms"] / theirs["median_ms"]


def _ratio_text(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def _mib(n) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def _order(settings: dict) -> str:
    """How the timed calls of the competitors were ordered (results from before ``run_length`` alternated)."""
    run = settings.get("run_length")
    if run is None:
        return "competitors alternated call by call"
    return (f"competitors taking turns of {run} timed calls in a row, each turn after an untimed call (the first "
            "call after another GPU API's pays a context switch)")


def markdown(data: dict) -> str:
    cells = _cells(data)
    m = data["machine"]
    adapter = m.get("adapter", {})
    baselines = [b for b in BASELINES if any(k[2] == b for k in cells)]
    lines = [f"# Benchmark: {adapter.get('name', '?')} ({adapter.get('type', '?')}, {adapter.get('backend', '?')})", "",
             f"Machine: {m['processor']}, {m['cpu_count']} CPUs ({m['torch_threads']} torch threads), CUDA: "
             f"{m['cuda_device'] or 'none'}; {m['date']}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v) + ". f32, TF32 off. "
             f"Median of {data['settings']['repeats']} calls after {data['settings']['warmup']} warm-up calls, "
             + _order(data["settings"]) + ". Ratio = meganeura / competitor (below 1: meganeura is faster). Gates (per "
             "tensor: the output, or the loss and every gradient): relative L2 against eager float64 on the CPU "
             "below 1e-3, or below twice eager f32's own error where f32 cannot reach 1e-3 (bench/gates.py)."]
    if data["settings"].get("tuned"):
        lines += ["", "meganeura compiled with tuned matmul variants (`--tune`): a workload's first call includes "
                      "timing its new GEMM shapes."]
    if data["settings"].get("device_batch"):
        lines += ["", "Inference batches are on the device before the timed calls: moved to the GPU once for PyTorch, "
                      "put on meganeura's device once (`torch_meganeura.to_device`). Training batches come from the "
                      "host at every meganeura step."]
    if data["settings"].get("note"):
        lines += ["", f"Note: {data['settings']['note']}"]
    lines.append("")
    header = ["workload", "mode", "meganeura ms"]
    for b in baselines:
        header += [f"{b} ms", "ratio"]
    header += ["gates", "first call s (meganeura" + (" / inductor)" if "torch-cuda-inductor" in baselines else ")"),
               "dispatches", "planned MiB", "peak MiB (meganeura / torch)", "host<->device MiB/call"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    workloads = list(dict.fromkeys(c["workload"] for c in data["cells"]))
    for w in workloads:
        for mode in MODES:
            ours = cells.get((w, mode, "meganeura"))
            if ours is None:
                continue
            row = [w, mode, _status(ours)]
            for b in baselines:
                r = ratio(cells, w, mode, b)
                row += [_status(cells.get((w, mode, b))), "-" if r is None else f"{r:.2f}"]
            present = [c for c in (cells.get((w, mode, x)) for x in ("meganeura", *baselines)) if c]
            failed = [c["competitor"] for c in present if not _ok(c)]
            row.append("all pass" if not failed else "FAILED: " + ", ".join(failed))
            first = f"{ours['compile_s']:.1f}" if ours["compile_s"] is not None else "-"
            inductor = cells.get((w, mode, "torch-cuda-inductor"))
            if inductor and inductor["compile_s"] is not None:
                first += f" / {inductor['compile_s']:.1f}"
            torch_peak = next((cells[(w, mode, b)]["peak_memory_bytes"] for b in ("torch-cuda-eager",)
                               if (w, mode, b) in cells), None)
            row += [first, str(ours["dispatches"] or "-"), _mib(ours["planned_bytes"]),
                    f"{_mib(ours['peak_memory_bytes'])} / {_mib(torch_peak)}", _mib(ours["transfer_bytes_per_call"])]
            lines.append("| " + " | ".join(row) + " |")
    lines += _resident_table(cells, baselines)
    lines += _fast_table(cells, baselines)
    lines += _half_table(data)
    errors = [c for c in data["cells"] if c["error"] or (c["gate"] and not c["gate"]["passed"])]
    if errors:
        lines += ["", "Failures:", ""]
        lines += [f"- {_what(c)}: {c['error'] or c['gate']['reason']}" for c in errors]
    fell_back = [c for c in data["cells"] if c.get("fallback_ops")]
    if fell_back:
        lines += ["", "Ran partly in eager PyTorch on the host (no device lowering; timed as they ran):", ""]
        lines += [f"- {_what(c)}: {', '.join(c['fallback_ops'])}" for c in fell_back]
    lines += _profile_lines(data["cells"])
    if data.get("recompile"):
        lines += ["", "Second compile of the training step after `torch._dynamo.reset()` (on-disk caches kept):", ""]
        lines += [f"- {r['workload']} {r['competitor']}: {r['seconds']:.1f} s" for r in data["recompile"]]
    if data.get("micro"):
        lines += ["", "## Micro benchmarks", "", "Per call: launch, kernels and the wait; GPU: the kernels alone "
                  "(meganeura: its profiler's timestamps around each dispatch, summed per call; PyTorch: CUDA events "
                  "around the call), median of the GPU-timed calls.", "",
                  "| benchmark | competitor | median ms | rate | GPU ms | rate at GPU time | µs per dispatch/op "
                  "| host µs per dispatch | dispatches | correct |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in data["micro"]:
            if r["error"]:
                lines.append(f"| {r['name']} | {r['competitor']} | error: {r['error'][:120]} | | | | | | | |")
                continue
            per = "-" if r["per_dispatch_us"] is None else f"{r['per_dispatch_us']:.1f}"
            host = "-" if r.get("host_per_dispatch_us") is None else f"{r['host_per_dispatch_us']:.1f}"
            gpu = "-" if r.get("gpu_median_ms") is None else f"{r['gpu_median_ms']:.3f}"
            gpu_rate = "-" if r.get("gpu_rate") is None else f"{r['gpu_rate']:.1f} {r['work']}"
            lines.append(f"| {r['name']} | {r['competitor']} | {r['median_ms']:.3f} | {r['rate']:.1f} {r['work']} "
                         f"| {gpu} | {gpu_rate} | {per} | {host} | {r['dispatches'] or '-'} "
                         f"| {'yes' if r['correct'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _profile_lines(cells: list) -> list[str]:
    """Top kernels by GPU time of the profiled meganeura cells."""
    profiled = [c for c in cells if c.get("top_kernels")]
    if not profiled:
        return []
    lines = ["", "## Where the GPU time goes (profiler: each dispatch in a timestamped pass)", "",
             "| workload | mode | competitor | GPU ms per call | top kernels: ms per call (share) |",
             "|---|---|---|---|---|"]
    for c in profiled:
        top = "; ".join(f"{k['name']} {k['ms_per_call']:.2f} ({100 * k['share']:.0f}%)" for k in c["top_kernels"])
        competitor = c["competitor"] + ("" if _dtype(c) == "float32" else f" {_dtype(c)}")
        lines.append(f"| {c['workload']} | {c['mode']} | {competitor} | {c['gpu_ms_per_call']:.2f} | {top} |")
    return lines


def _fast_table(cells: dict, baselines: list) -> list[str]:
    """precision "fast" (meganeura-fast) next to strict meganeura of the same run, and the baselines."""
    rows = [(w, mode) for (w, mode, c) in cells if c == "meganeura-fast"]
    if not rows:
        return []
    header = ["workload", "mode", "meganeura ms", "meganeura-fast ms", "speedup over strict", "output rel L2"]
    for b in baselines:
        header += [f"{b} ms", "ratio"]
    lines = ["", "Precision \"fast\" (`meganeura-fast`: f16 products in the forward matmuls and convolutions, gated "
             "at relative L2 1e-2; speedup = meganeura / meganeura-fast; ratio = meganeura-fast / competitor):", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for w, mode in rows:
        fast = cells[(w, mode, "meganeura-fast")]
        speedup = ratio(cells, w, mode, "meganeura-fast")
        error = fast["gate"]["output_rel_l2"] if fast["gate"] else None
        row = [w, mode, _status(cells.get((w, mode, "meganeura"))), _status(fast),
               "-" if speedup is None else f"{speedup:.2f}", "-" if error is None else f"{error:.1e}"]
        for b in baselines:
            r = ratio(cells, w, mode, b, ours="meganeura-fast")
            row += [_status(cells.get((w, mode, b))), "-" if r is None else f"{r:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _half_table(data: dict) -> list[str]:
    """meganeura in bfloat16 / float16 beside its own float32 time and the competitors at the same dtype."""
    halves = _half_dtypes(data)
    if not halves:
        return []
    f32 = _cells(data)
    by_dtype = {d: _cells(data, d) for d in halves}
    baselines = [b for b in BASELINES if any(k[2] == b for cells in by_dtype.values() for k in cells)]
    header = ["workload", "mode", "dtype", "meganeura ms", "meganeura float32 ms", "vs float32"]
    header += [x for b in baselines for x in (f"{b} ms", "ratio")]
    header += ["output rel L2 (meganeura / eager at dtype)", "gates"]
    lines = ["", "Half precision (`--dtypes`): the model and its float inputs cast with `.to(dtype)`; every cell gated "
             "against float64 of the same half-precision model and inputs, within 1.5x eager PyTorch's own error "
             "(on the CPU) at that dtype. vs float32 = meganeura at the dtype / meganeura float32 of the same run; "
             "ratio = meganeura / competitor, both at the dtype:", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    at_or_below = {(d, b): [0, 0] for d in halves for b in baselines}  # inference cells: [ratio <= 1, with a ratio]
    for w in dict.fromkeys(c["workload"] for c in data["cells"]):
        for mode in MODES:
            for d in halves:
                cells = by_dtype[d]
                ours = cells.get((w, mode, "meganeura"))
                if ours is None:
                    continue
                mine = f32.get((w, mode, "meganeura"))
                vs_f32 = ours["median_ms"] / mine["median_ms"] if _ok(ours) and _ok(mine) else None
                row = [w, mode, d, _status(ours), _status(mine), _ratio_text(vs_f32)]
                for b in baselines:
                    r = ratio(cells, w, mode, b)
                    row += [_status(cells.get((w, mode, b))), _ratio_text(r)]
                    if mode == "inference" and r is not None:
                        at_or_below[(d, b)][0] += r <= 1.0
                        at_or_below[(d, b)][1] += 1
                gate = ours["gate"] or {}
                errors = [gate.get("output_rel_l2"), gate.get("eager_rel_l2")]
                row.append(" / ".join("-" if e is None else f"{e:.1e}" for e in errors))
                failed = [c["competitor"] for k, c in cells.items() if k[:2] == (w, mode) and not _ok(c)]
                row.append("all pass" if not failed else "FAILED: " + ", ".join(failed))
                lines.append("| " + " | ".join(row) + " |")
    counts = [f"{d} vs {b} {n} of {total}" for (d, b), (n, total) in at_or_below.items() if total]
    if counts:
        lines += ["", "Inference cells at or below 1.0 (meganeura as fast or faster, gates passed): "
                  + ", ".join(counts) + "."]
    return lines


def _resident_table(cells: dict, baselines: list) -> list[str]:
    """Device-resident training (compile_train_step) next to the ordinary loop kept on the device
    (``meganeura-loop``), the backend's plain training step and the baselines."""
    rows = [w for (w, mode, c) in cells if c == "meganeura-resident" and mode == "training"]
    if not rows:
        return []
    header = ["workload", "meganeura-resident ms", "meganeura-loop ms", "loop / resident", "meganeura (backend) ms"] + [
        x for b in baselines for x in (f"{b} ms", "ratio")] + ["gates", "dispatches",
                                                             "peak MiB (resident / loop / torch)",
                                                             "host<->device MiB/step (resident / loop)"]
    lines = ["", "Training step through `compile_train_step` (forward, backward and AdamW in one device plan; "
             "ratio = meganeura-resident / competitor) and the ordinary loop with `keep_on_device` (meganeura-loop):",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for w in dict.fromkeys(rows):
        ours = cells[(w, "training", "meganeura-resident")]
        loop = cells.get((w, "training", "meganeura-loop")) or {}
        over = loop["median_ms"] / ours["median_ms"] if _ok(ours) and loop and _ok(loop) else None
        row = [w, _status(ours), _status(loop or None), "-" if over is None else f"{over:.2f}",
               _status(cells.get((w, "training", "meganeura")))]
        for b in baselines:
            theirs = cells.get((w, "training", b))
            r = ours["median_ms"] / theirs["median_ms"] if _ok(ours) and _ok(theirs) else None
            row += [_status(theirs), "-" if r is None else f"{r:.2f}"]
        torch_peak = (cells.get((w, "training", "torch-cuda-eager")) or {}).get("peak_memory_bytes")
        row += ["pass" if _ok(ours) and (not loop or _ok(loop)) else "FAILED", str(ours["dispatches"] or "-"),
                f"{_mib(ours['peak_memory_bytes'])} / {_mib(loop.get('peak_memory_bytes'))} / {_mib(torch_peak)}",
                f"{_mib(ours['transfer_bytes_per_call'])} / {_mib(loop.get('transfer_bytes_per_call'))}"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_dtype = {d: _cells(data, d) for d in ["float32", *_half_dtypes(data)]}
    series = _baselines(data) + (["meganeura float32"] if len(by_dtype) > 1 else [])
    groups = [(w, mode, d) for w in dict.fromkeys(c["workload"] for c in data["cells"]) for mode in MODES
              for d in by_dtype if (w, mode, "meganeura") in by_dtype[d]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(groups) + 2), 4.5))
    width = 0.8 / max(len(series), 1)
    for k, b in enumerate(series):
        xs, ys, missing = [], [], []
        for i, (w, mode, d) in enumerate(groups):
            if b == "meganeura float32":  # a half dtype's time over our own float32's
                if d == "float32":
                    continue
                ours, mine = by_dtype[d][(w, mode, "meganeura")], by_dtype["float32"].get((w, mode, "meganeura"))
                r = ours["median_ms"] / mine["median_ms"] if _ok(ours) and _ok(mine) else None
            else:
                r = ratio(by_dtype[d], w, mode, b)
            (xs if r is not None else missing).append(i + k * width)
            if r is not None:
                ys.append(r)
        bars = ax.bar(xs, ys, width, label=f"meganeura / {b}")
        for x in missing:
            ax.text(x, 1.0, "x", ha="center", va="center", color=bars.patches[0].get_facecolor() if ys else "k")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("time ratio (below 1: meganeura faster)")
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{w}\n{mode}" + ("" if d == "float32" else f"\n{d}") for w, mode, d in groups],
                       rotation=60, ha="right", fontsize=7)
    adapter = data["machine"].get("adapter", {}).get("name", "?")
    dtypes = "; each competitor at the cell's dtype" if len(by_dtype) > 1 else ""
    ax.set_title(f"meganeura on {adapter} vs PyTorch (x: failed gate or error{dtypes})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: Path) -> None:
    data = json.loads(Path(results).read_text())
    Path(results).with_suffix(".md").write_text(markdown(data))
    if data["cells"]:
        plot(data, Path(results).with_suffix(".png"))


def summary(data: dict, image: str) -> str:
    """The compact table for the README: median ms per competitor and meganeura's ratio to each, and the plot.
    Training has a second row for the device-resident step (``meganeura-resident``) where it was measured, and a
    mode measured in a half dtype a row per dtype (ratios to the competitors at that dtype)."""
    by_dtype = {d: _cells(data, d) for d in ["float32", *_half_dtypes(data)]}
    baselines = _baselines(data)
    m = data["machine"]
    header = ["workload", "mode", "meganeura ms"] + [x for b in baselines for x in (f"{b} ms", "ratio")] + ["gates"]
    lines = [f"{m.get('adapter', {}).get('name', '?')} vs PyTorch {m['versions'].get('torch')} "
             f"({m['cuda_device'] or m['processor'] + ' CPU'}), {data['settings'].get('scale', 'full')} scale, "
             f"{m['date'][:10]}; ratio = meganeura / competitor, below 1 is faster."
             + (f" {data['settings']['note']}" if data["settings"].get("note") else ""), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = [(mode, "meganeura", d, mode if d == "float32" else f"{mode}, {d}") for mode in MODES for d in by_dtype]
    rows += [("training", "meganeura-resident", "float32", "training, resident"),
             ("training", "meganeura-loop", "float32", "training, loop kept on device")]
    for w in dict.fromkeys(c["workload"] for c in data["cells"]):
        for mode, ours, dtype, label in rows:
            cells = by_dtype[dtype]
            if (w, mode, ours) not in cells:
                continue
            row = [w, label, _status(cells[(w, mode, ours)])]
            for b in baselines:
                r = ratio(cells, w, mode, b, ours)
                row += [_status(cells.get((w, mode, b))), "-" if r is None else f"{r:.2f}"]
            present = [c for k, c in cells.items() if k[:2] == (w, mode) and k[2] in (ours, *baselines)]
            row.append("pass" if all(_ok(c) for c in present) else "FAILED")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines + ["", f"![ratios]({image})"])


def update_readme(results: Path, readme: Path) -> None:
    tag = results.stem
    begin, end = f"<!-- bench:{tag} -->", f"<!-- /bench:{tag} -->"
    text = readme.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{readme} has no {begin} ... {end} markers")
    image = os.path.relpath(results.with_suffix(".png").resolve(), readme.resolve().parent)
    block = summary(json.loads(results.read_text()), str(image))
    readme.write_text(re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{block}\n{end}", text,
                             flags=re.S))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="bench/results/TAG.json")
    parser.add_argument("--readme", type=Path, help="also update this page's table for TAG")
    args = parser.parse_args()
    write(args.results)
    if args.readme:
        update_readme(args.results, args.readme)
