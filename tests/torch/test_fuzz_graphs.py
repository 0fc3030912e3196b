"""Differential fuzz: small random programs run three ways (eager float32, backend="meganeura", compile_train_step),
outputs and every gradient judged against float64 with eager float32's own error as the yardstick.

A program is a chain of steps over a (batch, seq, width) stream: matmuls (also over a transposed view), selects
and slices feeding and fed by matmuls, pointwise functions, row reductions (amax, logsumexp, softmax, RMS), residual
adds of earlier values, an embedding gather of an int input, and attention (SDPA with heads, causal or not). Half
the seeds force the unfused attention path (matmul-softmax-matmul, ``UNFUSED_MIN_KEYS`` 1), the others keep the
fused kernels at these short lengths. Any bug of the kind a single-op test misses (a view composed wrongly with its
neighbours: the coordinate renaming that made select(0) of a matmul output read row 0) shows as one program's
error far beyond eager's."""
import random
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers.compare import EAGER_ERROR_FACTOR, ERROR_FLOOR, Compiles, assert_within_eager_error
from torch_meganeura import compile_train_step
from torch_meganeura.lower.aten import attention

VOCAB = 11
FAST_SEEDS = range(6)  # the default run; the slow stage runs SLOW_SEEDS more
SLOW_SEEDS = range(6, 40)


class Program:
    """A random chain of steps; ``run(x, ids, *weights)`` returns the stream, ``weights`` the parameter shapes."""

    def __init__(self, seed: int):
        rng = random.Random(seed)
        self.batch, self.seq, self.width = rng.choice([1, 2]), rng.choice([3, 8]), rng.choice([8, 16])
        self.steps = [rng.choice(STEPS) for _ in range(rng.randint(3, 6))]
        if not any(step in WEIGHTS for step in self.steps):
            self.steps.append(_linear)  # the resident step needs a parameter to train
        self.choices = [rng.random() for _ in self.steps]
        self.shapes = []
        for step in self.steps:
            self.shapes += [shape(self) for shape in WEIGHTS.get(step, ())]

    def run(self, x, ids, *weights):
        weights, history, h = iter(weights), [x], x
        for step, choice in zip(self.steps, self.choices):
            h = step(self, h, ids, weights, history, choice)
            history.append(h)
        return h

    def describe(self) -> str:
        return " -> ".join(step.__name__.lstrip("_") for step in self.steps)


def _linear(p, h, ids, w, history, c):
    return h @ next(w)


def _linear_over_seq(p, h, ids, w, history, c):
    """A matmul of the transposed view: mixes positions."""
    return (h.transpose(1, 2) @ next(w)).transpose(1, 2)


def _select_of_matmul(p, h, ids, w, history, c):
    """The first batch row of a matmul output, broadcast back (the select-after-matmul pattern)."""
    return h + torch.tanh(h @ next(w))[0]


def _slice_roll(p, h, ids, w, history, c):
    k = 1 + int(c * (p.seq - 1)) if p.seq > 1 else 0
    return torch.cat([h[:, k:], h[:, :k]], 1) * 0.5 + h


def _pointwise(p, h, ids, w, history, c):
    fns = [torch.tanh, torch.sigmoid, F.gelu, lambda t: t * t * 0.25, lambda t: torch.exp(-t * t)]
    return fns[int(c * len(fns))](h)


def _residual(p, h, ids, w, history, c):
    earlier = history[int(c * len(history))]
    return h + earlier.transpose(1, 2).transpose(1, 2)


def _row_reduce(p, h, ids, w, history, c):
    fns = [lambda t: t - t.amax(-1, keepdim=True), lambda t: torch.logsumexp(t, -1, keepdim=True) - t,
           lambda t: torch.softmax(t, -1), lambda t: t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-5)]
    return fns[int(c * len(fns))](h)


def _embedding(p, h, ids, w, history, c):
    return h + F.embedding(ids, next(w))


def _attention(p, h, ids, w, history, c):
    heads = 2 if c < 0.5 else 1
    b, s, d = h.shape

    def split(t):
        return t.view(b, s, heads, d // heads).transpose(1, 2)

    q, k, v = split(h), split(h @ next(w)), split(h @ next(w))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=c > 0.25)
    return o.transpose(1, 2).reshape(b, s, d) + h


STEPS = [_linear, _linear_over_seq, _select_of_matmul, _slice_roll, _pointwise, _residual, _row_reduce, _embedding,
         _attention]
WEIGHTS = {
    _linear: [lambda p: (p.width, p.width)],
    _linear_over_seq: [lambda p: (p.seq, p.seq)],
    _select_of_matmul: [lambda p: (p.width, p.width)],
    _embedding: [lambda p: (VOCAB, p.width)],
    _attention: [lambda p: (p.width, p.width)] * 2,
}


class _Weights(torch.nn.Module):
    def __init__(self, tensors):
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in tensors])


def _inputs(program: Program, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(program.batch, program.seq, program.width, generator=g)
    ids = torch.randint(0, VOCAB, (program.batch, program.seq), generator=g)
    weights = [torch.randn(shape, generator=g) / shape[0] ** 0.5 for shape in program.shapes]
    cotangent = torch.randn(program.batch, program.seq, program.width, generator=g)
    return x, ids, weights, cotangent


def _eager(program, x, ids, weights, cotangent, dtype):
    leaves = [t.detach().clone().to(dtype).requires_grad_() for t in [x, *weights]]
    out = program.run(leaves[0], ids, *leaves[1:])
    (out * cotangent.to(dtype)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _backend(program, x, ids, weights, cotangent):
    torch._dynamo.reset()
    leaves = [t.detach().clone().requires_grad_() for t in [x, *weights]]
    compiled = torch.compile(program.run, backend="meganeura", options={"fallback": "error"})
    out = compiled(leaves[0], ids, *leaves[1:])
    (out * cotangent).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _resident_step(program, x, ids, weights, cotangent):
    """Gradients of the weights (the step's parameters; x is a batch input) and the loss."""
    model = _Weights(weights)

    def loss_fn(m, x, ids, cot):
        return (program.run(x, ids, *m.w) * cot).sum()

    step = compile_train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.0))
    loss, grads = step.gradients(x, ids, cotangent)
    return loss, [grads[f"w.{i}"] for i in range(len(weights))]


def _check(seed: int, monkeypatch):
    program = Program(seed)
    if seed % 2:
        monkeypatch.setattr(attention, "UNFUSED_MIN_KEYS", 1)
    x, ids, weights, cot = _inputs(program, seed)
    exact, exact_grads = _eager(program, x, ids, weights, cot, torch.float64)
    eager, eager_grads = _eager(program, x, ids, weights, cot, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, got_grads = _backend(program, x, ids, weights, cot)
        loss, step_grads = _resident_step(program, x, ids, weights, cot)
    what = f"seed {seed} ({program.describe()})"
    assert_within_eager_error(got, eager, exact, what=f"{what}: backend output")
    names = ["x"] + [f"w{i}" for i in range(len(weights))]
    for name, g, e, want in zip(names, got_grads, eager_grads, exact_grads):
        assert_within_eager_error(g, e, want, what=f"{what}: backend grad of {name}")
    _check_sum(loss, (eager * cot).sum(), exact * cot.double(), what=f"{what}: resident step loss")
    for name, g, e, want in zip(names[1:], step_grads, eager_grads[1:], exact_grads[1:]):
        assert_within_eager_error(g, e, want, what=f"{what}: resident step grad of {name}")


def _check_sum(got, eager, exact_terms, what: str) -> None:
    """A sum's error against float64, as a fraction of the sum of its terms' magnitudes (the sum's own size can be
    far smaller where terms cancel: its relative error is then rounding noise amplified by the cancellation)."""
    exact, scale = exact_terms.sum().item(), exact_terms.abs().sum().item()
    ours, theirs = abs(got.item() - exact) / scale, abs(eager.item() - exact) / scale
    assert ours <= EAGER_ERROR_FACTOR * theirs + ERROR_FLOOR, (
        f"{what}: error {ours:.3g} of the terms' magnitude, eager float32's {theirs:.3g}")


def _check_symbolic(seed: int, monkeypatch):
    """The backend with every size symbolic (``dynamic=True``: one plan for any size), forward and backward, at the
    program's sizes and at a longer sequence where no weight's shape depends on it."""
    program = Program(seed)
    if seed % 2:
        monkeypatch.setattr(attention, "UNFUSED_MIN_KEYS", 1)
    torch._dynamo.reset()  # (also empties the shared graphs: each seed compiles its own plans)
    compiled = torch.compile(program.run, backend="meganeura", dynamic=True, options={"fallback": "error"})
    first = program.seq
    longer = [] if _linear_over_seq in program.steps else [first + 3]
    for seq in [first, *longer]:
        program.seq = seq
        x, ids, weights, cot = _inputs(program, seed)
        exact, exact_grads = _eager(program, x, ids, weights, cot, torch.float64)
        eager, eager_grads = _eager(program, x, ids, weights, cot, torch.float32)
        leaves = [t.detach().clone().requires_grad_() for t in [x, *weights]]
        with warnings.catch_warnings(), Compiles() as compiles:
            warnings.simplefilter("ignore")
            got = compiled(leaves[0], ids, *leaves[1:])
            (got * cot).sum().backward()
        what = f"seed {seed} ({program.describe()}), symbolic sizes at seq {seq}"
        if seq == first and _slice_roll not in program.steps:  # (its offset, an int of the length, specialises it)
            assert compiles.dynamic, f"{what}: no plan was compiled over symbolic sizes"
        assert_within_eager_error(got.detach(), eager, exact, what=f"{what}: output")
        names = ["x"] + [f"w{i}" for i in range(len(weights))]
        for name, leaf, e, want in zip(names, leaves, eager_grads, exact_grads):
            assert_within_eager_error(leaf.grad, e, want, what=f"{what}: grad of {name}")


WAYS = {"three_ways": _check, "with_symbolic_sizes": _check_symbolic}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_random_program(seed, way, monkeypatch):
    WAYS[way](seed, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_random_program_more_seeds(seed, way, monkeypatch):
    WAYS[way](seed, monkeypatch)
