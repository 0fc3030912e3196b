"""Counters of device work (pipelines, buffers, bind groups, submits, bytes moved), for tests and reports."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Counters:
    pipelines_created: int = 0
    buffers_created: int = 0
    bind_groups_created: int = 0
    submits: int = 0
    waits: int = 0  # host waits for the GPU: read-backs and downloads (``meganeura.runtime.in_flight``)
    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    bytes_allocated: int = 0  # live: buffer creation adds its size, destruction subtracts it
    peak_bytes_allocated: int = 0  # the most ``bytes_allocated`` reached (a caller may lower it to start a window)

    def snapshot(self) -> dict[str, int]:
        return asdict(self)
