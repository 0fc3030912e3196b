"""Random sequences of what users do around the ordinary loop (``torch.compile`` + ``keep_on_device``), against the same
sequence in eager PyTorch from the same weights, in one process with the garbage collector running. The models
(``MODELS``) hold BatchNorm statistics that the training forward updates in place: an MLP, and a convolution; their
optimizers (``OPTIMIZERS``) are AdamW, Adam with weight decay, and SGD with Nesterov momentum.

Each sequence draws its actions from ``ACTIONS`` with a seed of its own: training steps that read their loss or not,
gradient accumulation, ``zero_grad`` to None or to zeros, clipping, an LR change, a gradient check before the step
(two forwards and a backward between: the order that aborted the process in session 14), an eval-mode forward under
``no_grad``, an eager forward of the kept model, an export of it run by the runtime in the same process, reads of
``.grad`` and ``state_dict()``, an eager in-place write to a parameter, a snapshot restored with ``load_state_dict``,
and garbage collections. Every read is compared with eager's when it is made, and every parameter and buffer at the
end (the training tests' tolerances: rtol 1e-3, atol 1e-4; losses within 1e-4 relative). A step on a shorter batch
makes dynamo trace the loop again with the batch size symbolic. The runs are asynchronous: a read is where the host
waits, so a sequence also checks that what the device computed between reads is what eager computed.
"""
from __future__ import annotations

import copy
import gc
import random
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import meganeura.runtime.program as program_module
import torch_meganeura
from meganeura.runtime import load

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # (torch.export's, in export)
RTOL, ATOL, LOSS_REL = 1e-3, 1e-4, 1e-4
LENGTH = 14  # actions per sequence
WIDTH, CLASSES, BATCH = 12, 5, 8
SHORT_BATCHES = (3, 5)


class NormedMLP(nn.Module):
    """Linear, BatchNorm (running statistics the training forward updates in place), GELU, LayerNorm, Linear. The
    first linear has no bias, as layers before a BatchNorm have none: the batch's mean would cancel it, its gradient
    would be rounding noise, and AdamW's step (``lr`` times that noise's sign) would differ from eager's by whole
    steps."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn = nn.Linear(WIDTH, 24, bias=False), nn.BatchNorm1d(24)
        self.ln, self.fc2 = nn.LayerNorm(24), nn.Linear(24, CLASSES)

    def forward(self, x):
        return self.fc2(self.ln(F.gelu(self.bn(self.fc1(x)))))


class NormedConv(nn.Module):
    """A convolution (no bias, before its BatchNorm), BatchNorm2d, ReLU, average pooling, Linear: the input's
    ``WIDTH`` features as 3 x 4 pixels of one channel."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, CLASSES)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x.view(-1, 1, 3, 4))))
        return self.fc(h.mean(dim=(2, 3)))


MODELS = {"mlp": NormedMLP, "conv": NormedConv}


# the optimizers a kept model may have (each its own update kernels and state)
OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
              "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, nesterov=True)}


class Twins:
    """The kept model (``ours``) and its eager twin (``ref``), each with its optimizer; actions run on both."""

    def __init__(self, seed: int, folder: Path, kind: str = "mlp", optimizer: str = "adamw"):
        torch.manual_seed(seed)
        self.model = MODELS[kind]()
        self.ref = copy.deepcopy(self.model)
        self.opt = torch_meganeura.keep_on_device(OPTIMIZERS[optimizer](self.model.parameters()))
        self.ref_opt = OPTIMIZERS[optimizer](self.ref.parameters())
        self.compiled = torch.compile(self.model, backend="meganeura")
        self.data = torch.Generator().manual_seed(seed)
        self.snapshot: dict | None = None
        self.log: list[str] = []
        self.folder = folder  # (its exports' bundles)

    def pairs(self):
        return ((self.compiled, self.model, self.opt), (self.ref, self.ref, self.ref_opt))

    def batch(self, rows: int = BATCH):
        return torch.randn(rows, WIDTH, generator=self.data), torch.randint(0, CLASSES, (rows,), generator=self.data)

    def where(self) -> str:
        return "after " + ", ".join(self.log)


def _close(got, want, twins: Twins, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {twins.where()}: {m}")


def _loss_close(got: float, want: float, twins: Twins) -> None:
    assert abs(got - want) <= LOSS_REL * abs(want), f"loss {got} vs eager {want} {twins.where()}"


def _backward_both(twins: Twins, x, y) -> list:
    losses = []
    for module, _, _ in twins.pairs():
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        losses.append(loss)
    return losses


def step(twins: Twins, rng: random.Random, rows: int = BATCH) -> None:
    """A training step; its loss read (a wait) or not; ``zero_grad`` to None or zeros."""
    x, y = twins.batch(rows)
    losses = _backward_both(twins, x, y)
    set_to_none = rng.random() < 0.7
    for _, _, opt in twins.pairs():
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    if rng.random() < 0.5:
        _loss_close(losses[0].item(), losses[1].item(), twins)


def short_batch_step(twins: Twins, rng: random.Random) -> None:
    """A step on a batch of other rows (an epoch's last): dynamo traces the loop again, its batch size symbolic."""
    step(twins, rng, rng.choice(SHORT_BATCHES))


def accumulate(twins: Twins, rng: random.Random) -> None:
    """A backward whose gradients the next step adds to."""
    _backward_both(twins, *twins.batch())


def gradient_check_then_step(twins: Twins, rng: random.Random) -> None:
    """Two forwards with a backward between, then the step (its saved activations die unread)."""
    x, y = twins.batch()
    for module, _, opt in twins.pairs():
        F.cross_entropy(module(x), y).backward()
        module(x)
        opt.step()
        opt.zero_grad()


def clip_then_step(twins: Twins, rng: random.Random) -> None:
    x, y = twins.batch()
    _backward_both(twins, x, y)
    norms = [torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5) for _, model, _ in twins.pairs()]
    _close(norms[0], norms[1], twins, "gradient norm")
    for _, _, opt in twins.pairs():
        opt.step()
        opt.zero_grad()


def change_lr(twins: Twins, rng: random.Random) -> None:
    lr = rng.choice([3e-3, 1e-2, 2e-2])
    for _, _, opt in twins.pairs():
        for group in opt.param_groups:
            group["lr"] = lr


def eval_forward(twins: Twins, rng: random.Random) -> None:
    """An eval-mode forward under ``no_grad`` (the running statistics read), compared; back to train mode."""
    x, _ = twins.batch()
    outs = []
    for module, model, _ in twins.pairs():
        model.eval()
        with torch.no_grad():
            outs.append(module(x))
        model.train()
    _close(outs[0], outs[1], twins, "eval output")


def eager_forward(twins: Twins, rng: random.Random) -> None:
    """The kept model called as it is, in eager PyTorch (its parameters downloaded)."""
    x, _ = twins.batch()
    with torch.no_grad():
        outs = [model.eval()(x) for _, model, _ in twins.pairs()]
    for _, model, _ in twins.pairs():
        model.train()
    _close(outs[0], outs[1], twins, "eager output")


def export_and_run(twins: Twins, rng: random.Random) -> None:
    """The kept model exported in eval mode (its weights as the device holds them), the bundle run by the runtime
    in this process, compared with the eager twin's eval output; back to train mode."""
    x, _ = twins.batch()
    folder = twins.folder / f"bundle{len(twins.log)}"
    twins.model.eval()
    try:
        torch_meganeura.export(twins.model, (x,), folder)
    finally:
        twins.model.train()
    got = next(iter(load(folder)(x.numpy()).values()))
    with torch.no_grad():
        want = twins.ref.eval()(x)
    twins.ref.train()
    _close(torch.from_numpy(got), want, twins, "bundle output")


def read_grads(twins: Twins, rng: random.Random) -> None:
    for (name, p), q in zip(twins.model.named_parameters(), twins.ref.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{name}.grad {p.grad} vs eager's {q.grad} {twins.where()}"
        if q.grad is not None:
            _close(p.grad, q.grad, twins, f"{name}.grad")


def read_state(twins: Twins, rng: random.Random) -> None:
    want = twins.ref.state_dict()
    for name, value in twins.model.state_dict().items():
        _close(value, want[name], twins, name)


def eager_write(twins: Twins, rng: random.Random) -> None:
    """An in-place write from eager code to one parameter, in both."""
    k = rng.randrange(len(list(twins.ref.parameters())))
    for _, model, _ in twins.pairs():
        with torch.no_grad():
            list(model.parameters())[k].mul_(0.9)


def snapshot_or_restore(twins: Twins, rng: random.Random) -> None:
    """Keep the eager twin's state; the next time, load it into both."""
    if twins.snapshot is None:
        twins.snapshot = copy.deepcopy(twins.ref.state_dict())
        return
    for _, model, _ in twins.pairs():
        model.load_state_dict(twins.snapshot)
    twins.snapshot = None


def collect(twins: Twins, rng: random.Random) -> None:
    gc.collect()


ACTIONS = {f.__name__: f for f in (step, short_batch_step, accumulate, gradient_check_then_step, clip_then_step,
                                   change_lr, eval_forward, eager_forward, export_and_run, read_grads, read_state,
                                   eager_write, snapshot_or_restore, collect)}
# steps weigh double: the other actions act between steps
WEIGHTED = [*ACTIONS, "step", "step"]


def _run_sequence(seed: int, tmp: Path, models: int = 1) -> None:
    """``LENGTH`` actions on each of ``models`` kept models alive at once, taking turns at random (their runs, and
    the runs one records ahead, share one device and its pool of buffers)."""
    rng = random.Random(seed)
    torch._dynamo.reset()
    all_twins = [Twins(seed * 10 + m, tmp / f"model{m}", kind=list(MODELS)[(seed + m) % len(MODELS)],
                       optimizer=list(OPTIMIZERS)[(seed // 2 + m) % len(OPTIMIZERS)]) for m in range(models)]
    turns = [t for t in all_twins for _ in range(LENGTH - 1)]
    rng.shuffle(turns)
    for twins in turns:
        name = rng.choice(WEIGHTED)
        twins.log.append(name)
        ACTIONS[name](twins, rng)
    for twins in all_twins:
        twins.log.append("step")
        step(twins, rng)
        read_grads(twins, rng)
        read_state(twins, rng)


@pytest.fixture
def collector_running(monkeypatch):
    """The suite pauses the garbage collector during tests (conftest.py); users' processes run it. Every plan records
    its next run ahead, as a full-size model's do (these plans are shorter than ``AHEAD_MIN_DISPATCHES``)."""
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", 1)
    gc.enable()
    yield
    gc.disable()


@pytest.mark.parametrize("seed", range(2))
def test_a_random_sequence_around_the_loop_matches_eager(seed, collector_running, tmp_path):
    _run_sequence(seed, tmp_path)


@pytest.mark.parametrize("seed", [0])
def test_two_models_taking_turns_match_eager(seed, collector_running, tmp_path):
    _run_sequence(seed, tmp_path, models=2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 40))
def test_more_random_sequences_around_the_loop_match_eager(seed, collector_running, tmp_path):
    _run_sequence(seed, tmp_path, models=1 + seed % 3)
