"""The flash attention forward, for head sizes up to ``plans.FLASH_MAX_HEAD`` where the workgroup storage holds its
tiles: a block of 64 (or 32) query rows per workgroup, key tiles of 32, and both products register-tiled, 4 rows x
4 keys of scores and 4 rows x a few vec4 columns of output per thread (FlashAttention-2's loop order). On an H200 it
took the inference GPU time of Whisper-tiny from 3.13 to 2.75 ms (against the unfused matmuls), SD U-Net 3.19 ->
2.87, SmolLM2 5.82 -> 5.22 (unfused before), SmolVLA 2.67 -> 2.41 (the blocked forward before).

``flash_forward`` assembles the kernel from the pieces below, each the WGSL of one step of a thread's work.
"""
from __future__ import annotations

from ..sizes import ceil_div
from .common import (MASKED, PROB, block_entry, forward_outputs, key_range, key_range_arrays, slice_bounds,
                     sliced_grid, split_constants, u32_constants, vec4_loaders)
from .plans import FLASH_KEY_GROUPS, FLASH_KEYS, AttentionShape, FlashPlan, flash_sizes

# Score columns (vec4s) per iteration of the loop over the head size. H200, GPU us, 1, 2 and 4 columns and all
# written out: Whisper-tiny 207 / 201 / 193 / 191, SmolLM2 19.4 / 19.2 / 19.1 / 21.6, SmolVLA 14.2 / 14.0 / 14.3 /
# 16.5, 2 x 8 heads of d 40 over 256 keys 38.8 / 37.6 / 37.7 / 39.0.
QK_UNROLL = 4
ROWS4 = range(4)  # a thread's query rows (and keys) per tile


def flash_forward(prelude: str, s: AttentionShape, outs: list[str], plan: FlashPlan, limits: dict,
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
    _, _, per_thread = flash_sizes(s)
    groups = plan.rows // 4
    blocks = s.batch * s.heads * ceil_div(s.lq, plan.rows)
    grid = sliced_grid(s, "forward", plan, blocks, limits)
    cols = range(per_thread)
    key_end = "min(LK, i0 + BQ)" if s.causal else "LK"
    o_regs = "\n".join(f"  var o{r}_{w} = vec4<f32>();" for r in ROWS4 for w in cols)
    kernel = _header(s, plan, blocks, grid) + f"""
{block_entry(str(groups * FLASH_KEY_GROUPS), "BQ", "QBLOCKS")}
  let kg = tid % KG;
  let rg = tid / KG;
{_stage_q(s, plan)}
{o_regs}
  var m = array<f32, 4>(MASKED, MASKED, MASKED, MASKED);
  var l = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
{slice_bounds("key", key_end)}
{key_range(s, "GROUPS * KG")}
  for (var start = key_from; start < key_to; start = start + BK) {{
    workgroupBarrier();
{_stage_kv(s, plan)}
    workgroupBarrier();
{_key_tile(s, plan)}
  }}
{row_totals(groups)}
{stores(s, plan, outs, partial, cols)}
}}
"""
    return prelude + "\n" + vec4_loaders(prelude, s, "q", "k", "v") + kernel, grid


def _header(s: AttentionShape, plan: FlashPlan, blocks: int, grid) -> str:
    """WGSL constants and workgroup arrays of the flash forward, and ``prob``."""
    d4, dvp4, _ = flash_sizes(s)
    groups, kg = plan.rows // 4, FLASH_KEY_GROUPS
    return f"""
// ---- attention forward (flash): {plan.rows} query rows per workgroup, key tiles of {FLASH_KEYS}, 4x4 per thread
{u32_constants(H=s.heads, LQ=s.lq, LK=s.lk, DV=s.dv, BQ=plan.rows, BK=FLASH_KEYS, GROUPS=groups, KG=kg, QS=d4 + 1,
               DVP4=dvp4, EXS=kg + 1, QBLOCKS=ceil_div(s.lq, plan.rows), BLOCKS=blocks)}
{split_constants(s, "forward", plan, grid)}
const SCALE: f32 = {s.scale!r};
const MASKED: f32 = {MASKED!r};
var<workgroup> qs: array<vec4<f32>, {(d4 + 1) * plan.rows}>;
var<workgroup> ks: array<vec4<f32>, {(d4 + 1) * FLASH_KEYS}>;
var<workgroup> vs: array<vec4<f32>, {FLASH_KEYS * dvp4}>;
var<workgroup> ps: array<vec4<f32>, {FLASH_KEYS * (groups + 1)}>;
var<workgroup> ex: array<f32, {plan.rows * (kg + 1)}>;
{key_range_arrays(s)}

{PROB}
"""


def row_totals(groups: int) -> str:
    """WGSL: after the last key tile, each row's sum of probabilities (``total``), added up from the threads'
    partial sums through ``ex``."""
    stores = "\n".join(f"  ex[{tile_row(r, groups)} * EXS + kg] = l[{r}];" for r in ROWS4)
    sums = "\n".join(f"  for (var g = 0u; g < KG; g++) {{ total[{r}] += ex[{tile_row(r, groups)} * EXS + g]; }}"
                     for r in ROWS4)
    return f"""  workgroupBarrier();
{stores}
  workgroupBarrier();
  var total = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
{sums}"""


def tile_row(r: int, groups: int) -> str:
    """WGSL: the tile row of a thread's r-th query row."""
    return f"(rg + {groups * r}u)"


def shares(total: int, threads: int):
    """(element index, guard) of each of a thread's shares of ``total`` staged elements."""
    for t in range(-(-total // threads)):
        e = f"(tid + {t * threads}u)"
        yield e, f"if {e} < {total}u " if (t + 1) * threads > total else ""


def _stage_q(s: AttentionShape, plan: FlashPlan) -> str:
    """WGSL: query rows i0.. staged as they lie: qs[r * QS + c4]."""
    d4, _, _ = flash_sizes(s)
    threads = plan.rows // 4 * FLASH_KEY_GROUPS
    return "\n".join(f"  {guard}{{\n    let r = {e} / {d4}u;\n    let c4 = {e} % {d4}u;\n"
                     f"    qs[r * QS + c4] = load_q4(b, h, min(i0 + r, LQ - 1u), c4);\n  }}"
                     for e, guard in shares(plan.rows * d4, threads))


def _stage_kv(s: AttentionShape, plan: FlashPlan) -> str:
    """WGSL: key rows staged as they lie: ks[j * QS + c4]; value rows: vs[j * DVP4 + c4] (value columns past the
    row are not staged: their products go to output columns that are not stored)."""
    d4, _, _ = flash_sizes(s)
    threads = plan.rows // 4 * FLASH_KEY_GROUPS
    lines = []
    for what, width, array, stride in (("k", d4, "ks", "QS"), ("v", -(-s.dv // 4), "vs", "DVP4")):
        # A clamped load kept by select, not a load under ``if``: H200, loads of keys (and query rows) past the
        # end skipped by ``if`` took Whisper-tiny's attention from 0.77 to 1.09 ms a call (SmolLM2's one-token
        # attention 0.32 -> 0.30).
        for e, guard in shares(FLASH_KEYS * width, threads):
            load = f"select(vec4<f32>(), load_{what}4(b, h, min(start + j, LK - 1u), c4), start + j < key_end)"
            lines.append(f"    {guard}{{\n      let j = {e} / {width}u;\n      let c4 = {e} % {width}u;\n"
                         f"      {array}[j * {stride} + c4] = {load};\n    }}")
    return "\n".join(lines)


def _key_tile(s: AttentionShape, plan: FlashPlan) -> str:
    """WGSL: one staged key tile: the thread's 4x4 scores, the rows' shared max and the online softmax, the
    probabilities through workgroup memory, and P V into the thread's output registers."""
    return f"""    var s0 = vec4<f32>();
    var s1 = vec4<f32>();
    var s2 = vec4<f32>();
    var s3 = vec4<f32>();
{_products(s, plan)}
{probabilities(s, plan)}
    workgroupBarrier();
    for (var j = 0u; j < BK; j++) {{
{accumulate(s, "j", "vs[j * DVP4")}
    }}"""


def probabilities(s: AttentionShape, plan) -> str:
    """WGSL: the tile's scores, their online softmax into the thread's 4x4 probabilities p0..p3, and those into
    ``ps`` (``prob_stores``)."""
    return f"""{scores(s, plan)}
    workgroupBarrier();
    var p0 = vec4<f32>();
    var p1 = vec4<f32>();
    var p2 = vec4<f32>();
    var p3 = vec4<f32>();
{softmax(s, plan)}
{prob_stores()}"""


def prob_stores() -> str:
    """WGSL: the thread's 4x4 probabilities into ``ps``, a vec4 of its 4 rows per key."""
    return "\n".join(f"    ps[(kg + {FLASH_KEY_GROUPS * t}u) * (GROUPS + 1u) + rg] = "
                     f"vec4<f32>(p0[{t}], p1[{t}], p2[{t}], p3[{t}]);" for t in range(4))


def accumulate(s: AttentionShape, key: str, value_row: str) -> str:
    """WGSL: the probabilities of tile key ``key`` (its 4 rows) times the thread's vec4 columns of that key's value
    row, whose vec4 c4 is read as ``value_row + c4]``, into the output registers."""
    _, _, per_thread = flash_sizes(s)
    kg = FLASH_KEY_GROUPS
    return f"      let pv = ps[{key} * (GROUPS + 1u) + rg];\n" + "\n".join(
        f"      {{ let vv = {value_row} + kg + {kg * w}u];\n"
        + "".join(f"        o{r}_{w} = fma(vec4<f32>(pv[{r}]), vv, o{r}_{w});\n" for r in ROWS4) + "      }"
        for w in range(per_thread))


def _products(s: AttentionShape, plan: FlashPlan) -> str:
    """WGSL: the thread's 4x4 block of dot products of query and key rows, QK_UNROLL vec4 columns per iteration."""
    d4, _, _ = flash_sizes(s)
    groups, kg = plan.rows // 4, FLASH_KEY_GROUPS
    step = "\n".join(  # the products of vec4 column c4 of the tile's query and key rows
        [f"        let q{r} = qs[{tile_row(r, groups)} * QS + c4];" for r in ROWS4]
        + [f"        let k{t} = ks[(kg + {kg * t}u) * QS + c4];" for t in ROWS4]
        + [f"        s{r} = fma(vec4<f32>(q{r}[{u}]), vec4<f32>(k0[{u}], k1[{u}], k2[{u}], k3[{u}]), s{r});"
           for u in range(4) for r in ROWS4])
    whole = d4 // QK_UNROLL * QK_UNROLL  # columns taken QK_UNROLL at a time; the rest written out after the loop
    return "\n".join(
        ([f"    for (var c0 = 0u; c0 < {whole}u; c0 += {QK_UNROLL}u) {{"]
         + [f"      {{\n        let c4 = c0 + {u}u;\n{step}\n      }}" for u in range(QK_UNROLL)] + ["    }"]
         if whole else [])
        + [f"    {{\n        let c4 = {c}u;\n{step}\n    }}" for c in range(whole, d4)])


def scores(s: AttentionShape, plan: FlashPlan) -> str:
    """WGSL: the products scaled, biased and masked into scores, each row's max of its 4 into ``ex``."""
    groups, kg = plan.rows // 4, FLASH_KEY_GROUPS
    bias = "load_bias(b, h, min(i, LQ - 1u), min(j, LK - 1u))" if s.has_bias else "0.0"
    masked = "j >= key_end" + (" || j > i" if s.causal else "")
    return "\n".join(
        f"      {{\n        let i = i0 + {tile_row(r, groups)};\n"
        + "".join(f"        {{ let j = start + kg + {kg * t}u;\n"
                  f"          s{r}[{t}] = select(s{r}[{t}] * SCALE + {bias}, MASKED, {masked}); }}\n" for t in range(4))
        + f"        ex[{tile_row(r, groups)} * EXS + kg] = max(max(s{r}[0], s{r}[1]), max(s{r}[2], s{r}[3]));\n      }}"
        for r in ROWS4)


def softmax(s: AttentionShape, plan: FlashPlan) -> str:
    """WGSL: per row, the tile's max from ``ex``, the running max, output and partial sum rescaled to it, and the
    probabilities of the thread's 4 keys."""
    _, _, per_thread = flash_sizes(s)
    groups = plan.rows // 4
    return "\n".join(
        f"      {{\n        var tile_max = MASKED;\n"
        f"        for (var g = 0u; g < KG; g++) {{ tile_max = max(tile_max, ex[{tile_row(r, groups)} * EXS + g]); }}\n"
        f"        let m_new = max(m[{r}], tile_max);\n"
        f"        let alpha = select(exp(m[{r}] - m_new), 1.0, m[{r}] <= MASKED);\n"
        f"        m[{r}] = m_new;\n"
        + "".join(f"        o{r}_{w} = o{r}_{w} * alpha;\n" for w in range(per_thread))
        + f"        p{r} = vec4<f32>(prob(s{r}[0], m_new), prob(s{r}[1], m_new), prob(s{r}[2], m_new), "
          f"prob(s{r}[3], m_new));\n"
        f"        l[{r}] = l[{r}] * alpha + p{r}[0] + p{r}[1] + p{r}[2] + p{r}[3];\n      }}"
        for r in ROWS4)


def stores(s: AttentionShape, plan: FlashPlan, outs: list[str], partial: str | None, cols: range) -> str:
    """WGSL: each thread's 4 output rows (its vec4 columns of each), normalised into ``out`` with the row's
    log-sum-exp into ``lse`` (where ``outs`` names it: ``forward_outputs``); or, keys cut into slices, unnormalised
    with the running max and sum into this slice's row of ``partial`` (the layout ``merge.merge_slices`` reads)."""
    out, lse = forward_outputs(outs)
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
            if lse is None:
                return ""
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
