"""The decomposition table handed to aot_autograd: torch's core-aten table minus what we lower whole.

Ops kept whole get one fused kernel (or a better one) instead of their decomposition. Each exclusion
names its reason.
"""
from __future__ import annotations

import torch
from torch._decomp import core_aten_decompositions

aten = torch.ops.aten

KEEP_WHOLE = {
    aten.silu.default: "one pointwise expression",
    aten.clamp_min.default: "one pointwise expression",
    aten.clamp_max.default: "one pointwise expression",
    aten.squeeze.dim: "a view, folded into index math",
    aten.squeeze.default: "a view, folded into index math",
    aten.transpose.int: "a view, folded into index math",
    aten.t.default: "a view, folded into index math",
    aten._unsafe_view.default: "a view, folded into index math",
    aten.sum.default: "one reduction",
}


def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    for op in KEEP_WHOLE:
        table.pop(op, None)
    return table
