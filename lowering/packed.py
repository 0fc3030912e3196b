"""Outputs of one node placed side by side in the arena, bound once by a kernel that reads several of them.

A node that writes several intermediates at once (a sibling matmul's blocks: a layer's query, key and value; a
pointwise node's outputs: a rotary embedding's cosine and sine) may lay them side by side (``Node.side_by_side``): the
memory planner places them as one range, each at the storage-offset alignment after the one before
(``PackedLayout``), alive from the node's dispatch to the last read of any of them. A kernel that reads two or more of
them binds the range once and reads each at its element offset in it (``schedule._bindings``); the offsets depend on
the outputs' sizes alone, so the kernels of repeated layers stay one. The node itself stores each through a binding
of its own, and no kernel writes into the range while another binding reads it (WebGPU forbids a writable binding
that overlaps another of the same buffer in one dispatch): the outputs are intermediates, in the arena from the node
to their last reader, and no kernel stores over them (``schedule`` leaves them out of ``in_place.arena_aliases``).

Packing lengthens what the arena holds (every output lives as long as the longest-lived), so only a pass that would
otherwise exceed the storage-binding limit asks for it (``attention_writes``: a portable plan's Llama attention that
runs its layer's cache writes reads the query, key and value and the cosine and sine, five values, through two
bindings).
"""
from __future__ import annotations

from dataclasses import dataclass

from meganeura.kernels.sizes import is_size

from .ir import Graph, Matmul, Node, Pointwise, Reduce


def groups(nodes: list[Node]) -> dict[int, tuple[int, ...]]:
    """{value id: the ids of its node's outputs, in order} of the nodes whose outputs lie side by side."""
    return {v.id: tuple(o.id for o in n.outs) for n in nodes if n.side_by_side for v in n.outs}


def binding_keys(read: set, grouped: dict[int, tuple[int, ...]]) -> dict:
    """{value id of ``read``: the key of its binding}: the group (``groups``) of a value that ``read`` holds two or
    more of, else the id itself."""
    return {vid: grouped[vid] if vid in grouped and len(read & set(grouped[vid])) > 1 else vid for vid in read}


def binding_count(read: set, grouped: dict[int, tuple[int, ...]]) -> int:
    """How many bindings the values ``read`` take (``binding_keys``)."""
    return len(set(binding_keys(read, grouped).values()))


def packable(graph: Graph, read: set) -> list[Node]:
    """The nodes not yet side by side whose outputs may be laid so, of which ``read`` holds two or more: a matmul's
    blocks or a pointwise (not an update) or row program's outputs, each an intermediate (no graph output, so in the
    arena) of fixed shape, all of one compute type (one binding reads them)."""
    outputs = {v.id for v in graph.outputs}
    return [n for n in graph.nodes
            if isinstance(n, (Matmul, Pointwise, Reduce)) and not n.side_by_side and len(n.outs) > 1
            and getattr(n, "region", None) is None and len(read & {v.id for v in n.outs}) > 1
            and not outputs & {v.id for v in n.outs} and len({v.compute_dtype for v in n.outs}) == 1
            and not any(is_size(s) for v in n.outs for s in v.shape)]


@dataclass(frozen=True)
class PackedLayout:
    """Where side-by-side outputs lie in their range: ``group`` (value id -> its group, ``groups``), ``offset`` (value
    id -> bytes from the range's start) and ``size`` (group -> the range's bytes)."""

    group: dict[int, tuple[int, ...]]
    offset: dict[int, int]
    size: dict[tuple[int, ...], int]

    @classmethod
    def of(cls, nodes: list[Node], alignment: int, nbytes) -> "PackedLayout":
        """The layout of ``nodes``' side-by-side outputs, each ``nbytes(value)`` long at a multiple of ``alignment``
        bytes."""
        group, offset, size = groups(nodes), {}, {}
        for node in (n for n in nodes if n.side_by_side):
            at = 0
            for v in node.outs:
                at = -(-at // alignment) * alignment
                offset[v.id] = at
                at += nbytes(v)
            size[group[node.outs[0].id]] = at
        return cls(group, offset, size)
