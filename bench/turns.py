"""The order of the timed calls: competitors take turns, each turn a run of consecutive calls.

PyTorch (CUDA) and meganeura (Vulkan) share one GPU through context switches, and the first call after the other
API's work pays for the switch. On an H200, alternating call by call added about 0.25 ms to every call of both
sides: a 1024² matmul took cuBLAS 0.33 ms alternated and 0.083 ms in a run of its own calls (meganeura: 0.63 and
0.39); Whisper-tiny inference 3.23 and 2.98 ms for eager, 4.45 and 4.25 for meganeura. A user runs one of them, so
each turn starts with an untimed call that absorbs the switch, then times up to ``run_length`` calls in a row.
Taking turns still spreads slow drift (clocks, other load on the machine) over every competitor.
"""
from __future__ import annotations

from collections.abc import Callable

RUN_LENGTH = 5  # timed calls per turn (bench --run-length)


def take_turns(competitors: int, repeats: int, run_length: int, call: Callable[[int, bool], None]) -> None:
    """Call ``call(i, timed)`` for each competitor ``i < competitors`` in turns until each has had ``repeats``
    timed calls: a turn is one untimed call (``timed`` False), then up to ``run_length`` timed ones."""
    if run_length < 1:
        raise ValueError(f"run_length must be at least 1, got {run_length}")
    done = 0
    while done < repeats:
        count = min(run_length, repeats - done)
        for i in range(competitors):
            call(i, False)
            for _ in range(count):
                call(i, True)
        done += count
