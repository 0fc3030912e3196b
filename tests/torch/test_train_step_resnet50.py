"""Device-resident training of a full HF ResNet-50 (BatchNorm, 64x64 images in batches of 4) against eager: 50 steps
of AdamW (weight decay, cosine LR schedule) and 50 of SGD with momentum and weight decay.

Every step starts both sides from eager's state (parameters, BatchNorm statistics, optimizer state, LR). Each step:
the loss matches eager's within 1e-4 relative; each parameter is the optimizer's formula applied to the device's
own states (elementwise, rtol 1e-5, atol 1e-7); the BatchNorm statistics match eager's elementwise (rtol 1e-3,
atol 1e-5).

The optimizer states after the step (the moments carry the gradients) are compared with the same step taken in
float64. Their float32 error is mostly one random draw: the forward's rounding reaches the loss gradient (softmax -
onehot of 4 images and 2 classes: a handful of independent numbers), and the backward, where BatchNorm over 4
images makes many gradients sums that mostly cancel, carries it into every gradient amplified hundreds of times
(all moments are 2% from float64 at step 1, for eager as for the device). One implementation's distance from
float64 is thus one draw from a wide distribution, and "within twice eager's distance" failed at some step for any
float32 implementation: the device at AdamW's step 10 (its loss gradient 2.3e-5 from float64, eager's 1.2e-5, and
every convolution's moments about twice as far as eager's), and as well eager itself in channels_last with oneDNN
off (3.2 times eager's default at AdamW's step 3). So the scale is the spread of three float32 implementations of
the same step: eager, eager in channels_last (oneDNN's NHWC kernels) and eager with oneDNN off (PyTorch's own
convolutions). With d(x) the relative L2 distance from float64:
  * each step, d(all moments together) within 8 times the largest of the three: a gross error at any step (zeros,
    a stale buffer, a wrong formula are orders of magnitude beyond rounding). The bound is twice the most a correct
    implementation reached: over the 100 steps of both tests, each of the three against the largest of the other
    two reached 2.7 to 3.9 times (eager 2.7 and 3.7, channels_last 3.9 and 3.7, oneDNN off 1.7 and 3.3), and the
    device against the largest of the three reached 4.2 at AdamW's step 27 (its geometric mean there 0.54). A bound
    of 4 thus failed correct implementations; precision lost at every step is the next check's job;
  * over the 50 steps, the geometric mean of d(all moments) over the three's geometric mean at most 2: a step
    systematically less precise than eager's. A fourth correct implementation (channels_last with oneDNN off) gave
    1.31 over the first 10 AdamW steps; convolutions 7e-7 less precise per element give 7.1, and BatchNorm's
    epsilon 2e-5 instead of 1e-5 gives 5.0;
  * each state tensor, each step: closer than 0.5 (garbage: zeros, a stale buffer), and no more than 1% of them
    beyond 10 times the largest of the three and 5e-2. One float32 rounding can flip a ReLU whose input lies within
    1e-4 of zero, and with 16 values per channel in the last stage that moves a few tensors by far more than
    rounding: at AdamW's step 3, eager in channels_last with oneDNN off moved a last-stage BatchNorm bias's second
    moment 1.5e-1 from float64, 44 times the three's largest;
  * each state tensor, over the 50 steps, the geometric mean of its d over the three's at most 2: an error confined
    to tensors whose own rounding is small. A loss gradient scaled by (1 + 1e-3), the loss unchanged, moves the
    classifier's moments 100 times farther than rounding does, which only this check sees.

Why the update is checked against the device's own moments rather than eager's update: AdamW moves a weight by
about lr times the sign of its gradient at first, and a gradient made mostly of rounding (a convolution before
BatchNorm sums terms that cancel) may flip sign between two correct float32 implementations: at step 1, 0.7% of
the stem convolution's updates differ from eager's that way.

Not one free-running trajectory per side, because ResNet-50 trained from scratch on batches of 4 is chaotic in
float32: on the CPU, eager float32 and eager float64 part by 2e-3 in the loss at AdamW's second step
(lr 1e-4) and by 5e-2 within 50 steps, and SGD with momentum (lr 1e-3) parts by 2e-2 at step 2. Any two float32
implementations that round differently part the same way, so a free-running comparison would measure the chaos,
not the implementation. Anchored, the same 50 steps are checked (optimizer state, step counts and statistics
evolving as in training) without that amplification.

Marked slow: on lavapipe a step takes a minute or two, so the default run (CI) leaves it out; run it with
``pytest -m slow -s tests/torch/test_train_step_resnet50.py`` (``-s`` prints every step's distances). The small
models of test_train_step cover the same paths in the default run."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from helpers.models import resnet50
from torch_meganeura import compile_train_step

pytestmark = pytest.mark.slow
STEPS = 50
FLOAT32 = ("eager", "channels_last", "native")  # float32 implementations of the step, besides the device's


def _loss(model, x, y):
    return F.cross_entropy(model(x).logits, y)


def _batch(i):
    gen = torch.Generator().manual_seed(2000 + i)
    return torch.randn(4, 3, 64, 64, generator=gen), torch.randint(0, 2, (4,), generator=gen)


def _rel(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _expected_param(before, state, group):
    """The parameter after the update that ``state`` (after the step) implies, by torch's AdamW or SGD formula."""
    lr, decay = group["lr"], group["weight_decay"]
    if "exp_avg" in state:
        (beta1, beta2), step = group["betas"], float(state["step"])
        denom = state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step) + group["eps"]
        return before * (1 - lr * decay) - lr / (1 - beta1**step) * state["exp_avg"] / denom
    return before - lr * state["momentum_buffer"]  # SGD, momentum without nesterov (decay is in the buffer)


def _step_eagerly(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = _loss(model, x, y)
    loss.backward()
    optimizer.step()
    return loss


def _reference_states(ref, ref_opt, kind, options, x, y) -> dict:
    """The optimizer states after this step from eager's state (before eager takes it), by side and parameter name:
    float64, and two float32 implementations that round differently from eager's: the model and batch in
    channels_last (oneDNN's NHWC kernels) and oneDNN off (PyTorch's own convolutions)."""
    sides = {}
    for side in ("float64", "channels_last", "native"):
        model, batch = copy.deepcopy(ref), x
        if side == "float64":
            model, batch = model.double(), x.double()
        if side == "channels_last":
            model, batch = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        optimizer = kind(model.parameters(), **options)
        optimizer.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # else float32 states are shared
        with torch.backends.mkldnn.flags(enabled=side != "native"):
            _step_eagerly(model, optimizer, batch, y)
        sides[side] = {name: optimizer.state[p] for name, p in model.named_parameters()}
    return sides


def _geomean(values) -> float:
    return math.exp(sum(math.log(max(v, 1e-12)) for v in values) / len(values))


def _check_distances(steps: list[dict]) -> None:
    """``steps``: per step, each side's distance from float64 of all moments together ("all") and of each state
    tensor (by "name.slot"). The checks of the module docstring, with every figure in the messages."""
    table = "\n".join(f"step {i + 1}: " + " ".join(f"{side} {d['all']:.2e}" for side, d in s.items())
                      for i, s in enumerate(steps))
    spread = [max(s[side]["all"] for side in FLOAT32) for s in steps]
    for i, (s, most) in enumerate(zip(steps, spread)):
        assert s["device"]["all"] <= max(8 * most, 1e-6), f"step {i + 1}: all moments\n{table}"
    typical = [_geomean([s[side]["all"] for side in FLOAT32]) for s in steps]
    ratio = _geomean([s["device"]["all"] / t for s, t in zip(steps, typical)])
    assert ratio <= 2, f"all moments: device over float32 eager, geometric mean over the steps {ratio:.2f}\n{table}"
    per_tensor = {}
    for i, s in enumerate(steps):
        outliers = {}
        for key, got in s["device"].items():
            if key == "all":
                continue
            refs = [s[side][key] for side in FLOAT32]
            assert got < 0.5, f"step {i + 1}: {key} off float64 by {got:.2e}, float32 by {refs}"
            if got >= max(10 * max(refs), 5e-2):
                outliers[key] = f"{got:.2e} (float32: {max(refs):.2e})"
            per_tensor.setdefault(key, []).append(max(got, 1e-12) / max(_geomean(refs), 1e-12))
        assert len(outliers) <= len(s["device"]) // 100, f"step {i + 1}: outliers {outliers}"
    worst = sorted(((_geomean(r), key) for key, r in per_tensor.items()), reverse=True)[:5]
    print("per tensor, geometric mean of device over float32 eager:", worst)
    assert worst[0][0] <= 2, f"per tensor, device over float32 eager, geometric mean over the steps: {worst}"


def _anchored_steps(kind, **options):
    torch.manual_seed(0)
    model = resnet50().train()
    ref = copy.deepcopy(model)
    opt, ref_opt = kind(model.parameters(), **options), kind(ref.parameters(), **options)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, STEPS)
    step = compile_train_step(model, _loss, opt)
    distances = []
    for i in range(STEPS):
        if i:  # both sides start the step from eager's state
            model.load_state_dict(ref.state_dict())
            opt.load_state_dict(ref_opt.state_dict())
            step.load_from_module()
        before = {n: p.detach().clone() for n, p in ref.named_parameters()}
        x, y = _batch(i)
        sides = _reference_states(ref, ref_opt, kind, options, x, y)
        got = float(step(x, y))
        want = _step_eagerly(ref, ref_opt, x, y)
        sched.step()
        assert abs(got - float(want)) <= 1e-4 * abs(float(want)), f"step {i + 1}: loss {got} vs eager {float(want)}"
        step.sync_to_module()
        ours = dict(model.named_parameters())
        sides["device"] = {name: opt.state[p] for name, p in ours.items()}
        sides["eager"] = {name: ref_opt.state[p] for name, p in ref.named_parameters()}
        group = opt.param_groups[0]
        for name, p in ours.items():
            torch.testing.assert_close(p.detach(), _expected_param(before[name], opt.state[p], group),
                                       rtol=1e-5, atol=1e-7, msg=lambda m: f"step {i + 1}: {name}: {m}")
        slots = [(name, slot) for name, state in sides["eager"].items() for slot in state if slot != "step"]
        exact = [sides["float64"][name][slot].double().reshape(-1) for name, slot in slots]
        exact_all = torch.cat(exact)
        distances.append({})
        for side in ("device", *FLOAT32):
            tensors = [sides[side][name][slot].double().reshape(-1) for name, slot in slots]
            d = {f"{name}.{slot}": _rel(t, e) for (name, slot), t, e in zip(slots, tensors, exact)}
            distances[-1][side] = {"all": _rel(torch.cat(tensors), exact_all), **d}
        print(f"step {i + 1}: all moments off float64 by",
              {side: f"{d['all']:.2e}" for side, d in distances[-1].items()}, flush=True)
        buffers = dict(model.named_buffers())
        for name, b in ref.named_buffers():
            torch.testing.assert_close(buffers[name].to(b.dtype), b, rtol=1e-3, atol=1e-5,
                                       msg=lambda m: f"step {i + 1}: {name}: {m}")
    _check_distances(distances)


def test_adamw_cosine_resnet50_50_anchored_steps():
    _anchored_steps(torch.optim.AdamW, lr=1e-4, weight_decay=0.01)


def test_sgd_momentum_resnet50_50_anchored_steps():
    _anchored_steps(torch.optim.SGD, lr=1e-3, momentum=0.9, weight_decay=0.01)
