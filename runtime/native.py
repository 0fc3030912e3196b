"""Direct calls into wgpu-native for the replay loop, the read-back, the timestamp period and shader modules without
runtime checks, with the wgpu-py API as fallback.

wgpu-py wraps every native call in Python error capture, a few microseconds each, and a plan replay makes up to
three calls per dispatch. Recording a compute pass cannot fail at the call: wgpu stores a recording error in the
pass and reports it when the pass ends and the encoder finishes, and both of those still go through the checked
calls (``Device.submit``). So the dispatches are recorded with the raw functions when wgpu-py's native backend is
the one in use, and with the public methods otherwise. A run's encoder, compute passes and finished command buffer
are also made without the descriptors (and, for a pass, the Python object) that the API builds on every call: on
the H200 machine a one-dispatch run's host time went from 62 to 49 us (SmolLM2 inference 6.02 -> 5.90 ms).

wgpu-py's ``map_sync`` submits an empty command buffer first (a workaround for buffers written through a mapping,
which ours never are) and waits for a poll thread to resolve a promise: two thread hand-offs per call. The native
read-back maps and then polls the device on the calling thread. It first polls without blocking, for up to
``spin_seconds``, and only then waits for the idle queue: a blocked thread wakes up late (H200 host, a bare dispatch
and 4-byte read: 51 us to the mapped result blocking, 26 us spinning; Whisper-tiny's call 3.74 -> 3.40 ms), while a
spinning one holds a core, which a CPU adapter's own threads need (``Device`` spins only on GPUs).

``read_mapped`` (a program's outputs, ``meganeura.runtime.readback``) then hands out the mapped memory itself.
``read_back`` (a device array's download, the profiler's timestamps) copies it into a numpy array, which numpy
allocates on transparent huge pages where the kernel has them: a large copy then takes a few page faults instead
of thousands. A large read-back is copied by a few threads at once (numpy releases the GIL while it copies): one
thread's copy is bound by its own memory traffic, not by the machine's (SmolLM2's 24 MB of logits on an H200, when
outputs were copied: 11.9 -> 9.8 ms per inference call).
"""
from __future__ import annotations

import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

try:
    from wgpu.backends.wgpu_native import ffi as _ffi
    from wgpu.backends.wgpu_native import lib as _lib
    from wgpu.backends.wgpu_native import _api
except ImportError:  # another wgpu-py backend: the public API only
    _ffi = _lib = _api = None

MAP_POLLS = 3  # a wait for the idle queue runs the map callback; more than one is a safety margin
# A read-back is copied in slices of at least COPY_SLICE_BYTES by up to COPY_THREADS threads at once. H200 host,
# 24 MB: 3.2-3.7 ms by one thread, 2.1 by two, 1.5 by four or eight; 4 MB: 0.48 by one, 0.46 by two, 0.6 by four.
COPY_SLICE_BYTES = 4 << 20
COPY_THREADS = min(4, os.cpu_count() or 1)
_copy_pool: ThreadPoolExecutor | None = None
_map_results: list[int] = []  # statuses the map callback reported, consumed by read_back

if _ffi is not None:
    @_ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
    def _on_mapped(status, _message, _userdata1, _userdata2):
        _map_results.append(int(status))


def command_encoder(wgpu_device):
    """A new command encoder (wgpu-py's object), created without a descriptor: the API builds a labelled one per
    call. Its recording errors are raised where it finishes, which goes through the checked API."""
    handle = getattr(wgpu_device, "_internal", None)
    if _lib is None or handle is None:
        return wgpu_device.create_command_encoder()
    return _api.GPUCommandEncoder("", _api.libf.wgpuDeviceCreateCommandEncoder(handle, _ffi.NULL), wgpu_device)


def finish(encoder):
    """``encoder.finish()`` without a descriptor; checked like the API's (a recording error raises here)."""
    handle = getattr(encoder, "_internal", None)
    if _lib is None or handle is None:
        return encoder.finish()
    return _api.GPUCommandBuffer("", _api.libf.wgpuCommandEncoderFinish(handle, _ffi.NULL), encoder._device)


def compute_pass(encoder, commands, sizes_group=None) -> None:
    """Record ``(pipeline, bind group, (x, y, z))`` commands into a new compute pass of ``encoder`` and end it, with
    ``sizes_group`` (a plan's size buffer) bound as group 1 first where given. With the native backend the pass is
    raw: begun without a descriptor and released here, with no Python object."""
    handle = getattr(encoder, "_internal", None)
    if _lib is None or handle is None:
        compute = encoder.begin_compute_pass()
        if sizes_group is not None:
            compute.set_bind_group(1, sizes_group)
        _record_with_api(compute, commands)
        compute.end()
        return
    compute = _lib.wgpuCommandEncoderBeginComputePass(handle, _ffi.NULL)
    try:
        if sizes_group is not None:
            _lib.wgpuComputePassEncoderSetBindGroup(compute, 1, sizes_group._internal, 0, _ffi.NULL)
        _record_raw(compute, commands)
        _api.libf.wgpuComputePassEncoderEnd(compute)
    finally:
        _lib.wgpuComputePassEncoderRelease(compute)


class Indirect(NamedTuple):
    """A dispatch's workgroup counts read from ``buffer`` at ``offset`` (three u32) when it runs: a plan over
    symbolic sizes writes them at each run, and its recorded commands stay the same."""

    buffer: object
    offset: int


def record_dispatches(compute_pass, commands) -> None:
    """Record ``(pipeline, bind group, (x, y, z) or Indirect)`` commands into wgpu-py's ``compute_pass``, skipping
    repeated pipelines and bind groups."""
    handle = getattr(compute_pass, "_internal", None)
    if _lib is None or handle is None:
        _record_with_api(compute_pass, commands)
    else:
        _record_raw(handle, commands)


def _record_raw(handle, commands) -> None:
    set_pipeline = _lib.wgpuComputePassEncoderSetPipeline
    set_group = _lib.wgpuComputePassEncoderSetBindGroup
    dispatch = _lib.wgpuComputePassEncoderDispatchWorkgroups
    dispatch_indirect = _lib.wgpuComputePassEncoderDispatchWorkgroupsIndirect
    null = _ffi.NULL
    pipeline = group = None
    for next_pipeline, next_group, workgroups in commands:
        if next_pipeline is not pipeline:
            pipeline = next_pipeline
            set_pipeline(handle, pipeline._internal)
        if next_group is not group:
            group = next_group
            set_group(handle, 0, group._internal, 0, null)
        if type(workgroups) is Indirect:
            dispatch_indirect(handle, workgroups.buffer._internal, workgroups.offset)
        else:
            dispatch(handle, *workgroups)


def _record_with_api(compute_pass, commands) -> None:
    pipeline = group = None
    for next_pipeline, next_group, workgroups in commands:
        if next_pipeline is not pipeline:
            pipeline = next_pipeline
            compute_pass.set_pipeline(pipeline)
        if next_group is not group:
            group = next_group
            compute_pass.set_bind_group(0, group)
        if type(workgroups) is Indirect:
            compute_pass.dispatch_workgroups_indirect(workgroups.buffer, workgroups.offset)
        else:
            compute_pass.dispatch_workgroups(*workgroups)


def create_unchecked_shader_module(wgpu_device, wgsl: str, label: str):
    """The shader module of ``wgsl`` compiled without naga's runtime checks (index clamping on arrays and a
    counter that bounds every loop); None where wgpu-native's trusted entry point is unavailable.

    Only for kernels whose every index is in range and whose every loop ends by construction, as the generated
    ones are. Errors are raised like ``create_shader_module``'s (wgpu-py's checked library calls)."""
    create = getattr(_lib, "wgpuDeviceCreateShaderModuleTrusted", None)
    handle = getattr(wgpu_device, "_internal", None)
    if create is None or handle is None:
        return None
    source = _api.new_struct_p("WGPUShaderSourceWGSL *", code=_api.to_c_string_view(wgsl))
    source[0].chain.next = _ffi.NULL
    source[0].chain.sType = _lib.WGPUSType_ShaderSourceWGSL
    descriptor = _api.new_struct_p(
        "WGPUShaderModuleDescriptor *",
        nextInChain=_ffi.cast("WGPUChainedStruct *", source),
        label=_api.to_c_string_view(label),
    )
    module = _api.libf.wgpuDeviceCreateShaderModuleTrusted(handle, descriptor, _lib.WGPUShaderRuntimeChecks_None)
    if module == _ffi.NULL:
        raise RuntimeError(f"shader module {label!r} was not created")
    return _api.GPUShaderModule(label, module, wgpu_device)


def timestamp_period_ns(queue) -> float:
    """Nanoseconds per timestamp tick of ``queue`` (1.0 where the backend cannot say)."""
    handle = getattr(queue, "_internal", None)
    getter = getattr(_lib, "wgpuQueueGetTimestampPeriod", None)
    if getter is None or handle is None:
        return 1.0
    period = float(getter(handle))
    return period if period > 0 else 1.0


def read_back(device, buffer, size: int, spin_seconds: float = 0.0) -> np.ndarray | None:
    """Wait for ``device``'s queue and copy the first ``size`` bytes of the MAP_READ ``buffer``; None where the
    native path is unavailable (the caller then maps through the API). The wait polls without blocking for up to
    ``spin_seconds``, then blocks. Raises RuntimeError if mapping fails."""
    buffer_handle, device_handle = getattr(buffer, "_internal", None), getattr(device, "_internal", None)
    if _lib is None or buffer_handle is None or device_handle is None:
        return None
    _map_when_idle(device_handle, buffer_handle, size, spin_seconds)
    try:
        data = np.empty(size, np.uint8)
        mapped = _lib.wgpuBufferGetConstMappedRange(buffer_handle, 0, size)
        threads = min(COPY_THREADS, size // COPY_SLICE_BYTES)
        if threads < 2:
            _ffi.memmove(_ffi.from_buffer(data), mapped, size)
        else:
            _copy_in_slices(data, np.frombuffer(_ffi.buffer(_ffi.cast("char *", mapped), size), np.uint8), threads)
    finally:
        _lib.wgpuBufferUnmap(buffer_handle)
    return data


def read_mapped(device, buffer, size: int, spin_seconds: float, on_unmapped) -> np.ndarray | None:
    """Wait for ``device``'s queue, map the MAP_READ ``buffer`` and return its first ``size`` bytes as a writable
    numpy array over the mapped memory itself, with no copy. The buffer stays mapped while any array over that memory
    lives; then it is unmapped and passed to ``on_unmapped``. None where the native path is unavailable. The wait is
    ``read_back``'s."""
    buffer_handle, device_handle = getattr(buffer, "_internal", None), getattr(device, "_internal", None)
    if _lib is None or buffer_handle is None or device_handle is None:
        return None
    _map_when_idle(device_handle, buffer_handle, size, spin_seconds)
    address = int(_ffi.cast("uintptr_t", _lib.wgpuBufferGetConstMappedRange(buffer_handle, 0, size)))
    return np.asarray(_MappedRange(buffer, address, size, on_unmapped))


class _MappedRange:
    """Owns a mapped range: numpy arrays over it hold this object as their base, and the last one to go unmaps the
    buffer (a READ mapping's memory is the host's own; what is written to it is never sent back)."""

    def __init__(self, buffer, address: int, size: int, on_unmapped):
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3}
        weakref.finalize(self, _unmap, buffer, on_unmapped).atexit = False  # at exit the process drops it all


def _unmap(buffer, on_unmapped) -> None:
    handle = getattr(buffer, "_internal", None)
    if handle is None or _lib is None:  # released by wgpu-py already (interpreter shutdown)
        return
    _lib.wgpuBufferUnmap(handle)
    on_unmapped(buffer)


def _map_when_idle(device_handle, buffer_handle, size: int, spin_seconds: float) -> None:
    """Map the first ``size`` bytes of a buffer for reading, once the queue has finished what uses it."""
    info = _ffi.new("WGPUBufferMapCallbackInfo *")
    info.mode = _lib.WGPUCallbackMode_AllowProcessEvents
    info.callback = _on_mapped
    _map_results.clear()
    _lib.wgpuBufferMapAsync(buffer_handle, _lib.WGPUMapMode_Read, 0, size, info[0])
    _spin(device_handle, spin_seconds)
    for _ in range(MAP_POLLS):
        if _map_results:
            break
        _lib.wgpuDevicePoll(device_handle, True, _ffi.NULL)  # returns when the queue is idle
    if not _map_results:
        raise RuntimeError(f"the read-back buffer was not mapped after {MAP_POLLS} waits for an idle queue")
    if _map_results[0] != _lib.WGPUMapAsyncStatus_Success:
        raise RuntimeError(f"mapping the read-back buffer failed (status {_map_results[0]})")


def _spin(device_handle, seconds: float) -> None:
    """Poll ``device_handle`` without blocking until a map callback has run or ``seconds`` have passed."""
    if seconds <= 0:
        return
    poll, null = _lib.wgpuDevicePoll, _ffi.NULL
    deadline = time.perf_counter() + seconds
    while not _map_results and time.perf_counter() < deadline:
        poll(device_handle, False, null)


def _copy_in_slices(destination: np.ndarray, source: np.ndarray, threads: int) -> None:
    global _copy_pool
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="meganeura-read-back")
    step = -(-source.size // threads // 4096) * 4096  # page-aligned slices
    slices = [slice(start, start + step) for start in range(0, source.size, step)]
    for done in [_copy_pool.submit(np.copyto, destination[s], source[s]) for s in slices]:
        done.result()
