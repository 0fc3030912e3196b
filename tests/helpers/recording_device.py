"""A device with no GPU behind it, for tests of plans, bindings and fusion that need no Vulkan adapter.

``RecordingDevice`` has what ``meganeura.runtime.program.Program`` (and the ``ReadBackBuffers``, ``BufferPool`` and
``DeviceArray`` it uses) asks of a ``meganeura.runtime.device.Device``: limits and features, buffers with host memory
behind them, pipelines compiled once per WGSL text, bind groups, command encoders, submits and read-backs. Nothing is
computed: a dispatch is recorded, not run, so outputs hold whatever their buffers held (zeros, or stale data).
Uploads, buffer clears and copies do happen, in host memory, so inputs, status words and read-backs behave as they
would.

What it records, in order: ``buffers`` (every buffer created, with its label, size and kind), ``compiled`` (the
(WGSL, binding count, label) of each pipeline compiled) and ``submits`` (each submit's label and the commands of its
command buffers); ``dispatched()`` lists every dispatch submitted so far as (kernel, workgroups, bindings). Like
wgpu, it refuses (``MeganeuraError``) a bind group range outside its buffer, at an offset not aligned to
``min-storage-buffer-offset-alignment``, over a destroyed or a staging buffer; a kernel that declares a binding its
layout lacks; and a submit that uses a destroyed buffer.

It imports neither torch nor wgpu (tests/runtime/test_program_recorded.py checks).
"""
from __future__ import annotations

import re
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from meganeura.runtime.counters import Counters
from meganeura.runtime.errors import DeviceLostError, MeganeuraError
from meganeura.runtime.requirements import WEBGPU_DEFAULT_LIMITS  # every adapter has at least these
from meganeura.runtime.arena import SharedArena
from meganeura.runtime.in_flight import InFlight
from meganeura.runtime.resident import BufferPool

_BINDING = re.compile(r"@group\(0\)\s*@binding\((\d+)\)")


@dataclass(eq=False)
class RecordedBuffer:
    label: str
    size: int
    kind: str  # "storage" or "staging"
    data: bytearray = field(repr=False)
    destroyed: bool = False

    def destroy(self) -> None:
        self.destroyed = True


@dataclass(eq=False, frozen=True)
class RecordedPipeline:
    wgsl: str = field(repr=False)
    n_bindings: int
    label: str


@dataclass(eq=False, frozen=True)
class RecordedBindGroup:
    ranges: tuple[tuple[RecordedBuffer, int, int], ...]  # (buffer, offset, size) at bindings 0, 1, ...
    label: str


@dataclass(frozen=True)
class Dispatch:
    pipeline: RecordedPipeline
    group: RecordedBindGroup
    workgroups: tuple[int, int, int]


@dataclass(frozen=True)
class Copy:
    source: RecordedBuffer
    source_offset: int
    destination: RecordedBuffer
    destination_offset: int
    size: int


@dataclass(frozen=True)
class Clear:
    buffer: RecordedBuffer


@dataclass(frozen=True)
class CommandBuffer:
    commands: tuple


@dataclass(frozen=True)
class Submit:
    label: str
    command_buffers: tuple[CommandBuffer, ...]

    @property
    def dispatches(self) -> list[Dispatch]:
        return [c for buffer in self.command_buffers for c in buffer.commands if isinstance(c, Dispatch)]


class RecordingPass:
    """A compute pass: what is set when a dispatch is recorded goes with it."""

    def __init__(self, commands: list):
        self._commands = commands
        self._pipeline = self._group = None

    def set_pipeline(self, pipeline: RecordedPipeline) -> None:
        self._pipeline = pipeline

    def set_bind_group(self, index: int, group: RecordedBindGroup) -> None:
        assert index in (0, 1), f"plans bind group 0, and group 1 for their sizes, not {index}"
        if index == 0:
            self._group = group

    def dispatch_workgroups_indirect(self, buffer: RecordedBuffer, offset: int) -> None:
        """A dispatch whose workgroup counts a plan over symbolic sizes wrote into ``buffer`` (three u32)."""
        assert not buffer.destroyed and offset + 12 <= buffer.size, f"indirect counts out of {buffer.label!r}"
        self.dispatch_workgroups(*np.frombuffer(bytes(buffer.data[offset:offset + 12]), np.uint32).tolist())

    def dispatch_workgroups(self, x: int, y: int = 1, z: int = 1) -> None:
        assert self._pipeline is not None and self._group is not None, "a dispatch with no pipeline or bind group"
        assert len(self._group.ranges) == self._pipeline.n_bindings, (
            f"kernel {self._pipeline.label!r} takes {self._pipeline.n_bindings} bindings, the group has "
            f"{len(self._group.ranges)}")
        self._commands.append(Dispatch(self._pipeline, self._group, (x, y, z)))

    def end(self) -> None:
        pass


class RecordingEncoder:
    def __init__(self):
        self._commands: list = []

    def begin_compute_pass(self, timestamp_writes=None) -> RecordingPass:
        return RecordingPass(self._commands)

    def clear_buffer(self, buffer: RecordedBuffer) -> None:
        self._commands.append(Clear(buffer))

    def copy_buffer_to_buffer(self, source, source_offset: int, destination, destination_offset: int,
                              size: int) -> None:
        self._commands.append(Copy(source, source_offset, destination, destination_offset, size))

    def finish(self) -> CommandBuffer:
        """The command buffer; a dispatch over a destroyed buffer fails here, as wgpu-core's finish does (it aborts
        the process: ``Device.any_destroyed``)."""
        gone = {r[0].label for c in self._commands if isinstance(c, Dispatch) for r in c.group.ranges if r[0].destroyed}
        assert not gone, f"a command encoder finished over destroyed buffers {sorted(gone)}: wgpu-core aborts here"
        return CommandBuffer(tuple(self._commands))


class RecordingDevice:
    """A device of ``limits`` (WebGPU's defaults, updated with the given ones) and ``features`` that records what is
    asked of it (see the module docstring); ``on_dispatch``, if given, is called with each dispatch when it is
    submitted, between the clears and copies before and after it (a stand-in for a kernel, e.g. one that raises a
    status word)."""

    def __init__(self, limits: dict | None = None, features=(), name: str = "recording device", on_dispatch=None):
        self.name = name
        self.on_dispatch = on_dispatch
        self.adapter_type = "CPU"
        self.backend = "none"
        self.counters = Counters()
        self.lost = False
        self.features = set(features)
        self.limits = {**WEBGPU_DEFAULT_LIMITS, **(limits or {})}
        self.offset_alignment = self.limits["min-storage-buffer-offset-alignment"]
        self.max_binding_size = self.limits["max-storage-buffer-binding-size"]
        self.max_buffer_size = self.limits["max-buffer-size"]
        self.max_workgroups_per_dim = self.limits["max-compute-workgroups-per-dimension"]
        self.wgpu_device = self  # meganeura.runtime.native falls back to create_command_encoder() on it
        self.profiler = None
        self.buffers: list[RecordedBuffer] = []
        self.compiled: list[tuple[str, int, str]] = []
        self.submits: list[Submit] = []
        self._pipelines: dict[tuple[str, int], RecordedPipeline] = {}
        self.fence = self.storage_buffer(4, "meganeura fence")
        self.pool = BufferPool(self)
        self.arena = SharedArena(self)
        self.in_flight = InFlight(self.counters)
        self._submitted_since_wait = False  # as ``Device``'s: ``synchronize`` waits only for what is unwaited

    def describe(self) -> str:
        return f"{self.name} (no GPU)"

    def __repr__(self) -> str:
        return f"<RecordingDevice {self.describe()}>"

    def checked(self, label: str):
        if self.lost:
            raise DeviceLostError(f"{label}: the device {self.name} was lost; create a new one")
        return nullcontext()

    # ---- what was recorded

    def dispatched(self) -> list[tuple]:
        """Every dispatch submitted so far, in order: (kernel, workgroups, bindings), the kernel as its pipeline's
        label (a plan's kernel key, for a Program), a binding as (buffer label, offset, size)."""
        return [(d.pipeline.label, d.workgroups, tuple((b.label, offset, size) for b, offset, size in d.group.ranges))
                for submit in self.submits for d in submit.dispatches]

    # ---- pipelines and bind groups

    def pipeline(self, wgsl: str, n_bindings: int, label: str = "kernel") -> RecordedPipeline:
        return self.pipelines([(wgsl, n_bindings, label)])[0]

    def compile_ahead(self, kernels: list[tuple[str, int, str]]) -> None:
        for wgsl, n, label in kernels:
            if (wgsl, n) in self._pipelines:
                continue
            declared = {int(i) for i in _BINDING.findall(wgsl)}
            if any(i >= n for i in declared):
                raise MeganeuraError(f"kernel {label!r}: wgpu refused it\nit declares bindings {sorted(declared)}, "
                                     f"its layout has {n}")
            self._pipelines[(wgsl, n)] = RecordedPipeline(wgsl, n, label)
            self.compiled.append((wgsl, n, label))
            self.counters.pipelines_created += 1

    def pipelines(self, kernels: list[tuple[str, int, str]]) -> list[RecordedPipeline]:
        self.compile_ahead(kernels)
        return [self._pipelines[(wgsl, n)] for wgsl, n, _ in kernels]

    def bind_group(self, ranges: list[tuple[RecordedBuffer, int, int]], label: str = "") -> RecordedBindGroup:
        for i, (buffer, offset, size) in enumerate(ranges):
            problem = ("is destroyed" if buffer.destroyed
                       else "is a staging buffer, not a storage buffer" if buffer.kind != "storage"
                       else f"has {buffer.size} bytes" if offset + size > buffer.size
                       else f"is bound at offset {offset}, not a multiple of {self.offset_alignment}"
                       if offset % self.offset_alignment else None)
            if problem:
                raise MeganeuraError(f"bind group {label!r}: wgpu refused it\nbinding {i} ({offset}, {size}) of "
                                     f"buffer {buffer.label!r}: the buffer {problem}")
        self.counters.bind_groups_created += 1
        return RecordedBindGroup(tuple(ranges), label)

    # ---- buffers and transfers

    def create_buffer(self, size: int, kind: str, label: str = "") -> RecordedBuffer:
        buffer = RecordedBuffer(label, size, kind, bytearray(size))
        self.buffers.append(buffer)
        self.counters.buffers_created += 1
        self.counters.bytes_allocated += size
        self.counters.peak_bytes_allocated = max(self.counters.peak_bytes_allocated, self.counters.bytes_allocated)
        return buffer

    def storage_buffer(self, size: int, label: str = "") -> RecordedBuffer:
        return self.create_buffer(size, "storage", label)

    def uniform_buffer(self, size: int, label: str = "") -> RecordedBuffer:
        return self.create_buffer(size, "storage", label)

    def indirect_buffer(self, size: int, label: str = "") -> RecordedBuffer:
        return self.create_buffer(size, "storage", label)

    def sizes_group(self, buffer: RecordedBuffer) -> RecordedBindGroup:
        """Group 1 of a plan over symbolic sizes: its size buffer."""
        self.counters.bind_groups_created += 1
        return RecordedBindGroup(((buffer, 0, buffer.size),), "sizes")

    def staging_buffer(self, size: int, label: str = "") -> RecordedBuffer:
        return self.create_buffer(size, "staging", label)

    def destroy_buffer(self, buffer: RecordedBuffer) -> None:
        buffer.destroy()
        self.counters.bytes_allocated -= buffer.size

    def any_destroyed(self, buffers) -> bool:
        return any(buffer.destroyed for buffer in buffers)

    def write(self, buffer: RecordedBuffer, offset: int, data, label: str = "") -> None:
        view = memoryview(data).cast("B")
        assert buffer.kind == "storage" and not buffer.destroyed, f"write to {buffer!r}"
        assert offset % 4 == 0 and view.nbytes % 4 == 0 and offset + view.nbytes <= buffer.size, (
            f"write of {view.nbytes} bytes at {offset} into {buffer.label!r} of {buffer.size}")
        buffer.data[offset:offset + view.nbytes] = view
        self.counters.bytes_uploaded += view.nbytes

    def upload(self, data, label: str = "") -> RecordedBuffer:
        view = memoryview(data).cast("B")
        buffer = self.storage_buffer(view.nbytes, label)
        self.write(buffer, 0, view, label)
        return buffer

    def create_command_encoder(self) -> RecordingEncoder:
        return RecordingEncoder()

    def submit(self, encoder: RecordingEncoder, label: str = "", before=()) -> None:
        """Record the submit; carry out its clears and copies in host memory (its dispatches compute nothing)."""
        submitted = (*before, CommandBuffer(tuple(encoder._commands)))  # (checked below, as ``finish`` would be)
        commands = [c for buffer in submitted for c in buffer.commands]
        for command in commands:
            used = ([r[0] for r in command.group.ranges] if isinstance(command, Dispatch) else
                    [command.source, command.destination] if isinstance(command, Copy) else [command.buffer])
            gone = [b.label for b in used if b.destroyed]
            if gone:
                raise MeganeuraError(f"submit {label!r}: wgpu refused it\nit uses destroyed buffers {gone}")
        for command in commands:
            if isinstance(command, Dispatch):
                if self.on_dispatch is not None:
                    self.on_dispatch(command)
            elif isinstance(command, Clear):
                command.buffer.data[:] = bytes(command.buffer.size)
            elif isinstance(command, Copy):
                source, destination = command.source, command.destination
                assert command.source_offset + command.size <= source.size, f"copy out of {source.label!r}"
                assert command.destination_offset + command.size <= destination.size, f"copy into {destination.label!r}"
                start = command.source_offset
                destination.data[command.destination_offset:command.destination_offset + command.size] = (
                    source.data[start:start + command.size])
        self.submits.append(Submit(label, submitted))
        self.counters.submits += 1
        self._submitted_since_wait = True

    def read_mapped(self, buffer: RecordedBuffer, size: int, on_unmapped) -> np.ndarray:
        """A copy of the first ``size`` bytes; the buffer is handed back at once (as where wgpu-native is absent)."""
        data = self.read_staging(buffer, size)
        on_unmapped(buffer)
        return data

    def read_staging(self, buffer: RecordedBuffer, size: int) -> np.ndarray:
        assert buffer.kind == "staging" and size <= buffer.size, f"read of {size} bytes from {buffer!r}"
        self.in_flight.before_wait()  # (``Device.read_staging``'s)
        self.counters.bytes_downloaded += size
        data = np.frombuffer(bytes(buffer.data[:size]), np.uint8).copy()
        if not self.in_flight.reading_through:  # (a read through one run in flight waited for that one only)
            self._submitted_since_wait = False
        if not self.in_flight.settling:  # a wait: the runs in flight are read (``Device._waited``)
            self.counters.waits += 1
            self.in_flight.settle()
        return data

    def synchronize(self) -> None:
        if not self._submitted_since_wait and not self.in_flight:
            return
        self._submitted_since_wait = False
        self.counters.waits += 1
        self.in_flight.settle()
