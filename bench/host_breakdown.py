"""Where the ordinary loop's host time per step goes, on the null device (or a GPU): torch's work against ours.

    python -m bench.host_breakdown --workloads resnet50,smollm2 --steps 30 --samples 1500 --json FILE
    python -m bench.host_breakdown --device gpu --workloads sd_unet --steps 30     # on the adapter's device

The loop is ``bench.host``'s (``torch.compile`` + ``keep_on_device(AdamW)``, the same ``Runner``). Each phase of a
step is timed in the calling thread's CPU time (``time.thread_time``): ``opt.zero_grad()``, ``compiled(*batch)``,
``loss.backward()``, ``opt.step()`` and the final ``Device.synchronize`` (ours); ``all`` is their sum. Inside each,
three shares are timed at a few entry points (a few calls a step, so the timing adds microseconds):

- ``ours``: the backend's compiled functions (what ``entry.compile_graph_module`` returns; aot_autograd's wrappers
  call them), the kept optimizer's update (``_DeviceStep._update``, inside torch's ``step`` wrapper) and its
  ``zero_grad``, less the device API calls made inside them;
- ``device``: the device API, here the null device's stand-in for wgpu-native: compute passes recorded
  (``native.compute_pass``), submits and uploads (``RecordingDevice.submit`` and ``write``);
- ``torch``: the rest of the phase: dynamo's guards and frame, aot_autograd's runtime wrappers, the autograd
  engine, the optimizer's ``step`` wrapper, and the garbage collector where it runs in them.

``to_last_submit`` is the step less its final wait (``sync``): the host's path to the last submit, which a GPU
cannot shorten (it has the step's work only once it is submitted); what the host does at the wait (the runs recorded
ahead, ``InFlight.defer``) runs while a GPU works through the step.

The same workload's resident step (``compile_train_step``) is then timed in the same process, under the same load:
the loop over it is issue 50's gate, and (torch's share + the device's) over it what the loop would take with no
work of ours at all.

Each phase's wall time is taken beside its CPU time. On the null device they differ only by what other processes
took of the cores. With ``--device gpu`` the loop and the resident step run on the adapter's device (a GPU, or
lavapipe): the sync's wall less its CPU time is then the host blocked on the GPU, and the loop's wall per step
against the resident step's (``loop_over_resident_wall``, the GPU gate's ratio) says how much of the host's work
the GPU waited for.

With ``--samples N``, N more steps run under a sampling profiler (``signal.setitimer``'s CPU-time timer), which
charges each sample to the module of the innermost Python frame (``classify``; code made at run time, to its
caller's), garbage collection apart: the split of torch's share (guards, aot_autograd, autograd) and of ours by
module. A sample that lands in C code is charged to the Python frame that runs next (CPython handles signals between
bytecodes): dynamo's guards, evaluated in C++, are charged to its epilogue guard, a Python function of
``torch._dynamo``, and a long copy to the next call.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import signal
import statistics
import time
from contextlib import contextmanager

import torch

from .cells import Runner
from .host import HOST_THREADS, WAYS
from .memory import use_null_device
from .workloads import WORKLOADS

PHASES = ("zero_grad", "forward", "backward", "step", "sync")
SAMPLE_PERIOD_S = 0.0002  # asked of the timer; the kernel's tick (often 4 ms) may space the samples further
# (path fragment, category) in order, the first that a frame's file name holds
CATEGORIES = (("torch/_dynamo", "torch: dynamo (frame, guards)"), ("torch/_functorch", "torch: aot_autograd"),
              ("torch/autograd", "torch: autograd"), ("torch/optim", "torch: optimizer"),
              ("torch/nn", "torch: nn.Module calls"), ("site-packages/torch/", "torch: other"),
              ("site-packages/transformers/", "transformers"), ("recording_device", "device (null)"),
              ("torch_meganeura/backend/", "ours: backend"), ("torch_meganeura/training/", "ours: training"),
              ("torch_meganeura/tensors/", "ours: tensors"), ("torch_meganeura/", "ours: other"),
              ("/runtime/native", "ours: runtime native"), ("/runtime/", "ours: runtime"))


class Shares:
    """CPU seconds of the current step by phase and share (``ours``, ``device``), added by ``timed`` wrappers."""

    def __init__(self):
        self.phase = None
        self.seconds: collections.Counter = collections.Counter()

    def timed(self, share: str, function):
        """``function`` with its CPU time added to ``share`` of the current phase."""

        def call(*args, **kwargs):
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[self.phase, share] += time.thread_time() - start

        call.__dict__.update(getattr(function, "__dict__", {}))  # (``_boxed_call``: aot_autograd reads it)
        return call

    @contextmanager
    def within(self, phase: str):
        self.phase, start, wall = phase, time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase, "total"] += time.thread_time() - start
            self.seconds[phase, "wall"] += time.perf_counter() - wall
            self.phase = None


@contextmanager
def instrumented(shares: Shares, null: bool = True):
    """Time our compiled functions, the kept optimizer's update and zero_grad, and the device API (the null
    device's, or with ``null`` False the wgpu device's), while in the context (entered before the model compiles:
    the backend makes its compiled functions then); put back after."""
    import meganeura.runtime.program_recording as recording
    import torch_meganeura.backend.entry as entry
    import torch_meganeura.training.keep_on_device as kept
    from meganeura.runtime.device import Device as WgpuDevice

    if null:
        from helpers.recording_device import RecordingDevice
    Device = RecordingDevice if null else WgpuDevice
    compile_graph_module = entry.compile_graph_module
    patches = [(entry, "compile_graph_module", lambda *a, **k: shares.timed("ours", compile_graph_module(*a, **k))),
               (kept._DeviceStep, "_update", shares.timed("ours", kept._DeviceStep._update)),
               (kept, "_kept_zero_grad", shares.timed("ours", kept._kept_zero_grad)),
               (recording, "compute_pass", shares.timed("device", recording.compute_pass)),
               (Device, "submit", shares.timed("device", Device.submit)),
               (Device, "write", shares.timed("device", Device.write))]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, timed in patches:
        setattr(owner, name, timed)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def loop_step(runner: Runner, shares: Shares) -> None:
    """One step of the loop, phase by phase (``bench.cells.Runner.step``'s)."""
    with shares.within("zero_grad"):
        runner.optimizer.zero_grad(set_to_none=True)
    with shares.within("forward"):
        loss = runner.fn(*runner.batch)
    with shares.within("backward"):
        loss.backward()
    with shares.within("step"):
        runner.optimizer.step()
    with shares.within("sync"):
        shares.timed("ours", runner.sync)()  # (the runtime's wait for the runs in flight)


def classify(path: str) -> str:
    for fragment, category in CATEGORIES:
        if fragment in path:
            return category
    return "other"


class Sampler:
    """Samples by phase and ``classify``'s category of the innermost Python frame; garbage collection apart."""

    def __init__(self, shares: Shares):
        self.shares, self.counts, self.collecting = shares, collections.Counter(), False

    def _on_gc(self, event: str, _info) -> None:
        self.collecting = event == "start"

    def _on_signal(self, _signum, frame) -> None:
        while frame.f_back is not None and frame.f_code.co_filename.startswith("<"):  # (code made at run time:
            frame = frame.f_back  # dynamo's guard, a dataclass's __init__, an fx graph's forward: its caller's)
        where = "garbage collection" if self.collecting else classify(frame.f_code.co_filename)
        self.counts[self.shares.phase, where] += 1

    @contextmanager
    def sampling(self):
        gc.callbacks.append(self._on_gc)
        previous = signal.signal(signal.SIGPROF, self._on_signal)
        signal.setitimer(signal.ITIMER_PROF, SAMPLE_PERIOD_S, SAMPLE_PERIOD_S)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0, 0)
            signal.signal(signal.SIGPROF, previous)
            gc.callbacks.remove(self._on_gc)


def measure(name: str, steps: int, samples: int, smoke: bool, null: bool = True) -> dict:
    """Median microseconds per step of each phase and share, and (``samples`` steps) each phase's split by category,
    scaled to that phase's median. Each phase's wall time beside: on a GPU, the sync's wall less its CPU time is
    the host blocked on the GPU, and a step's wall against the resident step's shows what the GPU waited for."""
    shares = Shares()
    with instrumented(shares, null):
        runner = _warm_runner(name, smoke, shares)
        rows = collections.defaultdict(list)
        for _ in range(steps):
            shares.seconds.clear()
            loop_step(runner, shares)
            for phase in PHASES:
                for share in ("total", "ours", "device", "wall"):
                    rows[phase, share].append(shares.seconds[phase, share] * 1e6)
        phases = {phase: _phase_row(rows, phase) for phase in PHASES}
        sampled = _sampled(runner, shares, samples, phases) if samples else {}
    every = {key: sum(p[key] for p in phases.values()) for key in ("total", "torch", "ours", "device", "wall")}
    resident, resident_wall = _resident_step_us(name, steps, smoke)
    return {"workload": name, "steps": steps, "phases": phases, "all": every, "sampled": sampled,
            "to_last_submit_us": every["total"] - phases["sync"]["total"],
            "resident_step_us": resident, "loop_over_resident": every["total"] / resident,
            "torch_and_device_over_resident": (every["torch"] + every["device"]) / resident,
            "resident_step_wall_us": resident_wall, "loop_over_resident_wall": every["wall"] / resident_wall}


def _resident_step_us(name: str, steps: int, smoke: bool) -> tuple[float, float]:
    """The median CPU and wall microseconds of the same workload's resident step (``compile_train_step``), in this
    process right after the loop: the reference of issue 50's gate, under the same load."""
    workload = WORKLOADS[name]
    torch.manual_seed(0)
    base = workload.build(smoke)
    batch = workload.batch("full", torch.Generator().manual_seed(0), smoke)
    runner = Runner(WAYS["resident"], workload, base, "training", batch)
    runner.first_call()
    runner.step()
    times, walls = [], []
    for _ in range(steps):
        start, wall = time.thread_time(), time.perf_counter()
        runner.step()
        times.append((time.thread_time() - start) * 1e6)
        walls.append((time.perf_counter() - wall) * 1e6)
    return statistics.median(times), statistics.median(walls)


def _warm_runner(name: str, smoke: bool, shares: Shares) -> Runner:
    """The loop's ``Runner`` of workload ``name`` after its first call (which compiles) and two steps."""
    workload = WORKLOADS[name]
    torch.manual_seed(0)
    base = workload.build(smoke)
    batch = workload.batch("full", torch.Generator().manual_seed(0), smoke)
    torch._dynamo.reset()
    runner = Runner(WAYS["loop"], workload, base, "training", batch)
    runner.first_call()
    for _ in range(2):
        loop_step(runner, shares)
    return runner


def _phase_row(rows: dict, phase: str) -> dict:
    """A phase's median total, device and ours (less the device calls in it) microseconds; torch's the rest."""
    total, ours, device, wall = (statistics.median(rows[phase, share])
                                 for share in ("total", "ours", "device", "wall"))
    return {"total": total, "torch": total - ours, "ours": ours - device, "device": device, "wall": wall}


def _sampled(runner: Runner, shares: Shares, steps: int, phases: dict) -> dict:
    sampler = Sampler(shares)
    with sampler.sampling():
        for _ in range(steps):
            loop_step(runner, shares)
    by_phase = collections.Counter()
    for (phase, _), n in sampler.counts.items():
        by_phase[phase] += n
    split = collections.defaultdict(dict)
    for (phase, where), n in sorted(sampler.counts.items(), key=lambda item: -item[1]):
        if phase is not None:
            split[phase][where] = phases[phase]["total"] * n / by_phase[phase]
    return {"samples": sum(by_phase.values()), "us_by_phase_and_category": dict(split)}


def _print(row: dict) -> None:
    print(f"{row['workload']}: median us per step, {row['steps']} steps")
    print(f"  {'phase':10s} {'total':>8s} {'torch':>8s} {'ours':>8s} {'device':>8s} {'wall':>8s}")
    for phase, p in (*row["phases"].items(), ("all", row["all"])):
        print(f"  {phase:10s} {p['total']:8.0f} {p['torch']:8.0f} {p['ours']:8.0f} {p['device']:8.0f} "
              f"{p['wall']:8.0f}")
    print(f"  to the last submit {row['to_last_submit_us']:.0f} us")
    print(f"  resident step {row['resident_step_us']:.0f} us: loop / resident {row['loop_over_resident']:.2f}, "
          f"(torch's + device) / resident {row['torch_and_device_over_resident']:.2f}; wall: resident step "
          f"{row['resident_step_wall_us']:.0f} us, loop / resident {row['loop_over_resident_wall']:.2f}")
    for phase, split in row["sampled"].get("us_by_phase_and_category", {}).items():
        print(f"  sampled {phase}: " + ", ".join(f"{where} {us:.0f}" for where, us in split.items() if us >= 10))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="resnet50,smollm2", help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--steps", type=int, default=30, help="timed steps, after two untimed")
    p.add_argument("--samples", type=int, default=0, help="steps sampled after them (0: none)")
    p.add_argument("--smoke", action="store_true", help="the workloads at smoke scale")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--device", choices=("null", "gpu"), default="null",
                   help="the null device (host work only), or the adapter's (a GPU: the wall times show the waits)")
    args = p.parse_args(argv)
    if args.device == "null":
        use_null_device()
    torch.set_num_threads(HOST_THREADS)
    rows = []
    for name in args.workloads.split(","):
        rows.append(measure(name, args.steps, args.samples, args.smoke, null=args.device == "null"))
        _print(rows[-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
