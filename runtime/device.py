"""The GPU device: adapter choice, limits and features, buffers, cached pipelines, and readable errors.

``get_device()`` returns one ``Device`` per adapter per process. The adapter is the argument, else the
``MEGANEURA_ADAPTER`` environment variable (an index into ``list_adapters()`` or a case-insensitive substring of
the adapter's name), else in a process of a ``torchrun`` job (``LOCAL_RANK`` set) the rank's own GPU (logged),
else the best kind available: discrete GPU, integrated GPU, virtual GPU, then CPU, with the OpenGL backend last.
Every wgpu validation or shader error is re-raised as ``MeganeuraError`` naming what was being built; a lost
device becomes ``DeviceLostError``.

Kernels are compiled without naga's runtime checks (a clamp on every array index, a counter bounding every loop):
the generated kernels stay in range and end by construction, and the checks cost 7-11 % of the GPU time of the
benchmark workloads on an H200. ``MEGANEURA_SHADER_CHECKS=1`` puts the checks back, to tell a kernel's
out-of-range access from other faults.

Waiting for the GPU at a read-back polls without blocking for up to ``MEGANEURA_SPIN_WAIT_MS`` milliseconds (default
20 on a GPU; 0 on a CPU adapter, whose own threads need the cores), then blocks: a thread woken from a blocking wait
comes back late, by 0.2-0.3 ms per call of ResNet-50 and Whisper-tiny on the H200 machine. ``0`` always blocks.

A device gets the adapter's maximal limits and the optional features meganeura uses (shader-f16, subgroups,
timestamp queries). ``MEGANEURA_LIMITS=webgpu-default`` (or ``get_device(limits="webgpu-default")``) holds it to
WebGPU's default limits and none of the features that shape kernels instead, as on many Apple, Intel and mobile
adapters: wgpu itself then refuses whatever exceeds them, and every plan is generated for them (the plan cache keys
on the limits, so such plans are kept apart). Timestamp queries stay where the adapter has them: they shape no
kernel, and profiling may be asked for after the device exists (the ``profile`` option, ``torch_meganeura.profile``).
"""
from __future__ import annotations

import logging
import os
import re
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import wgpu

from . import native
from .arena import SharedArena
from .in_flight import InFlight
from .counters import Counters
from .errors import DeviceLostError, MeganeuraError, NoAdapterError
from .profiler import profiler_from_env
from .requirements import SUBGROUP_OPS, default_limits
from .resident import BufferPool

ADAPTER_ENV = "MEGANEURA_ADAPTER"
SHADER_CHECKS_ENV = "MEGANEURA_SHADER_CHECKS"  # "1": compile kernels with naga's index clamps and loop bounds
SPIN_WAIT_ENV = "MEGANEURA_SPIN_WAIT_MS"  # how long a read-back polls before it blocks
SPIN_WAIT_MS = 20.0  # its default on GPU adapters
LIMITS_ENV = "MEGANEURA_LIMITS"  # "webgpu-default": request WebGPU's default limits, no shader-f16 or subgroups
ADAPTER_LIMITS, DEFAULT_LIMITS = "adapter", "webgpu-default"  # its values ("adapter" when unset)
RANK_ENV = "LOCAL_RANK"  # set by torchrun: with no adapter chosen, each process of a host takes its own GPU
log = logging.getLogger("meganeura.runtime")
STORAGE_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
STAGING_USAGE = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
INDIRECT_USAGE = wgpu.BufferUsage.INDIRECT | wgpu.BufferUsage.COPY_DST
UNIFORM_USAGE = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST
# A kernel of a plan over symbolic sizes reads them from a uniform in this bind group (``meganeura.kernels.wgsl``)
SIZES_GROUP_DECLARATION = "@group(1) @binding(0) var<uniform>"

_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
_WANTED_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-storage-buffers-per-shader-stage",
    "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroup-size-y",
    "max-compute-workgroup-size-z",
    "max-compute-workgroups-per-dimension",
    "max-bindings-per-bind-group",
)
# Threads that compile a plan's new pipelines side by side (bounded: a driver compiler uses memory per thread).
PIPELINE_THREADS = min(16, os.cpu_count() or 1)
_TIMESTAMP_FEATURES = ("timestamp-query", "timestamp-query-inside-passes")
_WANTED_FEATURES = ("shader-f16", "subgroup", *_TIMESTAMP_FEATURES)
_LOST = re.compile(r"device (is |was )?lost", re.IGNORECASE)
_NO_ADAPTER_HINT = (
    "Install a Vulkan driver (on Debian/Ubuntu: apt-get install mesa-vulkan-drivers libvulkan1, which also gives "
    "a CPU fallback) or run on macOS, where wgpu uses Metal."
)

_adapters: list | None = None
_devices: dict[tuple[int, str], "Device"] = {}  # (adapter index, limits) -> its device
_devices_lock = threading.RLock()  # get_device may run on prepare_device's thread and the caller's at once


def _enumerate_adapters() -> list:
    global _adapters
    with _devices_lock:
        if _adapters is None:
            _adapters = list(wgpu.gpu.enumerate_adapters_sync())
        return _adapters


def _adapter_name(adapter) -> str:
    info = adapter.info
    return info["device"] or info["description"] or info["vendor"] or "unnamed adapter"


def list_adapters() -> list[dict]:
    """Every adapter wgpu sees, in enumeration order (the indices ``MEGANEURA_ADAPTER`` accepts)."""
    return [
        {
            "index": i,
            "name": _adapter_name(a),
            "type": a.info["adapter_type"],
            "backend": a.info["backend_type"],
            "features": sorted(a.features),
            "limits": dict(a.limits),
        }
        for i, a in enumerate(_enumerate_adapters())
    ]


def _preference(adapters: list) -> list[int]:
    """Adapter indices, best first: non-OpenGL before OpenGL, then by adapter type, then enumeration order."""

    def rank(i):
        info = adapters[i].info
        return (info["backend_type"] == "OpenGL", _TYPE_RANK.get(info["adapter_type"], len(_TYPE_RANK)), i)

    return sorted(range(len(adapters)), key=rank)


def _choose_adapter(adapters: list, choice: str | int | None, local_rank: int | None = None) -> int:
    if not adapters:
        raise NoAdapterError(f"wgpu found no GPU adapter. {_NO_ADAPTER_HINT}")
    order = _preference(adapters)
    if choice is None and local_rank is not None:
        return _rank_adapter(adapters, order, local_rank)
    if choice is None:
        return order[0]
    names = ", ".join(f"{i}: {_adapter_name(a)} ({a.info['backend_type']})" for i, a in enumerate(adapters))
    if isinstance(choice, int) or choice.strip().isdigit():
        index = int(choice)
        if not 0 <= index < len(adapters):
            raise NoAdapterError(f"adapter index {index} is out of range; adapters are {names}")
        return index
    needle = choice.strip().lower()
    for i in order:
        info = adapters[i].info
        if needle in info["device"].lower() or needle in info["description"].lower():
            return i
    raise NoAdapterError(f"no adapter name contains {choice!r}; adapters are {names}")


def _rank_adapter(adapters: list, order: list[int], local_rank: int) -> int:
    """The adapter of process ``local_rank`` on a host: its GPU among the discrete and integrated ones of the best
    backend (a GPU a second backend lists again is not a second GPU), round robin when ranks outnumber GPUs; the
    best adapter when there is no GPU (every rank on the CPU driver)."""
    backend = adapters[order[0]].info["backend_type"]
    gpus = [i for i in order if adapters[i].info["backend_type"] == backend
            and adapters[i].info["adapter_type"] in ("DiscreteGPU", "IntegratedGPU")]
    return gpus[local_rank % len(gpus)] if gpus else order[0]


def _spin_seconds(adapter_type: str) -> float:
    """How long a read-back polls before blocking: ``MEGANEURA_SPIN_WAIT_MS``, else SPIN_WAIT_MS on a GPU and 0 on a
    CPU adapter."""
    text = os.environ.get(SPIN_WAIT_ENV, "").strip()
    if not text:
        return 0.0 if adapter_type == "CPU" else SPIN_WAIT_MS / 1e3
    try:
        milliseconds = float(text)
    except ValueError:
        raise MeganeuraError(f"{SPIN_WAIT_ENV}={text!r} is not a number of milliseconds") from None
    if not milliseconds >= 0:
        raise MeganeuraError(f"{SPIN_WAIT_ENV}={text!r} must be 0 or more milliseconds")
    return milliseconds / 1e3


class _Checked:
    """``Device.checked``'s context: a class rather than a generator, as a plan run enters it a few times per call."""
    __slots__ = ("device", "label")

    def __init__(self, device: "Device", label: str):
        self.device, self.label = device, label

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, _traceback) -> bool:
        if kind is None or not issubclass(kind, (wgpu.GPUError, wgpu.GPUPipelineError)):
            return False
        text, device = str(error), self.device
        if _LOST.search(text):
            device.lost = True
            raise DeviceLostError(f"{self.label}: the device {device.name} was lost\n{text}") from error
        raise MeganeuraError(f"{self.label}: wgpu refused it\n{text}") from error


def _limits_choice(limits: str | None) -> str:
    """``limits``, else ``MEGANEURA_LIMITS``, else "adapter"; checked."""
    choice = (limits if limits is not None else os.environ.get(LIMITS_ENV, "")).strip() or ADAPTER_LIMITS
    if choice not in (ADAPTER_LIMITS, DEFAULT_LIMITS):
        raise MeganeuraError(f"limits {choice!r} (from {'the argument' if limits is not None else LIMITS_ENV}) is "
                             f"not one of {ADAPTER_LIMITS!r}, {DEFAULT_LIMITS!r}")
    return choice


def get_device(adapter: str | int | None = None, limits: str | None = None) -> "Device":
    """The process-wide device of the chosen adapter and limits (see the module docstring for the choices); a new
    one once the last was lost (what lived on the lost one is gone: programs built on it keep raising
    DeviceLostError)."""
    with _devices_lock:
        adapters = _enumerate_adapters()
        choice = adapter if adapter is not None else (os.environ.get(ADAPTER_ENV) or None)
        rank = os.environ.get(RANK_ENV, "").strip()
        index = _choose_adapter(adapters, choice, int(rank) if rank.isdigit() else None)
        key = (index, _limits_choice(limits))
        if key not in _devices or _devices[key].lost:
            _devices[key] = Device(adapters[index], key[1])
            if rank.isdigit():
                log.info("local rank %s uses adapter %d: %s", rank, index, _devices[key].describe())
        return _devices[key]


def prepare_device(adapter: str | int | None = None) -> None:
    """Start ``get_device(adapter)`` on a background thread, so that creating the device (0.3-1.0 s for an H200's
    Vulkan driver) overlaps the caller's other work; a later ``get_device`` waits for it. A failure is left for
    that later call to raise."""
    def create() -> None:
        try:
            get_device(adapter)
        except Exception as err:  # noqa: BLE001 - raised again, with its message, by the caller's own get_device
            log.debug("preparing the device failed: %s", err)

    threading.Thread(target=create, name="meganeura-device", daemon=True).start()


class Device:
    """An adapter's wgpu device and queue, requested with the adapter's maximal limits, or with ``limits`` =
    "webgpu-default" with WebGPU's default limits and no shader-f16 or subgroups (see the module docstring)."""

    def __init__(self, adapter, limits: str = ADAPTER_LIMITS):
        info = adapter.info
        self.adapter = adapter
        self.name = _adapter_name(adapter)
        self.adapter_type = info["adapter_type"]
        self.backend = info["backend_type"]
        self.restricted = limits == DEFAULT_LIMITS  # held to WebGPU's default limits, no shader-f16 or subgroups
        self.counters = Counters()
        self.lost = False
        self._destroyed = weakref.WeakSet()  # destroyed buffers whose Python objects live on (``any_destroyed``)
        if self.restricted:
            features = [f for f in _TIMESTAMP_FEATURES if f in adapter.features]
            required = default_limits(adapter.limits)  # all of them: wgpu-py fills the rest with the adapter's
        else:
            features = [f for f in _WANTED_FEATURES if f in adapter.features]
            required = {k: adapter.limits[k] for k in _WANTED_LIMITS if k in adapter.limits}
        with self.checked(f"device request on {self.name}"):
            self.wgpu_device = adapter.request_device_sync(
                label="meganeura", required_features=features, required_limits=required
            )
        self.queue = self.wgpu_device.queue
        self.features = set(self.wgpu_device.features)
        self.limits = dict(self.wgpu_device.limits)
        if "subgroup" in self.features:
            self.limits[SUBGROUP_OPS] = 1
        self.offset_alignment = self.limits["min-storage-buffer-offset-alignment"]
        self.max_binding_size = self.limits["max-storage-buffer-binding-size"]
        self.max_buffer_size = self.limits["max-buffer-size"]
        self.max_workgroups_per_dim = self.limits["max-compute-workgroups-per-dimension"]
        self.spin_seconds = _spin_seconds(self.adapter_type)
        self._layouts: dict[int, object] = {}
        self._sizes_layout = None
        self._pipelines: dict[tuple[str, int], Future] = {}  # (wgsl, bindings) -> its pipeline, compiled or compiling
        self._compiler: ThreadPoolExecutor | None = None  # the compiling threads, started by the first compile_ahead
        self.fence = self.storage_buffer(4, "meganeura fence")  # a copy source for runs that read nothing back
        self.pool = BufferPool(self)  # buffers of DeviceArrays (tensors kept on the device between runs)
        self.arena = SharedArena(self)  # the arena buffer of every program on this device
        self.in_flight = InFlight(self.counters)  # runs whose status is unread (``meganeura.runtime.in_flight``)
        self._fence_staging = None  # where ``synchronize`` copies the fence to wait for the queue
        self._submitted_since_wait = False  # (a wait waits for the whole queue: ``synchronize`` then has none to make)
        self.profiler = profiler_from_env(self)  # set while plan runs record per-dispatch GPU timestamps

    def describe(self) -> str:
        held = ", WebGPU default limits" if self.restricted else ""
        return f"{self.name} ({self.adapter_type}, {self.backend}{held})"

    def __repr__(self) -> str:
        return f"<meganeura Device {self.describe()}>"

    def checked(self, label: str) -> "_Checked":
        """A context for wgpu calls that turns wgpu errors into MeganeuraError (DeviceLostError if the device is
        gone)."""
        if self.lost:
            raise DeviceLostError(f"{label}: the device {self.name} was lost; create a new one")
        return _Checked(self, label)

    # ---- pipelines and bind groups

    def bind_group_layout(self, n_bindings: int):
        """The layout of ``n_bindings`` read_write storage buffers visible to compute, cached per count."""
        layout = self._layouts.get(n_bindings)
        if layout is None:
            storage = {"type": wgpu.BufferBindingType.storage}
            entries = [
                {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": storage} for i in range(n_bindings)
            ]
            with self.checked(f"bind group layout of {n_bindings} storage buffers"):
                layout = self.wgpu_device.create_bind_group_layout(entries=entries)
            self._layouts[n_bindings] = layout
        return layout

    def pipeline(self, wgsl: str, n_bindings: int, label: str = "kernel"):
        """The compute pipeline of ``wgsl`` (entry point ``main``), compiled once per WGSL text."""
        return self.pipelines([(wgsl, n_bindings, label)])[0]

    def compile_ahead(self, kernels: list[tuple[str, int, str]]) -> None:
        """Start compiling the pipelines of ``kernels`` ((wgsl, binding count, label) each) that are neither compiled
        nor compiling, and return at once; ``pipelines`` takes them when they are done.

        They are compiled side by side on up to ``PIPELINE_THREADS`` threads, the longest sources first (the slowest
        kernel bounds the whole): shader translation and the driver's compiler make up most of a cold first call,
        and wgpu's device is thread-safe (its calls release the GIL; wgpu-py keeps errors per thread)."""
        jobs = {}
        for wgsl, n, label in kernels:
            if (wgsl, n) not in self._pipelines:
                jobs.setdefault((wgsl, n), label)
        if not jobs:
            return
        for n in {n for _, n in jobs}:
            self.bind_group_layout(n)  # created here, not raced for by the threads
        self.sizes_group_layout()
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(PIPELINE_THREADS, thread_name_prefix="meganeura-pipelines")
        for (wgsl, n), label in sorted(jobs.items(), key=lambda job: -len(job[0][0])):
            self._pipelines[(wgsl, n)] = self._compiler.submit(self._compile_pipeline, wgsl, n, label)
        self.counters.pipelines_created += len(jobs)

    def pipelines(self, kernels: list[tuple[str, int, str]]) -> list:
        """The compute pipelines of ``kernels`` ((wgsl, binding count, label) each), compiled once per WGSL text
        (see ``compile_ahead``); raises the first compile error among them, naming its kernel (a kernel that failed
        is compiled again when asked for again)."""
        self.compile_ahead(kernels)
        futures = {key: self._pipelines[key] for key in dict.fromkeys((wgsl, n) for wgsl, n, _ in kernels)}
        failure = None
        for key, future in futures.items():  # every one is waited for, so that none is left compiling after a failure
            if future.exception() is not None:
                failure = failure or future.exception()
                if self._pipelines.get(key) is future:
                    del self._pipelines[key]
        if failure is not None:
            raise failure
        return [futures[(wgsl, n)].result() for wgsl, n, _ in kernels]

    def _compile_pipeline(self, wgsl: str, n_bindings: int, label: str):
        with self.checked(f"kernel {label!r}"):
            module = None
            if os.environ.get(SHADER_CHECKS_ENV) != "1":
                module = native.create_unchecked_shader_module(self.wgpu_device, wgsl, label)
            if module is None:  # checks asked for, or wgpu-native's trusted entry point is unavailable
                module = self.wgpu_device.create_shader_module(code=wgsl, label=label)
            groups = [self.bind_group_layout(n_bindings)]
            if SIZES_GROUP_DECLARATION in wgsl:  # (a plan over symbolic sizes: their uniform, group 1)
                groups.append(self.sizes_group_layout())
            layout = self.wgpu_device.create_pipeline_layout(bind_group_layouts=groups, label=label)
            return self.wgpu_device.create_compute_pipeline(
                layout=layout, compute={"module": module, "entry_point": "main"}, label=label
            )

    def sizes_group_layout(self):
        """The layout of group 1 of a kernel over symbolic sizes: one uniform buffer, the sizes' values."""
        if self._sizes_layout is None:
            entries = [{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE,
                        "buffer": {"type": wgpu.BufferBindingType.uniform}}]
            with self.checked("bind group layout of a size buffer"):
                self._sizes_layout = self.wgpu_device.create_bind_group_layout(entries=entries)
        return self._sizes_layout

    def sizes_group(self, buffer):
        """The bind group of a plan's size buffer (``sizes_group_layout``)."""
        entries = [{"binding": 0, "resource": {"buffer": buffer, "offset": 0, "size": buffer.size}}]
        with self.checked("bind group of a size buffer"):
            group = self.wgpu_device.create_bind_group(layout=self.sizes_group_layout(), entries=entries)
        self.counters.bind_groups_created += 1
        return group

    def uniform_buffer(self, size: int, label: str = ""):
        """A uniform buffer written from the host (a plan's size buffer)."""
        return self.create_buffer(size, UNIFORM_USAGE, label)

    def bind_group(self, ranges: list[tuple[object, int, int]], label: str = ""):
        """A bind group of (buffer, offset, size) storage ranges at bindings 0, 1, ..."""
        entries = [
            {"binding": i, "resource": {"buffer": buf, "offset": offset, "size": size}}
            for i, (buf, offset, size) in enumerate(ranges)
        ]
        with self.checked(f"bind group {label!r}"):
            group = self.wgpu_device.create_bind_group(
                layout=self.bind_group_layout(len(ranges)), entries=entries, label=label
            )
        self.counters.bind_groups_created += 1
        return group

    # ---- buffers and transfers

    def create_buffer(self, size: int, usage: int, label: str = ""):
        with self.checked(f"buffer {label!r} of {size} bytes"):
            buffer = self.wgpu_device.create_buffer(size=size, usage=usage, label=label)
        self.counters.buffers_created += 1
        self.counters.bytes_allocated += size
        self.counters.peak_bytes_allocated = max(self.counters.peak_bytes_allocated, self.counters.bytes_allocated)
        return buffer

    def storage_buffer(self, size: int, label: str = ""):
        """A storage buffer that can also be written from the host and copied from."""
        return self.create_buffer(size, STORAGE_USAGE, label)

    def indirect_buffer(self, size: int, label: str = ""):
        """A buffer of dispatches' workgroup counts (three u32 each), written from the host."""
        return self.create_buffer(size, INDIRECT_USAGE, label)

    def staging_buffer(self, size: int, label: str = ""):
        """A host-readable buffer to copy results into."""
        return self.create_buffer(size, STAGING_USAGE, label)

    def destroy_buffer(self, buffer) -> None:
        buffer.destroy()
        self._destroyed.add(buffer)
        self.counters.bytes_allocated -= buffer.size

    def any_destroyed(self, buffers) -> bool:
        """Whether any of ``buffers`` is destroyed. A command list over one must not be recorded: wgpu-core aborts
        the process (a panic it cannot unwind through the C API) when such a command encoder is finished, where a
        submit over one is only refused. O(1) while no destroyed buffer is still referenced from Python."""
        return bool(self._destroyed) and any(buffer in self._destroyed for buffer in buffers)

    def write(self, buffer, offset: int, data, label: str = "") -> None:
        """Upload ``data`` (bytes-like, size a multiple of 4) into ``buffer`` at ``offset``."""
        view = memoryview(data).cast("B")
        with self.checked(f"upload to {label or buffer.label!r}"):
            self.queue.write_buffer(buffer, offset, view)
        self.counters.bytes_uploaded += view.nbytes

    def upload(self, data, label: str = ""):
        """A new storage buffer holding ``data`` (bytes-like, size a multiple of 4 and > 0)."""
        view = memoryview(data).cast("B")
        buffer = self.storage_buffer(view.nbytes, label)
        self.write(buffer, 0, view, label)
        return buffer

    def submit(self, encoder, label: str = "", before=()) -> None:
        """Finish ``encoder`` and submit it, after the finished command buffers ``before``, in one submit."""
        with self.checked(f"submit {label!r}"):
            commands = native.finish(encoder)
            self.queue.submit([*before, commands])
        self.counters.submits += 1
        self._submitted_since_wait = True

    def synchronize(self) -> None:
        """Wait for everything submitted; raise the first status error a run in flight set. Nothing to wait for
        where nothing was submitted since the last wait (a run that read its outputs back waited for the queue)."""
        if not self._submitted_since_wait and not self.in_flight:
            return
        if self.in_flight:
            self.counters.waits += 1
            self.in_flight.settle()
            return
        if self._fence_staging is None:
            self._fence_staging = self.staging_buffer(4, "meganeura fence read")
        with self.checked("synchronize"):
            encoder = self.wgpu_device.create_command_encoder()
            encoder.copy_buffer_to_buffer(self.fence, 0, self._fence_staging, 0, 4)
        self.submit(encoder, "synchronize")
        self.read_staging(self._fence_staging, 4)

    def _waited(self) -> None:
        """After a wait for the queue: count it, and read the runs in flight (the queue has passed them). A read of
        the runs in flight through one of them (``InFlight.read_through``) waited for that one only."""
        if not self.in_flight.reading_through:
            self._submitted_since_wait = False
        if not self.in_flight.settling:
            self.counters.waits += 1
            self.in_flight.settle()

    def read_mapped(self, buffer, size: int, on_unmapped) -> np.ndarray | memoryview:
        """Wait for the queue, then return the first ``size`` bytes of a staging buffer as an array over its mapped
        memory (no host copy); the buffer is unmapped and passed to ``on_unmapped`` once no array over it is left.
        Where wgpu-py's native backend is not in use, a copy, with the buffer passed back at once."""
        self.in_flight.before_wait()
        with self.checked(f"read back {buffer.label!r}"):
            try:
                data = native.read_mapped(self.wgpu_device, buffer, size, self.spin_seconds, on_unmapped)
            except RuntimeError as e:
                raise MeganeuraError(f"read back {buffer.label!r}: {e}") from e
        if data is None:
            data = self.read_staging(buffer, size)
            on_unmapped(buffer)
            return data
        self.counters.bytes_downloaded += size
        self._waited()
        return data

    def read_staging(self, buffer, size: int) -> np.ndarray | memoryview:
        """Wait for the queue, then return a host copy of the first ``size`` bytes of a staging buffer."""
        self.in_flight.before_wait()
        with self.checked(f"read back {buffer.label!r}"):
            try:
                data = native.read_back(self.wgpu_device, buffer, size, self.spin_seconds)
            except RuntimeError as e:
                raise MeganeuraError(f"read back {buffer.label!r}: {e}") from e
            if data is None:
                buffer.map_sync(wgpu.MapMode.READ, 0, size)
                try:
                    data = buffer.read_mapped(0, size, copy=True)
                finally:
                    buffer.unmap()
        self.counters.bytes_downloaded += size
        self._waited()
        return data
