"""Rematerialization: a cheap pointwise value that a much later kernel reads again is computed again there, not kept.

A training step's graph holds the forward and the backward, so a value the backward reads stays in the arena from
the forward to the backward. Where it is a pointwise function of values that are kept that long anyway (BatchNorm's
``x - mean`` and ``(x - mean) * rstd`` beside the convolution output they come from), holding it costs memory and
saves almost nothing: its later readers can compute it from what they already read. Fusion never recomputes (a
computing producer inlines only into its single consumer), so this pass gives each later reader a copy of the node,
which fusion then inlines into it.

A node is copied only where that is cheap and shortens what the arena holds: it is pointwise plain arithmetic (the
ops fusion recomputes in attention prologues, ``fusion.PROLOGUE_OPS``: no transcendental, no random draw), and what
it reads is kept that long anyway: graph inputs, values read at least as late as its own last reader (their
lifetimes do not grow; nodes are taken in order, and a copied value's last read is then its last near reader's),
values ``SMALL_RATIO`` times smaller (BatchNorm's per-channel mean, kept longer for them), or cheap pointwise values
computed from such, whose expressions the copy takes in (a view, ``x - mean``, then the
normalization of BatchNorm's output). A reader must come at least
``REMAT_DISTANCE`` nodes after its first reader (a nearby reader gains nothing from a copy). Its first reader keeps
the original; every reader from the distance on reads a copy placed just before it.
"""
from __future__ import annotations

from . import expr as E
from .fusion import PROLOGUE_OPS
from .indexing import simplify
from .ir import Graph, Input, Pointwise, Value

# Readers this many nodes after a value's first reader get a copy. Small enough that a forward value read by its
# layer's backward qualifies (an HF ResNet block's forward and backward are hundreds of nodes apart), large enough
# that the readers within one layer's forward share the stored value.
REMAT_DISTANCE = 64
REMAT_MAX_NODES = 64  # the largest recomputed expression: a few elementwise ops (BatchNorm's affine normalization)
SMALL_RATIO = 64  # a value this many times smaller than the copied one may live longer for it (a per-channel mean)


def rematerialize(graph: Graph) -> int:
    """Give far readers of cheap pointwise values their own copies (module docstring); returns how many were made."""
    outputs = {v.id for v in graph.outputs}
    inputs = {n.out.id for n in graph.nodes if isinstance(n, Input)}
    producers = graph.producers()
    values = {v.id: v for n in graph.nodes for v in n.outs}
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    readers: dict[int, list] = {}
    for node in graph.nodes:
        for vid in dict.fromkeys(ld.args[0] for e in node.exprs() for ld in E.loads_of(e)):
            readers.setdefault(vid, []).append(node)
    last_read = {vid: max(position[id(n)] for n in nodes) for vid, nodes in readers.items()}
    next_id = 1 + max(v.id for n in graph.nodes for v in n.outs)
    copies: list[tuple[object, Pointwise]] = []  # (reader, copy to place before it)
    for node in graph.nodes:
        if not isinstance(node, Pointwise) or node.out.id in outputs:
            continue
        vid = node.out.id
        far = _far_readers(readers.get(vid, []), position)
        if not far or not _cheap(node) or node.is_view():  # (walked only where it has far readers)
            continue
        until, small = last_read[vid], node.out.numel // SMALL_RATIO

        def kept(u: int) -> bool:
            return u in inputs or last_read.get(u, -1) >= until or values[u].numel <= small

        expr = recomputed(node.expr, producers, kept)
        if expr is None:
            continue
        expr = simplify(expr, dict(enumerate(node.out.shape)))
        for ld in E.loads_of(expr):  # a small value read by the copies now lives until they run
            last_read[ld.args[0]] = max(last_read.get(ld.args[0], -1), until)
        for reader in far:
            copy = Pointwise([Value(next_id, node.out.shape, node.out.dtype)], expr, node.label)
            next_id += 1
            values[copy.out.id], producers[copy.out.id] = copy.out, copy  # a later node may read it
            _redirect(reader, vid, copy.out.id)
            copies.append((reader, copy))
        last_read[vid] = max(position[id(n)] for n in readers[vid] if not any(n is f for f in far))
    if copies:
        before: dict[int, list[Pointwise]] = {}
        for reader, copy in copies:
            before.setdefault(id(reader), []).append(copy)
        graph.nodes = [m for n in graph.nodes for m in (*before.get(id(n), ()), n)]
    return len(copies)


def _cheap(node) -> bool:
    """A pointwise node of one output and plain arithmetic only."""
    return (isinstance(node, Pointwise) and not node.also
            and all(n.op in PROLOGUE_OPS for n in E.walk(node.expr)))


def recomputed(expr: E.Expr, producers: dict, kept) -> E.Expr | None:
    """``expr`` with each load of a value that is not ``kept`` replaced by its cheap producer's expression, down to
    kept values; None where a load leads to anything else, or past ``REMAT_MAX_NODES``. Equal loads share one
    inlined expression, counted once. The inlined expressions are counted as they are taken in, so a long chain of cheap
    values (a residual stream) is given up on at once rather than followed to its end."""
    budget = [REMAT_MAX_NODES - E.size(expr)]
    failed = []
    inlined: dict[E.Expr, E.Expr] = {}  # equal loads (ReLU reads x three times) share one inlined expression

    def rewrite(node: E.Expr):
        if failed or node.op != "load" or kept(node.args[0]):
            return None
        if node in inlined:
            return inlined[node]
        producer = producers.get(node.args[0])
        if _cheap(producer):
            budget[0] -= E.size(producer.expr)
        if not _cheap(producer) or budget[0] < 0:
            failed.append(node)
            return None
        inner = E.substitute(producer.expr, rewrite)
        if failed:
            return None
        inlined[node] = E.shift_coords(inner, dict(enumerate(node.args[1])))
        return inlined[node]

    result = E.substitute(expr, rewrite)
    return None if failed or E.size(result) > REMAT_MAX_NODES else result


def _far_readers(nodes: list, position: dict) -> list:
    """The readers at least ``REMAT_DISTANCE`` nodes after the first one."""
    if len(nodes) < 2:
        return []
    first = min(position[id(n)] for n in nodes)
    return [n for n in nodes if position[id(n)] - first >= REMAT_DISTANCE]


def _redirect(node, old: int, new: int) -> None:
    """Make ``node``'s loads of value ``old`` load value ``new``."""
    def rewrite(e: E.Expr):
        if e.op == "load" and e.args[0] == old:
            return E.load(new, e.args[1], e.dtype)
        return None

    node.set_exprs([E.substitute(e, rewrite) for e in node.exprs()])
