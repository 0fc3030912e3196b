"""Pointwise archetype: each thread evaluates a fused expression at a few output elements and stores them.

The outputs are contiguous (several of the same size share the thread's index and its common subexpressions);
inputs are read through arbitrary index expressions (strides, broadcasting, gathers), so a whole chain of views
and elementwise ops runs as one dispatch.

A large output gives each thread several elements (the most of ``ELEMENTS_PER_THREAD`` that still leaves
``MIN_WORKGROUPS`` workgroups), one workgroup width apart so that every load of a subgroup stays coalesced. All of
a thread's values are computed before any is stored: the loads of the copies are independent, so more of them are
in flight per thread (the buffers may alias as far as the shader compiler knows, so a store in between would order
them). Values are computed without a branch, past the end at the last element's index (clamped), and only the
stores are guarded: a load inside a bounds test cannot be issued before the work of the copy ahead of it.
"""
from __future__ import annotations

from . import wgsl

WORKGROUP = 256
ELEMENTS_PER_THREAD = (8, 4, 2)  # candidates, largest first; H200, 256 MiB copy: 1 -> 0.87 ms, 4 -> 0.57, 8 -> 0.35
MIN_WORKGROUPS = 2048            # a thread takes several elements only while this many workgroups remain


def elements_per_thread(total: int) -> int:
    return next((n for n in ELEMENTS_PER_THREAD if total >= n * WORKGROUP * MIN_WORKGROUPS), 1)


def pointwise_kernel(*, bindings, outputs, shape, limits) -> tuple[str, tuple]:
    """Return (WGSL, workgroups) computing, at every coordinate of ``shape``, each (name, dtype, expr) of
    ``outputs`` into buffer ``name`` at the coordinate's linear index.

    ``bindings`` lists (slot, name, storage type) for every buffer the kernel uses (outputs included).
    """
    total = 1
    for s in shape:
        total *= s
    copies = elements_per_thread(total)
    groups = wgsl.grid(-(-total // (WORKGROUP * copies)), limits["max-compute-workgroups-per-dimension"])
    groups_total = groups[0] * groups[1] * groups[2]
    coords = [f"c{d}" for d in range(len(shape))]
    declared, computed, stored = [], [], []
    for copy in range(copies):
        linear = f"first + {copy * WORKGROUP}u" if copy else "first"
        em = wgsl.Emitter(coords, indent="    ")
        values = [wgsl.store(em.value(expr), dtype) for _, dtype, expr in outputs]
        results = [f"r{k}_{copy}" for k in range(len(outputs))]
        declared += [f"  var {r}: {wgsl.STORAGE_TYPE[dtype]};" for r, (_, dtype, _) in zip(results, outputs)]
        lines = (wgsl.unravel_lines("idx", coords, shape, indent="    ") + em.lines
                 + [f"    {r} = {v};" for r, v in zip(results, values)])
        index = f"min({linear}, {max(total - 1, 0)}u)" if copies * WORKGROUP * groups_total > total else linear
        computed.append(f"  {{\n    let idx = i32({index});\n" + "\n".join(lines) + "\n  }")
        stored += [f"  if ({linear} < {total}u) {{ {name}[{linear}] = {r}; }}"
                   for r, (name, _, _) in zip(results, outputs)]
    body = "\n".join(declared + computed + stored)
    source = f"""{wgsl.binding_decls(bindings)}
{wgsl.helpers_for(body)}
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let first = {wgsl.flat_workgroup(groups[0])} * {WORKGROUP * copies}u + lid;
{body}
}}
"""
    return source, groups
