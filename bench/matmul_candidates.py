"""``python -m bench.matmul_candidates``: every candidate variant of the tiled f32 matmul on square products, each
timed on the GPU, beside PyTorch's CUDA f32 matmul (cuBLAS, TF32 off) where CUDA exists (issue 51).

    python -m bench.matmul_candidates --sizes 1024,2048,4096 --out bench/results/h100-sgemm-candidates
    python -m bench.matmul_candidates --sizes 64,96 --limits webgpu-default      # the path at small sizes
    python -m bench.matmul_candidates --sizes 4096 --tiles 128x256,128x128      # those tiles' candidates alone

For each size n, ``a @ b`` of two (n, n) float32 tensors is traced and lowered as the backend lowers it; its
matmul's tuning problem (the plan's own loads, vec4 loaders and store) gives the candidates the tuner weighs on this
device and limits (``meganeura.kernels.matmul_tuning.variants``, the default first). Each candidate's row has:
- its kernel as the generator describes it (tile, K chunk, threads and register block, double buffers, staging);
- tuner us: its time as the tuner measures it (zero-filled scratch buffers, GPU timestamps around repeated runs:
  ``MatmulTuner.time_candidates``); ``*`` marks the one the tuner keeps (``meganeura.runtime.matmul_tuner.pick``);
- GPU us: the median of GPU_CALLS runs of the plan compiled with that variant forced, each dispatch between two GPU
  timestamps (``meganeura.runtime.profiler``, as ``bench --micro`` times its rows), on random operands, after
  WARM_SECONDS of runs; its TFLOP/s, and that rate over cuBLAS's;
- rel L2: the plan's result against float64 (past TOLERANCE the row says FAILED).
The default is timed again after the last candidate ("default, again"): the gap between its two times is the run's
drift. cuBLAS is timed between CUDA events around each call, the median of GPU_CALLS calls after a warm-up.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import statistics
import time
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .gates import rel_l2
from .micro import _cuda_event_ms, _matmul, _profiled_ms

GPU_CALLS = 20  # timed runs per candidate (and cuBLAS calls), after the warm-up
WARM_SECONDS = 0.2  # runs of each candidate before it is timed: the GPU's clocks up after the compiles
TOLERANCE = 1e-4  # relative L2 against float64 (lavapipe, n = 128: 2e-7; float32 sums' error grows about as sqrt(n))
_HEADER = re.compile(r"// ---- matmul: (.*)")


@dataclasses.dataclass
class Row:
    size: int
    index: int  # position in the tuner's candidate list (0: the default; -1: cuBLAS)
    variant: str  # the kernel's description (its generated header), or cuBLAS's name
    choice: dict | None = None  # the MatmulChoice's fields (None for cuBLAS)
    tuner_us: float | None = None
    kept: bool = False  # the tuner's choice
    gpu_us: float | None = None
    tflops: float | None = None
    vs_cublas: float | None = None  # this rate over cuBLAS's
    rel_l2: float | None = None
    error: str | None = None


def traced(a, b):
    """``a @ b`` traced to aten once (fake tensors: no product computed); each compile lowers it again (a compile
    fuses its lowered graph in place)."""
    return make_fx(_matmul, tracing_mode="fake")(a, b)


def _lowered(gm, a, b):
    from torch_meganeura.lower.fx_lowering import lower_graph

    return lower_graph(gm, [a, b], {0, 1})


def matmul_problem(gm, a, b, limits: dict):
    """The tuning problem of the matmul of ``gm`` (``traced``), as a tuned plan for ``limits`` would ask it."""
    from meganeura.lowering import compile_graph

    asked = []

    def keep_default(problems):
        asked.extend(problems)
        return [None] * len(problems)

    compile_graph(_lowered(gm, a, b).graph, limits, keep_default)
    if len(asked) != 1:
        raise RuntimeError(f"expected one tiled matmul problem, got {len(asked)}")
    return asked[0]


def _program(gm, a, b, device, choice):
    """A program of ``gm`` (``traced``) whose matmul takes ``choice``, its operands uploaded; (program, output name,
    kernel description)."""
    from meganeura.lowering import compile_graph
    from meganeura.runtime.program import Program
    from torch_meganeura.tensors.params import host_form

    lowered = _lowered(gm, a, b)
    plan, _ = compile_graph(lowered.graph, device.limits, lambda problems: [choice] * len(problems))
    headers = [m.group(1) for d in plan.dispatches if (m := _HEADER.search(plan.kernels[d.kernel]))]
    output = plan.outputs[0].name
    program = Program(device, plan, resident_outputs=[output])
    program.upload_params({name: host_form((a, b)[i]) for i, name in lowered.params})
    return program, output, headers[0] if headers else "?"


def _run(program) -> None:
    for array in program.run({}).values():
        array.release()


def _result(program, output: str) -> torch.Tensor:
    from torch_meganeura.tensors.params import tensor_from_host

    arrays = program.run({})
    value = arrays[output].numpy()
    for array in arrays.values():
        array.release()
    return tensor_from_host(value)


def _gpu_us(device, program) -> float | None:
    """Median GPU microseconds of a run of ``program`` (None without timestamp queries), after WARM_SECONDS."""
    end = time.perf_counter() + WARM_SECONDS
    while True:
        _run(program)
        device.synchronize()
        if time.perf_counter() >= end:
            break
    if "timestamp-query" not in device.features:
        return None
    return statistics.median(_profiled_ms(device, lambda: _run(program), GPU_CALLS)) * 1e3


def candidate_row(size: int, index: int, choice, operands: tuple, exact, device) -> Row:
    """One candidate's row: its plan built from ``operands`` (the traced graph, a, b), checked against ``exact`` and
    timed (an error is reported in the row)."""
    row = Row(size, index, "", dataclasses.asdict(choice))
    program = None
    try:
        program, output, row.variant = _program(*operands, device, choice)
        row.rel_l2 = float(rel_l2(_result(program, output).double(), exact))
        row.gpu_us = _gpu_us(device, program)
        if row.gpu_us:
            row.tflops = 2.0 * size**3 / (row.gpu_us * 1e-6) / 1e12
    except Exception as err:  # noqa: BLE001 - reported per candidate
        row.error = f"{type(err).__name__}: {err}"[:500]
    finally:
        if program is not None:
            program.release()
    return row


def cublas_row(size: int, a, b) -> Row:
    """cuBLAS's f32 product (TF32 off) timed between CUDA events: the median of GPU_CALLS calls after a warm-up."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ca, cb = a.cuda(), b.cuda()
    for _ in range(10):
        ca @ cb
    torch.cuda.synchronize()
    us = statistics.median(_cuda_event_ms(lambda: ca @ cb, GPU_CALLS)) * 1e3
    return Row(size, -1, "cuBLAS (torch CUDA eager, TF32 off)", gpu_us=us, tflops=2.0 * size**3 / (us * 1e-6) / 1e12)


def size_rows(size: int, device, tuner, gen, tiles=None) -> list[Row]:
    """Every candidate's row at ``size`` (with ``tiles``, a set of (rows, columns): the default and the candidates
    of those forced tiles alone; the tuner still weighs all), the default's again, and cuBLAS's where CUDA exists."""
    from meganeura.runtime.matmul_tuner import pick

    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    cuda = torch.cuda.is_available()
    exact = (a.cuda().double() @ b.cuda().double()).cpu() if cuda else a.double() @ b.double()
    operands = (traced(a, b), a, b)
    choices, seconds = tuner.time_candidates(matmul_problem(*operands, device.limits))
    kept = pick(seconds) if seconds else 0
    rows = []
    for index, choice in enumerate(choices):
        if index and tiles is not None and choice.tile not in tiles:
            continue
        rows.append(candidate_row(size, index, choice, operands, exact, device))
        rows[-1].tuner_us = seconds[index] * 1e6 if seconds else None
        rows[-1].kept = index == kept
    again = candidate_row(size, 0, choices[0], operands, exact, device)
    again.variant = "default, again: " + again.variant
    rows.append(again)
    if cuda:
        reference = cublas_row(size, a, b)
        for row in rows:
            row.vs_cublas = row.tflops / reference.tflops if row.tflops else None
        rows.append(reference)
    return rows


def _cell(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rate(tflops) -> str:
    return "-" if tflops is None else f"{tflops:.3g}"  # (a CPU driver's rates are thousandths)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table, size by size."""
    lines = ["| n | # | variant | tuner us | GPU us | TFLOP/s | x cuBLAS | rel L2 |", "|" + "---|" * 8]
    for r in rows:
        check = "-" if r.rel_l2 is None else f"{r.rel_l2:.1e}" + (" FAILED" if r.rel_l2 > TOLERANCE else "")
        name = r.variant + (f" ({r.error})" if r.error else "")
        lines.append(f"| {r.size} | {r.index if r.index >= 0 else ''}{'*' if r.kept else ''} | {name} | "
                     f"{_cell(r.tuner_us, 1)} | {_cell(r.gpu_us, 1)} | {_rate(r.tflops)} | "
                     f"{_cell(r.vs_cublas, 3)} | {check} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """Per size: the fastest candidate by GPU time and the tuner's choice, each with its ratio to cuBLAS."""
    lines = []
    for size in dict.fromkeys(r.size for r in rows):
        ours = [r for r in rows if r.size == size and r.index >= 0 and r.gpu_us and not r.error
                and r.rel_l2 is not None and r.rel_l2 <= TOLERANCE]
        if not ours:
            lines.append(f"n={size}: no candidate ran correctly")
            continue
        best = min(ours, key=lambda r: r.gpu_us)
        kept = next((r for r in ours if r.kept), None)
        line = (f"n={size}: fastest #{best.index}, {best.gpu_us:.1f} us ({_cell(best.vs_cublas, 3)} x cuBLAS), "
                f"{best.variant}")
        if kept is not None:
            line += f"; the tuner keeps #{kept.index}, {kept.gpu_us:.1f} us ({_cell(kept.vs_cublas, 3)} x cuBLAS)"
        lines.append(line)
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.matmul_candidates", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1024,2048,4096", help="comma-separated square sizes n (a (n, n) @ (n, n))")
    p.add_argument("--limits", default="adapter", choices=("adapter", "webgpu-default"),
                   help="the device's limits (webgpu-default: the candidates a portable plan weighs)")
    p.add_argument("--tiles", default=None,
                   help="comma-separated forced tiles, e.g. 128x256,128x128: only their candidates (and the default)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md (rows, adapter, date)")
    return p


def main(argv=None) -> int:
    """Each size's rows printed as they are done, and the files (with ``--out``) rewritten after each size: a run cut
    short by a time limit keeps the sizes it finished."""
    from meganeura.runtime.device import get_device
    from meganeura.runtime.matmul_tuner import MatmulTuner

    args = _parser().parse_args(argv)
    device = get_device(limits=args.limits)
    tuner = MatmulTuner(device, None)
    gen = torch.Generator().manual_seed(0)
    adapter = dict(device.adapter.info)
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    head = (f"adapter: {adapter.get('device', '?')} ({args.limits} limits); cuda: {cuda}; "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(head, flush=True)
    rows = []
    tiles = None if args.tiles is None else {tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",") if t}
    for size in (int(s) for s in args.sizes.split(",") if s):
        done = size_rows(size, device, tuner, gen, tiles)
        rows += done
        print(f"\n{table(done)}\n\n{summary(done)}", flush=True)
        if args.out:
            _write(Path(args.out), "\n\n".join([head, table(rows), summary(rows)]),
                   {"adapter": adapter, "limits": args.limits, "cuda": cuda, "torch": torch.__version__,
                    "rows": [dataclasses.asdict(r) for r in rows]})
    return 0


def _write(out: Path, text: str, data: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
