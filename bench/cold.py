"""``python -m bench.cold``: cold first calls, each in a fresh process, meganeura against Inductor.

    python -m bench.cold --out bench/results/h200-cold                        # the five workloads, full size
    python -m bench.cold --out /tmp/cold-smoke --smoke --workloads whisper_tiny  # tiny sizes: checks the path
    python -m bench.cold --out OUT --workloads smollm2 --generate 6 --rounds 3  # HF generate's first call

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

With ``--generate N`` the cold first call is a language model's first HF ``generate`` of N new tokens (greedy, a
16-token prompt), with each cache of ``--caches``: for meganeura with ``model.forward`` compiled by the backend and
HF's own compile off (``disable_compile=True``), its plans' share summed over the plans it compiled, with the frames
dynamo compiled; for Inductor (on CUDA) HF's static cache as HF ships it (``generate`` compiles the forward itself)
and the default cache with ``model.forward`` compiled by Inductor. Each process also gives its CPU time (all its
threads), steadier than the wall time on a shared machine. ``--rounds R`` runs every process R times, alternating,
and the table gives medians; ``--profile`` splits meganeura's first call by cProfile (``_profile_shares``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPETITORS = ("meganeura", "torch-cuda-inductor")
RESULT = "COLD-RESULT "  # prefix of the child's one line of JSON
CACHES = {"static": {"cache_implementation": "static"}, "dynamic": {}}  # HF generate's arguments of each cache
PROMPT_TOKENS = 16  # a generate call's prompt: the first tokens of the workload's batch
# Functions whose cumulative time (cProfile, the main thread) splits a cold generate call (``_profile_shares``)
PROFILED = (("dynamo", "torch/_dynamo/convert_frame.py", "_compile"),  # a frame's tracing, the backend's call in it
            ("aot_autograd", "torch/_functorch/aot_autograd.py", "aot_module_simplified"),  # (our backend in it)
            ("backend_graph", "torch_meganeura/backend/entry.py", "compile_graph_module"),  # partition, wrappers
            ("plans", "torch_meganeura/backend/per_call.py", "_compile"),  # a plan, at a partition's first call:
            ("plans_lowering", "torch_meganeura/backend/device_graph.py", "compile_device_graph"),  # IR, fusion, WGSL
            ("runs", "runtime/program.py", "run"))  # every run: submits and waits (lavapipe compiles at the first)


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
    p.add_argument("--generate", type=int, metavar="N",
                   help="time a language model's first HF generate of N new tokens instead (workloads: smollm2)")
    p.add_argument("--caches", default=",".join(CACHES), help="with --generate: comma-separated, from static, dynamic")
    p.add_argument("--rounds", type=int, default=1, help="processes per cell, alternating; the table gives medians")
    p.add_argument("--profile", action="store_true", help="with --generate: split meganeura's call by cProfile")
    p.add_argument("--child", nargs=2, metavar=("COMPETITOR", "WORKLOAD"), help=argparse.SUPPRESS)
    p.add_argument("--cache", choices=tuple(CACHES), help=argparse.SUPPRESS)
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


def _child_generate(competitor: str, workload_name: str, smoke: bool, new_tokens: int, cache: str,
                    profile: bool) -> dict:
    """One cold first HF ``generate`` in this process (``--generate``); returns what to report."""
    import torch

    from .workloads import WORKLOADS

    workload = WORKLOADS[workload_name]
    torch.manual_seed(0)
    model = workload.build(smoke).float().eval()
    prompt = workload.batch("full", torch.Generator().manual_seed(1), smoke)[0][:, :PROMPT_TOKENS]
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **CACHES[cache])
    if competitor == "meganeura":
        return _first_generate_meganeura(model, prompt, kwargs, profile)
    model, prompt = model.cuda(), prompt.cuda()
    if cache != "static":  # (HF compiles the static cache's forward by itself)
        model.forward = torch.compile(model.forward)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        model.generate(prompt, **kwargs)
    torch.cuda.synchronize()
    return {"first_s": time.perf_counter() - start, "first_cpu_s": time.process_time() - cpu,
            "device": torch.cuda.get_device_name(0)}


def _first_generate_meganeura(model, prompt, kwargs: dict, profile: bool) -> dict:
    """``model.generate`` once with its forward compiled by the backend: the call's wall and CPU time, its plans'
    share, the frames dynamo compiled (and with ``profile``, the call split by ``_profile_shares``)."""
    import cProfile

    import torch

    import torch_meganeura
    from torch_meganeura.backend.entry import BackendContext
    from meganeura.runtime.device import get_device

    records: list = []
    BackendContext.recorders.append(records)
    graphs = torch._dynamo.utils.counters["stats"]
    frames = graphs["unique_graphs"]
    model.forward = torch.compile(model.forward, backend="meganeura")
    profiler = cProfile.Profile() if profile else None
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        if profiler is not None:
            profiler.enable()
        model.generate(prompt, disable_compile=True, **kwargs)
        if profiler is not None:
            profiler.disable()
    first = time.perf_counter() - start
    plans = [r for r in records if not isinstance(r, dict)]
    plans_s = sum(r.compile_seconds for r in plans)
    result = {"first_s": first, "first_cpu_s": time.process_time() - cpu, "plans_s": plans_s,
              "rest_s": first - plans_s, "frames": graphs["unique_graphs"] - frames, "plans": len(plans),
              "kernels": sum(r.kernels for r in plans), "device": get_device().describe(),
              "tree": str(Path(torch_meganeura.__file__).parents[1])}  # (the checkout whose backend ran)
    if profiler is not None:
        result["profile_s"] = _profile_shares(profiler, first)
    return result


def _profile_shares(profiler, total: float) -> dict:
    """The profiled call's seconds by ``PROFILED``'s shares, and "other" (HF's Python, dynamo's guards and wrappers,
    the backend's per-call work): each function's cumulative time less that of the ones called within it.
    cProfile's own cost inflates Python-heavy shares (dynamo's and AOT autograd's tracing) more than the waits."""
    import pstats

    cumulative = dict.fromkeys((name for name, *_ in PROFILED), 0.0)
    for (path, _, function), (_, _, _, cum, _) in pstats.Stats(profiler).stats.items():
        for name, suffix, wanted in PROFILED:
            if function == wanted and path.endswith(suffix):
                cumulative[name] += cum
    shares = {"dynamo": cumulative["dynamo"] - cumulative["aot_autograd"],
              "aot_autograd": cumulative["aot_autograd"] - cumulative["backend_graph"],
              "backend_graph": cumulative["backend_graph"], "plans_lowering": cumulative["plans_lowering"],
              "plans_other": cumulative["plans"] - cumulative["plans_lowering"], "runs": cumulative["runs"]}
    shares["other"] = total - cumulative["dynamo"] - cumulative["plans"] - cumulative["runs"]
    return shares


def _run_child(competitor: str, workload: str, args, scratch: Path, cache: str | None = None) -> dict:
    """One fresh process's cold first call (``cache``: HF generate's KV cache, with ``--generate``)."""
    cache_dir = tempfile.mkdtemp(prefix=f"{competitor}-{workload}-", dir=scratch)
    env = dict(os.environ, MEGANEURA_CACHE_DIR=cache_dir, TORCHINDUCTOR_CACHE_DIR=cache_dir, MEGANEURA_TUNE="0",
               __GL_SHADER_DISK_CACHE="0", MESA_SHADER_CACHE_DISABLE="true")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "bench.cold", "--child", competitor, workload, "--size", args.size,
               *(["--smoke"] if args.smoke else []), *(["--profile"] if args.profile else []),
               *(["--generate", str(args.generate), "--cache", cache] if cache else [])]
    entry = {"workload": workload, "competitor": competitor, "size": args.size, **({"cache": cache} if cache else {})}
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**entry, "error": f"no result within {args.timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        return {**entry, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:2000]}
    return {**entry, **json.loads(lines[-1][len(RESULT):])}


def _label(result: dict) -> str:
    """A table row's name: the workload, and with ``--generate`` the cache."""
    return result["workload"] + (f" generate, {result['cache']} cache" if "cache" in result else "")


def _medians(results: list[dict]) -> dict:
    """One cell's processes as one result: the first error, else each timing's median over the rounds."""
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]
    return {**results[0], **{key: statistics.median(r[key] for r in results)
                             for key in ("first_s", "plans_s", "rest_s", "first_cpu_s") if key in results[0]}}


def _table(results: list[dict]) -> str:
    rows = ["| workload | meganeura first call s | of which plans s | tracing and run s | inductor first call s "
            "| ratio | kernels |", "|---|---|---|---|---|---|---|"]
    cells: dict = {}
    for r in results:
        cells.setdefault((_label(r), r["competitor"]), []).append(r)
    by_key = {key: _medians(runs) for key, runs in cells.items()}
    for label in dict.fromkeys(label for label, _ in cells):
        ours, theirs = by_key.get((label, "meganeura")), by_key.get((label, "torch-cuda-inductor"))
        cells = ["-"] * 6
        if ours is not None:
            cells[:3] = ([f"{ours['first_s']:.2f}", f"{ours['plans_s']:.2f}", f"{ours['rest_s']:.2f}"]
                         if "error" not in ours else [f"error: {ours['error'][:80]}", "-", "-"])
            cells[5] = str(ours.get("kernels", "-"))
        if theirs is not None:
            cells[3] = f"{theirs['first_s']:.2f}" if "error" not in theirs else f"error: {theirs['error'][:80]}"
            if "error" not in theirs and ours is not None and "error" not in ours:
                cells[4] = f"{ours['first_s'] / theirs['first_s']:.2f}"
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        result = (_child_generate(*args.child, args.smoke, args.generate, args.cache, args.profile) if args.generate
                  else _child(*args.child, args.size, args.smoke))
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
    caches = [c for c in args.caches.split(",") if c] if args.generate else [None]
    if set(caches) - {None, *CACHES}:
        _parser().error(f"unknown caches {sorted(set(caches) - set(CACHES))}; choose from {', '.join(CACHES)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="meganeura-cold-") as scratch:
        for _ in range(args.rounds):  # (rounds alternate: a machine's load drifts)
            for workload in workloads:
                for cache in caches:
                    for competitor in competitors:
                        results.append(_run_child(competitor, workload, args, Path(scratch), cache))
                        print(json.dumps(results[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from .run import machine

    note = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "size": args.size, "smoke": args.smoke,
            "generate": args.generate, "rounds": args.rounds, "load_average": os.getloadavg()}
    out.with_suffix(".json").write_text(json.dumps({"machine": machine(), "settings": note, "results": results},
                                                   indent=1))
    out.with_suffix(".md").write_text(
        f"# Cold first calls ({args.size} size{', smoke scale' if args.smoke else ''}, {note['date']})\n\n"
        "Each a fresh process, caches empty or off (bench/cold.py). 'of which plans': meganeura's plans (lowering, "
        "fusion, kernels, parameter uploads); 'tracing and run': the rest of the call (torch's dynamo and AOT "
        "tracing, the first run). Ratio = meganeura / Inductor."
        + (f" Medians of {args.rounds} rounds." if args.rounds > 1 else "") + "\n\n" + _table(results) + "\n")
    print(_table(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
