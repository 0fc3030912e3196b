"""Device copies of parameters and buffers, keyed on tensor identity, ``_version`` and storage.

An unchanged weight is uploaded once and shared by every plan that binds it; an in-place change (an
optimizer step, ``copy_``, ``fill_``) bumps ``_version``, and ``p.data = t`` gives the same tensor new storage:
either way the next call writes the new data into the same device buffer. (An in-place change made through
``p.data`` bumps neither and is not seen.) The device copy is freed when the tensor is garbage-collected.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from meganeura.runtime.errors import InputError
from meganeura.runtime.dtypes import host_words, storage_bytes
from meganeura.runtime.resident import DeviceArray

from .registry import logical_dtype


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
    buffer: object
    nbytes: int


class ParamStore:
    """Device copies of torch tensors. ``generation`` changes when a store hands out another buffer for a tensor
    it already served (a plan bound to the old one must bind again); this store writes changes into the same
    buffer, so its generation stays 0."""

    generation = 0

    def __init__(self, device):
        self.device = device
        self._entries: dict[int, _DeviceCopy] = {}

    def buffer(self, t: torch.Tensor, what: str = "parameter"):
        key = id(t)
        entry = self._entries.get(key)
        if entry is not None and entry.ref() is t and entry.nbytes == max(storage_bytes(t.numel(), logical_dtype(t.dtype)), 4):
            if entry.stamp != (t._version, t.data_ptr()):
                data = to_device_numpy(t, what)
                if data.size:
                    self.device.write(entry.buffer, 0, data, what)
                entry.stamp = (t._version, t.data_ptr())
            return entry.buffer
        data = to_device_numpy(t, what)
        buf = self.device.storage_buffer(max(data.nbytes, 4), what)
        if data.size:
            self.device.write(buf, 0, data, what)
        self._drop(key)
        ref = weakref.ref(t, lambda r, k=key: self._drop(k, r))
        self._entries[key] = _DeviceCopy(ref, (t._version, t.data_ptr()), buf, max(data.nbytes, 4))
        return buf

    def _drop(self, key: int, dead_ref=None) -> None:
        entry = self._entries.get(key)
        if entry is None or (dead_ref is not None and entry.ref is not dead_ref):
            return
        del self._entries[key]
        self.device.destroy_buffer(entry.buffer)
