"""Gradients of kept parameters parked on them by the backward (``backend.parked_grads``): ``p.grad`` reads as the
gradient eager autograd stores, in every way eager code reaches it, and the backward parks only where autograd
would store the gradient as it is.

Criteria: gradients against the same model's in eager PyTorch (``assert_close`` rtol 1e-4, atol 1e-5: float32 sums
in other orders over a few hundred terms).
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_meganeura
from meganeura.runtime.resident import DeviceArray
from torch_meganeura.tensors.resident import ResidentTensor

RTOL, ATOL = 1e-4, 1e-5


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    opt = torch_meganeura.keep_on_device(torch.optim.AdamW(model.parameters(), lr=1e-2))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="meganeura")
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    # a first step: the kept optimizer holds the parameters from then on (their class: DeviceParameter)
    F.cross_entropy(compiled(x), y).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            q.copy_(p)
    return model, ref, opt, compiled, x, y


def _eager_grads(ref, x, y):
    ref.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    return [q.grad.clone() for q in ref.parameters()]


def test_backward_parks_the_gradients_and_grad_reads_them():
    model, ref, opt, compiled, x, y = _setup()
    F.cross_entropy(compiled(x), y).backward()
    params = list(model.parameters())
    assert all(type(p._meganeura_kept.grad) is DeviceArray for p in params)  # parked: nothing crossed autograd
    expected = _eager_grads(ref, x, y)
    for p, g in zip(params, expected):
        assert type(p.grad) is ResidentTensor
        torch.testing.assert_close(p.grad, g, rtol=RTOL, atol=ATOL)
        assert p._meganeura_kept.grad is None  # given to .grad at the first read
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_the_step_reads_parked_gradients_and_zero_grad_drops_them():
    model, ref, opt, compiled, x, y = _setup()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (its own tensors, not the kept ones)
    for _ in range(3):
        F.cross_entropy(compiled(x), y).backward()
        opt.step()  # (the gradients still parked: no .grad read)
        opt.zero_grad()
        assert all(p._meganeura_kept.grad is None for p in model.parameters())
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().clone(), q.detach(), rtol=1e-3, atol=1e-4)


def test_zero_grad_keeping_the_tensors_and_module_zero_grad():
    model, _, opt, compiled, x, y = _setup()
    F.cross_entropy(compiled(x), y).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    F.cross_entropy(compiled(x), y).backward()
    model.zero_grad()  # (nn.Module's: reads each .grad, then sets it to None)
    assert all(p.grad is None and p._meganeura_kept.grad is None for p in model.parameters())


def test_autograd_grad_gets_the_gradients_and_stores_none():
    model, ref, _, compiled, x, y = _setup()
    params = list(model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(compiled(x), y), params)
    for g, e in zip(grads, _eager_grads(ref, x, y)):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)
    assert all(p.grad is None and p._meganeura_kept.grad is None for p in params)


def test_backward_of_some_inputs_and_hooks_see_the_gradient():
    model, ref, _, compiled, x, y = _setup()
    first, second = model[0], model[2]
    seen = []
    second.bias.register_hook(lambda g: seen.append(g.clone()))
    F.cross_entropy(compiled(x), y).backward(inputs=[first.weight, second.bias])
    expected = dict(zip(("0.weight", "0.bias", "2.weight", "2.bias"), _eager_grads(ref, x, y)))
    assert first.bias.grad is None and second.weight.grad is None  # not among the inputs
    torch.testing.assert_close(first.weight.grad, expected["0.weight"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(second.bias.grad, expected["2.bias"], rtol=RTOL, atol=ATOL)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], expected["2.bias"], rtol=RTOL, atol=ATOL)


def test_an_eager_term_on_a_parameter_adds_to_its_parked_gradient():
    """An L2 term computed in eager code on a kept parameter: autograd stores that term's gradient while the compiled
    backward parks the rest; ``.grad`` and the step see their sum."""
    model, ref, opt, compiled, x, y = _setup()
    weight, ref_weight = model[0].weight, ref[0].weight
    (F.cross_entropy(compiled(x), y) + (weight * weight).sum()).backward()
    (F.cross_entropy(ref(x), y) + (ref_weight * ref_weight).sum()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    opt.zero_grad()
    ref.zero_grad()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for module, optimizer, w in ((compiled, opt, weight), (ref, ref_opt, ref_weight)):  # the step reads the sum
        (F.cross_entropy(module(x), y) + (w * w).sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().clone(), q.detach(), rtol=1e-3, atol=1e-4)
