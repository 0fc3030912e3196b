"""Data-parallel training with torch.distributed (gloo) and the meganeura backend; launch with torchrun:

    torchrun --nproc-per-node 2 scripts/ddp_example.py                 # DDP around the compiled model
    torchrun --nproc-per-node 2 scripts/ddp_example.py --form compile-ddp   # torch.compile around DDP
    torchrun --nproc-per-node 2 scripts/ddp_example.py --form resident      # compile_train_step(DDP(model), ...)

Each process takes its own GPU (LOCAL_RANK; MEGANEURA_ADAPTER overrides) and trains a small Llama on its shard of
every batch; gradients are averaged across processes through gloo (on the host: Vulkan GPUs have no NCCL), by DDP
or, in the resident form, by ``compile_train_step`` between its gradient plan and its update plan (weights and
optimizer state stay on the device).
With ``--out`` every rank saves its losses and final weights (the tests compare them with one process).
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

from torch_meganeura import compile_train_step

LLAMA = dict(vocab_size=64, hidden_size=160, intermediate_size=320, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=64)


def batches(steps: int, global_batch: int) -> list[torch.Tensor]:
    """The same token batches in every process (and in a single-process reference)."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, LLAMA["vocab_size"], (global_batch, 12), generator=gen) for _ in range(steps)]


def model_and_optimizer(lr: float):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).train()
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def loss_fn(model, ids):
    return model(ids, labels=ids).loss


def resident(args, rank: int, world: int) -> tuple[list[float], dict, dict]:
    """compile_train_step in data-parallel mode: around DDP (its process group), or with ``process_group=``."""
    model, optimizer = model_and_optimizer(args.lr)
    k = args.accumulation_steps
    if args.process_group:
        step = compile_train_step(model, loss_fn, optimizer, process_group=dist.group.WORLD,
                                  max_grad_norm=args.max_grad_norm, accumulation_steps=k)
    else:
        step = compile_train_step(DDP(model), loss_fn, optimizer, max_grad_norm=args.max_grad_norm,
                                  accumulation_steps=k)
    losses = []
    for ids in batches(args.steps, args.per_rank * world):
        mine = ids[rank * args.per_rank:(rank + 1) * args.per_rank]
        loss = sum(float(step(part)) for part in mine.chunk(k))  # each call returns its loss divided by k
        mean = torch.tensor(loss)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            print(f"step {len(losses)}: loss {losses[-1]:.5f}", flush=True)
    averaged = {n: torch.from_numpy(a.numpy()) for n, a in step.data_parallel.reducer.arrays.items()}
    return losses, step.state_dict(), averaged  # averaged: the last step's gradients, before clipping


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--form", choices=["ddp-compiled", "compile-ddp", "resident"], default="ddp-compiled",
                   help="DDP(torch.compile(model)), torch.compile(DDP(model)) (dynamo splits it at DDP's buckets) or "
                        "compile_train_step(DDP(model), ...)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--per-rank", type=int, default=2, help="sequences per process and step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=None, help="directory for rank<N>.pt (losses and final weights)")
    p.add_argument("--max-grad-norm", type=float, default=None, help="resident form: clip the averaged gradients")
    p.add_argument("--accumulation-steps", type=int, default=1, help="resident form: micro-batches per update")
    p.add_argument("--process-group", action="store_true", help="resident form: pass process_group= instead of DDP")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.form == "resident":
        losses, state, grads = resident(args, rank, world)
        _save(args, rank, losses, state, grads=grads)
        dist.destroy_process_group()
        return
    model, optimizer = model_and_optimizer(args.lr)
    if args.form == "ddp-compiled":
        net = DDP(torch.compile(model, backend="meganeura"))
    else:
        net = torch.compile(DDP(model, bucket_cap_mb=1), backend="meganeura")  # small buckets: several pieces
    losses = []
    for ids in batches(args.steps, args.per_rank * world):
        mine = ids[rank * args.per_rank:(rank + 1) * args.per_rank]
        optimizer.zero_grad()
        loss = net(mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            print(f"step {len(losses)}: loss {losses[-1]:.5f}", flush=True)
    _save(args, rank, losses, model.state_dict())
    dist.destroy_process_group()


def _save(args, rank: int, losses: list[float], state: dict, **extra) -> None:
    if args.out:
        torch.save({"losses": losses, "state": state, "local_rank": os.environ.get("LOCAL_RANK"), **extra},
                   os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
