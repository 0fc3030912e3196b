"""Attention kernel generator: fused scaled-dot-product attention that never stores the (lq, lk) score matrix.

The caller's WGSL prelude declares the bindings and defines the loads the pass needs: ``load_q(b, h, i, c)``,
``load_k(b, h, j, c)``, ``load_v(b, h, j, c)`` (h is the query head; grouped-query attention maps it to its KV
head inside the load), optionally ``load_bias(b, h, i, j)`` (an additive mask), and for the backward passes
``load_dout(b, h, i, c)``, ``load_lse(b, h, i)`` and ``load_delta(b, h, i)`` (delta = rowsum(dout * out)).
Outputs are written contiguously into the arrays named by the caller.

Three passes, each in two forms. Blocked (``_blocked_*``, for head sizes up to d + dv = 160; on an H200 it was the
faster form in the SD U-Net (seq 64-256), SmolLM2 (seq 128, rotary embeddings in the loads) and Whisper (seq 1500)
workloads, though a bare seq-50 attention ran faster per row): a block of rows per workgroup, one row per thread,
with tiles of the other sequence staged in workgroup memory and read by broadcast. Where the row blocks are too few
to fill the GPU (Whisper: 144), the other sequence is also cut into slices, one workgroup per (block, slice); the
slices' partial results (output with running max and sum, or gradient shares) go to scratch and a second dispatch
merges them. Per row (otherwise): one workgroup per row, ``THREADS`` threads walking the other sequence in tiles of
``THREADS``:
  forward  per query row (b, h, i): scores of a key tile, online softmax (running max and sum), the output
           accumulated over value rows; writes out (b, h, i, :) and the row's log-sum-exp;
  grad_q   per query row: recomputes the tile's probabilities from the saved log-sum-exp, dS = P (dO.V - delta),
           dQ += dS K;
  grad_kv  per key row (b, g, j) of KV head g: walks every query head of its group and every query row,
           dV += P dO and dK += dS Q. Each output is owned by one workgroup: no atomics.
A score at or below ``MASKED`` (an additive mask of -inf or the dtype's minimum) counts as masked out; a row with
every score masked outputs zeros (like PyTorch's math attention).

The forward has a third form, flash (``_flash_forward``), for head sizes up to ``FLASH_MAX_HEAD`` where the
workgroup storage holds its tiles: a block of 64 (or 32) query rows per workgroup, key tiles of 32, and both
products register-tiled, 4 rows x 4 keys of scores and 4 rows x a few vec4 columns of output per thread
(FlashAttention-2's loop order). On an H200 it took the inference GPU time of Whisper-tiny from 3.13 to 2.75 ms
(against the unfused matmuls), SD U-Net 3.19 -> 2.87, SmolLM2 5.82 -> 5.22 (unfused before), SmolVLA 2.67 -> 2.41
(the blocked forward before).
"""
from __future__ import annotations

from dataclasses import dataclass

from .matmul import fold_grid
from .wgsl import SPLIT_TARGET_WORKGROUPS

THREADS = 64
MASKED = -1.0e38
# The probability of a score against a row's log-sum-exp (or running max), zero where either is masked out.
PROB = """fn prob(s: f32, lse: f32) -> f32 {
  return select(exp(s - lse), 0.0, s <= MASKED || lse <= MASKED);
}"""


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


def attention_splits(shape: AttentionShape, kind: str, limits: dict) -> int:
    """How many slices of the other sequence pass ``kind`` is cut into (1: not cut). The slices' partial results
    go to scratch of ``partial_floats`` floats, and a second dispatch merges them."""
    plan = (_flash_plan(shape, limits) if kind == "forward" else None) or _block_plan(shape, kind, limits)
    return 1 if plan is None else plan.splits


def partial_floats(shape: AttentionShape, kind: str, splits: int) -> int:
    """Floats of scratch that ``splits`` slices of pass ``kind`` write: per slice and row, the unnormalised
    output with its running max and sum (forward), dQ (grad_q), or dK and dV (grad_kv)."""
    rows, width = _partial_layout(shape, kind)
    return splits * rows * width


def attention_kernel(prelude: str, kind: str, shape: AttentionShape, outs: list[str], limits: dict,
                     partial: str | None = None) -> list[tuple[str, tuple[int, int, int]]]:
    """WGSL and workgroup grid of each dispatch of pass ``kind`` ("forward", "grad_q" or "grad_kv"); ``outs``
    names the output arrays: [out, lse] for forward, [dq] for grad_q, [dk, dv] for grad_kv. Where
    ``attention_splits`` is above 1, ``partial`` names the scratch array and there are two dispatches: the
    slices, then their merge."""
    flash = _flash_plan(shape, limits) if kind == "forward" else None
    if flash is not None:
        if flash.splits > 1 and partial is None:
            raise ValueError(f"attention forward is cut into {flash.splits} slices and needs a partial array")
        passes = [_flash_forward(prelude, shape, outs, flash, limits, partial)]
        if flash.splits > 1:
            passes.append(_merge(prelude, shape, kind, outs, flash.splits, partial, limits))
        return passes
    plan = _block_plan(shape, kind, limits)
    if plan is not None:
        if plan.splits > 1 and partial is None:
            raise ValueError(f"attention {kind} is cut into {plan.splits} slices and needs a partial array")
        blocked = {"forward": _blocked_forward, "grad_q": _blocked_grad_q, "grad_kv": _blocked_grad_kv}[kind]
        passes = [blocked(prelude, shape, outs, plan, limits, partial)]
        if plan.splits > 1:
            passes.append(_merge(prelude, shape, kind, outs, plan.splits, partial, limits))
        return passes
    rows = shape.batch * (shape.kv_heads * shape.lk if kind == "grad_kv" else shape.heads * shape.lq)
    grid = fold_grid(rows, limits.get("max-compute-workgroups-per-dimension", 65535))
    body = {"forward": _forward, "grad_q": _grad_q, "grad_kv": _grad_kv}[kind](shape, outs)
    source = "\n".join([prelude, _constants(shape, rows, grid), _helpers(shape), body])
    return [(source, grid)]


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

{PROB}
"""


def _entry(size: str = "T", index: str = "row", count: str = "ROWS") -> str:
    """The kernel's head: ``index``, the linear workgroup id (folded grids), and an exit for ids past ``count``."""
    return f"""@compute @workgroup_size({size})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {{
  let {index} = wg.x + wg.y * GRID_X + wg.z * GRID_XY;
  if ({index} >= {count}) {{ return; }}  // uniform: the whole workgroup leaves
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


# ---------------------------------------------------------------- blocked passes: a block of rows per workgroup


@dataclass(frozen=True)
class BlockPlan:
    rows: int  # rows of the pass (query rows; key rows for grad_kv) per workgroup, one per thread
    tile: int  # rows of the other sequence per tile staged in workgroup memory
    splits: int = 1  # slices of the other sequence, each a workgroup of its own (merged by a second dispatch)
    chunk: int = 0  # rows of the other sequence per slice, a multiple of ``tile`` (with splits > 1)


def _shared_bytes(kind: str, plan: BlockPlan, d4: int, dv4: int) -> int:
    if kind == "forward":  # key and value tiles, each thread's scores of a tile
        return 16 * plan.tile * (d4 + dv4) + 4 * plan.rows * (plan.tile + 1)
    if kind == "grad_q":  # key and value tiles, each thread's query row
        return 16 * plan.tile * (d4 + dv4) + 16 * plan.rows * (d4 + 1)
    # grad_kv: query, output-gradient, lse and delta tiles, each thread's key and value rows
    return 16 * plan.tile * (d4 + dv4) + 8 * plan.tile + 16 * plan.rows * (d4 + dv4 + 2)


def _block_plan(s: AttentionShape, kind: str, limits: dict) -> BlockPlan | None:
    """Rows per workgroup and tile length of a blocked pass, or None where the per-row kernel is the one to use:
    head sizes whose per-thread registers would not fit, or workgroup storage too small for the smallest tile."""
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    if d4 + dv4 > BLOCK_MAX_VEC4:
        return None
    own, other = (s.kv_heads * s.lk, s.lq) if kind == "grad_kv" else (s.heads * s.lq, s.lk)
    length = own // (s.kv_heads if kind == "grad_kv" else s.heads)
    rows = BLOCK_ROWS[0]
    while rows > BLOCK_ROWS[-1] and s.batch * (own // length) * -(-length // rows) < BLOCK_MIN_WORKGROUPS:
        rows //= 2
    rows = min(rows, limits.get("max-compute-invocations-per-workgroup", 256),
               limits.get("max-compute-workgroup-size-x", 256))
    storage = limits.get("max-compute-workgroup-storage-size", 16384)
    fits = [BlockPlan(r, min(tile, max(4, 1 << max(0, other - 1).bit_length())))
            for r in BLOCK_ROWS if r <= rows for tile in BLOCK_TILES]  # fewer rows, then shorter tiles
    plan = next((p for p in fits if _shared_bytes(kind, p, d4, dv4) <= storage), None)
    if plan is None:
        return None
    blocks = s.batch * (own // length) * -(-length // plan.rows)
    tiles = -(-other // plan.tile)
    splits = 1
    while (blocks * splits < SPLIT_TARGET_WORKGROUPS and tiles // (splits * 2) >= SPLIT_MIN_TILES
           and splits * 2 <= SPLIT_MAX):
        splits *= 2
    return BlockPlan(plan.rows, plan.tile, splits, -(-tiles // splits) * plan.tile if splits > 1 else 0)


def _partial_layout(s: AttentionShape, kind: str) -> tuple[int, int]:
    """Rows of a pass's output and floats per row in one slice of its scratch."""
    if kind == "forward":
        return s.batch * s.heads * s.lq, s.dv + 2
    if kind == "grad_q":
        return s.batch * s.heads * s.lq, s.d
    return s.batch * s.kv_heads * s.lk, s.d + s.dv


BLOCK_ROWS = (64, 32, 16)  # rows per workgroup: the largest that still gives BLOCK_MIN_WORKGROUPS
BLOCK_MIN_WORKGROUPS = 128
BLOCK_TILES = (32, 16, 8, 4)  # rows of the other sequence per tile, the largest that fits the workgroup storage
BLOCK_MAX_VEC4 = 40  # per-thread vec4 registers of row state (d/4 + dv/4, so d + dv <= 160)
# A long other sequence over too few blocks (Whisper's 1500 frames: 144 blocks) is cut into slices until the pass
# has SPLIT_TARGET_WORKGROUPS workgroups, each slice at least SPLIT_MIN_TILES tiles long.
SPLIT_MIN_TILES = 2
SPLIT_MAX = 16
MERGE_THREADS = 256
# Forward: keys whose scores a thread computes together (independent dot products in flight). H200, Whisper: the
# forward 2.41 -> 2.30 ms; the same for the gradient passes (2 keys) made them slower (grad_kv 4.0 -> 11.0 ms).
UNROLL = 4


def _vec4_loaders(prelude: str, s: AttentionShape, *operands: str) -> str:
    """``load_<x>4(b, h, r, c4)``: components 4*c4 .. 4*c4+3 of ``load_<x>``, zero past the head size, for c4 below
    the row's vec4 count (every caller's range), where the caller's ``prelude`` does not define it (with one vec4
    read). Only the last vec4's components past the head size are checked."""
    sizes = {"q": s.d, "k": s.d, "v": s.dv, "dout": s.dv}
    out = []
    for x in operands:
        if f"fn load_{x}4(" in prelude:
            continue
        size = sizes[x]
        last = 4 * (-(-size // 4) - 1)  # the first component of the last vec4
        parts = ", ".join(f"select(0.0, load_{x}(b, h, r, min(c + {t}u, {size - 1}u)), c + {t}u < {size}u)"
                          if last + t >= size else f"load_{x}(b, h, r, c + {t}u)" for t in range(4))
        out.append(f"fn load_{x}4(b: u32, h: u32, r: u32, c4: u32) -> vec4<f32> {{\n  let c = 4u * c4;\n"
                   f"  return vec4<f32>({parts});\n}}\n")
    return "".join(out)


def _stage(array: str, fn: str, plan: BlockPlan, width: int, first: str, limit: str) -> str:
    """WGSL: the workgroup copies ``plan.tile`` rows of ``width`` vec4s from row ``first`` on (zeros past ``limit``)
    into ``array``. Straight-line code, every load issued before the first store, so that the loads of a thread
    are in flight together instead of one loop iteration at a time."""
    total = plan.tile * width
    lines = []
    for t in range(-(-total // plan.rows)):
        e = f"tid + {t * plan.rows}u"
        row = f"{first} + ({e}) / {width}u"
        load = f"{fn}(b, h, min({row}, {limit} - 1u), ({e}) % {width}u)"
        lines.append(f"    let stage{t} = select(vec4<f32>(), {load}, {row} < {limit});")
    for t in range(-(-total // plan.rows)):
        guard = f"if (tid + {t * plan.rows}u < {total}u) " if (t + 1) * plan.rows > total else ""
        lines.append(f"    {guard}{{ {array}[tid + {t * plan.rows}u] = stage{t}; }}")
    return "    {\n" + "\n".join(lines) + "\n    }"


def _vec4_load(fn: str, args: str, c4: int, size: int) -> str:
    """vec4 of ``fn(args, 4*c4 + t)`` for t < 4, zero past ``size``."""
    parts = [f"{fn}({args}, {4 * c4 + t}u)" if 4 * c4 + t < size else "0.0" for t in range(4)]
    return f"vec4<f32>({', '.join(parts)})"


def _blocked_forward(prelude: str, s: AttentionShape, outs: list[str], plan: BlockPlan, limits: dict,
                     partial: str | None) -> tuple[str, tuple[int, int, int]]:
    """Each thread owns one query row: its query and output accumulator live in vec4 registers, and the
    workgroup stages tiles of keys and values in workgroup memory that every thread reads by broadcast, so a
    key is fetched once per block of rows instead of once per row. Softmax is online, rescaled per tile. Cut
    into slices of keys, each slice stores its unnormalised output, running max and sum into ``partial``."""
    out, lse = outs
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    blocks = s.batch * s.heads * -(-s.lq // plan.rows)
    grid = fold_grid(blocks * plan.splits, limits.get("max-compute-workgroups-per-dimension", 65535))
    stride = plan.tile + 1  # per-thread score row in workgroup memory, padded against bank conflicts
    q_regs = "\n".join(f"  let q{c} = {_vec4_load('load_q', 'b, h, iq', c, s.d)};" for c in range(d4))
    o_regs = "\n".join(f"  var o{c} = vec4<f32>();" for c in range(dv4))
    bias = "load_bias(b, h, iq, j)" if s.has_bias else "0.0"
    masked = "j > i" if s.causal else "false"

    def score(u: int) -> str:  # the score of key t + u into sc{u}
        dot = " + ".join(f"dot(q{c}, tile_k[(t + {u}u) * {d4}u + {c}u])" for c in range(d4))
        return (f"      var sc{u} = MASKED;\n      {{\n        let j = start + t + {u}u;\n"
                f"        if (!({masked})) {{ sc{u} = ({dot}) * SCALE + {bias}; }}\n      }}")

    rescale = "\n".join(f"      o{c} = o{c} * alpha;" for c in range(dv4))
    accumulate = "\n".join(f"        o{c} = fma(vec4<f32>(p), tile_v[base + {c}u], o{c});" for c in range(dv4))
    if plan.splits > 1:
        stores = _partial_stores(partial, [("o", dv4, s.dv)], tail=("m", "l"))
    else:
        stores = "\n".join(
            f"    {{ let v = select(o{c} / l, vec4<f32>(), l == 0.0);\n"
            + "".join(f"      {out}[row * DV + {4 * c + t}u] = v[{t}];\n" for t in range(4) if 4 * c + t < s.dv)
            + "    }" for c in range(dv4)) + f"\n    {lse}[row] = select(m + log(l), MASKED, l == 0.0);"
    key_end = "min(LK, i0 + BQ)" if s.causal else "LK"
    kernel = f"""
// ---- attention forward: {plan.rows} query rows per workgroup, key tiles of {plan.tile}
const H: u32 = {s.heads}u;
const LQ: u32 = {s.lq}u;
const LK: u32 = {s.lk}u;
const DV: u32 = {s.dv}u;
const BQ: u32 = {plan.rows}u;
const BLOCK: u32 = BQ;
const BK: u32 = {plan.tile}u;
const QBLOCKS: u32 = {-(-s.lq // plan.rows)}u;
const BLOCKS: u32 = {blocks}u;
{_split_constants(s, "forward", plan, grid)}
const SCALE: f32 = {s.scale!r};
const MASKED: f32 = {MASKED!r};
var<workgroup> tile_k: array<vec4<f32>, {plan.tile * d4}>;
var<workgroup> tile_v: array<vec4<f32>, {plan.tile * dv4}>;
var<workgroup> scores: array<f32, {plan.rows * stride}>;

{PROB}

{_entry("BQ", "wid", "BLOCKS * SPLITS")}  let blk = wid / SPLITS;
  let split = wid % SPLITS;
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
{_slice("key", key_end)}
  for (var start = key_lo; start < key_end; start = start + BK) {{
    workgroupBarrier();
{_stage("tile_k", "load_k4", plan, d4, "start", "LK")}
{_stage("tile_v", "load_v4", plan, dv4, "start", "LK")}
    workgroupBarrier();
    let n = min(BK, key_end - start);
    var tile_max = MASKED;
    var t = 0u;
    for (; t + {UNROLL - 1}u < n; t = t + {UNROLL}u) {{  // independent dot products in flight together
{chr(10).join(score(u) for u in range(UNROLL))}
{chr(10).join(f"      scores[tid * {stride}u + t + {u}u] = sc{u};{chr(10)}      tile_max = max(tile_max, sc{u});" for u in range(UNROLL))}
    }}
    for (; t < n; t = t + 1u) {{
{score(0)}
      scores[tid * {stride}u + t] = sc0;
      tile_max = max(tile_max, sc0);
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
  }}
}}
"""
    return prelude + "\n" + _vec4_loaders(prelude, s, "k", "v") + kernel, grid


def _blocked_header(s: AttentionShape, plan: BlockPlan, blocks: int, grid, per_block: int, kind: str) -> str:
    return f"""const H: u32 = {s.heads}u;
const HKV: u32 = {s.kv_heads}u;
const GROUP: u32 = {s.heads // s.kv_heads}u;
const LQ: u32 = {s.lq}u;
const LK: u32 = {s.lk}u;
const D: u32 = {s.d}u;
const DV: u32 = {s.dv}u;
const BLOCK: u32 = {plan.rows}u;
const TILE: u32 = {plan.tile}u;
const PER_BLOCK: u32 = {per_block}u;
const BLOCKS: u32 = {blocks}u;
{_split_constants(s, kind, plan, grid)}
const SCALE: f32 = {s.scale!r};
const MASKED: f32 = {MASKED!r};

{PROB}
"""


def _split_constants(s: AttentionShape, kind: str, plan: BlockPlan, grid) -> str:
    rows, _ = _partial_layout(s, kind)
    return (f"const SPLITS: u32 = {plan.splits}u;\nconst CHUNK: u32 = {plan.chunk}u;\nconst ROWS: u32 = {rows}u;\n"
            f"const GRID_X: u32 = {grid[0]}u;\nconst GRID_XY: u32 = {grid[0] * grid[1]}u;")


def _slice(what: str, end: str, start: str = "0u") -> str:
    """WGSL: ``{what}_lo`` and ``{what}_end``, this workgroup's range of the other sequence: [start, end), cut to
    slice ``split`` of CHUNK rows when the pass is cut into SPLITS slices (uniform across the workgroup)."""
    return (f"  let {what}_lo = select({start}, max({start}, split * CHUNK), SPLITS > 1u);\n"
            f"  let {what}_end = select({end}, min({end}, split * CHUNK + CHUNK), SPLITS > 1u);")


def _row_stores(out: str, name: str, count: int, size: int, scale: str) -> str:
    """WGSL: the vec4 registers ``name``0.. (times ``scale``) into row ``row`` of ``out``, ``size`` floats long."""
    return "\n".join(
        f"    {{ let v = {name}{c}{scale};\n"
        + "".join(f"      {out}[row * {size}u + {4 * c + t}u] = v[{t}];\n" for t in range(4) if 4 * c + t < size)
        + "    }" for c in range(count))


def _partial_stores(partial: str, parts: list[tuple[str, int, int]], tail: tuple[str, ...] = ()) -> str:
    """WGSL: vec4 registers (name, count, size) one after another into this slice's row of ``partial``, then the
    scalars named in ``tail`` (the forward's running max and sum)."""
    width = sum(size for _, _, size in parts) + len(tail)
    lines, offset = [f"    let at = (split * ROWS + row) * {width}u;"], 0
    for name, count, size in parts:
        lines += [f"    {partial}[at + {offset + 4 * c + t}u] = {name}{c}[{t}];"
                  for c in range(count) for t in range(4) if 4 * c + t < size]
        offset += size
    lines += [f"    {partial}[at + {offset + k}u] = {name};" for k, name in enumerate(tail)]
    return "\n".join(lines)


def _merge(prelude: str, s: AttentionShape, kind: str, outs: list[str], splits: int, partial: str,
           limits: dict) -> tuple[str, tuple[int, int, int]]:
    """The second dispatch of a pass cut into slices: one thread per output element merges the slices' partial
    results. Forward rescales each slice's output and sum to the overall max (and writes the log-sum-exp); the
    gradients add up."""
    rows, width = _partial_layout(s, kind)
    total = rows * width if kind != "forward" else rows * s.dv
    grid = fold_grid(-(-total // MERGE_THREADS), limits.get("max-compute-workgroups-per-dimension", 65535))
    if kind == "forward":
        out, lse = outs
        body = f"""  let row = e / {s.dv}u;
  let c = e % {s.dv}u;
  var m = MASKED;
  for (var s = 0u; s < {splits}u; s++) {{ m = max(m, {partial}[(s * {rows}u + row) * {width}u + {s.dv}u]); }}
  var l = 0.0;
  var o = 0.0;
  for (var s = 0u; s < {splits}u; s++) {{
    let at = (s * {rows}u + row) * {width}u;
    let w = prob({partial}[at + {s.dv}u], m);
    l = l + w * {partial}[at + {s.dv + 1}u];
    o = o + w * {partial}[at + c];
  }}
  {out}[e] = select(o / l, 0.0, l == 0.0);
  if (c == 0u) {{ {lse}[row] = select(m + log(l), MASKED, l == 0.0); }}"""
    else:
        sums = f"""  var acc = 0.0;
  for (var s = 0u; s < {splits}u; s++) {{ acc = acc + {partial}[s * {rows * width}u + e]; }}"""
        if kind == "grad_q":
            body = sums + f"\n  {outs[0]}[e] = acc * {s.scale!r};"
        else:
            dk, dv = outs
            body = sums + f"""
  let row = e / {width}u;
  let c = e % {width}u;
  if (c < {s.d}u) {{ {dk}[row * {s.d}u + c] = acc * {s.scale!r}; }}
  else {{ {dv}[row * {s.dv}u + c - {s.d}u] = acc; }}"""
    kernel = f"""
// ---- attention {kind}: merge of {splits} slices
const MASKED: f32 = {MASKED!r};
{PROB}

@compute @workgroup_size({MERGE_THREADS})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let e = (wg.x + wg.y * {grid[0]}u + wg.z * {grid[0] * grid[1]}u) * {MERGE_THREADS}u + lid;
  if (e >= {total}u) {{ return; }}
{body}
}}
"""
    return prelude + kernel, grid


def _row_dot(own: str, row: str, tile: str, t: str, width: int) -> str:
    return " + ".join(f"dot({own}[{row} + {c}u], {tile}[{t} * {width}u + {c}u])" for c in range(width))


def _blocked_grad_q(prelude: str, s: AttentionShape, outs: list[str], plan: BlockPlan, limits: dict,
                    partial: str | None) -> tuple[str, tuple[int, int, int]]:
    """dQ for a block of query rows, one per thread: its output gradient and dQ in vec4 registers, its query row
    in workgroup memory; key and value tiles staged once per block and read by broadcast. Cut into slices of
    keys, each slice stores its unscaled share of dQ into ``partial``."""
    (dq,) = outs
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    per_block = -(-s.lq // plan.rows)
    blocks = s.batch * s.heads * per_block
    grid = fold_grid(blocks * plan.splits, limits.get("max-compute-workgroups-per-dimension", 65535))
    bias = "load_bias(b, h, iq, j)" if s.has_bias else "0.0"
    dout_regs = "\n".join(f"  let o{c} = {_vec4_load('load_dout', 'b, h, iq', c, s.dv)};" for c in range(dv4))
    acc_regs = "\n".join(f"  var g{c} = vec4<f32>();" for c in range(d4))
    dp = " + ".join(f"dot(o{c}, tile_v[t * {dv4}u + {c}u])" for c in range(dv4))
    update = "\n".join(f"          g{c} = fma(vec4<f32>(ds), tile_k[t * {d4}u + {c}u], g{c});" for c in range(d4))
    if plan.splits == 1:
        stores = _row_stores(dq, "g", d4, s.d, " * SCALE")
    else:
        stores = _partial_stores(partial, [("g", d4, s.d)])
    kernel = f"""
// ---- attention grad_q: {plan.rows} query rows per workgroup, key tiles of {plan.tile}
{_blocked_header(s, plan, blocks, grid, per_block, "grad_q")}
var<workgroup> tile_k: array<vec4<f32>, {plan.tile * d4}>;
var<workgroup> tile_v: array<vec4<f32>, {plan.tile * dv4}>;
var<workgroup> own_q: array<vec4<f32>, {plan.rows * (d4 + 1)}>;

{_entry("BLOCK", "wid", "BLOCKS * SPLITS")}  let blk = wid / SPLITS;
  let split = wid % SPLITS;
  let bh = blk / PER_BLOCK;
  let b = bh / H;
  let h = bh % H;
  let i0 = (blk % PER_BLOCK) * BLOCK;
  let i = i0 + tid;
  let iq = min(i, LQ - 1u);  // rows past the end compute on the last row and store nothing
  let mine = tid * {d4 + 1}u;
  for (var c = 0u; c < {d4}u; c = c + 1u) {{ own_q[mine + c] = load_q4(b, h, iq, c); }}
{dout_regs}
{acc_regs}
  let lse = load_lse(b, h, iq);
  let delta = load_delta(b, h, iq);
{_slice("key", "min(LK, i0 + BLOCK)" if s.causal else "LK")}
  for (var start = key_lo; start < key_end; start = start + TILE) {{
    workgroupBarrier();
{_stage("tile_k", "load_k4", plan, d4, "start", "LK")}
{_stage("tile_v", "load_v4", plan, dv4, "start", "LK")}
    workgroupBarrier();
    let n = min(TILE, key_end - start);
    for (var t = 0u; t < n; t = t + 1u) {{
      let j = start + t;
      if (!({"j > i" if s.causal else "false"})) {{
        let p = prob(({_row_dot("own_q", "mine", "tile_k", "t", d4)}) * SCALE + {bias}, lse);
        if (p > 0.0) {{
          let ds = p * (({dp}) - delta);
{update}
        }}
      }}
    }}
  }}
  if (i < LQ) {{
    let row = bh * LQ + i;
{stores}
  }}
}}
"""
    return prelude + "\n" + _vec4_loaders(prelude, s, "q", "k", "v") + kernel, grid


def _blocked_grad_kv(prelude: str, s: AttentionShape, outs: list[str], plan: BlockPlan, limits: dict,
                     partial: str | None) -> tuple[str, tuple[int, int, int]]:
    """dK and dV for a block of key rows of one KV head, one per thread: dK and dV in vec4 registers, its key and
    value rows in workgroup memory; for every query head of the group, tiles of queries, output gradients, lse
    and delta staged once per block and read by broadcast. Cut into slices of queries, each slice stores its
    unscaled share of dK and dV into ``partial``."""
    dk, dv = outs
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    per_block = -(-s.lk // plan.rows)
    blocks = s.batch * s.kv_heads * per_block
    grid = fold_grid(blocks * plan.splits, limits.get("max-compute-workgroups-per-dimension", 65535))
    bias = "load_bias(b, h, i, jk)" if s.has_bias else "0.0"
    acc_regs = "\n".join([f"  var gk{c} = vec4<f32>();" for c in range(d4)]
                         + [f"  var gv{c} = vec4<f32>();" for c in range(dv4)])
    update_v = "\n".join(f"          gv{c} = fma(vec4<f32>(p), tile_do[t * {dv4}u + {c}u], gv{c});"
                         for c in range(dv4))
    update_k = "\n".join(f"          gk{c} = fma(vec4<f32>(ds), tile_q[t * {d4}u + {c}u], gk{c});"
                         for c in range(d4))

    if plan.splits == 1:
        stores = _row_stores(dk, "gk", d4, s.d, " * SCALE") + "\n" + _row_stores(dv, "gv", dv4, s.dv, "")
    else:
        stores = _partial_stores(partial, [("gk", d4, s.d), ("gv", dv4, s.dv)])
    kernel = f"""
// ---- attention grad_kv: {plan.rows} key rows per workgroup, query tiles of {plan.tile}
{_blocked_header(s, plan, blocks, grid, per_block, "grad_kv")}
var<workgroup> tile_q: array<vec4<f32>, {plan.tile * d4}>;
var<workgroup> tile_do: array<vec4<f32>, {plan.tile * dv4}>;
var<workgroup> tile_lse: array<f32, {plan.tile}>;
var<workgroup> tile_delta: array<f32, {plan.tile}>;
var<workgroup> own_k: array<vec4<f32>, {plan.rows * (d4 + 1)}>;
var<workgroup> own_v: array<vec4<f32>, {plan.rows * (dv4 + 1)}>;

{_entry("BLOCK", "wid", "BLOCKS * SPLITS")}  let blk = wid / SPLITS;
  let split = wid % SPLITS;
  let bg = blk / PER_BLOCK;
  let b = bg / HKV;
  let g = bg % HKV;
  let j0 = (blk % PER_BLOCK) * BLOCK;
  let j = j0 + tid;
  let jk = min(j, LK - 1u);  // rows past the end compute on the last row and store nothing
  let mine_k = tid * {d4 + 1}u;
  let mine_v = tid * {dv4 + 1}u;
  for (var c = 0u; c < {d4}u; c = c + 1u) {{ own_k[mine_k + c] = load_k4(b, g * GROUP, jk, c); }}
  for (var c = 0u; c < {dv4}u; c = c + 1u) {{ own_v[mine_v + c] = load_v4(b, g * GROUP, jk, c); }}
{acc_regs}
{_slice("query", "LQ", "(j0 / TILE) * TILE" if s.causal else "0u")}
  for (var h = g * GROUP; h < (g + 1u) * GROUP; h = h + 1u) {{
    for (var start = query_lo; start < query_end; start = start + TILE) {{
      workgroupBarrier();
{_stage("tile_q", "load_q4", plan, d4, "start", "LQ")}
{_stage("tile_do", "load_dout4", plan, dv4, "start", "LQ")}
      for (var t = tid; t < TILE; t = t + BLOCK) {{
        let r = min(start + t, LQ - 1u);
        tile_lse[t] = load_lse(b, h, r);
        tile_delta[t] = load_delta(b, h, r);
      }}
      workgroupBarrier();
      let n = min(TILE, query_end - start);
      for (var t = 0u; t < n; t = t + 1u) {{
        let i = start + t;
        if (!({"j > i" if s.causal else "false"})) {{
          let p = prob(({_row_dot("own_k", "mine_k", "tile_q", "t", d4)}) * SCALE + {bias}, tile_lse[t]);
          if (p > 0.0) {{
{update_v}
            let ds = p * (({_row_dot("own_v", "mine_v", "tile_do", "t", dv4)}) - tile_delta[t]);
{update_k}
          }}
        }}
      }}
    }}
  }}
  if (j < LK) {{
    let row = bg * LK + j;
{stores}
  }}
}}
"""
    return prelude + "\n" + _vec4_loaders(prelude, s, "q", "k", "v", "dout") + kernel, grid


# ------------------------------------------------------------------------------------------ flash forward
FLASH_MAX_HEAD = 64  # query/key and value head sizes up to this take the flash forward (its tiles then fit 48 KiB)
FLASH_ROWS = (64, 32)  # query rows per workgroup: 64 where that gives FLASH_MIN_BLOCKS blocks and fits, else 32
FLASH_MIN_BLOCKS = 128
FLASH_KEYS = 32  # keys per tile
FLASH_KEY_GROUPS = FLASH_KEYS // 4  # threads across a tile's keys (4 keys each); as many across value columns
# Keys are cut into slices (merged by a second dispatch): slices of at least SPLIT_MIN_TILES tiles while there are
# fewer than FLASH_MIN_BLOCKS workgroups, then slices of at least FLASH_SLICE_MIN_TILES up to FLASH_TARGET_WORKGROUPS.
# Where the workgroups fill the GPU, a short slice does not pay back its query staging, partial stores and the merge
# pass (about 5 us). H200, GPU us, with slices of 2 tiles against 8 past 128 workgroups: SD U-Net's attention in the
# benchmark (2 x 16 heads, 256 x 256, d 8) 22.0 -> 17.2, the same shape with 8 heads of d 40 37.6 -> 27.3;
# Whisper-tiny's 1500 keys keep their 4 slices (192 us). SmolLM2's (9 heads, causal, 128 keys: 36 workgroups) needs
# its short slices: 19.1 against 19.4 unsliced; in its model, where rotary embeddings make the loads dearer, 4.89
# against 4.99 ms of GPU time per call.
FLASH_TARGET_WORKGROUPS = 512
FLASH_SLICE_MIN_TILES = 8
# Score columns (vec4s) per iteration of the loop over the head size. H200, GPU us, 1, 2 and 4 columns and all
# written out: Whisper-tiny 207 / 201 / 193 / 191, SmolLM2 19.4 / 19.2 / 19.1 / 21.6, SmolVLA 14.2 / 14.0 / 14.3 /
# 16.5, 2 x 8 heads of d 40 over 256 keys 38.8 / 37.6 / 37.7 / 39.0.
QK_UNROLL = 4


def flash_forward_fits(d: int, dv: int) -> bool:
    """Whether head sizes ``d`` (query/key) and ``dv`` (value) take the flash forward (where the adapter's
    workgroup storage holds its tiles; otherwise the blocked one runs, as in portable bundles generated for
    WebGPU's 16 KiB: on an H200 about as fast as the unfused form for Whisper-tiny, 325 against 320 us a layer)."""
    return d <= FLASH_MAX_HEAD and dv <= FLASH_MAX_HEAD


@dataclass(frozen=True)
class FlashPlan:
    rows: int  # query rows per workgroup, 4 per thread across rows
    splits: int = 1  # slices of the keys, each a workgroup of its own (merged by a second dispatch)
    chunk: int = 0  # keys per slice, a multiple of FLASH_KEYS (with splits > 1)


def _flash_sizes(s: AttentionShape) -> tuple[int, int, int]:
    """(vec4 columns of a query/key row, vec4 columns of a value row padded to the column threads, vec4 columns
    per thread)."""
    dv4 = -(-s.dv // 4)
    per_thread = -(-dv4 // FLASH_KEY_GROUPS)
    return -(-s.d // 4), per_thread * FLASH_KEY_GROUPS, per_thread


def _flash_shared_bytes(s: AttentionShape, rows: int) -> int:
    """Workgroup storage of ``rows`` query rows: the query and key tiles (rows padded by a vec4), the value tile,
    the probabilities and the row-maximum exchange."""
    d4, dvp4, _ = _flash_sizes(s)
    groups = rows // 4
    vec4s = (d4 + 1) * (rows + FLASH_KEYS) + FLASH_KEYS * dvp4 + FLASH_KEYS * (groups + 1)
    return 16 * vec4s + 4 * rows * (FLASH_KEY_GROUPS + 1)


def _flash_plan(s: AttentionShape, limits: dict) -> FlashPlan | None:
    """Rows per workgroup and key slices of the flash forward, or None where it does not apply (head sizes above
    FLASH_MAX_HEAD, or workgroup storage or invocations too small for 32 rows)."""
    if not flash_forward_fits(s.d, s.dv):
        return None
    storage = limits.get("max-compute-workgroup-storage-size", 16384)
    invocations = min(limits.get("max-compute-invocations-per-workgroup", 256),
                      limits.get("max-compute-workgroup-size-x", 256))
    fitting = [r for r in FLASH_ROWS
               if _flash_shared_bytes(s, r) <= storage and r // 4 * FLASH_KEY_GROUPS <= invocations]
    if not fitting:
        return None
    rows = next((r for r in fitting if s.batch * s.heads * -(-s.lq // r) >= FLASH_MIN_BLOCKS), fitting[-1])
    blocks = s.batch * s.heads * -(-s.lq // rows)
    tiles = -(-s.lk // FLASH_KEYS)
    splits = 1
    while splits * 2 <= SPLIT_MAX and (
            blocks * splits < FLASH_MIN_BLOCKS and tiles // (splits * 2) >= SPLIT_MIN_TILES
            or blocks * splits < FLASH_TARGET_WORKGROUPS and tiles // (splits * 2) >= FLASH_SLICE_MIN_TILES):
        splits *= 2
    return FlashPlan(rows, splits, -(-tiles // splits) * FLASH_KEYS if splits > 1 else 0)


def _flash_forward(prelude: str, s: AttentionShape, outs: list[str], plan: FlashPlan, limits: dict,
                   partial: str | None) -> tuple[str, tuple[int, int, int]]:
    """The forward as two register-tiled products per key tile (FlashAttention-2's order): a workgroup holds a
    block of query rows in workgroup memory and walks the keys in tiles of FLASH_KEYS; each thread computes a 4x4
    block of scores (4 rows x 4 keys), the rows' running max is shared through workgroup memory, and the
    probabilities go back to workgroup memory for P V, in which the thread owns 4 rows x its vec4 columns of the
    output. Each thread keeps a partial row sum (rescaled with the shared max), added up at the end. Cut into
    slices of keys, each slice stores its unnormalised output, running max and sum into ``partial``.

    Query and key rows are staged as they lie, a vec4 store each, into rows padded by one vec4; thread (rg, kg)
    takes rows rg + GROUPS * r and keys kg + KG * t (r, t < 4), so the vec4 reads of a warp's threads fall on
    distinct banks. H200, Whisper-tiny's attention (6 heads, 1500 x 1500, d 64): staging the keys transposed, one
    scalar store per element, took about 60 of the kernel's 224 us."""
    d4, dvp4, per_thread = _flash_sizes(s)
    groups, kg = plan.rows // 4, FLASH_KEY_GROUPS
    blocks = s.batch * s.heads * -(-s.lq // plan.rows)
    grid = fold_grid(blocks * plan.splits, limits.get("max-compute-workgroups-per-dimension", 65535))
    threads = groups * kg
    rows4, cols = range(4), range(per_thread)

    def shares(total: int):  # (element index, guard) of each of a thread's shares of ``total`` staged elements
        for t in range(-(-total // threads)):
            e = f"(tid + {t * threads}u)"
            yield e, f"if {e} < {total}u " if (t + 1) * threads > total else ""

    def stage_q() -> str:  # query rows i0.. as they lie: qs[r * QS + c4]
        return "\n".join(f"  {guard}{{\n    let r = {e} / {d4}u;\n    let c4 = {e} % {d4}u;\n"
                         f"    qs[r * QS + c4] = load_q4(b, h, min(i0 + r, LQ - 1u), c4);\n  }}"
                         for e, guard in shares(plan.rows * d4))

    def stage_kv() -> str:  # key rows as they lie: ks[j * QS + c4]; value rows: vs[j * DVP4 + c4]
        # (value columns past the row are not staged: their products go to output columns that are not stored)
        lines = []
        for what, width, array, stride in (("k", d4, "ks", "QS"), ("v", -(-s.dv // 4), "vs", "DVP4")):
            # A clamped load kept by select, not a load under ``if``: H200, loads of keys (and query rows) past the
            # end skipped by ``if`` took Whisper-tiny's attention from 0.77 to 1.09 ms a call (SmolLM2's one-token
            # attention 0.32 -> 0.30).
            for e, guard in shares(FLASH_KEYS * width):
                load = f"select(vec4<f32>(), load_{what}4(b, h, min(start + j, LK - 1u), c4), start + j < key_end)"
                lines.append(f"    {guard}{{\n      let j = {e} / {width}u;\n      let c4 = {e} % {width}u;\n"
                             f"      {array}[j * {stride} + c4] = {load};\n    }}")
        return "\n".join(lines)

    def row(r: int) -> str:  # the tile row of a thread's r-th query row
        return f"(rg + {groups * r}u)"

    step = "\n".join(  # the products of vec4 column c4 of the tile's query and key rows
        [f"        let q{r} = qs[{row(r)} * QS + c4];" for r in rows4]
        + [f"        let k{t} = ks[(kg + {kg * t}u) * QS + c4];" for t in rows4]
        + [f"        s{r} = fma(vec4<f32>(q{r}[{u}]), vec4<f32>(k0[{u}], k1[{u}], k2[{u}], k3[{u}]), s{r});"
           for u in range(4) for r in rows4])
    whole = d4 // QK_UNROLL * QK_UNROLL  # columns taken QK_UNROLL at a time; the rest written out after the loop
    products = "\n".join(
        ([f"    for (var c0 = 0u; c0 < {whole}u; c0 += {QK_UNROLL}u) {{"]
         + [f"      {{\n        let c4 = c0 + {u}u;\n{step}\n      }}" for u in range(QK_UNROLL)] + ["    }"]
         if whole else [])
        + [f"    {{\n        let c4 = {c}u;\n{step}\n    }}" for c in range(whole, d4)])
    bias = "load_bias(b, h, min(i, LQ - 1u), min(j, LK - 1u))" if s.has_bias else "0.0"
    masked = "j >= key_end" + (" || j > i" if s.causal else "")
    scores = "\n".join(
        f"      {{\n        let i = i0 + {row(r)};\n"
        + "".join(f"        {{ let j = start + kg + {kg * t}u;\n"
                  f"          s{r}[{t}] = select(s{r}[{t}] * SCALE + {bias}, MASKED, {masked}); }}\n" for t in range(4))
        + f"        ex[{row(r)} * EXS + kg] = max(max(s{r}[0], s{r}[1]), max(s{r}[2], s{r}[3]));\n      }}"
        for r in rows4)
    softmax = "\n".join(
        f"      {{\n        var tile_max = MASKED;\n"
        f"        for (var g = 0u; g < KG; g++) {{ tile_max = max(tile_max, ex[{row(r)} * EXS + g]); }}\n"
        f"        let m_new = max(m[{r}], tile_max);\n"
        f"        let alpha = select(exp(m[{r}] - m_new), 1.0, m[{r}] <= MASKED);\n"
        f"        m[{r}] = m_new;\n"
        + "".join(f"        o{r}_{w} = o{r}_{w} * alpha;\n" for w in cols)
        + f"        p{r} = vec4<f32>(prob(s{r}[0], m_new), prob(s{r}[1], m_new), prob(s{r}[2], m_new), "
          f"prob(s{r}[3], m_new));\n"
        f"        l[{r}] = l[{r}] * alpha + p{r}[0] + p{r}[1] + p{r}[2] + p{r}[3];\n      }}"
        for r in rows4)
    accumulate = "\n".join(
        f"        {{ let vv = vs[j * DVP4 + kg + {kg * w}u];\n"
        + "".join(f"          o{r}_{w} = fma(vec4<f32>(pv[{r}]), vv, o{r}_{w});\n" for r in rows4) + "        }"
        for w in cols)
    finish = _flash_stores(s, plan, outs, partial, cols)
    p_stores = "\n".join(f"    ps[(kg + {kg * t}u) * (GROUPS + 1u) + rg] = "
                         f"vec4<f32>(p0[{t}], p1[{t}], p2[{t}], p3[{t}]);" for t in range(4))
    sum_stores = "\n".join(f"  ex[{row(r)} * EXS + kg] = l[{r}];" for r in rows4)
    sums = "\n".join(f"  for (var g = 0u; g < KG; g++) {{ total[{r}] = total[{r}] + ex[{row(r)} * EXS + g]; }}"
                      for r in rows4)
    key_end = "min(LK, i0 + BQ)" if s.causal else "LK"
    o_regs = "\n".join(f"  var o{r}_{w} = vec4<f32>();" for r in rows4 for w in cols)
    kernel = f"""
// ---- attention forward (flash): {plan.rows} query rows per workgroup, key tiles of {FLASH_KEYS}, 4x4 per thread
const H: u32 = {s.heads}u;
const LQ: u32 = {s.lq}u;
const LK: u32 = {s.lk}u;
const DV: u32 = {s.dv}u;
const BQ: u32 = {plan.rows}u;
const BK: u32 = {FLASH_KEYS}u;
const GROUPS: u32 = {groups}u;
const KG: u32 = {kg}u;
const QS: u32 = {d4 + 1}u;
const DVP4: u32 = {dvp4}u;
const EXS: u32 = {kg + 1}u;
const QBLOCKS: u32 = {-(-s.lq // plan.rows)}u;
const BLOCKS: u32 = {blocks}u;
{_split_constants(s, "forward", plan, grid)}
const SCALE: f32 = {s.scale!r};
const MASKED: f32 = {MASKED!r};
var<workgroup> qs: array<vec4<f32>, {(d4 + 1) * plan.rows}>;
var<workgroup> ks: array<vec4<f32>, {(d4 + 1) * FLASH_KEYS}>;
var<workgroup> vs: array<vec4<f32>, {FLASH_KEYS * dvp4}>;
var<workgroup> ps: array<vec4<f32>, {FLASH_KEYS * (groups + 1)}>;
var<workgroup> ex: array<f32, {plan.rows * (kg + 1)}>;

{PROB}

{_entry(str(threads), "wid", "BLOCKS * SPLITS")}  let blk = wid / SPLITS;
  let split = wid % SPLITS;
  let bh = blk / QBLOCKS;
  let b = bh / H;
  let h = bh % H;
  let i0 = (blk % QBLOCKS) * BQ;
  let kg = tid % KG;
  let rg = tid / KG;
{stage_q()}
{o_regs}
  var m = array<f32, 4>(MASKED, MASKED, MASKED, MASKED);
  var l = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
{_slice("key", key_end)}
  for (var start = key_lo; start < key_end; start = start + BK) {{
    workgroupBarrier();
{stage_kv()}
    workgroupBarrier();
    var s0 = vec4<f32>();
    var s1 = vec4<f32>();
    var s2 = vec4<f32>();
    var s3 = vec4<f32>();
{products}
{scores}
    workgroupBarrier();
    var p0 = vec4<f32>();
    var p1 = vec4<f32>();
    var p2 = vec4<f32>();
    var p3 = vec4<f32>();
{softmax}
{p_stores}
    workgroupBarrier();
    for (var j = 0u; j < BK; j++) {{
      let pv = ps[j * (GROUPS + 1u) + rg];
{accumulate}
    }}
  }}
  workgroupBarrier();
{sum_stores}
  workgroupBarrier();
  var total = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
{sums}
{finish}
}}
"""
    return prelude + "\n" + _vec4_loaders(prelude, s, "q", "k", "v") + kernel, grid


def _flash_stores(s: AttentionShape, plan: FlashPlan, outs: list[str], partial: str | None, cols: range) -> str:
    """WGSL: each thread's 4 output rows (its vec4 columns of each), normalised into ``out`` with the row's
    log-sum-exp into ``lse``; or, keys cut into slices, unnormalised with the running max and sum into this
    slice's row of ``partial`` (the layout ``_merge`` reads)."""
    out, lse = outs
    kg, dv4, groups = FLASH_KEY_GROUPS, -(-s.dv // 4), plan.rows // 4
    if plan.splits > 1:
        array, base = partial, f"(split * ROWS + bh * LQ + i) * {s.dv + 2}u"

        def scale(r):
            return ""

        def tail(r):
            return f"{partial}[at + DV] = m[{r}]; {partial}[at + DV + 1u] = total[{r}];"
    else:
        array, base = out, "(bh * LQ + i) * DV"

        def scale(r):
            return f" * select(1.0 / total[{r}], 0.0, total[{r}] == 0.0)"

        def tail(r):
            return f"{lse}[bh * LQ + i] = select(m[{r}] + log(total[{r}]), MASKED, total[{r}] == 0.0);"
    rows = []
    for r in range(4):
        columns = "".join(
            f"        if (kg + {kg * w}u < {dv4}u) {{\n          let v = o{r}_{w}{scale(r)};\n"
            + "".join(f"          if (4u * (kg + {kg * w}u) + {t}u < DV) {{ "
                      f"{array}[at + 4u * (kg + {kg * w}u) + {t}u] = v[{t}]; }}\n" for t in range(4))
            + "        }\n" for w in cols)
        rows.append(f"    {{\n      let i = i0 + rg + {groups * r}u;\n      if (i < LQ) {{\n        let at = {base};\n"
                    f"{columns}        if (kg == 0u) {{ {tail(r)} }}\n      }}\n    }}")
    return "\n".join(rows)
