"""Sibling matmuls: products of one A operand with different B operands become one matmul over their columns.

A transformer layer multiplies the normalised hidden state by its query, key and value weights, and an MLP by its
gate and up weights; each is a Matmul node with the same A expression after fusion. Merged, one kernel reads A
once for all of them, fills more workgroups with fewer dispatches, and writes each product to its own output: the
merged node keeps each sibling's B, epilogue and output as a block of columns (``Matmul.more_columns``), which the
kernel's ``load_b`` and ``store_c`` select by column. The merged node takes the later node's place (``siblings``
moves what depends on the earlier one and checks the binding limit).
"""
from __future__ import annotations

from .fusion import FusionReport
from .ir import Graph, Matmul, MatmulColumns
from .siblings import fuse_siblings


def fuse_sibling_matmuls(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Merge each Matmul into the next one with the same batch, m, k and A operand, where the rules allow."""
    fuse_siblings(graph, max_bindings, report, _key, _merge)


def _key(node) -> tuple | None:
    if not isinstance(node, Matmul) or node.n == 1:  # a single column stays on the matrix-vector kernel
        return None
    return (node.batch, node.m, node.k, node.a)


def _merge(earlier: Matmul, later: Matmul) -> None:
    """``later`` computes ``earlier``'s columns first, then its own."""
    own = MatmulColumns(later.n, later.b, later.epilogue)
    later.more_columns = earlier.more_columns + [own] + later.more_columns
    later.n, later.b, later.epilogue = earlier.n, earlier.b, earlier.epilogue
    later.outs = list(earlier.outs) + list(later.outs)
    later.label = "+".join(dict.fromkeys(earlier.label.split("+") + later.label.split("+")))
