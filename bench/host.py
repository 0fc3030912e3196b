"""Host work per training step, measured on the null device: no GPU time, so what is left is the host's.

    python -m bench.host --workloads resnet50,smollm2 --steps 5           # full size
    python -m bench.host --smoke --workloads resnet50 --steps 3

Each way (``loop``: ``torch.compile`` + ``keep_on_device(AdamW)``, the ordinary loop; ``resident``:
``compile_train_step``) trains the workload on a device that allocates, uploads and records like a GPU but computes
nothing (``bench.memory.use_null_device``): the plans, bindings and transfers are those a GPU with the adapter's
limits would get, and a step's wall time is host work only. After the first step (which compiles), each step is
timed; the last is profiled to count what the per-call path does per step:
- ``interceptions``: calls of our ``__torch_function__`` / ``__torch_dispatch__`` overrides;
- ``wrappers``: tensor wrapper subclasses made (``_make_wrapper_subclass``);
- ``waits``, ``submits`` and bytes up and down, from the device's counters.
The figures go to stdout and, with ``--json``, to a file for bench/results.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from .cells import Runner
from .memory import use_null_device
from .workloads import WORKLOADS

WAYS = {"loop": "meganeura-loop", "resident": "meganeura-resident"}
INTERCEPTIONS = ("__torch_function__", "__torch_dispatch__", "_torch_function")  # (device_tensor's override)


def _counts(profile: cProfile.Profile) -> dict[str, int]:
    """Calls of our tensor overrides and of wrapper-subclass construction in a profiled step."""
    stats = pstats.Stats(profile).stats
    interceptions = sum(s[1] for (path, _, name), s in stats.items()
                        if name in INTERCEPTIONS and "torch_meganeura" in path)
    wrappers = sum(s[1] for (_, _, name), s in stats.items() if "_make_wrapper_subclass" in name)
    return {"interceptions": interceptions, "wrappers": wrappers}


def measure(name: str, way: str, steps: int, smoke: bool) -> dict:
    """Host microseconds of each step after the first, and the per-step counts of the last."""
    from meganeura.runtime.device import get_device

    workload = WORKLOADS[name]
    torch.manual_seed(0)
    base = workload.build(smoke)
    batch = workload.batch("full", torch.Generator().manual_seed(0), smoke)
    torch._dynamo.reset()
    runner = Runner(WAYS[way], workload, base, "training", batch)
    runner.first_call()
    runner.step()
    micros = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.step()
        micros.append((time.perf_counter() - start) * 1e6)
    counters = get_device().counters
    before = counters.snapshot()
    profile = cProfile.Profile()
    profile.enable()
    runner.step()
    profile.disable()
    after = counters.snapshot()
    moved = {key: after[key] - before[key] for key in ("waits", "submits", "bytes_uploaded", "bytes_downloaded")}
    return {"workload": name, "way": way, "host_us": micros, "median_us": statistics.median(micros),
            "parameters": sum(1 for _ in base.parameters()), **_counts(profile), **moved}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="resnet50,smollm2", help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, from {', '.join(WAYS)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per way, after two untimed")
    p.add_argument("--smoke", action="store_true", help="the workloads at smoke scale")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    use_null_device()
    rows = []
    for name in args.workloads.split(","):
        for way in args.ways.split(","):
            row = measure(name, way, args.steps, args.smoke)
            rows.append(row)
            print(f"{name} {way}: host {row['median_us']:.0f} us/step (median of {args.steps}), "
                  f"{row['interceptions']} interceptions, {row['wrappers']} wrappers, {row['waits']} waits, "
                  f"{row['submits']} submits, {row['bytes_uploaded']} B up, {row['bytes_downloaded']} B down "
                  f"({row['parameters']} parameters)", flush=True)
        ways = {r["way"]: r for r in rows if r["workload"] == name}
        if len(ways) == 2:
            print(f"{name}: loop / resident host time {ways['loop']['median_us'] / ways['resident']['median_us']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
