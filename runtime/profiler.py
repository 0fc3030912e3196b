"""GPU time of every dispatch: timestamp queries around each kernel, a chrome trace and a top-kernels table.

While a ``Profiler`` is attached to a device (``with profile(device) as prof``, the ``MEGANEURA_PROFILE=trace.json``
environment variable, or the backend option ``profile``), every plan run records each dispatch in a compute pass
of its own whose beginning and end write GPU timestamps. The adapter must offer the ``timestamp-query`` feature;
without it ``Profiler`` raises ``FeatureError``. Passes per dispatch cost a little extra time, so profiled runs
are for finding where the time goes, not for headline timings.

``events`` holds one record per dispatch run: name (the dispatch label), kernel key, workgroups, run number,
start and duration in nanoseconds. ``top()`` sums them per name; ``save(path)`` writes a chrome-trace JSON
(chrome://tracing, Perfetto) with one track per run.
"""
from __future__ import annotations

import atexit
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import wgpu

from .errors import FeatureError
from .native import timestamp_period_ns

PROFILE_ENV = "MEGANEURA_PROFILE"
QUERIES_PER_SET = 4096  # wgpu's cap on one query set
RESOLVE_ALIGNMENT = 256  # resolve_query_set destination offsets must be multiples of this


@dataclass(frozen=True)
class KernelTime:
    name: str
    total_ms: float
    calls: int
    share: float  # of all profiled GPU time


class Profiler:
    """Collects per-dispatch GPU timestamps of the plan runs on one device."""

    def __init__(self, device):
        if "timestamp-query" not in device.features:
            raise FeatureError(f"profiling needs the timestamp-query feature, which {device.describe()} does not offer",
                               missing=["timestamp-query"])
        self.device = device
        self.period_ns = timestamp_period_ns(device.queue)
        self.events: list[dict] = []
        self.runs = 0
        self._sets: list = []
        self._resolve = self._staging = None
        self._capacity = 0

    def prepare(self, dispatches: int):
        """Query sets and buffers for a run of ``dispatches`` dispatches: (query sets, resolve buffer, staging)."""
        queries = 2 * dispatches
        while len(self._sets) * QUERIES_PER_SET < queries:
            self._sets.append(self.device.wgpu_device.create_query_set(
                type=wgpu.QueryType.timestamp, count=QUERIES_PER_SET, label="meganeura profile"))
        if self._capacity < queries:
            for buffer in (self._resolve, self._staging):
                if buffer is not None:
                    self.device.destroy_buffer(buffer)
            size = len(self._sets) * QUERIES_PER_SET * 8
            usage = wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
            self._resolve = self.device.create_buffer(size, usage, "meganeura profile resolve")
            self._staging = self.device.staging_buffer(size, "meganeura profile staging")
            self._capacity = len(self._sets) * QUERIES_PER_SET
        return self._sets, self._resolve, self._staging

    def timestamp_writes(self, index: int) -> dict:
        """The ``timestamp_writes`` of the compute pass holding dispatch ``index``."""
        query_set = self._sets[2 * index // QUERIES_PER_SET]
        first = 2 * index % QUERIES_PER_SET
        return {"query_set": query_set, "beginning_of_pass_write_index": first, "end_of_pass_write_index": first + 1}

    def resolve(self, encoder, dispatches: int) -> None:
        """Record the copy of this run's timestamps into the staging buffer (after the last pass)."""
        queries = 2 * dispatches
        for i, query_set in enumerate(self._sets):
            count = min(QUERIES_PER_SET, queries - i * QUERIES_PER_SET)
            if count <= 0:
                break
            offset = i * QUERIES_PER_SET * 8
            encoder.resolve_query_set(query_set, 0, count, self._resolve, offset)
        size = -(-queries * 8 // RESOLVE_ALIGNMENT) * RESOLVE_ALIGNMENT
        encoder.copy_buffer_to_buffer(self._resolve, 0, self._staging, 0, min(size, self._staging.size))

    def collect(self, dispatches) -> None:
        """Read the timestamps of the run just waited for; ``dispatches`` are the plan's, in order."""
        data = self.device.read_staging(self._staging, 2 * len(dispatches) * 8)
        ticks = np.frombuffer(data, np.uint64).reshape(-1, 2).astype(np.float64)
        for d, (begin, end) in zip(dispatches, ticks):
            self.events.append({
                "name": d.label or d.kernel, "kernel": d.kernel, "workgroups": list(d.workgroups), "run": self.runs,
                "start_ns": begin * self.period_ns, "duration_ns": max(0.0, (end - begin) * self.period_ns),
            })
        self.runs += 1

    def top(self, n: int = 10) -> list[KernelTime]:
        """The ``n`` names with the most GPU time, summed over every profiled run."""
        totals: dict[str, list] = {}
        for e in self.events:
            entry = totals.setdefault(e["name"], [0.0, 0])
            entry[0] += e["duration_ns"]
            entry[1] += 1
        whole = sum(t for t, _ in totals.values()) or 1.0
        ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:n]
        return [KernelTime(name, float(t / 1e6), calls, float(t / whole)) for name, (t, calls) in ranked]

    def chrome_trace(self) -> dict:
        starts = {}
        for e in self.events:
            starts[e["run"]] = min(starts.get(e["run"], e["start_ns"]), e["start_ns"])
        events = [{
            "name": e["name"], "ph": "X", "pid": 0, "tid": e["run"],
            "ts": (e["start_ns"] - starts[e["run"]]) / 1e3, "dur": e["duration_ns"] / 1e3,
            "args": {"kernel": e["kernel"], "workgroups": e["workgroups"]},
        } for e in self.events]
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"device": self.device.describe(), "runs": self.runs}}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


@contextmanager
def profile(device):
    """Attach a fresh ``Profiler`` to ``device`` for the block; yields it (the previous one is restored after)."""
    previous = device.profiler
    device.profiler = Profiler(device)
    try:
        yield device.profiler
    finally:
        device.profiler = previous


def attach(device, path: str) -> "Profiler":
    """The device's profiler, attached now if it has none; its trace is written to ``path`` at exit."""
    if device.profiler is None:
        device.profiler = Profiler(device)
    atexit.register(device.profiler.save, path)
    return device.profiler


def profiler_from_env(device):
    """The profiler that ``MEGANEURA_PROFILE=path`` asks for (saved to ``path`` at exit), else None."""
    path = os.environ.get(PROFILE_ENV)
    if not path:
        return None
    profiler = Profiler(device)
    atexit.register(profiler.save, path)
    return profiler
