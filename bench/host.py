"""Host work per training step, measured on the null device: no GPU time, so what is left is the host's.

    python -m bench.host --workloads resnet50,smollm2 --steps 5           # full size
    python -m bench.host --smoke --workloads resnet50 --steps 3
    python -m bench.host --workloads none --decode                        # per decode token: HF vs the bundle
    python -m bench.host --workloads none --inference whisper_tiny,resnet50  # per inference call

Each way (``loop``: ``torch.compile`` + ``keep_on_device(AdamW)``, the ordinary loop; ``resident``:
``compile_train_step``) trains the workload on a device that allocates, uploads and records like a GPU but computes
nothing (``bench.memory.use_null_device``): the plans, bindings and transfers are those a GPU with the adapter's
limits would get, and a step's wall time is host work only. After the first step (which compiles), each step is
timed, in wall time and in the CPU time of the calling thread (``cpu_us``: what a machine shared with other
processes does not inflate); the last is profiled to count what the per-call path does per step:
- ``interceptions``: calls of our ``__torch_function__`` / ``__torch_dispatch__`` overrides;
- ``wrappers``: tensor wrapper subclasses made (``_make_wrapper_subclass``);
- ``waits``, ``submits`` and bytes up and down, from the device's counters.
The figures go to stdout and, with ``--json``, to a file for bench/results.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import time

import torch

from .cells import Runner
from .memory import use_null_device
from .workloads import WORKLOADS

WAYS = {"loop": "meganeura-loop", "resident": "meganeura-resident"}
MOVED = ("waits", "submits", "bytes_uploaded", "bytes_downloaded")  # the device's counters reported per step
# HF ``generate``'s caches through the backend: its default (dynamic) cache, and its static cache without the
# compile HF would otherwise make of the forward (Inductor's), so that the forward is ours
HF_CACHES = {"hf-generate": {}, "hf-generate-static": {"cache_implementation": "static", "disable_compile": True}}
# and the static cache at one length for every call (HF's ``max_cache_len``: sized for the longest, as a static cache
# is meant to be): at the lengths of each call, the second length made dynamo trace the forward again with the cache's
# length symbolic, and every decode step then checked it in guards run as Python (2 to 4 a cache tensor)
STATIC_CACHE_LENGTH = 64  # at least the prompt and the longest generate's new tokens
HF_CACHES["hf-generate-static-one-length"] = {**HF_CACHES["hf-generate-static"], "max_cache_len": STATIC_CACHE_LENGTH}
INTERCEPTIONS = ("__torch_function__", "__torch_dispatch__", "_torch_function")  # (device_tensor's override)
# torch's CPU ops (HF's logits processors over the 49,152 logits of a decode token) in one thread: on a machine shared
# with other processes, the threads of a parallel op wait for each other to be scheduled, which made those ops
# 30-80x slower (5-10 ms each, measured on 2 shared cores) and the host time per token mostly that wait
HOST_THREADS = 1
# Untimed generate calls of each length before the timed ones. HF's static cache is as long as the prompt and the new
# tokens: the second length makes dynamo trace the forward again with that length symbolic, and the third call (the
# first length again) may compile a plan of its own; timing it (the second call of a length) counted that compile in
# the tokens between the lengths (58 ms a token instead of 5.7, measured).
WARM_ROUNDS = 2


def call_counts(profile: cProfile.Profile) -> dict[str, int]:
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
    micros, cpu_micros = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.thread_time()
        runner.step()
        micros.append((time.perf_counter() - start) * 1e6)
        cpu_micros.append((time.thread_time() - cpu_start) * 1e6)
    counters = get_device().counters
    before = counters.snapshot()
    profile = cProfile.Profile()
    profile.enable()
    runner.step()
    profile.disable()
    after = counters.snapshot()
    moved = {key: after[key] - before[key] for key in MOVED}
    return {"workload": name, "way": way, "host_us": micros, "median_us": statistics.median(micros),
            "cpu_us": cpu_micros, "median_cpu_us": statistics.median(cpu_micros),
            "parameters": sum(1 for _ in base.parameters()), **call_counts(profile), **moved}


def measure_inference(name: str, mode: str, calls: int, smoke: bool) -> dict:
    """Host microseconds of an inference call (``mode`` "inference" or "latency", as the benchmark's cells call it:
    the output not read, then ``Device.synchronize``) after warm calls, with the counts of the last ``calls``."""
    from meganeura.runtime.device import get_device

    workload = WORKLOADS[name]
    torch.manual_seed(0)
    base = workload.build(smoke)
    batch = workload.batch("full" if mode == "inference" else "minimal", torch.Generator().manual_seed(0), smoke)
    torch._dynamo.reset()
    runner = Runner("meganeura", workload, base, mode, batch)
    runner.first_call()
    for _ in range(3):  # (the first reads back what the gate read; the next ones leave their outputs on the device)
        runner.step()
    counters = get_device().counters
    before, micros, cpu_micros = counters.snapshot(), [], []
    for _ in range(calls):
        start, cpu_start = time.perf_counter(), time.thread_time()
        runner.step()
        micros.append((time.perf_counter() - start) * 1e6)
        cpu_micros.append((time.thread_time() - cpu_start) * 1e6)
    after = counters.snapshot()
    return {"workload": name, "way": mode, "host_us": micros, "median_us": statistics.median(micros),
            "cpu_us": cpu_micros, "median_cpu_us": statistics.median(cpu_micros),
            **{key: (after[key] - before[key]) / calls for key in MOVED}}


def _per_token(generate, short: int, long: int) -> dict:
    """Host microseconds per decode token: ``generate(n)`` timed at two lengths (each warmed at its own length,
    ``WARM_ROUNDS``), the difference over the tokens between them, so that the prompt's prefill cancels out; each
    timed call after a full garbage collection (one of this process's, about 0.5 s, would otherwise land in one of
    them now and then, and add 16 ms to each of the 32 tokens between). Both the wall time
    (``per_token_us``) and the process's CPU time (``per_token_cpu_us``): on a machine shared with other work, the
    wall time counts the time the process waited for a core, the CPU time only what it ran."""
    wall, cpu = {}, {}
    for n in (short, long) * WARM_ROUNDS:  # untimed
        generate(n)
    for n in (short, long):
        gc.collect()
        start, start_cpu = time.perf_counter(), time.process_time()
        generate(n)
        wall[n], cpu[n] = time.perf_counter() - start, time.process_time() - start_cpu
    per = (long - short) / 1e6
    return {"per_token_us": (wall[long] - wall[short]) / per, "per_token_cpu_us": (cpu[long] - cpu[short]) / per}


def _counts_per_token(generate, short: int, long: int) -> dict:
    """Per decode token, the counts of ``measure``'s step (interceptions, wrappers, waits, submits, bytes up and
    down): ``generate(n)`` profiled at two lengths (warm), the difference over the tokens between them."""
    from meganeura.runtime.device import get_device

    counters, counts = get_device().counters, {}
    for n in (short, long):
        before = counters.snapshot()
        profile = cProfile.Profile()
        profile.enable()
        generate(n)
        profile.disable()
        after = counters.snapshot()
        counts[n] = {**call_counts(profile), **{key: after[key] - before[key] for key in MOVED}}
    return {key: (counts[long][key] - counts[short][key]) / (long - short) for key in counts[long]}


def measure_decode(smoke: bool, short: int = 8, long: int = 40) -> list[dict]:
    """Host us per decode token of SmolLM2's config (greedy, a 16-token prompt): HF ``generate`` through the
    backend with its default cache (``hf-generate``) and with the static cache (``hf-generate-static``, HF's own
    compile of it off), and the torch-free generation bundle (``export_lm``): its decode steps run ahead of the reads
    of their tokens (``bundle``, ``meganeura.runtime.run_ahead``) and read one by one (``bundle-synchronous``,
    ``run_ahead = 1``); each with its counts per token (``_counts_per_token``). The null device computes
    nothing: every token is 0, which HF is kept from stopping at (``min_new_tokens``) and the bundle too."""
    import tempfile

    import torch_meganeura
    from meganeura.runtime import load

    torch.manual_seed(0)
    model = WORKLOADS["smollm2"].build(smoke).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 16))
    rows, forward = [], model.forward
    for way, cache in HF_CACHES.items():
        torch._dynamo.reset()  # (each cache's graphs count towards dynamo's recompile limit of the forward's frame)
        compiled = torch.compile(forward, backend="meganeura")

        def hf(n, cache=cache, compiled=compiled):
            with torch.no_grad():
                model.forward = compiled
                model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, **cache)

        rows.append({"workload": "smollm2", "way": way, **_per_token(hf, short, long),
                     **_counts_per_token(hf, short, long)})
    with tempfile.TemporaryDirectory() as folder:
        torch_meganeura.export_lm(model, f"{folder}/lm", max_cache_len=long + 32)
        lm = load(f"{folder}/lm")
        ids = prompt[0].numpy()
        bundle = lambda n: lm.generate(ids, n, eos_token_id=-1)  # noqa: E731
        for way, ahead in (("bundle", lm.run_ahead), ("bundle-synchronous", 1)):
            lm.run_ahead = ahead
            rows.append({"workload": "smollm2", "way": way, **_per_token(bundle, short, long),
                         **_counts_per_token(bundle, short, long)})
    return rows


def _print_decode(decode: list[dict]) -> None:
    bundle = next(row for row in decode if row["way"] == "bundle")
    print("smollm2 decode, host us per token (wall, CPU; each against the bundle's):", flush=True)
    for row in decode:
        print(f"  {row['way']}: {row['per_token_us']:.0f} wall ({row['per_token_us'] / bundle['per_token_us']:.2f}), "
              f"{row['per_token_cpu_us']:.0f} CPU ({row['per_token_cpu_us'] / bundle['per_token_cpu_us']:.2f}); "
              + ", ".join(f"{row[k]:g} {k}" for k in ("interceptions", "wrappers", *MOVED)), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="resnet50,smollm2", help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, from {', '.join(WAYS)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per way, after two untimed")
    p.add_argument("--smoke", action="store_true", help="the workloads at smoke scale")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--decode", action="store_true", help="also host us per decode token: HF generate through the "
                                                         "backend against the generation bundle (SmolLM2's config)")
    p.add_argument("--inference", default="", help="also host us per inference call of these workloads "
                                                   "(comma-separated), in inference and latency mode")
    args = p.parse_args(argv)
    use_null_device()
    torch.set_num_threads(HOST_THREADS)
    rows = []
    if args.decode:
        decode = measure_decode(args.smoke)
        rows += decode
        _print_decode(decode)
    for name in [w for w in args.inference.split(",") if w]:
        for mode in ("inference", "latency"):
            row = measure_inference(name, mode, args.steps, args.smoke)
            rows.append(row)
            print(f"{name} {mode}: host {row['median_us']:.0f} us/call, {row['median_cpu_us']:.0f} CPU us/call "
                  f"(medians of {args.steps}); per call: " + ", ".join(f"{row[k]:g} {k}" for k in MOVED), flush=True)
    for name in [w for w in args.workloads.split(",") if w != "none"]:
        for way in args.ways.split(","):
            row = measure(name, way, args.steps, args.smoke)
            rows.append(row)
            print(f"{name} {way}: host {row['median_us']:.0f} us/step, {row['median_cpu_us']:.0f} CPU us/step "
                  f"(medians of {args.steps}), "
                  f"{row['interceptions']} interceptions, {row['wrappers']} wrappers, {row['waits']} waits, "
                  f"{row['submits']} submits, {row['bytes_uploaded']} B up, {row['bytes_downloaded']} B down "
                  f"({row['parameters']} parameters)", flush=True)
        ways = {r["way"]: r for r in rows if r["workload"] == name}
        if len(ways) == 2:
            print(f"{name}: loop / resident host time {ways['loop']['median_us'] / ways['resident']['median_us']:.2f}, "
                  f"CPU time {ways['loop']['median_cpu_us'] / ways['resident']['median_cpu_us']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
