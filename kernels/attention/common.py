"""WGSL pieces shared by the attention passes: the masked-score convention (``MASKED``, ``PROB``), the kernel head
over a folded grid (and over blocks of rows) and the stores of an update its threads run (``with_side_stores``), u32
constants, vec4 loaders over the caller's element loads, and the
constants and range of a pass cut into slices of the other sequence."""
from __future__ import annotations

import re

from .. import wgsl
from ..sizes import is_size
from ..matmul_common import fold_grid
from .plans import AttentionShape, live_slices, partial_layout

# A score at or below this (an additive mask of -inf or the dtype's minimum) counts as masked out.
MASKED = -1.0e38
# The probability of a score against a row's log-sum-exp (or running max), zero where either is masked out.
PROB = """fn prob(s: f32, lse: f32) -> f32 {
  return select(exp(s - lse), 0.0, s <= MASKED || lse <= MASKED);
}"""


# Query rows per head up to which a forward pass with a mask narrows its loop over keys to the span that some row of
# its block leaves unmasked (``key_range``): a decode step's one row (or a few) over a static cache, whose mask hides
# every position past the current one, reads the keys up to that position instead of the whole cache. The scan costs
# a mask load per row and key of the slice, once; with more rows it would repeat most of the tiles' own mask loads.
NARROW_MAX_ROWS = 8


def narrows(s: AttentionShape) -> bool:
    """Whether a forward pass over ``s`` narrows its keys to the unmasked span (``key_range``)."""
    return s.has_bias and not is_size(s.lq) and s.lq <= NARROW_MAX_ROWS


def key_range_arrays(s: AttentionShape) -> str:
    """WGSL: the workgroup variables of ``key_range`` (none where the pass does not narrow)."""
    if not narrows(s):
        return ""
    return ("var<workgroup> key_first: atomic<u32>;\nvar<workgroup> key_last: atomic<u32>;\n"
            "var<workgroup> key_span: vec2<u32>;")


def key_range(s: AttentionShape, threads: str) -> str:
    """WGSL: ``key_from`` and ``key_to``, the keys the loop walks: after ``slice_bounds("key", ...)``, the
    workgroup's [key_lo, key_end); where the pass ``narrows``, cut to the first and past the last key that a
    query row of the block (rows i0 .. i0 + BQ below LQ) leaves unmasked, by the ``threads`` threads together (an
    empty range where the mask hides every key: the rows' sums stay zero, as they would). A mask value counts as
    masked as a score does (at or below MASKED; NaN does not). Uniform across the workgroup."""
    if not narrows(s):
        return "  let key_from = key_lo;\n  let key_to = key_end;"
    causal = " && kj <= ki" if s.causal else ""
    return f"""  if (tid == 0u) {{ atomicStore(&key_first, 0xffffffffu); atomicStore(&key_last, 0u); }}
  workgroupBarrier();
  {{
    let rows_here = min(BQ, LQ - min(i0, LQ));
    let keys_here = key_end - min(key_lo, key_end);
    var first = 0xffffffffu;
    var last = 0u;
    for (var e = tid; e < rows_here * keys_here; e = e + {threads}) {{
      let ki = i0 + e / keys_here;
      let kj = key_lo + e % keys_here;
      if (!(load_bias(b, h, ki, kj) <= MASKED){causal}) {{ first = min(first, kj); last = max(last, kj + 1u); }}
    }}
    if (last > 0u) {{ atomicMin(&key_first, first); atomicMax(&key_last, last); }}
  }}
  workgroupBarrier();
  if (tid == 0u) {{ key_span = vec2<u32>(atomicLoad(&key_first), atomicLoad(&key_last)); }}
  let live_keys = workgroupUniformLoad(&key_span);
  let key_from = live_keys.x;
  let key_to = live_keys.y;"""


def forward_outputs(outs: list[str]) -> tuple[str, str | None]:
    """(output array, log-sum-exp array or None) of a forward pass whose ``outs`` name [out, lse], or [out] alone
    where nothing reads the log-sum-exp (a decode step's attention: one storage binding fewer)."""
    return outs[0], (outs[1] if len(outs) > 1 else None)


# The line of ``entry`` after which a pass's threads run the stores of an update (``with_side_stores``).
EXIT = "{ return; }  // uniform: the whole workgroup leaves"
_ENTRY = re.compile(r"@compute @workgroup_size\((?P<size>[^)]+)\)\nfn main\([^\n]*\n[^\n]*\n"
                    r"  if \((?P<index>\w+) >= (?P<count>[^)]+)\) " + re.escape(EXIT)
                    + "\n")


def entry(size: str = "T", index: str = "row", count: str = "ROWS") -> str:
    """The kernel's head: ``index``, the linear workgroup id (folded grids), and an exit for ids past ``count``."""
    return f"""@compute @workgroup_size({size})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {{
  let {index} = wg.x + wg.y * GRID_X + wg.z * GRID_XY;
  if ({index} >= {count}) {EXIT}
"""


def with_side_stores(source: str, function: str, units: str) -> str:
    """``source``, a pass whose ``main`` starts with ``entry``, with every thread of its live workgroups calling
    ``function(unit)`` for its share of the ``units`` (u32 text) store units, a workgroup's threads on neighbouring
    units, before the pass's own work: the stores of an update that the pass reads from the update's expressions
    (``meganeura.lowering.attention_writes``), without a barrier (the loop may take any number of turns)."""
    head = _ENTRY.search(source)
    if head is None:
        raise ValueError("with_side_stores: no entry() head in the pass")
    size, index, count = head.group("size"), head.group("index"), head.group("count")
    loop = (f"  for (var mg_unit = {index} * ({size}) + tid; mg_unit < {units}; "
            f"mg_unit = mg_unit + ({count}) * ({size})) {{ {function}(mg_unit); }}\n")
    return source[:head.end()] + loop + source[head.end():]


def u32_constants(**values) -> str:
    """WGSL: ``const NAME: u32 = value;``, a line for each of ``values`` in order (a symbolic size: a private
    variable set as ``main`` starts, ``wgsl.size_constant``)."""
    return "".join(wgsl.size_constant(name, value) for name, value in values.items()).rstrip("\n")


# The names block_entry gives a block's batch-and-head index, its head, the head count and the block's first row.
BLOCK_NAMES = {"query": ("bh", "h", "H", "i0"), "key": ("bg", "g", "HKV", "j0")}


def block_entry(threads: str, rows: str, blocks_per_head: str, over: str = "query") -> str:
    """The head of a kernel over blocks of ``rows`` rows (query or key rows, ``over``), ``blocks_per_head`` blocks
    per head and each maybe cut into SPLITS slices, of which the LIVE first run (``sliced_grid``): from the
    workgroup's id ``wid``, its block ``blk`` and slice ``split``, batch ``b``, the head (``h`` of H query heads,
    or ``g`` of HKV KV heads) and the block's first row (``i0`` or ``j0``)."""
    pair, head, heads, first = BLOCK_NAMES[over]
    return entry(threads, "wid", "BLOCKS * LIVE") + f"""  let blk = wid / LIVE;
  let split = wid % LIVE;
  let {pair} = blk / {blocks_per_head};
  let b = {pair} / {heads};
  let {head} = {pair} % {heads};
  let {first} = (blk % {blocks_per_head}) * {rows};"""


def vec4_loaders(prelude: str, s: AttentionShape, *operands: str) -> str:
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


def split_constants(s: AttentionShape, kind: str, plan, grid) -> str:
    """WGSL constants of a blocked or flash pass: its slices (``plan``: a BlockPlan or FlashPlan) and those a run
    launches (``plans.live_slices``), output rows and folded grid."""
    rows, _ = partial_layout(s, kind)
    return (u32_constants(SPLITS=plan.splits, LIVE=live_slices(s, kind, plan), CHUNK=plan.chunk, ROWS=rows) + "\n"
            + wgsl.grid_constants(grid).rstrip("\n"))


def sliced_grid(s: AttentionShape, kind: str, plan, rows, limits: dict) -> tuple:
    """The folded grid of a pass of ``rows`` workgroups (row blocks) per slice: the slices a run launches
    (``plans.live_slices``: all of them but where a symbolic length leaves the last ones empty) of each."""
    return fold_grid(rows * live_slices(s, kind, plan), limits.get("max-compute-workgroups-per-dimension", 65535))


def slice_bounds(what: str, end: str, start: str = "0u") -> str:
    """WGSL: ``{what}_lo`` and ``{what}_end``, this workgroup's range of the other sequence: [start, end), cut to
    slice ``split`` of CHUNK rows when the pass is cut into SPLITS slices (uniform across the workgroup)."""
    return (f"  let {what}_lo = select({start}, max({start}, split * CHUNK), SPLITS > 1u);\n"
            f"  let {what}_end = select({end}, min({end}, split * CHUNK + CHUNK), SPLITS > 1u);")
