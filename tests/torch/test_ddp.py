"""Data parallelism through torch.distributed (gloo), launched with torchrun like a user would: two processes on
this machine's adapter train the small Llama of ``scripts/ddp_example.py`` for 10 AdamW steps, each on half of
every batch. Both forms, DDP around the compiled model and torch.compile around DDP (dynamo splits the graph at
DDP's buckets and the backend compiles every piece), must give on every rank the losses and final weights of one
eager process running the whole batches.

The device-resident form, ``compile_train_step(DDP(model), ...)``, is held to the same, with two micro-batches per
update and clipping at a norm the averaged gradients exceed (clipping before averaging would differ); the last
step's averaged gradients must also match the whole batch's (AdamW is almost blind to the gradients' scale: a sum
in place of the average would pass the other checks)."""
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.compare import rel_l2

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ddp_example.py"
STEPS, PER_RANK, WORLD, LR = 10, 2, 2, 1e-3


def _example():
    spec = importlib.util.spec_from_file_location("ddp_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def single_process(max_grad_norm: float | None = None):
    """Losses, final weights and the last step's gradients of one eager process on the whole batches."""
    example = _example()
    model, opt = example.model_and_optimizer(LR)
    losses = []
    for ids in example.batches(STEPS, PER_RANK * WORLD):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            assert norm > max_grad_norm, "the test means clipping to act"
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict(), grads


CASES = {  # form -> extra arguments, the reference's max_grad_norm
    "ddp-compiled": ([], None),
    "compile-ddp": ([], None),
    "resident": (["--max-grad-norm", "0.5", "--accumulation-steps", "2"], 0.5),
}


# two torchrun processes, 40-55 s a form on the 2-core CI machine: the slow stage (docs/architecture.md, Tests)
@pytest.mark.slow
@pytest.mark.parametrize("form", list(CASES))
def test_ddp_matches_one_process_on_the_whole_batch(form, tmp_path):
    extra, max_grad_norm = CASES[form]
    env = dict(os.environ, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                           str(SCRIPT), "--form", form, "--steps", str(STEPS),
                           "--per-rank", str(PER_RANK), "--lr", str(LR), *extra, "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    want_losses, want_state, want_grads = single_process(max_grad_norm)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert [r["local_rank"] for r in ranks] == ["0", "1"]
    for r, got in enumerate(ranks):
        for step, (g, w) in enumerate(zip(got["losses"], want_losses), 1):
            assert abs(g - w) <= 1e-4 * abs(w), f"rank {r} step {step}: loss {g} vs one process {w}"
        for name, want in want_state.items():
            torch.testing.assert_close(got["state"][name], want, rtol=1e-3, atol=2e-4, msg=f"rank {r}: {name}")
            assert rel_l2(got["state"][name], want) < 1e-4, f"rank {r}: {name}"
        for name, grad in got.get("grads", {}).items():  # the resident form's averaged gradients of the last step
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-3, atol=1e-5, msg=f"rank {r}: grad of {name}")
            assert rel_l2(grad, want_grads[name]) < 1e-4, f"rank {r}: grad of {name}"
    for name, weight in ranks[0]["state"].items():
        assert torch.equal(weight, ranks[1]["state"][name]), f"ranks disagree on {name}"


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_process_group_step_matches_the_single_plan_step(world_of_one, tmp_path):
    """process_group=: the gradient plan, the all-reduce and the update plan compute what the single plan does
    (BatchNorm statistics, clipping included); checkpoints and state_dict work as in a single-process step."""
    import copy

    import torch.nn.functional as F
    from torch import nn

    from torch_meganeura import compile_train_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).train()
    twin = copy.deepcopy(model)

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y)

    dp = compile_train_step(model, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-2), max_grad_norm=0.1,
                            process_group=world_of_one)
    single = compile_train_step(twin, loss_fn, torch.optim.AdamW(twin.parameters(), lr=1e-2), max_grad_norm=0.1)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(4)]
    for x, y in batches[:3]:
        torch.testing.assert_close(dp(x, y), single(x, y), rtol=1e-5, atol=1e-6)
    got, want = dp.device_weights(), single.device_weights()
    for name in want:
        torch.testing.assert_close(torch.from_numpy(got[name]), torch.from_numpy(want[name]), rtol=1e-5, atol=1e-6)
    dp.save(tmp_path / "dp.safetensors")
    after = dp(*batches[3])
    dp.load(tmp_path / "dp.safetensors")
    assert torch.equal(dp(*batches[3]), after) and dp.steps == 4
    assert torch.equal(dp.state_dict()["1.running_mean"], torch.from_numpy(dp.device_weights()["1.running_mean"]))


BATCHNORM_SCRIPT = """
import copy, os, sys
import torch, torch.nn as nn, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).train()
ref = copy.deepcopy(model)
compiled = nn.parallel.DistributedDataParallel(torch.compile(model, backend="meganeura"))
eager = nn.parallel.DistributedDataParallel(ref)
batches = torch.Generator().manual_seed(rank)  # each rank its own
for _ in range(3):
    x = torch.randn(4, 6, generator=batches)
    compiled(x).sum().backward()
    eager(x).sum().backward()
torch.save({"got": dict(model.named_buffers()), "want": dict(ref.named_buffers())}, f"{sys.argv[1]}/rank{rank}.pt")
print(f"rank {rank}: saved", file=sys.stderr, flush=True)
# The results are saved: leave without the interpreter's teardown. In 2 of about 8 clean-clone CI runs one rank aborted
# there ("terminate called without an active exception": a C++ thread still joinable while static destructors ran),
# with or without dist.destroy_process_group() first; never in 18 runs here, loaded or with cold caches.
os._exit(0)
"""


def test_ddp_around_the_compiled_model_broadcasts_batchnorm_statistics_as_eager(tmp_path):
    """DDP broadcasts rank 0's buffers before every forward, reading and writing their host copies from C++: in a
    group of several processes the running statistics a training forward updates come back to the host, and every
    rank's are eager DDP's. (Two small torchrun processes: about 11 s on the 2-core machine.)"""
    script = tmp_path / "batchnorm.py"
    script.write_text(BATCHNORM_SCRIPT)
    env = dict(os.environ, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                           str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    for r in range(WORLD):
        saved = torch.load(tmp_path / f"rank{r}.pt")
        for name, want in saved["want"].items():
            torch.testing.assert_close(saved["got"][name], want, rtol=1e-4, atol=1e-6, msg=f"rank {r}: {name}")
