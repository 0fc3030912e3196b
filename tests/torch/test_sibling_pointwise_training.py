"""A conv + GroupNorm + SiLU block trained through the backend and through the resident step: its sibling pointwise
kernels (lowering/sibling_pointwise.py: SiLU's input saved as a copy beside silu(x), the backward's sigmoid(x) beside
another reader of x, sigmoid(h) beside tanh(h)) merge, the plans' dispatches fewer by exactly the merges, the loss and
every gradient as eager's.

Tolerances: the loss with rtol 1e-5 and every gradient with rtol 1e-3, atol 1e-4 (relative L2 <= 1e-4 for the
backend's, ``helpers.compare.assert_grads_match``), as tests/torch/test_training.py and test_train_step.py judge.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import meganeura.lowering
from meganeura.lowering import sibling_pointwise
from helpers.compare import assert_grads_match
from helpers.compiled_plans import record_compiled_plans
from torch_meganeura import compile_train_step


class SiLUBlock(nn.Module):
    """diffusers' ResNet block in small (norm, SiLU, conv) and a gated pair of 1x1 convolutions of sigmoid(h) and
    tanh(h) (siblings in the resident step's joint graph too), the input added back."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.norm = nn.GroupNorm(2, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.gate, self.value = nn.Conv2d(channels, channels, 1), nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        h = self.conv(F.silu(self.norm(x)))
        return self.gate(torch.sigmoid(h)) * self.value(torch.tanh(h)) + x


def _loss(model, x):
    return model(x).square().mean()


def _train(way: str, model: nn.Module, x: torch.Tensor):
    """The loss and {name: gradient} of one step of ``way``: "loop" (torch.compile, backward) or "resident"
    (``compile_train_step``'s ``gradients``)."""
    torch._dynamo.reset()
    if way == "loop":
        loss = _loss(torch.compile(model, backend="meganeura"), x)
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}
    step = compile_train_step(model, _loss, torch.optim.SGD(model.parameters(), lr=0.1))
    return step.gradients(x)


def _dispatches_and_merges(monkeypatch, way: str, with_pass: bool) -> tuple[int, int]:
    """The dispatches of every plan one step of ``way`` compiles and the sibling merges among them, with or without
    ``fuse_sibling_pointwise``; the step's loss and gradients checked against eager's."""
    merges = []

    def counted(graph, max_bindings, report):
        before = len(report.fused)
        if with_pass:
            sibling_pointwise.fuse_sibling_pointwise(graph, max_bindings, report)
        merges.append(len(report.fused) - before)

    monkeypatch.setattr(meganeura.lowering, "fuse_sibling_pointwise", counted)
    plans = record_compiled_plans(monkeypatch)
    torch.manual_seed(0)
    model, x = SiLUBlock(), torch.randn(2, 4, 6, 6)
    ref = copy.deepcopy(model)
    loss, grads = _train(way, model, x)
    want = _loss(ref, x)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=0)
    if way == "loop":
        assert_grads_match(model, ref)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")
    return sum(len(plan.dispatches) for plan in plans), sum(merges)


@pytest.mark.parametrize("way", ["loop", "resident"])
def test_sibling_pointwise_kernels_merge_in_a_silu_block(monkeypatch, way):
    """With the pass, the plans of a step have as many dispatches fewer as it merged pairs (three or more in the
    loop's forward and backward, one or more in the resident step's); without it, none; as eager's either way."""
    with_pass, merges = _dispatches_and_merges(monkeypatch, way, with_pass=True)
    without, none = _dispatches_and_merges(monkeypatch, way, with_pass=False)
    assert none == 0 and merges >= (3 if way == "loop" else 1)
    assert without - with_pass == merges, (without, with_pass, merges)
