"""Ordinary CPU tensors whose values may live on the device only: ``DeviceParameter`` and ``DeviceTensor``.

Unlike a ``ResidentTensor`` (a wrapper with no storage, which dynamo cannot take as a graph input: it traces the
wrapper's dispatch and breaks the graph), these are tensors with their own CPU storage, which is stale while the
device holds newer values. Their class carries a ``__torch_function__`` override that eager code meets: before an
op reads their data it downloads the device's values into the storage, once (without bumping the version), and an
op that writes them makes the host's values the truth again. Reading metadata (shape, ``.grad``, ``_version``)
downloads nothing. While dynamo traces, the override is hidden (``_EagerOverride``), so a graph takes them as the
plain tensors they are, and the backend binds their device arrays instead of uploading them.

- ``DeviceParameter``: a parameter of an optimizer kept on the device (``device_optimizer``); its device copy is the
  backend's ``ParamStore`` entry, which the device update writes.
- ``DeviceTensor``: an output of an inference graph that eager code has not read (a KV cache that Python only hands
  back to the next call), with a device array of its own (``lazy_output``); a call that takes it back binds that
  array (``bound_array``). Or an input put on the device once (``uploaded``: ``torch_meganeura.to_device``). Or
  an input that a graph updates on the device (a static KV cache, BatchNorm's running
  statistics in training): the tensor itself then stands for the array (``adopt``), and is one from the graph's
  compilation on (``mark_updated``).
"""
from __future__ import annotations

import operator
import threading
import types
from collections import OrderedDict

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._python_dispatch import _disable_current_modes

from meganeura.runtime.dtypes import host_words
from meganeura.runtime.resident import DeviceArray, download_arrays

from .params import host_form, tensor_from_host
from .read_ahead import ReadAhead
from ..lower.registry import logical_dtype
from .resident import TORCH_DTYPE, ResidentTensor

_DATA_ATTRIBUTES = frozenset({"data", "real", "imag", "T", "mT", "H", "mH"})  # properties that return the data
_OVERWRITES = frozenset({torch.Tensor.zero_, torch.Tensor.fill_})  # methods that write every element of self
PASS_THROUGH_CACHE = 4096  # functions whose ``_passes_through`` is remembered: every Tensor method and property fits
_PASS_THROUGH: dict = {}
_METADATA_METHODS = frozenset({
    torch.Tensor.size, torch.Tensor.stride, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
    torch.Tensor.element_size, torch.Tensor.data_ptr, torch.Tensor.is_contiguous, torch.Tensor.__hash__,
    torch.Tensor.requires_grad_, torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__len__, torch.Tensor.storage_offset,
    torch.Tensor.get_device, torch.Tensor._is_view, torch.Tensor.__format__,
    torch.ones_like, torch.zeros_like, torch.empty_like,  # (``loss.backward()``'s seed: only the loss's metadata)
})


def eager_only(function):
    """``function``, which dynamo's frame callback skips, and every frame it calls: it runs as eager Python even
    under a compiled frame that dynamo gave up on. Where this torch can mark a code object so (a frame execution
    strategy: skip it and what it calls), that costs nothing per call; else it is ``torch.compiler.disable``d, whose
    wrapper sets and restores the frame callback at every call (about 2 us)."""
    try:
        # torch's private frame strategies, which not every torch has: the disable below is the fallback
        from torch._dynamo.eval_frame import set_code_exec_strategy  # noqa: PLC0415
        from torch._dynamo.types import FrameAction, FrameExecStrategy  # noqa: PLC0415
    except ImportError:
        return torch.compiler.disable(function)
    set_code_exec_strategy(function.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return function


_VERSION = operator.attrgetter("_version")


class Kept:
    """A tensor's link to its device values: its own ``array``, or a ``store``'s copy of it (a parameter);
    ``stale`` while the device holds values the host has not got; ``version``, the tensor's version when the array
    was last current (a later one: the host wrote it); ``on_read``, called at the first download; ``self_copy``,
    while aot_autograd may still copy the tensor into itself (``adopt``): one version step that writes nothing;
    ``spare``, the array a graph's update replaced, where the next update is written (``adopt``); ``read_ahead``,
    the group whose download it joins at ``position`` (``read_ahead.ReadAhead``), if any; ``on_download``, called at
    each download (``watch_downloads``). A kept parameter's ``grad``: its gradient parked by the backward, a device
    array that ``.grad`` stands for until eager code reads it (``backend.parked_grads``); ``accumulator``, its
    autograd gradient accumulator, kept (the node the engine would run for it)."""

    __slots__ = ("store", "array", "stale", "version", "on_read", "self_copy", "spare", "read_ahead", "position",
                 "on_download", "grad", "accumulator")

    def __init__(self, store=None, array: DeviceArray | None = None, stale: bool = False, version: int = 0,
                 on_read=None, self_copy: bool = False, spare: DeviceArray | None = None,
                 read_ahead: ReadAhead | None = None, position: int = 0):
        self.store, self.array, self.stale, self.version, self.on_read = store, array, stale, version, on_read
        self.self_copy, self.spare, self.read_ahead, self.position = self_copy, spare, read_ahead, position
        self.on_download = self.grad = self.accumulator = None

    def device_array(self, t: torch.Tensor) -> DeviceArray:
        return self.array if self.array is not None else self.store.kept(t)


def _tracing_context_reader():
    """``TracingContext.try_get``, read straight from the thread-local it keeps the context in where this torch has
    one: ``try_get``'s ``getattr`` misses the attribute outside tracing, which raises and catches an AttributeError
    (3 us; the override looks the context up twice per op, and a decode token's ops on its 60 KV-cache tensors, a
    training step's metadata reads of kept parameters, make thousands of lookups)."""
    local = getattr(torch._guards, "_TLS", None)
    if isinstance(local, threading.local):
        return lambda: local.__dict__.get("tracing_context")
    return torch._guards.TracingContext.try_get


_tracing_context = _tracing_context_reader()


class _EagerOverride:
    """The classes' ``__torch_function__``: the override eager code meets, and none while dynamo traces (a
    tracing context is active), so that dynamo traces these tensors as the plain ones it compiles: tracing through
    an override that calls the function again with subclass overrides off, dynamo misreads a function with a
    dispatch of its own (F.layer_norm, F.rms_norm, F.batch_norm, F.embedding) and breaks the graph there.

    The override is eager code, and dynamo must not compile it as a frame of its own: a frame dynamo gave up on (a
    graph break inside a loop: HF Whisper's layerdrop) runs eagerly under dynamo's frame callback, which then
    compiled ``__get__`` and ``_torch_function``, one graph per op, again with automatic dynamic sizes for each op
    met with other arguments (a convolution's stride as a SymInt, a weight's sizes as symbols). Both are therefore
    frames dynamo skips, with what they call (``eager_only``): the op runs in eager PyTorch, as the override intends."""

    def __init__(self, function):
        self.function = function
        self._bound: dict[type, types.MethodType] = {}  # by owner: torch looks the override up twice per op

    @eager_only
    def __get__(self, instance, owner):
        if _tracing_context() is not None:
            return torch._C._disabled_torch_function_impl
        bound = self._bound.get(owner)
        if bound is None:
            bound = self._bound[owner] = types.MethodType(self.function, owner)
        return bound


@eager_only
def _torch_function(cls, func, types_, args=(), kwargs=None):
    kwargs = kwargs or {}
    if _passes_through(func):  # metadata (shape, dtype, .grad): nothing to download, _before_eager not entered
        if func in _GRAD_ACCESS:  # (a gradient the backward parked: ``.grad`` gets it, a write replaces it)
            unpark_grad(args[0], keep=func == _GRAD_GET)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func is torch.Tensor.copy_ and len(args) == 2 and _same_values(args[0], args[1]):
        kept = getattr(args[0], "_meganeura_kept", None)
        if kept is not None:
            kept.self_copy = False  # seen, and no version step made: the next step is eager code writing it
        return args[0]  # a tensor into itself (aot_autograd applying a mutation already made on the device)
    if func is torch.Tensor.view_as and len(args) == 2 and args[0] is args[1]:
        return _view_of_itself(args[0])
    if func is torch.Tensor.backward or func is torch.autograd.backward:  # no data of the loss needed
        return _backward(*args, **kwargs)
    _before_eager(func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


# ``.grad``'s getter, setter and deleter, as torch gives them to ``__torch_function__`` (each a new method-wrapper
# that compares equal: found with ``==``)
_GRAD_GET = torch._C.TensorBase.grad.__get__
_GRAD_ACCESS = frozenset({_GRAD_GET, torch._C.TensorBase.grad.__set__, torch._C.TensorBase.grad.__delete__})


def unpark_grad(p: torch.Tensor, keep: bool = True) -> None:
    """Give ``p``'s parked gradient (``Kept.grad``) to ``p.grad`` as a ``ResidentTensor`` (``keep``), or drop it (a
    write of ``.grad`` replaces it). Where autograd stored a gradient too since it was parked (from an eager op on
    the parameter in the same backward: the engine sums a parameter's gradients before storing them), ``.grad``
    gets their sum."""
    kept = getattr(p, "_meganeura_kept", None)
    if kept is None or kept.grad is None:
        return
    array, kept.grad = kept.grad, None
    if keep:
        with torch._C.DisableTorchFunctionSubclass():
            parked, stored = ResidentTensor(array), p.grad
            p.grad = parked if stored is None else stored + parked


def _view_of_itself(t: torch.Tensor) -> torch.Tensor:
    """``t.view_as(t)``, reading no data: what autograd makes of an input that a training forward's function returns
    unchanged (an update in place). Outside dispatch modes: aot_autograd's first call checks custom ops under one
    that refuses tensor subclasses."""
    with torch._C.DisableTorchFunctionSubclass(), _disable_current_modes():
        return torch.Tensor.view_as(t, t)


def _same_values(t: torch.Tensor, source) -> bool:
    """Whether ``source`` is ``t`` or a view of all of it as it lies (``_view_of_itself``): copying it into ``t``
    changes nothing."""
    if source is t:
        return True
    if type(source) is not torch.Tensor:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return (source.data_ptr() == t.data_ptr() and source.dtype == t.dtype and source.shape == t.shape
                and source.stride() == t.stride())


def _backward(tensors, *args, **kwargs):
    """``loss.backward()`` (or ``torch.autograd.backward``) of tensors whose values may be on the device only (a
    training forward's loss), seeded without downloading them (a wait): each runs as an alias of the base class,
    attached to the same autograd graph (``as_subclass``), while the backward's own ops keep the override."""
    with torch._C.DisableTorchFunctionSubclass():
        if isinstance(tensors, torch.Tensor):
            tensors = tensors.as_subclass(torch.Tensor)
        else:
            tensors = [t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) else t for t in tensors]
    if "gradient" in kwargs:  # (Tensor.backward's name of it)
        kwargs["grad_tensors"] = kwargs.pop("gradient")
    inputs = kwargs.get("inputs")
    if inputs is not None:  # kept parameters as their gradient edges: as inputs they would meet the override again
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else inputs
        kwargs["inputs"] = [get_gradient_edge(t) if type(t) is DeviceParameter else t for t in inputs]
    torch.autograd.backward(tensors, *args, **kwargs)


class DeviceParameter(nn.Parameter):
    """A parameter of an optimizer kept on the device (``device_optimizer.keep_on_device``)."""

    __torch_function__ = _EagerOverride(_torch_function)

    def __reduce_ex__(self, protocol):  # an ordinary parameter, synced (``.data``), without the device link
        return torch._utils._rebuild_parameter, (self.data, self.requires_grad, OrderedDict())

    def __deepcopy__(self, memo):
        result = memo[id(self)] = nn.Parameter(self.data.clone(), self.requires_grad)
        return result


class DeviceTensor(torch.Tensor):
    """An inference graph's output that stays on the device until eager code reads it (``lazy_output``)."""

    __torch_function__ = _EagerOverride(_torch_function)

    def __reduce_ex__(self, protocol):  # an ordinary tensor, synced
        with torch._C.DisableTorchFunctionSubclass():
            return plain(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        with torch._C.DisableTorchFunctionSubclass():
            result = memo[id(self)] = plain(self).clone()
        return result


def plain(t: DeviceTensor) -> torch.Tensor:
    """``t``'s values as a tensor of the base class (downloaded first where stale; subclass overrides off)."""
    _sync(t, t._meganeura_kept)
    return t.as_subclass(torch.Tensor)


def host_alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` as eager PyTorch takes it where tensor subclasses are refused (aot_autograd's first call runs the graph
    under a dispatch mode that refuses them): a tensor kept on the device as a plain alias of its host copy,
    downloaded first where stale (a write through it steps the version the next bind checks); others as they are.
    Call with subclass overrides off."""
    return plain(t) if getattr(t, "_meganeura_kept", None) is not None else t


def copy_into(t: torch.Tensor, value: torch.Tensor) -> None:
    """``t.copy_(value)`` by the graph's own epilogue, on plain aliases (``host_alias``): every element of ``t`` is
    written, so its host copy becomes the truth without a download (the version step uploads it at the next bind)."""
    with torch._C.DisableTorchFunctionSubclass():
        kept = getattr(t, "_meganeura_kept", None)
        if kept is not None:
            kept.stale = False
        t.as_subclass(torch.Tensor).copy_(host_alias(value))


def lazy_output(array: DeviceArray, on_read=None) -> DeviceTensor:
    """A ``DeviceTensor`` standing for ``array``: its CPU storage is allocated, filled at the first eager read (which
    calls ``on_read()``)."""
    return lazy_outputs((array,), (on_read,))[0]


def lazy_outputs(arrays, on_reads) -> list[DeviceTensor]:
    """``lazy_output`` of each of ``arrays`` with its ``on_reads`` callback, in one loop under one override switch (a
    decode step's KV-cache outputs, 60 a token in SmolLM2-135M)."""
    made = []
    with torch._C.DisableTorchFunctionSubclass():
        for array, on_read in zip(arrays, on_reads):
            t = torch.empty(array.shape, dtype=TORCH_DTYPE[array.dtype]).as_subclass(DeviceTensor)
            t._meganeura_kept = Kept(array=array, stale=True, version=t._version, on_read=on_read)
            made.append(t)
    return made


def uploaded(t: torch.Tensor, device) -> DeviceTensor:
    """A copy of ``t`` (detached) whose values are on ``device`` too, uploaded now: compiled calls bind its array
    without an upload; eager code reads its host copy, which stays current; a write goes up at the next bind."""
    with torch._C.DisableTorchFunctionSubclass():
        host = t.detach().clone()
        array = DeviceArray.upload(device, host_form(host), logical_dtype(host.dtype))
        kept = host.as_subclass(DeviceTensor)
        kept._meganeura_kept = Kept(array=array, stale=False, version=kept._version)
    return kept


def read_back_output(t: torch.Tensor, on_read=None) -> DeviceTensor:
    """``t`` (an output read back) as a ``DeviceTensor`` whose values are on the host already: the class an output
    that may stay on the device has from its first call. Eager code's first touch makes it plain (``on_read``)."""
    with torch._C.DisableTorchFunctionSubclass():
        t = t.as_subclass(DeviceTensor)
        t._meganeura_kept = Kept(stale=False, version=t._version, on_read=on_read)
    return t


def bound_array(t: DeviceTensor) -> DeviceArray:
    """The device array of ``t`` with its current values: what eager code (or aot_autograd, copying a graph's new
    value into it with overrides off) wrote since goes up first; but not the one version step of aot_autograd
    copying an adopted tensor into itself."""
    kept = t._meganeura_kept
    with torch._C.DisableTorchFunctionSubclass():
        if kept.self_copy and t._version == kept.version + 1:
            kept.version = t._version
        kept.self_copy = False
        if t._version != kept.version:
            data = host_words(host_form(t.as_subclass(torch.Tensor)), logical_dtype(t.dtype))
            if data.size:
                kept.array.device.write(kept.array.buffer, 0, data, "device tensor")
            kept.version, kept.stale = t._version, False
    return kept.array


def adopt(t: torch.Tensor, array: DeviceArray, read: DeviceArray | None = None,
          read_ahead: tuple[ReadAhead, int] | None = None) -> torch.Tensor:
    """``t`` itself, its values now ``array``'s (a graph updated it on the device): a ``DeviceTensor`` from here on,
    its host copy stale (a static KV cache that a compiled call updated in place, BatchNorm's running statistics).
    ``read``, the array the graph read ``t`` from, is kept as its ``spare`` where ``array`` is another: the next
    update is written there, so that the two alternate and the runs' bindings repeat. Its version steps, as an
    eager update's would (a plan that binds it as a parameter binds its new array: ``bound_plan.BoundPlan``).
    ``read_ahead``: the group and position whose downloads it joins (``Kept``)."""
    group, position = read_ahead or (None, 0)
    spare = read if read is not array else None
    with torch._C.DisableTorchFunctionSubclass():
        if type(t) is not DeviceTensor:
            t.__class__ = DeviceTensor
        torch._C._increment_version((t,))  # (``torch.autograd.graph.increment_version``, without its checks)
        kept = t.__dict__.get("_meganeura_kept")
        if kept is None or kept.store is not None or kept.on_read is not None:
            t._meganeura_kept = Kept(array=array, stale=True, version=t._version, self_copy=True, spare=spare,
                                     read_ahead=group, position=position)
        else:  # (its own link, updated: a static cache's tensors are adopted at every decode step)
            kept.array, kept.stale, kept.version, kept.self_copy, kept.spare = array, True, t._version, True, spare
            kept.read_ahead, kept.position = group, position
    return t


def readopt(tensors: tuple, kepts: list) -> tuple:
    """Adopt ``tensors`` again (``adopt``), each of them updated in place by another run of the plan whose run
    adopted them last and unchanged since (its ``Kept`` among ``kepts``, on the same array, at the version that
    adoption gave it): their versions step and their host copies are stale, with no call per tensor. Returns their
    versions now."""
    with torch._C.DisableTorchFunctionSubclass():
        torch._C._increment_version(tensors)
        versions = tuple(map(_VERSION, tensors))
    for kept, version in zip(kepts, versions):
        kept.version, kept.stale, kept.self_copy = version, True, True
    return versions


def fill_host(t: DeviceTensor, values) -> None:
    """Give ``t``, adopted (its values on the device), those values on the host too: read back along with a run
    that waited anyway (``Program.read_along``), so that eager code's read of it downloads nothing. Through
    ``.data``: the version stays, so nothing uploads it back."""
    with torch._C.DisableTorchFunctionSubclass(), _disable_current_modes():
        t.data.copy_(tensor_from_host(values).reshape(t.shape))
    t._meganeura_kept.stale = False


def watch_downloads(t: DeviceTensor, callback) -> None:
    """Have ``callback()`` called whenever eager code's read of ``t`` (adopted) downloads its device values."""
    kept = t._meganeura_kept
    if kept.on_download is not callback:
        kept.on_download = callback


def mark_updated(t: torch.Tensor) -> None:
    """``t`` as the ``DeviceTensor`` that a graph's update will make of it (``adopt``), its values still on the
    host (``backend``: before dynamo's guards are built)."""
    with torch._C.DisableTorchFunctionSubclass():
        t.__class__ = DeviceTensor
        t._meganeura_kept = Kept(stale=False, version=t._version)


def spare_array(t: torch.Tensor, device) -> DeviceArray | None:
    """Where a graph may write ``t``'s update: its ``spare`` array (``adopt``), if it is live on ``device`` and of
    ``t``'s current array's shape and dtype; else None (the program takes a new one)."""
    kept = getattr(t, "_meganeura_kept", None) if type(t) is DeviceTensor else None
    if kept is None or kept.spare is None or kept.array is None:
        return None
    spare, array = kept.spare, kept.array
    if spare.buffer is None or spare.device is not device or (spare.shape, spare.dtype) != (array.shape, array.dtype):
        return None
    return spare


def device_input(t: torch.Tensor, device) -> DeviceArray:
    """The device array a graph updates ``t`` in (``adopt``): its own where it is a ``DeviceTensor`` of ``device``,
    else a new one holding its values. The array of a ``DeviceTensor`` that nothing wrote since its last update is
    taken here without ``bound_array``'s checks and calls (a static KV cache's three updates per layer, per decode
    step)."""
    kept = t.__dict__.get("_meganeura_kept") if type(t) is DeviceTensor else None
    if kept is not None and not kept.self_copy and kept.array is not None and kept.array.device is device:
        with torch._C.DisableTorchFunctionSubclass():
            if t._version == kept.version:
                return kept.array
    found = kept_array(t, device)
    if found is not None:
        return found
    with torch._C.DisableTorchFunctionSubclass():
        return DeviceArray.upload(device, host_form(t.as_subclass(torch.Tensor)), logical_dtype(t.dtype))


def kept_array(value, device) -> DeviceArray | None:
    """The device array a graph input binds instead of an upload: a ``DeviceTensor`` of ``device``'s; else None."""
    if type(value) is DeviceTensor:
        array = value._meganeura_kept.array
        if array is not None and array.device is device:
            return bound_array(value)
    return None


@eager_only  # eager code between graphs runs it as it is, not traced into a graph
def _before_eager(func, args, kwargs) -> None:
    """Before eager code runs ``func``: download the device values of its ``DeviceParameter`` and ``DeviceTensor``
    arguments if it reads their data (both classes: the override of whichever comes first runs the call, with
    overrides off); a parameter whose data are replaced (``p.data = t``) holds the truth on the host from then on."""
    reads = _reads_data(func)
    with torch._C.DisableTorchFunctionSubclass():
        for arg in _flat(args, kwargs):
            kind = type(arg)
            kept = getattr(arg, "_meganeura_kept", None) if kind is DeviceTensor or kind is DeviceParameter else None
            if kept is None:
                continue
            if func in _OVERWRITES and arg is args[0]:
                kept.stale = False  # every element is written: the host's values become the truth, none downloaded
            elif reads:
                _sync(arg, kept)
                if kind is DeviceTensor and kept.on_read is not None:  # an output: an ordinary tensor from now
                    _release(arg, kept)
            elif _descriptor(func) == "data" and func.__name__ == "__set__":
                kept.stale = False


def _sync(t: torch.Tensor, kept: Kept) -> None:
    """Download ``t``'s device values into it where the host copy is stale (subclass overrides off), with the stale
    members of its read-ahead group that come next (``read_ahead``) in the same wait; an output read by eager code
    is an ordinary tensor from then on (``_release``)."""
    if not kept.stale:
        return
    group = kept.read_ahead
    _download([t] if group is None else group.batch(t, kept.position, _stale_bytes))


def _stale_bytes(t: torch.Tensor) -> int:
    """The bytes a download of ``t`` moves: 0 unless it is a stale kept tensor."""
    kept = t.__dict__.get("_meganeura_kept")
    return kept.device_array(t).nbytes if kept is not None and kept.stale else 0


def _download(tensors: list) -> None:
    """Download the device values of the stale kept ``tensors`` into them, in one wait."""
    kepts = [t._meganeura_kept for t in tensors]
    arrays = download_arrays([kept.device_array(t) for t, kept in zip(tensors, kepts)])
    for t, kept, array in zip(tensors, kepts, arrays):
        host = tensor_from_host(array).reshape(t.shape)
        # Through .data: the version stays, so nothing uploads it back. Outside any dispatch mode: filling the host
        # copy is not an op of the program (aot_autograd's first call of a graph analyses its ops under a mode that
        # refuses tensor subclasses, and a training forward's output, read by eager code between graphs, meets it
        # there).
        with _disable_current_modes():
            t.data.copy_(host)
        kept.stale = False
        if kept.on_download is not None:
            kept.on_download()
        if kept.on_read is not None and type(t) is not DeviceTensor:  # (an output is released by the caller)
            kept.on_read()


def _release(t: DeviceTensor, kept: Kept) -> None:
    """Eager code read an output: it becomes a plain tensor (its partition reads that position back from now)."""
    t.__class__ = torch.Tensor
    del t._meganeura_kept
    kept.on_read()


def read_now(t: DeviceTensor) -> None:
    """Read the lazy output ``t`` back now, as eager code's first read would: a plain tensor from then on."""
    with torch._C.DisableTorchFunctionSubclass():
        kept = getattr(t, "_meganeura_kept", None)
        if kept is not None and kept.on_read is not None:
            _sync(t, kept)
            _release(t, kept)


def sync(tensors) -> None:
    """Download every stale tensor of ``tensors`` now, in one wait (eager reads do so by themselves, a read-ahead
    group's window at a time)."""
    with torch._C.DisableTorchFunctionSubclass():
        _download([t for t in tensors if _stale_bytes(t)])


def _flat(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _descriptor(func) -> str | None:
    """The attribute name of a property's getter or setter (``__get__`` of ``Tensor.data``), else None."""
    if getattr(func, "__name__", None) in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", None)
    return None


def _passes_through(func) -> bool:
    """Whether ``func`` neither reads nor replaces the data of its tensors: a metadata method, or a property other
    than the data's (``.grad``, ``.shape``, ``.dtype``, ``.requires_grad``); decided once per function. A kept
    optimizer's step, ``zero_grad`` and the backend's argument checks make about 2,000 such calls per ResNet-50 step,
    which ``_before_eager``'s disabled frame made 5 us each."""
    known = _PASS_THROUGH.get(func)
    if known is None:
        attribute = _descriptor(func)
        known = attribute not in _DATA_ATTRIBUTES if attribute is not None else func in _METADATA_METHODS
        if len(_PASS_THROUGH) < PASS_THROUGH_CACHE:
            _PASS_THROUGH[func] = known
    return known


def _reads_data(func) -> bool:
    attribute = _descriptor(func)
    if attribute is not None:
        return attribute in _DATA_ATTRIBUTES and func.__name__ == "__get__"
    return func not in _METADATA_METHODS
