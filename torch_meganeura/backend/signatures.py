"""What selects a partition's compiled graph: the signature of its arguments (each tensor's shape, dtype and kind:
a parameter, a tensor on the host, one on the device; a non-tensor's value), checked against a dynamic graph's
abstract signature without building it (``fits``), and the process's compiled graphs shared by signature
(``SharedGraphs``)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from meganeura.runtime.resident import DeviceArray

from .device_graph import DeviceGraph
from ..tensors.device_tensor import DeviceTensor
from ..tensors.resident import TORCH_DTYPE, ResidentTensor


def arg_kind(a) -> str | None:
    """The kind of a partition argument: ``"resident"``, ``"param"`` or ``"tensor"``; None for a non-tensor.
    Exact types are tested first: ``isinstance`` against ``Parameter`` runs its metaclass's Python check, and a
    call tests every argument."""
    cls = type(a)
    if cls is torch.nn.Parameter:
        return "param"
    if cls is DeviceArray:  # a saved activation, unpacked (``SavedPack``)
        return "resident"
    if cls is torch.Tensor:
        return "param" if getattr(a, "_is_param", False) else "tensor"  # (what Parameter's isinstance accepts too)
    if isinstance(a, ResidentTensor) or cls is DeviceTensor and a._meganeura_kept.array is not None:
        return "resident"
    if cls is DeviceTensor:  # (read back: its values are on the host)
        return "tensor"
    if isinstance(a, torch.Tensor):
        return "param" if isinstance(a, torch.nn.Parameter) else "tensor"
    return None


def signature_item(a):
    """What selects a plan about one argument: a tensor's shape, dtype and kind, or a non-tensor's value."""
    if type(a) is DeviceArray:  # (as the ResidentTensor of it: the same plan binds either)
        return torch.Size(a.shape), TORCH_DTYPE[a.dtype], "resident"
    kind = arg_kind(a)
    return a if kind is None else (a.shape, a.dtype, kind)


def fits(a, item) -> bool:
    """Whether ``a`` has the abstract signature ``item`` (``DynamicSizes.abstract_item`` of its ``signature_item``:
    None at its symbolic dimensions; an int argument's is None), read without building it."""
    if item is None:
        return True
    shape, dtype, kind = item
    if arg_kind(a) != kind or a.dtype != dtype:
        return False
    own = a.shape
    if len(own) != len(shape):
        return False
    for n, s in zip(own, shape):  # (a loop, not a generator: a decode step checks two cache tensors per layer)
        if s is not None and s != n:
            return False
    return True


def signature(args) -> tuple:
    return tuple(map(signature_item, args))


class SharedGraphs:
    """The compiled graphs of this process, by what selects one: a partition's code and signature, which inputs are
    parameters, and the options that change its plan. Partitions of different dynamo graphs share them: dynamo
    compiles a frame again when an input's class changes (a KV cache that came back as a ``DeviceTensor``), and the
    new graph's partitions then build only their programs. The least recently used of ``LIMIT`` entries go first."""

    LIMIT = 256  # entries (each holds a plan and its lowered graph, no device object)

    def __init__(self):
        self._entries: OrderedDict[tuple, list[DeviceGraph]] = OrderedDict()

    def find(self, key: tuple, device, values) -> DeviceGraph | None:
        graphs = self._entries.get(key, [])
        if graphs:
            self._entries.move_to_end(key)
        return next((g for g in graphs if g.device is device and g.holds(values)), None)

    def graphs(self, key: tuple) -> list[DeviceGraph]:
        """The graphs compiled for ``key``, oldest first."""
        return list(self._entries.get(key, ()))

    def add(self, key: tuple, graph: DeviceGraph) -> None:
        graphs = self._entries.setdefault(key, [])
        graphs[:] = [g for g in graphs if g.device is graph.device and not g.device.lost] + [graph]
        self._entries.move_to_end(key)
        while len(self._entries) > self.LIMIT:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


SHARED_GRAPHS = SharedGraphs()


def graph_key(key: tuple) -> tuple:
    """What selects a compiled graph (its plan) about a signature: a tensor on the device and one on the host are
    the same input of the plan (only the program binds them differently)."""
    return tuple((*item[:-1], "tensor") if isinstance(item, tuple) and item[-1:] == ("resident",) else item
                 for item in key)
