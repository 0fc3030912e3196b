"""Fusion: fold pointwise producers into the expressions of their consumers.

Walking the graph in order, every Pointwise node becomes a candidate for inlining. A consumer takes a
candidate unless a rule refuses it, and every refusal is recorded with its reason:
  * a view (a single load) inlines into every consumer: it only changes index math;
  * a computing producer inlines only into its single consumer, and only if it is not also a graph output (no
    recomputation: multi-output fusion later lets its consumer store it);
  * matmul operands take views only (their loads repeat and must stay cheap);
  * attention operands take views and cheap prologues: a single-consumer producer of at most
    ``PROLOGUE_MAX_LOADS`` loads and plain arithmetic (no transcendentals, no RNG), recomputed on every load. This
    folds rotary embeddings (q * cos + rotate_half(q) * sin) into the attention loads;
  * a kernel may not exceed the device's storage-buffer bindings, ``MAX_EXPR_NODES`` nor ``MAX_EXPR_DEPTH``.
Values that end up read by no kernel (and are not graph outputs) are dropped, as are unused results of
multi-output reductions and a forward attention's unread log-sum-exp (before inlining, so that a prologue may take
its binding); other multi-output nodes are kept whole while any of their results is used.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from . import expr as E
from .indexing import simplify
from .ir import Attention, Graph, Input, Matmul, Node, Pointwise, Reduce, kernel_forms

log = logging.getLogger("meganeura.lowering.fusion")
MAX_EXPR_NODES = 1500  # a fused expression past this many nodes is kept apart: kernel text and its compile grow with it
# A fused expression nested deeper than this is kept apart too: the passes that rebuild expressions recurse once per
# level (a few Python frames each) and run deep in dynamo's stack, under Python's default limit of 1,000 frames. A
# loop of a few hundred pointwise steps (x = x * a + b) is then a few kernels, not a failed compile.
MAX_EXPR_DEPTH = 96
PROLOGUE_MAX_LOADS = 6
# Rounding to a half precision is a few integer operations, as cheap as index arithmetic: a half precision model's
# rotary embedding and repeated KV heads, rounded to its dtype, stay attention prologues; a rounded view, a matmul
# operand.
ROUNDINGS = ("round_bf16", "round_f16")
# A NaN test is a few integer operations on the bits too: ReLU keeps NaN (``where(isnan(x), x, max(x, 0))``), and a
# ReLU output is then cheap to compute again where the backward reads it (``remat``).
PROLOGUE_OPS = {"load", "const", "coord", "cast", *ROUNDINGS, "isnan", "neg", "add", "sub", "mul", "where", "maximum",
                "minimum", "idiv", "imod", "not", *E.BINARY_COMPARE, *E.BINARY_LOGIC}


@dataclass
class FusionReport:
    fused: list[tuple[str, str]] = field(default_factory=list)  # (producer, consumer)
    refused: list[tuple[str, str, str]] = field(default_factory=list)  # (producer, consumer, reason)

    def summary(self) -> str:
        return f"{len(self.fused)} producers fused, {len(self.refused)} fusions refused"


def _name(node: Node) -> str:
    label = getattr(node, "label", "") or type(node).__name__.lower()
    return f"{label}#v{node.out.id}"


def fuse(graph: Graph, max_bindings: int) -> FusionReport:
    report = FusionReport()
    producers = graph.producers()
    users = graph.users()
    outputs = {v.id for v in graph.outputs}
    _drop_unread_lse(graph, users, outputs)
    candidates: dict[int, Pointwise] = {}

    for node in graph.nodes:
        if isinstance(node, Input):
            continue
        _inline_into(node, candidates, producers, max_bindings, report)
        if isinstance(node, Pointwise):
            vid = node.out.id
            node_users = users.get(vid, [])
            if node.is_view():
                candidates[vid] = node
            elif len(node_users) == 1 and vid not in outputs:
                candidates[vid] = node
            elif node_users:
                reason = "a graph output" if vid in outputs else f"{len(node_users)} consumers"
                for u in node_users:
                    report.refused.append((_name(node), _name(u), f"{reason} (no recomputation)"))

    _prune(graph, outputs)
    for producer, consumer in report.fused:
        log.debug("fused %s into %s", producer, consumer)
    for producer, consumer, reason in report.refused:
        log.debug("kept %s apart from %s: %s", producer, consumer, reason)
    return report


def inline_candidates(graph: Graph, nodes: list[Pointwise], max_bindings: int, report: FusionReport) -> None:
    """Inline the pointwise ``nodes`` into each of their readers that takes them (``_takes``), within the rules of a
    kernel's size and bindings, computed again by each: cheap index arithmetic that a check kept apart until fusion
    (``data_checks``). Those no node reads any more are dropped."""
    candidates = {n.out.id: n for n in nodes}
    for node in graph.nodes:
        if not isinstance(node, Input) and any(ld.args[0] in candidates for e in node.exprs() for ld in E.loads_of(e)):
            _inline_into(node, candidates, None, max_bindings, report)
    read = {ld.args[0] for n in graph.nodes for e in n.exprs() for ld in E.loads_of(e)}
    graph.nodes = [n for n in graph.nodes if not (n.out.id in candidates and n.out.id not in read)]


def _drop_unread_lse(graph: Graph, users: dict, outputs: set[int]) -> None:
    """Forward attention passes whose log-sum-exp nothing reads (inference: only training saves it for the backward)
    store their output alone: one storage binding fewer, which a portable plan's decode attention spends on the
    query's rotary embedding as a prologue."""
    for node in graph.nodes:
        if isinstance(node, Attention) and node.kind == "forward" and len(node.outs) == 2:
            lse = node.outs[1]
            if lse.id not in outputs and not users.get(lse.id):
                node.outs = node.outs[:1]


def _inline_into(node: Node, candidates, producers, max_bindings, report) -> None:
    """Substitute candidate producers into ``node``'s expressions, refusing what breaks a rule."""
    refused: set[int] = set()
    while True:
        new_exprs = [_substitute(e, dom, candidates, refused, node) for e, dom in zip(node.exprs(), node.domains())]
        loaded = max(len({ld.args[0] for e in form for ld in E.loads_of(e)}) for form in kernel_forms(node, new_exprs))
        too_big = (max((E.size(e) for e in new_exprs), default=0) > MAX_EXPR_NODES
                   or max((E.depth(e) for e in new_exprs), default=0) > MAX_EXPR_DEPTH)
        if loaded + len(node.outs) + 1 <= max_bindings and not too_big:
            break
        used = [vid for vid in _direct_loads(node, refused) if vid in candidates]
        if not used:
            break
        victim = max(used, key=lambda vid: E.size(candidates[vid].expr))
        reason = "expression too large" if too_big else f"more than {max_bindings} storage bindings"
        report.refused.append((_name(candidates[victim]), _name(node), reason))
        refused.add(victim)
    for vid in _direct_loads(node, refused):
        if vid in candidates:
            report.fused.append((_name(candidates[vid]), _name(node)))
    node.set_exprs(new_exprs)


def _direct_loads(node: Node, refused) -> list[int]:
    return sorted({ld.args[0] for e in node.exprs() for ld in E.loads_of(e)} - refused)


def is_cheap_prologue(producer: Pointwise) -> bool:
    """Whether recomputing ``producer`` on every load of an attention operand costs about as little as a view."""
    nodes = E.walk(producer.expr)
    return (all(n.op in PROLOGUE_OPS for n in nodes)
            and sum(n.op == "load" for n in nodes) <= PROLOGUE_MAX_LOADS)


def _takes(consumer: Node, producer: Pointwise) -> bool:
    if producer.is_view():
        return True
    if isinstance(consumer, Matmul):  # an operand element is loaded by many workgroups: only what costs no more
        return _is_rounded_view(producer)
    if isinstance(consumer, Attention):
        return is_cheap_prologue(producer)
    return True


def _is_rounded_view(producer: Pointwise) -> bool:
    """A view rounded to a half precision (an attention output in a bf16 model, reshaped for its projection)."""
    e = producer.expr
    return not producer.also and e.op in ROUNDINGS and e.args[0].op == "load"


def _substitute(e: E.Expr, domain, candidates, refused, consumer) -> E.Expr:
    def rewrite(node: E.Expr):
        if node.op != "load":
            return None
        vid, coords = node.args
        producer = candidates.get(vid)
        if producer is None or vid in refused:
            return None
        if not _takes(consumer, producer):
            return None
        mapping = dict(enumerate(coords))
        return E.shift_coords(producer.expr, mapping)

    bounds = dict(enumerate(domain))
    return simplify(E.substitute(e, rewrite), bounds)


def _prune(graph: Graph, outputs: set[int]) -> None:
    """Drop nodes nobody reads any more and unused results of reductions."""
    changed = True
    while changed:
        changed = False
        read = {ld.args[0] for n in graph.nodes for e in n.exprs() for ld in E.loads_of(e)}
        kept = []
        for node in graph.nodes:
            live = [v.id in read or v.id in outputs for v in node.outs]
            if isinstance(node, Input) or all(live):
                kept.append(node)
            elif isinstance(node, Reduce) and any(live):
                node.results = [r for r, keep in zip(node.results, live) if keep]
                node.outs = [v for v, keep in zip(node.outs, live) if keep]
                kept.append(node)
                changed = True
            elif any(live):  # other multi-output kernels write all their outputs
                kept.append(node)
            else:
                changed = True
        graph.nodes = kept
