"""Tensors that stay on the device between plan runs, and the pool that recycles their buffers.

A ``DeviceArray`` is a contiguous tensor in a storage buffer of its own: a plan writes it as an output that is
not read back (a forward pass's saved activation) and a later plan binds it as an input without an upload
(the backward pass). Its buffer returns to the device's ``BufferPool`` when the array is released or garbage
collected, so a training loop reuses the same buffers step after step instead of allocating new ones.
"""
from __future__ import annotations

import operator
from itertools import repeat
from math import prod

import numpy as np

from .dtypes import HOST_DTYPE, from_storage, host_words, storage_bytes


def buffer_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a contiguous tensor of logical ``dtype`` on the device; at least 4."""
    return max(storage_bytes(prod(shape), dtype), 4)


def _alive(buffer) -> bool:
    """False for a buffer wgpu-py has released: when an array and its buffer die in one garbage cycle, the
    buffer's finalizer may run before or after the array's returns it here; such a buffer is never handed out."""
    return getattr(buffer, "_internal", True) is not None


def _all_alive(buffers) -> bool:
    """``_alive`` of each of ``buffers``, read in loops run by C: a training step's sets of saved activations and
    kept gradients hold hundreds, each taken and given back once a step."""
    return all(map(operator.is_not, map(getattr, buffers, repeat("_internal"), repeat(True)), repeat(None)))


class BufferPool:
    """Storage buffers kept for reuse, by exact size. ``acquire`` reuses a preferred one where it is free, else the
    most recently released one."""

    def __init__(self, device):
        self.device = device
        self._free: dict[int, dict[int, object]] = {}  # size -> {id(buffer): buffer}, in order of release
        self._free_sets: dict[tuple, list[tuple]] = {}  # sizes -> sets of buffers of those sizes (``acquire_set``)
        self.live = 0  # buffers handed out and not yet released

    def acquire(self, nbytes: int, prefer=()):
        """A buffer of ``nbytes``: the first of ``prefer`` that is free here, else the most recently released."""
        free = self._free.get(nbytes) or {}
        buffer = None
        for p in prefer if free else ():
            buffer = free.pop(id(p), None)
            if buffer is not None and getattr(buffer, "_internal", True) is not None:  # (``_alive``, inlined)
                break
            buffer = None
        while buffer is None and free:
            buffer = free.popitem()[1]
            buffer = buffer if _alive(buffer) else None
        if buffer is None:
            buffer = self.device.storage_buffer(nbytes, "resident")
        self.live += 1
        return buffer

    def release(self, buffer) -> None:
        self.live -= 1
        if self.device.lost or not _alive(buffer):
            return
        self._free.setdefault(buffer.size, {})[id(buffer)] = buffer

    def acquire_set(self, sizes: tuple[int, ...]) -> tuple:
        """Buffers of ``sizes``, taken and given back as one (``release_set``): the set released last where one of
        these sizes is free, else new buffers. A run's saved outputs take one set, not one acquire each."""
        free = self._free_sets.get(sizes)
        buffers = None
        while buffers is None and free:
            buffers = free.pop()
            buffers = buffers if _all_alive(buffers) else None
        if buffers is None:
            buffers = tuple(self.device.storage_buffer(n, "resident") for n in sizes)
        self.live += len(buffers)
        return buffers

    def release_set(self, sizes: tuple[int, ...], buffers: tuple) -> None:
        self.live -= len(buffers)
        if self.device.lost or not _all_alive(buffers):
            return
        self._free_sets.setdefault(sizes, []).append(buffers)

    def free_buffers(self) -> list:
        """The buffers waiting for reuse."""
        return ([b for buffers in self._free.values() for b in buffers.values()]
                + [b for sets in self._free_sets.values() for buffers in sets for b in buffers])

    def pooled_bytes(self) -> int:
        return (sum(size * len(buffers) for size, buffers in self._free.items())
                + sum(sum(sizes) * len(sets) for sizes, sets in self._free_sets.items()))

    def clear(self) -> None:
        """Destroy the buffers waiting for reuse (buffers still handed out are not touched)."""
        for buffer in self.free_buffers():
            self.device.destroy_buffer(buffer)
        self._free.clear()
        self._free_sets.clear()


class BufferSet:
    """Buffers taken from ``pool`` as one set (``BufferPool.acquire_set``), each an array's (``arrays``), the pool
    interface of those arrays: the set goes back to the pool when the last of them is released or collected."""

    __slots__ = ("device", "sizes", "buffers", "_pool")

    def __init__(self, pool: BufferPool, sizes: tuple[int, ...]):
        self.device, self.sizes, self._pool = pool.device, sizes, pool
        self.buffers = pool.acquire_set(sizes)

    def arrays(self, shapes, dtypes) -> list["DeviceArray"]:
        """An array in each buffer, of the given shapes and logical dtypes (each holds the set)."""
        arrays = []
        for buffer, shape, dtype in zip(self.buffers, shapes, dtypes):
            array = DeviceArray.__new__(DeviceArray)
            array.device, array.shape, array.dtype, array._pool, array.buffer = self.device, shape, dtype, self, buffer
            arrays.append(array)
        return arrays

    def release(self, buffer) -> None:
        """(An array's buffer: the set goes back as one, when the last array lets go of it.)"""

    def __del__(self):
        try:
            self._pool.release_set(self.sizes, self.buffers)
        except Exception:  # noqa: BLE001 - interpreter shutdown, a lost device
            pass


class DedicatedBuffers:
    """The pool interface over buffers that are not kept for reuse: each array gets a buffer of its own, destroyed
    when the array is released (a parameter's device copy, which lives as long as its tensor)."""

    def __init__(self, device, label: str):
        self.device, self.label = device, label

    def acquire(self, nbytes: int, prefer=()):
        return self.device.storage_buffer(nbytes, self.label)

    def release(self, buffer) -> None:
        self.device.destroy_buffer(buffer)


class _ViewOf:
    """The pool interface of a view (``DeviceArray.reshaped``): it holds the array viewed, whose buffer it shares;
    the view's release drops that hold and gives back nothing."""

    __slots__ = ("base",)

    def __init__(self, base: "DeviceArray"):
        self.base = base

    def release(self, buffer) -> None:
        self.base = None


class DeviceArray:
    """A contiguous tensor of logical ``dtype`` held in a buffer from ``pool`` (the device's ``BufferPool``, or
    ``DedicatedBuffers``)."""

    __slots__ = ("device", "buffer", "shape", "dtype", "_pool")

    def __init__(self, pool: BufferPool | DedicatedBuffers, shape: tuple[int, ...], dtype: str, capacity: int = 0,
                 prefer=()):
        """``capacity``: the buffer's bytes where more than the shape's (an output of a plan over symbolic sizes
        takes its size at the plan's bounds, so that the pool's buffers serve every length: a KV cache one token
        longer each step reuses the buffer of the step before, where exact sizes would leave one per length).
        ``prefer``: buffers to take from the pool first, where free (``BufferPool.acquire``)."""
        shape = tuple(shape)
        self.device, self.shape, self.dtype, self._pool = pool.device, shape, dtype, pool
        self.buffer = pool.acquire(max(buffer_bytes(shape, dtype), capacity), prefer)

    @classmethod
    def in_pool(cls, pool: BufferPool, shape: tuple[int, ...], dtype: str, nbytes: int, prefer=()) -> "DeviceArray":
        """The array ``cls(pool, shape, dtype, capacity=nbytes, prefer=prefer)`` for an ``nbytes`` of at least the
        shape's (not computed again): a program's resident output, made at every run in a buffer of one size."""
        array = cls.__new__(cls)
        array.device, array.shape, array.dtype, array._pool = pool.device, tuple(shape), dtype, pool
        array.buffer = pool.acquire(nbytes, prefer)
        return array

    @classmethod
    def upload(cls, device, array: np.ndarray, dtype: str, pool=None) -> "DeviceArray":
        """A new device array of logical ``dtype`` holding ``array`` (its host form, see ``dtypes``), in a buffer
        from ``pool`` (default: the device's)."""
        result = cls(pool or device.pool, tuple(array.shape), dtype)
        host = host_words(array, dtype)
        if host.size:
            device.write(result.buffer, 0, host, "device array")
        return result

    @classmethod
    def zeros(cls, device, shape: tuple[int, ...], dtype: str, pool=None) -> "DeviceArray":
        """A new device array of zeros (a buffer from the pool holds what its last user left there)."""
        result = cls(pool or device.pool, tuple(shape), dtype)
        with device.checked("zeroing a device array"):
            encoder = device.wgpu_device.create_command_encoder()
            encoder.clear_buffer(result.buffer)
        device.submit(encoder, "zeros")
        return result

    @property
    def nbytes(self) -> int:
        return buffer_bytes(self.shape, self.dtype)

    def reshaped(self, shape: tuple[int, ...]) -> "DeviceArray":
        """This array's buffer under another ``shape`` of as many elements (a token per row, [batch], bound as the
        next step's ids, [batch, 1]): a view that holds this array, so that the buffer goes back to its pool once
        both are gone; releasing the view lets go of this array, not of the buffer (releasing this array gives the
        buffer back under its views: let them go first)."""
        shape = tuple(shape)
        if prod(shape) != prod(self.shape):
            raise ValueError(f"cannot view {self.dtype}{list(self.shape)} as shape {list(shape)}")
        if self.buffer is None:
            raise ValueError("this device array was released")
        view = DeviceArray.__new__(DeviceArray)
        view.device, view.shape, view.dtype, view.buffer = self.device, shape, self.dtype, self.buffer
        view._pool = _ViewOf(self)
        return view

    def numpy(self) -> np.ndarray:
        """Download the contents as a numpy array in the dtype's host form (int64 from int32, bool from u32,
        bfloat16 as raw uint16 bits)."""
        return download_arrays([self])[0]

    def release(self) -> None:
        """Give the buffer back to the pool; the array cannot be used afterwards."""
        if self.buffer is not None:
            buffer, self.buffer = self.buffer, None
            self._pool.release(buffer)

    def __del__(self):
        try:  # (``release``, inlined: hundreds of arrays die at every training step)
            buffer = self.buffer
            if buffer is not None:
                self.buffer = None
                self._pool.release(buffer)
        except Exception:  # noqa: BLE001 - interpreter shutdown, a lost device, or an acquire that failed
            pass

    def __repr__(self) -> str:
        state = "released" if self.buffer is None else "live"
        return f"<DeviceArray {self.dtype}{list(self.shape)} on {self.device.name}, {state}>"


def download_arrays(arrays: list[DeviceArray]) -> list[np.ndarray]:
    """The contents of each of ``arrays`` (``DeviceArray.numpy``), all copied into one staging buffer by one
    submission and read back in one wait: the arrays of one device, each at a 4-byte aligned offset (each
    ``nbytes`` is a multiple of 4: half precisions are stored two to a word)."""
    for array in arrays:
        if array.buffer is None:
            raise ValueError("this device array was released")
    present = [array for array in arrays if prod(array.shape)]
    if not present:
        return [np.empty(array.shape, dtype=HOST_DTYPE[array.dtype]) for array in arrays]
    device = present[0].device
    offsets, total = {}, 0
    for array in present:
        offsets[id(array)], total = total, total + array.nbytes
    staging = device.staging_buffer(total, "download")
    try:
        with device.checked("downloading device arrays"):
            encoder = device.wgpu_device.create_command_encoder()
            for array in present:
                encoder.copy_buffer_to_buffer(array.buffer, 0, staging, offsets[id(array)], array.nbytes)
        device.submit(encoder, "download")
        data = device.read_staging(staging, total)
    finally:
        device.destroy_buffer(staging)
    return [from_storage(data, array.dtype, array.shape, offsets[id(array)]).copy() if id(array) in offsets
            else np.empty(array.shape, dtype=HOST_DTYPE[array.dtype]) for array in arrays]
