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

Where the caller finds every output an f32 row of whole vec4s and names the reads that are too (``quads``: reads of
element c of a row of the output's last axis, rows starting at multiples of 4 elements), a thread's copy is a quad of
4 neighbouring elements: those reads are one vec4 load each (their bindings declared as vec4s), the expression is
evaluated per element (any other read stays a scalar load at the element's own coordinates), and the 4 results are
one vec4 store. A copy then moves 16 bytes a load instead of 4 (``QUAD_COPIES``): more bytes in flight per thread.

``scattered_kernel`` runs the same way over a region of its outputs (the elements an update changes), each element
stored at an index that an expression computes, where another one says so. ``store_function`` is either kernel's
work on one store unit as a function of its own, which another kernel's threads call (an attention pass storing the
cache update it reads: ``meganeura.lowering.attention_writes``).
"""
from __future__ import annotations

from .sizes import ceil_div, is_size, product, size_max

from . import wgsl

WORKGROUP = 256
ELEMENTS_PER_THREAD = (8, 4, 2)  # candidates, largest first; H200, 256 MiB copy: 1 -> 0.87 ms, 4 -> 0.57, 8 -> 0.35
MIN_WORKGROUPS = 2048            # a thread takes several elements only while this many workgroups remain


def elements_per_thread(total: int) -> int:
    return next((n for n in ELEMENTS_PER_THREAD if total >= n * WORKGROUP * MIN_WORKGROUPS), 1)


def quad_layout(outputs, shape) -> bool:
    """Whether a kernel over ``shape`` with these ``outputs`` may take ``quads``: a concrete shape whose last axis
    is whole vec4s, every output f32 stored as f32."""
    return (len(shape) > 0 and not any(is_size(s) for s in shape) and shape[-1] % 4 == 0
            and all(dtype == "f32" and storage == "f32" for _, dtype, _, storage in outputs))


def pointwise_kernel(*, bindings, outputs, shape, limits, guarded: bool = False,
                     quads: dict | None = None) -> tuple[str, tuple]:
    """Return (WGSL, workgroups) computing, at every coordinate of ``shape``, each (name, dtype, expr, storage) of
    ``outputs`` into buffer ``name`` at the coordinate's linear index.

    ``bindings`` lists (slot, name, storage type) for every buffer the kernel uses (outputs included). Where an output
    is stored in half precision (``storage`` "bf16" or "f16"), each thread computes element pairs and stores each
    pair as one u32 word: two threads never write the same word. A ``guarded`` kernel (one that stores over its
    inputs) stores nothing once a check of an earlier kernel has failed: ``bindings`` then include the status buffer.
    ``quads`` (see the module docstring; ``quad_layout`` says where it may be given) maps each read node to read as
    vec4s to the vec4 index of the first element of its row: every read of those nodes' slots must be among them.
    """
    if quads is not None:
        return _quad_kernel(bindings, outputs, shape, limits, guarded, quads)
    total = product(shape)
    symbolic = is_size(total)  # a dynamic graph's: sizes read from its size buffer, the grid folded at replay
    lanes = 2 if any(storage in wgsl.HALF_STORAGE for *_, storage in outputs) else 1
    units = ceil_div(total, lanes)  # what a thread's copy stores: an element, or an element pair
    copies = elements_per_thread(units)
    groups = wgsl.grid(ceil_div(units, WORKGROUP * copies), limits["max-compute-workgroups-per-dimension"])
    groups_total = groups[0] * groups[1] * groups[2]
    declared, computed, stored = [], [], []
    for copy in range(copies):
        unit = f"first + {copy * WORKGROUP}u" if copy else "first"
        clamp = symbolic or copies * WORKGROUP * groups_total * lanes > total
        results = [[f"r{k}_{copy}" + (f"_{lane}" if lanes > 1 else "") for lane in range(lanes)]
                   for k in range(len(outputs))]
        declared += [f"  var {r}: {wgsl.STORAGE_TYPE[dtype]};"
                     for rs, (_, dtype, _, _) in zip(results, outputs) for r in rs]
        for lane in range(lanes):
            element = f"({unit}) * {lanes}u + {lane}u" if lanes > 1 else unit
            index = f"min({element}, {wgsl.size_u32(size_max(total - 1, 0))})" if clamp else element
            computed.append(_compute(outputs, [rs[lane] for rs in results], index, shape))
        stored += [_store(name, storage, rs, unit, lanes, total) for rs, (name, _, _, storage) in zip(results, outputs)]
    return _assembled(bindings, groups, copies, declared + computed, stored, guarded)


def _assembled(bindings, groups, copies: int, computed: list[str], stored: list[str], guarded: bool) -> tuple:
    """(WGSL source, workgroups) of a pointwise kernel whose body computes (``computed``) then stores (``stored``);
    where ``guarded``, the stores run only while the status word is clear."""
    if guarded:
        stored = [f"  if (atomicLoad(&{wgsl.STATUS_VAR}[0]) == 0u) {{", *stored, "  }"]
    body = "\n".join(computed + stored)
    source = f"""{wgsl.binding_decls(bindings)}
{wgsl.helpers_for(body)}
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let first = {wgsl.flat_workgroup(groups[0])} * {WORKGROUP * copies}u + lid;
{body}
}}
"""
    return source, groups


def _compute(outputs, results: list[str], index: str, shape) -> str:
    """A block that evaluates every output's expression at linear element ``index`` into ``results``."""
    coords = [f"c{d}" for d in range(len(shape))]
    em = wgsl.Emitter(coords, indent="    ")
    values = [wgsl.store(em.value(expr), dtype) for _, dtype, expr, _ in outputs]
    lines = (wgsl.unravel_lines("idx", coords, shape, indent="    ") + em.lines
             + [f"    {r} = {v};" for r, v in zip(results, values)])
    return f"  {{\n    let idx = i32({index});\n" + "\n".join(lines) + "\n  }"


def _store(name: str, storage: str, results: list[str], unit: str, lanes: int, total) -> str:
    """The guarded stores of one output's ``results`` for store unit ``unit`` (an element, or a pair of them)."""
    end, pairs = wgsl.size_u32(total), wgsl.size_u32(ceil_div(total, 2))
    if storage in wgsl.HALF_STORAGE:  # the pair as one word; an odd tail's upper half is the tensor's padding
        return f"  if ({unit} < {pairs}) {{ {name}[{unit}] = mg_pack_{storage}({results[0]}, {results[1]}); }}"
    if lanes == 1:
        return f"  if ({unit} < {end}) {{ {name}[{unit}] = {results[0]}; }}"
    return "\n".join(f"  if (({unit}) * 2u + {lane}u < {end}) {{ {name}[({unit}) * 2u + {lane}u] = {r}; }}"
                     for lane, r in enumerate(results))


def _quad_kernel(bindings, outputs, shape, limits, guarded: bool, quads: dict) -> tuple[str, tuple]:
    """``pointwise_kernel`` with a quad of 4 neighbouring elements per copy (the module docstring)."""
    if not quad_layout(outputs, shape):
        raise ValueError("pointwise_kernel: quads need a concrete shape of whole vec4 rows and f32 outputs, "
                         f"got {shape}")
    quad_slots = {node.args[0] for node in quads} | {_slot_of(name, bindings) for name, *_ in outputs}
    bindings = [(slot, name, "vec4<f32>" if slot in quad_slots else stype) for slot, name, stype in bindings]
    units = product(shape) // 4
    copies = elements_per_thread(units)
    groups = wgsl.grid(ceil_div(units, WORKGROUP * copies), limits["max-compute-workgroups-per-dimension"])
    clamp = copies * WORKGROUP * groups[0] * groups[1] * groups[2] > units
    declared, computed, stored = [], [], []
    for copy in range(copies):
        unit = f"first + {copy * WORKGROUP}u" if copy else "first"
        index = f"min({unit}, {units - 1}u)" if clamp else unit
        results = [[f"r{k}_{copy}_{lane}" for lane in range(4)] for k in range(len(outputs))]
        declared += [f"  var {r}: f32;" for rs in results for r in rs]
        computed.append(_compute_quad(outputs, results, index, shape, quads))
        stored += [f"  if ({unit} < {units}u) {{ {name}[{unit}] = vec4<f32>({', '.join(rs)}); }}"
                   for rs, (name, *_) in zip(results, outputs)]
    return _assembled(bindings, groups, copies, declared + computed, stored, guarded)


def _slot_of(name: str, bindings) -> int:
    return next(slot for slot, bound, _ in bindings if bound == name)


def _compute_quad(outputs, results: list[list[str]], unit: str, shape, quads: dict) -> str:
    """A block that evaluates every output's expression at the 4 elements of quad ``unit`` into ``results``: the
    quad's coordinates, its vec4 loads (``quads``), then each element's expression, its last coordinate stepped."""
    last = len(shape) - 1
    coords = [f"c{d}" for d in range(len(shape))]
    base = wgsl.Emitter(coords, indent="    ")
    loaded = {}
    for node, row in quads.items():
        start = base.value(row)
        loaded[node] = f"q{len(loaded)}"
        base.lines.append(f"    let {loaded[node]} = b{node.args[0]}[{start} + c{last} / 4i];")
    lines = wgsl.unravel_lines("idx", coords, shape, indent="    ") + base.lines
    for lane in range(4):
        em = wgsl.Emitter(coords[:-1] + [f"c{last}_{lane}"], indent="      ")
        for node, name in loaded.items():
            em.known(node, f"{name}[{lane}]")
        values = [em.value(expr) for _, _, expr, _ in outputs]
        lines += ["    {", f"      let c{last}_{lane} = c{last} + {lane}i;", *em.lines,
                  *(f"      {rs[lane]} = {v};" for rs, v in zip(results, values)), "    }"]
    return f"  {{\n    let idx = i32({unit}) * 4i;\n" + "\n".join(lines) + "\n  }"


def scattered_kernel(*, bindings, outputs, shape, index, keep, limits, guarded: bool = False) -> tuple[str, tuple]:
    """Return (WGSL, workgroups) computing, at every coordinate of ``shape`` (a region of the outputs), each (name,
    dtype, expr, storage) of ``outputs`` and storing it into buffer ``name`` at element ``index`` (an i32 expression
    over the region's coordinates) where ``keep`` (a bool expression) holds; the outputs' other elements are left
    as they are. ``guarded`` as in ``pointwise_kernel``. Where an output is stored in half precision, each thread
    computes a pair of neighbouring elements of the region and stores them as one u32 word at ``index / 2`` of the
    first, as the first's ``keep`` says: the caller makes sure each pair is a whole word (``index`` even at the
    first, the second element next to it, ``keep`` the same for both), so that no two threads store one word."""
    total = product(shape)
    lanes = 2 if any(storage in wgsl.HALF_STORAGE for *_, storage in outputs) else 1
    units = ceil_div(total, lanes)
    copies = elements_per_thread(units)
    groups = wgsl.grid(ceil_div(units, WORKGROUP * copies), limits["max-compute-workgroups-per-dimension"])
    clamp = is_size(total) or copies * WORKGROUP * groups[0] * groups[1] * groups[2] * lanes > total
    places = [("", "i32", index, ""), ("", "bool", keep, "")]
    declared, computed, stored = [], [], []
    for copy in range(copies):
        unit = f"first + {copy * WORKGROUP}u" if copy else "first"
        results = [[f"r{k}_{copy}_{lane}" for lane in range(lanes)] for k in range(len(outputs) + 2)]
        declared += [f"  var {r}: {wgsl.STORAGE_TYPE[dtype]};"
                     for rs, (_, dtype, _, _) in zip(results, outputs + places) for r in rs]
        for lane in range(lanes):
            element = f"({unit}) * {lanes}u + {lane}u" if lanes > 1 else unit
            at = f"min({element}, {wgsl.size_u32(size_max(total - 1, 0))})" if clamp else element
            computed.append(_compute(outputs + places, [rs[lane] for rs in results], at, shape))
        where, kept = results[-2:]
        stored += [_scattered_store(name, storage, rs, where, kept, unit, lanes, total)
                   for rs, (name, _, _, storage) in zip(results, outputs)]
    return _assembled(bindings, groups, copies, declared + computed, stored, guarded)


def _scattered_store(name: str, storage: str, results: list[str], where: list[str], kept: list[str], unit: str,
                     lanes: int, total) -> str:
    """The stores of one output's ``results`` for store unit ``unit`` of a region kernel, each lane's at its
    ``where`` if its ``kept``, a half precision pair as one word at the first lane's."""
    if storage in wgsl.HALF_STORAGE:
        pair = f"mg_pack_{storage}({results[0]}, {results[1]})"
        return (f"  if ({unit} < {wgsl.size_u32(ceil_div(total, 2))} && {kept[0]} != 0u) "
                f"{{ {name}[u32({where[0]}) / 2u] = {pair}; }}")
    end = wgsl.size_u32(total)
    element = [f"({unit}) * {lanes}u + {lane}u" if lanes > 1 else unit for lane in range(lanes)]
    return "\n".join(f"  if ({element[lane]} < {end} && {kept[lane]} != 0u) {{ {name}[u32({where[lane]})] = {r}; }}"
                     for lane, r in enumerate(results))


def store_function(name: str, *, outputs, shape, guarded: bool, index=None, keep=None) -> tuple[str, object]:
    """(WGSL of ``fn name(first: u32)``, store units): the work of a ``pointwise_kernel`` over ``shape`` (or, given
    ``index`` and ``keep``, of a ``scattered_kernel`` over that region) on store unit ``first`` (an element, or an
    element pair where an output is stored in half precision), for the caller's threads to call for every unit below
    the count; ``outputs`` and ``guarded`` as those kernels take them. The bindings are the caller's."""
    total = product(shape)
    lanes = 2 if any(storage in wgsl.HALF_STORAGE for *_, storage in outputs) else 1
    places = [] if index is None else [("", "i32", index, ""), ("", "bool", keep, "")]
    results = [[f"r{k}_{lane}" for lane in range(lanes)] for k in range(len(outputs) + len(places))]
    declared = [f"  var {r}: {wgsl.STORAGE_TYPE[dtype]};"
                for rs, (_, dtype, _, _) in zip(results, outputs + places) for r in rs]
    computed = []
    for lane in range(lanes):
        element = f"first * {lanes}u + {lane}u" if lanes > 1 else "first"
        at = f"min({element}, {wgsl.size_u32(size_max(total - 1, 0))})"
        computed.append(_compute(outputs + places, [rs[lane] for rs in results], at, shape))
    if index is None:
        stored = [_store(out, storage, rs, "first", lanes, total) for rs, (out, _, _, storage) in zip(results, outputs)]
    else:
        stored = [_scattered_store(out, storage, rs, results[-2], results[-1], "first", lanes, total)
                  for rs, (out, _, _, storage) in zip(results, outputs)]
    if guarded:
        stored = [f"  if (atomicLoad(&{wgsl.STATUS_VAR}[0]) == 0u) {{", *stored, "  }"]
    body = "\n".join(declared + computed + stored)
    return f"fn {name}(first: u32) {{\n{body}\n}}\n", ceil_div(total, lanes)
