"""One workload measured in every mode against every competitor: the cells of the benchmark table.

A cell is (workload, mode, competitor). Modes: ``latency`` (inference at the minimal input), ``inference`` (at the
workload's size), ``training`` (zero_grad + forward + backward + AdamW step, all timed). Compile time is the wall
time of a cell's first call (tracing, compiling and one run); ``recompile`` repeats it after ``torch._dynamo.reset``
on a fresh copy of the model (a warm start where the competitor has an on-disk cache).

Every cell is gated on the same weights and inputs against eager PyTorch on the CPU in float64, with eager f32's own
error as the allowance (see ``gates``): the inference output, or the training loss and every parameter gradient (of
the first step, before any optimizer update), by relative L2 per tensor. A cell that fails its gate keeps its
timings but is marked failed, never reported as a win. ``meganeura-fast`` is the backend with precision "fast"
(f16 products in the forward matmuls), gated at ``FAST_TOLERANCE``.
A cell also has a dtype (``DTYPES``): in bfloat16 or float16 the model and the batch's float tensors are cast with
``.to(dtype)`` (token ids, labels and integer timesteps stay as they are), the float64 reference is that same
half-precision model and batch in float64, and the allowance is ``HALF_FACTOR`` times eager's own error at the dtype.
Half dtypes are measured in latency and inference (``HALF_MODES``) by the competitors that take any model as it is
(``HALF_COMPETITORS``); precision "fast" and the resident training step stay float32.
Inference batches are on the device before the timed calls on both sides (``DEVICE_BATCH``).
Competitors are timed in turns of consecutive calls after a warm-up (``turns``: a call right after the other GPU
API's pays a context switch); both sides are synchronised (a CUDA synchronize; meganeura's ``Device.synchronize``:
an inference call whose last output nobody read returns once submitted, its output staying on the device).
"""
from __future__ import annotations

import copy
import gc
import statistics
import time
from dataclasses import dataclass, field

import torch

from .gates import (EAGER_FACTOR, FAST_TOLERANCE, HALF_FACTOR, HALF_TOLERANCE, TOLERANCE, Gate, gate_gradients,
                    gate_output)
from .turns import RUN_LENGTH, take_turns
from .workloads import Workload

MODES = ("latency", "inference", "training")
COMPETITORS = ("meganeura", "meganeura-fast", "meganeura-resident", "meganeura-loop", "torch-cpu-eager",
               "torch-cuda-eager", "torch-cuda-inductor")
# meganeura-resident: compile_train_step, forward, backward and AdamW in one device plan; meganeura-loop: the ordinary
# loop through the backend with keep_on_device(AdamW)
TRAINING_ONLY = ("meganeura-resident", "meganeura-loop")
# Inference batches put on the device once (``torch_meganeura.to_device``), as CUDA's are moved to the GPU once; the
# training ways take host batches, which each step uploads (the resident step's API takes host tensors)
DEVICE_BATCH = ("meganeura", "meganeura-fast")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HALF_MODES = ("latency", "inference")
HALF_COMPETITORS = ("meganeura", "torch-cpu-eager", "torch-cuda-eager", "torch-cuda-inductor")


@dataclass
class Cell:
    workload: str
    mode: str
    competitor: str
    dtype: str = "float32"  # the model's and the float inputs' dtype, a key of DTYPES
    samples_ms: list[float] = field(default_factory=list)
    median_ms: float | None = None
    compile_s: float | None = None  # first call: trace + compile + one run
    gate: dict | None = None
    dispatches: int | None = None  # meganeura: dispatches per call (forward + backward for training)
    planned_bytes: int | None = None  # meganeura: arena bytes of the plans after lifetime planning
    peak_memory_bytes: int | None = None  # device bytes allocated at peak during the cell
    transfer_bytes_per_call: int | None = None  # meganeura: host<->device bytes per timed call
    gpu_ms_per_call: float | None = None  # meganeura, with --profile: summed kernel time of a call
    top_kernels: list | None = None  # meganeura, with --profile: [{name, ms_per_call, share}] by GPU time
    fallback_ops: list | None = None  # meganeura: ops (or failed partitions) that ran in eager PyTorch instead
    error: str | None = None


class Runner:
    """One competitor's model copy, compiled function, batch and optimizer for one (workload, mode)."""

    def __init__(self, competitor: str, workload: Workload, base: torch.nn.Module, mode: str, batch: tuple):
        self.competitor = competitor
        self.training = mode == "training"
        self.device = "cuda" if competitor.startswith("torch-cuda") else "cpu"
        self.model = copy.deepcopy(base).to(self.device).train(self.training and workload.train_mode)
        self.batch = tuple(t.to(self.device) for t in batch)
        if competitor in DEVICE_BATCH and not self.training:
            from torch_meganeura import to_device

            self.batch = tuple(map(to_device, self.batch))
        what = workload.loss if self.training else workload.output
        model = self.model

        def call(*args):
            return what(model, *args)

        self.resident = None
        if competitor == "meganeura-resident":
            from torch_meganeura import compile_train_step

            self.resident = compile_train_step(self.model, what, torch.optim.AdamW(self.model.parameters(), lr=1e-5))
            self.fn = None
        elif competitor in ("meganeura", "meganeura-fast", "meganeura-loop"):
            options = {"precision": "fast"} if competitor == "meganeura-fast" else {}
            self.fn = torch.compile(call, backend="meganeura", options=options)
        elif competitor == "torch-cuda-inductor":
            self.fn = torch.compile(call, backend="inductor")
        else:
            self.fn = call
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5) if self.training else None
        if competitor == "meganeura-loop":
            from torch_meganeura import keep_on_device

            keep_on_device(self.optimizer)
        if self.resident is not None:
            self.optimizer = self.resident.optimizer

    def sync(self) -> None:
        """Wait for the competitor's device: CUDA's queue, or meganeura's runs in flight (a loop step that reads
        nothing returns once submitted)."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        elif self.competitor.startswith("meganeura"):
            _device().synchronize()

    def first_call(self):
        """The first call (compiles), returning what the gate compares: the output, or (loss, gradients).
        For the resident step the gate reads its gradients (a separate plan, not timed) and the time is that of
        the first real step, which compiles the training plan."""
        if self.resident is not None:
            from torch_meganeura.training.roles import Mode

            loss, grads = self.resident.gradients(*self.batch)
            # The gate's gradient plan is not part of training: released, and the peak-memory window (_Meter) starts
            # again from what is live (the step's parameters and optimizer state stay counted).
            self.resident.release_plans(Mode.GRADS)
            counters = _device().counters
            counters.peak_bytes_allocated = counters.bytes_allocated
            start = time.perf_counter()
            self.resident(*self.batch)
            return time.perf_counter() - start, (loss, grads)
        start = time.perf_counter()
        if self.training:
            loss = self.fn(*self.batch)
            loss.backward()
        else:
            with torch.no_grad():
                out = self.fn(*self.batch)
        self.sync()
        seconds = time.perf_counter() - start
        if self.training:
            grads = {n: p.grad.detach().cpu() for n, p in self.model.named_parameters() if p.grad is not None}
            return seconds, (loss.detach().cpu(), grads)
        return seconds, out.detach().cpu()

    def step(self) -> float:
        """One timed call in milliseconds."""
        start = time.perf_counter()
        if self.resident is not None:
            self.resident(*self.batch)  # the loss comes back to the host: the call is synchronised
        elif self.training:
            self.optimizer.zero_grad(set_to_none=True)
            self.fn(*self.batch).backward()
            self.optimizer.step()
        else:
            with torch.no_grad():
                self.fn(*self.batch)
        self.sync()
        return (time.perf_counter() - start) * 1e3


def cast(batch: tuple, dtype: torch.dtype) -> tuple:
    """The batch with its float tensors in ``dtype``; integer tensors (token ids, labels) as they are."""
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def reference(workload: Workload, base: torch.nn.Module, mode: str, batch: tuple, dtype=torch.float32):
    """Eager PyTorch on the CPU in ``dtype``: the output, or (loss, gradients) of the first training step."""
    model = copy.deepcopy(base).to(dtype).train(mode == "training" and workload.train_mode)
    batch = cast(batch, dtype)
    if mode != "training":
        with torch.no_grad():
            return workload.output(model, *batch)
    loss = workload.loss(model, *batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def measure(workload: Workload, mode: str, competitors: list[str], warmup: int, repeats: int,
            smoke: bool = False, seed: int = 0, profile_calls: int = 0, run_length: int = RUN_LENGTH,
            dtype: str = "float32") -> list[Cell]:
    """The cells of one (workload, mode, dtype), competitors timed in turns of ``run_length`` calls; then, if
    ``profile_calls``, that many more calls of each meganeura competitor under the profiler (per-dispatch GPU time,
    not the timed calls). In a half dtype only ``HALF_COMPETITORS`` run, and only in ``HALF_MODES``."""
    half = dtype != "float32"
    if half and mode not in HALF_MODES:
        raise ValueError(f"{dtype} cells are measured in {HALF_MODES}, not {mode}")
    torch.manual_seed(seed)
    base = workload.build(smoke).to(DTYPES[dtype])
    size = "minimal" if mode == "latency" else "full"
    batch = cast(workload.batch(size, torch.Generator().manual_seed(seed + 1), smoke), DTYPES[dtype])
    competitors = [c for c in competitors if (mode == "training" or c not in TRAINING_ONLY)
                   and (not half or c in HALF_COMPETITORS)]
    try:
        exact = reference(workload, base, mode, batch, torch.float64)
        eager = reference(workload, base, mode, batch, DTYPES[dtype])
    except Exception as err:  # noqa: BLE001 - a workload that eager cannot run fails every cell of its mode
        why = f"eager reference failed: {type(err).__name__}: {err}"[:2000]
        return [Cell(workload.name, mode, c, dtype, error=why) for c in competitors]
    cells, runners = [], []
    torch._dynamo.reset()  # every Runner compiles the same code object: start each (workload, mode) afresh
    for competitor in competitors:
        cell = Cell(workload.name, mode, competitor, dtype)
        cells.append(cell)
        try:
            with _Meter(competitor) as meter:  # construction, first call and two steps: the peak-memory window
                runner = Runner(competitor, workload, base, mode, batch)
                cell.compile_s, got = runner.first_call()
                runner.step()
                # An eager optimizer creates its state in its first step(): only from the second step on does a
                # backward run beside it, as every later step of a training run does.
                runner.step()
            meter.report(cell)
            if runner.resident is not None:
                plans = [p.program.plan for p in runner.resident._plans.values()]
                cell.dispatches = len(plans[-1].dispatches)  # the training plan (the last compiled)
                cell.planned_bytes = plans[-1].stats["arena_bytes"]
            cell.gate = _gate(got, exact, eager, mode == "training", *_allowance(competitor, half)).as_dict()
            runners.append((runner, cell))
        except Exception as err:  # noqa: BLE001 - a competitor that cannot run this cell is reported, not fatal
            cell.error = f"{type(err).__name__}: {err}"[:2000]
    for _ in range(warmup - 1):
        for runner, _cell in runners:
            runner.step()

    def call(i: int, timed: bool) -> None:
        runner, cell = runners[i]  # noqa: F821 - ``del runners`` below runs after the last call
        if not timed:
            runner.step()
            return
        with _Transfers(cell) as moved:
            cell.samples_ms.append(runner.step())
        if moved.bytes is not None:
            cell.transfer_bytes_per_call = moved.bytes  # the same every call: the last one is kept

    take_turns(len(runners), repeats, run_length, call)
    for cell in cells:
        if cell.samples_ms:
            cell.median_ms = statistics.median(cell.samples_ms)
    if profile_calls:
        for runner, cell in runners:
            if runner.competitor.startswith("meganeura"):
                _profile(runner, cell, profile_calls)
    del runners
    gc.collect()
    return cells


def recompile(workload: Workload, competitor: str, smoke: bool = False, seed: int = 0) -> float:
    """First-call seconds of the training step after ``torch._dynamo.reset`` (on-disk caches kept)."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    base = workload.build(smoke).float()
    batch = workload.batch("full", torch.Generator().manual_seed(seed + 1), smoke)
    seconds, _ = Runner(competitor, workload, base, "training", batch).first_call()
    return seconds


def _profile(runner: Runner, cell: Cell, calls: int, top: int = 5) -> None:
    from meganeura.runtime.device import get_device
    from meganeura.runtime.profiler import profile

    with profile(get_device()) as prof:
        for _ in range(calls):
            runner.step()
    cell.gpu_ms_per_call = sum(e["duration_ns"] for e in prof.events) / 1e6 / calls
    cell.top_kernels = [{"name": k.name, "ms_per_call": k.total_ms / calls, "share": k.share}
                        for k in prof.top(top)]


def _allowance(competitor: str, half: bool) -> tuple[float, float]:
    """(tolerance, factor of eager's own error) of a cell's gate (see ``gates``)."""
    if half:
        return HALF_TOLERANCE, HALF_FACTOR
    return (FAST_TOLERANCE if competitor == "meganeura-fast" else TOLERANCE), EAGER_FACTOR


def _gate(got, exact, eager, training: bool, tolerance: float, factor: float) -> Gate:
    if not training:
        return gate_output(got, exact, eager, tolerance, factor)
    (loss, grads), (exact_loss, exact_grads), (eager_loss, eager_grads) = got, exact, eager
    return gate_gradients(loss, grads, exact_loss, exact_grads, eager_loss, eager_grads, tolerance, factor)


class _Meter:
    """A window over a competitor's first call: what meganeura's backend records while it compiles, and the
    device memory allocated at peak (meganeura's allocation counters, or CUDA's peak statistics)."""

    def __init__(self, competitor: str):
        self.competitor, self.records, self.start = competitor, [], 0

    def __enter__(self):
        if self.competitor.startswith("meganeura"):
            from torch_meganeura.backend.entry import BackendContext

            BackendContext.recorders.append(self.records)
            device = _device()
            # Buffers an earlier competitor gave back to the pool would serve this one's arrays of the same sizes
            # without an allocation, so its peak would leave them out: they are destroyed first.
            device.pool.clear()
            counters = device.counters
            counters.peak_bytes_allocated = self.start = counters.bytes_allocated
        elif self.competitor.startswith("torch-cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        if self.competitor.startswith("meganeura"):
            from torch_meganeura.backend.entry import BackendContext

            BackendContext.recorders.remove(self.records)
            self.peak = _device().counters.peak_bytes_allocated - self.start
        elif self.competitor.startswith("torch-cuda"):
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.peak = None
        return False

    def report(self, cell: Cell) -> None:
        cell.peak_memory_bytes = self.peak
        plans = [r for r in self.records if not isinstance(r, dict)]
        graphs = [r for r in self.records if isinstance(r, dict)]
        if graphs:
            failed = {"a partition that failed to compile" for r in graphs if r["kind"] == "failed"}
            cell.fallback_ops = sorted({op for r in graphs for op in r.get("fallback_ops", ())} | failed)
        if plans:
            cell.dispatches = sum(r.dispatches for r in plans)
            cell.planned_bytes = sum(r.arena_bytes for r in plans)


class _Transfers:
    """meganeura's host<->device bytes during one call (None for other competitors)."""

    def __init__(self, cell: Cell):
        self.on = cell.competitor.startswith("meganeura")
        self.bytes = None

    def __enter__(self):
        if self.on:
            c = _device().counters
            self.start = c.bytes_uploaded + c.bytes_downloaded
        return self

    def __exit__(self, *exc):
        if self.on:
            c = _device().counters
            self.bytes = c.bytes_uploaded + c.bytes_downloaded - self.start
        return False


def _device():
    from meganeura.runtime.device import get_device

    return get_device()
