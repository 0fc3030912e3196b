"""Schedule: turn a fused Graph into a Plan (buffers, memory plan, WGSL per kernel, dispatch list).

Every non-input node is one dispatch, or two for a node cut into slices (a matmul's K, attention's other sequence,
the rows of a reduction):
the slices' partial results go to the arena, then a second dispatch merges them. Inputs, parameters and graph
outputs get buffers of their own; intermediates share the arena placed by the planner. Loads become linear reads of
contiguous tensors, with the index math simplified against the kernel's iteration bounds.
"""
from __future__ import annotations

import hashlib

from meganeura.kernels import attention as attention_kernels
from meganeura.kernels import matmul_plans
from meganeura.kernels.matmul_tuning import MatmulProblem
from meganeura.kernels import reduce as reduce_kernels
from meganeura.kernels import wgsl
from meganeura.runtime.dtypes import HALF_STORAGE, STORAGE, storage_bytes
from meganeura.runtime.plan import SIZES_INPUT, Binding, BufferSpec, Dispatch, Plan, TensorSpec
from meganeura.kernels.sizes import active, is_size, size_max, upper

from . import expr as E
from .bindings import checks, kernel_bindings
from .indexing import linear_index, simplify
from .in_place import StoredOver, arena_aliases, in_place_outputs
from .ir import (Attention, Graph, Input, Matmul, Node, Pointwise, Reduce, Scatter, Value, last_reads,
                 storing_node)
from .node_kernels import (KERNELS, Slots, attention_shape, fast_axes, looped_operand, matmul_prelude_of,
                           matmul_quads, stores_pairs)
from .packed import PackedLayout, binding_keys
from .planner import Interval, place
from .sibling_updates import split_overfull_updates
from .slice_merges import ReaderMerge, SliceMerge, slice_merges

ROUNDED_TO = {"round_bf16": "bf16", "round_f16": "f16"}  # a rounding op -> the storage it rounds to


# The status buffer (and binding): 4 u32 words; kernels raise word 0 (atomicMax) and the runtime reads all back.
STATUS_BYTES = 16


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
    graph, narrowed = _narrowed_outputs(graph)
    kernels = [n for n in graph.nodes if not isinstance(n, Input)]
    values = {v.id: v for n in graph.nodes for v in n.outs}
    kernels, over, refused = _in_place_decided(graph, kernels, limits)
    _check_scatters(graph, kernels, over)
    buffers, inputs, params, outputs, placement = _own_buffers(graph, over)
    stored = {vid: STORAGE[values[vid].dtype] for vid in placement}
    alignment = limits.get("min-storage-buffer-offset-alignment", 256)
    packed = PackedLayout.of(kernels, alignment, lambda v: upper(tensor_bytes(v)))
    variants = _matmul_variants([n for n in kernels if isinstance(n, Matmul)], values, stored, limits, choose_matmuls,
                                packed)
    aliases = {old: new for old, new in arena_aliases(kernels, placement, values).items()
               if old not in packed.group}  # (no kernel stores over side-by-side outputs: ``packed``)
    merges = slice_merges(kernels, placement, limits, variants,
                          lambda n: _slices(n, limits, variants.get(id(n)), packed)[0])
    intervals, scratch = _arena_intervals(kernels, placement, limits, variants, aliases, merges, packed)
    sizes = {iv.key: iv.size for iv in intervals if iv.key < 0}
    offsets, arena_size = place(intervals, alignment)
    if intervals:
        buffers.append(BufferSpec("arena", arena_size, "arena"))
        _place_in_arena(placement, offsets, aliases, packed)
    if graph.status_messages:
        buffers.append(BufferSpec("status", STATUS_BYTES, "status"))
    symbols = symbol_count()
    if symbols:  # a dynamic graph's: the symbols' values, written by each run (``Plan.symbols``), bound as a uniform
        buffers.append(BufferSpec(f"input:{SIZES_INPUT}", 16 * wgsl.sizes_vec4s(symbols), "input"))
        inputs.append(TensorSpec(SIZES_INPUT, f"input:{SIZES_INPUT}", 0, (symbols,), "int32"))

    binding_of = _binding_table(placement, sizes, values, stored, packed)
    stored_over = StoredOver({target.out.id: graph.outputs[i].id for i, target in over.items()},
                             bool(graph.status_messages), aliases)
    sources, dispatches = _emit_dispatches(kernels, values, stored, limits, scratch, variants, binding_of, on_kernel,
                                           stored_over, merges, packed)
    plan_stats = dict(stats or {})
    plan_stats.update(arena_bytes=arena_size if intervals else 0, unplanned_bytes=sum(iv.size for iv in intervals),
                      dispatches=len(dispatches), kernels=len(sources), arena_aliases=len(aliases),
                      merged_by_readers=len(merges))
    if narrowed:
        plan_stats.update(narrowed_outputs=narrowed)
    if graph.in_place:
        saved = sum(tensor_bytes(target.out, stored) for target in over.values())
        plan_stats.update(in_place_outputs=len(over), in_place_bytes=saved,
                          in_place_refused={f"out{i}": why for i, why in refused.items()})
    in_place = {f"out{i}": target.name for i, target in over.items()}
    plan = Plan(buffers, inputs, params, outputs, sources, dispatches, dict(graph.status_messages), plan_stats,
                in_place, symbols, tuple(active().bound(k) for k in range(symbols)) if symbols else ())
    plan.validate()
    return plan


def _in_place_decided(graph: Graph, kernels: list[Node], limits: dict) -> tuple[list[Node], dict, dict]:
    """(kernels, {output position: the Input it is stored over}, {output position: why not}): the in-place requests
    decided (``in_place_outputs``); where a merged update counted on storing over inputs that it may not store over,
    it is cut back within the binding limit (``split_overfull_updates``) and the requests are decided again."""
    over, refused = in_place_outputs(graph, kernels)
    stored = {graph.outputs[i].id: target.out.id for i, target in over.items()}
    split = split_overfull_updates(graph, kernels, stored, limits.get("max-storage-buffers-per-shader-stage", 8))
    if len(split) == len(kernels):
        return kernels, over, refused
    return split, *in_place_outputs(graph, split)


def _check_scatters(graph: Graph, kernels: list[Node], over: dict) -> None:
    """Raise where a ``Scatter``'s output is not stored over its base: its kernel stores only the elements it
    changes, so the rest would be garbage (``regions`` makes one only where the output is)."""
    stored = {graph.outputs[i].id: target.out.id for i, target in over.items()}
    for node in (storing_node(n, n.outs[-1].id) for n in kernels):  # (an attention pass's update: ``writes``)
        if isinstance(node, Scatter) and any(stored.get(v.id) != b for v, b in zip(node.outs, node.region.bases)):
            raise ValueError(f"{node.label or 'scatter'} stores only the elements it changes, but an output of it "
                             "is not stored over the input it updates")


def symbol_count() -> int:
    """The number of symbols of the dynamic graph being compiled (0 for a static one): its kernels read their values
    from the plan's size buffer (``wgsl.SIZES_VAR``)."""
    guards = active()
    return len(guards.hints) if guards is not None else 0


def _narrowed_outputs(graph: Graph) -> tuple[Graph, dict[str, str]]:
    """(``graph`` where each half precision output that a kernel cannot store itself (``pair_refusal``) is copied
    out by a pointwise node of its own, {output name: why} of those). The pointwise kernel stores half precision two
    elements to a thread (one u32 word), a matmul kernel by pairs of columns and a row program its element results
    by pairs of elements; the copy reads the producer's f32 result from the arena."""
    producers = graph.producers()
    in_place = {graph.outputs[i].id for i in graph.in_place}
    stores = {v.id: storing_node(producers[v.id], v.id) for v in graph.outputs}
    why = {v.id: pair_refusal(stores[v.id], v.id, v.id in in_place) for v in graph.outputs
           if STORAGE[v.dtype] in HALF_STORAGE and not isinstance(stores[v.id], (Pointwise, Scatter, Input))}
    narrow = {vid for vid, reason in why.items() if reason is not None}
    if not narrow:
        return graph, {}
    next_id = 1 + max(v.id for n in graph.nodes for v in n.outs)
    copies: dict[int, Value] = {}
    for vid in sorted(narrow):
        v = producers[vid].outs[[o.id for o in producers[vid].outs].index(vid)]
        copies[vid] = Value(next_id + len(copies), v.shape, v.dtype)
    nodes = graph.nodes + [Pointwise([copies[vid]], E.load(vid, tuple(E.coord(d) for d in range(len(c.shape))), E.F32),
                                     "narrow") for vid, c in copies.items()]
    outputs = [copies.get(v.id, v) for v in graph.outputs]
    reasons = {f"out{i}": why[v.id] for i, v in enumerate(graph.outputs) if v.id in narrow}
    return Graph(nodes, outputs, graph.status_messages, graph.in_place), reasons


def pair_refusal(node: Node, vid: int, in_place: bool) -> str | None:
    """Why ``node``'s kernel cannot store its half precision output ``vid`` itself, or None. A matmul kernel stores
    its outputs by pairs of neighbouring columns (``node_kernels.stores_pairs``) where each output's column count is
    even (with several outputs side by side along columns, every block's: no pair straddles a row or a block); a
    row program its element results by pairs of neighbouring elements where the reduced axes end with the domain's
    last, of an even length (``reduce_kernels.pairs_fit``), not its row results (one per row, neighbouring rows'
    stored by other threads). Attention kernels store f32 only. Either way the outputs compute in f32, and the output
    is not stored over an input (only a pointwise writer may be: ``in_place``)."""
    if not isinstance(node, (Matmul, Reduce)):
        return f"an {type(node).__name__.lower()} kernel stores f32 only"
    if in_place:
        return "stored over an input, which only a pointwise kernel may do"
    if any(v.compute_dtype != E.F32 for v in node.outs):
        return "an output computed in another type than f32"
    if isinstance(node, Reduce):
        if not node.results[[v.id for v in node.outs].index(vid)].per_element:
            return "a row result of a reduction: neighbouring rows' results are stored by other threads"
        if not reduce_kernels.pairs_fit(node.domain, node.axes):
            return "a reduction whose last reduced axis is not the last, or of an odd or symbolic length"
        return None
    widths = node.sizes if node.block_axis == "j" else [node.n]
    if any(is_size(w) or w % 2 for w in widths):
        return "an odd or symbolic column count: a pair of columns would straddle two rows"
    return None


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


def _arena_intervals(kernels: list[Node], placement: dict, limits: dict, variants: dict, aliases: dict[int, int],
                     merges: dict[int, SliceMerge],
                     packed: PackedLayout) -> tuple[list[Interval], dict[int, tuple[int, int]]]:
    """The lifetimes the arena holds, and node id -> (slices, arena key of their partial results) of each node cut
    into slices. Each value without a buffer of its own lives from the step that writes it to its last read, and a
    value stored over an operand (``aliases``: operand id -> value id) extends the operand's range, keyed by the
    first of the chain; outputs side by side (``packed``) are one range, keyed by the first; the partial results of
    a sliced node, keyed -1 - step (no value id collides), during its step, or until its reader's where the reader
    merges them (``merges``)."""
    last_use = last_reads(kernels)
    unwritten = {m.attention.out.id for m in merges.values()}  # (its slices' scratch stands for it)
    first_of: dict[int, int] = {}
    for old, new in aliases.items():  # (in kernel order)
        first_of[new] = first_of.get(old, old)
    spans: dict[int, Interval] = {}
    for step, node in enumerate(kernels):
        for v in node.outs:
            if v.id not in placement and v.id not in unwritten:
                key = first_of.get(v.id, v.id)
                size, last = upper(tensor_bytes(v)), last_use.get(v.id, step)
                if v.id in packed.group:
                    key, size = packed.group[v.id][0], packed.size[packed.group[v.id]]
                span = spans.get(key)
                spans[key] = (Interval(key, size, step, last) if span is None
                              else Interval(key, max(size, span.size), span.first, max(last, span.last)))
    intervals = list(spans.values())
    scratch: dict[int, tuple[int, int]] = {}
    for step, node in enumerate(kernels):
        split, floats = _slices(node, limits, variants.get(id(node)), packed)
        if split > 1:
            scratch[id(node)] = (split, -1 - step)
            last = merges[id(node)].reader_step if id(node) in merges else step
            intervals.append(Interval(-1 - step, upper(4 * floats), step, last))
    return intervals, scratch


def _place_in_arena(placement: dict, offsets: dict[int, int], aliases: dict[int, int], packed: PackedLayout) -> None:
    """Add the arena's values to ``placement``: each at its interval's offset (``_arena_intervals``), a value
    stored over an operand at the operand's, and outputs side by side at their group's plus their own offset."""
    placement.update({key: ("arena", off) for key, off in offsets.items()})
    for old, new in aliases.items():  # (in kernel order: a chain's first is placed first)
        placement[new] = placement[old]
    for vid, group in packed.group.items():
        placement[vid] = ("arena", offsets[group[0]] + packed.offset[vid])


def _binding_table(placement: dict, sizes: dict, values: dict, stored: dict, packed: PackedLayout) -> dict:
    """Bound value id (or "status", or the arena key of partial results, or a group of outputs side by side) -> its
    ``Binding``: bindings of symbolic sizes span the most they hold (``upper``)."""
    table = {vid: Binding(buf, off, sizes[vid] if vid in sizes else upper(tensor_bytes(values[vid], stored)))
             for vid, (buf, off) in placement.items()}
    table.update({group: Binding("arena", placement[group[0]][1], size) for group, size in packed.size.items()})
    table["status"] = Binding("status", 0, STATUS_BYTES)
    return table


def _emit_dispatches(kernels: list[Node], values: dict, stored: dict, limits: dict, scratch: dict, variants: dict,
                     binding_of: dict, on_kernel, stored_over: StoredOver, merges: dict[int, SliceMerge],
                     packed: PackedLayout) -> tuple[dict[str, str], list[Dispatch]]:
    """(WGSL by kernel key, dispatches in order) of the nodes that write anything; ``on_kernel`` hears of each new
    kernel as it is generated. ``stored_over``: the outputs stored over inputs (``in_place``); ``merges``: the sliced
    attention passes whose reader merges their slices (their own merge pass left out)."""
    sources: dict[str, str] = {}
    dispatches = []
    max_bindings = limits.get("max-storage-buffers-per-shader-stage", 8)
    for node in kernels:
        if all(v.numel == 0 for v in node.outs):
            continue
        label = _label(node)
        merged = next((ReaderMerge.of(m, scratch[id(m.attention)]) for m in merges.values()
                       if m.reader is node), None)
        passes = _kernel(node, values, stored, limits, scratch.get(id(node)), variants.get(id(node)), stored_over,
                         merged, packed, unbound={node.out.id} if id(node) in merges else set())
        if id(node) in merges:
            passes = passes[:1]
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


def _matmul_variants(nodes: list[Matmul], values: dict, stored: dict, limits: dict, choose,
                     packed: PackedLayout) -> dict[int, matmul_plans.MatmulChoice]:
    """Node id -> kernel variant of each matmul node: ``choose``'s for a tiled problem where it gives one, else the
    default."""
    variants = {id(n): matmul_plans.default_choice(n.batch, n.rows, n.columns, n.k, limits) for n in nodes}
    if choose is None:
        return variants
    f16 = bool(limits.get(matmul_plans.F16_PRODUCTS))
    problems = {id(n): _matmul_problem(n, values, stored, f16, limits, packed) for n in nodes
                if matmul_plans.is_tiled(n.rows, n.columns)
                and not any(map(is_size, (n.batch, n.rows, n.columns, n.k)))}
    distinct = list(dict.fromkeys(problems.values()))
    chosen = dict(zip(distinct, choose(distinct))) if distinct else {}
    for node_id, problem in problems.items():
        if chosen[problem] is not None:
            variants[node_id] = chosen[problem]
    return variants


_TUNING_PARTIAL = "tuning partial sums"  # the bound key of a problem's partial-sum binding


def _matmul_problem(node: Matmul, values: dict, stored: dict, f16: bool, limits: dict,
                    packed: PackedLayout) -> MatmulProblem:
    """The tuning problem of a tiled matmul node: its shape and layouts, and its kernel's prelude with a partial-sum
    binding after the node's own (as a split variant's kernel has it), then the vec4 bindings of the operands that
    quad-staged variants read as vec4s (``node_kernels.matmul_quads``)."""
    slots = _bindings(node, values, stored, _TUNING_PARTIAL, packed=packed)
    a_fast, b_fast = fast_axes(slots.exprs)

    def size(vid) -> int:
        if isinstance(vid, tuple):  # (outputs side by side)
            return packed.size[vid]
        return STATUS_BYTES if vid == "status" else tensor_bytes(values[vid], stored)

    decl, bound = list(slots.decl), list(slots.bound)
    quads = matmul_quads(node, slots, decl, bound, limits)
    return MatmulProblem(node.batch, node.rows, node.columns, node.k, a_fast, b_fast, f16,
                         matmul_prelude_of(node, slots, decl, quads), tuple(map(size, slots.bound[:-1])),
                         slots.name(len(slots.bound) - 1), looped_operand(node),
                         "".join(quad[0] for quad in quads), tuple(map(size, bound[len(slots.bound):])),
                         stores_pairs(slots))


def _linearise(e: E.Expr, domain, values: dict, stored: dict, slot_of, calls: dict | None = None,
               shift: dict | None = None) -> E.Expr:
    """``e`` with each load turned into a read of slot ``slot_of(value id)`` at a simplified linear index (widened
    from half precision where the value is ``stored`` so), a rounding of such a read to its own half precision left
    out: it is exact (a repeated KV head of a bf16 cache, rounded to bf16 as its copy, stays a plain read, which
    attention then reads by groups); a rounding of a choice between such a read and another value rounds the other
    side alone (a bf16 cache that an update changes at a row stays a plain read elsewhere, which attention reads by
    groups and branches from: ``node_kernels._row_branch``). A value of ``calls`` (value id -> its read at a linear
    index) is read so; one of ``shift`` (value id -> elements) that many elements further (an output side by side
    with others: ``packed``)."""
    bounds = dict(enumerate(domain))
    shift = shift or {}

    def rewrite(n: E.Expr):
        if n.op == "load":
            vid, coords = n.args
            index = linear_index(coords, values[vid].shape)
            index = simplify(E.add(index, E.const(shift[vid], E.I32)) if vid in shift else index, bounds)
            if calls and vid in calls:
                return calls[vid](index)
            half = stored.get(vid) if stored.get(vid) in HALF_STORAGE else ""
            return E.read(slot_of(vid), index, n.dtype, half)
        if n.op in ROUNDED_TO and _is_half_read(n.args[0], n.op):
            return n.args[0]  # (a value widened from a half precision is that half precision already)
        if n.op in ROUNDED_TO and n.args[0].op == "where" and any(_is_half_read(x, n.op) for x in n.args[0].args[1:]):
            condition, *sides = n.args[0].args  # (rounded side by side: the side read from that half stays plain)
            return E.where(condition, *(x if _is_half_read(x, n.op) else E.unary(n.op, x) for x in sides))
        return None

    return E.substitute(e, rewrite)


def _is_half_read(e: E.Expr, rounding: str) -> bool:
    """Whether ``e`` is a read of a value stored in the half precision that ``rounding`` rounds to."""
    return e.op == "read" and e.args[2:] == (ROUNDED_TO[rounding],)


def _slices(node: Node, limits: dict, variant: matmul_plans.MatmulChoice | None,
            packed: PackedLayout) -> tuple[int, int]:
    """(slices, floats of scratch for their partial results) of a node whose kernel is cut into slices merged by a
    second dispatch: a matmul's K, attention's other sequence, the rows of a reduction; (1, 0) for the rest."""
    if kernel_bindings(node, packed.group) >= limits.get("max-storage-buffers-per-shader-stage", 8):
        return 1, 0  # no binding left for the partial results: one pass
    if isinstance(node, Matmul):
        return variant.split, variant.split * node.batch * node.rows * node.columns
    if isinstance(node, Attention):
        shape = attention_shape(node)
        split = attention_kernels.attention_splits(shape, node.kind, limits)
        return split, attention_kernels.partial_floats(shape, node.kind, split)
    if isinstance(node, Reduce):
        split = reduce_kernels.reduce_splits(node.domain, node.axes, node.phases, node.results)
        return split, reduce_kernels.partial_floats(node.domain, node.axes, node.phases, split)
    return 1, 0


def _bindings(node: Node, values: dict, stored: dict, scratch_key=None, stored_over: StoredOver | None = None,
              merged: ReaderMerge | None = None, packed: PackedLayout | None = None,
              unbound: set = frozenset()) -> Slots:
    """A node's bindings (``Slots``). A status binding follows the values where an expression checks something, and
    ``scratch_key`` (f32 partial results) comes last. ``merged``: an attention output the node reads merged from the
    slices' partial results (``slice_merges``), whose scratch it binds in the output's place. The node reads an
    input that one of its outputs is stored over (``in_place``), or an arena operand it stores over
    (``arena_aliases``), through the output's binding: one buffer range is bound once (WebGPU forbids a writable
    binding that overlaps another in one dispatch); a node storing over an input binds the status buffer too where
    ``stored_over.guarded``. Outputs side by side (``packed``) of which it reads several it reads through one
    binding of their range, each at its offset. ``unbound``: outputs it does not write, which get no slot (None)."""
    bound: list = []
    outs = {v.id for v in node.outs}
    stored_over = stored_over or StoredOver({}, False)
    same = {old: new for old, new in stored_over.values.items() if new in outs}
    guarded = bool(same) and stored_over.guarded
    same.update({old: new for old, new in stored_over.arena.items() if new in outs})  # (arena_aliases)
    read = {ld.args[0] for e in node.exprs() for ld in E.loads_of(e)} - outs
    grouped = {vid: key for vid, key in binding_keys(read, packed.group if packed else {}).items() if vid != key}
    same.update(grouped)
    shift = {vid: packed.offset[vid] // 4 for vid in grouped}  # (arena elements are 4 bytes: ``tensor_bytes``)

    def slot_of(vid) -> int:
        vid = same.get(vid, vid)
        if vid not in bound:
            bound.append(vid)
        return bound.index(vid)

    own = {v.id for v in node.outs} & {ld.args[0] for e in node.exprs() for ld in E.loads_of(e)}
    if own:  # other threads may not have written it yet: a race on GPUs that a serial CPU driver hides
        raise ValueError(f"{type(node).__name__} node reads its own output values {sorted(own)}")
    calls = {} if merged is None else {merged.vid: lambda index: merged.read(slot_of(merged.key), index)}
    exprs = [_linearise(e, d, values, stored, slot_of, calls, shift) for e, d in zip(node.exprs(), node.domains())]
    out_slots = [None if v.id in unbound else slot_of(v.id) for v in node.outs]
    if checks(exprs) or guarded:
        slot_of("status")

    def name(slot):
        return wgsl.STATUS_VAR if bound[slot] == "status" else f"b{slot}"

    if scratch_key is not None:
        slot_of(scratch_key)
    decl, storage = [], []
    for slot, vid in enumerate(bound):
        plain = vid == "status" or (vid in (scratch_key, merged and merged.key) and vid is not None)
        kind = "" if plain else _storage(values[vid[0] if isinstance(vid, tuple) else vid], stored)
        storage.append(kind)
        if vid == "status":
            decl.append((slot, wgsl.STATUS_VAR, "atomic<u32>"))
        else:
            decl.append((slot, name(slot), wgsl.STORAGE_TYPE[kind] if kind else "f32"))
    functions = "" if merged is None else merged.function(bound.index(merged.key), name)
    return Slots(bound, decl, storage, exprs, out_slots, name, guarded, functions)


def _storage(v: Value, stored: dict) -> str:
    """How ``v`` is stored where this plan keeps it: its dtype's storage in a buffer of its own, else in 32 bits."""
    return stored.get(v.id, "u32" if v.compute_dtype == E.BOOL else v.compute_dtype)


def _kernel(node: Node, values: dict, stored: dict, limits: dict, scratch: tuple[int, int] | None = None,
            variant: matmul_plans.MatmulChoice | None = None, stored_over: StoredOver | None = None,
            merged: ReaderMerge | None = None, packed: PackedLayout | None = None,
            unbound: set = frozenset()) -> list[tuple]:
    """(WGSL, workgroups, bound value ids in slot order) of each dispatch of one node: one, or two for a node cut
    into slices (``scratch``: slices and the arena key of their partial results). A matmul node's kernel is
    ``variant``; ``merged``, an attention output it reads merged from slices; ``unbound``, its outputs that its
    first dispatch does not write and nothing binds (a sliced attention's whose reader merges the slices).
    ``KERNELS`` holds the generator of each node type."""
    slots = _bindings(node, values, stored, scratch[1] if scratch is not None else None, stored_over, merged, packed,
                      unbound)
    generate = KERNELS.get(type(node))
    if generate is None:
        raise TypeError(f"no kernel for node {type(node).__name__}")
    if not isinstance(node, (Pointwise, Scatter)):  # (a scatter's pairs: ``regions``)
        refused = [pair_refusal(node, v.id, False) for v in node.outs
                   if stored.get(v.id) in HALF_STORAGE and storing_node(node, v.id) is node]
        if any(refused):
            raise TypeError(f"{type(node).__name__} node stores half precision: {next(filter(None, refused))}")
    return generate(node, slots, limits, scratch, variant)
