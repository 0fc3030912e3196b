"""Scaled dot-product attention as the fused ``Attention`` archetype: forward and backward without a seq x seq
score matrix in memory.

``scaled_dot_product_attention`` reaches the backend as the CPU flash-attention op and its backward (our
decomposition table keeps both whole). The operands are loads whose index math absorbs views: HF's transposes
and the repeat-KV expansion of grouped-query attention become coordinates, not copies. A boolean mask becomes an
additive one (-inf where False); masks broadcast over batch and heads. The backward is three passes: delta =
rowsum(dout * out) as a reduction, then dQ per query row and dK, dV per key row.

The forward of head sizes the flash kernel takes (``flash_forward_fits``) is always fused. Otherwise, and for
the backward, where the score matrices of a call fit ``UNFUSED_MAX_SCORE_BYTES`` and rows are long
(``UNFUSED_MIN_KEYS``), the attention is lowered unfused instead, as PyTorch's math path computes it, onto the
matmul and reduction archetypes: the scores S = scale q.k + bias (masked) stored by a matmul, the row log-sum-exp
by a reduction over them, and out = softmax(S) v by a matmul that exponentiates S as it loads it. The backward
recomputes S, gets dV as a matmul of P (from S and the log-sum-exp), then stores dS = P (dO.V - delta) from a
matmul's epilogue over S (its last reader), and gets dQ and dK as two matmuls of dS. The tiled matmuls reuse
every loaded row many times, where the blocked and per-row kernels run one row per thread: on long rows that is
faster, at the price of one score matrix in memory.
"""
from __future__ import annotations

import math

import torch

from meganeura.kernels.attention import MASKED  # a score at or below counts as masked out
from meganeura.kernels.attention import flash_forward_fits
from meganeura.kernels.sizes import is_size
from meganeura.lowering import expr as E
from meganeura.lowering.ir import RowOutput

from ..registry import DEVICE_FLOATS, lowering, tensor_inputs

aten = torch.ops.aten
UNFUSED_MAX_SCORE_BYTES = 64 << 20  # one (batch * heads, lq, lk) float32 score matrix at most
UNFUSED_MIN_KEYS = 128  # and rows at least this long (H200: unfused faster from 128 on, the shortest measured)


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
        if any(t.dtype not in (*DEVICE_FLOATS, torch.bool) for t in tensor_inputs(node)):
            return "attention on the device takes floating point and bool operands only"
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
    fields = _fields(q, k, v, scale, is_causal)
    if _unfused(fields) and not flash_forward_fits(fields["d"], fields["dv"]):
        return _unfused_forward(ctx.b, qe, ke, ve, bias, fields)
    out, lse = ctx.b.attention("forward",
                               [((batch, heads, lq, v.shape[3]), "float32"), ((batch, heads, lq), "float32")],
                               q=qe, k=ke, v=ve, bias=bias, label="attention", **fields)
    return out, lse


@lowering(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, supports=_supported(1, 6))
def _sdpa_backward(ctx, grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    b = ctx.b
    qe, ke, ve, bias = _operands(ctx, q, k, v, attn_mask)
    coords = [E.coord(d) for d in range(4)]
    rowdot = E.mul(E.cast(b.load(grad_out, coords), E.F32), E.cast(b.load(out, coords), E.F32))
    (delta,) = b.reduce(out.shape, (3,), [("sum", rowdot)], [RowOutput(False, E.acc(0))], ["float32"],
                        "attention_delta")
    rows = [E.coord(0), E.coord(1), E.coord(2)]
    common = dict(q=qe, k=ke, v=ve, bias=bias, dout=E.cast(b.load(grad_out, coords), E.F32),
                  lse=E.cast(b.load(lse, rows), E.F32), delta=b.load(delta, rows), **_fields(q, k, v, scale, is_causal))
    if _unfused(common):
        return _unfused_backward(b, common)
    (dq,) = b.attention("grad_q", [(q.shape, "float32")], label="attention_grad_q", **common)
    dk, dv = b.attention("grad_kv", [(k.shape, "float32"), (v.shape, "float32")], label="attention_grad_kv", **common)
    return dq, dk, dv


# ------------------------------------------------------------------------------------ unfused (math) attention
def _unfused(f: dict) -> bool:
    """Whether the scores are stored (large head counts of short sequences); never where a size is symbolic: the
    fused kernels serve every length with one plan."""
    if any(is_size(f[name]) for name in ("batch", "lq", "lk")):
        return False
    return f["lk"] >= UNFUSED_MIN_KEYS and f["batch"] * f["heads"] * f["lq"] * f["lk"] * 4 <= UNFUSED_MAX_SCORE_BYTES


def _i32(value: int) -> E.Expr:
    return E.const(value, E.I32)


def _at(e: E.Expr, heads: int, batch_head: E.Expr, *rest: E.Expr) -> E.Expr:
    """An expression over (b, h, ...) read at flat (batch * heads + head) index ``batch_head`` and ``rest``."""
    mapping = {0: E.binary("idiv", batch_head, _i32(heads)), 1: E.binary("imod", batch_head, _i32(heads))}
    return E.shift_coords(e, {**mapping, **{2 + k: c for k, c in enumerate(rest)}})


def _scores(b, qe, ke, bias, f: dict):
    """S[bh, i, j] = scale * q.k + bias, or MASKED where causal masking removes it."""
    h, i, j = E.coord(0), E.coord(1), E.coord(2)
    q_op = _at(qe, f["heads"], h, i, E.coord(2))  # gemm A over (bh, i, p)
    k_op = _at(ke, f["heads"], h, E.coord(2), E.coord(1))  # gemm B over (bh, p, j): key row j, channel p
    score = E.mul(E.acc(0), E.const(f["scale"], E.F32))
    if bias is not None:
        score = E.add(score, _at(bias, f["heads"], h, i, j))
    if f["causal"]:
        score = E.where(E.binary("gt", j, i), E.const(MASKED, E.F32), score)
    return b.gemm(f["batch"] * f["heads"], f["lq"], f["lk"], f["d"], q_op, k_op, epilogue=score,
                  label="attention_scores")


def _prob(s: E.Expr, lse: E.Expr) -> E.Expr:
    masked = E.binary("or", E.binary("le", s, E.const(MASKED, E.F32)), E.binary("le", lse, E.const(MASKED, E.F32)))
    return E.where(masked, E.const(0.0, E.F32), E.unary("exp", E.binary("sub", s, lse)))


def _unfused_forward(b, qe, ke, ve, bias, f: dict):
    rows = f["batch"] * f["heads"]
    scores = _scores(b, qe, ke, bias, f)
    s = b.load(scores, [E.coord(0), E.coord(1), E.coord(2)])
    kept = E.binary("gt", s, E.const(MASKED, E.F32))
    phases = [("max", s), ("sum", E.where(kept, E.unary("exp", E.binary("sub", s, E.acc(0))), E.const(0.0, E.F32)))]
    lse_expr = E.where(E.binary("eq", E.acc(1), E.const(0.0, E.F32)), E.const(MASKED, E.F32),
                       E.add(E.acc(0), E.unary("log", E.acc(1))))
    (lse,) = b.reduce(scores.shape, (2,), phases, [RowOutput(False, lse_expr)], ["float32"], "attention_lse")
    p_op = _prob(b.load(scores, [E.coord(0), E.coord(1), E.coord(2)]), b.load(lse, [E.coord(0), E.coord(1)]))
    v_op = _at(ve, f["heads"], E.coord(0), E.coord(1), E.coord(2))  # gemm B over (bh, p = key row, c)
    out = b.gemm(rows, f["lq"], f["dv"], f["lk"], p_op, v_op, label="attention_values")
    return (b.reshape(out, (f["batch"], f["heads"], f["lq"], f["dv"])),
            b.reshape(lse, (f["batch"], f["heads"], f["lq"])))


def _unfused_backward(b, f: dict):
    heads, lq, lk = f["heads"], f["lq"], f["lk"]
    group = heads // f["kv_heads"]
    scale = E.const(f["scale"], E.F32)
    scores = _scores(b, f["q"], f["k"], f["bias"], f)

    def prob(batch_head, i, j):
        return _prob(b.load(scores, [batch_head, i, j]), _at(f["lse"], heads, batch_head, i))

    h, i, j = E.coord(0), E.coord(1), E.coord(2)
    # dK, dV per KV head g: sums over the group's query heads and their rows, p = head-in-group * lq + query row
    kv = f["kv_heads"]
    g, p = E.coord(0), E.coord(2)

    def query_head(p_coord):  # flat (batch * heads + head) of reduction index p under KV head g
        first = E.add(E.mul(E.binary("idiv", g, _i32(kv)), _i32(heads)),
                      E.mul(E.binary("imod", g, _i32(kv)), _i32(group)))
        return E.add(first, E.binary("idiv", p_coord, _i32(lq)))

    def query_row(p_coord):
        return E.binary("imod", p_coord, _i32(lq))

    b_p = E.coord(1)  # in a B operand, (0: g, 1: p, 2: channel)
    # dV first: dS, the last reader of S, is then stored over it (``lowering.in_place.arena_aliases``)
    dv = b.gemm(f["batch"] * kv, lk, f["dv"], group * lq, prob(query_head(p), query_row(p), E.coord(1)),
                _at(f["dout"], heads, query_head(b_p), query_row(b_p), E.coord(2)), label="attention_grad_v")
    # dS = P * (dO.V - delta): A = dO over (bh, i, c), B = V over (bh, c, j)
    ds_epilogue = E.mul(prob(h, i, j), E.binary("sub", E.acc(0), _at(f["delta"], heads, h, i)))
    grad_scores = b.gemm(f["batch"] * heads, lq, lk, f["dv"], _at(f["dout"], heads, h, i, E.coord(2)),
                         _at(f["v"], heads, h, E.coord(2), E.coord(1)), epilogue=ds_epilogue,
                         label="attention_grad_scores")
    scaled = E.mul(E.acc(0), scale)
    dq = b.gemm(f["batch"] * heads, lq, f["d"], lk, b.load(grad_scores, [h, i, E.coord(2)]),
                _at(f["k"], heads, h, E.coord(1), E.coord(2)), epilogue=scaled, label="attention_grad_q")
    dk = b.gemm(f["batch"] * kv, lk, f["d"], group * lq, b.load(grad_scores, [query_head(p), query_row(p), E.coord(1)]),
                _at(f["q"], heads, query_head(b_p), query_row(b_p), E.coord(2)), epilogue=scaled,
                label="attention_grad_k")
    return (b.reshape(dq, (f["batch"], heads, lq, f["d"])), b.reshape(dk, (f["batch"], kv, lk, f["d"])),
            b.reshape(dv, (f["batch"], kv, lk, f["dv"])))
