"""What a program checks before it builds or runs anything: a plan against its device's limits (``check_limits``),
a run's arguments (``check_run_inputs``, which is ``check_run_keys`` and ``check_device_arrays``; ``check_into``,
``check_in_place``, ``require_own_buffers``) and each host array against its tensor's spec on the way up
(``to_device_array``); and the read-back's bytes taken apart into host arrays (``from_device_bytes``) and status
errors (``status_error``)."""
from __future__ import annotations

import operator

import numpy as np

from .device import Device
from .dtypes import HOST_DTYPE, from_storage, host_words
from .errors import InputError, KernelStatusError, LimitError
from .plan import Plan, TensorSpec
from .resident import DeviceArray

_INT32 = np.iinfo(np.int32)
_BUFFER = operator.attrgetter("buffer")
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


def require_own_buffers(specs, alone: set[str], what: str) -> None:
    """Require each tensor of ``specs`` to be alone at offset 0 of its buffer (``alone``): it is swapped per run."""
    for t in specs:
        if t.name not in alone:
            raise InputError(f"{what} {t.name!r} shares buffer {t.buffer!r}; it needs a buffer of its own")


def check_run_inputs(inputs: dict, device_inputs: dict, specs: dict[str, TensorSpec], shapes: dict[str, tuple],
                     device_only: frozenset, alone: set[str], device) -> None:
    """A run's host and device inputs against the plan's inputs ``specs``: each given once, the device-only ones on
    the device, each device array live on ``device``, of its spec's dtype and its shape in this run (``shapes``), in
    a buffer it may swap."""
    check_run_keys(inputs, device_inputs, specs, device_only, alone)
    check_device_arrays(device_inputs, specs, shapes, device)


def check_run_keys(inputs: dict, device_inputs: dict, specs: dict[str, TensorSpec], device_only: frozenset,
                   alone: set[str], kept=(), partial: bool = False) -> None:
    """``check_run_inputs``'s checks of the names: each input given once, the device-only ones and those given on the
    device alone in a buffer. ``kept``: the names of inputs bound already, none among these (``program_inputs``);
    ``partial``: not every input need be given."""
    if (len(inputs) + len(device_inputs) + len(kept) != len(specs) and not partial
            or not specs.keys() >= device_inputs.keys()
            or not specs.keys() >= inputs.keys() or inputs.keys() & device_inputs.keys()):  # (no set built)
        named = set(inputs) | set(device_inputs) | set(kept)
        raise InputError(f"missing inputs {sorted(set(specs) - named)}, unexpected inputs "
                         f"{sorted(named - set(specs))}, given twice {sorted(set(inputs) & set(device_inputs))}; "
                         f"expected {sorted(specs)}")
    host_only = sorted(device_only & set(inputs))
    if host_only:
        raise InputError(f"inputs {host_only} are device-only in this program: pass them as device_inputs")
    if not alone.issuperset(device_inputs):
        require_own_buffers([specs[name] for name in device_inputs], alone, "a device input")


def check_device_arrays(device_inputs: dict, specs: dict[str, TensorSpec], shapes: dict[str, tuple],
                        device) -> None:
    """``check_run_inputs``'s checks of the device arrays, raising at the first that fails."""
    for name, array in device_inputs.items():
        if (not isinstance(array, DeviceArray) or array.buffer is None or array.device is not device
                or array.shape != shapes[name] or array.dtype != specs[name].dtype):
            _reject_device_input(name, array, specs[name], shapes[name], device)


def _reject_device_input(name: str, array, spec: TensorSpec, shape: tuple, device) -> None:
    """Raise what is wrong with device input ``name`` (``check_run_inputs`` found something)."""
    if not isinstance(array, DeviceArray) or array.buffer is None:
        raise InputError(f"device input {name!r} must be a live DeviceArray, got {array!r}")
    if array.device is not device:
        raise InputError(f"device input {name!r} lives on {array.device.name}, this program on {device.name}")
    raise InputError(f"device input {name!r} expects {spec.dtype}{list(shape)}, got "
                     f"{array.dtype}{list(array.shape)}")


def check_into(into: dict, device_inputs: dict, resident: dict[str, TensorSpec], shapes: dict[str, tuple],
               device) -> None:
    """The arrays a run writes its ``resident`` outputs into: live on ``device``, of the outputs' dtypes and shapes
    in this run (``shapes``), none bound as an input of the run, none given twice."""
    unknown = sorted(set(into) - set(resident))
    if unknown:
        raise InputError(f"into: {unknown} are not resident outputs of this program; those are {sorted(resident)}")
    if not into:
        return
    bound = {id(array.buffer) for array in device_inputs.values()}
    for name, array in into.items():
        spec, shape = resident[name], shapes[name]
        if not isinstance(array, DeviceArray) or array.buffer is None or array.device is not device:
            raise InputError(f"into[{name!r}] must be a live DeviceArray on {device.name}, got {array!r}")
        if array.shape != shape or array.dtype != spec.dtype:
            raise InputError(f"into[{name!r}] must be {spec.dtype}{list(shape)}, got "
                             f"{array.dtype}{list(array.shape)}")
        if id(array.buffer) in bound:
            raise InputError(f"into[{name!r}] is also bound as a device input of this run; an output cannot "
                             "overwrite an input the plan reads")
    if len({id(array.buffer) for array in into.values()}) < len(into):
        raise InputError("into: two resident outputs were given the same array")


def check_in_place(device_inputs: dict, in_place: dict[str, str]) -> None:
    """An input that an output overwrites (``in_place``: output -> input) must be the only input bound to its array
    (another would read the new values as its own)."""
    bound = list(map(id, map(_BUFFER, device_inputs.values())))
    if len(set(bound)) == len(bound):  # every input in an array of its own: none shares a target's
        return
    targets = {id(device_inputs[name].buffer): name for name in in_place.values()}
    shared = sorted(f"{name} and {targets[id(a.buffer)]}" for name, a in device_inputs.items()
                    if id(a.buffer) in targets and targets[id(a.buffer)] != name)
    if shared:
        raise InputError(f"device inputs {shared} are bound to one array, which this run overwrites in place")


def status_error(data, status_offsets: list[tuple[str, int, int]],
                 messages: dict[int, str]) -> KernelStatusError | None:
    """The error of the first status word set in read-back ``data`` (each status buffer's (name, staging offset,
    size)), named by ``messages`` (a plan's ``status_messages``); None where none is set."""
    for name, offset, size in status_offsets:
        words = np.frombuffer(data, np.uint32, size // 4, offset)
        nonzero = np.flatnonzero(words)
        if nonzero.size:
            code = int(words[nonzero[0]])
            default = f"a kernel raised status code {code} (word {int(nonzero[0])} of {name!r})"
            return KernelStatusError(code, messages.get(code, default))
    return None
