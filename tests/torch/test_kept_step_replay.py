"""A kept optimizer's ``opt.step()`` replays the update it bound at the last step while its parameters, gradients and
state are the same objects (``training.bound_update``), and binds again when one of them changed. Each case runs
the kept loop (``keep_on_device``, through the backend) beside eager PyTorch from the same weights, makes the same
change to both between steps, and compares every parameter and optimizer state tensor after every step (the
training tests' tolerances: ``assert_close`` rtol 1e-3, atol 1e-4; step counts exactly). Which steps replayed is
read from the binding the kept optimizer holds: a case where the replay missed a change fails on the values.
"""
import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_meganeura

RTOL, ATOL = 1e-3, 1e-4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05)


def sgd(groups):
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


class Pair:
    """A kept loop and an eager loop from the same weights; ``step`` runs one step of each, with ``change(model,
    optimizer)`` applied to both between their backward and their step."""

    def __init__(self, make_optimizer, groups=lambda m: m.parameters()):
        torch.manual_seed(0)
        self.model = Net()
        self.ref = copy.deepcopy(self.model)
        self.opt, self.ref_opt = make_optimizer(groups(self.model)), make_optimizer(groups(self.ref))
        torch_meganeura.keep_on_device(self.opt)
        torch._dynamo.reset()
        self.compiled = torch.compile(self.model, backend="meganeura")
        self.x, self.y = torch.randn(8, 6), torch.randint(0, 4, (8,))

    def step(self, change=None):
        for model, forward, opt in ((self.model, self.compiled, self.opt), (self.ref, self.ref, self.ref_opt)):
            opt.zero_grad()
            F.cross_entropy(forward(self.x), self.y).backward()
            if change is not None:
                change(model, opt)
            opt.step()
        kept = getattr(self.opt, "_meganeura_step", None)
        return kept._bound if kept is not None else None

    def assert_match(self, when: str) -> None:
        names = [name for name, _ in self.model.named_parameters()]
        for name, p, q in zip(names, self.model.parameters(), self.ref.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda m: f"{when}, {name}: {m}")
            got, want = self.opt.state.get(p, {}), self.ref_opt.state.get(q, {})
            assert got.keys() == want.keys(), (when, name)
            for slot, value in want.items():
                if slot == "step":
                    assert got[slot].shape == () and float(got[slot]) == float(value), (when, name, got[slot], value)
                else:
                    torch.testing.assert_close(got[slot], value, rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"{when}, {name} {slot}: {m}")


def test_unchanged_steps_replay_one_binding_and_read_each_steps_numbers():
    """Steps that change nothing replay the binding of the first; the learning rate, weight decay and betas that
    eager code sets in ``param_groups`` between them are those of each step."""
    pair = Pair(adamw, lambda m: [{"params": m.fc1.parameters(), "lr": 2e-2}, {"params": m.fc2.parameters()}])
    first = pair.step()
    pair.assert_match("step 0")

    def retune(model, opt):
        opt.param_groups[0]["lr"] *= 0.5
        opt.param_groups[1]["weight_decay"] = 0.3
        opt.param_groups[1]["betas"] = (0.8, 0.99)

    for step in range(1, 4):
        assert pair.step(retune if step == 2 else None) is first, step
        pair.assert_match(f"step {step}")


@pytest.mark.parametrize("make", [adamw, sgd], ids=["adamw", "sgd"])
def test_a_gradient_set_to_none_binds_again_and_each_parameter_keeps_its_count(make):
    """A parameter without a gradient at a step is left as it is and its count stays; the steps after it update
    parameters at two counts (two rows of numbers in one group), then at one again."""
    pair = Pair(make)

    def drop(model, opt):
        model.fc2.weight.grad = None

    bounds = [pair.step(drop if step in (0, 3) else None) for step in range(6)]
    pair.assert_match("6 steps")
    assert bounds[1] is not bounds[0] and bounds[3] is not bounds[2] and bounds[4] is not bounds[3]
    assert bounds[5] is bounds[4]  # (as both: all parameters at one count)


def scale_weight(model, opt):
    with torch.no_grad():
        model.fc1.weight.mul_(0.5)


def new_bias_data(model, opt):
    model.fc2.bias.data = torch.full_like(model.fc2.bias.data, 0.25)


def scale_exp_avg(model, opt):
    opt.state[model.fc2.weight]["exp_avg"].mul_(2.0)


def set_step(model, opt):
    opt.state[model.fc1.bias]["step"].fill_(1.0)


def replace_exp_avg_sq(model, opt):
    opt.state[model.fc2.weight]["exp_avg_sq"] = torch.ones_like(model.fc2.weight)


def test_state_and_parameters_written_by_eager_code_between_steps():
    """Eager writes between steps reach the device. A parameter written in place or given new data (``.data``) and a
    state tensor written in place are uploaded by the replayed step; a step count written (the count read again:
    that parameter's bias corrections restart) or a state tensor replaced bind again."""
    pair = Pair(adamw)
    pair.step()
    first = pair.step()
    for change in (scale_weight, new_bias_data, scale_exp_avg):
        assert pair.step(change) is first, change.__name__
        pair.assert_match(change.__name__)
    for change in (set_step, replace_exp_avg_sq):
        bound = pair.step(change)
        assert bound is not first, change.__name__
        pair.assert_match(change.__name__)
        first = bound


def test_a_parameter_moved_to_a_group_of_its_own_and_a_parameter_not_kept():
    """Moving a parameter into a new param group (another learning rate) binds again; a parameter added after
    ``keep_on_device`` is refused by name, before anything runs."""
    pair = Pair(adamw)
    pair.step()
    pair.step()

    def move(model, opt):
        params = opt.param_groups[0]["params"]
        del params[next(i for i, p in enumerate(params) if p is model.fc2.bias)]
        opt.add_param_group({"params": [model.fc2.bias], "lr": 0.1})

    pair.step(move)
    pair.assert_match("moved")
    pair.step()
    pair.assert_match("after")
    extra = nn.Parameter(torch.zeros(3))
    extra.grad = torch.ones(3)
    pair.opt.add_param_group({"params": [extra]})
    with pytest.raises(TypeError, match="keep_on_device"):
        pair.opt.step()


def test_load_state_dict_between_steps_and_a_kept_state_continued_by_an_eager_optimizer():
    """A state loaded between steps (an earlier one) is the next step's; a kept optimizer's state saved with
    ``torch.save`` continues in an eager optimizer as the eager run does (each parameter counts its own step)."""
    pair = Pair(adamw)
    pair.step()
    saved, ref_saved = copy.deepcopy(pair.opt.state_dict()), copy.deepcopy(pair.ref_opt.state_dict())
    pair.step()
    pair.step(lambda model, opt: opt.load_state_dict(saved if opt is pair.opt else ref_saved))
    pair.assert_match("loaded")
    buffer = io.BytesIO()
    torch.save({"model": pair.model.state_dict(), "opt": pair.opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model = Net()
    model.load_state_dict(checkpoint["model"])
    opt = adamw(model.parameters())
    opt.load_state_dict(checkpoint["opt"])
    pair.model, pair.compiled, pair.opt = model, model, opt  # the eager continuation stands for the kept loop
    for step in range(2):
        pair.step()
    pair.assert_match("continued eagerly")


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.scale = nn.Linear(6, 4), nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.fc(x) * self.scale


def test_a_parameter_given_data_of_another_shape_binds_a_plan_for_it():
    """SGD without momentum keeps no state: a parameter whose data take another shape (``.data``) goes on training
    with an update for that shape, as in eager PyTorch."""
    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    torch_meganeura.keep_on_device(opt)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="meganeura")
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    for step in range(4):
        if step == 2:
            for m in (model, ref):
                m.scale.data = torch.full((1,), 0.5)
        for forward, o in ((compiled, opt), (ref, ref_opt)):
            o.zero_grad()
            F.cross_entropy(forward(x), y).backward()
            o.step()
    assert model.scale.shape == (1,)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_step_hooks_and_a_closure_see_the_step_as_eager_hooks_do():
    """With a step pre-hook (which changes the learning rate before the update) and a post-hook registered, and with
    ``step(closure)``, torch's step runs around the device update with the gradients hidden (not the parameter
    lists): the hooks run once per step, the pre-hook's change applies, and the gradients are there after."""
    pair = Pair(adamw)
    calls = []

    def halve_lr(opt, args, kwargs):
        opt.param_groups[0]["lr"] *= 0.5

    def count(opt, args, kwargs):
        calls.append(len(opt.param_groups[0]["params"]))

    for opt in (pair.opt, pair.ref_opt):
        opt.register_step_pre_hook(halve_lr)
        opt.register_step_post_hook(count)
    for step in range(3):
        pair.step()
        pair.assert_match(f"hooked step {step}")
    assert calls == [4] * 6
    assert all(p.grad is not None for p in pair.model.parameters())
    for model, forward, opt in ((pair.model, pair.compiled, pair.opt), (pair.ref, pair.ref, pair.ref_opt)):
        def closure(forward=forward, opt=opt):
            opt.zero_grad()
            loss = F.cross_entropy(forward(pair.x), pair.y)
            loss.backward()
            return loss
        opt.step(closure)
    pair.assert_match("step(closure)")
