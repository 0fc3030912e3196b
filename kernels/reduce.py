"""Reduction archetype: one workgroup per row runs a sequence of tree reductions over the row.

A row program has phases (sum, prod, max, min, argmax, argmin), each reducing an expression that may use
the results of earlier phases; then it writes per-row results (by thread 0) and per-element results
(strided over the row). Softmax, log-softmax, layer norm and variance are one dispatch each; plain
sum/mean/amax are the one-phase case. Threads stride over the row and combine in workgroup memory.
Rows of at most SERIAL_ROW_MAX elements (a pooling window, a few scatter candidates) are the exception: one
thread walks each row on its own, with no workgroup memory and no barriers.
"""
from __future__ import annotations

from . import wgsl

IDENTITY = {
    ("sum", "f32"): "0.0", ("sum", "i32"): "0i", ("prod", "f32"): "1.0", ("prod", "i32"): "1i",
    ("max", "f32"): "bitcast<f32>(0xff800000u)", ("max", "i32"): "i32(-2147483647 - 1)",
    ("min", "f32"): "bitcast<f32>(0x7f800000u)", ("min", "i32"): "2147483647i",
    ("argmax", "f32"): "bitcast<f32>(0xff800000u)", ("argmax", "i32"): "i32(-2147483647 - 1)",
    ("argmin", "f32"): "bitcast<f32>(0x7f800000u)", ("argmin", "i32"): "2147483647i",
    ("max", "bool"): "false", ("min", "bool"): "true",
}
COMBINE = {
    "sum": "({a} + {b})", "prod": "({a} * {b})",
    ("max", "f32"): "mg_max({a}, {b})", ("min", "f32"): "mg_min({a}, {b})",
    ("max", "i32"): "max({a}, {b})", ("min", "i32"): "min({a}, {b})",
    ("max", "bool"): "({a} || {b})", ("min", "bool"): "({a} && {b})",
}
# (value, index) replaces (best, best_index) when it is better; ties keep the lower index, NaN wins like torch.
ARG_BETTER = {
    ("argmax", "f32"): "(mg_isnan({v}) && (!mg_isnan({bv}) || {i} < {bi})) || (!mg_isnan({bv}) && ({v} > {bv} || ({v} == {bv} && {i} < {bi})))",
    ("argmin", "f32"): "(mg_isnan({v}) && (!mg_isnan({bv}) || {i} < {bi})) || (!mg_isnan({bv}) && ({v} < {bv} || ({v} == {bv} && {i} < {bi})))",
    ("argmax", "i32"): "({v} > {bv} || ({v} == {bv} && {i} < {bi}))",
    ("argmin", "i32"): "({v} < {bv} || ({v} == {bv} && {i} < {bi}))",
}


SERIAL_ROW_MAX = 16
SERIAL_WORKGROUP = 64


def workgroup_size(row_length: int, max_invocations: int) -> int:
    size = 32
    while size < row_length and size < 256:
        size *= 2
    return min(size, max_invocations)


def reduce_kernel(*, bindings, domain, axes, phases, results, limits) -> tuple[str, tuple]:
    """Return (WGSL, workgroups) for a row program.

    ``phases``: list of (op, expr); ``results``: list of (per_element, expr, out_name, out_dtype).
    Coordinates in expressions are domain dimensions; ``acc(i)`` is phase i's result for the row.
    """
    outer_dims = [d for d in range(len(domain)) if d not in axes]
    row_shape = [domain[d] for d in outer_dims]
    red_shape = [domain[d] for d in axes]
    rows = _prod(row_shape)
    length = _prod(red_shape)
    serial = length <= SERIAL_ROW_MAX
    wg = SERIAL_WORKGROUP if serial else workgroup_size(length, limits["max-compute-invocations-per-workgroup"])
    groups = wgsl.grid(-(-rows // wg) if serial else rows, limits["max-compute-workgroups-per-dimension"])
    names = [f"o{d}" if d in outer_dims else f"r{d}" for d in range(len(domain))]
    acc_names = [f"acc{i}" for i in range(len(phases))]
    body: list[str] = []
    body += wgsl.unravel_lines("row", [names[d] for d in outer_dims], row_shape)
    shared_types = set()
    has_arg = False
    for p, (op, expr) in enumerate(phases):
        body += _phase(p, op, expr, names, axes, red_shape, length, 1 if serial else wg, acc_names[:p])
        shared_types.add(expr.dtype)
        has_arg = has_arg or op.startswith("arg")
    row_results = [r for r in results if not r[0]]
    elem_results = [r for r in results if r[0]]
    if row_results:
        em = wgsl.Emitter(names, acc_names, indent="    ")
        stores = [f"    {name}[row] = {wgsl.store(em.value(e), dt)};" for _, e, name, dt in row_results]
        body += ["  if (lid == 0u || SERIAL) {"] + em.lines + stores + ["  }"]
    if elem_results:
        em = wgsl.Emitter(names, acc_names, indent="    ")
        stores = [f"    {name}[flat] = {wgsl.store(em.value(e), dt)};" for _, e, name, dt in elem_results]
        strides = _strides(domain)
        flat = " + ".join([f"{names[d]} * {strides[d]}i" for d in range(len(domain))] or ["0i"])
        first, step = ("0i", "1i") if serial else ("i32(lid)", f"{wg}i")
        body += [f"  for (var j: i32 = {first}; j < {length}i; j = j + {step}) {{"]
        body += wgsl.unravel_lines("j", [names[d] for d in axes], red_shape, indent="    ")
        body += [f"    let flat: i32 = {flat};"] + em.lines + stores + ["  }"]
    text = "\n".join(body)
    shared = "\n".join(f"var<workgroup> red_{t}: array<{wgsl.VALUE_TYPE[t] if t != 'bool' else 'u32'}, {wg}>;"
                       for t in sorted(shared_types)) if not serial else ""
    if has_arg and not serial:  # indices get their own array: an i32 argmax keeps its values in red_i32
        shared += f"\nvar<workgroup> red_idx: array<i32, {wg}>;"
    row_index = f"{wgsl.flat_workgroup(groups[0])} * {wg}u + lid" if serial else wgsl.flat_workgroup(groups[0])
    source = f"""{wgsl.binding_decls(bindings)}
{shared}
const SERIAL: bool = {"true" if serial else "false"};
{wgsl.helpers_for(text)}
@compute @workgroup_size({wg})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let row_u = {row_index};
  if (row_u >= {rows}u) {{ return; }}
  let row = i32(row_u);
{text}
}}
"""
    return source, groups


def _phase(p, op, expr, names, axes, red_shape, length, wg, acc_names) -> list[str]:
    """Lines computing acc{p}: a strided per-thread loop, then a tree over workgroup memory (``wg`` 1: one thread
    walks the whole row and there is no tree)."""
    dt = expr.dtype
    em = wgsl.Emitter(names, acc_names, indent="    ")
    value = em.value(expr)
    is_arg = op.startswith("arg")
    a, ai = f"a{p}", f"ai{p}"
    lines = [f"  var {a}: {wgsl.VALUE_TYPE[dt]} = {IDENTITY[(op, dt)]};"]
    if is_arg:
        lines.append(f"  var {ai}: i32 = 2147483647i;")
    lines += [f"  for (var j: i32 = {'0i' if wg == 1 else 'i32(lid)'}; j < {length}i; j = j + {wg}i) {{"]
    lines += wgsl.unravel_lines("j", [names[d] for d in axes], red_shape, indent="    ")
    lines += em.lines
    if is_arg:
        better = ARG_BETTER[(op, dt)].format(v=value, i="j", bv=a, bi=ai)
        lines += [f"    if ({better}) {{ {a} = {value}; {ai} = j; }}"]
    else:
        lines += [f"    {a} = {_combine(op, dt, a, value)};"]
    lines += ["  }"]
    if wg == 1:  # one thread per row: the loop saw the whole row
        return lines + [f"  let acc{p} = {ai if is_arg else a};"]
    shared = f"red_{dt}"
    to_shared = (lambda x: f"select(0u, 1u, {x})") if dt == "bool" else (lambda x: x)
    from_shared = (lambda x: f"({x} != 0u)") if dt == "bool" else (lambda x: x)
    lines.append(f"  {shared}[lid] = {to_shared(a)};")
    if is_arg:
        lines.append(f"  red_idx[lid] = {ai};")
    lines.append("  workgroupBarrier();")
    lines.append(f"  for (var s: u32 = {wg // 2}u; s > 0u; s = s >> 1u) {{")
    lines.append("    if (lid < s) {")
    mine, other = from_shared(f"{shared}[lid]"), from_shared(f"{shared}[lid + s]")
    if is_arg:
        better = ARG_BETTER[(op, dt)].format(v="ov", i="oi", bv="mv", bi="mi")
        lines += [f"      let mv = {mine}; let mi = red_idx[lid]; let ov = {other}; let oi = red_idx[lid + s];",
                  f"      if ({better}) {{ {shared}[lid] = {to_shared('ov')}; red_idx[lid] = oi; }}"]
    else:
        lines.append(f"      {shared}[lid] = {to_shared(_combine(op, dt, mine, other))};")
    lines += ["    }", "    workgroupBarrier();", "  }"]
    result = "red_idx[0]" if is_arg else from_shared(f"{shared}[0]")
    lines += [f"  let acc{p} = {result};", "  workgroupBarrier();"]
    return lines


def _combine(op, dt, a, b) -> str:
    template = COMBINE.get(op) or COMBINE[(op, dt)]
    return template.format(a=a, b=b)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _strides(shape):
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return list(reversed(out))
