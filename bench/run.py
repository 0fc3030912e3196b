"""``python -m bench``: run the workloads and micro benchmarks, write one JSON file per machine, and its report.

The JSON (``bench/results/<tag>.json``) holds the machine (CPU, adapter, CUDA device, library versions, TF32
setting), the settings, every cell with every sample, and the micro results; ``bench.report`` makes the markdown
table and the PNG plot from it. Timings are f32 with TF32 off; with ``--dtypes`` the latency and inference cells are
also measured with the models in bfloat16 and/or float16 (each dtype's cells gated at that dtype, see ``cells``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _parser() -> argparse.ArgumentParser:
    from .cells import COMPETITORS, DTYPES, HALF_COMPETITORS, HALF_MODES, MODES
    from .turns import RUN_LENGTH
    from .workloads import WORKLOADS

    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", required=True, help="results name: bench/results/TAG.json (e.g. cpu-lavapipe, h200)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, from {', '.join(WORKLOADS)} (default: all); 'none' for micro only")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--competitors", default=None,
                   help=f"comma-separated, from {', '.join(COMPETITORS)} (default: the CPU ones, and the CUDA ones "
                        "when CUDA is present)")
    p.add_argument("--dtypes", default="float32",
                   help=f"comma-separated, from {', '.join(DTYPES)} (default: float32). Half dtypes run the "
                        f"{' and '.join(HALF_MODES)} modes with {', '.join(HALF_COMPETITORS)}, models and float inputs "
                        "cast with .to(dtype), each gated within 1.5x eager's own error at that dtype")
    p.add_argument("--smoke", action="store_true",
                   help="smoke scale: every workload shrunk (same architectures) to check the path, not to time it")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per competitor before timing (>= 1)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per competitor")
    p.add_argument("--run-length", type=int, default=RUN_LENGTH,
                   help="timed calls per competitor in a row; competitors take turns, each turn starting with an "
                        "untimed call (a GPU shared by CUDA and Vulkan pays a context switch on the first call after "
                        "the other API's)")
    p.add_argument("--recompile", action="store_true",
                   help="also time a second compile of each training step after torch._dynamo.reset (warm caches)")
    p.add_argument("--profile", type=int, default=0, metavar="CALLS",
                   help="after timing, run each meganeura cell CALLS more times under the GPU profiler and report "
                        "its top kernels (profiled calls are not timed)")
    p.add_argument("--tune", action="store_true",
                   help="meganeura compiles with tuned matmul variants (MEGANEURA_TUNE=1), the micro benchmarks too: "
                        "the first call of a workload then includes timing its new GEMM shapes, remembered for later "
                        "calls")
    p.add_argument("--micro", action="store_true", help="also run the micro benchmarks")
    p.add_argument("--matmul-sizes", default="1024,2048,4096", help="micro: square matmul sizes")
    p.add_argument("--stream-mib", type=int, default=256,
                   help="micro: size of the pointwise/copy/reduction input (0: none of them, nor the dispatch chain)")
    p.add_argument("--attention-shapes", default="6x1500x64,8x2048x128c",
                   help="micro: f32 self-attentions HEADSxLENGTHxHEADSIZE, a final 'c' for causal; '' for none")
    p.add_argument("--projections", default=None,
                   help="micro: projections F.linear(x, w), x MxK and w NxK, as MxKxN comma-separated (default: "
                        "decode's and a prefill's at SmolLM2-135M's and Llama-3.2-1B's sizes; '' for none)")
    p.add_argument("--projection-dtypes", default="float32,bfloat16", help="micro: the projections' dtypes")
    p.add_argument("--note", default="", help="a remark on the conditions of this run, shown in the report")
    p.add_argument("--merge", action="store_true",
                   help="add to an existing results file (cells of the same workload, mode and competitor "
                        "are replaced)")
    return p


def machine() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "versions": {}, "tf32": {"cuda_matmul": False, "cudnn": False}}
    for package in ("torch", "torch-meganeura", "wgpu", "numpy", "transformers", "diffusers"):
        try:
            info["versions"][package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info["versions"][package] = None
    try:
        from meganeura.runtime.device import get_device

        dev = get_device()
        info["adapter"] = {"name": dev.name, "type": dev.adapter_type, "backend": dev.backend,
                           "info": {k: str(v) for k, v in dev.adapter.info.items()}}
    except Exception as err:  # noqa: BLE001 - recorded: the meganeura cells will report the same error
        info["adapter"] = {"error": str(err)}
    info["cuda_device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    info["torch_threads"] = torch.get_num_threads()
    return info


def _strict_f32() -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-inductor-"))  # cold compiles
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="bench-triton-"))
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    if args.tune:
        os.environ["MEGANEURA_TUNE"] = "1"
    import torch

    from . import cells, micro, report
    from .workloads import WORKLOADS

    _strict_f32()
    if args.warmup < 1:
        raise SystemExit("--warmup must be at least 1")
    if args.run_length < 1:
        raise SystemExit("--run-length must be at least 1")
    if args.competitors:
        competitors = args.competitors.split(",")
    else:
        competitors = ["meganeura", "meganeura-resident", "torch-cpu-eager"]
        if torch.cuda.is_available():
            competitors += ["torch-cuda-eager", "torch-cuda-inductor"]
    unknown = set(competitors) - set(cells.COMPETITORS)
    if unknown:
        raise SystemExit(f"unknown competitors {sorted(unknown)}; choose from {cells.COMPETITORS}")
    workloads = [] if args.workloads == "none" else args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    modes = args.modes.split(",")
    if set(modes) - set(cells.MODES):
        raise SystemExit(f"unknown modes {sorted(set(modes) - set(cells.MODES))}; choose from {cells.MODES}")
    dtypes = args.dtypes.split(",")
    if set(dtypes) - set(cells.DTYPES):
        raise SystemExit(f"unknown dtypes {sorted(set(dtypes) - set(cells.DTYPES))}; choose from {list(cells.DTYPES)}")
    runs = [(mode, dtype) for mode in modes for dtype in dtypes if dtype == "float32" or mode in cells.HALF_MODES]
    skipped = sorted({f"{mode} in {dtype}" for mode in modes for dtype in dtypes} - {f"{m} in {d}" for m, d in runs})
    if skipped:
        print(f"not measured (half dtypes run {', '.join(cells.HALF_MODES)} only): {', '.join(skipped)}", flush=True)

    path = RESULTS / f"{args.tag}.json"
    result = json.loads(path.read_text()) if args.merge and path.exists() else {"cells": [], "micro": [],
                                                                                   "recompile": []}
    result["machine"] = machine()
    result["settings"] = {"warmup": args.warmup, "repeats": args.repeats, "run_length": args.run_length,
                          "competitors": competitors, "dtypes": dtypes,
                          "scale": "smoke" if args.smoke else "full", "note": args.note,
                          "tuned": args.tune, "device_batch": True}
    print(f"adapter: {result['machine'].get('adapter')}; CUDA: {result['machine']['cuda_device']}", flush=True)
    for name in workloads:
        for mode, dtype in runs:
            done = cells.measure(WORKLOADS[name], mode, competitors, args.warmup, args.repeats, args.smoke,
                                 profile_calls=args.profile, run_length=args.run_length, dtype=dtype)
            result["cells"] = [c for c in result["cells"]
                               if (c["workload"], c["mode"], c.get("dtype", "float32")) != (name, mode, dtype)
                               or c["competitor"] not in competitors]
            result["cells"] += [dataclasses.asdict(c) for c in done]
            for c in done:
                _print_cell(c)
            _write(path, result)
        if args.recompile and "training" in modes:
            result["recompile"] = [r for r in result["recompile"] if r["workload"] != name]
            for competitor in competitors:
                if competitor in ("meganeura", "torch-cuda-inductor"):
                    seconds = cells.recompile(WORKLOADS[name], competitor, args.smoke)
                    result["recompile"].append({"workload": name, "competitor": competitor, "seconds": seconds})
                    print(f"{name:15s} recompile  {competitor:20s} {seconds:8.2f} s", flush=True)
            _write(path, result)
    if args.micro:
        sizes = [int(n) for n in args.matmul_sizes.split(",") if n]
        micro_competitors = [c for c in competitors if c in micro.COMPETITORS]
        projections = (micro.PROJECTIONS if args.projections is None else
                       micro.parse_projections(args.projections))
        done = micro.run_all(micro_competitors, sizes, args.stream_mib, args.warmup, args.repeats,
                             args.run_length, micro.parse_attention_shapes(args.attention_shapes), projections,
                             tuple(filter(None, args.projection_dtypes.split(","))))
        result["micro"] = [dataclasses.asdict(m) for m in done]
        for m in done:
            rate = f"{m.rate:10.1f} {m.work}" if m.rate is not None else m.error
            print(f"{m.name:32s} {m.competitor:20s} {m.median_ms or 0:9.3f} ms {rate}", flush=True)
        _write(path, result)
    report.write(path)
    print(f"wrote {path} and its report", flush=True)
    return 0


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def _print_cell(c) -> None:
    what = f"{c.workload:15s} {c.mode:9s} {c.dtype:8s} {c.competitor:20s}"
    if c.error:
        print(f"{what} ERROR {c.error[:300]}", flush=True)
        return
    gate = "ok" if c.gate and c.gate["passed"] else f"GATE FAILED {c.gate and c.gate['reason']}"
    print(f"{what} {c.median_ms:10.2f} ms  first call {c.compile_s:7.2f} s  {gate}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
