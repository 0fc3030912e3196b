"""``python -m bench.ddp``: data-parallel training steps on 1 and 2 GPUs, meganeura against PyTorch DDP on CUDA.

    python -m bench.ddp --gpus 1,2 --out bench/results/ddp-h200          # ResNet-50 and SmolLM2, full size
    python -m bench.ddp --gpus 1,2 --out bench/results/ddp-smoke --smoke  # tiny sizes: checks the path anywhere

For every GPU count N and every (workload, competitor) this launches ``torchrun --standalone --nproc-per-node N``
on one cell (a fresh set of processes each, so a failing cell is recorded and the rest still run), collects every
rank's timings, and writes ``OUT.json`` and the markdown table ``OUT.md``. Each process takes its own GPU:
``LOCAL_RANK`` picks the wgpu adapter (``meganeura.runtime.device``) and ``cuda:LOCAL_RANK``.

Competitors, both training with AdamW (lr 1e-5) at the workload's training batch per GPU (global batch N times it;
each rank draws its own batch), f32 with TF32 off:
  meganeura-dp    ``compile_train_step(DistributedDataParallel(model), loss, AdamW)``: gradient plan, gloo
                  all-reduce of the gradients on the host, update plan; weights and optimizer state stay on the GPU
  torch-cuda-ddp  eager ``DistributedDataParallel`` on cuda:LOCAL_RANK with NCCL (skipped, with the reason, without
                  CUDA)
A step is timed on every rank from its start until its loss is on the host (meganeura) or after
``torch.cuda.synchronize`` (CUDA). A cell's step time is the slowest rank's median after warm-up; samples/s is the
global batch over it; scaling efficiency is throughput(N) / (N * throughput(1)). For meganeura every rank also
records host<->device bytes per step and the gradient all-reduce's time: the whole phase (pack, communicate, write
back) and the part spent blocked on the asynchronous handles (which includes waiting for a slower rank).
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
WORKLOADS = ("resnet50", "smollm2")
COMPETITORS = ("meganeura-dp", "torch-cuda-ddp")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1,2", help="comma-separated GPU (process) counts (default 1,2)")
    p.add_argument("--out", default=None, help="results path without suffix: writes OUT.json and OUT.md "
                                               "(default bench/results/ddp[-smoke])")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--competitors", default=",".join(COMPETITORS), help=f"from {', '.join(COMPETITORS)}")
    p.add_argument("--smoke", action="store_true", help="the workloads' smoke sizes (a path check, not a benchmark)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (compiling) one")
    p.add_argument("--repeats", type=int, default=20, help="timed steps")
    p.add_argument("--note", default="", help="a remark on the conditions of this run, kept in the results")
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # worker: WORKLOAD,COMPETITOR
    p.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)  # worker: where rank<N>.json goes
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.cell:
        return _worker(args)
    return _launch(args)


# ---- launcher

def _launch(args) -> int:
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / ("ddp-smoke" if args.smoke else "ddp")
    gpus = [int(n) for n in args.gpus.split(",")]
    workloads, competitors = args.workloads.split(","), args.competitors.split(",")
    unknown = (set(workloads) - set(WORKLOADS)) | (set(competitors) - set(COMPETITORS))
    if unknown:
        raise SystemExit(f"unknown workloads or competitors {sorted(unknown)}")
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    import torch

    result = {"machine": _machine(), "settings": {"gpus": gpus, "warmup": args.warmup, "repeats": args.repeats,
                                                "scale": "smoke" if args.smoke else "full", "note": args.note,
                                                "command": " ".join(["python -m bench.ddp", *sys.argv[1:]])},
              "cells": []}
    cuda_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for name in workloads:
        for competitor in competitors:
            for n in gpus:
                cell = {"workload": name, "competitor": competitor, "gpus": n}
                if competitor == "torch-cuda-ddp" and cuda_gpus < n:
                    cell["skipped"] = f"needs {n} CUDA device(s), found {cuda_gpus}"
                else:
                    _run_cell(args, cell)
                result["cells"].append(cell)
                _print(cell)
                _write(out, result)
    _efficiency(result["cells"])
    _write(out, result)
    print(f"wrote {out}.json and {out}.md", flush=True)
    print(_table(result), flush=True)
    return 0


def _machine() -> dict:
    """What ``bench.run.machine`` records, without opening a GPU in this process (the ranks record theirs)."""
    import platform
    from importlib import metadata

    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "tf32": {"cuda_matmul": False, "cudnn": False}, "versions": {}}
    for package in ("torch", "torch-meganeura", "wgpu", "numpy", "transformers"):
        try:
            info["versions"][package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info["versions"][package] = None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(count)]
    return info


def _run_cell(args, cell: dict) -> None:
    n = cell["gpus"]
    print(f"== {cell['workload']} {cell['competitor']} on {n} GPU(s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   "-m", "bench.ddp", "--cell", f"{cell['workload']},{cell['competitor']}", "--result-dir", tmp,
                   "--warmup", str(args.warmup), "--repeats", str(args.repeats)] + (["--smoke"] if args.smoke else [])
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))))
        cell["wall_s"] = time.perf_counter() - start
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    if done.returncode != 0 or len(ranks) != n:
        cell["error"] = f"torchrun exited with {done.returncode}; {len(ranks)} of {n} ranks wrote results (see log)"
        return
    cell["ranks"] = sorted(ranks, key=lambda r: r["rank"])
    cell["per_gpu_batch"] = ranks[0]["per_gpu_batch"]
    cell["global_batch"] = n * cell["per_gpu_batch"]
    cell["median_ms"] = max(r["median_ms"] for r in ranks)  # the slowest rank sets the pace
    cell["samples_per_s"] = cell["global_batch"] / (cell["median_ms"] / 1e3)
    for key in ("transfer_bytes_per_step", "reduce_ms", "wait_ms"):
        if ranks[0].get(key) is not None:
            cell[key] = max(r[key] for r in ranks)


def _efficiency(cells: list) -> None:
    one = {(c["workload"], c["competitor"]): c.get("samples_per_s") for c in cells if c["gpus"] == 1}
    for c in cells:
        base = one.get((c["workload"], c["competitor"]))
        if c.get("samples_per_s") and base and c["gpus"] > 1:
            c["scaling_efficiency"] = c["samples_per_s"] / (c["gpus"] * base)


def _print(cell: dict) -> None:
    what = f"{cell['workload']:9s} {cell['competitor']:15s} {cell['gpus']} GPU(s)"
    if "skipped" in cell or "error" in cell:
        print(f"{what}: {cell.get('skipped') or 'ERROR ' + cell['error']}", flush=True)
        return
    print(f"{what}: {cell['median_ms']:9.2f} ms/step, {cell['samples_per_s']:8.2f} samples/s (global batch "
          f"{cell['global_batch']}), first step {max(r['first_step_s'] for r in cell['ranks']):.1f} s", flush=True)


def _table(result: dict) -> str:
    m = result["machine"]
    adapters = sorted({f"rank {r['rank']}: adapter {r['adapter_index']}, {r['adapter']}" for c in result["cells"]
                       for r in c.get("ranks", []) if c["competitor"] == "meganeura-dp"})
    lines = [f"# Data-parallel training steps ({result['settings']['scale']} scale)", "",
             f"`{result['settings']['command']}` on {m['processor']} ({m['cpu_count']} CPUs), CUDA devices "
             f"{m['cuda_devices'] or 'none'}; {m['date']}. {result['settings']['note']}".rstrip(), "",
             f"meganeura adapters: {'; '.join(adapters) or '-'}.", "",
             "Median step after warm-up (the slowest rank's), AdamW, f32 (TF32 off), per-GPU batch = the workload's "
             "training batch. Efficiency = samples/s(N) / (N x samples/s(1)). Host<->device and all-reduce: "
             "meganeura only, per step (all-reduce: whole phase / blocked on handles, waits for slower ranks "
             "included).",
             "",
             "| workload | competitor | GPUs | global batch | step ms | samples/s | efficiency | host<->device MB "
             "| all-reduce ms |", "|---|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        head = f"| {c['workload']} | {c['competitor']} | {c['gpus']} |"
        if "median_ms" not in c:
            lines.append(f"{head} {c.get('skipped') or 'error: ' + c.get('error', '?')} | | | | | |")
            continue
        eff = f"{c['scaling_efficiency']:.2f}" if "scaling_efficiency" in c else ""
        moved = f"{c['transfer_bytes_per_step'] / 1e6:.2f}" if c.get("transfer_bytes_per_step") is not None else ""
        reduce = f"{c['reduce_ms']:.2f} / {c['wait_ms']:.2f}" if c.get("reduce_ms") is not None else ""
        lines.append(f"{head} {c['global_batch']} | {c['median_ms']:.2f} | {c['samples_per_s']:.2f} | {eff} | "
                     f"{moved} | {reduce} |")
    return "\n".join(lines) + "\n"


def _write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1))
    Path(f"{out}.md").write_text(_table(result))


# ---- worker (one rank of one cell, under torchrun)

def _worker(args) -> int:
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    import torch
    import torch.distributed as dist

    from .run import _strict_f32
    from .workloads import WORKLOADS as ALL

    _strict_f32()
    name, competitor = args.cell.split(",")
    workload = ALL[name]
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = competitor == "torch-cuda-ddp"
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = workload.build(args.smoke).float().train(workload.train_mode)
    batch = workload.batch("full", torch.Generator().manual_seed(1 + rank), args.smoke)
    record = {"rank": rank, "local_rank": local_rank, "world": world, "per_gpu_batch": int(batch[0].shape[0])}
    step = _cuda_step(model, workload, batch, local_rank, record) if cuda else _meganeura_step(model, workload,
                                                                                               batch, record)
    start = time.perf_counter()
    record["first_loss"] = step()
    record["first_step_s"] = time.perf_counter() - start
    if rank == 0:
        print(f"   first step (compiles) {record['first_step_s']:.1f} s, loss {record['first_loss']:.4f}", flush=True)
    for _ in range(args.warmup):
        step()
    samples, extras = [], []
    for i in range(args.repeats):
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e3)
        extras.append(dict(record.pop("last", {})))
        if rank == 0 and (i + 1) % max(1, args.repeats // 4) == 0:
            print(f"   {i + 1}/{args.repeats} timed steps, median so far {statistics.median(samples):.2f} ms",
                  flush=True)
    record["samples_ms"] = samples
    record["median_ms"] = statistics.median(samples)
    for key in ("transfer_bytes_per_step", "reduce_ms", "wait_ms"):
        values = [e[key] for e in extras if key in e]
        record[key] = statistics.median(values) if values else None
    dist.barrier()
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


def _meganeura_step(model, workload, batch, record: dict):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from meganeura.runtime import device as runtime_device
    from torch_meganeura import compile_train_step

    train = compile_train_step(DistributedDataParallel(model), workload.loss,
                               torch.optim.AdamW(model.parameters(), lr=1e-5))
    counters = train.device.counters
    record["adapter"] = train.device.describe()
    record["adapter_index"] = next(i for i, d in runtime_device._devices.items() if d is train.device)
    reducer = train.data_parallel.reducer
    record["buckets"] = len(reducer.buckets)

    def step() -> float:
        before = counters.bytes_uploaded + counters.bytes_downloaded
        loss = float(train(*batch))  # the loss is on the host: the step is over
        record["last"] = {"transfer_bytes_per_step": counters.bytes_uploaded + counters.bytes_downloaded - before,
                          "reduce_ms": reducer.stats["reduce_ms"], "wait_ms": reducer.stats["wait_ms"]}
        return loss

    return step


def _cuda_step(model, workload, batch, local_rank: int, record: dict):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device("cuda", local_rank)
    net = DistributedDataParallel(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5)
    batch = tuple(t.to(device) for t in batch)
    props = torch.cuda.get_device_properties(device)
    record["adapter"] = f"{props.name} (cuda:{local_rank}, PCI bus {getattr(props, 'pci_bus_id', '?')})"

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(net, *batch)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        return loss.item()

    return step


if __name__ == "__main__":
    sys.exit(main())
