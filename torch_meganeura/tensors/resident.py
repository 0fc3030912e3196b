"""ResidentTensor: a torch tensor whose data stay in a device buffer (a ``DeviceArray``) until eager code reads them.

The backend returns values that Python only hands back to a later device plan as ResidentTensors: the activations
a training forward saves for the backward, and, for an optimizer kept on the device (``device_optimizer``), the
parameters' gradients. A device partition binds a ResidentTensor's buffer directly: no download after one plan, no
upload before the next. When autograd or the user drops one, its buffer returns to the device's pool.

Eager code sees an ordinary tensor. The first aten op that reaches a ResidentTensor outside a device partition
downloads it once into a host copy (its *twin*), and every later eager op uses the twin. An op that writes it in
place (``grad.mul_(c)``, ``zero_()``) writes the twin, which then holds the truth: the next device plan that binds the
tensor uploads the twin first. A view of the twin that escapes to eager code (``t[0]``, ``t.view(...)``) may be
written without our knowing, so from then on the twin is uploaded at every bind. ``detach()`` and ``alias`` return a
ResidentTensor sharing the same value. Pickling, ``numpy()``, ``tolist()``, ``repr`` and ``deepcopy`` go through
the twin: ``torch.save`` writes an ordinary tensor.
"""
from __future__ import annotations

import logging
import operator
from itertools import repeat

import torch
from torch.utils._pytree import tree_flatten, tree_map

from meganeura.runtime.dtypes import host_words
from meganeura.runtime.resident import DeviceArray

from .params import host_form, tensor_from_host
from ..lower.registry import TORCH_TO_LOGICAL, logical_dtype

log = logging.getLogger("torch_meganeura")

TORCH_DTYPE = {logical: dtype for dtype, logical in TORCH_TO_LOGICAL.items()}
_SHARED = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}  # return the same value, another wrapper
# The wrappers' device as an object: given as the string "cpu", ``_make_wrapper_subclass`` parses it at every call
# (a training step makes hundreds of wrappers: saved activations, gradients and autograd's detach of each gradient)
_HOST = torch.device("cpu")
_make_wrapper = torch.Tensor._make_wrapper_subclass


class _Value:
    """What the wrappers of one device value share: the array, the host twin once downloaded, and whether the twin
    is newer than the array (written in place) or may be written behind our back (a view of it escaped);
    ``watched``: a host copy made, written or exposed is counted (``watch``)."""

    __slots__ = ("array", "twin", "twin_newer", "exposed", "watched")

    def __init__(self, array: DeviceArray):
        self.array, self.twin, self.twin_newer, self.exposed, self.watched = array, None, False, False, False


_watched_touches = [0]  # host copies of watched values made, written or exposed (``watched_touches``)


def watch(tensors) -> None:
    """Count, from now on, each host copy of ``tensors``' values made, written or exposed (``watched_touches``)."""
    for t in tensors:
        t._value.watched = True


def watched_touches() -> int:
    """A count that changes whenever a watched value gets a host copy, or its host copy is written or exposed:
    while it stays, watched values found with no host copy (``written_on_device``) have none."""
    return _watched_touches[0]


def _touched(value: _Value) -> None:
    if value.watched:
        _watched_touches[0] += 1


class ResidentTensor(torch.Tensor):
    """``array``: the device array (its value's, the same in every wrapper of it, kept in a slot of each because the
    per-call path reads it for every argument it binds)."""

    __slots__ = ("_value", "array")  # no instance dict to make per wrapper
    _value: _Value
    array: DeviceArray

    @staticmethod
    def __new__(cls, array: DeviceArray, value: _Value | None = None):
        t = _make_wrapper(cls, array.shape, dtype=TORCH_DTYPE[array.dtype], device=_HOST)
        t._value = _Value(array) if value is None else value
        t.array = array
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _SHARED:  # first: autograd's AccumulateGrad detaches every gradient it stores
            return _sharing(args[0])
        kwargs = kwargs or {}
        log.debug("eager %s on a resident tensor: its host copy", func)
        written = _written_residents(func, args, kwargs)
        unwrap = lambda x: x.materialize() if isinstance(x, ResidentTensor) else x  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        for r in written:
            r._value.twin_newer = True
            _touched(r._value)
        return _rewrapped(func, args, kwargs, out, written)

    def materialize(self) -> torch.Tensor:
        """The host copy of the data (downloaded at the first call); eager ops read and write it."""
        value = self._value
        if value.twin is None:
            value.twin = tensor_from_host(value.array.numpy())
            _touched(value)
        return value.twin

    def device_array(self) -> DeviceArray:
        """The device array, current: a twin written since it was last uploaded (or exposed) goes up first."""
        value = self._value
        if value.twin_newer or value.exposed:
            data = host_words(host_form(value.twin), logical_dtype(value.twin.dtype))
            if data.size:
                value.array.device.write(value.array.buffer, 0, data, "resident tensor")
            value.twin_newer = False
        return value.array

    def written_on_device(self) -> None:
        """A device plan stored new values into the array: the host copy (and any view of it) is out of date."""
        value = self._value
        value.twin, value.twin_newer, value.exposed = None, False, False

    def numpy(self, *, force: bool = False):
        return self.materialize().numpy(force=force)

    def tolist(self):
        return self.materialize().tolist()

    def __array__(self, dtype=None, copy=None):
        return self.materialize().__array__(dtype)

    def __reduce_ex__(self, protocol):
        return self.materialize().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.materialize().clone()

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self.materialize())


def _sharing(tensor: ResidentTensor) -> ResidentTensor:
    """Another wrapper of ``tensor``'s value (``detach``, ``alias``), made without ``ResidentTensor(...)``'s call."""
    array = tensor.array  # (its shape and dtype: a wrapper's ``shape`` and ``dtype`` cost more to read)
    t = _make_wrapper(ResidentTensor, array.shape, dtype=TORCH_DTYPE[array.dtype], device=_HOST)
    t._value, t.array = tensor._value, array
    return t


_twin, _twin_newer = operator.attrgetter("_value.twin"), operator.attrgetter("_value.twin_newer")
_exposed, _value_array = operator.attrgetter("_value.exposed"), operator.attrgetter("_value.array")


def device_arrays(tensors: list) -> list[DeviceArray]:
    """``device_array()`` of each of ``tensors`` (resident tensors): a kept optimizer binds hundreds at every step,
    nearly all with no host copy written, found so in C loops (``map``)."""
    if not any(map(_twin_newer, tensors)) and not any(map(_exposed, tensors)):
        return list(map(_value_array, tensors))
    arrays = []
    for t in tensors:
        value = t._value
        arrays.append(t.device_array() if value.twin_newer or value.exposed else value.array)
    return arrays


def written_on_device(tensors: list) -> None:
    """``written_on_device()`` of each of ``tensors`` (resident tensors) that has a host copy to drop (nearly none,
    found so in C loops)."""
    if not any(map(operator.is_not, map(_twin, tensors), repeat(None))) and not any(map(_exposed, tensors)):
        return
    for t in tensors:
        value = t._value
        if value.twin is not None or value.exposed:
            t.written_on_device()


def _arguments(func, args, kwargs):
    """(schema argument, value) of each argument given to ``func``."""
    schema = func._schema.arguments
    given = list(zip(schema, args))
    given += [(a, kwargs[a.name]) for a in schema[len(args):] if a.name in kwargs]
    return given


def _written_residents(func, args, kwargs) -> list[ResidentTensor]:
    """The ResidentTensors ``func`` writes in place (``self`` of ``add_``, a list of ``_foreach_mul_``, ``out=``)."""
    written = []
    for argument, value in _arguments(func, args, kwargs):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written += [v for v in tree_flatten(value)[0] if isinstance(v, ResidentTensor)]
    return written


def _rewrapped(func, args, kwargs, out, written: list[ResidentTensor]):
    """``out`` with each returned twin of a written ResidentTensor (``x.add_(y)`` returns ``x``) as that wrapper. A
    returned view of a twin exposes that twin: eager code may write it through the view."""
    returns_alias = any(r.alias_info is not None for r in func._schema.returns)
    if not returns_alias:
        return out
    twins = {id(r._value.twin): r for r in written}
    outputs = tree_map(lambda t: twins.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)
    if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
        for argument, value in _arguments(func, args, kwargs):
            if argument.alias_info is not None:
                for v in tree_flatten(value)[0]:
                    if isinstance(v, ResidentTensor):
                        v._value.exposed = True
                        _touched(v._value)
    return outputs
