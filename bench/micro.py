"""Micro benchmarks: projections (``F.linear``) in float32 and bfloat16, f32 matmul, f32 attention, a fused
pointwise chain and a copy (the bandwidth roof), a row reduction, and the host cost per dispatch of plan replay.

Each matmul size is timed twice: one product per call (its latency: the launch and the wait count in full), and, for
sizes up to ``BACK_TO_BACK_MAX``, ``BACK_TO_BACK`` independent products (no operand shared) per call, issued back to
back with one wait at the end (the throughput: one call's launch and wait spread over several products, both sides).

meganeura's side runs a plan directly: the function is traced to aten (``make_fx``), lowered and compiled like a
backend graph (with tuned matmul variants where ``MEGANEURA_TUNE=1``, as ``bench --tune`` sets), its operands
uploaded once as parameters and its outputs kept on the device (``DeviceArray``s, recycled every call), so a timed
call is one replay of the plan plus the 4-byte fence read that waits for it.
Beside the time per call (launch, kernels and the wait), each row has the GPU time of a call's kernels, so that the
launch-and-wait cost is told apart from the kernels' own: ``GPU_CALLS`` more calls each, meganeura's under its
profiler (every dispatch in a pass of its own between two GPU timestamps, summed per call), PyTorch CUDA's between
two CUDA events recorded on its stream (the kernels of a call and any gaps between them).
The dispatch chain reports the wall time per dispatch (host and GPU: a chain of dependent dispatches is bound by
whichever is slower) and, for meganeura, the host's share alone: recording and submitting, before the wait.
PyTorch's side calls the same function on resident tensors (CPU, and CUDA where present, synchronised).
Each attention shape (``ATTENTION_SHAPES``: ``F.scaled_dot_product_attention`` on one batch, PyTorch's SDPA on its
side) has a second row, meganeura's alone, whose plan is compiled for WebGPU's default workgroup storage
(``PORTABLE_STORAGE``): the kernel a portable bundle runs, on the same adapter.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from .turns import RUN_LENGTH, take_turns

DISPATCH_CHAIN = 500  # dispatches in the host-cost plan
BACK_TO_BACK = 8  # products per call in a matmul throughput row
BACK_TO_BACK_MAX = 2048  # sizes up to this get a throughput row
GPU_CALLS = 10  # calls timed on the GPU per row, after the timed turns (their median is the row's GPU time)
COMPETITORS = ("meganeura", "torch-cpu-eager", "torch-cuda-eager")  # (a plan replay has no resident/compiled form)
# (heads, sequence length, head size, causal) of a batch-1 f32 self-attention: Whisper-tiny's encoder (1,500 frames),
# and a head size of 128 (an LLM's) over 2,048 causal tokens (scores past the unfused path's 64 MiB: fused). FLOPs
# counted: 4 * heads * length^2 * head size (two products), half of it where causal.
ATTENTION_SHAPES = ((6, 1500, 64, False), (8, 2048, 128, True))
PORTABLE_STORAGE = 16384  # WebGPU's default max-compute-workgroup-storage-size: the second row of each shape
# Projections ``F.linear(x, w)``, x (M, K) and w (N, K), in each of PROJECTION_DTYPES (``bench --projections``): a
# decode step's (M = 1: SmolLM2-135M's q/o, gate/up, down and LM head; Llama-3.2-1B's gate/up) and a prefill's.
# A row runs as many independent projections per call (no operand shared: one dispatch each) as make its weights
# at least PROJECTION_BYTES in float32 (half of it in bfloat16), past the GPU's L2 cache (H100: 50 MiB), as a decode
# step's 540 MB are; at most MAX_PROJECTIONS.
PROJECTIONS = ((1, 576, 576), (1, 576, 1536), (1, 1536, 576), (1, 576, 49152), (1, 2048, 8192), (128, 576, 1536))
PROJECTION_DTYPES = ("float32", "bfloat16")
PROJECTION_BYTES = 256 << 20
MAX_PROJECTIONS = 128
# A half row's correctness bound (relative L2 against PyTorch's CPU result in the same dtype): both round the outputs
# to 8 significant bits, and sum in different orders (a bfloat16 output differs by an ulp, 2^-8, here and there).
HALF_TOLERANCE = 2e-2


@dataclass
class MicroResult:
    name: str
    competitor: str
    work: str  # what the rate counts: "GFLOP/s" or "GB/s" (bytes read + written)
    samples_ms: list[float] = field(default_factory=list)
    median_ms: float | None = None
    rate: float | None = None
    per_dispatch_us: float | None = None  # the dispatch chain: time per dispatch (per eager op for PyTorch)
    host_per_dispatch_us: float | None = None  # meganeura's chain: host time (record + submit) per dispatch
    host_ms: list[float] = field(default_factory=list)  # meganeura: host share of each timed call
    gpu_samples_ms: list[float] = field(default_factory=list)  # GPU time of each of GPU_CALLS calls (module docstring)
    gpu_median_ms: float | None = None  # their median; None where the device has no timer (no timestamp queries)
    gpu_rate: float | None = None  # the rate at the GPU time
    dispatches: int | None = None  # meganeura: dispatches of the plan
    correct: bool | None = None  # the result against PyTorch on the CPU (relative L2 < 1e-3)
    error: str | None = None


def _device_call(fn, args, storage: int | None = None):
    """Callables that replay ``fn``'s plan on the device and that return its outputs; its dispatch count. With
    ``storage``, the plan is compiled (untuned) for that workgroup storage limit instead of the device's."""
    from meganeura.runtime.device import get_device
    from meganeura.runtime.program import Program
    from torch_meganeura.lower.fx_lowering import lower_graph
    from torch_meganeura.lower.tuning import compile_plan, tuning_enabled
    from torch_meganeura.tensors.params import host_form, tensor_from_host

    gm = make_fx(fn)(*args)
    lowered = lower_graph(gm, list(args), set(range(len(args))))
    device = get_device()
    limits = None if storage is None else dict(device.limits, **{"max-compute-workgroup-storage-size": storage})
    plan, _, _ = compile_plan(lowered.graph, device, tuning_enabled(None), limits=limits)  # tuned under bench --tune
    outputs = [t.name for t in plan.outputs]
    program = Program(device, plan, resident_outputs=outputs)
    program.upload_params({name: host_form(args[i]) for i, name in lowered.params})

    def run():
        for array in program.run({}).values():
            array.release()

    def result():
        arrays = program.run({})
        values = [arrays[name].numpy() for name in outputs]
        for array in arrays.values():
            array.release()
        return _flat([tensor_from_host(v) for v in values])

    return run, result, len(plan.dispatches), lambda: program.host_seconds * 1e3


def _timed(call, sync) -> float:
    start = time.perf_counter()
    call()
    sync()
    return (time.perf_counter() - start) * 1e3


def measure(name: str, fn, args, work: str, amount: float, competitors, warmup: int, repeats: int,
            run_length: int = RUN_LENGTH, storage: int | None = None, tolerance: float = 1e-3) -> list[MicroResult]:
    """Time ``fn(*args)`` for each competitor, in turns of ``run_length`` calls; ``amount`` is the FLOPs or bytes of
    one call. ``storage``: meganeura's plan compiled for that workgroup storage limit (``_device_call``); a result
    is correct within ``tolerance`` (relative L2 against PyTorch on the CPU)."""
    from .gates import rel_l2

    want = _flat(fn(*args))
    results, timed = [], []
    for competitor in competitors:
        res = MicroResult(name, competitor, work)
        results.append(res)
        try:
            call, sync, result, res.dispatches, host_ms, gpu_ms = _prepare(competitor, fn, args, storage)
            res.correct = rel_l2(result().float(), want.float()) < tolerance
            timed.append((res, call, sync, host_ms, gpu_ms))
        except Exception as err:  # noqa: BLE001 - reported per competitor
            res.error = f"{type(err).__name__}: {err}"[:2000]
    for _ in range(warmup):
        for _res, call, sync, _host_ms, _gpu_ms in timed:
            _timed(call, sync)

    def turn_call(i: int, counted: bool) -> None:
        res, call, sync, host_ms, _gpu_ms = timed[i]
        ms = _timed(call, sync)
        if counted:
            res.samples_ms.append(ms)
            if host_ms is not None:
                res.host_ms.append(host_ms())

    take_turns(len(timed), repeats, run_length, turn_call)
    for res, call, sync, _host_ms, gpu_ms in timed:
        res.median_ms = statistics.median(res.samples_ms)
        res.rate = amount / (res.median_ms * 1e-3) / 1e9
        if gpu_ms is not None:
            call()  # (a call of its own first: the one that pays for the switch from the other API's work)
            sync()
            res.gpu_samples_ms = gpu_ms(GPU_CALLS)
            res.gpu_median_ms = statistics.median(res.gpu_samples_ms)
            res.gpu_rate = amount / (res.gpu_median_ms * 1e-3) / 1e9 if res.gpu_median_ms > 0 else None
    return results


def _prepare(competitor: str, fn, args, storage: int | None = None):
    """(call, sync, result, dispatches per call or None, host ms of the last call or None, GPU timer or None) of one
    competitor; the GPU timer ``gpu_ms(calls)`` makes that many calls and returns each one's GPU milliseconds."""
    if competitor == "meganeura":
        from meganeura.runtime.device import get_device

        run, result, dispatches, host_ms = _device_call(fn, args, storage)  # (outputs stay on the device: it returns
        device = get_device()                                      # once submitted, and is waited for here)
        timer = (lambda calls: _profiled_ms(device, run, calls)) if "timestamp-query" in device.features else None
        return run, device.synchronize, result, dispatches, host_ms, timer
    device = "cuda" if competitor == "torch-cuda-eager" else "cpu"
    on = [a.to(device) for a in args]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    timer = (lambda calls: _cuda_event_ms(lambda: fn(*on), calls)) if device == "cuda" else None
    return (lambda: fn(*on)), sync, (lambda: _flat(fn(*on)).cpu()), None, None, timer


def _profiled_ms(device, run, calls: int) -> list[float]:
    """GPU milliseconds of each of ``calls`` plan runs: the summed durations of its dispatches under the profiler."""
    from meganeura.runtime.profiler import profile

    with profile(device) as prof:
        for _ in range(calls):
            run()  # (a profiled run waits for its timestamps)
    per_run = [0.0] * prof.runs
    for event in prof.events:
        per_run[event["run"]] += event["duration_ns"] / 1e6
    return per_run


def _cuda_event_ms(call, calls: int) -> list[float]:
    """GPU milliseconds of each of ``calls`` calls: between CUDA events recorded on the stream before and after it."""
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _flat(outputs) -> torch.Tensor:
    """A function's outputs (a tensor, or a tuple of them) as one flat tensor, for the correctness check."""
    if isinstance(outputs, torch.Tensor):
        return outputs.reshape(-1)
    return torch.cat([t.reshape(-1) for t in outputs])


def _matmul(a, b):
    return a @ b


def _matmuls(*operands):
    # independent products of distinct operands (no two share one, so the compiler cannot merge them into one GEMM):
    # each its own kernel launch, its own dispatch
    return tuple(a @ b for a, b in zip(operands[::2], operands[1::2]))


def _pointwise_chain(x):
    return torch.sigmoid(x * 1.5 + 0.5) * x - 0.25


def _copy(x):
    return x * 1.0


def _row_sum(x):
    return x.sum(dim=-1)


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _causal_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def parse_attention_shapes(text: str) -> tuple:
    """``ATTENTION_SHAPES`` from ``"6x1500x64,8x1024x128c"`` (``bench --attention-shapes``)."""
    shapes = []
    for item in filter(None, text.split(",")):
        causal = item.endswith("c")
        heads, length, d = (int(n) for n in item.rstrip("c").split("x"))
        shapes.append((heads, length, d, causal))
    return tuple(shapes)


def attention_rows(shapes, timing, gen) -> list[MicroResult]:
    """Each attention shape's row (every competitor) and its row at WebGPU's default workgroup storage
    (meganeura's alone)."""
    results = []
    for heads, length, d, causal in shapes:
        args = tuple(torch.randn(1, heads, length, d, generator=gen) for _ in range(3))
        name = f"attention {heads}x{length}x{d}" + (" causal" if causal else "")
        fn = _causal_attention if causal else _attention
        flops = 4.0 * heads * length * length * d / (2 if causal else 1)
        competitors, *rest = timing
        results += measure(name, fn, args, "GFLOP/s", flops, *timing)
        if "meganeura" in competitors:
            results += measure(f"{name} at {PORTABLE_STORAGE // 1024} KiB", fn, args, "GFLOP/s", flops, ["meganeura"],
                               *rest, storage=PORTABLE_STORAGE)
    return results


def _projections(*operands):
    # independent projections of distinct operands (x0, w0, x1, w1, ...): no two share one, one dispatch each
    return tuple(F.linear(x, w) for x, w in zip(operands[::2], operands[1::2]))


def parse_projections(text: str) -> tuple:
    """``PROJECTIONS`` from ``"1x576x1536,128x576x1536"`` (``bench --projections``: MxKxN)."""
    return tuple(tuple(int(n) for n in item.split("x")) for item in filter(None, text.split(",")))


def projection_rows(shapes, dtypes, timing, gen) -> list[MicroResult]:
    """Each projection shape in each dtype (``PROJECTIONS``): GB/s of the weights, the rows and the outputs moved
    for a decode's (M = 1), GFLOP/s for the rest; the same count of projections per call in every dtype."""
    results = []
    for m, k, n in shapes:
        copies = max(1, min(MAX_PROJECTIONS, -(-PROJECTION_BYTES // (4 * n * k))))
        for dtype in dtypes:
            half = getattr(torch, dtype)
            operands = tuple(t for _ in range(copies) for t in (torch.randn(m, k, generator=gen).to(half),
                                                                 torch.randn(n, k, generator=gen).to(half)))
            size = torch.finfo(half).bits // 8
            work, amount = (("GB/s", copies * size * (n * k + m * k + m * n)) if m == 1 else
                            ("GFLOP/s", copies * 2.0 * m * n * k))
            results += measure(f"linear {m}x{k}x{n} {dtype} x{copies}", _projections, operands, work, amount,
                               *timing, tolerance=1e-3 if dtype == "float32" else HALF_TOLERANCE)
    return results


def _dispatch_chain(x, w):
    for _ in range(DISPATCH_CHAIN):
        x = x @ w  # a matmul per step: nothing fuses, every step is a dispatch
    return x


def run_all(competitors, matmul_sizes, stream_mib: int, warmup: int, repeats: int, run_length: int = RUN_LENGTH,
            attention_shapes=ATTENTION_SHAPES, projections=PROJECTIONS,
            projection_dtypes=PROJECTION_DTYPES) -> list[MicroResult]:
    """Every micro benchmark; ``stream_mib`` sizes the pointwise, copy and reduction inputs (0: none of them, nor the
    dispatch chain)."""
    gen = torch.Generator().manual_seed(0)
    results = []
    timing = (competitors, warmup, repeats, run_length)
    results += projection_rows(projections, projection_dtypes, timing, gen)
    for n in matmul_sizes:
        a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        results += measure(f"matmul {n}", _matmul, (a, b), "GFLOP/s", 2.0 * n**3, *timing)
        if n <= BACK_TO_BACK_MAX:
            operands = tuple(torch.randn(n, n, generator=gen) for _ in range(2 * BACK_TO_BACK))
            results += measure(f"matmul {n} x{BACK_TO_BACK} back to back", _matmuls, operands, "GFLOP/s",
                               2.0 * n**3 * BACK_TO_BACK, *timing)
    results += attention_rows(attention_shapes, timing, gen)
    if not stream_mib:
        return results
    numel = stream_mib * (1 << 20) // 4
    x = torch.randn(numel, generator=gen)
    for name, fn in ((f"pointwise chain {stream_mib} MiB", _pointwise_chain), (f"copy {stream_mib} MiB", _copy)):
        results += measure(name, fn, (x,), "GB/s", 8.0 * numel, *timing)
    rows = x.view(-1, 4096)
    results += measure(f"row sum {stream_mib} MiB", _row_sum, (rows,), "GB/s", 4.0 * numel, *timing)
    small, w = torch.randn(8, 8, generator=gen), torch.eye(8) + 0.001 * torch.randn(8, 8, generator=gen)
    chain = measure(f"{DISPATCH_CHAIN} dispatches of 8x8 matmuls", _dispatch_chain, (small, w), "GFLOP/s",
                    2.0 * 8**3 * DISPATCH_CHAIN, *timing)
    for res in chain:  # one dispatch (one eager op) per matmul on every side
        if res.median_ms is not None:
            res.per_dispatch_us = res.median_ms * 1e3 / DISPATCH_CHAIN
        if res.host_ms:
            res.host_per_dispatch_us = statistics.median(res.host_ms) * 1e3 / DISPATCH_CHAIN
    return results + chain
