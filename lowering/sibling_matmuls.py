"""Sibling matmuls: products that share an operand become one matmul over their outputs side by side.

A transformer layer multiplies the normalised hidden state by its query, key and value weights, and an MLP by its
gate and up weights: Matmul nodes with the same A expression after fusion. Their weight gradients share B (the
layer's input). Merged, one kernel reads the shared operand once for all of them, fills more workgroups with fewer
dispatches, and writes each product to its own output: the merged node keeps each sibling's other operand, epilogue
and output as a block (``Matmul.more_blocks``) of columns (shared A) or rows (shared B), which the kernel's loads and
``store_c`` select by index. Products sharing A merge first; a node that took blocks merges no other way. The merged
node takes the later node's place (``siblings`` moves what depends on the earlier one and checks the binding limit).
"""
from __future__ import annotations

from .fusion import FusionReport
from .ir import Graph, Matmul, MatmulBlock
from .siblings import fuse_siblings


def fuse_sibling_matmuls(graph: Graph, max_bindings: int, report: FusionReport) -> None:
    """Merge each Matmul into the next one with the same shared operand and extents, where the rules allow."""
    for axis in ("j", "i"):
        fuse_siblings(graph, max_bindings, report, lambda node: _key(node, axis),
                      lambda e, later: _merge(e, later, axis))


def _key(node, axis: str) -> tuple | None:
    """Siblings along ``axis`` share the other operand: A for column blocks ("j"), B for row blocks ("i")."""
    if not isinstance(node, Matmul) or (node.more_blocks and node.block_axis != axis) or node.products:
        return None
    if node.row_phases and axis != "j":  # (a prologue normalises the row of the shared A)
        return None
    if (node.n if axis == "j" else node.m) == 1:  # a single column (row) stays on the matrix-vector kernel
        return None
    return ((node.batch, node.m, node.k, node.a, tuple(node.row_phases)) if axis == "j"
            else (node.batch, node.n, node.k, node.b))


def _merge(earlier: Matmul, later: Matmul, axis: str) -> None:
    """``later`` computes ``earlier``'s blocks first, then its own."""
    size, operand = (later.n, later.b) if axis == "j" else (later.m, later.a)
    later.more_blocks = earlier.more_blocks + [MatmulBlock(size, operand, later.epilogue)] + later.more_blocks
    later.block_axis = axis
    later.m, later.n = earlier.m, earlier.n
    later.a, later.b, later.epilogue, later.row_phases = earlier.a, earlier.b, earlier.epilogue, earlier.row_phases
    later.outs = list(earlier.outs) + list(later.outs)
    later.label = "+".join(dict.fromkeys(earlier.label.split("+") + later.label.split("+")))
