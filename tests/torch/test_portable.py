"""Under ``MEGANEURA_LIMITS=webgpu-default`` the backend compiles for a device held to WebGPU's default limits and no
optional feature (as on many Apple, Intel and mobile adapters): its plans fit them and match eager.
``scripts/test-portable.sh`` runs the model tests so."""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_meganeura.backend.device_graph as device_graph
from helpers.compare import check_gradients_against_eager, meganeura_warnings
from meganeura.runtime.device import LIMITS_ENV

RTOL, ATOL, REL = 1e-3, 1e-4, 1e-4


class Block(nn.Module):
    """A convolution, a layer norm and masked attention: reductions, matmuls and an attention gradient pass (with a
    mask, 9 bindings in its plain form) to generate for the smaller limits."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)

    def forward(self, x, mask):
        h = self.norm(self.conv(x).transpose(1, 2))
        q, k, v = self.qkv(h).view(2, 12, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1)


def test_a_model_compiled_for_webgpu_default_limits_fits_them_and_matches_eager(monkeypatch):
    monkeypatch.setenv(LIMITS_ENV, "webgpu-default")
    compiled, real = [], device_graph.compile_plan

    def spy(graph, device, *args, **kwargs):
        plan, report, from_cache = real(graph, device, *args, **kwargs)
        compiled.append((device, plan))
        return plan, report, from_cache

    monkeypatch.setattr(device_graph, "compile_plan", spy)
    model, mask = Block(), torch.rand(1, 1, 12, 12) > 0.3
    params = dict(model.named_parameters())

    def fn(x, *weights):
        return torch.func.functional_call(model, dict(zip(params, weights)), (x, mask))

    check_gradients_against_eager(fn, torch.randn(2, 8, 12), *params.values(), rtol=RTOL, atol=ATOL, rel=REL,
                                  names=["x", *params])
    assert len(compiled) == 2  # forward and backward
    for device, plan in compiled:
        assert device.restricted and device.limits["max-storage-buffers-per-shader-stage"] == 8
        assert max(len(d.bindings) for d in plan.dispatches) <= 8
        assert not any("subgroup" in wgsl or "enable f16" in wgsl for wgsl in plan.kernels.values())
    assert "attention_rows" in [d.label for d in compiled[1][1].dispatches]  # lse and delta packed for grad_kv


def test_a_concatenation_of_more_tensors_than_bindings_is_computed_in_parts(monkeypatch):
    """``torch.cat`` of 21 tensors (as ``clip_grad_norm_`` stacks its per-parameter norms) is one pointwise node
    reading 21 values; under 8 storage buffers its widest parts that fit run first, as kernels of their own."""
    monkeypatch.setenv(LIMITS_ENV, "webgpu-default")
    compiled, real = [], device_graph.compile_plan

    def spy(graph, device, *args, **kwargs):
        plan, report, from_cache = real(graph, device, *args, **kwargs)
        compiled.append(plan)
        return plan, report, from_cache

    monkeypatch.setattr(device_graph, "compile_plan", spy)
    xs = [torch.randn(3) for _ in range(21)]

    def fn(*xs):
        return torch.cat([x * 2 for x in xs]) + 1

    check_gradients_against_eager(fn, *xs, rtol=RTOL, atol=ATOL, rel=REL)
    forward = compiled[0]
    assert max(len(d.bindings) for d in forward.dispatches) <= 8
    assert len([d for d in forward.dispatches if "(part)" in d.label]) == 3  # 21 values: 7 + 7 + 6, 3 + 1 left


def test_precision_fast_stays_f32_with_a_warning_on_a_device_without_shader_f16(monkeypatch):
    """The device held to WebGPU's defaults has no shader-f16 (not a feature taken away by the test): ``precision=
    "fast"`` compiles f32 plans and says so."""
    from torch_meganeura.backend.entry import BackendContext

    monkeypatch.setenv(LIMITS_ENV, "webgpu-default")
    monkeypatch.setattr(BackendContext, "_warned", set())  # the warning is given once per device and process
    flags, real = [], device_graph.compile_plan

    def spy(graph, device, tune, f16_products=False, limits=None):
        flags.append(f16_products)
        return real(graph, device, tune, f16_products, limits)

    monkeypatch.setattr(device_graph, "compile_plan", spy)
    torch._dynamo.reset()
    model, x = nn.Linear(32, 16).eval(), torch.randn(8, 32)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="meganeura", options={"precision": "fast"})(x)
    assert flags == [False]
    assert any("shader-f16" in text and "WebGPU default limits" in text for text in meganeura_warnings(caught))
    assert torch.allclose(out, model(x), rtol=1e-4, atol=1e-5)
