"""SavedPack: what one device partition of a training forward saves for the backward, crossing autograd as one object.

aot_autograd saves each value a forward returns past the user's outputs (``ctx.save_for_backward``) and hands them to
the compiled backward in the same order. Made one ``ResidentTensor`` each, a forward saving hundreds of activations
cost as many wrappers, and the backward as many again to unwrap. Instead, a device partition returns one ``SavedPack``
at every position it saves: aot_autograd's per-value work on it (``_is_view``, saving, unpacking) stays in C++, and
the backward's compiled function (``backend.packed``) puts each value back at its position before its partitions run:
the partition's ``DeviceArray`` (bound by the backward's plans as it is) or, for a position eager code reads, a
``ResidentTensor`` of it. The pack's arrays go back to the device's pool when autograd drops the saved values (after
the backward, or with the graph when no backward runs).

A pack is a tensor only to cross autograd: any aten op on it is an error (no eager code sees it).
"""
from __future__ import annotations

import torch

_HOST = torch.device("cpu")  # (an object: ``_make_wrapper_subclass`` parses a string at every call)
_NO_ELEMENTS = (0,)
_make_wrapper = torch.Tensor._make_wrapper_subclass


class SavedPack(torch.Tensor):
    """``values``: what the partition saves, by its saved output positions in order (``DeviceArray``s, or tensors
    for the positions its plan returns on the host: constants, a 0-d bool). ``origin``: the partition's token, which
    the backward checks (the pack it unpacks is the one its graph's forward made)."""

    __slots__ = ("values", "origin")
    values: list
    origin: object

    @staticmethod
    def __new__(cls, values: list, origin: object):
        t = _make_wrapper(cls, _NO_ELEMENTS, dtype=torch.float32, device=_HOST)
        t.values, t.origin = values, origin
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"meganeura: {func} on the values a device partition saved for the backward (a SavedPack): "
                           "only the compiled backward unpacks them")

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"SavedPack({len(self.values)} values)"
