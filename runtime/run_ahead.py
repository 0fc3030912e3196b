"""Decode steps submitted ahead of the host's reads of their tokens: ``LanguageModel``'s greedy and device-sampled
generation (``meganeura.runtime.generate``), asynchronous as CUDA's launches are.

A decode step's ids are the step before's token output, bound on the device (``DeviceArray.reshaped``: [batch] as
[batch, 1]); the rest of what it takes (its cache position, the sampler's numbers, the random seed) the host knows
beforehand, and the queue keeps those uploads in order with the runs. So the host need not read a step's tokens
before it submits the next: it keeps up to ``RUN_AHEAD`` steps submitted and unread, and reads them
``RUN_AHEAD // 2`` at a time from their runs' staging buffers (``Program.run``'s ``read_later``,
``in_flight.LaterRead``), in one wait for the newest of them, while the GPU still has the others queued. The wall
time of a token becomes the larger of the host's work and the GPU's, not their sum, and the host waits once per
``RUN_AHEAD // 2`` tokens. A status error that a step sets is raised at the read of its tokens, naming the op.

The host sees a row's end-of-sequence id up to ``RUN_AHEAD`` steps after it submitted that step; the steps
submitted past the end are dropped unread (their status is read at the device's next wait). No more steps are
submitted than the call's ``max_new_tokens`` allows, so the cache's bound holds. ``run_ahead=1`` reads each step's
tokens before it submits the next: the synchronous way (``MEGANEURA_SYNC=1``'s default).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np

# Decode steps submitted and unread. When the host reads, half of them (2) are still queued: on the H100 a SmolLM2
# step is ~2 ms of GPU work against ~0.8 ms of the host's, so the GPU stays busy while the host takes the tokens
# read and submits the next two. More would only waste steps past an end-of-sequence id (each one a step's GPU time)
# and delay a streamed token further; the device reads the oldest run in flight past in_flight.MAX_IN_FLIGHT (8).
RUN_AHEAD = 4


class RunAhead:
    """The tokens of ``steps`` decode steps, submitted up to ``ahead`` at a time before they are read (module
    docstring). ``submit(ids)`` submits a step over ``ids`` (the host's ids for the first step, then the step
    before's token array) and returns its token array and the ``LaterRead`` of its ``token`` output."""

    def __init__(self, submit: Callable, first_ids: np.ndarray, steps: int, token: str, ahead: int = RUN_AHEAD):
        self._submit, self._ids, self._left, self._token = submit, first_ids, steps, token
        self._ahead, self._together = max(1, ahead), max(1, ahead // 2)
        self._unread: deque = deque()  # each submitted step's LaterRead, oldest first
        self._read: deque = deque()  # (tokens, host seconds) of the steps read and not yet taken, oldest first

    def next(self) -> tuple[np.ndarray, float]:
        """The next step's tokens (int64, one per row) and its share of the host's seconds in submitting steps and
        reading them (a read of several steps shares its seconds evenly between them)."""
        if not self._read:
            self._submit_and_read()
        return self._read.popleft()

    def _submit_and_read(self) -> None:
        began = time.perf_counter()
        while self._left and len(self._unread) < self._ahead:
            self._ids, later = self._submit(self._ids)
            self._unread.append(later)
            self._left -= 1
        group = [self._unread.popleft() for _ in range(min(self._together, len(self._unread)))]
        group[-1].values()  # one wait: the runs in flight through the newest of the group are read
        seconds = (time.perf_counter() - began) / len(group)
        self._read.extend((later.values()[self._token].reshape(-1).astype(np.int64), seconds) for later in group)
