"""The staging buffers of a program's read-back, whose mapped memory becomes the outputs.

A run copies its outputs and status words into a staging buffer and maps it. The numpy outputs are views of the
mapped memory itself, so a large output is not copied again on the host: one thread copies 8-9 GB/s out of a
mapping on the H200 machine, 0.27 ms for Whisper-tiny's 2.3 MB, about 1.5 ms for SmolLM2's 24 MB of logits on four
threads. A buffer stays mapped while any output over it lives. A run meanwhile takes another buffer, and the last
output of a buffer to go unmaps it and hands it back. A program starts with two (``START_BUFFERS``), so that a loop
holding its last result (``y = model(x)``) alternates between them and allocates nothing; outputs held longer cost
a new buffer per run.
"""
from __future__ import annotations

import numpy as np

START_BUFFERS = 2


class ReadBackBuffers:
    """Staging buffers of one size for one program: taken by a run, given back when their outputs are gone."""

    def __init__(self, device, size: int, label: str):
        self.device, self.size, self.label = device, size, label
        self._free = [device.staging_buffer(size, label) for _ in range(START_BUFFERS)]
        self.held = 0  # buffers mapped under outputs still alive
        self._released = False

    def take(self):
        """An unmapped buffer for the next run's copies."""
        return self._free.pop() if self._free else self.device.staging_buffer(self.size, self.label)

    def read(self, buffer, size: int | None = None) -> np.ndarray | memoryview:
        """Wait for the run that copied into ``buffer`` (from ``take``) and return its bytes (its first ``size``),
        mapped."""
        self.held += 1
        try:
            return self.device.read_mapped(buffer, self.size if size is None else size, self._give_back)
        except BaseException:
            self.held -= 1
            raise

    def _give_back(self, buffer) -> None:
        """Called once ``buffer`` is unmapped (the garbage collector may call it on any thread)."""
        self.held -= 1
        if self._released:
            self.device.destroy_buffer(buffer)
        else:
            self._free.append(buffer)

    def release(self) -> None:
        """Destroy the free buffers now and each held one when its outputs are gone."""
        self._released = True
        for buffer in self._free:
            self.device.destroy_buffer(buffer)
        self._free = []
