"""Direct calls into wgpu-native for the replay loop and the timestamp period, with the wgpu-py API as fallback.

wgpu-py wraps every native call in Python error capture, a few microseconds each, and a plan replay makes up to
three calls per dispatch. Recording a compute pass cannot fail at the call: wgpu stores a recording error in the
pass and reports it when the pass ends and the encoder finishes, and both of those still go through the checked
API (``Device.submit``). So the dispatches are recorded with the raw functions when wgpu-py's native backend is the
one in use, and with the public methods otherwise.
"""
from __future__ import annotations

try:
    from wgpu.backends.wgpu_native import ffi as _ffi
    from wgpu.backends.wgpu_native import lib as _lib
except ImportError:  # another wgpu-py backend: the public API only
    _ffi = _lib = None


def record_dispatches(compute_pass, commands) -> None:
    """Record ``(pipeline, bind group, (x, y, z))`` commands, skipping repeated pipelines and bind groups."""
    handle = getattr(compute_pass, "_internal", None)
    if _lib is None or handle is None:
        _record_with_api(compute_pass, commands)
        return
    set_pipeline = _lib.wgpuComputePassEncoderSetPipeline
    set_group = _lib.wgpuComputePassEncoderSetBindGroup
    dispatch = _lib.wgpuComputePassEncoderDispatchWorkgroups
    null = _ffi.NULL
    pipeline = group = None
    for next_pipeline, next_group, (x, y, z) in commands:
        if next_pipeline is not pipeline:
            pipeline = next_pipeline
            set_pipeline(handle, pipeline._internal)
        if next_group is not group:
            group = next_group
            set_group(handle, 0, group._internal, 0, null)
        dispatch(handle, x, y, z)


def _record_with_api(compute_pass, commands) -> None:
    pipeline = group = None
    for next_pipeline, next_group, workgroups in commands:
        if next_pipeline is not pipeline:
            pipeline = next_pipeline
            compute_pass.set_pipeline(pipeline)
        if next_group is not group:
            group = next_group
            compute_pass.set_bind_group(0, group)
        compute_pass.dispatch_workgroups(*workgroups)


def timestamp_period_ns(queue) -> float:
    """Nanoseconds per timestamp tick of ``queue`` (1.0 where the backend cannot say)."""
    handle = getattr(queue, "_internal", None)
    getter = getattr(_lib, "wgpuQueueGetTimestampPeriod", None)
    if getter is None or handle is None:
        return 1.0
    period = float(getter(handle))
    return period if period > 0 else 1.0
