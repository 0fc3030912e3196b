"""Pointwise archetype: one thread per output element evaluates a fused expression and stores it.

The output is contiguous; inputs are read through arbitrary index expressions (strides, broadcasting,
gathers), so a whole chain of views and elementwise ops runs as one dispatch.
"""
from __future__ import annotations

from . import wgsl

WORKGROUP = 256


def pointwise_kernel(*, bindings, out_name: str, out_dtype: str, expr, shape, limits) -> tuple[str, tuple]:
    """Return (WGSL, workgroups) computing ``expr`` at every coordinate of ``shape`` into ``out_name``.

    ``bindings`` lists (slot, name, storage type) for every buffer the kernel uses (output included).
    """
    total = 1
    for s in shape:
        total *= s
    groups = wgsl.grid(-(-total // WORKGROUP), limits["max-compute-workgroups-per-dimension"])
    coords = [f"c{d}" for d in range(len(shape))]
    em = wgsl.Emitter(coords)
    result = em.value(expr)
    body = "\n".join(
        wgsl.unravel_lines("idx", coords, shape)
        + em.lines
        + [f"  {out_name}[idx] = {wgsl.store(result, out_dtype)};"]
    )
    source = f"""{wgsl.binding_decls(bindings)}
{wgsl.helpers_for(body)}
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let linear = {wgsl.flat_workgroup(groups[0])} * {WORKGROUP}u + lid;
  if (linear >= {total}u) {{ return; }}
  let idx = i32(linear);
{body}
}}
"""
    return source, groups
