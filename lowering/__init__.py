"""Torch-free compiler middle: typed static IR, fusion into archetype kernels, memory planning, the plan.

``compile_graph(graph, limits)`` runs the passes in order: fuse -> schedule (memory plan + WGSL + dispatches).
"""
from __future__ import annotations

from .fusion import FusionReport, fuse
from .ir import Graph
from .schedule import schedule


def compile_graph(graph: Graph, limits: dict):
    """Fuse and schedule ``graph``; return (Plan, FusionReport)."""
    report = fuse(graph, limits.get("max-storage-buffers-per-shader-stage", 8))
    plan = schedule(graph, limits, stats={"fused_producers": len(report.fused)})
    return plan, report
