"""Data-parallel training with torch.distributed (gloo) and the meganeura backend; launch with torchrun:

    torchrun --nproc-per-node 2 scripts/ddp_example.py                 # DDP around the compiled model
    torchrun --nproc-per-node 2 scripts/ddp_example.py --form compile-ddp   # torch.compile around DDP

Each process takes its own GPU (LOCAL_RANK; MEGANEURA_ADAPTER overrides) and trains a small Llama on its shard of
every batch; gradients are averaged across processes by DDP through gloo (on the host: Vulkan GPUs have no NCCL).
With ``--out`` every rank saves its losses and final weights (the tests compare them with one process).
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

import torch_meganeura  # noqa: F401 - only for the error message if the package is missing; the backend is an entry point

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--form", choices=["ddp-compiled", "compile-ddp"], default="ddp-compiled",
                   help="DDP(torch.compile(model)) or torch.compile(DDP(model)) (dynamo splits it at DDP's buckets)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--per-rank", type=int, default=2, help="sequences per process and step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=None, help="directory for rank<N>.pt (losses and final weights)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
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
    if args.out:
        torch.save({"losses": losses, "state": model.state_dict(), "local_rank": os.environ.get("LOCAL_RANK")},
                   os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
