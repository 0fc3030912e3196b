"""GPU time of alternative dispatch sequences, for choosing between kernel variants (the matmul tuner).

A sequence is a list of (pipeline, bind group, workgroups). Each is recorded ``reps`` times in one compute pass
whose beginning and end write timestamps where the adapter offers ``timestamp-query``; elsewhere its time is the
wall time of that submission, waited for (which also counts the host's submit and the wait, the same for every
candidate). Before the first measurement the first sequence runs for ``warmup_seconds`` (at least one submit), in
passes as long as the measured ones, so that a GPU that idled while pipelines compiled has its clocks up again (an
H200 run that compiled between measurements timed the same matmuls 3-5x slower than one that ran them back to
back). A sequence is measured ``ROUNDS`` times and its fastest round counts.
"""
from __future__ import annotations

import time

import numpy as np
import wgpu

from .native import timestamp_period_ns

# The default warm-up. An H200 whose GPU idled for the seconds of a tuning batch's compile timed its first matmul
# variants 2-7x slow for about the first 0.2 s of work (a sweep: 1024^3 476 -> 71 us, later in the same run).
# Warmed up by single runs, each submitted and waited for, it stayed slow: the first problem of a batch, 1024^3, timed
# its default at 181 us and kept a variant cut in 8 slices at 100 us.
WARMUP_SECONDS = 0.5
ROUNDS = 2
TARGET_SECONDS = 2e-3  # each measured pass lasts about this long: enough repetitions to rise above the noise
MAX_REPS = 20
MAX_WARMUP_REPS = 1000


def time_sequences(device, sequences: list[list[tuple]], warmup_seconds: float = WARMUP_SECONDS) -> list[float]:
    """Seconds per run of each sequence (a list of (pipeline, bind group, workgroups))."""
    timer = _Timer(device)
    _warm_up(timer, sequences[0], warmup_seconds)
    first = min(timer.measure(sequences[0], 1) for _ in range(ROUNDS))
    reps = _reps(first, MAX_REPS)
    return [min(timer.measure(seq, reps) for _ in range(ROUNDS)) / reps for seq in sequences]


def _warm_up(timer, sequence: list[tuple], seconds: float) -> None:
    """Run ``sequence`` for ``seconds`` (at least once) in passes of about TARGET_SECONDS each, keeping the GPU busy
    rather than idle between one short pass and the next."""
    end = time.perf_counter() + seconds
    reps = 1
    while True:
        per_run = timer.measure(sequence, reps) / reps
        if time.perf_counter() >= end:
            return
        reps = _reps(per_run, MAX_WARMUP_REPS)


def _reps(seconds_per_run: float, most: int) -> int:
    """Runs per pass for a pass of about TARGET_SECONDS, between 1 and ``most``."""
    return max(1, min(most, int(TARGET_SECONDS / max(seconds_per_run, 1e-7))))


class _Timer:
    def __init__(self, device):
        self.device = device
        self.timestamps = "timestamp-query" in device.features
        if self.timestamps:
            wd = device.wgpu_device
            self.period_ns = timestamp_period_ns(device.queue)
            self.query_set = wd.create_query_set(type=wgpu.QueryType.timestamp, count=2, label="meganeura timing")
            self.resolved = device.create_buffer(256, wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC,
                                                 "meganeura timing resolve")
        self.staging = device.staging_buffer(256, "meganeura timing staging")

    def measure(self, sequence: list[tuple], reps: int) -> float:
        """Seconds for ``reps`` runs of ``sequence`` in one pass."""
        dev = self.device
        encoder = dev.wgpu_device.create_command_encoder()
        writes = ({"query_set": self.query_set, "beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1}
                  if self.timestamps else None)
        compute = encoder.begin_compute_pass(timestamp_writes=writes)
        for _ in range(reps):
            for pipeline, group, workgroups in sequence:
                compute.set_pipeline(pipeline)
                compute.set_bind_group(0, group)
                compute.dispatch_workgroups(*workgroups)
        compute.end()
        if self.timestamps:
            encoder.resolve_query_set(self.query_set, 0, 2, self.resolved, 0)
            encoder.copy_buffer_to_buffer(self.resolved, 0, self.staging, 0, 16)
        else:
            encoder.copy_buffer_to_buffer(dev.fence, 0, self.staging, 0, 4)
        start = time.perf_counter()
        dev.submit(encoder, "timing")
        data = dev.read_staging(self.staging, 16 if self.timestamps else 4)
        if not self.timestamps:
            return time.perf_counter() - start
        begin, end = np.frombuffer(data, np.uint64)[:2].astype(np.float64)
        return max(0.0, end - begin) * self.period_ns * 1e-9
