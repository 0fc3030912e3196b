"""Attention kernel generator: fused scaled-dot-product attention that never stores the (lq, lk) score matrix.

The caller's WGSL prelude declares the bindings and defines the loads the pass needs: ``load_q(b, h, i, c)``,
``load_k(b, h, j, c)``, ``load_v(b, h, j, c)`` (h is the query head; grouped-query attention maps it to its KV
head inside the load), optionally ``load_bias(b, h, i, j)`` (an additive mask), and for the backward passes
``load_dout(b, h, i, c)``, ``load_lse(b, h, i)`` and ``load_delta(b, h, i)`` (delta = rowsum(dout * out)).
Outputs are written contiguously into the arrays named by the caller.

Three passes. The forward, for head sizes up to d + dv = 160, runs a block of query rows per workgroup, one row
per thread, with key and value tiles staged in workgroup memory (``_blocked_forward``). Otherwise, and for the
backward passes, one workgroup per row, ``THREADS`` threads walking the other sequence in tiles of ``THREADS``:
  forward  per query row (b, h, i): scores of a key tile, online softmax (running max and sum), the output
           accumulated over value rows; writes out (b, h, i, :) and the row's log-sum-exp;
  grad_q   per query row: recomputes the tile's probabilities from the saved log-sum-exp, dS = P (dO.V - delta),
           dQ += dS K;
  grad_kv  per key row (b, g, j) of KV head g: walks every query head of its group and every query row,
           dV += P dO and dK += dS Q. Each output is owned by one workgroup: no atomics.
A score at or below ``MASKED`` (an additive mask of -inf or the dtype's minimum) counts as masked out; a row with
every score masked outputs zeros (like PyTorch's math attention).
"""
from __future__ import annotations

from dataclasses import dataclass

from .matmul import fold_grid

THREADS = 64
MASKED = -1.0e38


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    kv_heads: int
    lq: int
    lk: int
    d: int  # query/key head size
    dv: int  # value head size
    scale: float
    causal: bool
    has_bias: bool


def attention_kernel(prelude: str, kind: str, shape: AttentionShape, outs: list[str],
                     limits: dict) -> tuple[str, tuple[int, int, int]]:
    """WGSL and workgroup grid of pass ``kind`` ("forward", "grad_q" or "grad_kv"); ``outs`` names the output
    arrays: [out, lse] for forward, [dq] for grad_q, [dk, dv] for grad_kv."""
    if kind == "forward":
        plan = _block_plan(shape, limits)
        if plan is not None:
            return _blocked_forward(prelude, shape, outs, plan, limits)
    rows = shape.batch * (shape.kv_heads * shape.lk if kind == "grad_kv" else shape.heads * shape.lq)
    grid = fold_grid(rows, limits.get("max-compute-workgroups-per-dimension", 65535))
    body = {"forward": _forward, "grad_q": _grad_q, "grad_kv": _grad_kv}[kind](shape, outs)
    source = "\n".join([prelude, _constants(shape, rows, grid), _helpers(shape), body])
    return source, grid


def _constants(s: AttentionShape, rows: int, grid) -> str:
    return "\n".join([
        f"const T: u32 = {THREADS}u;", f"const H: u32 = {s.heads}u;", f"const HKV: u32 = {s.kv_heads}u;",
        f"const GROUP: u32 = {s.heads // s.kv_heads}u;", f"const LQ: u32 = {s.lq}u;", f"const LK: u32 = {s.lk}u;",
        f"const D: u32 = {s.d}u;", f"const DV: u32 = {s.dv}u;", f"const ROWS: u32 = {rows}u;",
        f"const GRID_X: u32 = {grid[0]}u;", f"const GRID_XY: u32 = {grid[0] * grid[1]}u;",
        f"const SCALE: f32 = {s.scale!r};", f"const MASKED: f32 = {MASKED!r};",
        f"const PER_D: u32 = {-(-s.d // THREADS)}u;", f"const PER_DV: u32 = {-(-s.dv // THREADS)}u;",
    ])


def _helpers(s: AttentionShape) -> str:
    bias = "load_bias(b, h, i, j)" if s.has_bias else "0.0"
    causal = "j > i" if s.causal else "false"
    return f"""
var<workgroup> row_a: array<f32, {max(s.d, s.dv)}>;
var<workgroup> row_b: array<f32, {max(s.dv, 1)}>;
var<workgroup> tile_p: array<f32, {THREADS}>;
var<workgroup> tile_s: array<f32, {THREADS}>;

// The scaled score of query row i against key row j (row_a holds the query row), or MASKED.
fn score_q(b: u32, h: u32, i: u32, j: u32) -> f32 {{
  if ({causal}) {{ return MASKED; }}
  var dot = 0.0;
  for (var c = 0u; c < D; c = c + 1u) {{ dot = dot + row_a[c] * load_k(b, h, j, c); }}
  return dot * SCALE + {bias};
}}

// The scaled score of query row i (loaded) against key row j (row_a holds the key row), or MASKED.
fn score_k(b: u32, h: u32, i: u32, j: u32) -> f32 {{
  if ({causal}) {{ return MASKED; }}
  var dot = 0.0;
  for (var c = 0u; c < D; c = c + 1u) {{ dot = dot + load_q(b, h, i, c) * row_a[c]; }}
  return dot * SCALE + {bias};
}}

fn prob(s: f32, lse: f32) -> f32 {{
  return select(exp(s - lse), 0.0, s <= MASKED || lse <= MASKED);
}}
"""


def _entry() -> str:
    return """@compute @workgroup_size(T)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let row = wg.x + wg.y * GRID_X + wg.z * GRID_XY;
  if (row >= ROWS) { return; }  // uniform: the whole workgroup leaves
"""


def _forward(s: AttentionShape, outs: list[str]) -> str:
    out, lse = outs
    return _entry() + f"""  let b = row / (H * LQ);
  let h = (row / LQ) % H;
  let i = row % LQ;
  for (var c = tid; c < D; c = c + T) {{ row_a[c] = load_q(b, h, i, c); }}
  workgroupBarrier();
  var m = MASKED;
  var l = 0.0;
  var acc: array<f32, PER_DV>;
  for (var start = 0u; start < LK; start = start + T) {{
    let j = start + tid;
    var sc = MASKED;
    if (j < LK) {{ sc = score_q(b, h, i, j); }}
    tile_s[tid] = sc;
    workgroupBarrier();
    var tile_max = MASKED;
    for (var t = 0u; t < T; t = t + 1u) {{ tile_max = max(tile_max, tile_s[t]); }}
    let m_new = max(m, tile_max);
    tile_p[tid] = prob(sc, m_new);
    workgroupBarrier();
    let alpha = select(exp(m - m_new), 1.0, m <= MASKED);
    var tile_sum = 0.0;
    for (var t = 0u; t < T; t = t + 1u) {{ tile_sum = tile_sum + tile_p[t]; }}
    l = l * alpha + tile_sum;
    for (var r = 0u; r < PER_DV; r = r + 1u) {{
      let c = tid + r * T;
      if (c < DV) {{
        var a = acc[r] * alpha;
        for (var t = 0u; t < T && start + t < LK; t = t + 1u) {{
          a = a + tile_p[t] * load_v(b, h, start + t, c);
        }}
        acc[r] = a;
      }}
    }}
    m = m_new;
    workgroupBarrier();
  }}
  for (var r = 0u; r < PER_DV; r = r + 1u) {{
    let c = tid + r * T;
    if (c < DV) {{ {out}[row * DV + c] = select(acc[r] / l, 0.0, l == 0.0); }}
  }}
  if (tid == 0u) {{ {lse}[row] = select(m + log(l), MASKED, l == 0.0); }}
}}
"""


def _grad_q(s: AttentionShape, outs: list[str]) -> str:
    (dq,) = outs
    return _entry() + f"""  let b = row / (H * LQ);
  let h = (row / LQ) % H;
  let i = row % LQ;
  for (var c = tid; c < D; c = c + T) {{ row_a[c] = load_q(b, h, i, c); }}
  for (var c = tid; c < DV; c = c + T) {{ row_b[c] = load_dout(b, h, i, c); }}
  let lse = load_lse(b, h, i);
  let delta = load_delta(b, h, i);
  workgroupBarrier();
  var acc: array<f32, PER_D>;
  for (var start = 0u; start < LK; start = start + T) {{
    let j = start + tid;
    var ds = 0.0;
    if (j < LK) {{
      let p = prob(score_q(b, h, i, j), lse);
      var dp = 0.0;
      for (var c = 0u; c < DV; c = c + 1u) {{ dp = dp + row_b[c] * load_v(b, h, j, c); }}
      ds = p * (dp - delta);
    }}
    tile_s[tid] = ds;
    workgroupBarrier();
    for (var r = 0u; r < PER_D; r = r + 1u) {{
      let c = tid + r * T;
      if (c < D) {{
        var a = acc[r];
        for (var t = 0u; t < T && start + t < LK; t = t + 1u) {{ a = a + tile_s[t] * load_k(b, h, start + t, c); }}
        acc[r] = a;
      }}
    }}
    workgroupBarrier();
  }}
  for (var r = 0u; r < PER_D; r = r + 1u) {{
    let c = tid + r * T;
    if (c < D) {{ {dq}[row * D + c] = acc[r] * SCALE; }}
  }}
}}
"""


def _grad_kv(s: AttentionShape, outs: list[str]) -> str:
    dk, dv = outs
    return _entry() + f"""  let b = row / (HKV * LK);
  let g = (row / LK) % HKV;
  let j = row % LK;
  for (var c = tid; c < D; c = c + T) {{ row_a[c] = load_k(b, g * GROUP, j, c); }}
  for (var c = tid; c < DV; c = c + T) {{ row_b[c] = load_v(b, g * GROUP, j, c); }}
  workgroupBarrier();
  var acc_k: array<f32, PER_D>;
  var acc_v: array<f32, PER_DV>;
  for (var h = g * GROUP; h < (g + 1u) * GROUP; h = h + 1u) {{
    for (var start = 0u; start < LQ; start = start + T) {{
      let i = start + tid;
      var p = 0.0;
      var ds = 0.0;
      if (i < LQ) {{
        p = prob(score_k(b, h, i, j), load_lse(b, h, i));
        var dp = 0.0;
        for (var c = 0u; c < DV; c = c + 1u) {{ dp = dp + load_dout(b, h, i, c) * row_b[c]; }}
        ds = p * (dp - load_delta(b, h, i));
      }}
      tile_p[tid] = p;
      tile_s[tid] = ds;
      workgroupBarrier();
      for (var r = 0u; r < PER_DV; r = r + 1u) {{
        let c = tid + r * T;
        if (c < DV) {{
          var a = acc_v[r];
          for (var t = 0u; t < T && start + t < LQ; t = t + 1u) {{ a = a + tile_p[t] * load_dout(b, h, start + t, c); }}
          acc_v[r] = a;
        }}
      }}
      for (var r = 0u; r < PER_D; r = r + 1u) {{
        let c = tid + r * T;
        if (c < D) {{
          var a = acc_k[r];
          for (var t = 0u; t < T && start + t < LQ; t = t + 1u) {{ a = a + tile_s[t] * load_q(b, h, start + t, c); }}
          acc_k[r] = a;
        }}
      }}
      workgroupBarrier();
    }}
  }}
  for (var r = 0u; r < PER_D; r = r + 1u) {{
    let c = tid + r * T;
    if (c < D) {{ {dk}[row * D + c] = acc_k[r] * SCALE; }}
  }}
  for (var r = 0u; r < PER_DV; r = r + 1u) {{
    let c = tid + r * T;
    if (c < DV) {{ {dv}[row * DV + c] = acc_v[r]; }}
  }}
}}
"""


# ---------------------------------------------------------------- forward over a block of query rows


@dataclass(frozen=True)
class BlockPlan:
    rows: int  # query rows per workgroup, one per thread
    keys: int  # keys per tile staged in workgroup memory

    def shared_bytes(self, d4: int, dv4: int) -> int:
        return 16 * self.keys * (d4 + dv4) + 4 * self.rows * (self.keys + 1)


def _block_plan(s: AttentionShape, limits: dict) -> BlockPlan | None:
    """The query block and key tile of the blocked forward, or None where the per-row kernel is the one to use
    (head sizes whose query row and accumulator would not fit in registers)."""
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    if d4 + dv4 > BLOCK_MAX_VEC4:
        return None
    rows = BLOCK_ROWS[0]
    while rows > BLOCK_ROWS[-1] and s.batch * s.heads * -(-s.lq // rows) < BLOCK_MIN_WORKGROUPS:
        rows //= 2
    rows = min(rows, limits.get("max-compute-invocations-per-workgroup", 256),
               limits.get("max-compute-workgroup-size-x", 256))
    for keys in BLOCK_KEYS:
        plan = BlockPlan(rows, min(keys, max(4, 1 << max(0, s.lk - 1).bit_length())))
        if plan.shared_bytes(d4, dv4) <= limits.get("max-compute-workgroup-storage-size", 16384):
            return plan
    return None


BLOCK_ROWS = (64, 32, 16)  # query rows per workgroup: the largest that still gives BLOCK_MIN_WORKGROUPS
BLOCK_MIN_WORKGROUPS = 128
BLOCK_KEYS = (32, 16, 8, 4)  # keys per tile, the largest that fits the workgroup storage
BLOCK_MAX_VEC4 = 40  # query row + output accumulator per thread, in vec4 registers (d + dv <= 160)


def _vec4_load(fn: str, args: str, c4: int, size: int) -> str:
    """vec4 of ``fn(args, 4*c4 + t)`` for t < 4, zero past ``size``."""
    parts = [f"{fn}({args}, {4 * c4 + t}u)" if 4 * c4 + t < size else "0.0" for t in range(4)]
    return f"vec4<f32>({', '.join(parts)})"


def _blocked_forward(prelude: str, s: AttentionShape, outs: list[str], plan: BlockPlan,
                     limits: dict) -> tuple[str, tuple[int, int, int]]:
    """Each thread owns one query row: its query and output accumulator live in vec4 registers, and the
    workgroup stages tiles of keys and values in workgroup memory that every thread reads by broadcast, so a
    key is fetched once per block of rows instead of once per row. Softmax is online, rescaled per tile."""
    out, lse = outs
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    blocks = s.batch * s.heads * -(-s.lq // plan.rows)
    grid = fold_grid(blocks, limits.get("max-compute-workgroups-per-dimension", 65535))
    stride = plan.keys + 1  # per-thread score row in workgroup memory, padded against bank conflicts
    q_regs = "\n".join(f"  let q{c} = {_vec4_load('load_q', 'b, h, iq', c, s.d)};" for c in range(d4))
    o_regs = "\n".join(f"  var o{c} = vec4<f32>();" for c in range(dv4))
    dot = " + ".join(f"dot(q{c}, tile_k[base + {c}u])" for c in range(d4))
    rescale = "\n".join(f"      o{c} = o{c} * alpha;" for c in range(dv4))
    accumulate = "\n".join(f"        o{c} = fma(vec4<f32>(p), tile_v[base + {c}u], o{c});" for c in range(dv4))
    stores = "\n".join(
        f"    {{ let v = select(o{c} / l, vec4<f32>(), l == 0.0);\n"
        + "".join(f"      {out}[row * DV + {4 * c + t}u] = v[{t}];\n" for t in range(4) if 4 * c + t < s.dv)
        + "    }" for c in range(dv4))
    bias = "load_bias(b, h, iq, j)" if s.has_bias else "0.0"
    masked = "j > i" if s.causal else "false"
    key_end = "min(LK, i0 + BQ)" if s.causal else "LK"
    kernel = f"""
// ---- attention forward: {plan.rows} query rows per workgroup, key tiles of {plan.keys}
const H: u32 = {s.heads}u;
const LQ: u32 = {s.lq}u;
const LK: u32 = {s.lk}u;
const DV: u32 = {s.dv}u;
const BQ: u32 = {plan.rows}u;
const BK: u32 = {plan.keys}u;
const QBLOCKS: u32 = {-(-s.lq // plan.rows)}u;
const BLOCKS: u32 = {blocks}u;
const GRID_X: u32 = {grid[0]}u;
const GRID_XY: u32 = {grid[0] * grid[1]}u;
const SCALE: f32 = {s.scale!r};
const MASKED: f32 = {MASKED!r};
var<workgroup> tile_k: array<vec4<f32>, {plan.keys * d4}>;
var<workgroup> tile_v: array<vec4<f32>, {plan.keys * dv4}>;
var<workgroup> scores: array<f32, {plan.rows * stride}>;

fn prob(s: f32, m: f32) -> f32 {{
  return select(exp(s - m), 0.0, s <= MASKED || m <= MASKED);
}}

@compute @workgroup_size({plan.rows})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {{
  let blk = wg.x + wg.y * GRID_X + wg.z * GRID_XY;
  if (blk >= BLOCKS) {{ return; }}  // uniform: the whole workgroup leaves
  let bh = blk / QBLOCKS;
  let b = bh / H;
  let h = bh % H;
  let i0 = (blk % QBLOCKS) * BQ;
  let i = i0 + tid;
  let iq = min(i, LQ - 1u);  // rows past the end compute on the last row and store nothing
{q_regs}
{o_regs}
  var m = MASKED;
  var l = 0.0;
  let key_end = {key_end};
  for (var start = 0u; start < key_end; start = start + BK) {{
    workgroupBarrier();
    for (var e = tid; e < BK * {d4}u; e = e + BQ) {{
      let j = start + e / {d4}u;
      var v = vec4<f32>();
      if (j < LK) {{ v = load_k4(b, h, j, e % {d4}u); }}
      tile_k[e] = v;
    }}
    for (var e = tid; e < BK * {dv4}u; e = e + BQ) {{
      let j = start + e / {dv4}u;
      var v = vec4<f32>();
      if (j < LK) {{ v = load_v4(b, h, j, e % {dv4}u); }}
      tile_v[e] = v;
    }}
    workgroupBarrier();
    let n = min(BK, LK - start);
    var tile_max = MASKED;
    for (var t = 0u; t < n; t = t + 1u) {{
      let j = start + t;
      var sc = MASKED;
      if (!({masked})) {{
        let base = t * {d4}u;
        sc = ({dot}) * SCALE + {bias};
      }}
      scores[tid * {stride}u + t] = sc;
      tile_max = max(tile_max, sc);
    }}
    let m_new = max(m, tile_max);
    if (m_new > m) {{
      let alpha = select(exp(m - m_new), 1.0, m <= MASKED);
      l = l * alpha;
{rescale}
      m = m_new;
    }}
    for (var t = 0u; t < n; t = t + 1u) {{
      let p = prob(scores[tid * {stride}u + t], m);
      if (p > 0.0) {{
        l = l + p;
        let base = t * {dv4}u;
{accumulate}
      }}
    }}
  }}
  if (i < LQ) {{
    let row = bh * LQ + i;
{stores}
    {lse}[row] = select(m + log(l), MASKED, l == 0.0);
  }}
}}
"""
    loads = (f"fn load_k4(b: u32, h: u32, j: u32, c4: u32) -> vec4<f32> {{\n"
             f"  let c = 4u * c4;\n  return vec4<f32>("
             + ", ".join(f"select(0.0, load_k(b, h, j, min(c + {t}u, {s.d - 1}u)), c + {t}u < {s.d}u)" for t in range(4))
             + ");\n}\n"
             f"fn load_v4(b: u32, h: u32, j: u32, c4: u32) -> vec4<f32> {{\n"
             f"  let c = 4u * c4;\n  return vec4<f32>("
             + ", ".join(f"select(0.0, load_v(b, h, j, min(c + {t}u, {s.dv - 1}u)), c + {t}u < {s.dv}u)"
                         for t in range(4))
             + ");\n}\n")
    return prelude + "\n" + loads + kernel, grid
