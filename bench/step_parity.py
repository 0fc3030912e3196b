"""``python -m bench.step_parity``: losses of compile_train_step beside eager PyTorch's, step by step, on a workload.

Each side starts from the same weights and trains ``--steps`` AdamW steps on the same batches: the resident step
(meganeura), eager float32 (on CUDA when present, TF32 off) and eager float64 on the CPU, the yardstick. The report
gives every step's losses and each float32 side's relative distance from float64, so a drift that compounds over
steps shows (an earlier fusion bug put the SmolLM2 step 0.58 % off at step 1 and 12 % off after 5 steps).
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from .workloads import WORKLOADS


def _batches(workload, steps: int, smoke: bool) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    return [workload.batch("full", gen, smoke) for _ in range(steps)]


def _eager_losses(model, workload, batches, device: str, dtype, lr: float) -> list[float]:
    model = copy.deepcopy(model).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        batch = tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in batch)
        opt.zero_grad()
        loss = workload.loss(model, *batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach().double()))
    return losses


def _resident_losses(model, workload, batches, lr: float) -> list[float]:
    from torch_meganeura import compile_train_step

    model = copy.deepcopy(model)
    step = compile_train_step(model, workload.loss, torch.optim.AdamW(model.parameters(), lr=lr))
    return [float(step(*batch)) for batch in batches]


def run(name: str, steps: int, lr: float, smoke: bool) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    workload = WORKLOADS[name]
    torch.manual_seed(0)
    model = workload.build(smoke).train(workload.train_mode)
    batches = _batches(workload, steps, smoke)
    cuda = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    sides = {"float64 (cpu)": _eager_losses(model, workload, batches, "cpu", torch.float64, lr),
             f"eager float32 ({cuda})": _eager_losses(model, workload, batches, cuda, torch.float32, lr),
             "meganeura resident": _resident_losses(model, workload, batches, lr)}
    exact = sides["float64 (cpu)"]
    distance = {side: [abs(a - b) / abs(b) for a, b in zip(losses, exact)] for side, losses in sides.items()
                if side != "float64 (cpu)"}
    return {"workload": name, "steps": steps, "lr": lr, "smoke": smoke, "losses": sides,
            "relative_distance_from_float64": distance, "seconds": round(time.perf_counter() - start, 1)}


def markdown(result: dict) -> str:
    sides = list(result["losses"])
    lines = [f"# Training-step parity: {result['workload']}, {result['steps']} AdamW steps (lr {result['lr']})", "",
             "| step | " + " | ".join(sides) + " | " + " | ".join(f"{s}: rel. from float64"
                                                             for s in result["relative_distance_from_float64"]) + " |",
             "|" + "---|" * (1 + len(sides) + len(result["relative_distance_from_float64"]))]
    for i in range(result["steps"]):
        losses = " | ".join(f"{result['losses'][s][i]:.6f}" for s in sides)
        dist = " | ".join(f"{d[i]:.2e}" for d in result["relative_distance_from_float64"].values())
        lines.append(f"| {i + 1} | {losses} | {dist} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_parity", description=__doc__)
    p.add_argument("--workload", default="smollm2", choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--smoke", action="store_true", help="the workload's smoke-scale model")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    result = run(args.workload, args.steps, args.lr, args.smoke)
    text = markdown(result)
    print(text)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
        Path(f"{args.out}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
