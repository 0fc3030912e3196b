"""Cache writes run by the attention that reads the cache: one dispatch per decode layer fewer.

A decode step writes each layer's new key and value rows into its caches, then attends over the caches: with a
static cache an update stored over the caches that changes the new rows alone (a ``Scatter``: ``regions``), with HF's
default cache two new tensors, each cache concatenated with its new row (a ``Pointwise`` node). Either way the writes
are graph outputs, so fusion keeps them a kernel of their own (no recomputation), and the attention reads what they
stored. Here the attention pass takes the update into its own dispatch (``Attention.writes``):

- the pass reads the updated values from the update's expressions, recomputed on each load as a prologue is
  (``fusion``): a concatenation's own expression; a region's new value where the element lies in the region, the
  updated input's element elsewhere (the region a box of the output: along each axis at its own coordinate, at a
  coordinate plus an offset, or at one place: ``_inverse``);
- its threads, across all its workgroups, also store the update (``kernels.attention.with_side_stores``): a region's
  elements over the input, only while the status word is clear where the plan checks data (``in_place``), or the
  whole concatenation into its new buffer. Nothing the pass reads is among what they store: an update stored over
  its input changes only elements that the pass reads from the update's expressions (it loads the input's old element
  there too, and discards it), a concatenation stores into a buffer of its own.

It applies to a forward pass and one update whose outputs are all graph outputs that no other node reads, read in
the pass's operands; an update over its whole output must not be stored over an input (a ``Pointwise`` with no
region that the caller asks to store in place would store every element while other workgroups read them), and a
``Scatter``'s region must be a box (``_inverse``). Neither the update nor the pass may check data (a failed run
must leave the inputs as they were: ``data_checks``), the update's expressions are those an attention prologue may
recompute (``fusion.PROLOGUE_OPS``: no transcendentals, no random numbers), and the kernel stays within the binding
limit with one to spare for the scratch of slices: where the update stores over its inputs it reads them through its
outputs' bindings, and binds the status buffer. The merged node runs where the attention's other operands allow: at
the update's place, or at the attention's where no node between them stores over an input (a counter's update
after the caches' writes). A Llama layer's merged kernel binds 10 buffers with the default cache (the query, key and
value, the rotary embedding's cosine and sine, the two caches and their concatenations, the output) and 10 with the
static cache (the position and the status word in place of the concatenations' two; the causal mask it computes from
the position: ``data_checks``), one more for the scratch of slices: the adapter's limits hold them (lavapipe's 32, a
GPU's more). Where the limit does not (WebGPU's default 8, a portable bundle's), the nodes of which the merged kernel
reads several outputs lay them side by side, each group bound once (``packed``): the layer's query, key and value
(one matmul: ``sibling_matmuls``), and the cosine and sine, 5 bindings in 2, so that the static cache's kernel binds
7 and a layer takes 5 dispatches (a GPT-2 layer's query, key and value are one tensor already). Where even that does
not fit, the update keeps a kernel of its own.
"""
from __future__ import annotations

from . import expr as E
from .bindings import checks
from .fusion import MAX_EXPR_NODES, PROLOGUE_OPS, FusionReport, _name
from .indexing import simplify
from .ir import Attention, Graph, Node, Pointwise, Scatter
from .packed import binding_count, groups, packable

# What an update's expressions may hold besides ``fusion.PROLOGUE_OPS``: a dynamic graph's sizes (a concatenation's
# offset is the cache's length).
UPDATE_OPS = PROLOGUE_OPS | {"size"}


def fuse_attention_writes(graph: Graph, max_bindings: int, report: FusionReport) -> int:
    """Run each update that a forward attention pass reads in the pass's dispatch, where the module docstring's
    rules allow; returns how many moved."""
    moved = 0
    for attention in [n for n in graph.nodes if isinstance(n, Attention)]:
        writer = _writer(graph, attention)
        if writer is None:
            continue
        merged, reason = _merged_operands(graph, attention, writer, max_bindings)
        place = None
        if reason is None:
            place, reason = _place(graph, attention, writer)
        if reason is not None:
            report.refused.append((_name(writer), _name(attention), reason))
            continue
        report.fused.append((_name(writer), _name(attention)))
        operands, packing = merged
        for node in packing:
            node.side_by_side = True
        graph.remove(writer)
        graph.remove(attention)
        graph.nodes.insert(place, attention)
        attention.set_exprs(operands)
        attention.writes = writer
        attention.outs = attention.outs + writer.outs
        moved += 1
    return moved


def _writer(graph: Graph, attention: Attention) -> Pointwise | Scatter | None:
    """The first update whose outputs are all graph outputs that the forward pass ``attention`` reads in its
    operands, or None."""
    if attention.kind != "forward" or attention.writes is not None:
        return None
    producers = graph.producers()
    outputs = {v.id for v in graph.outputs}
    for e in attention.exprs():
        for ld in E.loads_of(e):
            node = producers.get(ld.args[0])
            if ((isinstance(node, Scatter) or (isinstance(node, Pointwise) and node.region is None))
                    and all(v.id in outputs for v in node.outs)):
                return node
    return None


def _merged_operands(graph: Graph, attention: Attention, writer: Node,
                     max_bindings: int) -> tuple[tuple[list[E.Expr], list[Node]] | None, str | None]:
    """((``attention``'s operands reading the update's expressions in place of its outputs, the nodes whose outputs
    it then needs side by side to stay within ``max_bindings``: ``packed``), None) where ``writer`` may run in
    ``attention``'s dispatch (the module docstring), else (None, why not)."""
    own = {v.id for v in writer.outs}
    if any(n is not attention and any(ld.args[0] in own for e in n.exprs() for ld in E.loads_of(e))
           for n in graph.nodes):
        return None, "another node reads the update"
    if isinstance(writer, Pointwise) and own & {graph.outputs[p].id for p in graph.in_place}:
        return None, "an update of every element stored over its input (other workgroups read the elements it stores)"
    if checks(writer.exprs()) or checks(attention.exprs()):
        return None, "a kernel that checks data (a failed run must leave the inputs as they were)"
    if not all(n.op in UPDATE_OPS for e in writer.exprs() for n in E.walk(e)):
        return None, "an update that an attention prologue may not recompute (transcendentals or random numbers)"
    values = _updated_values(writer)
    if values is None:
        return None, "a region that is no box of its output"
    operands = [_inline(e, values, dom) for e, dom in zip(attention.exprs(), attention.domains())]
    if max(map(E.size, operands), default=0) > MAX_EXPR_NODES:
        return None, "expression too large"
    bases = set(writer.region.bases) if isinstance(writer, Scatter) else set()
    loaded = {ld.args[0] for e in operands + writer.exprs() for ld in E.loads_of(e)} - bases
    status = 1 if bases else 0  # (a writer over inputs binds the status buffer where the plan checks data)
    others = len(attention.outs) + len(writer.outs) + status + 1
    grouped = groups(graph.nodes)
    if binding_count(loaded, grouped) + others <= max_bindings:
        return (operands, []), None
    packing = packable(graph, loaded)
    if binding_count(loaded, grouped | groups([_side_by_side(n) for n in packing])) + others > max_bindings:
        return None, f"more than {max_bindings} storage bindings"
    return (operands, packing), None


def _side_by_side(node: Node) -> Node:
    """A stand-in for ``node`` with its outputs side by side (``packed``), to count bindings with."""
    return Node(node.outs, side_by_side=True)


def _updated_values(writer: Node) -> dict[int, E.Expr] | None:
    """{output value id: its element over the output's coordinates} of ``writer``, or None where a region is no
    box (``_inverse``)."""
    if isinstance(writer, Pointwise):
        return {v.id: e for v, e in zip(writer.outs, [writer.expr, *writer.also])}
    shape = writer.out.shape
    box = _inverse(writer.region.at, writer.region.shape, shape)
    if box is None:
        return None
    inside, to_region = box
    bounds = dict(enumerate(shape))
    keep = E.shift_coords(writer.region.keep, to_region)
    inside = simplify(inside if keep == E.const(True, E.BOOL) else E.binary("and", inside, keep), bounds)
    values = {}
    for v, new, base in zip(writer.outs, writer.region.values, writer.region.bases):
        old = E.load(base, tuple(E.coord(d) for d in range(len(shape))), new.dtype)
        values[v.id] = simplify(E.where(inside, E.shift_coords(new, to_region), old), bounds)
    return values


def _inverse(at: tuple, region_shape: tuple, shape: tuple) -> tuple[E.Expr, dict[int, E.Expr]] | None:
    """(whether an output element lies in the region, {region coordinate: its expression over the output's
    coordinates}) of a region whose coordinate d lands at output coordinate d, itself, plus an offset, or at one
    place where the region is one element long there (a coordinate-free expression: a position); None otherwise."""
    one = {d: E.const(0, E.I32) for d, n in enumerate(region_shape) if isinstance(n, int) and n == 1}
    conditions, to_region = [], {}
    for d, (where, n) in enumerate(zip(at, region_shape)):
        where, x = E.shift_coords(where, one), E.coord(d)
        if d in one and not _coords_of(where):  # one place along d (none to test where the output is one long)
            to_region[d] = E.const(0, E.I32)
            conditions += [] if _same(shape[d], 1) else [E.binary("eq", x, where)]
            continue
        if where == x:
            offset = E.const(0, E.I32)
        elif where.op == "add" and x in where.args and not _coords_of(_other(where.args, x)):
            offset = _other(where.args, x)
        else:
            return None
        to_region[d] = E.binary("sub", x, offset)
        if offset != E.const(0, E.I32) or not _same(n, shape[d]):
            conditions += [E.binary("ge", x, offset), E.binary("lt", x, E.add(offset, _extent(n)))]
    inside = E.const(True, E.BOOL)
    for condition in conditions:
        inside = condition if inside == E.const(True, E.BOOL) else E.binary("and", inside, condition)
    return inside, to_region


def _same(a, b) -> bool:
    """Whether extents ``a`` and ``b`` are the same, comparing symbolic sizes by their form (no guard recorded)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return not isinstance(a, int) and not isinstance(b, int) and E.SizeLeaf(a) == E.SizeLeaf(b)


def _other(args: tuple, x: E.Expr) -> E.Expr:
    return args[1] if args[0] == x else args[0]


def _extent(n) -> E.Expr:
    return E.const(n, E.I32) if isinstance(n, int) else E.Expr("size", (E.SizeLeaf(n),), E.I32)


def _coords_of(e: E.Expr) -> set[int]:
    return {n.args[0] for n in E.walk(e) if n.op == "coord"}


def _inline(e: E.Expr, values: dict[int, E.Expr], domain) -> E.Expr:
    """``e`` with each load of an updated value replaced by the value's expression at the load's coordinates."""
    def rewrite(n: E.Expr):
        if n.op == "load" and n.args[0] in values:
            return E.shift_coords(values[n.args[0]], dict(enumerate(n.args[1])))
        return None

    return simplify(E.substitute(e, rewrite), dict(enumerate(domain)))


def _place(graph: Graph, attention: Attention, writer: Node) -> tuple[int | None, str | None]:
    """(index in ``graph.nodes``, once both are taken out, where the merged node runs, None): the writer's place where
    everything else the pass reads is computed before it, else the pass's place where no node between them stores
    over an input (its request would be refused: a later kernel, the merged one, reads the input); or (None, why
    not)."""
    at_writer, at_attention = graph.position(writer), graph.position(attention)
    between = graph.nodes[at_writer + 1:at_attention]
    produced = {v.id for n in between for v in n.outs}
    read = {ld.args[0] for e in attention.exprs() for ld in E.loads_of(e)}
    if not read & produced:
        return at_writer, None
    if produced & {graph.outputs[p].id for p in graph.in_place}:
        return None, ("a node between the update and the attention stores over an input, and the attention reads "
                      "its work")
    return at_attention - 1, None
