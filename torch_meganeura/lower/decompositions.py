"""The decomposition table handed to aot_autograd: torch's core-aten table minus what we lower whole, plus a
few of torch's other decompositions for ops that core-aten keeps but we do not lower yet.

Ops kept whole get one fused kernel (or a better one) instead of their decomposition. Each exclusion and
addition names its reason.
"""
from __future__ import annotations

import torch
from torch._C import DispatchKey
from torch._decomp import core_aten_decompositions, get_decompositions

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
    aten.select_scatter.default: "one pointwise expression (select's backward)",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "the fused attention kernel",
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "the fused attention backward",
    aten.detach.default: "a stop-gradient: compile_train_step differentiates the decomposed graph, where detach's "
                         "decomposition (alias) would pass the gradient (aot_autograd's table below decomposes it)",
}


ADDED = {
    aten._native_batch_norm_legit_functional.default: "batch norm in training, with running-stat outputs",
    aten._native_batch_norm_legit.no_stats: "batch norm without running stats",
    aten.native_batch_norm.default: "batch norm as make_fx + functionalize trace it (compile_train_step)",
    aten.addmv.default: "mv, scaled and added",
    aten.dist.default: "the norm of a difference",
    aten.view_copy.default: "a view (a copy only in eager)",
    aten.permute_copy.default: "a view (a copy only in eager)",
    aten.unbind_copy.int: "views (copies only in eager)",
}


def _weight_norm_interface(v, g, dim=0):
    """Weight norm as torch's CPU kernel computes it: for both half precisions the norms in float32 and the weight
    ``v * (g / norm)`` in float32, rounded once (torch's decomposition keeps float16 norms in float16, and rounds
    ``norm`` and ``g / norm`` to the half dtype before the product: three roundings). The backward,
    ``_weight_norm_interface_backward``, has no lowering and runs that kernel in eager, which refuses float16 norms."""
    keep = tuple(i for i in range(v.dim()) if i != dim)
    if g.dtype not in (torch.float16, torch.bfloat16):
        norm = v.norm(2, keep, keepdim=True)
        return v * (g / norm), norm
    norm = v.norm(2, keep, keepdim=True, dtype=torch.float32)
    return (v.float() * (g.float() / norm)).to(v.dtype), norm


OWN = {
    aten._weight_norm_interface.default: (_weight_norm_interface, "torch's keeps float16 norms in float16, which its "
                                          "own backward kernel refuses, and rounds three times in half precision"),
}


def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(list(ADDED)))
    table.update({op: fn for op, (fn, _) in OWN.items()})
    for op in KEEP_WHOLE:
        table.pop(op, None)
    return table


def aot_decomposition_table() -> dict:
    """The table for aot_autograd, which differentiates before it decomposes: there detach may become alias, as
    before compile_train_step needed it whole (the min-cut partitioner's choice of saved tensors depends on it)."""
    return {**decomposition_table(), **get_decompositions([aten.detach.default])}


def before_autograd_table() -> dict:
    """The decompositions aot_autograd applies before it differentiates: those registered at the Autograd or
    CompositeImplicitAutograd key (upsample's, batch norm's). The rest differentiate by their own formulas and
    decompose after (logsumexp's backward is ``grad * exp(x - result)``; through its decomposition the gradient
    would also pass its max, adding rounding noise). compile_train_step differentiates with torch.func, which does
    not apply the former on its own, so it decomposes the loss graph through this table first."""
    keys = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)
    return {op: fn for op, fn in decomposition_table().items()
            if any(k in getattr(op, "py_kernels", {}) for k in keys)}
