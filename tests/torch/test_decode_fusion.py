"""Decode-step fusion (lowering/row_prologues.py, lowering/paired_matmuls.py): one row through a pre-norm block's
projections, exported as a bundle and run on the device, matches eager (against float64) in fewer dispatches: the
norm's statistics are computed by the matrix-vector kernel that reads the normalised row, and a gated MLP's two
products of that row by one kernel."""
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
    gate and up products share one kernel, so the half-block is two dispatches; the outputs match float64 eager as
    closely as float32 eager does (rtol 1e-4, atol 1e-5)."""
    model = _randomized(CASES[case]())
    x = torch.randn(1, 1, WIDTH)
    torch_meganeura.export(model, {"x": x}, tmp_path / "bundle")
    bundle = load(tmp_path / "bundle")
    labels = [d.label for d in bundle.program.plan.dispatches]
    assert len(labels) == 2 and all(map(_is_one_row_product, labels)), labels
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
