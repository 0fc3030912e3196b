"""Sibling in-place updates: pointwise nodes of one shape whose outputs are all stored over inputs become one kernel.

A decode step writes each layer's new key and new value into the layer's two caches (``Graph.in_place``): two
pointwise nodes over the cache's shape that do not read each other. Merged, one kernel stores both (the later node
computes the earlier one's expressions as further outputs, ``Pointwise.also``), one dispatch per layer fewer.
Only updates stored over inputs are merged, so that ordinary pointwise kernels keep their plans; the merged kernel
stays within the binding limit (``siblings``, which also moves what depends on the earlier node), so a portable
plan's 8 bindings keep a layer's two cache writes apart.
"""
from __future__ import annotations

from .fusion import FusionReport
from .ir import Graph, Pointwise
from .siblings import fuse_siblings


def fuse_sibling_updates(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Merge each in-place pointwise update into the next one of the same shape and dtype, where the rules allow."""
    updated = {graph.outputs[i].id for i in graph.in_place}

    def key(node) -> tuple | None:
        if not isinstance(node, Pointwise) or not all(v.id in updated for v in node.outs):
            return None
        return node.out.shape, node.out.dtype

    fuse_siblings(graph, max_bindings, report, key, _merge)


def _merge(earlier: Pointwise, later: Pointwise) -> None:
    """``later`` stores ``earlier``'s outputs first, then its own, at the same linear index."""
    later.outs = list(earlier.outs) + list(later.outs)
    later.expr, later.also = earlier.expr, [*earlier.also, later.expr, *later.also]
    later.label = "+".join(dict.fromkeys(earlier.label.split("+") + later.label.split("+")))
