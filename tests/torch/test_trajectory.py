"""Trajectories: optimizer steps on the device against the same steps in float64, eager float32 as the yardstick.

Each case trains a small model for a few steps (SGD with momentum, Adam or AdamW) through the resident step
(``compile_train_step``) or the ordinary loop (``torch.compile(model, backend="meganeura")`` with
``keep_on_device(optimizer)``), and the same steps in eager float64. Every final parameter must be within
``FACTOR`` times eager float32's distance from the float64 weights (L2 per parameter).

Eager float32's distance is measured on ``1 + NUDGED_RUNS`` eager float32 runs: the run from the model's weights, and
runs from weights nudged by at most one ulp each (each element moved one ulp up or down, or left, at random: the
rounding that storing the weights in float32 already implies). The yardstick is their root mean square. A single eager
run is one sample of a noisy quantity: after 8 AdamW steps of a GPT-2 (n_embd 96, batch 8 x 64) the eager run with its
batch reversed, as exact as the eager run itself, was up to 4.0x the eager run's distance on one parameter (a bias,
whose error comes from a few elements), while the geometric mean of the ratio over the parameters was 1.0-1.26. Ours was
0.75-0.97 by that mean and up to 2.4x against the single run, within the same noise.

The CNNs take GELU for their ReLU (ReLU6): a ReLU's kink makes a trajectory's distance discrete. A pre-activation
within rounding of 0 lands on either side in any float32 run, and its mask, flipped, moves everything upstream by far
more than rounding: ResNet 64x64, batch 4, SGD through the resident step, step 4 met a pre-activation 6.1e-7 from 0 in
float64 and ours took the other side (stem weight 1.3e-4 from float64 after 8 steps, eager 7.5e-8); eager took it on
MobileNetV2 at 128x128 (stem gradient 1.1e-2 from float64, ours 1.0e-5). Such a flip says nothing of a 2x bound.

A parameter whose gradient is 0 in exact arithmetic (the key bias of attention; the float64 run finds it: its
gradient at every step is below ``ZERO_GRADIENT`` of all the gradients' norm) moves in float32 by rounding noise alone
(Adam turns noise into steps of about lr) and hardly in float64. Its distance is a draw of that noise, spread far wider
than a sum of many roundings: AutoencoderKL (scale 2, Adam, 8 steps), the decoder's key bias, in 16 eager runs (the
plain one and 15 nudged): 1.3e-5 to 8.8e-5, the largest 1.9x the RMS of the first three. Our attention backward's
noise on its gradient is eager's (one step, that attention's inputs from the float64 run, RMS over 30 ulp-nudged
inputs: 1.09x eager's in the decoder, 0.77x in the encoder), but single draws of ours landed at 2.04x (the loop) and
1.28x (the resident step) of that RMS. Such a parameter is judged, as the issue has it, by eager's own distance from
float64: the farthest of eager's runs, times ``FACTOR`` (ours through the loop: 9.4e-5 against the farthest of three,
6.0e-5). A wrong gradient there is not noise: it moves each element by about lr every step in one direction, 4.5e-2
over 8 steps of 32 elements, 500x the farthest eager run.

The default cases are tiny (GPT-2 with AdamW through the resident step, ResNet with SGD through the loop: 13-30 s on two
cores with lavapipe); ``-m slow`` runs every family, optimizer and path at larger sizes, the issue's GPT-2 (n_embd 96,
2 layers, vocabulary 503, 8 AdamW steps) among them.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import torch_meganeura
from helpers.compare import meganeura_warnings

FACTOR = 2.0  # ours may be this many times eager float32's distance from float64
NUDGED_RUNS = 2  # eager float32 runs from nudged weights, beside the plain one (each ~0.1-1 s on the CPU)
# A parameter that eager float32 computes exactly (a BatchNorm bias followed by another BatchNorm, whose gradient
# is 0 in exact arithmetic, summed to exactly 0 by eager) leaves no yardstick: ours may be a few ulps off there.
FLOOR = 2.0 ** -21  # 4 float32 ulps at 1, relative to the RMS of all the float64 weights, per element
STEPS = 8
# float64 rounds a sum to ~1e-16 of its terms: a gradient below this fraction of all the gradients' norm at every step
# of the float64 run is 0 in exact arithmetic (AutoencoderKL's key biases at scale 2: 3.5e-18 at most; the smallest
# other gradient of GPT-2, T5, ResNet and AutoencoderKL there: 3.2e-4)
ZERO_GRADIENT = 1e-10


# ------------------------------------------------------------------------------------------------ the models
# Each builder returns (model, batches, loss_fn): ``loss_fn(model, *batch)`` is the loss of one batch.


def _no_dropout(config):
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and "drop" in key:
            setattr(config, key, 0.0)
    return config


def gpt2(scale: int = 1):
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, width, layers, batch, seq = (64, 32, 1, 2, 8) if scale == 1 else (503, 96, 2, 4, 32)
    model = GPT2LMHeadModel(_no_dropout(GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=4,
                                                   n_positions=seq)))
    batches = [(torch.randint(0, vocab, (batch, seq)),) for _ in range(3)]
    return model, batches, lambda m, ids: m(ids, labels=ids).loss


def mobilenet_v2(scale: int = 1):
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    size, batch = 96, 4  # smaller images leave BatchNorms of 1x1 or 2x2 pixels, nearly singular: slow sweep only
    model = MobileNetV2ForImageClassification(_no_dropout(MobileNetV2Config(
        image_size=size, depth_multiplier=0.35, num_labels=5, hidden_act="gelu")))
    batches = [(torch.randn(batch, 3, size, size), torch.randint(0, 5, (batch,))) for _ in range(3)]
    return model, batches, lambda m, x, y: m(x, labels=y).loss


def resnet(scale: int = 1):
    from transformers import ResNetConfig, ResNetForImageClassification

    size, batch = (32, 4) if scale == 1 else (64, 4)
    model = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                      layer_type="basic", num_labels=5, hidden_act="gelu"))
    batches = [(torch.randn(batch, 3, size, size), torch.randint(0, 5, (batch,))) for _ in range(3)]
    return model, batches, lambda m, x, y: m(x, labels=y).loss


def autoencoder_kl(scale: int = 1):
    diffusers = pytest.importorskip("diffusers")

    size = 16 if scale == 1 else 32
    model = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16) if scale == 1 else (16, 32),
        norm_num_groups=4 if scale == 1 else 8, latent_channels=4, sample_size=size)
    batches = [(torch.randn(1, 3, size, size),) for _ in range(3)]
    weight = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(7))
    return model, batches, lambda m, x: (m(x).sample * weight.to(x.dtype)).sum()


def t5(scale: int = 1):
    from transformers import T5Config, T5ForConditionalGeneration

    vocab, width = (64, 32) if scale == 1 else (256, 64)
    model = T5ForConditionalGeneration(_no_dropout(T5Config(
        vocab_size=vocab, d_model=width, d_kv=8, d_ff=2 * width, num_layers=1, num_decoder_layers=1, num_heads=4,
        decoder_start_token_id=0)))
    batches = [(torch.randint(1, vocab, (2, 8)), torch.randint(1, vocab, (2, 6))) for _ in range(3)]
    return model, batches, lambda m, ids, labels: m(input_ids=ids, labels=labels).loss


FAMILIES = {f.__name__: f for f in (gpt2, resnet, mobilenet_v2, autoencoder_kl, t5)}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=1e-2),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2),
}


# ------------------------------------------------------------------------------------------------ the runs


def _batch(batch, dtype):
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def train_eager(model: nn.Module, batches, loss_fn, make_optimizer, steps: int, dtype=torch.float32,
                gradient_norms: list | None = None) -> nn.Module:
    """The steps in eager PyTorch; ``gradient_norms`` (if given) receives each step's gradient norm per parameter."""
    model = copy.deepcopy(model).to(dtype)
    opt = make_optimizer(model.parameters())
    for i in range(steps):
        loss_fn(model, *_batch(batches[i % len(batches)], dtype)).backward()
        if gradient_norms is not None:
            gradient_norms.append([0.0 if p.grad is None else torch.linalg.vector_norm(p.grad).item()
                                   for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return model


def train_resident(model: nn.Module, batches, loss_fn, make_optimizer, steps: int) -> nn.Module:
    model = copy.deepcopy(model)
    step = torch_meganeura.compile_train_step(model, loss_fn, make_optimizer(model.parameters()))
    for i in range(steps):
        step(*batches[i % len(batches)])
    step.sync_to_module()
    return model


def train_loop(model: nn.Module, batches, loss_fn, make_optimizer, steps: int) -> nn.Module:
    model = copy.deepcopy(model)
    opt = make_optimizer(model.parameters())
    torch_meganeura.keep_on_device(opt)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="meganeura")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            loss_fn(compiled, *batches[i % len(batches)]).backward()
            opt.step()
            opt.zero_grad()
    assert not meganeura_warnings(caught), meganeura_warnings(caught)  # nothing ran in eager PyTorch instead
    torch_meganeura.sync_parameters(opt)
    return model


PATHS = {"resident": train_resident, "loop": train_loop}


def nudged(model: nn.Module, seed: int) -> nn.Module:
    """A copy whose weights each move one ulp up, one ulp down, or stay, at random."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            coin = torch.randint(-1, 2, p.shape, generator=g)
            toward = torch.where(coin > 0, torch.inf, -torch.inf).to(p.dtype)
            p.copy_(torch.where(coin == 0, p, torch.nextafter(p, toward)))
    return model


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.linalg.vector_norm(a.detach().double() - b.detach().double()).item()


def zero_in_exact_arithmetic(gradient_norms: list[list[float]]) -> list[bool]:
    """Per parameter, whether its float64 gradient was below ZERO_GRADIENT of all the gradients' norm at every step."""
    totals = [sum(n * n for n in step) ** 0.5 for step in gradient_norms]
    return [all(step[i] <= ZERO_GRADIENT * total for step, total in zip(gradient_norms, totals))
            for i in range(len(gradient_norms[0]))]


def trajectory_report(family: str, optimizer: str, path: str, scale: int = 1, steps: int = STEPS) -> list[tuple]:
    """(ratio, name, ours, eager's yardstick, the plain eager run's distance) for every parameter, worst first;
    ratio is FACTOR x ours / (FACTOR x yardstick + the floor), so a ratio above FACTOR fails. The yardstick is the
    RMS of eager's distances, or for a parameter whose gradient is 0 in exact arithmetic the largest of them."""
    torch.manual_seed(0)
    model, batches, loss_fn = FAMILIES[family](scale)
    model.train()
    make = OPTIMIZERS[optimizer]
    gradient_norms: list[list[float]] = []
    exact = train_eager(model, batches, loss_fn, make, steps, torch.float64, gradient_norms)
    zero = zero_in_exact_arithmetic(gradient_norms)
    eager = [train_eager(m, batches, loss_fn, make, steps)
             for m in [model] + [nudged(model, seed) for seed in range(NUDGED_RUNS)]]
    ours = PATHS[path](model, batches, loss_fn, make, steps)
    everything = torch.cat([p.detach().flatten() for p in exact.parameters()])
    ulps = FLOOR * torch.linalg.vector_norm(everything).item() / everything.numel() ** 0.5
    rows = []
    for (name, p), is_zero, *others in zip(ours.named_parameters(), zero, exact.parameters(),
                                           *[e.parameters() for e in eager]):
        want, runs = others[0], others[1:]
        distances = [distance(e, want) for e in runs]
        yardstick = max(distances) if is_zero else (sum(d * d for d in distances) / len(distances)) ** 0.5
        name = f"{name} (gradient 0 in exact arithmetic)" if is_zero else name
        allowed = FACTOR * yardstick + ulps * want.numel() ** 0.5
        got = distance(p, want)
        rows.append((FACTOR * got / allowed, name, got, yardstick, distance(runs[0], want)))
    return sorted(rows, key=lambda r: r[0], reverse=True)


def assert_trajectory(family: str, optimizer: str, path: str, scale: int = 1) -> None:
    rows = trajectory_report(family, optimizer, path, scale)
    print(f"\nTRAJECTORY {family} {optimizer} {path}: worst {rows[0][0]:.2f} at {rows[0][1]} "
          f"(ours {rows[0][2]:.3g}, eager {rows[0][3]:.3g}, plain eager run {rows[0][4]:.3g})")
    failures = [r for r in rows if not r[0] <= FACTOR]
    assert not failures, "\n".join(
        f"{name}: distance from float64 {got:.3g}, eager float32's {eager:.3g} (plain run {plain:.3g}): "
        f"{ratio:.2f} > {FACTOR}" for ratio, name, got, eager, plain in failures)


# ------------------------------------------------------------------------------------------------ the tests



@pytest.mark.parametrize("family,optimizer,path", [
    ("gpt2", "adamw", "resident"), ("resnet", "sgd", "loop")])
def test_trajectory_within_eager_error(family, optimizer, path):
    pytest.importorskip("transformers")
    assert_trajectory(family, optimizer, path)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_trajectory_sweep(family, optimizer, path):
    pytest.importorskip("transformers")
    assert_trajectory(family, optimizer, path, scale=2)
