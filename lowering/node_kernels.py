"""The kernels of one scheduled node, by archetype: pointwise, reduction, matmul (tiled, or the gemv) and attention,
each a WGSL source with its workgroups and bindings, from the node's ``Slots`` (``schedule._bindings``); and where
their operands are read in groups (``_quad_rows``: vec4 of f32, vec2<u32> or vec4<u32> of halves); and an update
over its region (``Scatter``)."""
from __future__ import annotations

from typing import Callable, NamedTuple

from meganeura.kernels import attention as attention_kernels
from meganeura.kernels import matmul as matmul_kernels
from meganeura.kernels import matmul_plans
from meganeura.kernels.matmul_gemv import gemv_stage_fits
from meganeura.kernels.matmul_split_sum import split_reduce_kernel
from meganeura.kernels import pointwise as pointwise_kernels
from meganeura.kernels.prelude import (ATTENTION_ARGS, GemvWide, attention_prelude, matmul_prelude, wide_binding_type,
                                       wide_unit)
from meganeura.kernels import reduce as reduce_kernels
from meganeura.kernels import wgsl
from meganeura.runtime.dtypes import HALF_STORAGE
from meganeura.kernels.sizes import concrete, is_size

from . import expr as E
from .indexing import linear_index, quad_row_index, simplify, unit_stride_coord
from .ir import Attention, Matmul, Pointwise, Reduce, Scatter

# Sibling matmuls of this many blocks or more fetch their blocked operand in a loop (matmul_kernel's ``looped``). H200:
# SmolVLA's 16 cross-attention projections of one context, merged, took the driver 1.0-1.4 s to compile with the
# fetch written out (0.15 s with one tensor in place of the chain); with the loop no kernel of SmolVLA took more than
# 0.5 s in a cold first call, and its GPU time per call stayed within 2 %.
LOOPED_FETCH_BLOCKS = 4

# Storage kinds that matmul and attention operands read in groups (``_quad_rows``): f32, and the halves, widened in
# registers from a vec2<u32> (4) or vec4<u32> (8) load rather than one 32-bit load and select per element.
WIDE_KINDS = ("f32", *HALF_STORAGE)
# Elements of a group that the gemv reads of a matrix at once (one vec4<u32> of halves, two vec4<f32> of f32), and
# the matrices it reads so: a decode step's weights. H100, SmolLM2's f32 portable decode, median step 1.94 -> 1.91 ms
# (QKV's 1x960x576 318 -> 270 us a token); 2 outputs per staged workgroup in place of 8 gained 1.91 -> 1.86 there
# but lost 1.60 -> 1.85 ms on Llama-3.2-1B in bf16, so ``matmul_gemv.STAGED_MIN_COLUMNS`` stays.
GEMV_WIDTH = 8
GEMV_WIDE_KINDS = WIDE_KINDS


class Slots(NamedTuple):
    """A node's bindings, as ``_bindings`` lays them out."""
    bound: list  # value ids (or "status", or the arena key of partial results) in slot order
    decl: list  # (slot, WGSL name, element type) of each slot
    storage: list  # how each slot's value is stored (a key of wgsl.STORAGE_TYPE; "" for status and partial sums)
    exprs: list  # the node's expressions, with loads read from slots
    out_slots: list  # the slot of each output value
    name: Callable[[int], str]  # slot -> WGSL name
    guarded: bool = False  # the node stores over an input in a plan that checks data: it stores only if no check failed
    functions: str = ""  # WGSL functions that the expressions call (``slice_merges``: a vector merged from slices)


def looped_operand(node: Matmul) -> str:
    """The operand a tiled kernel fetches in a loop: the one that picks among ``LOOPED_FETCH_BLOCKS`` or more sibling
    tensors (its loader, a chain of one branch per tensor, is then written once, not once per staging register)."""
    if len(node.sizes) < LOOPED_FETCH_BLOCKS:
        return ""
    return "a" if node.block_axis == "i" else "b"


def fast_axes(exprs: list[E.Expr]) -> tuple[str, str]:
    """(a_fast, b_fast) of a matmul's linearised operand expressions: the axis along which each one's reads step by
    one element."""
    a_fast = "i" if unit_stride_coord(exprs[0], (2, 1)) == 1 else "p"
    b_fast = "p" if unit_stride_coord(exprs[1], (2, 1)) == 1 else "j"
    return a_fast, b_fast


def attention_shape(node: Attention) -> attention_kernels.AttentionShape:
    """The pass's shape: its batch and lengths may be symbolic; the head counts and sizes are concrete."""
    dynamic = ("batch", "lq", "lk")
    sizes = [getattr(node, f) if f in dynamic else concrete(getattr(node, f))
             for f in ("batch", "heads", "kv_heads", "lq", "lk", "d", "dv")]
    return attention_kernels.AttentionShape(*sizes, node.scale, node.causal, node.bias is not None)


def _pointwise_kernels(node: Pointwise, slots: Slots, limits: dict, scratch, variant) -> list[tuple]:
    outputs = [(slots.name(s), v.compute_dtype, e, slots.storage[s])
               for s, v, e in zip(slots.out_slots, node.outs, slots.exprs)]
    src, groups = pointwise_kernels.pointwise_kernel(bindings=slots.decl, outputs=outputs, shape=node.out.shape,
                                                     limits=limits, guarded=slots.guarded,
                                                     quads=_pointwise_quads(node, slots, outputs, limits))
    return [(src, groups, slots.bound)]


def _pointwise_quads(node: Pointwise, slots: Slots, outputs: list, limits: dict) -> dict | None:
    """The reads of a pointwise node to load as vec4s (``pointwise_kernel``'s ``quads``), or None where its kernel
    keeps one element per copy: outputs that are no f32 rows of whole vec4s, bindings whose offsets may fall between
    16-byte boundaries, or an output slot read in a way that is not whole vec4s. A slot read anywhere at an index
    that is not the quad's (a broadcast, a gather, a transposed view) keeps its scalar reads."""
    shape = node.out.shape
    if (limits.get("min-storage-buffer-offset-alignment", 256) % 16
            or not pointwise_kernels.quad_layout(outputs, shape)):
        return None
    last = len(shape) - 1
    reads: dict[int, dict] = {}
    for e in slots.exprs:
        for n in E.walk(e):
            if n.op == "read":
                quad = _quad_rows(n, slots.decl, shape[-1], last)
                reads.setdefault(n.args[0], {})[n] = None if quad is None else quad[1]
    if any(None in found.values() for slot, found in reads.items() if slot in slots.out_slots):
        return None
    return {n: row for found in reads.values() if None not in found.values() for n, row in found.items()}


def _scatter_kernels(node: Scatter, slots: Slots, limits: dict, scratch, variant) -> list[tuple]:
    """The kernel of an update over its region (``regions``): the region's values stored at their linear index in
    the outputs."""
    region = node.region
    at, keep, values = slots.exprs[:len(region.at)], slots.exprs[len(region.at)], slots.exprs[len(region.at) + 1:]
    index = simplify(linear_index(at, node.out.shape), dict(enumerate(region.shape)))
    outputs = [(slots.name(s), v.compute_dtype, e, slots.storage[s])
               for s, v, e in zip(slots.out_slots, node.outs, values)]
    src, groups = pointwise_kernels.scattered_kernel(bindings=slots.decl, outputs=outputs, shape=region.shape,
                                                     index=index, keep=keep, limits=limits, guarded=slots.guarded)
    return [(src, groups, slots.bound)]


def _reduce_kernels(node: Reduce, slots: Slots, limits: dict, scratch, variant) -> list[tuple]:
    n_phases = len(node.phases)
    phases = [(op, e) for (op, _), e in zip(node.phases, slots.exprs[:n_phases])]
    results = [(r.per_element, e, slots.name(s), v.compute_dtype, slots.storage[s])
               for r, e, s, v in zip(node.results, slots.exprs[n_phases:], slots.out_slots, node.outs)]
    split, partial = (scratch[0], slots.name(slots.bound.index(scratch[1]))) if scratch is not None else (1, None)
    decl, bound = list(slots.decl), list(slots.bound)
    quads = _reduce_quads(node, phases, slots.out_slots, decl, bound, limits)
    return [(src, groups, bound) for src, groups in reduce_kernels.reduce_kernel(
        bindings=decl, domain=node.domain, axes=node.axes, phases=phases, results=results, limits=limits,
        split=split, partial=partial, quads=quads, guarded=slots.guarded)]


def _reduce_quads(node: Reduce, phases: list, out_slots: list, decl: list, bound: list, limits: dict) -> dict:
    """The reads of a row program's phases to load as vec4s (``reduce_kernel``'s ``quads``): f32 reads along the
    last reduced axis of rows that start at multiples of 4 elements, each through a vec4 binding of its value
    appended to ``decl`` and ``bound``, while the bindings stay within the adapter's limit (values read at other
    indices too keep their plain binding for those). Not a value the kernel stores over (an input read through an
    output's binding): no second binding overlaps one the kernel writes. None where the kernel may not read quads
    (``reduce_kernels.quad_rows``) or a binding offset may fall between 16-byte boundaries, and none for a program of
    several phases (a norm's, a softmax's): read by quads, they added up 3x eager's error from float64 in the bias
    gradients of a VAE trained 8 steps (test_trajectory's autoencoder_kl with SGD)."""
    if len(phases) > 1:
        return {}
    if (limits.get("min-storage-buffer-offset-alignment", 256) % 16
            or not reduce_kernels.quad_rows(node.domain, node.axes)):
        return {}
    last, size = node.axes[-1], node.domain[node.axes[-1]]
    found: dict[int, dict] = {}
    for _, e in phases:
        for n in E.walk(e):
            quad = _quad_rows(n, decl, size, last) if n.op == "read" else None
            if quad is not None and quad[0] not in out_slots:
                found.setdefault(quad[0], {})[n] = quad[1]
    room = limits.get("max-storage-buffers-per-shader-stage", 8) - len(bound)
    quads = {}
    for slot in list(found)[:max(room, 0)]:
        name = f"b{slot}_4"
        decl.append((len(bound), name, "vec4<f32>"))
        bound.append(bound[slot])
        quads.update({n: (name, row) for n, row in found[slot].items()})
    return quads


def _matmul_kernels(node: Matmul, slots: Slots, limits: dict, scratch,
                    variant: matmul_plans.MatmulChoice) -> list[tuple]:
    """The matmul pass; cut into slices of K, the slices' pass and the pass summing them. A half precision output is
    stored by pairs of columns (``stores_pairs``)."""
    a_fast, b_fast = fast_axes(slots.exprs)
    pairs = stores_pairs(slots)
    decl, bound = list(slots.decl), list(slots.bound)
    tiled = matmul_plans.is_tiled(node.rows, node.columns)
    quads = matmul_quads(node, slots, decl, bound, limits) if variant.quads and tiled else []
    wide = None if tiled else _gemv_wide(node, slots, decl, bound, limits)
    prelude = matmul_prelude_of(node, slots, decl, quads, wide) + slots.functions
    dims = dict(batch=node.batch, m=node.rows, n=node.columns)  # (symbolic sizes too: the generators take them)
    shape = dict(k=node.k, limits=limits, a_fast=a_fast, b_fast=b_fast, tile=variant.tile, block=variant.block,
                 f16=variant.f16, looped=looped_operand(node), double=variant.double, quads=variant.quads,
                 patches=variant.patches, chunk=variant.chunk, unpadded=variant.unpadded,
                 vector_loads="".join(quad[0] for quad in quads),
                 products=len(node.products), row_phases=len(node.row_phases),
                 gemv_width=wide.width if wide is not None else 0, pairs=pairs,
                 staged=stages_row(node, slots, limits, tiled or scratch is not None))
    if scratch is None:
        return [(*matmul_kernels.matmul_kernel(prelude, **dims, **shape), bound)]
    split, partial = scratch[0], slots.name(slots.bound.index(scratch[1]))
    return [(*matmul_kernels.matmul_kernel(prelude, **dims, **shape, split=split, partial=partial), bound),
            (*split_reduce_kernel(prelude, **dims, split=split, partial=partial, limits=limits, pairs=pairs), bound)]


def stages_row(node: Matmul, slots: Slots, limits: dict, tiled_or_split: bool) -> bool:
    """Whether a gemv over columns computes its vector once per workgroup into workgroup memory (``matmul_kernel``'s
    ``staged``): a row merged from slices (``slots.functions``), or, where the row fits (``gemv_stage_fits``), any
    vector that is more than a plain read, such as a normalised row (a row prologue) or a pointwise chain, which each
    output's lanes would otherwise compute again. H100, Llama-3.2-1B's bf16 decode: the head over 128,256 outputs
    normalised and rounded each of its 2,048 elements once per output (452 us for 525 MB, where the f32 head moved
    1.05 GB in 338 us)."""
    if slots.functions:
        return True
    return (not tiled_or_split and node.rows == 1 and not _plain_read(slots.exprs[0])
            and gemv_stage_fits(node.k, len(node.products), limits))


def _plain_read(e: E.Expr) -> bool:
    """Whether ``e`` reads one stored element, widened or cast at most."""
    while e.op == "cast":
        e = e.args[0]
    return e.op == "read"


def stores_pairs(slots: Slots) -> bool:
    """Whether a matmul kernel stores its outputs by pairs of columns (``kernels.matmul``'s ``pairs``): where one of
    them is stored in half precision, two to a u32 word (``schedule.pair_refusal`` says where it may be)."""
    return any(slots.storage[s] in HALF_STORAGE for s in slots.out_slots)


def matmul_quads(node: Matmul, slots: Slots, decl: list, bound: list, limits: dict) -> list[tuple]:
    """The operands of a tiled matmul to read as vec4s along their unit-stride axis (``matmul_prelude``'s
    ``quads``): plain reads of f32 or halves in rows of whole groups of 4 (``_quad_rows``) of one block each, not
    fetched in a loop, not a value the kernel stores over, each through a binding of its value in groups of 4 (vec4s
    of f32, vec2<u32>s of halves) appended to ``decl`` and ``bound`` while the bindings stay within the adapter's
    limit. None where a binding offset may fall between 16-byte boundaries."""
    if limits.get("min-storage-buffer-offset-alignment", 256) % 16:
        return []
    a_fast, b_fast = fast_axes(slots.exprs)
    blocked = "a" if node.block_axis == "i" else "b"
    operands = (("a", slots.exprs[0], (2, "i", node.k) if a_fast == "p" else (1, "p", node.rows)),
                ("b", slots.exprs[1], (1, "j", node.k) if b_fast == "p" else (2, "p", node.columns)))
    aliases, quads = {}, []
    room = limits.get("max-storage-buffers-per-shader-stage", 8)
    for operand, e, (coord, other, size) in operands:
        if is_size(size) or (operand == blocked and len(node.sizes) > 1) or looped_operand(node) == operand:
            continue
        found = _quad_rows(e, slots.decl, size, coord, kinds=WIDE_KINDS)
        if found is None or found[0] in slots.out_slots or (found[0] not in aliases and len(bound) >= room):
            continue
        slot, row, kind = found
        if slot not in aliases:  # one vec4 binding per value, however many operands read it
            aliases[slot] = f"b{slot}_4"
            decl.append((len(bound), aliases[slot], wide_binding_type(kind, 4)))
            bound.append(bound[slot])
        quads.append((operand, other, aliases[slot], row, kind))
    return quads


def _gemv_wide(node: Matmul, slots: Slots, decl: list, bound: list, limits: dict) -> GemvWide | None:
    """The wide loaders of a gemv over columns (``GemvWide``): where every matrix operand (B's blocks and the further
    products') is a plain read of a half precision value (``GEMV_WIDE_KINDS``) along K in rows of whole groups of
    ``GEMV_WIDTH`` elements that start at multiples of it (``_quad_rows``), read by nothing else in the kernel, each
    such binding in ``decl`` is retyped to groups (``wide_binding_type``; its scalar loader is left out); the vector,
    a plain read of f32 or halves in such rows, is read through a binding of groups appended to ``decl`` and
    ``bound`` while the adapter's limit leaves one, else by elements. None (the scalar gemv) for anything else: a
    symbolic or misaligned K, a row offset that is not a multiple of the group, a gathered or fused matrix."""
    if (node.rows != 1 or is_size(node.k) or fast_axes(slots.exprs)[1] != "p"
            or limits.get("min-storage-buffer-offset-alignment", 256) % 16):
        return None
    exprs, end = slots.exprs, 3 + 2 * len(node.more_blocks)
    starts = [sum(node.sizes[:k]) for k in range(len(node.sizes))]
    b_blocks = list(zip(starts, [exprs[1], *exprs[3:end:2]])) if node.block_axis == "j" else [(0, exprs[1])]
    matrices = [b_blocks] + [[(0, e)] for e in exprs[end:end + len(node.products)]]
    found = [[(start, _quad_rows(e, slots.decl, node.k, 1, GEMV_WIDTH, GEMV_WIDE_KINDS)) for start, e in blocks]
             for blocks in matrices]
    if any(q is None for blocks in found for _, q in blocks):
        return None
    wide_slots = {q[0] for blocks in found for _, q in blocks}
    matrix_exprs = {id(e) for blocks in matrices for _, e in blocks}
    others = [n for e in exprs if id(e) not in matrix_exprs for n in E.walk(e) if n.op == "read"]
    if wide_slots & ({n.args[0] for n in others} | set(slots.out_slots)):
        return None
    for slot in wide_slots:
        decl[slot] = (slot, decl[slot][1], wide_binding_type(slots.storage[slot], GEMV_WIDTH))
    vector = _quad_rows(exprs[0], slots.decl, node.k, 2, GEMV_WIDTH, WIDE_KINDS)
    if (vector is not None and vector[0] not in wide_slots | set(slots.out_slots)
            and len(bound) < limits.get("max-storage-buffers-per-shader-stage", 8)):
        slot, row, kind = vector
        decl.append((len(bound), f"b{slot}_{GEMV_WIDTH}", wide_binding_type(kind, GEMV_WIDTH)))
        bound.append(bound[slot])
        vector = (decl[-1][1], row, kind)
    else:
        vector = None
    return GemvWide(GEMV_WIDTH, [[(start, slots.name(q[0]), q[1], q[2]) for start, q in blocks] for blocks in found],
                    vector)


def _attention_kernels(node: Attention, slots: Slots, limits: dict, scratch, variant) -> list[tuple]:
    """The attention pass (and the merge of its slices); where it runs an update's stores (``Attention.writes``),
    its first dispatch's threads run them too (``with_side_stores``)."""
    partial = slots.name(slots.bound.index(scratch[1])) if scratch is not None else None
    # (a vec4 binding needs its offset, a binding offset, on a 16-byte boundary)
    vec4_bindings = limits.get("min-storage-buffer-offset-alignment", 256) % 16 == 0
    functions, units = _update_stores(node, slots)
    prelude = _attention_prelude(node, slots,
                                 limits.get("max-storage-buffers-per-shader-stage", 8) if vec4_bindings else 0,
                                 functions)
    outs = [UNBOUND if s is None else slots.name(s) for s in slots.out_slots[:len(node.own_outs)]]
    passes = [[src, groups, slots.bound] for src, groups in attention_kernels.attention_kernel(
        prelude, node.kind, attention_shape(node), outs, limits, partial)]
    if node.writes is not None:
        passes[0][0] = attention_kernels.with_side_stores(passes[0][0], UPDATE_STORES, wgsl.size_u32(units))
    return [tuple(p) for p in passes]


# The name an attention pass is given for an output it has no binding of: the slices' pass whose reader merges them
# (``lowering.slice_merges``) stores only partial results; a kernel that wrote it would not compile.
UNBOUND = "mg_unbound"
UPDATE_STORES = "mg_update_store"  # the WGSL function of an attention pass's update's stores (``_update_stores``)


def _update_stores(node: Attention, slots: Slots) -> tuple[str, object]:
    """(WGSL of the function that stores one unit of ``node``'s update, ``UPDATE_STORES``, and the count of units)
    of a pass that runs an update's stores (``Attention.writes``: ``pointwise.store_function`` as the update's own
    kernel would store, over its region for a ``Scatter``), or ("", 0)."""
    writes = node.writes
    if writes is None:
        return "", 0
    exprs = slots.exprs[len(node.operands()):]
    out_slots = slots.out_slots[len(node.own_outs):]
    if isinstance(writes, Scatter):
        region = writes.region
        n = len(region.at)
        at, keep, values = exprs[:n], exprs[n], exprs[n + 1:]
        index = simplify(linear_index(at, writes.out.shape), dict(enumerate(region.shape)))
        extra, shape = dict(index=index, keep=keep), region.shape
    else:
        values, extra, shape = exprs, {}, writes.out.shape
    outputs = [(slots.name(s), v.compute_dtype, e, slots.storage[s]) for s, v, e in zip(out_slots, writes.outs, values)]
    return pointwise_kernels.store_function(UPDATE_STORES, outputs=outputs, shape=shape, guarded=slots.guarded, **extra)


# The kernel generator of each IR node type: (node, its Slots, limits, scratch, matmul variant) -> the passes.
KERNELS = {Pointwise: _pointwise_kernels, Reduce: _reduce_kernels, Matmul: _matmul_kernels,
           Attention: _attention_kernels, Scatter: _scatter_kernels}


def _attention_prelude(node: Attention, slots: Slots, max_bindings: int, functions: str = "") -> str:
    """``kernels.prelude.attention_prelude`` of ``node``: each operand expression read as f32, with the vec4 row
    reads of head-size operands (f32 or halves) where ``_quad_rows`` finds them (their bindings appended to the
    slots); ``functions``: further WGSL functions of the kernel (an update's stores: ``_update_stores``). An operand
    that reads a row from an update's expression or else plainly (``_row_branch``) branches between the two."""
    loads = []
    for operand, e in zip(node.operands(), slots.exprs):
        size = node.dv if operand in ("v", "dout") else node.d
        quads = _quad_rows(e, slots.decl, size, kinds=WIDE_KINDS) if ATTENTION_ARGS[operand][-1] == "c" else None
        branch = _row_branch(e, slots.decl, size) if quads is None and ATTENTION_ARGS[operand][-1] == "c" else None
        loads.append((operand, E.cast(e, E.F32), quads if branch is None else branch[0], branch))
    return attention_prelude(slots.decl, slots.bound, loads, max_bindings, functions)


def _row_branch(e: E.Expr, decl, size: int) -> tuple[tuple, int] | None:
    """(``_quad_rows`` of the plain read, its index in ``e.args``) where ``e`` is ``where(condition, a, b)`` over a
    condition that does not read c (coordinate 3) and one side a plain read of rows that ``_quad_rows`` reads in
    groups: an attention operand reading a cache that an update changes at a few rows, the update's values there
    (``attention_writes``); None otherwise. Where both sides are plain reads (a value cache and the projection's new
    row), the plain read is the side whose row follows the key row (coordinate 2, ``_reads_key_row``): the cache, read
    at every key, while the update's one row is the side a kernel walking the keys takes rarely."""
    if e.op != "where" or any(n.op == "coord" and n.args[0] == 3 for n in E.walk(e.args[0])):
        return None
    for side in sorted((1, 2), key=lambda k: not _reads_key_row(e.args[k])):
        quads = _quad_rows(e.args[side], decl, size, kinds=WIDE_KINDS)
        if quads is not None:
            return quads, side
    return None


def _reads_key_row(e: E.Expr) -> bool:
    """Whether ``e`` reads coordinate 2 (an attention operand's key row j)."""
    return any(n.op == "coord" and n.args[0] == 2 for n in E.walk(e))


def _quad_rows(e: E.Expr, decl, size: int, coord: int = 3, width: int = 4,
               kinds: tuple[str, ...] = ("f32",)) -> tuple[int, E.Expr, str] | None:
    """(slot, index of the row's first element in elements of its wide binding, storage kind) where ``e`` is a
    plain read of element c (coordinate ``coord``) of a value stored as one of ``kinds``, in rows of ``size``
    elements, a multiple of ``width``, that start at multiples of the wide binding's element (``wide_unit``: 4
    elements of f32, ``width`` halves); None otherwise."""
    if e.op != "read" or e.dtype != E.F32 or size % width:
        return None
    slot, index, *half = e.args
    kind = half[0] if half else "f32"
    if kind not in kinds or decl[slot][2] != wgsl.STORAGE_TYPE[kind]:
        return None
    row = quad_row_index(index, coord, wide_unit(kind, width))
    return None if row is None else (slot, row, kind)


def matmul_prelude_of(node: Matmul, slots: Slots, decl: list | None = None, quads: list = (),
                    gemv_wide: GemvWide | None = None) -> str:
    """``kernels.prelude.matmul_prelude`` of ``node``: with several outputs (``more_blocks``), the operand they do not
    share and the epilogue go by the output's block of ``node.block_axis``; ``decl`` (default the slots') and
    ``quads`` as ``_matmul_quads`` gives them, ``gemv_wide`` as ``_gemv_wide`` does."""
    axis, exprs = node.block_axis, slots.exprs
    end = 3 + 2 * len(node.more_blocks)
    starts = [sum(node.sizes[:k]) for k in range(len(node.sizes))]
    blocked = list(zip(starts, [exprs[0 if axis == "i" else 1], *exprs[3:end:2]]))  # the operand the outputs differ in
    a_blocks = blocked if axis == "i" else [(0, exprs[0])]
    b_blocks = blocked if axis == "j" else [(0, exprs[1])]
    epilogues = [exprs[2], *exprs[4:end:2]]
    products, row_phases = exprs[end:end + len(node.products)], exprs[end + len(node.products):]
    stores = []
    for s, e, slot, size, v in zip(starts, epilogues, slots.out_slots, node.sizes, node.outs):
        m, n = (size, node.n) if axis == "i" else (node.m, size)
        stores.append((s, e, slots.name(slot), m, n, v.compute_dtype, slots.storage[slot]))
    return matmul_prelude(slots.decl if decl is None else decl, axis, a_blocks, b_blocks, stores, products, row_phases,
                          quads, gemv_wide, stores_pairs(slots))
