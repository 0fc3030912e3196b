"""Outputs written over an input's buffer: the updates a caller asks for in ``Graph.in_place``, where they are safe.

A training step returns each parameter's and optimizer state's new value, and a cache update returns the cache
changed in a few places. Given a buffer of its own, every such output doubles the memory of what it updates (the
caller keeps both and alternates). Where the caller asks (``Graph.in_place``: output position -> the name of the
``Input`` it replaces, whose old value the caller will not read again) and it is safe, the output is stored in the
input's buffer instead.

It is safe when the kernel storing the output reads the input only at the element it stores, and no later kernel
reads the input. The kernel is then a pointwise one (each thread computes all its values before it stores any, and
stores at its own linear index: ``kernels.pointwise``), so every read of the old value comes before the write of
that element. A reduction (``Reduce``) may store a row result over an input that only its row results read, each at
its own row (BatchNorm's running statistics, updated from the batch's): one thread of the row computes them after
every phase and stores them after computing them all (``kernels.reduce``). A ``Scatter`` (``regions``) stores
only the elements it changes, at computed places, so it is safe only over its base, the input whose other elements
its outputs keep, and where it does not read that input at all (another thread may have stored over the element it
reads). A run that fails a check (an index out of range) must
leave the input as it was, so no kernel from the writer on may check anything (``data_checks`` moves those checks
ahead of the writers), and where the plan checks data the writer stores only while the status word is clear
(``StoredOver.guarded``). Requests that are not safe are refused, with the reason, and the output keeps a buffer of its
own.

The same rule lets an intermediate take the arena range of an operand it is the last to read (``arena_aliases``):
no request is needed there, since nothing outside the run reads the arena.
"""
from __future__ import annotations

from typing import NamedTuple

from meganeura.kernels.sizes import is_size
from meganeura.runtime.dtypes import STORAGE

from . import expr as E
from .bindings import checks
from .indexing import linear_index, simplify
from .ir import Graph, Input, Matmul, Node, Pointwise, Reduce, Scatter, Value, last_reads, storing_node


class StoredOver(NamedTuple):
    """What the kernels of a plan with in-place outputs need to know."""

    values: dict[int, int]  # input value id -> id of the output value stored over it
    guarded: bool  # the plan checks data: the writers store only while the status word is clear
    arena: dict[int, int] = {}  # arena value id -> id of the value its last reader stores over it (``arena_aliases``)


def in_place_outputs(graph: Graph, kernels: list[Node]) -> tuple[dict[int, Input], dict[int, str]]:
    """({output position: the Input it is stored over}, {output position: why not}) for ``graph.in_place``'s
    requests, with the kernels in dispatch order."""
    inputs = {n.name: n for n in graph.nodes if isinstance(n, Input)}
    producers = graph.producers()
    step = {id(n): i for i, n in enumerate(kernels)}
    last_read = last_reads(kernels)
    last_check = max((i for i, n in enumerate(kernels) if checks(n.exprs())), default=-1)
    positions: dict[int, list[int]] = {}
    for i, v in enumerate(graph.outputs):
        positions.setdefault(v.id, []).append(i)
    granted: dict[int, Input] = {}
    refused: dict[int, str] = {}
    for position, name in sorted(graph.in_place.items()):
        target = inputs.get(name)
        reason = ("no input of that name" if target is None
                  else _refusal(graph.outputs[position], target, producers, step, last_read, last_check, positions))
        if reason is None and any(g is target for g in granted.values()):
            reason = "another output is stored over the same input"
        if reason is None:
            granted[position] = target
        else:
            refused[position] = reason
    return granted, refused


def _refusal(v: Value, target: Input, producers: dict, step: dict, last_read: dict, last_check: int,
             positions: dict) -> str | None:
    """Why ``v`` cannot be stored over ``target``'s buffer, or None."""
    if len(positions[v.id]) > 1:
        return "the value is returned at several positions"
    writer = producers[v.id]
    reason = writer_refusal(v, target, writer)
    if reason is not None:
        return reason
    if last_read.get(target.out.id, -1) > step[id(writer)]:
        return "a later kernel reads the input"
    if last_check >= step[id(writer)]:
        return "a kernel from its own on checks data (a failed run must leave the input as it was)"
    return None


def writer_refusal(v: Value, target: Input, writer: Node) -> str | None:
    """Why ``writer``'s output ``v`` cannot be stored over ``target``'s buffer whatever the kernels' order, or None:
    the rules of the module docstring but those on the kernels before and after it."""
    writer = storing_node(writer, v.id)  # (an update an attention pass runs: its own rules, ``attention_writes``)
    old = target.out
    if target.role != "input":
        return "the input is a param buffer, which the plan does not rebind per run"
    if v.shape != old.shape or STORAGE[v.dtype] != STORAGE[old.dtype]:
        return f"{v.dtype}{list(v.shape)} is not stored as the input {old.dtype}{list(old.shape)} is"
    if isinstance(writer, Scatter):
        return _scatter_refusal(v, old, writer)
    if isinstance(writer, Reduce):
        return _row_result_refusal(v, old, writer)
    if not isinstance(writer, Pointwise):
        return f"its kernel is a {type(writer).__name__}, not pointwise"
    bounds = dict(enumerate(writer.out.shape))
    here = simplify(linear_index([E.coord(d) for d in range(len(bounds))], writer.out.shape), bounds)
    for e in writer.exprs():
        for ld in E.loads_of(e):
            if ld.args[0] == old.id and simplify(linear_index(ld.args[1], old.shape), bounds) != here:
                return "its kernel reads the input at other elements"
    return None


def _scatter_refusal(v: Value, old: Value, writer: Scatter) -> str | None:
    """Why ``writer``, which stores only the elements it changes, cannot store ``v`` over ``old``, or None."""
    if dict(zip((o.id for o in writer.outs), writer.region.bases)).get(v.id) != old.id:
        return "its kernel stores only the elements it changes, and the input is not the one it updates"
    if any(ld.args[0] == old.id for e in writer.exprs() for ld in E.loads_of(e)):
        return "its kernel stores only the elements it changes and reads the input (another thread's element)"
    return None


def _row_result_refusal(v: Value, old: Value, writer: Reduce) -> str | None:
    """Why reduction ``writer`` cannot store ``v`` over ``old``, or None. A row result is computed and stored by one
    thread of its row, after every phase, all its values computed before it stores any (``kernels.reduce``): it may
    be stored over an input that only the row results read, each at its own row (a BatchNorm's running statistics,
    updated from the batch's). Phases and element results run in every thread of a row (in a cut row, of several
    workgroups, without a barrier before the row result's store), so they must not read it."""
    position = [o.id for o in writer.outs].index(v.id)
    if writer.results[position].per_element:
        return "its kernel is a Reduce and the value one of its element results, stored by every thread of a row"
    n_phases = len(writer.phases)
    if any(ld.args[0] == old.id for e in writer.exprs()[:n_phases] for ld in E.loads_of(e)) or any(
            ld.args[0] == old.id for r in writer.results if r.per_element for ld in E.loads_of(r.expr)):
        return "its kernel is a Reduce whose phases or element results read the input"
    bounds = dict(enumerate(writer.domain))
    outer = [d for d in range(len(writer.domain)) if d not in writer.axes]
    here = simplify(linear_index([E.coord(d) for d in outer], writer.row_shape), bounds)
    for r in writer.results:
        for ld in E.loads_of(r.expr):
            if ld.args[0] == old.id and simplify(linear_index(ld.args[1], old.shape), bounds) != here:
                return "its kernel reads the input at other rows"
    return None


def arena_aliases(kernels: list[Node], placement: dict, values: dict[int, Value]) -> dict[int, int]:
    """{value id: id of the arena value its last reader stores over it}: where a kernel computes a value of the same
    shape and arena storage as an operand it is the last to read, reading it only at the element it stores, the
    two share one arena range (the operand's lifetime ends where the value's begins). The same rule as for outputs
    stored over inputs (the module docstring), for a pointwise kernel and for a matmul's epilogue, which the kernel
    evaluates once per element, in the thread that stores it (``kernels.matmul``), the operands being other
    tensors. The unfused attention backward's dS is so stored over its score matrix (Whisper-tiny: one 51.5 MiB
    matrix of two). ``placement``: the values with buffers of their own (not in the arena); ``values`` by id."""
    last_read = last_reads(kernels)
    aliases: dict[int, int] = {}
    for step, node in enumerate(kernels):
        target = _arena_target(node, step, placement, last_read, values)
        if target is not None:
            aliases[target] = node.outs[0].id
    return aliases


def _arena_target(node: Node, step: int, placement: dict, last_read: dict, values: dict) -> int | None:
    """The id of the arena operand ``node`` may store its one output over (``arena_aliases``), or None."""
    if len(node.outs) != 1 or node.outs[0].id in placement:
        return None
    if isinstance(node, Pointwise):
        domain, free = node.exprs(), []
    elif isinstance(node, Matmul) and not node.more_blocks:
        domain, free = [node.epilogue], [node.a, node.b, *node.products, *node.row_phases]
    else:
        return None
    out = node.outs[0]
    shape = node.domains()[2] if isinstance(node, Matmul) else out.shape  # (the epilogue's)
    if any(is_size(s) for s in (*shape, *out.shape)):
        return None
    bounds = dict(enumerate(shape))
    here = simplify(linear_index([E.coord(d) for d in range(len(shape))], shape), bounds)
    operands = dict.fromkeys(ld.args[0] for e in domain for ld in E.loads_of(e))
    avoided = {ld.args[0] for e in free for ld in E.loads_of(e)}
    for vid in operands:
        old = values.get(vid)
        if (vid in placement or vid in avoided or last_read.get(vid) != step or old is None
                or any(is_size(s) for s in old.shape) or old.numel != out.numel
                or old.compute_dtype != out.compute_dtype):
            continue
        if all(simplify(linear_index(ld.args[1], old.shape), bounds) == here
               for e in domain for ld in E.loads_of(e) if ld.args[0] == vid):
            return vid
    return None


def hoist_writers(graph: Graph) -> int:
    """Move each pointwise kernel that writes a requested in-place output up the node order, to just after the last
    node it must follow: the producers of what it reads, the other readers of the inputs it overwrites, and any
    node that checks data (so that the request stays grantable). A training step traces the whole backward before
    the optimizer, so every gradient would otherwise stay in the arena until the end; moved up, a parameter's update
    runs as soon as its gradient is complete, and the gradient's arena range is free again. Returns how many moved."""
    inputs = {n.name: n for n in graph.nodes if isinstance(n, Input)}
    producers = graph.producers()
    targets: dict[int, set[int]] = {}  # writer id -> value ids of the inputs it overwrites
    writers: dict[int, Pointwise] = {}
    for position, name in graph.in_place.items():
        writer = producers.get(graph.outputs[position].id)
        if isinstance(writer, Pointwise) and name in inputs:
            writers[id(writer)] = writer
            targets.setdefault(id(writer), set()).add(inputs[name].out.id)
    reads = {id(n): {ld.args[0] for e in n.exprs() for ld in E.loads_of(e)} for n in graph.nodes}
    checking = {id(n) for n in graph.nodes if checks(n.exprs())}
    moved = 0
    for writer in sorted(writers.values(), key=graph.position):
        at = graph.position(writer)
        loaded = reads[id(writer)]
        earliest = 0
        for i, node in enumerate(graph.nodes[:at]):
            if (id(node) in checking or reads[id(node)] & targets[id(writer)]
                    or any(v.id in loaded for v in node.outs)):
                earliest = i + 1
        if earliest < at:
            graph.nodes.insert(earliest, graph.nodes.pop(at))
            moved += 1
    return moved
