"""Per-row attention kernels, for head sizes the blocked form cannot hold in registers (d + dv above 160) or
workgroup storage too small for its smallest tile, and for the forward of a decode step's few query rows where the
flash form does not fit (``plans.row_plan``): one workgroup per row, ``THREADS`` threads walking the other sequence in
tiles of ``THREADS``:
  forward  per query row (b, h, i), and per slice of the keys where the plan cuts them (``sliced_forward``): scores
           of a key tile, online softmax (running max and sum), the output accumulated over value rows; writes out
           (b, h, i, :) and the row's log-sum-exp, or the slice's partial results for ``merge``;
  grad_q   per query row: recomputes the tile's probabilities from the saved log-sum-exp, dS = P (dO.V - delta),
           dQ += dS K;
  grad_kv  per key row (b, g, j) of KV head g: walks every query head of its group and every query row,
           dV += P dO and dK += dS Q. Each output is owned by one workgroup: no atomics.
"""
from __future__ import annotations

import textwrap

from .. import wgsl
from .common import (MASKED, PROB, entry, forward_outputs, key_range, key_range_arrays, slice_bounds, sliced_grid,
                     u32_constants, vec4_loaders)
from .plans import ROW_THREADS, AttentionShape, RowPlan, live_slices

THREADS = ROW_THREADS  # threads per workgroup, and rows of the other sequence per tile


def per_row_kernel(prelude: str, kind: str, shape: AttentionShape, outs: list[str], limits: dict,
                   plan: RowPlan = RowPlan(), partial: str | None = None) -> tuple[str, tuple[int, int, int]]:
    """WGSL and workgroup grid of pass ``kind`` ("forward", "grad_q" or "grad_kv"), one workgroup per row;
    ``outs`` names the output arrays as ``attention_kernel`` takes them. The forward may be cut into ``plan.splits``
    slices of the keys, a workgroup each, storing partial results into ``partial`` (``sliced_forward``)."""
    rows = shape.batch * (shape.kv_heads * shape.lk if kind == "grad_kv" else shape.heads * shape.lq)
    grid = sliced_grid(shape, kind, plan, rows, limits)
    if kind == "forward":
        branches = {x for x in ("k", "v") if f"fn load_{x}_if(" in prelude}
        body = vec4_loaders(prelude, shape, "q", "k") + _forward(shape, outs, plan, partial, branches)
    else:
        body = {"grad_q": _grad_q, "grad_kv": _grad_kv}[kind](shape, outs)
    source = "\n".join([prelude, _constants(shape, kind, rows, grid, plan), _helpers(shape), body])
    return source, grid


def sliced_forward(prelude: str, s: AttentionShape, outs: list[str], plan: RowPlan, limits: dict,
                   partial: str | None) -> tuple[str, tuple[int, int, int]]:
    """The forward of a few query rows per head (``plans.row_plan``): one workgroup per query row and slice of the
    keys, each walking only the keys its row leaves unmasked (``common.key_range``)."""
    return per_row_kernel(prelude, "forward", s, outs, limits, plan, partial)


def _constants(s: AttentionShape, kind: str, rows: int, grid, plan: RowPlan) -> str:
    """WGSL constants of a per-row pass (the key count, a slice's keys, the slices launched and the grid may be
    symbolic: a sliced forward over a dynamic graph's KV cache)."""
    return (u32_constants(SPLITS=plan.splits, LIVE=live_slices(s, kind, plan), CHUNK=plan.chunk, BQ=1, T=THREADS,
                          H=s.heads, HKV=s.kv_heads, GROUP=s.heads // s.kv_heads, LQ=s.lq, LK=s.lk, D=s.d, DV=s.dv,
                          ROWS=rows) + "\n" + wgsl.grid_constants(grid)
            + f"const SCALE: f32 = {s.scale!r};\nconst MASKED: f32 = {MASKED!r};\n"
            + u32_constants(PER_D=-(-s.d // THREADS), PER_DV=-(-s.dv // THREADS)))


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

{PROB}
"""


def _forward(s: AttentionShape, outs: list[str], plan: RowPlan, partial: str | None, branches: set) -> str:
    """Each workgroup: one query row (b, h, i) and slice ``split`` of the keys, walked a tile of T keys at a time
    (one key a thread) between ``key_from`` and ``key_to``; the output normalised into ``out`` (and the log-sum-exp
    into ``lse``), or, cut into slices, unnormalised with the running max and sum into the slice's row of
    ``partial`` (``merge``'s layout). ``branches``: the operands (of "k", "v") that branch between a plain read and
    an update's row (``prelude.attention_prelude``)."""
    d4 = -(-s.d // 4)
    return f"""{key_range_arrays(s)}
var<workgroup> row_q4: array<vec4<f32>, {d4}>;
{FRESH_ARRAYS if "v" in branches else ""}
{TILE_FOLDS}
{entry("T", "wid", "ROWS * LIVE")}  let row = wid / LIVE;
  let split = wid % LIVE;
  let b = row / (H * LQ);
  let h = (row / LQ) % H;
  let i = row % LQ;
  let i0 = i;  // (the block of one row that key_range narrows over)
  for (var c4 = tid; c4 < {d4}u; c4 = c4 + T) {{ row_q4[c4] = load_q4(b, h, i, c4); }}
  workgroupBarrier();
{slice_bounds("key", "LK")}
{key_range(s, "T")}
  var m = MASKED;
  var l = 0.0;
  var acc: array<f32, PER_DV>;
{"  var fresh_seen = 0u;" if "v" in branches else ""}
  for (var start = key_from; start < key_to; start = start + T) {{
    let j = start + tid;
    var sc = MASKED;
    if (j < key_to{" && j <= i" if s.causal else ""}) {{
{textwrap.indent(_row_score(s, d4, "k" in branches), "      ")}
    }}
{_fresh_flags("v" in branches)}    tile_s[tid] = sc;
    workgroupBarrier();
    let m_new = max(m, tile_max());
    tile_p[tid] = prob(sc, m_new);
    workgroupBarrier();
    let alpha = select(exp(m - m_new), 1.0, m <= MASKED);
    l = l * alpha + tile_sum();
    let n = min(T, key_to - start);
{_fresh_seen("v" in branches)}    for (var r = 0u; r < PER_DV; r = r + 1u) {{
      let c = tid + r * T;
      if (c < DV) {{
{textwrap.indent(_values_times_probabilities("v" in branches), "        ")}
        acc[r] = acc[r] * alpha + (a0 + a1) + (a2 + a3);
      }}
    }}
    m = m_new;
    workgroupBarrier();
  }}
{_forward_stores(s, outs, plan, partial)}
}}
"""


def _row_score(s: AttentionShape, d4: int, branch: bool) -> str:
    """WGSL: ``sc``, the scaled, biased score of the row's query (``row_q4``) against key row j, by vec4s of the
    key row (two sums in flight); where the keys branch, once per row between the two sides' groups, so that a
    row's group reads are all in flight together."""
    bias = "load_bias(b, h, i, j)" if s.has_bias else "0.0"

    def score(loader: str) -> str:
        halves = [" + ".join(f"row_q4[{c}u] * {loader}(b, h, j, {c}u)" for c in range(first, d4, 2))
                  or "vec4<f32>()" for first in (0, 1)]
        return f"sc = dot(({halves[0]}) + ({halves[1]}), vec4<f32>(1.0)) * SCALE + {bias};"
    if not branch:
        return score("load_k4")
    return (f"if (load_k_if(b, h, j, 0u)) {{\n  {score('load_k_14')}\n}} else {{\n  {score('load_k_24')}\n}}")


# Workgroup state of a forward whose values branch (``_fresh_flags``): per key of the tile, whether it takes the
# update's row, and how many keys have, counted over the tiles walked (so that no reset races the next tile).
FRESH_ARRAYS = "var<workgroup> tile_f: array<u32, T>;\nvar<workgroup> fresh_keys: atomic<u32>;"


def _fresh_flags(branch: bool) -> str:
    """WGSL, before the tile's first barrier: this thread's key's flag (it takes the update's value row)."""
    if not branch:
        return ""
    return """    let fresh = j < key_to && load_v_if(b, h, j, 0u);
    tile_f[tid] = select(0u, 1u, fresh);
    if (fresh) { atomicAdd(&fresh_keys, 1u); }
"""


def _fresh_seen(branch: bool) -> str:
    """WGSL, after the tile's barriers: ``fresh_tile``, whether some key of the tile takes the update's row (the
    same in every thread)."""
    if not branch:
        return ""
    return """    let fresh_total = atomicLoad(&fresh_keys);
    let fresh_tile = fresh_total != fresh_seen;
    fresh_seen = fresh_total;
"""


# Value rows a thread reads at once in the forward's sum over a tile: the reads are independent, all in flight
# before the first product (a value row branching between a plain read and an update's row reads plainly here).
VALUE_READS = 16


def _values_times_probabilities(branch: bool) -> str:
    """WGSL: the tile's probabilities times column c of its value rows into a0..a3, VALUE_READS reads at once.
    Where the values branch, the plain reads of keys that take the update's row count zero, and a second walk adds
    those keys' own values, only in a tile that has some (``fresh_tile``)."""
    def value(t: str) -> str:
        plain = f"load_v_2(b, h, start + {t}, c)" if branch else f"load_v(b, h, start + {t}, c)"
        return f"select({plain}, 0.0, tile_f[{t}] != 0u)" if branch else plain
    reads = "\n".join(f"  let v{k} = {value(f't + {k}u')};" for k in range(VALUE_READS))
    sums = "\n".join(f"  a{k % 4} = fma(tile_p[t + {k}u], v{k}, a{k % 4});" for k in range(VALUE_READS))
    fresh = """
if (fresh_tile) {
  for (var u = 0u; u < n; u = u + 1u) {
    if (tile_f[u] != 0u) { a0 = fma(tile_p[u], load_v_1(b, h, start + u, c), a0); }
  }
}""" if branch else ""
    return f"""var a0 = 0.0;
var a1 = 0.0;
var a2 = 0.0;
var a3 = 0.0;
var t = 0u;
for (; t + {VALUE_READS - 1}u < n; t = t + {VALUE_READS}u) {{
{reads}
{sums}
}}
for (; t < n; t = t + 1u) {{ a0 = fma(tile_p[t], {value("t")}, a0); }}{fresh}"""


# WGSL: a tile's largest score and its sum of probabilities, read four at a time (T is a multiple of 4).
TILE_FOLDS = """fn tile_max() -> f32 {
  var m4 = vec4<f32>(MASKED);
  for (var t = 0u; t < T; t = t + 4u) {
    m4 = max(m4, vec4<f32>(tile_s[t], tile_s[t + 1u], tile_s[t + 2u], tile_s[t + 3u]));
  }
  return max(max(m4.x, m4.y), max(m4.z, m4.w));
}

fn tile_sum() -> f32 {
  var s4 = vec4<f32>(0.0);
  for (var t = 0u; t < T; t = t + 4u) {
    s4 = s4 + vec4<f32>(tile_p[t], tile_p[t + 1u], tile_p[t + 2u], tile_p[t + 3u]);
  }
  return (s4.x + s4.y) + (s4.z + s4.w);
}
"""


def _forward_stores(s: AttentionShape, outs: list[str], plan: RowPlan, partial: str | None) -> str:
    """WGSL: the forward's row normalised into ``out`` (and its log-sum-exp into ``lse``), or, cut into slices, the
    slice's unnormalised row, running max and sum into ``partial``."""
    if plan.splits > 1:
        return f"""  let at = (split * ROWS + row) * (DV + 2u);
  for (var r = 0u; r < PER_DV; r = r + 1u) {{
    let c = tid + r * T;
    if (c < DV) {{ {partial}[at + c] = acc[r]; }}
  }}
  if (tid == 0u) {{ {partial}[at + DV] = m; {partial}[at + DV + 1u] = l; }}"""
    out, lse = forward_outputs(outs)
    stores = _store_columns(out, "select(acc[r] / l, 0.0, l == 0.0)", "DV")
    return stores + ("" if lse is None else
                     f"\n  if (tid == 0u) {{ {lse}[row] = select(m + log(l), MASKED, l == 0.0); }}")


def _grad_q(s: AttentionShape, outs: list[str]) -> str:
    (dq,) = outs
    return entry() + f"""  let b = row / (H * LQ);
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
{_accumulate("acc", "tile_s", "load_k", "D", "LK", "    ")}
    workgroupBarrier();
  }}
{_store_columns(dq, "acc[r] * SCALE", "D")}
}}
"""


def _grad_kv(s: AttentionShape, outs: list[str]) -> str:
    dk, dv = outs
    return entry() + f"""  let b = row / (HKV * LK);
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
{_accumulate("acc_v", "tile_p", "load_dout", "DV", "LQ", "      ")}
{_accumulate("acc_k", "tile_s", "load_q", "D", "LQ", "      ")}
      workgroupBarrier();
    }}
  }}
{_store_columns(dk, "acc_k[r] * SCALE", "D")}
{_store_columns(dv, "acc_v[r]", "DV")}
}}
"""


def _accumulate(acc: str, weights: str, load: str, size: str, other: str, indent: str) -> str:
    """WGSL: for each of the thread's columns c (tid + r * T, below ``size``: D or DV), ``acc[r]`` += the tile's
    ``weights[t] * load(b, h, start + t, c)`` over its rows t (below ``other``, the sequence's length)."""
    return textwrap.indent(f"""for (var r = 0u; r < PER_{size}; r = r + 1u) {{
  let c = tid + r * T;
  if (c < {size}) {{
    var a = {acc}[r];
    for (var t = 0u; t < T && start + t < {other}; t = t + 1u) {{ a = a + {weights}[t] * {load}(b, h, start + t, c); }}
    {acc}[r] = a;
  }}
}}""", indent)


def _store_columns(out: str, value: str, size: str) -> str:
    """WGSL: ``value`` (of ``acc[r]``) into the thread's columns c (tid + r * T, below ``size``: D or DV) of row
    ``row`` of ``out``."""
    return f"""  for (var r = 0u; r < PER_{size}; r = r + 1u) {{
    let c = tid + r * T;
    if (c < {size}) {{ {out}[row * {size} + c] = {value}; }}
  }}"""
