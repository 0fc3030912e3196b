"""ResidentTensor: a torch tensor whose data stay in a device buffer (a ``DeviceArray``).

The forward graph of a training step returns the activations saved for backward as ResidentTensors, and the
backward graph's device partitions bind their buffers directly: no download after the forward, no upload
before the backward. Autograd only stores and hands them back; when it frees them (after the backward, or when
the graph is dropped) the buffer returns to the device's pool.

Any aten op that reaches a ResidentTensor outside a device partition (an eager fallback op, a user reading a
saved tensor) downloads it first, so the result is always right, only slower.
"""
from __future__ import annotations

import logging

import torch
from torch.utils._pytree import tree_map

from meganeura.runtime.resident import DeviceArray

from .params import tensor_from_host
from .registry import TORCH_TO_LOGICAL

log = logging.getLogger("torch_meganeura")

TORCH_DTYPE = {logical: dtype for dtype, logical in TORCH_TO_LOGICAL.items()}


class ResidentTensor(torch.Tensor):
    array: DeviceArray

    @staticmethod
    def __new__(cls, array: DeviceArray):
        t = torch.Tensor._make_wrapper_subclass(cls, array.shape, dtype=TORCH_DTYPE[array.dtype], device="cpu")
        t.array = array
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        log.debug("downloading a resident tensor for %s", func)
        unwrap = lambda x: x.materialize() if isinstance(x, ResidentTensor) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def materialize(self) -> torch.Tensor:
        """A host copy of the data."""
        return tensor_from_host(self.array.numpy())

    def __repr__(self) -> str:
        return f"ResidentTensor({self.array!r})"
