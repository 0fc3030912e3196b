"""Device-resident training of a full HF ResNet-50 (BatchNorm, 64x64 images in batches of 4) against eager: 50 steps
of AdamW (weight decay, cosine LR schedule) and 50 of SGD with momentum and weight decay.

Every step starts both sides from eager's state (parameters, BatchNorm statistics, optimizer state, LR): the step's
loss must match eager's within 1e-4 relative; the optimizer states after it (the moments carry the gradients) are
compared with the same step taken in float64, against eager float32's own distance from it:
  * all moments of the step together (one relative L2 over every state tensor) within twice eager's distance;
  * the median over state tensors of the device's distance over eager's at most 2 (no kernel systematically less
    precise than eager's);
  * each state tensor within ten times eager's distance, or 5e-2 relative L2.
The per-tensor allowance is wide because one float32 rounding can flip a ReLU whose input lies within 1e-4 of zero:
with 16 values per channel in the last stage, that moves the gradients of the stage's weights by far more than
eager's rounding, and eager's own distance is a single draw. At step 6 the device flipped 1 such ReLU of 3 in the
last block and eager none, while the device's forward there was closer to float64 than eager's; the moments of that
block's first convolution then moved by 3.2e-3 from float64 against eager's 4.8e-5 (AdamW), and a BatchNorm bias's
by 2.2e-2 (SGD). A wrong kernel moves tensors by more and shifts the whole step.
Each parameter must be the optimizer's formula applied to the device's own states (elementwise, rtol 1e-5, atol
1e-7); the BatchNorm statistics must match eager's elementwise (rtol 1e-3, atol 1e-5). The float64 reference
matters: with BatchNorm over 4 images many gradients are sums that mostly cancel, and eager float32 is 2% from
float64 on some of them at step 1 (the device is closer).

Not one free-running trajectory per side, because ResNet-50 trained from scratch on batches of 4 is chaotic in
float32: on the CPU, eager float32 and eager float64 part by 2e-3 in the loss at AdamW's second step
(lr 1e-4) and by 5e-2 within 50 steps, and SGD with momentum (lr 1e-3) parts by 2e-2 at step 2. Any two float32
implementations that round differently part the same way, so a free-running comparison would measure the chaos,
not the implementation. Anchored, the same 50 steps are checked (optimizer state, step counts and statistics
evolving as in training) without that amplification.

Where "k times eager's distance" is fragile even anchored: the backward of this network amplifies the error of the
loss gradient hundreds of times. At AdamW's step 10 (from eager's state) the device's logits are 3.7e-5 from
float64 against eager's 2.8e-5, the loss gradient 2.3e-5 against 1.2e-5, and then every convolution's first moment
7.0e-3 against 3.3e-3: the same ratio of about 2 in all of them, one rounding draw of the forward carried through
the whole backward (found by comparing the logits and softmax - onehot with float64 at that step). Both tests have
failed on this so far, at AdamW's step 10 and SGD's step 8, on the check of all moments together (3.4 and 2.02
times eager's distance).

Why the update is checked against the device's own moments rather than eager's update: AdamW moves a weight by
about lr times the sign of its gradient at first, and a gradient made mostly of rounding (a convolution before
BatchNorm sums terms that cancel) may flip sign between two correct float32 implementations: at step 1, 0.7% of
the stem convolution's updates differ from eager's that way.

Marked slow: on lavapipe a step takes seconds, so the default run (CI) leaves it out; run it with
``pytest -m slow tests/torch/test_train_step_resnet50.py``. The small models of test_train_step cover the same
paths in the default run."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from test_vision_models import resnet50
from torch_meganeura import compile_train_step

pytestmark = pytest.mark.slow
STEPS = 50


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


def _anchored_steps(kind, **options):
    torch.manual_seed(0)
    model = resnet50().train()
    ref = copy.deepcopy(model)
    opt, ref_opt = kind(model.parameters(), **options), kind(ref.parameters(), **options)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, STEPS)
    step = compile_train_step(model, _loss, opt)
    for i in range(STEPS):
        if i:  # both sides start the step from eager's state
            model.load_state_dict(ref.state_dict())
            opt.load_state_dict(ref_opt.state_dict())
            step.load_from_module()
        before = {n: p.detach().clone() for n, p in ref.named_parameters()}
        exact = copy.deepcopy(ref).double()  # the same step in float64 from the same state
        exact_opt = kind(exact.parameters(), **options)
        exact_opt.load_state_dict(ref_opt.state_dict())
        x, y = _batch(i)
        got = float(step(x, y))
        want = _step_eagerly(ref, ref_opt, x, y)
        _step_eagerly(exact, exact_opt, x.double(), y)
        sched.step()
        assert abs(got - float(want)) <= 1e-4 * abs(float(want)), f"step {i + 1}: loss {got} vs eager {float(want)}"
        step.sync_to_module()
        ours = dict(model.named_parameters())
        group = opt.param_groups[0]
        exact_params = dict(exact.named_parameters())
        flat = {"device": [], "eager": [], "float64": []}
        ratios = []
        for name, p in ref.named_parameters():
            state, exact_state = opt.state[ours[name]], exact_opt.state[exact_params[name]]
            for slot, value in ref_opt.state[p].items():
                if slot != "step":
                    eager = _rel(value, exact_state[slot])
                    rel = _rel(state[slot], exact_state[slot])
                    assert rel < max(10 * eager, 5e-2), (f"step {i + 1}: {slot} of {name} off float64 by {rel:.2e}, "
                                                        f"eager by {eager:.2e}")
                    ratios.append(rel / max(eager, 1e-12))
                    for side, t in zip(flat, (state[slot], value, exact_state[slot])):
                        flat[side].append(t.double().reshape(-1))
            torch.testing.assert_close(ours[name].detach(), _expected_param(before[name], state, group),
                                       rtol=1e-5, atol=1e-7, msg=lambda m: f"step {i + 1}: {name}: {m}")
        exact_all = torch.cat(flat["float64"])
        together = {side: _rel(torch.cat(flat[side]), exact_all) for side in ("device", "eager")}
        assert together["device"] <= max(2 * together["eager"], 1e-6), f"step {i + 1}: all moments: {together}"
        median = sorted(ratios)[len(ratios) // 2]
        assert median <= 2, f"step {i + 1}: median distance from float64, device over eager: {median:.2f}"
        buffers = dict(model.named_buffers())
        for name, b in ref.named_buffers():
            torch.testing.assert_close(buffers[name].to(b.dtype), b, rtol=1e-3, atol=1e-5,
                                       msg=lambda m: f"step {i + 1}: {name}: {m}")


def test_adamw_cosine_resnet50_50_anchored_steps():
    _anchored_steps(torch.optim.AdamW, lr=1e-4, weight_decay=0.01)


def test_sgd_momentum_resnet50_50_anchored_steps():
    _anchored_steps(torch.optim.SGD, lr=1e-3, momentum=0.9, weight_decay=0.01)
