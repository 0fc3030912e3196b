"""Epilogue fusion: move a pointwise consumer into the kernel of the reduction or matmul it reads.

After inlining, a Pointwise node C that is the only reader of a Reduce/Matmul result R can be computed by
R's kernel instead of a dispatch of its own, when C reads R element for element:
  * an element result of a reduction or a matmul output, read at C's own linear index (reshapes allowed):
    C's expression replaces R's result, evaluated at the producer's coordinates;
  * a per-row reduction result read at the row of each element, with C covering the reduction's domain
    (RMS norm: ``x * rsqrt(mean(x^2) + eps) * w``): C becomes a new element result of the reduction;
  * per-row results read by a C of the rows' shape (BatchNorm's rsqrt(var + eps), its running statistics):
    C becomes a new row result.
A consumer that becomes a new result leaves the results it read in place, so those may have other readers; one
that replaces a result must be its only reader.
Any other result of R that C reads (layer norm's rstd next to its mean) is substituted the same way: a kernel never
loads its own output, which another thread may not have written yet. C's other inputs must already exist when the
producer runs, and the kernel must stay within the binding limit. Every refusal is recorded with its reason.
"""
from __future__ import annotations

from . import expr as E
from .fusion import FusionReport, _name
from .indexing import linear_index, simplify
from .ir import Graph, Input, Matmul, Pointwise, Reduce, RowOutput
from .builder import unravel


def fuse_epilogues(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Passes over the graph until no consumer moves. The value maps are kept up to date across merges, and a
    refused (consumer, value) pair is not tried again: every refusal reason stays true as producers grow."""
    outputs = {v.id for v in graph.outputs}
    users = graph.users()
    producers = graph.producers()
    position = {v.id: i for i, n in enumerate(graph.nodes) for v in n.outs}  # order only: removals keep it
    refused: set[tuple[int, int]] = set()
    merged: set[int] = set()
    changed = True
    while changed:
        changed = False
        for consumer in list(graph.nodes):
            if not isinstance(consumer, Pointwise) or id(consumer) in merged:
                continue
            loaded = list(dict.fromkeys(ld.args[0] for ld in E.loads_of(consumer.expr)))
            for vid in loaded:
                producer = producers[vid]
                if not isinstance(producer, (Reduce, Matmul)) or (id(consumer), vid) in refused:
                    continue
                index = next(i for i, v in enumerate(producer.outs) if v.id == vid)
                if not _is_row_result(producer, index) and (vid in outputs or len(users.get(vid, [])) != 1):
                    continue
                reason, read_rows = _try_merge(graph, consumer, producer, vid, position, producers, max_bindings)
                if reason is not None:
                    refused.add((id(consumer), vid))
                    report.refused.append((_name(consumer), _name(producer), reason))
                    continue
                report.fused.append((_name(consumer), _name(producer)))
                merged.add(id(consumer))
                _update_maps(consumer, producer, loaded, users, producers, position, vid)
                _drop_unread_rows(producer, read_rows - outputs, users)
                changed = True
                break


def _update_maps(consumer, producer, loaded, users, producers, position, vid) -> None:
    """After ``consumer`` moved into ``producer``: who loads what, and who produces the consumer's value."""
    for v in loaded:
        users[v] = [n for n in users.get(v, []) if n is not consumer]
    for e in producer.exprs():
        for ld in E.loads_of(e):
            readers = users.setdefault(ld.args[0], [])
            if not any(n is producer for n in readers):
                readers.append(producer)
    producers[consumer.out.id] = producer
    position[consumer.out.id] = position[vid]


def _drop_unread_rows(producer, rows: set[int], users) -> None:
    """Row results the moved consumer read that nobody loads any more (and that are not graph outputs)."""
    for u in rows:
        if not users.get(u):
            i = next(i for i, v in enumerate(producer.outs) if v.id == u)
            producer.results.pop(i)
            producer.outs.pop(i)


def _try_merge(graph, consumer: Pointwise, producer, vid, position, producers,
               max_bindings) -> tuple[str | None, set[int]]:
    """Merge ``consumer`` into ``producer`` if it reads ``vid`` element for element: (None, the producer's row
    results the consumer read), else (why not, empty)."""
    domain = producer.domain if isinstance(producer, Reduce) else (producer.batch, producer.m, producer.n)
    index = next(i for i, v in enumerate(producer.outs) if v.id == vid)
    per_row = (isinstance(producer, Reduce) and consumer.out.numel == _numel(producer.row_shape)
               and consumer.out.numel != _numel(domain))
    if consumer.out.numel != _numel(domain) and not per_row:
        return "consumer covers neither the producer's iteration domain nor its rows", set()
    moved = _at_producer(consumer, producer, domain, per_row)
    own = {v.id: i for i, v in enumerate(producer.outs)}
    reason = _own_results_refusal(moved, producer, domain, per_row, own)
    if reason is not None:
        return reason, set()
    start = position[vid]
    others = {ld.args[0] for ld in E.loads_of(moved)} - set(own)
    if any(position[o] > start and not isinstance(producers[o], Input) for o in others):
        return "consumer reads a value computed after the producer", set()
    existing = {ld.args[0] for e in producer.exprs() for ld in E.loads_of(e)}
    if len(existing | others) + len(producer.outs) + 2 > max_bindings:
        return f"more than {max_bindings} storage bindings", set()
    read_rows = {ld.args[0] for ld in E.loads_of(moved)
                 if ld.args[0] in own and _is_row_result(producer, own[ld.args[0]])}
    merged = simplify(E.substitute(moved, _results_of(producer, own)), dict(enumerate(domain)))
    _merge(graph, consumer, producer, index, merged, per_row)
    return None, read_rows


def _at_producer(consumer: Pointwise, producer, domain, per_row: bool) -> E.Expr:
    """The consumer's expression at the producer's coordinates, through the shared linear index (of the rows' shape
    for a per-row consumer)."""
    if per_row:
        outer = [E.coord(d) for d in range(len(domain)) if d not in producer.axes]
        to_consumer = unravel(linear_index(outer, producer.row_shape), consumer.out.shape)
    else:
        to_consumer = unravel(linear_index([E.coord(d) for d in range(len(domain))], domain), consumer.out.shape)
    return simplify(E.shift_coords(consumer.expr, dict(enumerate(to_consumer))), dict(enumerate(domain)))


def _own_results_refusal(moved: E.Expr, producer, domain, per_row: bool, own: dict[int, int]) -> str | None:
    """Why the moved consumer cannot read the producer's results as it does, or None. Every result of the producer
    that it reads (not only the one it was found through: layer norm's mean and rstd) becomes the result's
    expression inside the producer's kernel, so it must be read at the element (or row) the kernel is computing:
    a load from the kernel's own output would race with the thread that writes it."""
    dbounds = dict(enumerate(domain))
    for ld in E.loads_of(moved):
        i = own.get(ld.args[0])
        if i is None:
            continue
        if per_row and not _is_row_result(producer, i):
            return "a per-row consumer reads an element result"
        if _is_row_result(producer, i):
            outer = [E.coord(d) for d in range(len(domain)) if d not in producer.axes]
            want = simplify(linear_index(outer, producer.outs[i].shape), dbounds)
        else:
            want = simplify(linear_index([E.coord(d) for d in range(len(domain))], domain), dbounds)
        if simplify(linear_index(ld.args[1], producer.outs[i].shape), dbounds) != want:
            return "consumer reads a result of the producer at other elements"
    return None


def _results_of(producer, own: dict[int, int]):
    """``E.substitute``'s rewrite: a load of one of the producer's results becomes that result's expression."""
    def replace(node):
        if node.op == "load" and node.args[0] in own:
            return producer.epilogue if isinstance(producer, Matmul) else producer.results[own[node.args[0]]].expr
        return None
    return replace


def _merge(graph, consumer: Pointwise, producer, index: int, merged: E.Expr, per_row: bool) -> None:
    """``consumer`` (computing ``merged`` in the producer's terms) moves into ``producer``: the matmul's epilogue, a
    new result of the reduction (where it read a row result), or the result ``index`` it replaces."""
    if isinstance(producer, Matmul):
        producer.epilogue = merged
        producer.outs = [consumer.out]
    elif _is_row_result(producer, index):
        producer.results.append(RowOutput(not per_row, merged))
        producer.outs.append(consumer.out)
    else:
        producer.results[index] = RowOutput(True, merged)
        producer.outs[index] = consumer.out
    graph.remove(consumer)


def _is_row_result(producer, index: int) -> bool:
    return isinstance(producer, Reduce) and not producer.results[index].per_element


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n
