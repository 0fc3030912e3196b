"""Outputs held unread while other work runs, across the product's paths, in one process with the garbage collector
running: an inference output, a loop's loss or a language model's logits stays on the device (its run returned once
submitted) while other models' inference calls, loop steps, resident steps (``compile_train_step``) and HF
``generate`` calls (a tiny Llama, its greedy tokens eager's) run, outputs are dropped unread and collections free
buffers back to the pool; each held output is read at a random later point and must equal what eager PyTorch
computed when it was made (rtol 1e-4, atol 1e-5 for inference; the training tests' 1e-3 / 1e-4 and losses within
1e-4 relative for training, whose weights move between).

A buffer that went back to the pool, or was overwritten, while a held output still needed it would show here as
another call's values read back.
"""
from __future__ import annotations

import copy
import gc
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import meganeura.runtime.program as program_module
import torch_meganeura

INFER_RTOL, INFER_ATOL = 1e-4, 1e-5
TRAIN_RTOL, TRAIN_ATOL, LOSS_REL = 1e-3, 1e-4, 1e-4
ACTIONS_PER_TEST = 24
WIDTH = 10
GENERATED = 6  # new tokens of a ``generate`` call


def _mlp(seed: int, hidden: int, out: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, out))


class Paths:
    """Two inference models, a model trained by the kept loop and one by the resident step, each beside its eager
    twin; the outputs held unread (``held``: output, eager's value, its kind, the action that made it)."""

    def __init__(self, seed: int):
        torch._dynamo.reset()
        self.data = torch.Generator().manual_seed(seed)
        self.infer = []
        for k, (hidden, out) in enumerate(((16, 3), (24, 7))):
            model = _mlp(seed * 10 + k, hidden, out).eval()
            self.infer.append((torch.compile(model, backend="meganeura"), model))
        self.loop_model = _mlp(seed * 10 + 2, 16, 4)
        self.loop_ref = copy.deepcopy(self.loop_model)
        self.loop_opt = torch_meganeura.keep_on_device(torch.optim.AdamW(self.loop_model.parameters(), lr=1e-2))
        self.loop_ref_opt = torch.optim.AdamW(self.loop_ref.parameters(), lr=1e-2)
        self.loop = torch.compile(self.loop_model, backend="meganeura")
        self.step_model = _mlp(seed * 10 + 3, 20, 4)
        self.step_ref = copy.deepcopy(self.step_model)
        self.step_ref_opt = torch.optim.AdamW(self.step_ref.parameters(), lr=1e-2)
        self.step = torch_meganeura.compile_train_step(
            self.step_model, _loss, torch.optim.AdamW(self.step_model.parameters(), lr=1e-2))
        self.lm = None  # (``language_model``: made at its first use)
        self.held: list[tuple] = []
        self.log: list[str] = []

    def language_model(self):
        """The tiny Llama (``helpers.models.llama``), its forward compiled, and its eager twin."""
        if self.lm is None:
            from helpers.models import llama

            model = llama()
            ref = copy.deepcopy(model)
            model.forward = torch.compile(model.forward, backend="meganeura")
            self.lm = model, ref
        return self.lm

    def batch(self, rows: int = 6):
        return torch.randn(rows, WIDTH, generator=self.data), torch.randint(0, 4, (rows,), generator=self.data)


def _loss(model, x, y):
    return F.cross_entropy(model(x), y)


def infer(paths: Paths, rng: random.Random) -> None:
    """An inference call whose output is held unread."""
    compiled, model = rng.choice(paths.infer)
    x, _ = paths.batch(rng.choice((2, 6)))
    with torch.no_grad():
        paths.held.append((compiled(x), model(x), "inference", len(paths.log)))


def loop_step(paths: Paths, rng: random.Random) -> None:
    """A step of the kept loop whose loss is held unread (the step reads nothing: no wait)."""
    x, y = paths.batch()
    loss = _loss(paths.loop, x, y)
    loss.backward()
    paths.loop_opt.step()
    paths.loop_opt.zero_grad()
    ref = _loss(paths.loop_ref, x, y)
    ref.backward()
    paths.loop_ref_opt.step()
    paths.loop_ref_opt.zero_grad()
    paths.held.append((loss, ref.detach(), "loss", len(paths.log)))


def resident_step(paths: Paths, rng: random.Random) -> None:
    """A resident step (its loss comes back to the host), compared at once."""
    x, y = paths.batch()
    loss = paths.step(x, y)
    ref = _loss(paths.step_ref, x, y)
    ref.backward()
    paths.step_ref_opt.step()
    paths.step_ref_opt.zero_grad()
    assert abs(float(loss) - ref.item()) <= LOSS_REL * abs(ref.item()), f"resident loss {loss} vs {ref.item()}"


def lm_logits(paths: Paths, rng: random.Random) -> None:
    """The tiny Llama's logits over a prompt, held unread."""
    model, ref = paths.language_model()
    ids = torch.randint(0, model.config.vocab_size, (1, rng.choice((5, 9))), generator=paths.data)
    with torch.no_grad():
        paths.held.append((model(ids, use_cache=False).logits, ref(ids, use_cache=False).logits, "logits",
                           len(paths.log)))


def generate(paths: Paths, rng: random.Random) -> None:
    """HF ``generate`` (greedy, its default cache) through the backend: eager's tokens, compared at once."""
    model, ref = paths.language_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=paths.data)
    got, want = (m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GENERATED, do_sample=False)
                 for m in (model, ref))
    assert got.tolist() == want.tolist(), f"generate after {paths.log}"


def read_one(paths: Paths, rng: random.Random) -> None:
    if paths.held:
        _check(paths, paths.held.pop(rng.randrange(len(paths.held))))


def drop_one(paths: Paths, rng: random.Random) -> None:
    """An output dropped unread: its buffers go back to the pool."""
    if paths.held:
        paths.held.pop(rng.randrange(len(paths.held)))


def collect(paths: Paths, rng: random.Random) -> None:
    gc.collect()


def _check(paths: Paths, held: tuple) -> None:
    got, want, kind, made = held
    where = f"{kind} made at action {made} of {paths.log}"
    if kind == "loss":
        assert abs(got.item() - want.item()) <= LOSS_REL * abs(want.item()), f"{where}: {got.item()} vs {want}"
    else:
        torch.testing.assert_close(got, want, rtol=INFER_RTOL, atol=INFER_ATOL, msg=lambda m: f"{where}: {m}")


ACTIONS = {f.__name__: f for f in (infer, loop_step, resident_step, lm_logits, generate, read_one, drop_one,
                                   collect)}
WEIGHTED = [*ACTIONS, "infer", "loop_step", "read_one"]  # calls made and read more often than the rest


@pytest.fixture
def like_a_long_lived_process(monkeypatch):
    """The collector running (the suite pauses it: conftest.py), and every plan recording its next run ahead, as a
    full-size model's do (these plans are shorter than ``AHEAD_MIN_DISPATCHES``)."""
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", 1)
    gc.enable()
    yield
    gc.disable()


def _run(seed: int) -> None:
    rng = random.Random(seed)
    paths = Paths(seed)
    for _ in range(ACTIONS_PER_TEST):
        name = rng.choice(WEIGHTED)
        paths.log.append(name)
        ACTIONS[name](paths, rng)
    while paths.held:
        read_one(paths, rng)
    for (name, p), q in zip(paths.loop_model.named_parameters(), paths.loop_ref.parameters()):
        torch.testing.assert_close(p, q, rtol=TRAIN_RTOL, atol=TRAIN_ATOL, msg=lambda m: f"loop {name}: {m}")
    paths.step.sync_to_module()  # (the resident step's weights live on the device until synced)
    for (name, p), q in zip(paths.step_model.named_parameters(), paths.step_ref.parameters()):
        torch.testing.assert_close(p, q, rtol=TRAIN_RTOL, atol=TRAIN_ATOL, msg=lambda m: f"resident {name}: {m}")


@pytest.mark.parametrize("seed", [0])
def test_outputs_held_across_paths_read_as_eager(seed, like_a_long_lived_process):
    _run(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 25))
def test_more_outputs_held_across_paths_read_as_eager(seed, like_a_long_lived_process):
    _run(seed)
