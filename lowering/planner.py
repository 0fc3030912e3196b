"""Memory planner: place intermediate tensors in one arena by lifetime.

Each intermediate lives from the kernel that writes it to the last kernel that reads it (a value stored over an
operand it reads last extends the operand's lifetime instead: ``in_place.arena_aliases``). Tensors are
placed largest first at the lowest aligned offset that overlaps no already-placed tensor whose lifetime
intersects (greedy by size, as in TFLite's arena planner). The arena size is the planned peak; the sum
of all intermediates is what a one-buffer-per-tensor scheme would allocate.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    key: int
    size: int  # bytes
    first: int  # step that writes it
    last: int  # last step that reads it


def align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def place(intervals: list[Interval], alignment: int) -> tuple[dict[int, int], int]:
    """Return ({key: offset}, arena size) with no two lifetime-overlapping tensors overlapping in memory."""
    placed: list[tuple[int, Interval]] = []
    offsets: dict[int, int] = {}
    for iv in sorted(intervals, key=lambda i: (-i.size, i.first, i.key)):
        live = sorted(((off, other) for off, other in placed if other.first <= iv.last and iv.first <= other.last),
                      key=lambda item: item[0])
        offset = 0
        for off, other in live:
            if offset + iv.size <= off:
                break
            offset = max(offset, align(off + other.size, alignment))
        offsets[iv.key] = offset
        placed.append((offset, iv))
    size = max((off + iv.size for off, iv in placed), default=0)
    return offsets, align(max(size, 4), 4)
