"""What a program checks before it builds or runs anything: a plan against its device's limits (``check_limits``),
and each host array against its tensor's spec on the way up (``to_device_array``); and the read-back's bytes
taken apart into host arrays (``from_device_bytes``)."""
from __future__ import annotations

import numpy as np

from .device import Device
from .dtypes import HOST_DTYPE, from_storage, host_words
from .errors import InputError, LimitError
from .plan import Plan, TensorSpec

_INT32 = np.iinfo(np.int32)
_HOST_FORM = {"bfloat16": " (its raw bits as uint16; numpy has no bfloat16)"}


def to_device_array(spec: TensorSpec, value, kind: str = "input") -> np.ndarray:
    """Check ``value`` against ``spec`` and return it as a contiguous array of the device dtype."""
    if not isinstance(value, np.ndarray):
        raise InputError(
            f"{kind} {spec.name!r} must be a numpy array ({spec.dtype}, shape {spec.shape}), got {type(value).__name__}"
        )
    if value.dtype != HOST_DTYPE[spec.dtype]:
        raise InputError(f"{kind} {spec.name!r} expects dtype {spec.dtype}{_HOST_FORM.get(spec.dtype, '')}, "
                         f"got {value.dtype}")
    if tuple(value.shape) != spec.shape:
        raise InputError(f"{kind} {spec.name!r} expects shape {spec.shape}, got {tuple(value.shape)}")
    if spec.dtype == "int64" and value.size:
        low, high = int(value.min()), int(value.max())
        if low < _INT32.min or high > _INT32.max:
            raise InputError(
                f"{kind} {spec.name!r} holds values in [{low}, {high}], outside int32; the device stores int64 as int32"
            )
    return host_words(value, spec.dtype)


def from_device_bytes(spec: TensorSpec, data, offset: int) -> np.ndarray:
    """The tensor ``spec`` read from host bytes ``data`` at ``offset``, in its host form."""
    return from_storage(data, spec.dtype, spec.shape, offset)


def check_limits(dev: Device, plan: Plan) -> None:
    """Raise LimitError if a buffer, tensor, binding or dispatch of ``plan`` exceeds a limit of ``dev``."""
    for b in plan.buffers:
        if b.size > dev.max_buffer_size:
            raise LimitError.exceeded(f"buffer {b.name!r}", b.size, "max-buffer-size", dev.max_buffer_size)
    for t in plan.inputs + plan.params + plan.outputs:
        if t.nbytes > dev.max_binding_size:
            raise LimitError.exceeded(
                f"tensor {t.name!r}", t.nbytes, "max-storage-buffer-binding-size", dev.max_binding_size
            )
    max_storage = dev.limits["max-storage-buffers-per-shader-stage"]
    for i, d in enumerate(plan.dispatches):
        what = f"dispatch {i} ({d.label or d.kernel})"
        if len(d.bindings) > max_storage:
            raise LimitError.exceeded(
                what, len(d.bindings), "max-storage-buffers-per-shader-stage", max_storage, "storage buffers"
            )
        if max(d.workgroups) > dev.max_workgroups_per_dim:
            raise LimitError.exceeded(
                what, max(d.workgroups), "max-compute-workgroups-per-dimension", dev.max_workgroups_per_dim,
                "workgroups in one dimension",
            )
        for j, b in enumerate(d.bindings):
            if b.size > dev.max_binding_size:
                raise LimitError.exceeded(
                    f"{what} binding {j} of buffer {b.buffer!r}", b.size,
                    "max-storage-buffer-binding-size", dev.max_binding_size,
                )
            if b.offset % dev.offset_alignment:
                raise LimitError(
                    f"{what} binding {j} of buffer {b.buffer!r} starts at offset {b.offset}, not a multiple of "
                    f"this adapter's min-storage-buffer-offset-alignment {dev.offset_alignment}",
                    limit="min-storage-buffer-offset-alignment", value=dev.offset_alignment, requested=b.offset,
                )
