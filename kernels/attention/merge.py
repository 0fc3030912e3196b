"""The merge of a pass cut into slices of the other sequence: a second dispatch, one thread per output element,
that reads the slices' partial results from scratch (laid out as ``plans.partial_layout`` says) and writes the
pass's outputs."""
from __future__ import annotations

from ..matmul import fold_grid
from ..wgsl import size_u32
from .common import MASKED, PROB, forward_outputs
from .plans import AttentionShape, partial_layout

MERGE_THREADS = 256  # threads per workgroup of the merge, one output element each


def merge_slices(prelude: str, s: AttentionShape, kind: str, outs: list[str], splits, partial: str,
          limits: dict) -> tuple[str, tuple[int, int, int]]:
    """The second dispatch of a pass cut into slices: one thread per output element merges the partial results of
    the ``splits`` first slices (those the pass launched, ``plans.live_slices``: a size where the run's length sets
    it). Forward rescales each slice's output and sum to the overall max (and writes the log-sum-exp); the
    gradients add up."""
    rows, width = partial_layout(s, kind)
    total = rows * width if kind != "forward" else rows * s.dv
    grid = fold_grid(-(-total // MERGE_THREADS), limits.get("max-compute-workgroups-per-dimension", 65535))
    if kind == "forward":
        body = _forward_body(s, outs, splits, partial)
    else:
        body = _gradient_body(s, kind, outs, splits, partial)
    kernel = f"""
// ---- attention {kind}: merge of slices
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


def _forward_body(s: AttentionShape, outs: list[str], splits, partial: str) -> str:
    """WGSL: output element e rescaled from every slice to the overall max, and (one thread a row) the row's
    log-sum-exp."""
    out, lse = forward_outputs(outs)
    return f"""  let row = e / {s.dv}u;
  let c = e % {s.dv}u;
{_merged_sums(s, splits, partial)}
  {out}[e] = select(o / l, 0.0, l == 0.0);""" + ("" if lse is None else f"""
  if (c == 0u) {{ {lse}[row] = select(m + log(l), MASKED, l == 0.0); }}""")


def _merged_sums(s: AttentionShape, splits, partial: str) -> str:
    """WGSL: the overall max ``m`` of output row ``row``'s slices, and its sum ``l`` and column ``c``'s unnormalised
    output ``o`` rescaled to it (with ``prob`` and ``MASKED`` in scope)."""
    rows, width = partial_layout(s, "forward")
    return f"""  var m = MASKED;
  for (var s = 0u; s < {size_u32(splits)}; s++) {{ m = max(m, {partial}[(s * {rows}u + row) * {width}u + {s.dv}u]); }}
  var l = 0.0;
  var o = 0.0;
  for (var s = 0u; s < {size_u32(splits)}; s++) {{
    let at = (s * {rows}u + row) * {width}u;
    let w = prob({partial}[at + {s.dv}u], m);
    l = l + w * {partial}[at + {s.dv + 1}u];
    o = o + w * {partial}[at + c];
  }}"""


def merged_function(name: str, s: AttentionShape, splits, partial: str) -> str:
    """WGSL: ``name(e: i32) -> f32``, element e of a forward pass's output merged from the ``splits`` first slices'
    partial results in ``partial`` (what the merge dispatch stores there; a size where the run's length sets it),
    for a kernel that reads the output as it merges it (a matrix-vector product's row: ``lowering.slice_merges``);
    with the ``prob`` it calls, named apart."""
    helper = f"{name}_prob"
    sums = _merged_sums(s, splits, partial).replace("prob(", f"{helper}(").replace("MASKED", repr(MASKED))
    return f"""fn {helper}(s: f32, lse: f32) -> f32 {{
  return select(exp(s - lse), 0.0, s <= {MASKED!r} || lse <= {MASKED!r});
}}
fn {name}(e_: i32) -> f32 {{
  let e = u32(e_);
  let row = e / {s.dv}u;
  let c = e % {s.dv}u;
{sums}
  return select(o / l, 0.0, l == 0.0);
}}"""


def _gradient_body(s: AttentionShape, kind: str, outs: list[str], splits, partial: str) -> str:
    """WGSL: element e of the gradient (dQ; or dK and dV side by side) summed over the slices, and scaled."""
    rows, width = partial_layout(s, kind)
    sums = f"""  var acc = 0.0;
  for (var s = 0u; s < {size_u32(splits)}; s++) {{ acc = acc + {partial}[s * {rows * width}u + e]; }}"""
    if kind == "grad_q":
        return sums + f"\n  {outs[0]}[e] = acc * {s.scale!r};"
    dk, dv = outs
    return sums + f"""
  let row = e / {width}u;
  let c = e % {width}u;
  if (c < {s.d}u) {{ {dk}[row * {s.d}u + c] = acc * {s.scale!r}; }}
  else {{ {dv}[row * {s.dv}u + c - {s.d}u] = acc; }}"""
