"""Scaled dot-product attention as the fused ``Attention`` archetype: forward and backward without a seq x seq
score matrix in memory.

``scaled_dot_product_attention`` reaches the backend as the CPU flash-attention op and its backward (our
decomposition table keeps both whole). The operands are loads whose index math absorbs views: HF's transposes
and the repeat-KV expansion of grouped-query attention become coordinates, not copies. A boolean mask becomes an
additive one (-inf where False); masks broadcast over batch and heads. The backward is three passes: delta =
rowsum(dout * out) as a reduction, then dQ per query row and dK, dV per key row.
"""
from __future__ import annotations

import math

import torch

from meganeura.lowering import expr as E
from meganeura.lowering.ir import RowOutput

from ..registry import lowering

aten = torch.ops.aten


def _supported(q_arg: int, dropout_arg: int):
    """The support check of an attention op whose query is argument ``q_arg`` and dropout_p ``dropout_arg``."""
    def check(node) -> str | None:
        q, k = node.args[q_arg].meta["val"], node.args[q_arg + 1].meta["val"]
        if len(node.args) > dropout_arg and node.args[dropout_arg]:
            return "attention dropout is not lowered yet"
        if q.dim() != 4 or k.dim() != 4:
            return "attention on the device takes (batch, heads, seq, head_dim) tensors"
        if q.shape[1] % k.shape[1]:
            return "query heads are not a multiple of key/value heads"
        if any(a.meta["val"].dtype not in (torch.float32, torch.bool) for a in node.all_input_nodes):
            return "attention on the device computes float32 only"
        return None
    return check


def _operands(ctx, q, k, v, attn_mask):
    """Load expressions of q, k, v (over (b, h, row, c)) and of the additive bias (over (b, h, i, j))."""
    b = ctx.b
    batch, heads, lq, _ = q.shape
    group = heads // k.shape[1]

    def per_head(t):
        head = E.coord(1) if group == 1 else E.binary("idiv", E.coord(1), E.const(group, E.I32))
        return E.cast(b.load(t, [E.coord(0), head, E.coord(2), E.coord(3)]), E.F32)

    bias = None
    if attn_mask is not None:
        full = (batch, heads, lq, k.shape[2])
        mask = b.load_broadcast(attn_mask, full)
        if attn_mask.dtype == "bool":
            bias = E.where(mask, E.const(0.0, E.F32), E.const(-math.inf, E.F32))
        else:
            bias = E.cast(mask, E.F32)
    return E.cast(b.load(q, [E.coord(d) for d in range(4)]), E.F32), per_head(k), per_head(v), bias


def _fields(q, k, v, scale, causal) -> dict:
    batch, heads, lq, d = q.shape
    return dict(batch=batch, heads=heads, kv_heads=k.shape[1], lq=lq, lk=k.shape[2], d=d, dv=v.shape[3],
                scale=float(scale) if scale is not None else 1.0 / math.sqrt(d), causal=bool(causal))


@lowering(aten._scaled_dot_product_flash_attention_for_cpu.default, supports=_supported(0, 3))
def _sdpa(ctx, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    qe, ke, ve, bias = _operands(ctx, q, k, v, attn_mask)
    batch, heads, lq, _ = q.shape
    out, lse = ctx.b.attention("forward", [((batch, heads, lq, v.shape[3]), "float32"), ((batch, heads, lq), "float32")],
                               q=qe, k=ke, v=ve, bias=bias, label="attention", **_fields(q, k, v, scale, is_causal))
    return out, lse


@lowering(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, supports=_supported(1, 6))
def _sdpa_backward(ctx, grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    b = ctx.b
    qe, ke, ve, bias = _operands(ctx, q, k, v, attn_mask)
    coords = [E.coord(d) for d in range(4)]
    rowdot = E.mul(E.cast(b.load(grad_out, coords), E.F32), E.cast(b.load(out, coords), E.F32))
    (delta,) = b.reduce(out.shape, (3,), [("sum", rowdot)], [RowOutput(False, E.acc(0))], ["float32"], "attention_delta")
    rows = [E.coord(0), E.coord(1), E.coord(2)]
    common = dict(q=qe, k=ke, v=ve, bias=bias, dout=E.cast(b.load(grad_out, coords), E.F32),
                  lse=E.cast(b.load(lse, rows), E.F32), delta=b.load(delta, rows), **_fields(q, k, v, scale, is_causal))
    (dq,) = b.attention("grad_q", [(q.shape, "float32")], label="attention_grad_q", **common)
    dk, dv = b.attention("grad_kv", [(k.shape, "float32"), (v.shape, "float32")], label="attention_grad_kv", **common)
    return dq, dk, dv
