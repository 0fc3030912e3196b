"""Reduction archetype: one workgroup per row runs a sequence of tree reductions over the row.

A row program has phases (sum, prod, max, min, argmax, argmin), each reducing an expression that may use
the results of earlier phases; then it writes per-row results (by thread 0) and per-element results
(strided over the row). Softmax, log-softmax, layer norm and variance are one dispatch each; plain
sum/mean/amax are the one-phase case. Threads stride over the row and combine in workgroup memory.
Rows of at most SERIAL_ROW_MAX elements (a pooling window, a few scatter candidates) are the exception: one
thread walks each row on its own, with no workgroup memory and no barriers.
Few long rows (a loss averaged over a whole tensor, BatchNorm's sums over batch and pixels per channel, a loss's
log-softmax over a vocabulary for a few tokens) would leave most of a GPU idle, so where the phases can be combined
from partial results (``reduce_splits``) each row is cut into slices: a first dispatch reduces every (row, slice)
into partial results in scratch, a second combines a row's partials and writes its results, one workgroup per
(row, slice) again when there are element results. Phases combine where they do not depend on each other, and a
softmax's sum of exp(y - m), m an earlier phase's maximum (``_rescaled``): each slice sums exp(y - m_s) over its own
maximum m_s, and the row's sum is that of each slice's sum times exp(m_s - m) (a slice whose maximum is -inf adds
nothing, unless the row's is -inf too: then the sum is NaN, as in one pass). An argmax or argmin slice keeps its best
value and that value's index, combined slice by slice in order (a greedy decode's argmax over a vocabulary of 128,256
took 197 us in one workgroup on an H100).
Where the device offers subgroup operations, sums combine each subgroup's values with ``subgroupAdd`` and then the
subgroups' sums through workgroup memory: two barriers instead of a tree's one per halving. Nothing assumes a
subgroup size; other reductions keep the tree (a subgroup maximum's NaN handling is not specified).
A ``sum2`` phase (variance and its mean, which eager accumulates in double) adds every value into a pair of floats
whose high part sums exactly (``mg_sum2``), by the tree, and is not split.
Where the reduced elements of a row are whole vec4s along its last axis, the caller may name reads along that axis
(``quads``): a phase that makes them walks its row a quad of 4 elements at a time, each such read one vec4 load
through a second binding of the same value typed as vec4s, QUAD_UNROLL quads loaded before they are combined (a row
of 4096 over 256 threads: all of a thread's 16 elements in 4 loads at once, against 2 rounds of 8).
Element results stored in half precision (two to a u32 word) are computed and stored by pairs of neighbouring
elements, where the rows end on the domain's last axis, of an even length (``pairs_fit``): each word from one thread.
"""
from __future__ import annotations

from . import wgsl
from .sizes import ceil_div, is_size, product, upper
from .wgsl import SPLIT_TARGET_WORKGROUPS, SUBGROUP_OPS

IDENTITY = {
    ("sum", "f32"): "0.0", ("sum", "i32"): "0i", ("prod", "f32"): "1.0", ("prod", "i32"): "1i",
    ("max", "f32"): "bitcast<f32>(0xff800000u)", ("max", "i32"): "i32(-2147483647 - 1)",
    ("min", "f32"): "bitcast<f32>(0x7f800000u)", ("min", "i32"): "2147483647i",
    ("argmax", "f32"): "bitcast<f32>(0xff800000u)", ("argmax", "i32"): "i32(-2147483647 - 1)",
    ("argmin", "f32"): "bitcast<f32>(0x7f800000u)", ("argmin", "i32"): "2147483647i",
    ("max", "bool"): "false", ("min", "bool"): "true", ("sum2", "f32"): "vec2<f32>(0.0)",
}
COMBINE = {
    "sum": "({a} + {b})", "prod": "({a} * {b})", "sum2": "mg_sum2({a}, {b})",
    ("max", "f32"): "mg_max({a}, {b})", ("min", "f32"): "mg_min({a}, {b})",
    ("max", "i32"): "max({a}, {b})", ("min", "i32"): "min({a}, {b})",
    ("max", "bool"): "({a} || {b})", ("min", "bool"): "({a} && {b})",
}
# (value, index) replaces (best, best_index) when it is better; ties keep the lower index, NaN wins like torch.
ARG_BETTER = {
    ("argmax", "f32"): ("(mg_isnan({v}) && (!mg_isnan({bv}) || {i} < {bi})) "
                        "|| (!mg_isnan({bv}) && ({v} > {bv} || ({v} == {bv} && {i} < {bi})))"),
    ("argmin", "f32"): ("(mg_isnan({v}) && (!mg_isnan({bv}) || {i} < {bi})) "
                        "|| (!mg_isnan({bv}) && ({v} < {bv} || ({v} == {bv} && {i} < {bi})))"),
    ("argmax", "i32"): "({v} > {bv} || ({v} == {bv} && {i} < {bi}))",
    ("argmin", "i32"): "({v} < {bv} || ({v} == {bv} && {i} < {bi}))",
}


SERIAL_ROW_MAX = 16
SERIAL_WORKGROUP = 64
SPLIT_MIN_SLICE = 2048          # ...while every slice keeps at least this many elements
SPLIT_MAX = 64
SPLIT_OPS = ("sum", "prod", "max", "min", "argmax", "argmin")
# An arg phase's slice keeps its best value and that value's index, the index as an f32 in the scratch: exact up to
# 2**24, so longer rows of an arg phase are not cut (a vocabulary of 128,256 is far below).
ARG_SPLIT_MAX_LENGTH = 1 << 24
UNROLL = 8  # a thread's elements that a phase loads before combining them; H200, rows of 4096: sum 0.51 -> 0.27 ms
QUAD_UNROLL = 4  # a thread's quads that a phase loads before combining them, where it reads quads
PAIRWISE_OPS = ("sum", "prod", "sum2")  # their unrolled values combine as a tree (``_pairwise``)
PARTIAL_GROUP = 8  # a row's partial results (split rows) are added in groups of this many, each group pairwise
RUNNING_TYPE = {**wgsl.VALUE_TYPE, "pair": "vec2<f32>"}  # a phase's running value, by kind (``_kind``)
SHARED_TYPE = {**RUNNING_TYPE, "bool": "u32"}  # the elements of its workgroup array


def workgroup_size(row_length, max_invocations: int) -> int:
    """Threads per row: a power of two from 32 up to 256, the least that covers the row (256 for a symbolic length,
    whatever its value)."""
    if is_size(row_length):
        return min(256, max_invocations)
    size = 32
    while size < row_length and size < 256:
        size *= 2
    return min(size, max_invocations)


def reduce_splits(domain, axes, phases, results) -> int:
    """How many slices each row of a row program is cut into (1: not cut): only float phases of SPLIT_OPS that
    read no earlier phase's result can be combined from partial results. Symbolic sizes (a dynamic graph's) count
    at their bounds, the most the plan serves: one kernel for every value."""
    rows = upper(product([domain[d] for d in range(len(domain)) if d not in axes]))
    length = product([domain[d] for d in axes])
    serial = not is_size(length) and length <= SERIAL_ROW_MAX  # (as reduce_kernel decides)
    length = upper(length)
    if (not phases or serial
            or any(op not in SPLIT_OPS or e.dtype != "f32" or (_reads_acc(e) and _rescaled(phases, p) is None)
                   or (op.startswith("arg") and length > ARG_SPLIT_MAX_LENGTH)
                   for p, (op, e) in enumerate(phases))):
        return 1
    splits = 1
    while rows * splits < SPLIT_TARGET_WORKGROUPS and length // (splits * 2) >= SPLIT_MIN_SLICE \
            and splits * 2 <= SPLIT_MAX:
        splits *= 2
    return splits


def partial_floats(domain, axes, phases, splits: int) -> int:
    """Floats of scratch for the partial results of ``splits`` slices: per slice and row, one per phase (two for an
    arg phase, ``_partial_slots``)."""
    return _partial_slots(phases)[-1] * splits * product([domain[d] for d in range(len(domain)) if d not in axes])


def _partial_slots(phases) -> list[int]:
    """Where each phase's partial results start in the scratch, in planes of PARTS x ROWS floats, then the planes in
    all: one plane per phase, two for an arg phase (its best value, then that value's index)."""
    slots = [0]
    for op, _ in phases:
        slots.append(slots[-1] + (2 if op.startswith("arg") else 1))
    return slots


def pairs_fit(domain, axes) -> bool:
    """Whether a row program's element results can be stored by pairs of neighbouring elements: the reduced axes end
    with the domain's last, of a concrete even length (so a pair never straddles two rows, and starts a word)."""
    return bool(axes) and axes[-1] == len(domain) - 1 and not is_size(domain[-1]) and domain[-1] % 2 == 0


def quad_rows(domain, axes) -> bool:
    """Whether a row program may read quads (``reduce_kernel``'s ``quads``): concrete reduced sizes, the last
    reduced axis whole vec4s, and rows long enough for a workgroup of threads. (Slices of a row cut into slices are
    then whole vec4s too: their length is rounded up to a multiple of 4, the last slice the shorter.)"""
    red = [domain[d] for d in axes]
    if not red or any(is_size(s) for s in red) or red[-1] % 4:
        return False
    return product(red) > SERIAL_ROW_MAX


def reduce_kernel(*, bindings, domain, axes, phases, results, limits, split: int = 1, partial: str | None = None,
                  quads: dict | None = None, guarded: bool = False) -> list[tuple[str, tuple]]:
    """(WGSL, workgroups) of each dispatch of a row program: one, or two where ``split`` (see ``reduce_splits``)
    cuts the rows into slices whose partial results go to the scratch array ``partial``.

    ``phases``: list of (op, expr); ``results``: list of (per_element, expr, out_name, out_dtype, storage kind).
    Where an element result is stored in half precision (two to a u32 word), a thread computes the element results
    of neighbouring pairs of elements and stores each pair at once (``_pair_results``): the reduced axes must end
    with the domain's last, of an even length (``pairs_fit``).
    Coordinates in expressions are domain dimensions; ``acc(i)`` is phase i's result for the row.
    ``quads`` (where ``quad_rows`` allows it) maps read nodes along the last reduced axis to (the name of a vec4
    binding of their value, among ``bindings``; the vec4 index of the row's first element): see the module docstring.
    ``guarded`` (row results stored over inputs): they are stored only while the status word (bound) is clear."""
    if quads and not quad_rows(domain, axes):
        raise ValueError(f"reduce_kernel: quads need reduced axes of whole vec4s, got {domain} over {axes}")
    outer_dims = [d for d in range(len(domain)) if d not in axes]
    row_shape = [domain[d] for d in outer_dims]
    red_shape = [domain[d] for d in axes]
    rows = product(row_shape)
    length = product(red_shape)
    serial = not is_size(length) and length <= SERIAL_ROW_MAX  # (a symbolic length takes the workgroup form)
    chunk = ceil_div(length, split)
    if quads:
        chunk = ceil_div(chunk, 4) * 4  # (slices of whole quads)
    pairs = any(per_element and storage in wgsl.HALF_STORAGE for per_element, *_, storage in results)
    if pairs:
        if not pairs_fit(domain, axes):
            raise ValueError(f"reduce_kernel: half precision element results need an even last axis reduced last, "
                             f"got {domain} over {axes}")
        chunk = ceil_div(chunk, 2) * 2  # (slices of whole pairs)
    wg = SERIAL_WORKGROUP if serial else workgroup_size(chunk, limits["max-compute-invocations-per-workgroup"])
    names = [f"o{d}" if d in outer_dims else f"r{d}" for d in range(len(domain))]
    acc_names = [f"acc{i}" for i in range(len(phases))]
    subgroups = bool(limits.get(SUBGROUP_OPS)) and not serial
    head = wgsl.unravel_lines("row", [names[d] for d in outer_dims], row_shape)
    span = (["  let lo = i32(slice) * CHUNK;", "  let hi = min(lo + CHUNK, LENGTH);"] if split > 1
            else ["  let lo = 0i;", "  let hi = LENGTH;"])
    quads = quads or {}
    if split == 1:
        body = head + span + _phases(phases, names, axes, red_shape, 1 if serial else wg, acc_names, subgroups,
                                     quads)
        body += _results(results, names, acc_names, domain, axes, red_shape, 1 if serial else wg, guarded)
        passes = [(body, rows, ceil_div(rows, wg) if serial else rows)]
    else:
        first = head + span + _phases(phases, names, axes, red_shape, wg, acc_names, subgroups, quads)
        first += ["  if (lid == 0u) {"] + _store_partials(phases, partial) + ["  }"]
        elem = any(r[0] for r in results)
        second = head + span + _combine_partials(phases, partial)
        second += _results(results, names, acc_names, domain, axes, red_shape, wg, guarded)
        passes = [(first, rows * split, rows * split), (second, rows * (split if elem else 1),
                                                        rows * (split if elem else 1))]
    out = []
    for i, (body, units, workgroups) in enumerate(passes):
        slices = split if i == 0 or units > rows else 1
        text = "\n".join(body)
        groups = wgsl.grid(workgroups, limits["max-compute-workgroups-per-dimension"])
        out.append((_source(bindings, text, phases, serial, wg, groups, units, slices, split, rows, length, chunk,
                            subgroups), groups))
    return out


def _source(bindings, text, phases, serial, wg, groups, units, slices, parts, rows, length, chunk,
            subgroups: bool) -> str:
    """The kernel around a body: ``row`` and ``slice`` (of ``slices`` per row) from the workgroup (or thread, when
    serial) index; ``parts`` is the number of partial results per row and phase."""
    shared_kinds = {_kind(op, e.dtype) for op, e in phases}
    shared = "\n".join(f"var<workgroup> red_{t}: array<{SHARED_TYPE[t]}, {wg}>;"
                        for t in sorted(shared_kinds)) if not serial else ""
    if any(op.startswith("arg") for op, _ in phases) and not serial:  # an i32 argmax keeps its values in red_i32
        shared += f"\nvar<workgroup> red_idx: array<i32, {wg}>;"
    unit = f"{wgsl.flat_workgroup(groups[0])} * {wg}u + lid" if serial else wgsl.flat_workgroup(groups[0])
    lanes = (", @builtin(subgroup_invocation_id) sg_lane: u32, @builtin(subgroup_id) sg_id: u32,"
             " @builtin(num_subgroups) sg_count: u32") if subgroups else ""
    sizes = (wgsl.size_constant("ROWS", rows, "u32") + wgsl.size_constant("LENGTH", length, "i32")
             + wgsl.size_constant("CHUNK", chunk, "i32"))
    return f"""{wgsl.binding_decls(bindings)}
{shared}
const SERIAL: bool = {"true" if serial else "false"};
const SPLITS: u32 = {slices}u;
const PARTS: u32 = {parts}u;
{sizes}
{wgsl.helpers_for(text)}
@compute @workgroup_size({wg})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32{lanes}) {{
  let unit = {unit};
  if (unit >= {wgsl.size_u32(units)}) {{ return; }}
  let row_u = unit / SPLITS;
  let slice = unit % SPLITS;
  let row = i32(row_u);
{text}
}}
"""


def _phases(phases, names, axes, red_shape, wg, acc_names, subgroups: bool, quads: dict) -> list[str]:
    lines = []
    for p, (op, expr) in enumerate(phases):
        lines += _phase(p, op, expr, names, axes, red_shape, wg, acc_names[:p], subgroups, quads)
    return lines


def _rescaled(phases, p) -> int | None:
    """The phase whose maximum m phase ``p`` sums exp(y - m) over (``p`` a sum of ``exp(sub(y, acc(i)))``, phase i a
    maximum, neither y nor phase i's value reading a phase's result), else None."""
    op, e = phases[p]
    if op != "sum" or e.op != "exp" or e.args[0].op != "sub" or e.args[0].args[1].op != "acc":
        return None
    i = e.args[0].args[1].args[0]
    if i >= p or phases[i][0] != "max" or _reads_acc(phases[i][1]) or _reads_acc(e.args[0].args[0]):
        return None
    return i


def _combine_partials(phases, partial) -> list[str]:
    """acc{p} of every phase from the row's partial results (every thread reads them all)."""
    lines, slots = [], _partial_slots(phases)
    for p, (op, expr) in enumerate(phases):
        a, s = f"a{p}", f"s{p}"
        part = lambda k, plane=slots[p]: f"{partial}[({plane}u * PARTS + {s} + {k}u) * ROWS + row_u]"  # noqa: E731
        if op.startswith("arg"):
            lines += _combine_arg_partials(p, op, part, f"{partial}[({slots[p] + 1}u * PARTS + {s}) * ROWS + row_u]")
            continue
        i = _rescaled(phases, p)
        if i is not None:  # each slice's sum of exp(y - its own maximum), rescaled to the row's maximum acc{i}
            peak, low = f"{partial}[({slots[i]}u * PARTS + {s}) * ROWS + row_u]", IDENTITY[("max", "f32")]
            lines += [f"  var {a}: f32 = 0.0;", f"  for (var {s} = 0u; {s} < PARTS; {s} = {s} + 1u) {{",
                      f"    let m{p} = {peak};",
                      f"    {a} = {a} + select({part(0)} * mg_exp(m{p} - acc{i}), 0.0, "
                      f"m{p} == {low} && acc{i} != {low});",
                      "  }", f"  let acc{p} = {a};"]
            continue
        group = _pairwise(op, "f32", [part(k) for k in range(PARTIAL_GROUP)]) if op in PAIRWISE_OPS else None
        lines += [f"  var {a}: f32 = {IDENTITY[(op, 'f32')]};", f"  var {s} = 0u;"]
        if group is not None:
            lines += [f"  for (; {s} + {PARTIAL_GROUP}u <= PARTS; {s} = {s} + {PARTIAL_GROUP}u) {{",
                      f"    {a} = {_combine(op, 'f32', a, group)};", "  }"]
        lines += [f"  for (; {s} < PARTS; {s} = {s} + 1u) {{", f"    {a} = {_combine(op, 'f32', a, part(0))};", "  }",
                  f"  let acc{p} = {a};"]
    return lines


def _store_partials(phases, partial) -> list[str]:
    """A slice's partial results into the scratch (by the slice's thread 0): each phase's, an arg phase's best value
    (``best{p}``) and then its index as an f32 (exact below ARG_SPLIT_MAX_LENGTH)."""
    lines, slots = [], _partial_slots(phases)
    for p, (op, _) in enumerate(phases):
        plane = lambda k: f"{partial}[({slots[p] + k}u * PARTS + slice) * ROWS + row_u]"  # noqa: E731
        if op.startswith("arg"):
            lines += [f"    {plane(0)} = best{p};", f"    {plane(1)} = f32(acc{p});"]
        else:
            lines.append(f"    {plane(0)} = acc{p};")
    return lines


def _combine_arg_partials(p, op, part, index) -> list[str]:
    """acc{p} of an arg phase from its slices' best values and indices, taken slice by slice in order with the same
    rule as its elements (``ARG_BETTER``): ties keep the lower index, NaN wins."""
    a, ai, s = f"a{p}", f"ai{p}", f"s{p}"
    better = ARG_BETTER[(op, "f32")].format(v=f"v{p}", i=f"i{p}", bv=a, bi=ai)
    return [f"  var {a}: f32 = {IDENTITY[(op, 'f32')]};", f"  var {ai}: i32 = 2147483647i;",
            f"  for (var {s} = 0u; {s} < PARTS; {s} = {s} + 1u) {{",
            f"    let v{p} = {part(0)};", f"    let i{p} = i32({index});",
            f"    if ({better}) {{ {a} = v{p}; {ai} = i{p}; }}", "  }", f"  let acc{p} = {ai};"]


def _results(results, names, acc_names, domain, axes, red_shape, wg, guarded: bool = False) -> list[str]:
    """Row results (one thread of the row's first unit; ``guarded``: stored only while the status word is clear)
    and element results (over the unit's span)."""
    lines = []
    row_results = [r for r in results if not r[0]]
    elem_results = [r for r in results if r[0]]
    if row_results:
        em = wgsl.Emitter(names, acc_names, indent="    ")
        stores = [f"    {name}[row] = {wgsl.store(em.value(e), dt)};" for _, e, name, dt, _ in row_results]
        if guarded:
            stores = [f"    if (atomicLoad(&{wgsl.STATUS_VAR}[0]) == 0u) {{", *(f"  {s}" for s in stores), "    }"]
        lines += ["  if ((lid == 0u || SERIAL) && slice == 0u) {"] + em.lines + stores + ["  }"]
    strides = _strides(domain)
    flat = " + ".join([f"{names[d]} * {wgsl.size_i32(strides[d])}" for d in range(len(domain))] or ["0i"])
    if any(storage in wgsl.HALF_STORAGE for *_, storage in elem_results):
        return lines + _pair_results(elem_results, names, acc_names, axes, red_shape, wg, flat)
    if elem_results:
        em = wgsl.Emitter(names, acc_names, indent="    ")
        stores = [f"    {name}[flat] = {wgsl.store(em.value(e), dt)};" for _, e, name, dt, _ in elem_results]
        first, step = ("lo", "1i") if wg == 1 else ("lo + i32(lid)", f"{wg}i")
        lines += [f"  for (var j: i32 = {first}; j < hi; j = j + {step}) {{"]
        lines += wgsl.unravel_lines("j", [names[d] for d in axes], red_shape, indent="    ")
        lines += [f"    let flat: i32 = {flat};"] + em.lines + stores + ["  }"]
    return lines


def _pair_results(elem_results, names, acc_names, axes, red_shape, wg, flat: str) -> list[str]:
    """Element results by pairs of neighbouring elements (``pairs_fit``): each thread takes pairs (jp, jp + 1) of
    its span, evaluates every result at both (each in a block of its own), then stores them: a half precision result
    as the one u32 word the pair shares (``mg_pack_<kind>``, rounded to nearest even), so no other thread writes
    that word; an f32 one element by element."""
    first, step = ("lo", "2i") if wg == 1 else ("lo + 2i * i32(lid)", f"{2 * wg}i")
    values = [[f"e{k}_{lane}" for lane in range(2)] for k in range(len(elem_results))]
    lines = [f"  for (var jp: i32 = {first}; jp < hi; jp = jp + {step}) {{", "    var flat_pair = 0i;"]
    lines += [f"    var {v}: {wgsl.VALUE_TYPE[dt]};" for (_, _, _, dt, _), vs in zip(elem_results, values) for v in vs]
    for lane in range(2):
        em = wgsl.Emitter(names, acc_names, indent="      ")
        lines += ["    {", f"      let j = jp + {lane}i;"]
        lines += wgsl.unravel_lines("j", [names[d] for d in axes], red_shape, indent="      ")
        computed = [em.value(e) for _, e, *_ in elem_results]
        lines += [f"      let flat: i32 = {flat};"] + em.lines
        lines += [f"      {vs[lane]} = {value};" for value, vs in zip(computed, values)]
        lines += (["      flat_pair = flat;"] if lane == 0 else []) + ["    }"]
    for (_, _, name, dt, storage), (lo, hi) in zip(elem_results, values):
        if storage in wgsl.HALF_STORAGE:
            lines.append(f"    {name}[flat_pair / 2i] = mg_pack_{storage}({lo}, {hi});")
        else:
            lines += [f"    {name}[flat_pair] = {wgsl.store(lo, dt)};",
                      f"    {name}[flat_pair + 1i] = {wgsl.store(hi, dt)};"]
    return lines + ["  }"]


def _reads_acc(e) -> bool:
    seen, stack = set(), [e]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.op == "acc":
            return True
        stack.extend(a for a in n.args if hasattr(a, "op"))
    return False


def _phase(p, op, expr, names, axes, red_shape, wg, acc_names, subgroups: bool = False,
           quads: dict | None = None) -> list[str]:
    """Lines computing acc{p}: a strided per-thread loop (over quads where the phase reads any of ``quads``), then a
    tree over workgroup memory, or for a sum with ``subgroups`` a subgroup sum and a pass over the subgroups' sums
    (``wg`` 1: one thread walks the whole row)."""
    dt = expr.dtype
    is_arg = op.startswith("arg")
    a, ai = f"a{p}", f"ai{p}"
    lines = [f"  var {a}: {RUNNING_TYPE[_kind(op, dt)]} = {IDENTITY[(op, dt)]};"]
    if is_arg:
        lines.append(f"  var {ai}: i32 = 2147483647i;")
    lines += _thread_loops(p, op, expr, names, axes, red_shape, wg, acc_names, quads or {})
    if wg == 1:  # one thread per row: the loop saw the whole row
        return lines + [f"  let acc{p} = {_total(op, ai if is_arg else a)};"]
    shared = f"red_{_kind(op, dt)}"
    if subgroups and op == "sum" and dt in ("f32", "i32"):  # every thread adds the subgroups' sums in one order
        return lines + [f"  let s{p} = subgroupAdd({a});", f"  if (sg_lane == 0u) {{ {shared}[sg_id] = s{p}; }}",
                        "  workgroupBarrier();", f"  var t{p}: {wgsl.VALUE_TYPE[dt]} = {IDENTITY[(op, dt)]};",
                        f"  for (var s = 0u; s < sg_count; s = s + 1u) {{ t{p} = t{p} + {shared}[s]; }}",
                        f"  let acc{p} = t{p};", "  workgroupBarrier();"]
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
    lines.append(f"  let acc{p} = {_total(op, result)};")
    if is_arg:  # the best value too, which a slice's partial results hold beside its index
        lines.append(f"  let best{p} = {from_shared(f'{shared}[0]')};")
    lines.append("  workgroupBarrier();")
    return lines


def _thread_loops(p, op, expr, names, axes, red_shape, wg, acc_names, quads: dict) -> list[str]:
    """The thread's walk over its elements of the row into a{p} (and ai{p}, an arg phase's index): by quads where
    the phase reads any of ``quads``, else ``UNROLL`` elements at a time and then one by one."""
    dt, a, ai = expr.dtype, f"a{p}", f"ai{p}"
    is_arg = op.startswith("arg")
    nodes = _nodes(expr)
    read = {n: quads[n] for n in quads if n in nodes} if wg > 1 and not is_arg else {}
    if read:
        return _quad_loops(p, op, expr, names, axes, red_shape, wg, acc_names, read)
    start = "lo" if wg == 1 else "lo + i32(lid)"
    lines = []
    if not is_arg:
        lines += [f"  var j{p}: i32 = {start};"] + _unrolled_loop(p, op, expr, names, axes, red_shape, wg, acc_names)
        start = f"j{p}"
    em = wgsl.Emitter(names, acc_names, indent="    ")
    value = em.value(expr)
    lines += [f"  for (var j: i32 = {start}; j < hi; j = j + {wg}i) {{"]
    lines += wgsl.unravel_lines("j", [names[d] for d in axes], red_shape, indent="    ")
    lines += em.lines
    if is_arg:
        better = ARG_BETTER[(op, dt)].format(v=value, i="j", bv=a, bi=ai)
        lines += [f"    if ({better}) {{ {a} = {value}; {ai} = j; }}"]
    else:
        lines += [f"    {a} = {_combine(op, dt, a, _lift(op, value))};"]
    return lines + ["  }"]


def _quad_loops(p, op, expr, names, axes, red_shape, wg, acc_names, quads: dict) -> list[str]:
    """The thread's walk over its quads of the row (``lo`` and ``hi`` are multiples of 4): ``QUAD_UNROLL`` quads at a
    time while all are in the row, then one at a time. The values of the quads taken together are computed first
    (their loads in flight together), then combined, pairwise for float sums and products."""
    jq = f"jq{p}"
    lines = [f"  var {jq}: i32 = lo / 4i + i32(lid);", f"  let hq{p}: i32 = hi / 4i;"]
    for count, condition, step in ((QUAD_UNROLL, f"{jq} + {(QUAD_UNROLL - 1) * wg}i < hq{p}", QUAD_UNROLL * wg),
                                   (1, f"{jq} < hq{p}", wg)):
        lines.append(f"  for (; {condition}; {jq} = {jq} + {step}i) {{")
        values = []
        for u in range(count):
            quad_values, quad_lines = _quad_values(f"{p}_{u}", f"{jq} + {u * wg}i" if u else jq, expr, names, axes,
                                                   red_shape, acc_names, quads)
            values += quad_values
            lines += quad_lines
        lines += _combined(op, expr.dtype, f"a{p}", values)
        lines.append("  }")
    return lines


def _quad_values(tag: str, quad: str, expr, names, axes, red_shape, acc_names, quads: dict):
    """(names, lines): the values of ``expr`` at the 4 elements of quad ``quad`` of the row, into v{tag}_{lane}: the
    quad's coordinates, a vec4 load per read of ``quads``, then each element's value, the last reduced coordinate
    stepped."""
    dt, last = expr.dtype, names[axes[-1]]
    values = [f"v{tag}_{lane}" for lane in range(4)]
    lines = [f"    var {v}: {wgsl.VALUE_TYPE[dt]};" for v in values] + ["    {", f"      let j: i32 = ({quad}) * 4i;"]
    lines += wgsl.unravel_lines("j", [names[d] for d in axes], red_shape, indent="      ")
    base = wgsl.Emitter(names, acc_names, indent="      ")
    loaded = {}
    for node, (binding, row) in quads.items():
        start = base.value(row)
        loaded[node] = f"q{tag}_{len(loaded)}"
        base.lines.append(f"      let {loaded[node]} = {binding}[{start} + {last} / 4i];")
    lines += base.lines
    for lane, v in enumerate(values):
        em = wgsl.Emitter([f"{n}_{lane}" if n == last else n for n in names], acc_names, indent="        ")
        for node, name in loaded.items():
            em.known(node, f"{name}[{lane}]")
        value = em.value(expr)
        lines += ["      {", f"        let {last}_{lane} = {last} + {lane}i;", *em.lines, f"        {v} = {value};",
                  "      }"]
    return values, lines + ["    }"]


def _combined(op, dt, a: str, values: list[str]) -> list[str]:
    """Lines adding ``values`` into running value ``a``: pairwise for float sums and products, else one by one."""
    if op in PAIRWISE_OPS and dt == "f32":
        return [f"    {a} = {_combine(op, dt, a, _pairwise(op, dt, [_lift(op, v) for v in values]))};"]
    return [f"    {a} = {_combine(op, dt, a, _lift(op, v))};" for v in values]


def _nodes(e) -> set:
    """The distinct nodes of expression ``e``."""
    seen, stack = set(), [e]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(a for a in n.args if hasattr(a, "op"))
    return seen


def _unrolled_loop(p, op, expr, names, axes, red_shape, wg, acc_names) -> list[str]:
    """A loop over ``UNROLL`` of the thread's elements at a time, while all of them are in the row: their values
    are computed first (independent loads, in flight together), then combined into the thread's value, pairwise
    for float sums and products (``_pairwise``). It leaves ``j{p}`` at the first element the plain loop still has
    to take."""
    dt, a = expr.dtype, f"a{p}"
    values = [f"v{p}_{u}" for u in range(UNROLL)]
    lines = [f"  for (; j{p} + {(UNROLL - 1) * wg}i < hi; j{p} = j{p} + {UNROLL * wg}i) {{"]
    lines += [f"    var {v}: {wgsl.VALUE_TYPE[dt]};" for v in values]
    for u, v in enumerate(values):
        em = wgsl.Emitter(names, acc_names, indent="      ")
        value = em.value(expr)
        lines += ["    {", f"      let j: i32 = j{p} + {u * wg}i;"]
        lines += wgsl.unravel_lines("j", [names[d] for d in axes], red_shape, indent="      ")
        lines += em.lines + [f"      {v} = {value};", "    }"]
    return lines + _combined(op, dt, a, values) + ["  }"]


def _pairwise(op, dt, values: list[str]) -> str:
    """``values`` combined as a balanced tree: a float sum's rounding error grows with the depth of its additions,
    so a thread's running sum takes one addition per UNROLL elements instead of UNROLL (a sum of 1e6 elements was
    3x eager's relative error from float64, a variance 5x)."""
    while len(values) > 1:
        pairs = [_combine(op, dt, values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = pairs + ([values[-1]] if len(values) % 2 else [])
    return values[0]


def _kind(op, dt) -> str:
    """The kind of a phase's running value: its dtype, or "pair" (a ``sum2``'s high and low parts)."""
    return "pair" if op == "sum2" else dt


def _lift(op, value: str) -> str:
    """An element's value as the phase's running value takes it."""
    return f"vec2<f32>({value}, 0.0)" if op == "sum2" else value


def _total(op, running: str) -> str:
    """A phase's result from its running value."""
    return f"mg_sum2_total({running})" if op == "sum2" else running


def _combine(op, dt, a, b) -> str:
    template = COMBINE.get(op) or COMBINE[(op, dt)]
    return template.format(a=a, b=b)


def _strides(shape):
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return list(reversed(out))
