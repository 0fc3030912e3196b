"""Device copies of parameters and buffers, keyed on tensor identity, ``_version`` and storage.

An unchanged weight is uploaded once and shared by every plan that binds it; an in-place change (an
optimizer step, ``copy_``, ``fill_``) bumps ``_version``, and ``p.data = t`` gives the same tensor new storage:
either way the next call writes the new data into the same device buffer. (An in-place change made through
``p.data`` bumps neither and is not seen.) The device copy is freed when the tensor is garbage-collected. A device
update of a kept parameter (``device_optimizer``) writes the device copy, whose host data are then stale.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from meganeura.runtime.errors import InputError
from meganeura.runtime.dtypes import host_words
from meganeura.runtime.resident import DedicatedBuffers, DeviceArray

from ..lower.registry import TORCH_TO_LOGICAL, logical_dtype


def host_form(t: torch.Tensor) -> np.ndarray:
    """``t``'s data as the runtime's host form of its dtype: a contiguous numpy array (bfloat16 as its raw bits,
    ``np.uint16``: numpy has no bfloat16)."""
    a = t.detach()
    if a.device.type != "cpu":
        a = a.cpu()
    a = a.contiguous()
    if a.dtype == torch.bfloat16:
        return a.view(torch.int16).numpy().view(np.uint16)
    return a.numpy()


def tensor_from_host(array) -> torch.Tensor:
    """The torch tensor of a runtime result in host form (``np.uint16`` is bfloat16's bits; no other dtype is)."""
    array = np.asarray(array)
    if array.dtype == np.uint16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def checked_host_form(t: torch.Tensor, what: str) -> np.ndarray:
    """``host_form(t)``, refusing int64 values outside the int32 range the device computes in."""
    a = host_form(t)
    if a.dtype == np.int64 and a.size and (a.min() < -(2**31) or a.max() >= 2**31):
        raise InputError(f"{what} holds int64 values outside the int32 range the device computes in "
                         f"(min {a.min()}, max {a.max()})")
    return a


def to_device_numpy(t: torch.Tensor, what: str) -> np.ndarray:
    """``t``'s data as the flat words the device stores (int64 -> int32 with a range check, bool -> uint32, half
    precisions two to a word)."""
    return host_words(checked_host_form(t, what), logical_dtype(t.dtype))


def upload_array(device, t: torch.Tensor) -> DeviceArray:
    """A ``DeviceArray`` holding a copy of ``t`` (in device layout)."""
    return DeviceArray.upload(device, checked_host_form(t, "tensor"), logical_dtype(t.dtype))


@dataclass
class _DeviceCopy:
    ref: weakref.ref
    stamp: tuple  # (_version, data_ptr) of the tensor when its data was written
    array: DeviceArray


class ParamStore:
    """Device copies of torch tensors. ``generation`` changes when a store hands out another array for a tensor it
    already served (a plan bound to the old one must bind again): a copy whose size no longer fits, or one that a
    device update replaced (``replace``)."""

    def __init__(self, device):
        self.device = device
        self._generation = 0
        self._entries: dict[int, _DeviceCopy] = {}
        self._buffers = DedicatedBuffers(device, "parameter")

    @property
    def generation(self) -> int:
        return self._generation

    def buffer(self, t: torch.Tensor, what: str = "parameter"):
        return self.array(t, what).buffer

    def array(self, t: torch.Tensor, what: str = "parameter") -> DeviceArray:
        """The device copy of ``t``, current with its host data: what changed on the host since is written first."""
        with torch._C.DisableTorchFunctionSubclass():  # (a kept parameter's metadata; see device_optimizer)
            key = id(t)
            entry = self._entries.get(key)
            stamp = (t._version, t.data_ptr())
            shape, dtype = tuple(t.shape), logical_dtype(t.dtype)
            if entry is not None and entry.ref() is t and (entry.array.shape, entry.array.dtype) == (shape, dtype):
                if entry.stamp != stamp:
                    data = to_device_numpy(t, what)
                    if data.size:
                        self.device.write(entry.array.buffer, 0, data, what)
                    entry.stamp = stamp
                return entry.array
            array = DeviceArray.upload(self.device, checked_host_form(t, what), dtype, self._buffers)
            if entry is not None:
                self._generation += 1
            self._set(key, t, _DeviceCopy(None, stamp, array))
            return array

    def arrays(self, ts: list) -> list[DeviceArray]:
        """``array`` of each of ``ts`` (a kept optimizer's parameters, every step): a copy written from the same
        tensor at its current version, storage, shape and dtype is taken as it is, in one loop; any other goes
        through ``array``."""
        entries, found = self._entries, []
        with torch._C.DisableTorchFunctionSubclass():  # (metadata of kept parameters)
            for t in ts:
                entry = entries.get(id(t))
                if (entry is not None and entry.ref() is t and entry.stamp == (t._version, t.data_ptr())
                        and entry.array.shape == t.shape and entry.array.dtype == TORCH_TO_LOGICAL.get(t.dtype)):
                    found.append(entry.array)
                else:
                    found.append(self.array(t))
        return found

    def kept(self, t: torch.Tensor) -> DeviceArray | None:
        """The device copy of ``t`` as it stands (None if there is none), without looking at the host data."""
        entry = self._entries.get(id(t))
        return entry.array if entry is not None and entry.ref() is t else None

    def replace(self, t: torch.Tensor, array: DeviceArray) -> None:
        """Make ``array`` (a device update's new value of ``t``) the device copy of ``t``; the host data are left as
        they are (stale until synced, ``device_optimizer``)."""
        entry = self._entries[id(t)]
        self._generation += 1
        self._set(id(t), t, _DeviceCopy(None, entry.stamp, array))

    def _set(self, key: int, t: torch.Tensor, entry: _DeviceCopy) -> None:
        self._drop(key)
        entry.ref = weakref.ref(t, lambda r, k=key: self._drop(k, r))
        self._entries[key] = entry

    def _drop(self, key: int, dead_ref=None) -> None:
        entry = self._entries.get(key)
        if entry is None or (dead_ref is not None and entry.ref is not dead_ref):
            return
        del self._entries[key]
        entry.array.release()
