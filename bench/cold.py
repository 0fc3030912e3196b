"""``python -m bench.cold``: cold first calls, each in a fresh process, meganeura against Inductor.

    python -m bench.cold --out bench/results/h200-cold                        # the five workloads, full size
    python -m bench.cold --out /tmp/cold-smoke --smoke --workloads whisper_tiny  # tiny sizes: checks the path

A cold first call is a workload's first inference call (under ``torch.no_grad``) in a process that has compiled
nothing before, with every cache that could shorten it empty or off: for meganeura a new, empty plan cache
(``MEGANEURA_CACHE_DIR``), no tuning, and the drivers' shader caches off (``__GL_SHADER_DISK_CACHE=0`` for
NVIDIA's, ``MESA_SHADER_CACHE_DISABLE=true`` for Mesa's), so that every kernel is compiled; for Inductor (on CUDA,
where it exists) a new, empty ``TORCHINDUCTOR_CACHE_DIR``. Importing torch and building the model are not timed;
creating the device is (meganeura's backend creates it while torch traces).

meganeura's first call is split by ``torch_meganeura.explain``: the plans' share (from the device request to a
ready plan, for each device partition: lowering, fusion and scheduling, compiling the kernels, uploading the
parameters) and the rest of the call (torch's dynamo and AOT autograd tracing, the partitioner, and the first run
itself). Writes ``OUT.json`` (every process's result) and the markdown table ``OUT.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPETITORS = ("meganeura", "torch-cuda-inductor")
RESULT = "COLD-RESULT "  # prefix of the child's one line of JSON


def _parser() -> argparse.ArgumentParser:
    from .workloads import WORKLOADS

    p = argparse.ArgumentParser(prog="python -m bench.cold", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="results path without suffix: writes OUT.json and OUT.md")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--size", choices=("minimal", "full"), default="full",
                   help="the workload's input: full (its inference batch, default) or minimal (its latency batch)")
    p.add_argument("--competitors", default=None,
                   help=f"comma-separated, from {', '.join(COMPETITORS)} (default: meganeura, and Inductor on CUDA)")
    p.add_argument("--smoke", action="store_true", help="smoke scale: every workload shrunk, to check the path")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed to each process")
    p.add_argument("--child", nargs=2, metavar=("COMPETITOR", "WORKLOAD"), help=argparse.SUPPRESS)
    return p


def _child(competitor: str, workload_name: str, size: str, smoke: bool) -> dict:
    """One cold first call in this process; returns what to report."""
    import torch

    from .workloads import WORKLOADS

    workload = WORKLOADS[workload_name]
    torch.manual_seed(0)
    model = workload.build(smoke).float().eval()
    batch = workload.batch(size, torch.Generator().manual_seed(1), smoke)
    if competitor == "meganeura":
        import torch_meganeura

        with torch.no_grad():
            report = torch_meganeura.explain(lambda *b: workload.output(model, *b), *batch)
        return {"first_s": report.compile_seconds, "plans_s": report.device_compile_seconds,
                "rest_s": report.compile_seconds - report.device_compile_seconds, "kernels": report.kernels,
                "dispatches": report.dispatches, "fallback_ops": sorted(report.fallback_ops),
                "device": report.adapter}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, batch = model.cuda(), tuple(t.cuda() for t in batch)
    compiled = torch.compile(lambda *b: workload.output(model, *b))
    start = time.perf_counter()
    with torch.no_grad():
        compiled(*batch)
    torch.cuda.synchronize()
    return {"first_s": time.perf_counter() - start, "device": torch.cuda.get_device_name(0)}


def _run_child(competitor: str, workload: str, args, scratch: Path) -> dict:
    cache = tempfile.mkdtemp(prefix=f"{competitor}-{workload}-", dir=scratch)
    env = dict(os.environ, MEGANEURA_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=cache, MEGANEURA_TUNE="0",
               __GL_SHADER_DISK_CACHE="0", MESA_SHADER_CACHE_DISABLE="true")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "bench.cold", "--child", competitor, workload, "--size", args.size,
               *(["--smoke"] if args.smoke else [])]
    entry = {"workload": workload, "competitor": competitor, "size": args.size}
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**entry, "error": f"no result within {args.timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        return {**entry, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:2000]}
    return {**entry, **json.loads(lines[-1][len(RESULT):])}


def _table(results: list[dict]) -> str:
    rows = ["| workload | meganeura first call s | of which plans s | tracing and run s | inductor first call s "
            "| ratio | kernels |", "|---|---|---|---|---|---|---|"]
    by_key = {(r["workload"], r["competitor"]): r for r in results}
    for workload in dict.fromkeys(r["workload"] for r in results):
        ours, theirs = by_key.get((workload, "meganeura")), by_key.get((workload, "torch-cuda-inductor"))
        cells = ["-"] * 6
        if ours is not None:
            cells[:3] = ([f"{ours['first_s']:.2f}", f"{ours['plans_s']:.2f}", f"{ours['rest_s']:.2f}"]
                         if "error" not in ours else [f"error: {ours['error'][:80]}", "-", "-"])
            cells[5] = str(ours.get("kernels", "-"))
        if theirs is not None:
            cells[3] = f"{theirs['first_s']:.2f}" if "error" not in theirs else f"error: {theirs['error'][:80]}"
            if "error" not in theirs and ours is not None and "error" not in ours:
                cells[4] = f"{ours['first_s'] / theirs['first_s']:.2f}"
        rows.append(f"| {workload} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        result = _child(*args.child, args.size, args.smoke)
        print(RESULT + json.dumps(result), flush=True)
        return 0
    if not args.out:
        _parser().error("--out is required")
    from .workloads import WORKLOADS

    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        _parser().error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    if args.competitors:
        competitors = [c for c in args.competitors.split(",") if c]
    else:
        import torch

        competitors = ["meganeura"] + (["torch-cuda-inductor"] if torch.cuda.is_available() else [])
    unknown = sorted(set(competitors) - set(COMPETITORS))
    if unknown:
        _parser().error(f"unknown competitors {unknown}; choose from {', '.join(COMPETITORS)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="meganeura-cold-") as scratch:
        for workload in workloads:
            for competitor in competitors:
                results.append(_run_child(competitor, workload, args, Path(scratch)))
                print(json.dumps(results[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from .run import machine

    note = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "size": args.size, "smoke": args.smoke}
    out.with_suffix(".json").write_text(json.dumps({"machine": machine(), "settings": note, "results": results},
                                                   indent=1))
    out.with_suffix(".md").write_text(
        f"# Cold first calls ({args.size} size{', smoke scale' if args.smoke else ''}, {note['date']})\n\n"
        "Each a fresh process, caches empty or off (bench/cold.py). 'of which plans': meganeura's plans (lowering, "
        "fusion, kernels, parameter uploads); 'tracing and run': the rest of the call (torch's dynamo and AOT "
        "tracing, the first run). Ratio = meganeura / Inductor.\n\n" + _table(results) + "\n")
    print(_table(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
