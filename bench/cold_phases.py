"""Where a cold first HF ``generate`` through the backend spends its CPU time, phase by phase, on the null device.

    python -m bench.cold_phases --cache static --layers 30 --tokens 64 --json FILE

One process, one cold call: SmolLM2's config (``bench.workloads``; ``--layers`` shrinks its depth to see what grows
per layer), random weights, greedy, a 16-token prompt, ``model.forward`` compiled with ``backend="meganeura"`` (HF's
own compile off for the static cache). The device is the null device (``bench.memory.use_null_device``): nothing
is computed or compiled by a driver, so what is left is the host's work. Each phase is an entry point timed where it
is called, its CPU time (``time.thread_time``) inclusive of the phases inside it (a few calls a graph, so the timing
adds microseconds):

- ``generate``: the whole call; ``dynamo``: dynamo's frame compiles (``convert_frame._compile``), which hold
  ``aot_autograd`` (``aot_module_simplified``): its fake inputs (``aot_inputs``), the metadata run (``aot_metadata``),
  the traced graph with the decompositions (``aot_trace``), the compile step (``aot_compile``) that calls ours,
  ``ours_graph`` (``entry.compile_graph_module``: the partitions, ``partition``, and the wrappers);
- ``ours_plans``: each device partition's plan at its first call (``DevicePartition._compile``): ``lowering`` (aten to
  the IR), ``plan_key`` (the plan cache's fingerprint), ``fusion`` (``meganeura.lowering.fuse_graph``; in a tree
  without it, ``compile_graph`` less ``schedule``),
  ``schedule`` (memory plan and dispatches) with ``kernels`` (the WGSL generated in it), and ``params`` (the weights'
  device copies: on the null device a copy into host memory, ``device_writes``);
- ``runs``: the programs' runs (``Program.run``), ``gc``: the garbage collector, wherever it ran.

It also gives the dynamo frames compiled, each plan's kernel keys (the SHA-1 of its WGSL: two trees that generate
the same kernels give the same keys) and the tokens, so that two trees' runs can be checked against each other.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager

import torch

from .memory import use_null_device
from .workloads import WORKLOADS

PROMPT_TOKENS = 16
# torch's own backends beside ours: dynamo alone (its graph run by eager PyTorch), and with aot_autograd (no
# decompositions, the graph run by eager PyTorch): the share of a cold call no backend removes
BACKENDS = ("meganeura", "eager", "aot_eager")
# phases whose calls are also given one by one (a frame, its aot_autograd steps and our graph work, a plan)
EACH = ("dynamo", "aot_autograd", "aot_inputs", "aot_metadata", "aot_trace", "aot_compile", "ours_graph", "ours_plans")
CACHES = {"static": {"cache_implementation": "static", "disable_compile": True}, "default": {}}


class PhaseTimers:
    """CPU seconds of each phase, added by ``timed`` wrappers and the gc callback."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.plans: list[dict] = []
        self.each: dict[str, list[float]] = {}  # the phases of ``EACH``: each call's seconds
        self.stack: list[str] = ["generate"]  # the phases under way, innermost last
        self._gc_start = 0.0

    def timed(self, phase: str, function):
        def call(*args, **kwargs):
            start = time.thread_time()
            self.stack.append(phase)
            try:
                return function(*args, **kwargs)
            finally:
                self.stack.pop()
                spent = time.thread_time() - start
                self.seconds[phase] += spent
                self.calls[phase] += 1
                if phase in EACH:
                    self.each.setdefault(phase, []).append(round(spent, 3))

        call.__dict__.update(getattr(function, "__dict__", {}))
        return call

    def on_gc(self, event: str, info) -> None:
        if event == "start":
            self._gc_start = time.thread_time()
        else:
            spent = time.thread_time() - self._gc_start
            self.seconds["gc"] += spent
            self.seconds[f"gc in {self.stack[-1]}"] += spent
            self.calls[f"gc{info['generation']} in {self.stack[-1]}"] += 1


def _patches(timers: PhaseTimers) -> list[tuple]:
    """(owner, attribute, phase) of each timed entry point, at the name its caller looks it up by."""
    import torch._dynamo.convert_frame as convert_frame
    import torch._dynamo.backends.common as dynamo_common
    import torch._functorch.aot_autograd as aot
    import meganeura.lowering as lowering
    import meganeura.lowering.plan_cache as plan_cache
    import torch_meganeura.backend.device_graph as device_graph
    import torch_meganeura.backend.entry as entry
    import torch_meganeura.lower.tuning as tuning
    from helpers.recording_device import RecordingDevice
    from meganeura.runtime.program import Program
    from torch_meganeura.backend.bound_plan import BoundPlan
    from torch_meganeura.backend.per_call import DevicePartition

    schedule = sys.modules["meganeura.lowering.schedule"]  # (the package's ``schedule`` is its function)
    return [(convert_frame, "_compile", "dynamo"), (dynamo_common, "aot_module_simplified", "aot_autograd"),
            (aot, "prepare_aot_module_simplified", "aot_inputs"), (aot, "create_aot_state", "aot_metadata"),
            (aot, "aot_stage1_graph_capture", "aot_trace"), (aot, "aot_stage2_compile", "aot_compile"),
            (entry, "compile_graph_module", "ours_graph"), (entry, "partition", "partition"),
            (DevicePartition, "_compile", "ours_plans"), (device_graph, "lower_graph", "lowering"),
            (plan_cache, "_key", "plan_key"), (plan_cache, "compile_graph", "compile_graph"),
            (lowering, "schedule", "schedule"), (schedule, "_kernel", "kernels"), (BoundPlan, "bind", "params"),
            (RecordingDevice, "write", "device_writes"), (Program, "run", "runs"),
            *((owner, "fuse_graph", "fusion") for owner in (lowering, tuning) if hasattr(owner, "fuse_graph"))]


@contextmanager
def instrumented(timers: PhaseTimers):
    """The entry points of ``_patches`` timed while in the context, and each new plan's kernel keys noted."""
    import torch_meganeura.backend.per_call as per_call

    patches = _patches(timers)
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, phase in patches:
        setattr(owner, name, timers.timed(phase, getattr(owner, name)))
    makers = [(name, getattr(per_call, name)) for name in ("compile_device_graph", "rescheduled")
              if hasattr(per_call, name)]  # (a tree before ``rescheduled`` has only the first)

    def noted(name, make):
        def call(*args, **kwargs):
            graph = make(*args, **kwargs)
            if graph is not None:
                timers.plans.append({"by": name, "dispatches": len(graph.plan.dispatches),
                                     "kernels": sorted(graph.plan.kernels)})
            return graph
        return call

    for name, make in makers:
        setattr(per_call, name, noted(name, make))
    gc.callbacks.append(timers.on_gc)
    try:
        yield
    finally:
        gc.callbacks.remove(timers.on_gc)
        for name, make in makers:
            setattr(per_call, name, make)
        for owner, name, original in originals:
            setattr(owner, name, original)


def _model(layers: int | None):
    workload = WORKLOADS["smollm2"]
    torch.manual_seed(0)
    model = workload.build(False)
    if layers is not None and layers != model.config.num_hidden_layers:
        config = model.config
        config.num_hidden_layers = layers
        torch.manual_seed(0)
        model = type(model)(config)
    return model.eval()


def measure(cache: str, layers: int | None, tokens: int, backend: str = "meganeura") -> dict:
    """One cold ``generate`` of ``tokens`` new tokens, split into phases (CPU seconds) and ``own`` shares, with the
    forward compiled by ``backend`` (torch's ``eager`` and ``aot_eager`` measure torch's own share alone)."""
    os.environ["MEGANEURA_CACHE_DIR"] = tempfile.mkdtemp(prefix="cold-phases-")  # a new, empty plan cache
    use_null_device()
    model = _model(layers)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    timers = PhaseTimers()
    with instrumented(timers):
        model.forward = torch.compile(model.forward, backend=backend)
        with torch.no_grad():
            out = timers.timed("generate", model.generate)(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, min_new_tokens=tokens,
                do_sample=False, **CACHES[cache])
    from torch._dynamo.utils import counters

    s = timers.seconds
    fusion = s["fusion"] if "fusion" in timers.calls else s["compile_graph"] - s["schedule"]
    own = {"dynamo": s["dynamo"] - s["aot_autograd"], "aot_autograd": s["aot_autograd"] - s["ours_graph"],
           "ours_graph": s["ours_graph"], "ours_plans": s["ours_plans"] - s["device_writes"], "fusion": fusion,
           "device_writes": s["device_writes"], "rest": s["generate"] - s["dynamo"] - s["ours_plans"]}
    return {"backend": backend, "cache": cache, "layers": model.config.num_hidden_layers, "tokens": tokens,
            "seconds": dict(s), "calls": dict(timers.calls), "each": timers.each, "own": own,
            "frames": dict(counters["frames"]), "recompiles": dict(counters.get("recompiles", {})),
            "plans": timers.plans, "generated": out[0].tolist(), "load": os.getloadavg()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cold_phases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", choices=tuple(CACHES), default="static")
    p.add_argument("--layers", type=int, default=None, help="the model's depth (default: its config's, 30)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens")
    p.add_argument("--backend", default="meganeura", choices=BACKENDS, help="what compiles the forward")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    result = measure(args.cache, args.layers, args.tokens, args.backend)
    for phase, seconds in sorted(result["seconds"].items(), key=lambda kv: -kv[1]):
        print(f"{phase:16s} {seconds:8.3f} s  ({result['calls'].get(phase, 0)} calls)")
    print("own:", {k: round(v, 3) for k, v in result["own"].items()})
    print("frames:", result["frames"], "plans:", [(p["dispatches"], len(p["kernels"])) for p in result["plans"]])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
