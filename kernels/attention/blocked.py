"""Blocked attention: the forward here, and the WGSL helpers it shares with the gradient passes (``blocked_grad``).

For head sizes up to d + dv = 160 (``plans.BLOCK_MAX_VEC4``); on an H200 it was the faster form in the SD U-Net
(seq 64-256), SmolLM2 (seq 128, rotary embeddings in the loads) and Whisper (seq 1500) workloads, though a bare
seq-50 attention ran faster per row. A block of rows per workgroup, one row per thread, with tiles of the other
sequence staged in workgroup memory and read by broadcast. Where the row blocks are too few to fill the GPU
(Whisper: 144), the other sequence is also cut into slices, one workgroup per (block, slice); the slices' partial
results (output with running max and sum, or gradient shares) go to scratch and a second dispatch (``merge``)
merges them.
"""
from __future__ import annotations

from ..sizes import ceil_div
from .common import (MASKED, PROB, block_entry, forward_outputs, key_range, key_range_arrays, slice_bounds,
                     sliced_grid, split_constants, u32_constants, vec4_loaders)
from .plans import AttentionShape, BlockPlan

# Forward: keys whose scores a thread computes together (independent dot products in flight). H200, Whisper: the
# forward 2.41 -> 2.30 ms; the same for the gradient passes (2 keys) made them slower (grad_kv 4.0 -> 11.0 ms).
UNROLL = 4


def stage(array: str, fn: str, plan: BlockPlan, width: int, first: str, limit: str) -> str:
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


def vec4_load(fn: str, args: str, c4: int, size: int) -> str:
    """vec4 of ``fn(args, 4*c4 + t)`` for t < 4, zero past ``size``."""
    parts = [f"{fn}({args}, {4 * c4 + t}u)" if 4 * c4 + t < size else "0.0" for t in range(4)]
    return f"vec4<f32>({', '.join(parts)})"


def row_dot(own: str, row: str, tile: str, t: str, width: int) -> str:
    """WGSL: the dot product of the thread's row (vec4s from ``own[row]``) with row ``t`` of ``tile``."""
    return " + ".join(f"dot({own}[{row} + {c}u], {tile}[{t} * {width}u + {c}u])" for c in range(width))


def row_stores(out: str, name: str, count: int, size: int, scale: str) -> str:
    """WGSL: the vec4 registers ``name``0.. (times ``scale``) into row ``row`` of ``out``, ``size`` floats long."""
    return "\n".join(
        f"    {{ let v = {name}{c}{scale};\n"
        + "".join(f"      {out}[row * {size}u + {4 * c + t}u] = v[{t}];\n" for t in range(4) if 4 * c + t < size)
        + "    }" for c in range(count))


def partial_stores(partial: str, parts: list[tuple[str, int, int]], tail: tuple[str, ...] = ()) -> str:
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


def blocked_header(s: AttentionShape, plan: BlockPlan, blocks: int, grid, per_block: int, kind: str) -> str:
    """WGSL constants of a blocked gradient pass (``kind``), and ``prob``."""
    sizes = u32_constants(H=s.heads, HKV=s.kv_heads, GROUP=s.heads // s.kv_heads, LQ=s.lq, LK=s.lk, D=s.d, DV=s.dv,
                          BLOCK=plan.rows, TILE=plan.tile, PER_BLOCK=per_block, BLOCKS=blocks)
    return f"""{sizes}
{split_constants(s, kind, plan, grid)}
const SCALE: f32 = {s.scale!r};
const MASKED: f32 = {MASKED!r};

{PROB}
"""


def blocked_forward(prelude: str, s: AttentionShape, outs: list[str], plan: BlockPlan, limits: dict,
                    partial: str | None) -> tuple[str, tuple[int, int, int]]:
    """Each thread owns one query row: its query and output accumulator live in vec4 registers, and the
    workgroup stages tiles of keys and values in workgroup memory that every thread reads by broadcast, so a
    key is fetched once per block of rows instead of once per row. Softmax is online, rescaled per tile. Cut
    into slices of keys, each slice stores its unnormalised output, running max and sum into ``partial``."""
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    blocks = s.batch * s.heads * ceil_div(s.lq, plan.rows)
    grid = sliced_grid(s, "forward", plan, blocks, limits)
    stride = plan.tile + 1  # per-thread score row in workgroup memory, padded against bank conflicts
    q_regs = "\n".join(f"  let q{c} = {vec4_load('load_q', 'b, h, iq', c, s.d)};" for c in range(d4))
    o_regs = "\n".join(f"  var o{c} = vec4<f32>();" for c in range(dv4))
    key_end = "min(LK, i0 + BQ)" if s.causal else "LK"
    kernel = _forward_header(s, plan, blocks, grid, stride) + f"""
{block_entry("BQ", "BQ", "QBLOCKS")}
  let i = i0 + tid;
  let iq = min(i, LQ - 1u);  // rows past the end compute on the last row and store nothing
{q_regs}
{o_regs}
  var m = MASKED;
  var l = 0.0;
{slice_bounds("key", key_end)}
{key_range(s, "BQ")}
  for (var start = key_from; start < key_to; start = start + BK) {{
    workgroupBarrier();
{stage("tile_k", "load_k4", plan, d4, "start", "LK")}
{stage("tile_v", "load_v4", plan, dv4, "start", "LK")}
    workgroupBarrier();
{_forward_tile(s, stride)}
  }}
  if (i < LQ) {{
    let row = bh * LQ + i;
{_forward_stores(s, outs, plan, partial)}
  }}
}}
"""
    return prelude + "\n" + vec4_loaders(prelude, s, "k", "v") + kernel, grid


def _forward_header(s: AttentionShape, plan: BlockPlan, blocks: int, grid, stride: int) -> str:
    """WGSL constants and workgroup arrays of the blocked forward, and ``prob``."""
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    return f"""
// ---- attention forward: {plan.rows} query rows per workgroup, key tiles of {plan.tile}
{u32_constants(H=s.heads, LQ=s.lq, LK=s.lk, DV=s.dv, BQ=plan.rows)}
const BLOCK: u32 = BQ;
{u32_constants(BK=plan.tile, QBLOCKS=ceil_div(s.lq, plan.rows), BLOCKS=blocks)}
{split_constants(s, "forward", plan, grid)}
const SCALE: f32 = {s.scale!r};
const MASKED: f32 = {MASKED!r};
var<workgroup> tile_k: array<vec4<f32>, {plan.tile * d4}>;
var<workgroup> tile_v: array<vec4<f32>, {plan.tile * dv4}>;
var<workgroup> scores: array<f32, {plan.rows * stride}>;
{key_range_arrays(s)}

{PROB}
"""


def _forward_tile(s: AttentionShape, stride: int) -> str:
    """WGSL: one staged key tile in the blocked forward: the thread's scores (UNROLL keys at a time) into its row
    of ``scores``, the running max and sum rescaled to the tile's max, and the output accumulated."""
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    bias = "load_bias(b, h, iq, j)" if s.has_bias else "0.0"
    masked = "j > i" if s.causal else "false"

    def score(u: int) -> str:  # the score of key t + u into sc{u}
        dot = " + ".join(f"dot(q{c}, tile_k[(t + {u}u) * {d4}u + {c}u])" for c in range(d4))
        return (f"      var sc{u} = MASKED;\n      {{\n        let j = start + t + {u}u;\n"
                f"        if (!({masked})) {{ sc{u} = ({dot}) * SCALE + {bias}; }}\n      }}")

    rescale = "\n".join(f"      o{c} = o{c} * alpha;" for c in range(dv4))
    accumulate = "\n".join(f"        o{c} = fma(vec4<f32>(p), tile_v[base + {c}u], o{c});" for c in range(dv4))
    keep = "\n".join(f"      scores[tid * {stride}u + t + {u}u] = sc{u};\n      tile_max = max(tile_max, sc{u});"
                     for u in range(UNROLL))
    return f"""    let n = min(BK, key_end - start);
    var tile_max = MASKED;
    var t = 0u;
    for (; t + {UNROLL - 1}u < n; t = t + {UNROLL}u) {{  // independent dot products in flight together
{chr(10).join(score(u) for u in range(UNROLL))}
{keep}
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
    }}"""


def _forward_stores(s: AttentionShape, outs: list[str], plan: BlockPlan, partial: str | None) -> str:
    """WGSL: the thread's row normalised into ``out`` with its log-sum-exp into ``lse``; or, keys cut into slices,
    unnormalised with the running max and sum into this slice's row of ``partial``."""
    out, lse = forward_outputs(outs)
    dv4 = -(-s.dv // 4)
    if plan.splits > 1:
        return partial_stores(partial, [("o", dv4, s.dv)], tail=("m", "l"))
    stores = "\n".join(
        f"    {{ let v = select(o{c} / l, vec4<f32>(), l == 0.0);\n"
        + "".join(f"      {out}[row * DV + {4 * c + t}u] = v[{t}];\n" for t in range(4) if 4 * c + t < s.dv)
        + "    }" for c in range(dv4))
    return stores + (f"\n    {lse}[row] = select(m + log(l), MASKED, l == 0.0);" if lse is not None else "")
