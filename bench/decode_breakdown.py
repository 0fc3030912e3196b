"""Where a decode token's host time goes with HF ``generate`` through the backend, on the null device.

    python -m bench.decode_breakdown --caches default,static --rounds 5 --json FILE

The model and the calls are ``bench.host``'s decode ones (SmolLM2's config, greedy, a 16-token prompt, the forward
compiled with ``backend="meganeura"``; HF's static cache with its own compile off). A token's CPU time
(``time.thread_time``) is split at the entry points each layer calls the next through, each timed where it is called
(a few calls a token, so the timing adds microseconds):

- ``generate``: the whole call; ``forward``: the compiled forward (dynamo's frame: its guards, the code it made,
  which calls the graph and rebuilds the outputs); ``aot``: what the backend returned to dynamo (aot_autograd's
  runtime wrappers around our compiled function); ``ours``: that function (``entry.compile_graph_module``'s);
  ``partition``: the device partitions' calls in it (``per_call.DevicePartition.forward``); ``program``: their
  programs' runs (``meganeura.runtime.program.Program.run``); ``device``: the device API, here the null device's
  stand-in for wgpu-native (``compute_pass``, ``submit``, ``write``, ``read_staging``), and ``device_in_program``
  the part of it called in a program's run;
- the shares are their differences: HF's own Python (``generate`` less ``forward``: preparing the inputs, the logits
  processors, the stopping criteria, and the cache's bookkeeping outside the graph), dynamo's (``forward`` less
  ``aot``), aot_autograd's (``aot`` less ``ours``), ours (``ours`` less ``device``) and the device's; ours is split
  further into the graph around the partitions (``ours`` less ``partition``: the fx module aot_autograd's graph
  became, its eager ops and the inputs' copies), the per-call path (``partition`` less ``program``: selecting the
  entry, feeding it, putting the outputs together, less the device calls there) and the runtime's replay
  (``program`` less ``device_in_program``);
- ``gc``: the garbage collector's time, wherever it ran (it is inside the shares, not beside them);
- ``window``: the host's time between a program run's last submit and its wait (the read of its staging buffer), or
  its return where it does not wait: time in which a GPU would be working on the step just submitted; ``exposed``,
  the token less its window: the host's time while a GPU would have nothing of the token's to work on (the null
  device's wait is free: on a GPU a token takes about ``exposed`` plus the longer of its GPU time and its window);
  ``ahead``: recording a next step's commands ahead (``Program._record_pending``), in the window where the run
  waits, else at the device's next wait (``InFlight.defer``), before it blocks.

Per token is the difference between ``generate`` of two lengths over the tokens between them (each length warmed
first), as ``bench.host``'s. Each row also gives the graphs dynamo compiled in each warm call (dynamo's
``unique_graphs`` counter) and the guards it runs as Python at each call of each graph (``python_guards``: the
symbolic sizes' relations; its other checks run in C++). ``--guard-rounds N`` adds the guards' time a token, from N
pairs of rounds with them evaluated and skipped (``guard_time``).

``--eager`` adds the same split of eager PyTorch's ``generate`` (no compile): its HF share is HF's own Python
measured without any backend, which the subtraction above must match.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import time
from contextlib import contextmanager

import torch
from torch._dynamo.utils import counters

from .host import HF_CACHES, HOST_THREADS
from .memory import use_null_device
from .workloads import WORKLOADS

TIMED = ("generate", "forward", "aot", "ours", "partition", "program", "device", "device_in_program", "gc", "window",
         "ahead")
CACHES = {"default": HF_CACHES["hf-generate"], "static": HF_CACHES["hf-generate-static"],
          "static-one-length": HF_CACHES["hf-generate-static-one-length"]}
LENGTHS = (8, 40)  # new tokens of the two timed generate calls


class Timers:
    """CPU seconds spent in each timed entry point (``TIMED``), added by ``timed`` wrappers and the gc callback."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.active: collections.Counter = collections.Counter()  # calls of each share under way
        self._gc_start = 0.0
        self._submitted: float | None = None  # when a program run's last submit returned (``window``)

    def timed(self, share: str, function):
        """``function`` with its CPU time added to ``share``."""

        def call(*args, **kwargs):
            start = time.thread_time()
            self.active[share] += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.active[share] -= 1
                spent = time.thread_time() - start
                self.seconds[share] += spent
                if share == "device" and self.active["program"]:
                    self.seconds["device_in_program"] += spent

        call.__dict__.update(getattr(function, "__dict__", {}))  # (``_boxed_call``: aot_autograd reads it)
        return call

    def submitted(self, submit):
        """``submit`` (the device's), which opens the ``window`` when called in a program's run."""

        def call(*args, **kwargs):
            submit(*args, **kwargs)
            if self.active["program"]:
                self._submitted = time.thread_time()

        return call

    def waits(self, read_staging):
        """``read_staging`` (the device's), which closes the ``window`` opened by a submit."""

        def call(*args, **kwargs):
            if self._submitted is not None:
                self.seconds["window"] += time.thread_time() - self._submitted
                self._submitted = None
            return read_staging(*args, **kwargs)

        return call

    def closed(self, run):
        """``run`` (``Program.run``), which closes a window that no wait closed (a run left in flight)."""

        def call(*args, **kwargs):
            try:
                return run(*args, **kwargs)
            finally:
                if self._submitted is not None and not self.active["program"]:
                    self.seconds["window"] += time.thread_time() - self._submitted
                    self._submitted = None

        return call

    def on_gc(self, event: str, _info) -> None:
        if event == "start":
            self._gc_start = time.thread_time()
        else:
            self.seconds["gc"] += time.thread_time() - self._gc_start


@contextmanager
def instrumented(timers: Timers):
    """Time the backend's two layers (what it returns to dynamo, our compiled functions) and the device API while in
    the context (entered before the model compiles: the backend makes its functions then); put back after."""
    import meganeura.runtime.program_recording as recording
    import torch_meganeura.backend.entry as entry
    from helpers.recording_device import RecordingDevice
    from meganeura.runtime.program import Program
    from torch_meganeura.backend.per_call import DevicePartition

    backend, compile_graph_module = entry.backend_with_context, entry.compile_graph_module
    patches = [(entry, "backend_with_context", lambda *a, **k: timers.timed("aot", backend(*a, **k))),
               (entry, "compile_graph_module", lambda *a, **k: timers.timed("ours", compile_graph_module(*a, **k))),
               (DevicePartition, "forward", timers.timed("partition", DevicePartition.forward)),
               (Program, "run", timers.closed(timers.timed("program", Program.run))),
               (Program, "_record_pending", timers.timed("ahead", Program._record_pending)),
               (recording, "compute_pass", timers.timed("device", recording.compute_pass)),
               (RecordingDevice, "submit", timers.submitted(timers.timed("device", RecordingDevice.submit))),
               (RecordingDevice, "read_staging", timers.waits(timers.timed("device", RecordingDevice.read_staging))),
               (RecordingDevice, "write", timers.timed("device", RecordingDevice.write))]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, timed in patches:
        setattr(owner, name, timed)
    gc.callbacks.append(timers.on_gc)
    try:
        yield
    finally:
        gc.callbacks.remove(timers.on_gc)
        for owner, name, original in originals:
            setattr(owner, name, original)


def _generate(model, prompt, cache: dict, timers: Timers, compiled):
    """``generate(n)`` of ``model`` with its forward ``compiled`` (timed as ``forward``), under ``timers``."""
    forward = timers.timed("forward", compiled)

    def run(n: int) -> None:
        with torch.no_grad():
            model.forward = forward
            timers.timed("generate", model.generate)(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                **cache)

    return run


def per_token(run, timers: Timers, rounds: int) -> dict:
    """Median CPU microseconds per token of each timed entry point over ``rounds`` pairs of ``run`` at the two
    ``LENGTHS`` (each after a full collection), their difference over the tokens between."""
    short, long = LENGTHS
    samples = collections.defaultdict(list)
    for _ in range(rounds):
        seconds = {}
        for n in LENGTHS:
            gc.collect()
            timers.seconds.clear()
            run(n)
            seconds[n] = dict(timers.seconds)
        for key in TIMED:
            samples[key].append((seconds[long].get(key, 0.0) - seconds[short].get(key, 0.0)) / (long - short) * 1e6)
    return {key: statistics.median(values) for key, values in samples.items()}


def split(timed: dict) -> dict:
    """The shares (module docstring) from the timed entry points' CPU microseconds per token."""
    return {"total": timed["generate"], "hf": timed["generate"] - timed["forward"],
            "dynamo": timed["forward"] - timed["aot"], "aot_autograd": timed["aot"] - timed["ours"],
            "ours": timed["ours"] - timed["device"], "device": timed["device"], "gc": timed["gc"],
            "ours_runtime": timed["program"] - timed["device_in_program"],
            "ours_per_call": timed["partition"] - timed["program"] - (timed["device"] - timed["device_in_program"]),
            "ours_graph": timed["ours"] - timed["partition"], "window": timed["window"], "ahead": timed["ahead"],
            "exposed": timed["generate"] - timed["window"]}


def guard_time(run, timers: Timers, rounds: int) -> dict:
    """Dynamo's share of a token with its guards evaluated and without (``torch.compiler.set_stance``'s
    ``skip_guard_eval_unsafe``: only the checks that tell its graphs apart), ``rounds`` pairs alternated in this
    process: the guards' CPU microseconds a token, paired against the load's drift between processes."""
    on, off = [], []
    for _ in range(rounds):
        on.append(split(per_token(run, timers, 1))["dynamo"])
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            off.append(split(per_token(run, timers, 1))["dynamo"])
    paired = [a - b for a, b in zip(on, off)]
    return {"dynamo_guards_on": on, "dynamo_guards_off": off, "guard_us_paired": paired,
            "guard_us_median": statistics.median(paired)}


def measure(cache: str, rounds: int, smoke: bool, guard_rounds: int = 0) -> dict:
    """The split of a decode token of HF ``generate`` through the backend with ``cache`` ("default", "static"), or
    eager PyTorch's (``cache`` "eager": the default cache, no compile)."""
    timers = Timers()
    torch.manual_seed(0)
    model = WORKLOADS["smollm2"].build(smoke).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 16))
    torch._dynamo.reset()
    with instrumented(timers):
        compiled = model.forward if cache == "eager" else torch.compile(model.forward, backend="meganeura")
        run = _generate(model, prompt, CACHES.get(cache, {}), timers, compiled)
        graphs = []
        for n in LENGTHS * 2:  # warm: each length's graphs and plans made (``bench.host.WARM_ROUNDS``)
            before = counters["stats"]["unique_graphs"]
            run(n)
            graphs.append(counters["stats"]["unique_graphs"] - before)
        timed = per_token(run, timers, rounds)
        guards = guard_time(run, timers, guard_rounds) if guard_rounds and cache != "eager" else None
    return {"cache": cache, "rounds": rounds, "timed_us": timed, "split_us": split(timed),
            "graphs_per_warm_call": graphs, "python_guards": python_guards(type(model).forward),
            **({"guard_time": guards} if guards else {})}


def python_guards(forward) -> list[int]:
    """The guards dynamo runs as Python (lambdas, not its C++ checks) of each graph it compiled for the function
    ``forward``, newest first (the decode step's, then the prefill's): read from the guard managers' printed trees."""
    return [str(e.guard_manager).count("LAMBDA_GUARD")
            for e in torch._C._dynamo.eval_frame._debug_get_cache_entry_list(forward.__code__)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_breakdown", description=__doc__.split("\n\n")[0])
    p.add_argument("--caches", default="default,static", help=f"comma-separated, from {', '.join(CACHES)}")
    p.add_argument("--rounds", type=int, default=5, help="timed pairs of generate calls per cache")
    p.add_argument("--eager", action="store_true", help="also eager PyTorch's generate (HF's own share alone)")
    p.add_argument("--guard-rounds", type=int, default=0,
                   help="pairs of rounds with dynamo's guards evaluated and skipped (guard_time), after the split")
    p.add_argument("--smoke", action="store_true", help="the model at smoke scale")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    use_null_device()
    torch.set_num_threads(HOST_THREADS)
    rows = []
    for cache in [*args.caches.split(","), *(("eager",) if args.eager else ())]:
        rows.append(measure(cache, args.rounds, args.smoke, args.guard_rounds))
        print(f"{cache}: CPU us a token, medians of {args.rounds}: "
              + ", ".join(f"{k} {v:.0f}" for k, v in rows[-1]["split_us"].items())
              + f"; graphs compiled by warm call {rows[-1]['graphs_per_warm_call']}, Python guards by graph"
              f" {rows[-1]['python_guards']}"
              + (f"; guards {rows[-1]['guard_time']['guard_us_median']:.0f} us a token" if args.guard_rounds else ""),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": list(os.getloadavg()), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
