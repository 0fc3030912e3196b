"""Data checks run apart from the kernels that carried them, before any input is overwritten (``separate_checks``).

A plan that stores outputs over its inputs (``in_place``) must leave those inputs as they were when a check fails (an
index out of range), so every check from the first in-place writer on moves into a kernel of its own that runs
before the writers, which then store only while the status word is clear. A static KV cache's update checks its
position, and a fused embedding lookup carries its index check into later kernels: either would refuse every request.

Checks whose conditions read only the graph's inputs (directly, or through cheap pointwise values computed from them:
``remat.recomputed``) run together at the plan's front, as few kernels as the binding limit allows: each condition
over the coordinates it reads (a position check repeated over every element of the cache it guards runs once), equal
conditions once. The index arithmetic that precedes a cache write (HF's static cache: a layer's position counter plus
``arange``, its int64 overflow checked) gives its checks to the front kernel too, and, cheap and unchecked then,
inlines into the writes that read it, as fusion would have done had it not carried a check: a decode step's layer then
writes its cache in one dispatch, the position checks of every layer in one at the front. The other checks keep a
kernel each, placed as early as what they read allows.
"""
from __future__ import annotations

import operator

from meganeura.runtime.dtypes import STORAGE

from . import expr as E
from .bindings import checks
from .fusion import PROLOGUE_OPS, FusionReport, inline_candidates
from .indexing import simplify
from .ir import Graph, Input, Pointwise, Reduce, RowOutput, Value
from .remat import recomputed

# Storage of index arithmetic (``_index_arithmetic``): integers, and booleans (u32) compared from them.
INDEX_STORAGE = ("i32", "u32")
CHECK_KERNEL_BINDINGS = 2  # a check kernel binds its (unused) result and the status buffer besides what it reads
# A comparison op -> its Python operator (``_always`` evaluates a comparison of two constants).
_COMPARE = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
            "ge": operator.ge}


def separate_checks(graph: Graph, max_bindings: int, report: FusionReport) -> int:
    """Move the data checks of the kernels from the first requested in-place writer on, and those of the index
    arithmetic before it whose conditions read only inputs, into kernels of their own (the module docstring);
    returns how many check kernels were added."""
    producers = graph.producers()
    writers = [producers.get(graph.outputs[p].id) for p in graph.in_place]
    first = min((graph.position(w) for w in writers if isinstance(w, (Pointwise, Reduce))), default=None)
    if first is None:
        return 0
    inputs = {n.out.id for n in graph.nodes if isinstance(n, Input)}
    outputs = {v.id for v in graph.outputs}
    front: dict[tuple, dict] = {}  # a reduced domain -> its conditions read from inputs, {(condition, code): None}
    apart: dict[tuple, None] = {}  # (domain, conditions) of one expression's checks that read computed values
    freed = []  # index arithmetic whose checks moved: inlined into its readers next
    for at, node in enumerate(list(graph.nodes)):
        exprs = node.exprs()
        if not checks(exprs):
            continue
        found = [(domain, tuple(dict.fromkeys((_from_inputs(n.args[1], domain, producers, inputs), n.args[2])
                                              for n in E.walk(e) if n.op == "check")))
                 for e, domain in zip(exprs, node.domains())]
        direct = all(_reads_only(c, inputs) for _, conditions in found for c, _ in conditions)
        if at < first and not (direct and _index_arithmetic(node, outputs)):
            continue
        for domain, conditions in found:
            _sort(domain, conditions, inputs, front, apart)
        node.set_exprs([_without_checks(e) for e in exprs])
        if _index_arithmetic(node, outputs):
            freed.append(node)
    next_id = 1 + max(v.id for n in graph.nodes for v in n.outs)
    kernels = _front_kernels(front, next_id, max_bindings)
    kernels += [_check_kernel(Value(next_id + len(kernels) + k, (), "int32"), domain, conditions)
                for k, (domain, conditions) in enumerate(apart)]
    for kernel in kernels:
        _place(graph, kernel)
    if freed:
        inline_candidates(graph, freed, max_bindings, report)
        _sink_unread_writers(graph)
    return len(kernels)


def _sort(domain: tuple, conditions: tuple, inputs: set[int], front: dict, apart: dict) -> None:
    """File one expression's checks: those read from inputs under ``front`` (by their reduced domain), the rest
    together under ``apart``; those that hold whatever they read (``_always``) nowhere."""
    rest = []
    for condition, code in conditions:
        if _always(condition):
            continue
        if _reads_only(condition, inputs):
            reduced, small = _reduced(condition, domain)
            front.setdefault(small, {})[reduced, code] = None
        else:
            rest.append((condition, code))
    if rest:
        apart[domain, tuple(rest)] = None


def _index_arithmetic(node, outputs: set[int]) -> bool:
    """Whether ``node`` is index arithmetic: a pointwise integer or boolean value of one output (a position, or a mask
    compared from positions: a decode step's causal mask), not a graph output, whose expression is plain arithmetic
    once its checks are out (``fusion.PROLOGUE_OPS``): its readers may compute it again. (A float value such as an
    embedding lookup is data: it keeps its checks and its kernel.)"""
    return (isinstance(node, Pointwise) and not node.also and node.out.id not in outputs
            and STORAGE[node.out.dtype] in INDEX_STORAGE
            and all(n.op in PROLOGUE_OPS for n in E.walk(_without_checks(node.expr))))


def _from_inputs(condition: E.Expr, domain: tuple, producers: dict, inputs: set[int]) -> E.Expr:
    """``condition`` computed from the graph's inputs where it reads them through cheap pointwise values only
    (``remat.recomputed``: a loss's ``target != ignore_index``, a value the loss computes late in the node order),
    so that its check kernel can run before every in-place writer; else ``condition`` as it is."""
    direct = recomputed(condition, producers, lambda vid: vid in inputs)
    return condition if direct is None else simplify(direct, dict(enumerate(domain)))


def _always(condition: E.Expr) -> bool:
    """Whether ``condition`` holds whatever it reads: comparisons of an expression with itself or of two constants,
    joined by ``and`` and ``or`` (the int64 overflow check of a flat index that adds 0: ``x + 0 >= x``, a causal
    mask's over its coordinates)."""
    if condition.op == "and":
        return all(map(_always, condition.args))
    if condition.op == "or":
        return any(map(_always, condition.args))
    if condition.op in _COMPARE:
        x, y = condition.args
        if E.is_const(x) and E.is_const(y):
            return _COMPARE[condition.op](x.args[0], y.args[0])
        return x == y and condition.op in ("eq", "le", "ge")
    return E.is_const(condition, True)


def _reads_only(condition: E.Expr, inputs: set[int]) -> bool:
    return all(ld.args[0] in inputs for ld in E.loads_of(condition))


def _reduced(condition: E.Expr, domain: tuple) -> tuple[E.Expr, tuple]:
    """(``condition`` over the dimensions of ``domain`` it reads, those dimensions): the same checks, once each.
    A dimension of size 1 reads coordinate 0; a dimension it does not read is dropped where it has a fixed positive
    size (an empty or symbolic one could hold no element, where the check would not run at all)."""
    fixed = {d: E.const(0, E.I32) for d, size in enumerate(domain) if isinstance(size, int) and size == 1}
    condition = simplify(E.shift_coords(condition, fixed), dict(enumerate(domain)))
    read = {n.args[0] for n in E.walk(condition) if n.op == "coord"}
    kept = [d for d, size in enumerate(domain) if d in read or not (isinstance(size, int) and size > 0)]
    moved = E.shift_coords(condition, {d: E.coord(k) for k, d in enumerate(kept)})
    return moved, tuple(domain[d] for d in kept)


def _front_kernels(front: dict, next_id: int, max_bindings: int) -> list[Reduce]:
    """The check kernels of the conditions read from inputs: per domain, as many conditions a kernel as its
    bindings allow."""
    kernels = []
    for domain, conditions in front.items():
        part, loaded = [], set()
        for condition, code in conditions:
            loads = {ld.args[0] for ld in E.loads_of(condition)}
            if part and len(loaded | loads) + CHECK_KERNEL_BINDINGS > max_bindings:
                kernels.append(_check_kernel(Value(next_id + len(kernels), (), "int32"), domain, tuple(part)))
                part, loaded = [], set()
            part, loaded = [*part, (condition, code)], loaded | loads
        kernels.append(_check_kernel(Value(next_id + len(kernels), (), "int32"), domain, tuple(part)))
    return kernels


def _place(graph: Graph, kernel: Reduce) -> None:
    """Insert ``kernel`` just after the last node that computes what it reads (an input is no kernel: nothing to wait
    for)."""
    loaded = {ld.args[0] for e in kernel.exprs() for ld in E.loads_of(e)}
    after = max((i for i, n in enumerate(graph.nodes)
                 if not isinstance(n, Input) and any(v.id in loaded for v in n.outs)), default=-1)
    graph.nodes.insert(after + 1, kernel)


def _check_kernel(out: Value, domain: tuple, conditions: tuple) -> Reduce:
    """A reduction over ``domain`` that stores nothing of use and raises the status where a condition fails."""
    checked = E.const(0, E.I32)
    for condition, code in conditions:
        checked = E.Expr("check", (checked, condition, code), E.I32)
    return Reduce([out], domain=domain, axes=tuple(range(len(domain))), phases=[("max", checked)],
                  results=[RowOutput(False, E.acc(0, E.I32))], label="checks")


def _without_checks(e: E.Expr) -> E.Expr:
    return E.substitute(e, lambda n: n.args[0] if n.op == "check" else None)


def _sink_unread_writers(graph: Graph) -> None:
    """Move each requested in-place pointwise writer that no node reads to just after the last node that reads the
    input it overwrites, where that comes later: index arithmetic inlined into later kernels makes them readers of
    the inputs it read (a layer's position counter), which the writer of those inputs (the counter's update) must
    now follow for its request to hold (``in_place``; ``in_place.hoist_writers`` moves writers up only)."""
    producers = graph.producers()
    inputs = {n.name: n for n in graph.nodes if isinstance(n, Input)}
    reads = [{ld.args[0] for e in n.exprs() for ld in E.loads_of(e)} for n in graph.nodes]
    read = set().union(*reads)
    for position, name in graph.in_place.items():
        writer, target = producers.get(graph.outputs[position].id), inputs.get(name)
        if not isinstance(writer, Pointwise) or target is None or any(v.id in read for v in writer.outs):
            continue
        at = graph.position(writer)
        last = max((i for i, n in enumerate(graph.nodes) if n is not writer and target.out.id in reads[i]), default=-1)
        if last > at:  # (the nodes between shift down by one: the writer lands just after that reader)
            graph.nodes.insert(last, graph.nodes.pop(at))
            reads.insert(last, reads.pop(at))
