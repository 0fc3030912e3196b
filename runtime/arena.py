"""One arena buffer per device, shared by every program on it.

A plan's arena holds the intermediates of one run: nothing in it outlives the run (what a later run reads, a saved
activation or a gradient, is an output with a buffer of its own). Runs on one device never overlap: each waits for
its read-back before it returns, the queue runs submissions in order, and ``running`` keeps runs from two threads
apart. So one buffer, as large as the largest arena among the device's live programs, serves them all. A training
loop through the backend held its forward's, backward's and optimizer's arenas at once (full-size Whisper-tiny:
55 and 193 MiB, where 193 now serve both).

A program claims its plan's arena size while it lives (``claim``; ``release`` gives the claim back, and so does the
program's collection). The buffer is replaced when it no longer has the size of the largest claim, never during a
run: at the start of the next one, or at once where ``release`` is called between runs. ``generation`` then
changes, and each program binds the new buffer wherever it builds bind groups: before its next run, and when its
params are bound (``Program._use_current_arena``). A program made before another's run replaced the buffer, and
bound after it, would otherwise bind the destroyed one.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager


class SharedArena:
    """The arena buffer of ``device``'s programs."""

    def __init__(self, device):
        self.device = device
        self.generation = 0  # changes whenever the buffer is replaced: programs bound to the old one bind again
        self._buffer = None
        self._claims: dict[int, tuple[weakref.ref, int]] = {}  # id(owner) -> (owner, bytes)
        self._size = 0  # the largest claim
        self._lock = threading.RLock()
        self._runs = 0  # runs in progress (a run's own thread may start another: a collected object's finalizer)

    @property
    def size(self) -> int:
        """The bytes the buffer must hold: the largest claim."""
        return self._size

    def claim(self, owner, size: int) -> None:
        """``owner`` (a program) runs plans whose arena takes ``size`` bytes, while it lives or until ``release``."""
        key = id(owner)
        self._claims[key] = (weakref.ref(owner, lambda _ref, k=key: self._drop(k)), size)
        self._size = max(self._size, size)

    def release(self, owner) -> None:
        """``owner`` runs no more plans. Between runs, a buffer larger than every remaining claim goes at once."""
        self._drop(id(owner))
        self.shrink()

    def shrink(self) -> None:
        """Between runs, give back a buffer larger than every claim now (the claims of collected programs are gone
        with them, but their buffer stays until the next run, or this call)."""
        if not self._runs and self._buffer is not None and self._buffer.size > max(self._size, 4):
            self._replace()

    def buffer(self):
        """The shared buffer, of the largest claim's size: made (again) here where it has another size."""
        if self._buffer is not None and self._buffer.size != max(self._size, 4) and not self._runs:
            self._replace()
        if self._buffer is None:
            self._buffer = self.device.storage_buffer(max(self._size, 4), "arena")
        return self._buffer

    @contextmanager
    def running(self):
        """Held by a run from its first upload to its read-back: no other run on the device meanwhile, and the
        buffer stays as it is."""
        with self._lock:
            if not self._runs:
                self.buffer()  # replaced now if the claims changed since the last run
            self._runs += 1
            try:
                yield
            finally:
                self._runs -= 1

    def _drop(self, key: int) -> None:
        if self._claims.pop(key, None) is not None:
            self._size = max((size for _, size in self._claims.values()), default=0)

    def _replace(self) -> None:
        """Destroy the buffer (``buffer`` makes the next); programs bound to it bind again."""
        if not self.device.lost:
            self.device.destroy_buffer(self._buffer)
        self._buffer = None
        self.generation += 1
