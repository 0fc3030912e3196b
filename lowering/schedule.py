"""Schedule: turn a fused Graph into a Plan (buffers, memory plan, WGSL per kernel, dispatch list).

Every non-input node is one dispatch, or two for a node cut into slices (a matmul's K, attention's other sequence,
the rows of a reduction):
the slices' partial results go to the arena, then a second dispatch merges them. Inputs, parameters and graph
outputs get buffers of their own; intermediates share the arena placed by the planner. Loads become linear reads of
contiguous tensors, with the index math simplified against the kernel's iteration bounds.
"""
from __future__ import annotations

import hashlib
from typing import Callable, NamedTuple

from meganeura.kernels import attention as attention_kernels
from meganeura.kernels import matmul as matmul_kernels
from meganeura.kernels.matmul_tuning import MatmulProblem
from meganeura.kernels import pointwise as pointwise_kernels
from meganeura.kernels.prelude import (ATTENTION_ARGS, GemvWide, attention_prelude, matmul_prelude, wide_binding_type,
                                       wide_unit)
from meganeura.kernels import reduce as reduce_kernels
from meganeura.kernels import wgsl
from meganeura.runtime.dtypes import HALF_STORAGE, STORAGE, storage_bytes
from meganeura.runtime.plan import SIZES_INPUT, Binding, BufferSpec, Dispatch, Plan, TensorSpec
from meganeura.kernels.sizes import active, concrete, is_size, size_max, upper

from . import expr as E
from .bindings import checks, kernel_bindings
from .indexing import linear_index, quad_row_index, simplify, unit_stride_coord
from .in_place import StoredOver, arena_aliases, in_place_outputs
from .ir import Attention, Graph, Input, Matmul, Node, Pointwise, Reduce, Value, last_reads
from .planner import Interval, place


# Sibling matmuls of this many blocks or more fetch their blocked operand in a loop (matmul_kernel's ``looped``). H200:
# SmolVLA's 16 cross-attention projections of one context, merged, took the driver 1.0-1.4 s to compile with the
# fetch written out (0.15 s with one tensor in place of the chain); with the loop no kernel of SmolVLA took more than
# 0.5 s in a cold first call, and its GPU time per call stayed within 2 %.
LOOPED_FETCH_BLOCKS = 4


# Storage kinds that matmul and attention operands read in groups (``_quad_rows``): f32, and the halves, widened in
# registers from a vec2<u32> (4) or vec4<u32> (8) load rather than one 32-bit load and select per element.
WIDE_KINDS = ("f32", *HALF_STORAGE)
# Elements of a group that the gemv reads of a half precision matrix at once (one vec4<u32>: 16 bytes, as a vec4 of
# f32 is), and the matrices it reads so: a decode step's weights. f32 matrices keep the scalar gemv.
GEMV_WIDTH = 8
ROUNDED_TO = {"round_bf16": "bf16", "round_f16": "f16"}  # a rounding op -> the storage it rounds to
GEMV_WIDE_KINDS = HALF_STORAGE


# The status buffer (and binding): 4 u32 words; kernels raise word 0 (atomicMax) and the runtime reads all back.
STATUS_BYTES = 16


class Slots(NamedTuple):
    """A node's bindings, as ``_bindings`` lays them out."""
    bound: list  # value ids (or "status", or the arena key of partial results) in slot order
    decl: list  # (slot, WGSL name, element type) of each slot
    storage: list  # how each slot's value is stored (a key of wgsl.STORAGE_TYPE; "" for status and partial sums)
    exprs: list  # the node's expressions, with loads read from slots
    out_slots: list  # the slot of each output value
    name: Callable[[int], str]  # slot -> WGSL name
    guarded: bool = False  # the node stores over an input in a plan that checks data: it stores only if no check failed


def tensor_bytes(v: Value, stored: dict | None = None) -> int:
    """Bytes of ``v`` in a buffer of its own when it is one of ``stored`` (in its dtype's storage), else in the arena
    (every element in 32 bits: intermediates of half precision graphs stay in f32 and round only at the outputs)."""
    if stored is not None and v.id in stored:
        return size_max(storage_bytes(v.numel, v.dtype), 4)
    return size_max(4 * v.numel, 4)


def schedule(graph: Graph, limits: dict, input_names=None, stats=None, choose_matmuls=None, on_kernel=None) -> Plan:
    """Emit the plan. Graph outputs are named ``out{i}`` for their first position in ``graph.outputs``.

    ``choose_matmuls(problems)`` may pick the tiled matmul kernels' variants (``MatmulChoice``s, e.g. a tuner's):
    it gets the plan's distinct GEMM problems (``MatmulProblem``s: shape, layouts, f16 allowed, and the kernel's
    own prelude), all at once, and returns a choice or None for each. Where it is absent or says None, the kernel
    generator's own rule decides.
    f16 products are allowed where ``limits`` set ``F16_PRODUCTS`` (precision "fast"). ``on_kernel(wgsl, bindings,
    key)`` is told of each kernel as soon as it is generated (a device can start compiling it while the rest are)."""
    graph = _narrowed_outputs(graph)
    kernels = [n for n in graph.nodes if not isinstance(n, Input)]
    values = {v.id: v for n in graph.nodes for v in n.outs}
    over, refused = in_place_outputs(graph, kernels)
    buffers, inputs, params, outputs, placement = _own_buffers(graph, over)
    stored = {vid: STORAGE[values[vid].dtype] for vid in placement}
    variants = _matmul_variants([n for n in kernels if isinstance(n, Matmul)], values, stored, limits, choose_matmuls)
    aliases = arena_aliases(kernels, placement, values)
    intervals, scratch = _arena_intervals(kernels, placement, limits, variants, aliases)
    sizes = {iv.key: iv.size for iv in intervals if iv.key < 0}
    offsets, arena_size = place(intervals, limits.get("min-storage-buffer-offset-alignment", 256))
    if intervals:
        buffers.append(BufferSpec("arena", arena_size, "arena"))
        placement.update({key: ("arena", off) for key, off in offsets.items()})
        for old, new in aliases.items():  # (in kernel order: a chain's first is placed first)
            placement[new] = placement[old]
    if graph.status_messages:
        buffers.append(BufferSpec("status", STATUS_BYTES, "status"))
    symbols = symbol_count()
    if symbols:  # a dynamic graph's: the symbols' values, written by each run (``Plan.symbols``), bound as a uniform
        buffers.append(BufferSpec(f"input:{SIZES_INPUT}", 16 * wgsl.sizes_vec4s(symbols), "input"))
        inputs.append(TensorSpec(SIZES_INPUT, f"input:{SIZES_INPUT}", 0, (symbols,), "int32"))

    binding_of = _binding_table(placement, sizes, values, stored)
    stored_over = StoredOver({target.out.id: graph.outputs[i].id for i, target in over.items()},
                             bool(graph.status_messages), aliases)
    sources, dispatches = _emit_dispatches(kernels, values, stored, limits, scratch, variants, binding_of, on_kernel,
                                           stored_over)
    plan_stats = dict(stats or {})
    plan_stats.update(arena_bytes=arena_size if intervals else 0, unplanned_bytes=sum(iv.size for iv in intervals),
                      dispatches=len(dispatches), kernels=len(sources), arena_aliases=len(aliases))
    if graph.in_place:
        saved = sum(tensor_bytes(target.out, stored) for target in over.values())
        plan_stats.update(in_place_outputs=len(over), in_place_bytes=saved,
                          in_place_refused={f"out{i}": why for i, why in refused.items()})
    in_place = {f"out{i}": target.name for i, target in over.items()}
    plan = Plan(buffers, inputs, params, outputs, sources, dispatches, dict(graph.status_messages), plan_stats,
                in_place, symbols, tuple(active().bound(k) for k in range(symbols)) if symbols else ())
    plan.validate()
    return plan


def symbol_count() -> int:
    """The number of symbols of the dynamic graph being compiled (0 for a static one): its kernels read their values
    from the plan's size buffer (``wgsl.SIZES_VAR``)."""
    guards = active()
    return len(guards.hints) if guards is not None else 0


def _narrowed_outputs(graph: Graph) -> Graph:
    """``graph`` where each half precision output that a non-pointwise node computes is copied out by a pointwise
    node of its own: only the pointwise kernel stores half precision (two elements to a thread, one u32 word), and
    the copy reads the producer's f32 result from the arena."""
    producers = graph.producers()
    narrow = {v.id for v in graph.outputs
              if STORAGE[v.dtype] in HALF_STORAGE and not isinstance(producers[v.id], (Pointwise, Input))}
    if not narrow:
        return graph
    next_id = 1 + max(v.id for n in graph.nodes for v in n.outs)
    copies: dict[int, Value] = {}
    for vid in sorted(narrow):
        v = producers[vid].outs[[o.id for o in producers[vid].outs].index(vid)]
        copies[vid] = Value(next_id + len(copies), v.shape, v.dtype)
    nodes = graph.nodes + [Pointwise([copies[vid]], E.load(vid, tuple(E.coord(d) for d in range(len(c.shape))), E.F32),
                                     "narrow") for vid, c in copies.items()]
    outputs = [copies.get(v.id, v) for v in graph.outputs]
    return Graph(nodes, outputs, graph.status_messages, graph.in_place)


def _own_buffers(graph: Graph, over: dict[int, Input]) -> tuple[list[BufferSpec], list, list, list, dict]:
    """The buffers of the graph's inputs, parameters and outputs, each a buffer of its own but the outputs stored
    over an input (``over``: output position -> that Input): (buffers, input specs, parameter specs, output specs,
    value id -> (buffer, offset))."""
    placement: dict[int, tuple[str, int]] = {}
    buffers: list[BufferSpec] = []
    inputs, params, outputs = [], [], []
    for node in graph.nodes:
        if isinstance(node, Input):
            v = node.out
            buf = f"{node.role}:{node.name}"
            buffers.append(BufferSpec(buf, max(upper(storage_bytes(v.numel, v.dtype)), 4), node.role))
            (inputs if node.role == "input" else params).append(TensorSpec(node.name, buf, 0, v.shape, v.dtype))
            placement[v.id] = (buf, 0)
    for i, v in enumerate(graph.outputs):
        if v.id in placement:
            continue
        name = f"out{i}"
        if i in over:
            buf = placement[over[i].out.id][0]
        else:
            buf = name
            buffers.append(BufferSpec(buf, max(upper(storage_bytes(v.numel, v.dtype)), 4), "output"))
        outputs.append(TensorSpec(name, buf, 0, v.shape, v.dtype))
        placement[v.id] = (buf, 0)
    return buffers, inputs, params, outputs, placement


def _arena_intervals(kernels: list[Node], placement: dict, limits: dict, variants: dict,
                     aliases: dict[int, int]) -> tuple[list[Interval], dict[int, tuple[int, int]]]:
    """The lifetimes the arena holds, and node id -> (slices, arena key of their partial results) of each node cut
    into slices. Each value without a buffer of its own lives from the step that writes it to its last read, and a
    value stored over an operand (``aliases``: operand id -> value id) extends the operand's range, keyed by the
    first of the chain; the partial results of a sliced node, keyed -1 - step (no value id collides), during its
    step."""
    last_use = last_reads(kernels)
    first_of: dict[int, int] = {}
    for old, new in aliases.items():  # (in kernel order)
        first_of[new] = first_of.get(old, old)
    spans: dict[int, Interval] = {}
    for step, node in enumerate(kernels):
        for v in node.outs:
            if v.id not in placement:
                key = first_of.get(v.id, v.id)
                size, last = upper(tensor_bytes(v)), last_use.get(v.id, step)
                span = spans.get(key)
                spans[key] = (Interval(key, size, step, last) if span is None
                              else Interval(key, max(size, span.size), span.first, max(last, span.last)))
    intervals = list(spans.values())
    scratch: dict[int, tuple[int, int]] = {}
    for step, node in enumerate(kernels):
        split, floats = _slices(node, limits, variants.get(id(node)))
        if split > 1:
            scratch[id(node)] = (split, -1 - step)
            intervals.append(Interval(-1 - step, upper(4 * floats), step, step))
    return intervals, scratch


def _binding_table(placement: dict, sizes: dict, values: dict, stored: dict) -> dict:
    """Bound value id (or "status", or the arena key of partial results) -> its ``Binding``: bindings of symbolic
    sizes span the most they hold (``upper``)."""
    table = {vid: Binding(buf, off, sizes[vid] if vid in sizes else upper(tensor_bytes(values[vid], stored)))
             for vid, (buf, off) in placement.items()}
    table["status"] = Binding("status", 0, STATUS_BYTES)
    return table


def _emit_dispatches(kernels: list[Node], values: dict, stored: dict, limits: dict, scratch: dict, variants: dict,
                     binding_of: dict, on_kernel, stored_over: StoredOver) -> tuple[dict[str, str], list[Dispatch]]:
    """(WGSL by kernel key, dispatches in order) of the nodes that write anything; ``on_kernel`` hears of each new
    kernel as it is generated. ``stored_over``: the outputs stored over inputs (``in_place``)."""
    sources: dict[str, str] = {}
    dispatches = []
    max_bindings = limits.get("max-storage-buffers-per-shader-stage", 8)
    for node in kernels:
        if all(v.numel == 0 for v in node.outs):
            continue
        label = _label(node)
        passes = _kernel(node, values, stored, limits, scratch.get(id(node)), variants.get(id(node)), stored_over)
        merge = " (sum of slices)" if isinstance(node, Matmul) else " (merge of slices)"
        for i, (source, groups, bound) in enumerate(passes):
            source = wgsl.with_size_inits(source, symbol_count())  # (a dynamic graph's: its sizes set as main starts)
            if len(bound) > max_bindings:  # a pass fusion or a generator let grow past the limit: never sent to wgpu
                raise ValueError(f"kernel {label!r} needs {len(bound)} storage buffers but the limits' "
                                 f"max-storage-buffers-per-shader-stage is {max_bindings}")
            key = hashlib.sha1(source.encode()).hexdigest()[:16]
            bindings = tuple(binding_of[vid] for vid in bound)
            if key not in sources and on_kernel is not None:
                on_kernel(source, len(bindings), key)
            sources[key] = source
            dispatches.append(Dispatch(key, bindings, tuple(groups), label + (merge if i else "")))
    return sources, dispatches


def _label(node: Node) -> str:
    """A node's dispatch label: its own or its type's name; a matmul's adds the GEMM shape, which tells matmuls apart
    in profiles and errors."""
    label = getattr(node, "label", "") or type(node).__name__.lower()
    if isinstance(node, Matmul):
        dims = [repr(x) for x in (node.batch, node.rows, node.columns, node.k)]  # (a symbolic size by its form)
        label += " " + "x".join(dims if node.batch != 1 else dims[1:])
    return label


def _matmul_variants(nodes: list[Matmul], values: dict, stored: dict, limits: dict,
                     choose) -> dict[int, matmul_kernels.MatmulChoice]:
    """Node id -> kernel variant of each matmul node: ``choose``'s for a tiled problem where it gives one, else the
    default."""
    variants = {id(n): matmul_kernels.default_choice(n.batch, n.rows, n.columns, n.k, limits) for n in nodes}
    if choose is None:
        return variants
    f16 = bool(limits.get(matmul_kernels.F16_PRODUCTS))
    problems = {id(n): _matmul_problem(n, values, stored, f16, limits) for n in nodes
                if matmul_kernels.is_tiled(n.rows, n.columns)
                and not any(map(is_size, (n.batch, n.rows, n.columns, n.k)))}
    distinct = list(dict.fromkeys(problems.values()))
    chosen = dict(zip(distinct, choose(distinct))) if distinct else {}
    for node_id, problem in problems.items():
        if chosen[problem] is not None:
            variants[node_id] = chosen[problem]
    return variants


_TUNING_PARTIAL = "tuning partial sums"  # the bound key of a problem's partial-sum binding


def _matmul_problem(node: Matmul, values: dict, stored: dict, f16: bool, limits: dict) -> MatmulProblem:
    """The tuning problem of a tiled matmul node: its shape and layouts, and its kernel's prelude with a partial-sum
    binding after the node's own (as a split variant's kernel has it), then the vec4 bindings of the operands that
    quad-staged variants read as vec4s (``_matmul_quads``)."""
    slots = _bindings(node, values, stored, _TUNING_PARTIAL)
    a_fast, b_fast = _fast_axes(slots.exprs)

    def size(vid) -> int:
        return STATUS_BYTES if vid == "status" else tensor_bytes(values[vid], stored)

    decl, bound = list(slots.decl), list(slots.bound)
    quads = _matmul_quads(node, slots, decl, bound, limits)
    return MatmulProblem(node.batch, node.rows, node.columns, node.k, a_fast, b_fast, f16,
                         _matmul_prelude(node, slots, decl, quads), tuple(map(size, slots.bound[:-1])),
                         slots.name(len(slots.bound) - 1), _looped_operand(node),
                         "".join(quad[0] for quad in quads), tuple(map(size, bound[len(slots.bound):])))


def _looped_operand(node: Matmul) -> str:
    """The operand a tiled kernel fetches in a loop: the one that picks among ``LOOPED_FETCH_BLOCKS`` or more sibling
    tensors (its loader, a chain of one branch per tensor, is then written once, not once per staging register)."""
    if len(node.sizes) < LOOPED_FETCH_BLOCKS:
        return ""
    return "a" if node.block_axis == "i" else "b"


def _fast_axes(exprs: list[E.Expr]) -> tuple[str, str]:
    """(a_fast, b_fast) of a matmul's linearised operand expressions: the axis along which each one's reads step by
    one element."""
    a_fast = "i" if unit_stride_coord(exprs[0], (2, 1)) == 1 else "p"
    b_fast = "p" if unit_stride_coord(exprs[1], (2, 1)) == 1 else "j"
    return a_fast, b_fast


def _linearise(e: E.Expr, domain, values: dict, stored: dict, slot_of) -> E.Expr:
    """``e`` with each load turned into a read of slot ``slot_of(value id)`` at a simplified linear index (widened
    from half precision where the value is ``stored`` so), a rounding of such a read to its own half precision left
    out: it is exact (a repeated KV head of a bf16 cache, rounded to bf16 as its copy, stays a plain read, which
    attention then reads by groups)."""
    bounds = dict(enumerate(domain))

    def rewrite(n: E.Expr):
        if n.op == "load":
            vid, coords = n.args
            index = simplify(linear_index(coords, values[vid].shape), bounds)
            half = stored.get(vid) if stored.get(vid) in HALF_STORAGE else ""
            return E.read(slot_of(vid), index, n.dtype, half)
        if n.op in ROUNDED_TO and n.args[0].op == "read" and n.args[0].args[2:] == (ROUNDED_TO[n.op],):
            return n.args[0]  # (a value widened from a half precision is that half precision already)
        return None

    return E.substitute(e, rewrite)


def _slices(node: Node, limits: dict, variant: matmul_kernels.MatmulChoice | None) -> tuple[int, int]:
    """(slices, floats of scratch for their partial results) of a node whose kernel is cut into slices merged by a
    second dispatch: a matmul's K, attention's other sequence, the rows of a reduction; (1, 0) for the rest."""
    if kernel_bindings(node) >= limits.get("max-storage-buffers-per-shader-stage", 8):
        return 1, 0  # no binding left for the partial results: one pass
    if isinstance(node, Matmul):
        return variant.split, variant.split * node.batch * node.rows * node.columns
    if isinstance(node, Attention):
        shape = _attention_shape(node)
        split = attention_kernels.attention_splits(shape, node.kind, limits)
        return split, attention_kernels.partial_floats(shape, node.kind, split)
    if isinstance(node, Reduce):
        split = reduce_kernels.reduce_splits(node.domain, node.axes, node.phases, node.results)
        return split, reduce_kernels.partial_floats(node.domain, node.axes, node.phases, split)
    return 1, 0


def _attention_shape(node: Attention) -> attention_kernels.AttentionShape:
    """The pass's shape: its batch and lengths may be symbolic; the head counts and sizes are concrete."""
    dynamic = ("batch", "lq", "lk")
    sizes = [getattr(node, f) if f in dynamic else concrete(getattr(node, f))
             for f in ("batch", "heads", "kv_heads", "lq", "lk", "d", "dv")]
    return attention_kernels.AttentionShape(*sizes, node.scale, node.causal, node.bias is not None)


def _bindings(node: Node, values: dict, stored: dict, scratch_key=None,
              stored_over: StoredOver | None = None) -> Slots:
    """A node's bindings (``Slots``). A status binding follows the values where an expression checks something, and
    ``scratch_key`` (f32 partial results) comes last. The node reads an input that one of its outputs is stored over
    (``in_place``), or an arena operand it stores over (``arena_aliases``), through the output's binding: one buffer
    range is bound once (WebGPU forbids a writable binding that overlaps another in one dispatch); a node storing
    over an input binds the status buffer too where ``stored_over.guarded``."""
    bound: list = []
    outs = {v.id for v in node.outs}
    stored_over = stored_over or StoredOver({}, False)
    same = {old: new for old, new in stored_over.values.items() if new in outs}
    guarded = bool(same) and stored_over.guarded
    same.update({old: new for old, new in stored_over.arena.items() if new in outs})  # (arena_aliases)

    def slot_of(vid) -> int:
        vid = same.get(vid, vid)
        if vid not in bound:
            bound.append(vid)
        return bound.index(vid)

    own = {v.id for v in node.outs} & {ld.args[0] for e in node.exprs() for ld in E.loads_of(e)}
    if own:  # other threads may not have written it yet: a race on GPUs that a serial CPU driver hides
        raise ValueError(f"{type(node).__name__} node reads its own output values {sorted(own)}")
    exprs = [_linearise(e, d, values, stored, slot_of) for e, d in zip(node.exprs(), node.domains())]
    out_slots = [slot_of(v.id) for v in node.outs]
    if checks(exprs) or guarded:
        slot_of("status")

    def name(slot):
        return wgsl.STATUS_VAR if bound[slot] == "status" else f"b{slot}"

    if scratch_key is not None:
        slot_of(scratch_key)
    decl, storage = [], []
    for slot, vid in enumerate(bound):
        plain = vid == "status" or (scratch_key is not None and vid == scratch_key)
        kind = "" if plain else _storage(values[vid], stored)
        storage.append(kind)
        if vid == "status":
            decl.append((slot, wgsl.STATUS_VAR, "atomic<u32>"))
        else:
            decl.append((slot, name(slot), wgsl.STORAGE_TYPE[kind] if kind else "f32"))
    return Slots(bound, decl, storage, exprs, out_slots, name, guarded)


def _storage(v: Value, stored: dict) -> str:
    """How ``v`` is stored where this plan keeps it: its dtype's storage in a buffer of its own, else in 32 bits."""
    return stored.get(v.id, "u32" if v.compute_dtype == E.BOOL else v.compute_dtype)


def _kernel(node: Node, values: dict, stored: dict, limits: dict, scratch: tuple[int, int] | None = None,
            variant: matmul_kernels.MatmulChoice | None = None, stored_over: StoredOver | None = None) -> list[tuple]:
    """(WGSL, workgroups, bound value ids in slot order) of each dispatch of one node: one, or two for a node cut
    into slices (``scratch``: slices and the arena key of their partial results). A matmul node's kernel is
    ``variant``. ``KERNELS`` holds the generator of each node type."""
    slots = _bindings(node, values, stored, scratch[1] if scratch is not None else None, stored_over)
    generate = KERNELS.get(type(node))
    if generate is None:
        raise TypeError(f"no kernel for node {type(node).__name__}")
    if not isinstance(node, Pointwise) and any(stored.get(v.id) in HALF_STORAGE for v in node.outs):
        raise TypeError(f"{type(node).__name__} node stores half precision (only pointwise kernels do)")
    return generate(node, slots, limits, scratch, variant)


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


def _reduce_kernels(node: Reduce, slots: Slots, limits: dict, scratch, variant) -> list[tuple]:
    n_phases = len(node.phases)
    phases = [(op, e) for (op, _), e in zip(node.phases, slots.exprs[:n_phases])]
    results = [(r.per_element, e, slots.name(s), v.compute_dtype)
               for r, e, s, v in zip(node.results, slots.exprs[n_phases:], slots.out_slots, node.outs)]
    split, partial = (scratch[0], slots.name(slots.bound.index(scratch[1]))) if scratch is not None else (1, None)
    decl, bound = list(slots.decl), list(slots.bound)
    quads = _reduce_quads(node, phases, slots.out_slots, decl, bound, limits)
    return [(src, groups, bound) for src, groups in reduce_kernels.reduce_kernel(
        bindings=decl, domain=node.domain, axes=node.axes, phases=phases, results=results, limits=limits,
        split=split, partial=partial, quads=quads)]


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
                    variant: matmul_kernels.MatmulChoice) -> list[tuple]:
    """The matmul pass; cut into slices of K, the slices' pass and the pass summing them."""
    a_fast, b_fast = _fast_axes(slots.exprs)
    decl, bound = list(slots.decl), list(slots.bound)
    tiled = matmul_kernels.is_tiled(node.rows, node.columns)
    quads = _matmul_quads(node, slots, decl, bound, limits) if variant.quads and tiled else []
    wide = None if tiled else _gemv_wide(node, slots, decl, bound, limits)
    prelude = _matmul_prelude(node, slots, decl, quads, wide)
    dims = dict(batch=node.batch, m=node.rows, n=node.columns)  # (symbolic sizes too: the generators take them)
    shape = dict(k=node.k, limits=limits, a_fast=a_fast, b_fast=b_fast, tile=variant.tile, block=variant.block,
                 f16=variant.f16, looped=_looped_operand(node), double=variant.double, quads=variant.quads,
                 patches=variant.patches, vector_loads="".join(quad[0] for quad in quads),
                 products=len(node.products), row_phases=len(node.row_phases),
                 gemv_width=wide.width if wide is not None else 0)
    if scratch is None:
        return [(*matmul_kernels.matmul_kernel(prelude, **dims, **shape), bound)]
    split, partial = scratch[0], slots.name(slots.bound.index(scratch[1]))
    return [(*matmul_kernels.matmul_kernel(prelude, **dims, **shape, split=split, partial=partial), bound),
            (*matmul_kernels.split_reduce_kernel(prelude, **dims, split=split, partial=partial, limits=limits),
             bound)]


def _matmul_quads(node: Matmul, slots: Slots, decl: list, bound: list, limits: dict) -> list[tuple]:
    """The operands of a tiled matmul to read as vec4s along their unit-stride axis (``matmul_prelude``'s
    ``quads``): plain reads of f32 or halves in rows of whole groups of 4 (``_quad_rows``) of one block each, not
    fetched in a loop, not a value the kernel stores over, each through a binding of its value in groups of 4 (vec4s
    of f32, vec2<u32>s of halves) appended to ``decl`` and ``bound`` while the bindings stay within the adapter's
    limit. None where a binding offset may fall between 16-byte boundaries."""
    if limits.get("min-storage-buffer-offset-alignment", 256) % 16:
        return []
    a_fast, b_fast = _fast_axes(slots.exprs)
    blocked = "a" if node.block_axis == "i" else "b"
    operands = (("a", slots.exprs[0], (2, "i", node.k) if a_fast == "p" else (1, "p", node.rows)),
                ("b", slots.exprs[1], (1, "j", node.k) if b_fast == "p" else (2, "p", node.columns)))
    aliases, quads = {}, []
    room = limits.get("max-storage-buffers-per-shader-stage", 8)
    for operand, e, (coord, other, size) in operands:
        if is_size(size) or (operand == blocked and len(node.sizes) > 1) or _looped_operand(node) == operand:
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
    if (node.rows != 1 or is_size(node.k) or _fast_axes(slots.exprs)[1] != "p"
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
    partial = slots.name(slots.bound.index(scratch[1])) if scratch is not None else None
    # (a vec4 binding needs its offset, a binding offset, on a 16-byte boundary)
    vec4_bindings = limits.get("min-storage-buffer-offset-alignment", 256) % 16 == 0
    prelude = _attention_prelude(node, slots,
                                 limits.get("max-storage-buffers-per-shader-stage", 8) if vec4_bindings else 0)
    return [(src, groups, slots.bound) for src, groups in attention_kernels.attention_kernel(
        prelude, node.kind, _attention_shape(node), [slots.name(s) for s in slots.out_slots], limits, partial)]


# The kernel generator of each IR node type: (node, its Slots, limits, scratch, matmul variant) -> the passes.
KERNELS = {Pointwise: _pointwise_kernels, Reduce: _reduce_kernels, Matmul: _matmul_kernels,
           Attention: _attention_kernels}


def _attention_prelude(node: Attention, slots: Slots, max_bindings: int) -> str:
    """``kernels.prelude.attention_prelude`` of ``node``: each operand expression read as f32, with the vec4 row
    reads of head-size operands (f32 or halves) where ``_quad_rows`` finds them (their bindings appended to the
    slots)."""
    loads = []
    for operand, e in zip(node.operands(), slots.exprs):
        size = node.dv if operand in ("v", "dout") else node.d
        quads = _quad_rows(e, slots.decl, size, kinds=WIDE_KINDS) if ATTENTION_ARGS[operand][-1] == "c" else None
        loads.append((operand, E.cast(e, E.F32), quads))
    return attention_prelude(slots.decl, slots.bound, loads, max_bindings)


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


def _matmul_prelude(node: Matmul, slots: Slots, decl: list | None = None, quads: list = (),
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
        stores.append((s, e, slots.name(slot), m, n, v.compute_dtype))
    return matmul_prelude(slots.decl if decl is None else decl, axis, a_blocks, b_blocks, stores, products, row_phases,
                          quads, gemv_wide)
