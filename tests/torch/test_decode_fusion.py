"""Decode-step fusion (lowering/row_prologues.py, lowering/paired_matmuls.py, lowering/slice_merges.py): one row
through a pre-norm block's projections, exported as a bundle and run on the device, matches eager (against float64)
in fewer dispatches: the norm's statistics are computed by the matrix-vector kernel that reads the normalised row, a
gated MLP's two products of that row by one kernel, and the slices of one query row's attention over many keys are
merged by the output projection that reads them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_meganeura
from meganeura.runtime import load

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
WIDTH, HIDDEN = 64, 96
RTOL, ATOL = 1e-4, 1e-5


class GatedMLP(nn.Module):
    """Llama's MLP half-block: x + down(act(gate(norm(x))) * up(norm(x))), RMS norm with a weight."""

    def __init__(self, act):
        super().__init__()
        self.norm = nn.RMSNorm(WIDTH, eps=1e-6)
        self.gate, self.up = nn.Linear(WIDTH, HIDDEN, bias=False), nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)
        self.act = act

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(self.act(self.gate(h)) * self.up(h))


class LayerNormMLP(nn.Module):
    """GPT-2's MLP half-block: x + proj(gelu(fc(layer_norm(x)))), with biases."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x)), approximate="tanh"))


def _randomized(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.1) + (1.0 if "norm.weight" in name else 0.0))
    return model.eval()


CASES = {"swiglu": lambda: GatedMLP(F.silu), "geglu": lambda: GatedMLP(lambda t: F.gelu(t, approximate="tanh")),
         "layer_norm": LayerNormMLP}


def _is_one_row_product(label: str) -> bool:
    """A dispatch label of a one-row matmul (``schedule._label``: the op, then rows x columns x K)."""
    return len(label.split()) == 2 and label.split()[1].startswith("1x")


@pytest.mark.parametrize("case", list(CASES))
def test_one_row_takes_a_dispatch_per_product_and_matches_eager(case, tmp_path):
    """One token's row: the norm runs inside the first matrix-vector kernel (no reduction of its own), a gated MLP's
    gate and up products share one kernel, so the half-block is two dispatches; that first kernel normalises the row
    once per workgroup into workgroup memory (``row_a``), not once per output, while the second reads its vector as
    stored; the outputs match float64 eager as closely as float32 eager does (rtol 1e-4, atol 1e-5)."""
    model = _randomized(CASES[case]())
    x = torch.randn(1, 1, WIDTH)
    torch_meganeura.export(model, {"x": x}, tmp_path / "bundle")
    bundle = load(tmp_path / "bundle")
    labels = [d.label for d in bundle.program.plan.dispatches]
    assert len(labels) == 2 and all(map(_is_one_row_product, labels)), labels
    plan = bundle.program.plan
    assert ["row_a" in plan.kernels[d.kernel] for d in plan.dispatches] == [True, False]
    got = next(iter(bundle(x=x.numpy()).values()))
    with torch.no_grad():
        want = model.double()(x.double()).numpy()
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_several_rows_keep_the_norm_apart(tmp_path):
    """Three rows are a tiled matmul's work: the norm stays a reduction of its own, and the result is still eager's."""
    model = _randomized(GatedMLP(F.silu))
    x = torch.randn(1, 3, WIDTH)
    torch_meganeura.export(model, {"x": x}, tmp_path / "bundle")
    bundle = load(tmp_path / "bundle")
    labels = [d.label for d in bundle.program.plan.dispatches]
    assert len(labels) == 4 and not any(map(_is_one_row_product, labels)), labels
    got = next(iter(bundle(x=x.numpy()).values()))
    with torch.no_grad():
        want = model.double()(x.double()).numpy()
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


class AttendAndProject(nn.Module):
    """A decode step's attention half-block: one query row per head over a cache of keys and values, its heads side by
    side through the output projection, plus the residual."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.o_proj = nn.Linear(heads * head_dim, WIDTH, bias=False)

    def forward(self, x, q, k, v):
        x, q, k, v = (t.to(self.o_proj.weight.dtype) for t in (x, q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return (x + self.o_proj(out.transpose(1, 2).reshape(1, 1, -1))).float()


# The weights' dtypes: float32, and bfloat16 (the projection's half precision weights read by groups of 8). The bundle
# computes in float32 between the bfloat16 inputs and weights, as float64 eager from the same rounded values does.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HEADS, HEAD_DIM, KEYS = 4, 16, 256  # 8 tiles of 32 keys over 4 query rows: attention is cut into slices


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_attention_slices_are_merged_by_the_projection_that_reads_them(dtype, tmp_path):
    """One query row per head over 256 keys: attention is cut into slices of the keys, and the output projection
    merges them as it loads its row (lowering/slice_merges.py), two dispatches in all; the output matches float64
    eager's from the same inputs and weights rounded to the model's dtype (rtol 1e-4, atol 1e-5)."""
    dtype = DTYPES[dtype]
    model = _randomized(AttendAndProject(HEADS, HEAD_DIM)).to(dtype)
    torch.manual_seed(1)
    inputs = {"x": torch.randn(1, 1, WIDTH), "q": torch.randn(1, HEADS, 1, HEAD_DIM),
              "k": torch.randn(1, HEADS, KEYS, HEAD_DIM), "v": torch.randn(1, HEADS, KEYS, HEAD_DIM)}
    torch_meganeura.export(model, inputs, tmp_path / "bundle")
    bundle = load(tmp_path / "bundle")
    plan = bundle.program.plan
    assert [d.label for d in plan.dispatches] == ["attention", f"matmul 1x{WIDTH}x{HEADS * HEAD_DIM}"]
    assert plan.stats["merged_by_readers"] == 1
    got = next(iter(bundle(**{name: t.numpy() for name, t in inputs.items()}).values()))
    with torch.no_grad():  # (the inputs rounded to the model's dtype first, as the model does)
        want = model.double()(**{name: t.to(dtype).double() for name, t in inputs.items()}).numpy()
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
