"""The chunked flash forward: the flash forward's register tiles and online softmax (``flash``) for long query
sequences where its resident query block does not fit the workgroup storage (WebGPU's default 16 KiB) or its head
size limit, with head sizes up to ``plans.CHUNKED_MAX_HEAD``.

A workgroup owns a block of 64 (or 32) query rows and walks the keys in tiles of FLASH_KEYS. Each key tile's scores
are a product over the head size taken in chunks (``plan.d_chunk`` vec4 columns): the workgroup stages a chunk of
its query rows and of the tile's key rows (a vec4 load and store each), and every thread adds the chunk's products
to its 4 rows x 4 keys of scores in registers. The probabilities go to workgroup memory, and P V runs over chunks
of the tile's value rows (``plan.v_chunk`` keys) staged in the same area, each thread owning 4 rows x its vec4
columns of the output. One pass over the keys; the query rows are read again for each key tile (what the resident
block saves, at the cost of workgroup storage), nothing else is recomputed.

On lavapipe (a CPU driver on 2 shared cores, no GPU figure; seconds a call): 4 heads x 512 x 64 at WebGPU's 16 KiB,
the blocked forward 0.74, this one 0.46 (the flash forward at lavapipe's 32 KiB 0.36); 4 heads x 512 x 128 fused,
the per-row kernel 6.7, this one 0.58 (the unfused path, which the lowering picks for that shape, 1.0).
"""
from __future__ import annotations

from ..sizes import ceil_div
from .common import (MASKED, PROB, block_entry, slice_bounds, sliced_grid, split_constants, u32_constants,
                     vec4_loaders)
from .flash import ROWS4, accumulate, probabilities, row_totals, shares, stores, tile_row
from .plans import FLASH_KEY_GROUPS, FLASH_KEYS, AttentionShape, ChunkedPlan, chunked_shared_bytes, flash_sizes


def chunked_forward(prelude: str, s: AttentionShape, outs: list[str], plan: ChunkedPlan, limits: dict,
                    partial: str | None) -> tuple[str, tuple[int, int, int]]:
    """The forward over chunks of the head size (scores) and of the value tile (P V); the stores as the flash
    forward's (cut into slices of keys, each slice's unnormalised output, running max and sum into ``partial``)."""
    _, _, per_thread = flash_sizes(s)
    groups = plan.rows // 4
    blocks = s.batch * s.heads * ceil_div(s.lq, plan.rows)
    grid = sliced_grid(s, "forward", plan, blocks, limits)
    key_end = "min(LK, i0 + BQ)" if s.causal else "LK"
    o_regs = "\n".join(f"  var o{r}_{w} = vec4<f32>();" for r in ROWS4 for w in range(per_thread))
    kernel = _header(s, plan, blocks, grid) + f"""
{block_entry(str(groups * FLASH_KEY_GROUPS), "BQ", "QBLOCKS")}
  let kg = tid % KG;
  let rg = tid / KG;
{o_regs}
  var m = array<f32, 4>(MASKED, MASKED, MASKED, MASKED);
  var l = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
{slice_bounds("key", key_end)}
  for (var start = key_lo; start < key_end; start = start + BK) {{
    var s0 = vec4<f32>();
    var s1 = vec4<f32>();
    var s2 = vec4<f32>();
    var s3 = vec4<f32>();
    for (var c0 = 0u; c0 < D4; c0 = c0 + DC) {{
      workgroupBarrier();
{_stage_qk(s, plan)}
      workgroupBarrier();
{_chunk_products(plan)}
    }}
{probabilities(s, plan)}
    for (var v0 = 0u; v0 < BK; v0 = v0 + VC) {{
      workgroupBarrier();
{_stage_v(s, plan)}
      workgroupBarrier();
      for (var j = 0u; j < VC; j++) {{
{accumulate(s, "(v0 + j)", "stage[j * DVP4")}
      }}
    }}
  }}
{row_totals(groups)}
{stores(s, plan, outs, partial, range(per_thread))}
}}
"""
    return prelude + "\n" + vec4_loaders(prelude, s, "q", "k", "v") + kernel, grid


def _header(s: AttentionShape, plan: ChunkedPlan, blocks: int, grid) -> str:
    """WGSL constants and workgroup arrays of the chunked forward, and ``prob``. ``stage`` holds a chunk of query
    rows (QS vec4s a row) followed by the key rows' chunk (from KOFF), or a chunk of value rows (DVP4 a row)."""
    d4, dvp4, _ = flash_sizes(s)
    groups, kg = plan.rows // 4, FLASH_KEY_GROUPS
    staging = max((plan.rows + FLASH_KEYS) * (plan.d_chunk + 1), plan.v_chunk * dvp4)
    shared = chunked_shared_bytes(s, plan.rows, plan.d_chunk, plan.v_chunk)
    return f"""
// ---- attention forward (chunked flash): {plan.rows} query rows per workgroup, key tiles of {FLASH_KEYS}, 4x4 per
// thread, head size in chunks of {plan.d_chunk} vec4s, values in chunks of {plan.v_chunk} keys ({shared} bytes shared)
{u32_constants(H=s.heads, LQ=s.lq, LK=s.lk, DV=s.dv, BQ=plan.rows, BK=FLASH_KEYS, GROUPS=groups, KG=kg, D4=d4,
               DC=plan.d_chunk, QS=plan.d_chunk + 1, KOFF=plan.rows * (plan.d_chunk + 1), VC=plan.v_chunk,
               DVP4=dvp4, EXS=kg + 1, QBLOCKS=ceil_div(s.lq, plan.rows), BLOCKS=blocks)}
{split_constants(s, "forward", plan, grid)}
const SCALE: f32 = {s.scale!r};
const MASKED: f32 = {MASKED!r};
var<workgroup> stage: array<vec4<f32>, {staging}>;
var<workgroup> ps: array<vec4<f32>, {FLASH_KEYS * (groups + 1)}>;
var<workgroup> ex: array<f32, {plan.rows * (kg + 1)}>;

{PROB}
"""


def _stage_qk(s: AttentionShape, plan: ChunkedPlan) -> str:
    """WGSL: vec4 columns c0.. of the block's query rows into stage[r * QS + c] and of the tile's key rows into
    stage[KOFF + j * QS + c] (zeros for keys past the end: a clamped load kept by select, as in ``flash``)."""
    threads = plan.rows // 4 * FLASH_KEY_GROUPS
    width = plan.d_chunk
    lines = [f"      {guard}{{\n        let r = {e} / {width}u;\n        let c = {e} % {width}u;\n"
             f"        stage[r * QS + c] = load_q4(b, h, min(i0 + r, LQ - 1u), c0 + c);\n      }}"
             for e, guard in shares(plan.rows * width, threads)]
    load = "select(vec4<f32>(), load_k4(b, h, min(start + j, LK - 1u), c0 + c), start + j < key_end)"
    lines += [f"      {guard}{{\n        let j = {e} / {width}u;\n        let c = {e} % {width}u;\n"
              f"        stage[KOFF + j * QS + c] = {load};\n      }}"
              for e, guard in shares(FLASH_KEYS * width, threads)]
    return "\n".join(lines)


def _chunk_products(plan: ChunkedPlan) -> str:
    """WGSL: the staged chunk's products added to the thread's 4x4 scores, one vec4 column at a time."""
    groups, kg = plan.rows // 4, FLASH_KEY_GROUPS
    return "\n".join(
        f"      {{\n        let c = {c}u;\n"
        + "".join(f"        let q{r} = stage[{tile_row(r, groups)} * QS + c];\n" for r in ROWS4)
        + "".join(f"        let k{t} = stage[KOFF + (kg + {kg * t}u) * QS + c];\n" for t in ROWS4)
        + "".join(f"        s{r} = fma(vec4<f32>(q{r}[{u}]), vec4<f32>(k0[{u}], k1[{u}], k2[{u}], k3[{u}]), s{r});\n"
                  for u in range(4) for r in ROWS4)
        + "      }" for c in range(plan.d_chunk))


def _stage_v(s: AttentionShape, plan: ChunkedPlan) -> str:
    """WGSL: the value rows of tile keys v0 .. v0 + VC into stage[j * DVP4 + c4] (columns past the row are not
    staged: their products go to output columns that are not stored)."""
    threads = plan.rows // 4 * FLASH_KEY_GROUPS
    width = -(-s.dv // 4)
    load = "select(vec4<f32>(), load_v4(b, h, min(key, LK - 1u), c4), key < key_end)"
    return "\n".join(f"      {guard}{{\n        let j = {e} / {width}u;\n        let c4 = {e} % {width}u;\n"
                     f"        let key = start + v0 + j;\n        stage[j * DVP4 + c4] = {load};\n      }}"
                     for e, guard in shares(plan.v_chunk * width, threads))
