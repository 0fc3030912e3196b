"""Runs submitted and not yet waited for: asynchronous execution, as CUDA's.

A plan run that reads nothing back to the host (a backward whose gradients stay on the device, an optimizer update,
a decode step whose cache stays there) returns once it is submitted. The queue keeps runs in order, and every
WebGPU queue operation (a buffer write, a copy, a submit) is ordered with them, so nothing else needs to wait for it:
a later run reads what it wrote, a buffer given back to the pool is written again only by later queue operations,
and a destroyed buffer lives on in wgpu until the submissions that use it are done.

What such a run leaves unread is its status word (an index out of range, a failed check), copied into a staging
buffer. The device keeps those runs here, in order, and reads their status at the next wait: any read of data on the
host (a run with host outputs, a download), or ``Device.synchronize()``. By then the queue has passed them, so their
read costs no further wait. A status that is set raises there, naming the run's plan, its number and the op, as CUDA
raises an asynchronous error at the next synchronizing call. The runs after it still ran: their outputs may hold
values computed from the failed op's (a clamped index's) results.

A run in flight may also carry a few bytes of its outputs kept on the device in that staging buffer (``Program.run``'s
``read_later``: a decode step's token ids, which the host needs a few steps later). Its reader is then a
``LaterRead``, whose ``values()`` reads the runs in flight from the oldest through that one (``read_through``): one
wait, for that run, not for the runs submitted after it, where the device polls for the mapping rather than waiting
for an idle queue (``Device.spin_seconds``: GPUs). So the host can keep a few runs queued ahead of its reads.

Host work that can wait for the GPU (a run's next run recorded ahead, ``Program.run``) is left here too
(``defer``) and done at the next wait, before the host blocks (``before_wait``): while the GPU works through what
was submitted, not between one submit and the next, where the GPU may have nothing queued.

``MEGANEURA_SYNC=1`` waits after every run, as ``CUDA_LAUNCH_BLOCKING=1`` does: the error is then raised by the run
that set it. At most ``MAX_IN_FLIGHT`` runs wait here: the next one settles the oldest first (a wait), so that a loop
that never reads keeps a bounded number of staging buffers.
"""
from __future__ import annotations

import os
from collections import deque
from typing import Callable

from .errors import MeganeuraError

SYNC_ENV = "MEGANEURA_SYNC"  # "1": wait for the GPU after every plan run
# Runs whose status is unread: a training loop that reads nothing for a while (gradient accumulation) keeps this many
# staging buffers at most. CUDA's queue holds about a thousand launches; a run here is a whole plan.
MAX_IN_FLIGHT = 8


def sync_from_env() -> bool:
    return os.environ.get(SYNC_ENV, "").strip() not in ("", "0")


class InFlight:
    """The device's runs whose status is unread, oldest first: (description, reader). A reader waits for its run if it
    has not completed, and returns the status error it left (an exception) or None."""

    def __init__(self, counters=None, sync: bool | None = None):
        self.sync = sync_from_env() if sync is None else sync  # wait after every run (``MEGANEURA_SYNC``)
        self._counters = counters  # the device's: a read of the oldest run to bound the queue counts as a wait
        self._runs: deque[tuple[str, Callable[[], Exception | None]]] = deque()
        self.settling = False  # True while the runs are read: their reads are not waits of their own
        self.reading_through = False  # True while ``read_through`` reads: the runs after those may still be queued
        self._deferred: dict[object, Callable[[], None]] = {}  # host work for the next wait, by owner (``defer``)

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, description: str, reader: Callable[[], Exception | None]) -> None:
        """Keep a submitted run whose status ``reader`` reads; past ``MAX_IN_FLIGHT`` runs, the oldest is read now."""
        self._runs.append((description, reader))
        if len(self._runs) > MAX_IN_FLIGHT:
            if self._counters is not None:
                self._counters.waits += 1
            self._settle(1)

    def defer(self, owner, work: Callable[[], None]) -> None:
        """Do ``work`` at the device's next wait, before it blocks (``before_wait``), in place of ``owner``'s work
        deferred before, if any (an owner's latest only: a loop that never waits holds one item per owner)."""
        self._deferred.pop(owner, None)
        self._deferred[owner] = work

    def before_wait(self) -> None:
        """Do the work deferred (``defer``), oldest first; called by the device before each wait for the GPU."""
        while self._deferred:
            self._deferred.pop(next(iter(self._deferred)))()

    def settle(self) -> None:
        """Read every run's status (after a wait: the queue has passed them); raise the first error set, naming its
        run. Every staging buffer is read and given back before it raises."""
        self._settle(len(self._runs))

    def read_through(self, reader: Callable[[], Exception | None]) -> None:
        """Read the runs from the oldest through the one ``reader`` reads (a wait for that run; nothing if it was read
        already); raise the first error set, naming its run, as ``settle``."""
        count = next((k + 1 for k, (_, r) in enumerate(self._runs) if r is reader), 0)
        if not count or self.settling:
            return
        if self._counters is not None:
            self._counters.waits += 1
        self.reading_through = True
        try:
            self._settle(count)
        finally:
            self.reading_through = False

    def _settle(self, count: int) -> None:
        self.before_wait()
        if self.settling or not count:
            return
        first = None
        self.settling = True
        try:
            for _ in range(count):
                description, reader = self._runs.popleft()
                error = reader()
                if error is not None and first is None:
                    first = (description, error)
        finally:
            self.settling = False
        if first is not None:
            description, error = first
            error.args = (f"{error.args[0]} (set by {description}, raised at the next wait for the GPU; "
                          f"{SYNC_ENV}=1 waits after every run)",)
            raise error


class LaterRead:
    """Outputs that a run copies into its staging buffer to be read when the host asks (``Program.run``'s
    ``read_later``). A run in flight's reader for ``InFlight``: ``read`` returns the status error it left and those
    outputs by name. ``values()`` returns them, reading the runs in flight through this one first if they are not
    read yet (``InFlight.read_through``: a status error set by any of them is raised there)."""

    __slots__ = ("_in_flight", "_read", "_values")

    def __init__(self, in_flight: InFlight | None, read: Callable[[], tuple] | None, values: dict | None = None):
        self._in_flight, self._read, self._values = in_flight, read, values

    @classmethod
    def done(cls, values: dict) -> "LaterRead":
        """Outputs of a run that waited: read already."""
        return cls(None, None, values)

    def __call__(self) -> Exception | None:
        error, self._values = self._read()
        self._read = None
        return error

    def values(self) -> dict:
        if self._values is None:
            self._in_flight.read_through(self)
        if self._values is None:
            raise MeganeuraError("the outputs of a run in flight were not read: its read-back failed")
        return self._values
