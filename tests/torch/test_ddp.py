"""Data parallelism through torch.distributed (gloo), launched with torchrun like a user would: two processes on
this machine's adapter train the small Llama of ``scripts/ddp_example.py`` for 10 AdamW steps, each on half of
every batch. Both forms, DDP around the compiled model and torch.compile around DDP (dynamo splits the graph at
DDP's buckets and the backend compiles every piece), must give on every rank the losses and final weights of one
eager process running the whole batches."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_l2

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ddp_example.py"
STEPS, PER_RANK, WORLD, LR = 10, 2, 2, 1e-3


def _example():
    spec = importlib.util.spec_from_file_location("ddp_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def single_process():
    """Losses and final weights of one eager process on the whole batches."""
    example = _example()
    model, optimizer = example.model_and_optimizer(LR)
    losses = []
    for ids in example.batches(STEPS, PER_RANK * WORLD):
        optimizer.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("form", ["ddp-compiled", "compile-ddp"])
def test_ddp_matches_one_process_on_the_whole_batch(form, single_process, tmp_path):
    env = dict(os.environ, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                           str(SCRIPT), "--form", form, "--steps", str(STEPS), "--per-rank", str(PER_RANK),
                           "--lr", str(LR), "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    want_losses, want_state = single_process
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert [r["local_rank"] for r in ranks] == ["0", "1"]
    for r, got in enumerate(ranks):
        for step, (g, w) in enumerate(zip(got["losses"], want_losses), 1):
            assert abs(g - w) <= 1e-4 * abs(w), f"rank {r} step {step}: loss {g} vs one process {w}"
        for name, want in want_state.items():
            torch.testing.assert_close(got["state"][name], want, rtol=1e-3, atol=2e-4, msg=f"rank {r}: {name}")
            assert rel_l2(got["state"][name], want) < 1e-4, f"rank {r}: {name}"
    for name, weight in ranks[0]["state"].items():
        assert torch.equal(weight, ranks[1]["state"][name]), f"ranks disagree on {name}"
