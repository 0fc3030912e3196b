"""Pointwise archetype: one thread per output element evaluates a fused expression and stores it.

The outputs are contiguous (several of the same size share the thread's index and its common subexpressions);
inputs are read through arbitrary index expressions (strides, broadcasting, gathers), so a whole chain of views
and elementwise ops runs as one dispatch.
"""
from __future__ import annotations

from . import wgsl

WORKGROUP = 256


def pointwise_kernel(*, bindings, outputs, shape, limits) -> tuple[str, tuple]:
    """Return (WGSL, workgroups) computing, at every coordinate of ``shape``, each (name, dtype, expr) of
    ``outputs`` into buffer ``name`` at the coordinate's linear index.

    ``bindings`` lists (slot, name, storage type) for every buffer the kernel uses (outputs included).
    """
    total = 1
    for s in shape:
        total *= s
    groups = wgsl.grid(-(-total // WORKGROUP), limits["max-compute-workgroups-per-dimension"])
    coords = [f"c{d}" for d in range(len(shape))]
    em = wgsl.Emitter(coords)
    stores = [f"  {name}[idx] = {wgsl.store(em.value(expr), dtype)};" for name, dtype, expr in outputs]
    body = "\n".join(wgsl.unravel_lines("idx", coords, shape) + em.lines + stores)
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
