"""Torch-free compiler middle: typed static IR, fusion into archetype kernels, memory planning, the plan.

``compile_graph(graph, limits)`` runs the passes in order: fuse (inline producers into consumers) ->
fuse_sibling_reductions (row programs over the same rows into one) -> fuse_epilogues (consumers into reductions
and matmuls) -> fuse_multi_output (a pointwise value with several readers stored by its first pointwise reader) ->
fuse_sibling_matmuls (products of one A operand side by side in one matmul) -> schedule (memory plan + WGSL +
dispatches).
"""
from __future__ import annotations

from .epilogues import fuse_epilogues
from .fusion import FusionReport, fuse
from .ir import Graph
from .multi_output import fuse_multi_output
from .schedule import schedule
from .sibling_matmuls import fuse_sibling_matmuls
from .sibling_reductions import fuse_sibling_reductions


def compile_graph(graph: Graph, limits: dict):
    """Fuse and schedule ``graph``; return (Plan, FusionReport)."""
    max_bindings = limits.get("max-storage-buffers-per-shader-stage", 8)
    report = fuse(graph, max_bindings)
    fuse_sibling_reductions(graph, max_bindings, report)
    fuse_epilogues(graph, max_bindings, report)
    fuse_multi_output(graph, max_bindings, report)
    fuse_sibling_matmuls(graph, max_bindings, report)
    plan = schedule(graph, limits, stats={"fused_producers": len(report.fused)})
    return plan, report
