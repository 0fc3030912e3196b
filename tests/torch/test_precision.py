"""The ``precision`` option: "fast" forms the forward graphs' matmul and convolution products in f16 (checked against
eager with f16-sized tolerances, and shown to differ from strict), backward graphs stay f32, and an adapter without
shader-f16 keeps f32 with a warning."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import torch_meganeura.backend.device_graph as device_graph
from helpers.compare import assert_grads_match, assert_same, meganeura_warnings, rel_l2
from meganeura.runtime.device import get_device

# f16 operands carry a relative rounding error of 2^-11: about 1e-3 relative L2 on an output, and ReLU masks that
# flip near zero spread a little more into the gradients
FAST_REL, FAST_GRAD_REL = 5e-3, 3e-2


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(6, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, 48)
        self.head = nn.Linear(48, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1))))


@pytest.fixture
def needs_f16():
    if "shader-f16" not in get_device().features:
        pytest.skip("the adapter has no shader-f16")


def _spy_compiles(monkeypatch) -> list:
    """Record the f16 flag of every plan compiled from here on."""
    calls, real = [], device_graph.compile_plan

    def spy(graph, device, tune, f16_products=False, limits=None):
        calls.append(f16_products)
        return real(graph, device, tune, f16_products, limits)

    monkeypatch.setattr(device_graph, "compile_plan", spy)
    return calls


def test_fast_inference_is_f16_rounded_and_close_to_eager(needs_f16, monkeypatch):
    torch._dynamo.reset()
    model, x = ConvNet().eval(), torch.randn(4, 6, 8, 8)
    calls = _spy_compiles(monkeypatch)
    with torch.no_grad():
        want = model(x)
        fast = torch.compile(model, backend="meganeura", options={"precision": "fast"})(x)
    assert calls == [True]
    assert_same(fast, want, rtol=2e-2, atol=2e-2 * want.abs().max().item(), rel=FAST_REL)
    assert rel_l2(fast, want) > 1e-5  # rounded to f16: not the strict result (about 1e-7 off)


def test_fast_training_keeps_the_backward_in_f32(needs_f16, monkeypatch):
    torch._dynamo.reset()
    model, x = ConvNet(), torch.randn(4, 6, 8, 8)
    ref = copy.deepcopy(model)
    calls = _spy_compiles(monkeypatch)
    compiled = torch.compile(model, backend="meganeura", options={"precision": "fast"})
    loss = compiled(x).square().mean()
    loss.backward()
    want = ref(x).square().mean()
    want.backward()
    assert calls == [True, False]  # the forward plan with f16 products, the backward plan without
    assert abs(loss.item() - want.item()) <= FAST_REL * abs(want.item())
    assert_grads_match(model, ref, rtol=5e-2, atol=5e-2 * max(p.grad.abs().max().item() for p in ref.parameters()),
                       rel=FAST_GRAD_REL)


def test_fast_without_shader_f16_stays_f32_and_warns(monkeypatch):
    torch._dynamo.reset()
    device = get_device()
    monkeypatch.setattr(device, "features", device.features - {"shader-f16"})
    model, x = nn.Linear(32, 16).eval(), torch.randn(8, 32)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="meganeura", options={"precision": "fast"})(x)
        assert_same(out, model(x), rtol=1e-4, atol=1e-5)
    assert any("shader-f16" in text for text in meganeura_warnings(caught)), meganeura_warnings(caught)


def test_bad_precision_is_refused():
    with pytest.raises(Exception, match="precision='half'.*strict.*fast"):
        torch.compile(nn.Linear(4, 4), backend="meganeura", options={"precision": "half"})(torch.randn(2, 4))
