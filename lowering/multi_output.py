"""Multi-output fusion: a pointwise value that several kernels read is stored by its first pointwise reader.

Inlining copies a computing producer only into a single consumer, so a value with two readers (or one reader and a
graph output) stays a dispatch of its own. An optimizer update is the usual case: Adam's new ``exp_avg`` is both a
state output and an input of the new parameter. When a Pointwise node C reads such a Pointwise producer P element
for element (at C's own linear index), C can compute P's expressions in registers and also store them:
P's outputs become further outputs of C, and P's dispatch disappears. The other readers of P must come after C in
the plan (they now read what C writes), and the kernel must stay within the binding and expression limits. Every
refusal is recorded with its reason.
"""
from __future__ import annotations

from . import expr as E
from .builder import unravel
from .fusion import MAX_EXPR_DEPTH, MAX_EXPR_NODES, FusionReport, _name
from .indexing import linear_index, simplify
from .ir import Graph, Pointwise


def fuse_multi_output(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Merge Pointwise producers into their first element-wise Pointwise reader until none moves."""
    users = graph.users()
    producers = graph.producers()
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    for consumer in list(graph.nodes):
        if not isinstance(consumer, Pointwise):
            continue
        refused: set[int] = set()
        while True:
            candidates = [producers[vid] for vid in _loaded(consumer)
                          if isinstance(producers[vid], Pointwise) and id(producers[vid]) not in refused]
            if not candidates:
                break
            producer = candidates[0]
            reason = _try_merge(graph, consumer, producer, users, order, max_bindings)
            if reason is not None:
                refused.add(id(producer))
                report.refused.append((_name(producer), _name(consumer), reason))
                continue
            report.fused.append((_name(producer), _name(consumer)))
            for v in producer.outs:
                producers[v.id] = consumer
                users[v.id] = [n for n in users.get(v.id, []) if n is not consumer]
            for vid in _loaded(consumer):
                readers = users.setdefault(vid, [])
                if not any(n is consumer for n in readers):
                    readers.append(consumer)


def _loaded(node) -> list[int]:
    return list(dict.fromkeys(ld.args[0] for e in node.exprs() for ld in E.loads_of(e)))


def _try_merge(graph, consumer: Pointwise, producer: Pointwise, users, order, max_bindings) -> str | None:
    """Make ``producer``'s outputs further outputs of ``consumer``; None when done, else why not."""
    if consumer.out.numel != producer.out.numel:
        return "consumer and producer differ in size"
    if consumer.region is not None or producer.region is not None:
        return "an update that carries the elements it changes (regions.py)"
    own = {v.id for v in producer.outs}
    later_readers = {id(n) for v in own for n in users.get(v, []) if n is not consumer}
    if any(order[r] < order[id(consumer)] for r in later_readers):
        return "another reader of the producer runs before the consumer"
    bounds = dict(enumerate(consumer.out.shape))
    here = simplify(linear_index([E.coord(d) for d in range(len(consumer.out.shape))], consumer.out.shape), bounds)
    exprs = consumer.exprs()
    for ld in (ld for e in exprs for ld in E.loads_of(e) if ld.args[0] in own):
        shape = next(v.shape for v in producer.outs if v.id == ld.args[0])
        if simplify(linear_index(ld.args[1], shape), bounds) != here:
            return "consumer reads the producer at other elements"
    deepest = max(E.depth(e) for e in exprs) + max(E.depth(e) for e in producer.exprs())
    if deepest > MAX_EXPR_DEPTH:  # checked before the merged expressions are built: building them recurses
        return "expression too deep"
    # The producer's expressions, over the consumer's coordinates through the shared linear index.
    to_producer = dict(enumerate(unravel(here, producer.out.shape)))
    moved = [simplify(E.shift_coords(e, to_producer), bounds) for e in producer.exprs()]
    by_value = {v.id: e for v, e in zip(producer.outs, moved)}

    def replace(node):
        if node.op == "load" and node.args[0] in by_value:
            return by_value[node.args[0]]
        return None

    merged = [simplify(E.substitute(e, replace), bounds) for e in exprs] + moved
    if sum(E.size(e) for e in merged) > MAX_EXPR_NODES:
        return "expression too large"
    loaded = {ld.args[0] for e in merged for ld in E.loads_of(e)}
    if len(loaded) + len(consumer.outs) + len(producer.outs) + 1 > max_bindings:
        return f"more than {max_bindings} storage bindings"
    consumer.outs = consumer.outs + producer.outs
    consumer.set_exprs(merged)
    graph.remove(producer)
    return None
