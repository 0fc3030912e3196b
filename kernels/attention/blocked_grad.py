"""Blocked attention gradients: dQ per block of query rows (``blocked_grad_q``), dK and dV per block of key rows
(``blocked_grad_kv``), one row per thread, with tiles of the other sequence staged in workgroup memory and read by
broadcast (see ``blocked`` for the form and its helpers). Each recomputes the tile's probabilities from the saved
log-sum-exp, and dS = P (dO.V - delta)."""
from __future__ import annotations

from ..sizes import ceil_div
from .blocked import blocked_header, partial_stores, row_dot, row_stores, stage, vec4_load
from .common import block_entry, sliced_grid, slice_bounds, vec4_loaders
from .plans import AttentionShape, BlockPlan


def blocked_grad_q(prelude: str, s: AttentionShape, outs: list[str], plan: BlockPlan, limits: dict,
                   partial: str | None) -> tuple[str, tuple[int, int, int]]:
    """dQ for a block of query rows, one per thread: its output gradient and dQ in vec4 registers, its query row
    in workgroup memory; key and value tiles staged once per block and read by broadcast. Cut into slices of
    keys, each slice stores its unscaled share of dQ into ``partial``."""
    (dq,) = outs
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    per_block = ceil_div(s.lq, plan.rows)
    blocks = s.batch * s.heads * per_block
    grid = sliced_grid(s, "grad_q", plan, blocks, limits)
    dout_regs = "\n".join(f"  let o{c} = {vec4_load('load_dout', 'b, h, iq', c, s.dv)};" for c in range(dv4))
    acc_regs = "\n".join(f"  var g{c} = vec4<f32>();" for c in range(d4))
    if plan.splits == 1:
        stores = row_stores(dq, "g", d4, s.d, " * SCALE")
    else:
        stores = partial_stores(partial, [("g", d4, s.d)])
    kernel = f"""
// ---- attention grad_q: {plan.rows} query rows per workgroup, key tiles of {plan.tile}
{blocked_header(s, plan, blocks, grid, per_block, "grad_q")}
var<workgroup> tile_k: array<vec4<f32>, {plan.tile * d4}>;
var<workgroup> tile_v: array<vec4<f32>, {plan.tile * dv4}>;
var<workgroup> own_q: array<vec4<f32>, {plan.rows * (d4 + 1)}>;

{block_entry("BLOCK", "BLOCK", "PER_BLOCK")}
  let i = i0 + tid;
  let iq = min(i, LQ - 1u);  // rows past the end compute on the last row and store nothing
  let mine = tid * {d4 + 1}u;
  for (var c = 0u; c < {d4}u; c = c + 1u) {{ own_q[mine + c] = load_q4(b, h, iq, c); }}
{dout_regs}
{acc_regs}
  let lse = load_lse(b, h, iq);
  let delta = load_delta(b, h, iq);
{slice_bounds("key", "min(LK, i0 + BLOCK)" if s.causal else "LK")}
  for (var start = key_lo; start < key_end; start = start + TILE) {{
    workgroupBarrier();
{stage("tile_k", "load_k4", plan, d4, "start", "LK")}
{stage("tile_v", "load_v4", plan, dv4, "start", "LK")}
    workgroupBarrier();
{_grad_q_tile(s)}
  }}
  if (i < LQ) {{
    let row = bh * LQ + i;
{stores}
  }}
}}
"""
    return prelude + "\n" + vec4_loaders(prelude, s, "q", "k", "v") + kernel, grid


def _grad_q_tile(s: AttentionShape) -> str:
    """WGSL: one staged key tile in the blocked grad_q: each key's probability from the row's log-sum-exp, its
    dS, and dQ += dS K."""
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    bias = "load_bias(b, h, iq, j)" if s.has_bias else "0.0"
    dp = " + ".join(f"dot(o{c}, tile_v[t * {dv4}u + {c}u])" for c in range(dv4))
    update = "\n".join(f"          g{c} = fma(vec4<f32>(ds), tile_k[t * {d4}u + {c}u], g{c});" for c in range(d4))
    return f"""    let n = min(TILE, key_end - start);
    for (var t = 0u; t < n; t = t + 1u) {{
      let j = start + t;
      if (!({"j > i" if s.causal else "false"})) {{
        let p = prob(({row_dot("own_q", "mine", "tile_k", "t", d4)}) * SCALE + {bias}, lse);
        if (p > 0.0) {{
          let ds = p * (({dp}) - delta);
{update}
        }}
      }}
    }}"""


def blocked_grad_kv(prelude: str, s: AttentionShape, outs: list[str], plan: BlockPlan, limits: dict,
                    partial: str | None) -> tuple[str, tuple[int, int, int]]:
    """dK and dV for a block of key rows of one KV head, one per thread: dK and dV in vec4 registers, its key and
    value rows in workgroup memory; for every query head of the group, tiles of queries, output gradients, lse
    and delta staged once per block and read by broadcast. Cut into slices of queries, each slice stores its
    unscaled share of dK and dV into ``partial``."""
    dk, dv = outs
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    per_block = ceil_div(s.lk, plan.rows)
    blocks = s.batch * s.kv_heads * per_block
    grid = sliced_grid(s, "grad_kv", plan, blocks, limits)
    acc_regs = "\n".join([f"  var gk{c} = vec4<f32>();" for c in range(d4)]
                         + [f"  var gv{c} = vec4<f32>();" for c in range(dv4)])
    if plan.splits == 1:
        stores = row_stores(dk, "gk", d4, s.d, " * SCALE") + "\n" + row_stores(dv, "gv", dv4, s.dv, "")
    else:
        stores = partial_stores(partial, [("gk", d4, s.d), ("gv", dv4, s.dv)])
    kernel = _grad_kv_header(s, plan, blocks, grid, per_block) + f"""
{block_entry("BLOCK", "BLOCK", "PER_BLOCK", over="key")}
  let j = j0 + tid;
  let jk = min(j, LK - 1u);  // rows past the end compute on the last row and store nothing
  let mine_k = tid * {d4 + 1}u;
  let mine_v = tid * {dv4 + 1}u;
  for (var c = 0u; c < {d4}u; c = c + 1u) {{ own_k[mine_k + c] = load_k4(b, g * GROUP, jk, c); }}
  for (var c = 0u; c < {dv4}u; c = c + 1u) {{ own_v[mine_v + c] = load_v4(b, g * GROUP, jk, c); }}
{acc_regs}
{slice_bounds("query", "LQ", "(j0 / TILE) * TILE" if s.causal else "0u")}
  for (var h = g * GROUP; h < (g + 1u) * GROUP; h = h + 1u) {{
    for (var start = query_lo; start < query_end; start = start + TILE) {{
      workgroupBarrier();
{stage("tile_q", "load_q4", plan, d4, "start", "LQ")}
{stage("tile_do", "load_dout4", plan, dv4, "start", "LQ")}
      for (var t = tid; t < TILE; t = t + BLOCK) {{
        let r = min(start + t, LQ - 1u);
        tile_lse[t] = load_lse(b, h, r);
        tile_delta[t] = load_delta(b, h, r);
      }}
      workgroupBarrier();
{_grad_kv_tile(s)}
    }}
  }}
  if (j < LK) {{
    let row = bg * LK + j;
{stores}
  }}
}}
"""
    return prelude + "\n" + vec4_loaders(prelude, s, "q", "k", "v", "dout") + kernel, grid


def _grad_kv_header(s: AttentionShape, plan: BlockPlan, blocks: int, grid, per_block: int) -> str:
    """WGSL constants and workgroup arrays of the blocked grad_kv: the query, output-gradient, lse and delta tiles
    and each thread's key and value rows."""
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    return f"""
// ---- attention grad_kv: {plan.rows} key rows per workgroup, query tiles of {plan.tile}
{blocked_header(s, plan, blocks, grid, per_block, "grad_kv")}
var<workgroup> tile_q: array<vec4<f32>, {plan.tile * d4}>;
var<workgroup> tile_do: array<vec4<f32>, {plan.tile * dv4}>;
var<workgroup> tile_lse: array<f32, {plan.tile}>;
var<workgroup> tile_delta: array<f32, {plan.tile}>;
var<workgroup> own_k: array<vec4<f32>, {plan.rows * (d4 + 1)}>;
var<workgroup> own_v: array<vec4<f32>, {plan.rows * (dv4 + 1)}>;
"""


def _grad_kv_tile(s: AttentionShape) -> str:
    """WGSL: one staged query tile in the blocked grad_kv: each query's probability from its log-sum-exp, dV += P dO,
    its dS, and dK += dS Q."""
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    bias = "load_bias(b, h, i, jk)" if s.has_bias else "0.0"
    update_v = "\n".join(f"          gv{c} = fma(vec4<f32>(p), tile_do[t * {dv4}u + {c}u], gv{c});"
                         for c in range(dv4))
    update_k = "\n".join(f"          gk{c} = fma(vec4<f32>(ds), tile_q[t * {d4}u + {c}u], gk{c});"
                         for c in range(d4))
    return f"""      let n = min(TILE, query_end - start);
      for (var t = 0u; t < n; t = t + 1u) {{
        let i = start + t;
        if (!({"j > i" if s.causal else "false"})) {{
          let p = prob(({row_dot("own_k", "mine_k", "tile_q", "t", d4)}) * SCALE + {bias}, tile_lse[t]);
          if (p > 0.0) {{
{update_v}
            let ds = p * (({row_dot("own_v", "mine_v", "tile_do", "t", dv4)}) - tile_delta[t]);
{update_k}
          }}
        }}
      }}"""
