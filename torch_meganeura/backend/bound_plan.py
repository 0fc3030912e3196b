"""An entry of a device partition: one compiled signature, its program, and what a call needs to replay it as bound.

``BoundPlan`` remembers the parameter arguments its program's buffers were last bound from (identity, version and
storage) and checks, without building the signature, that a call's arguments are those (``replays``); a call that
is binds nothing again. ``SteadyUpdates`` holds the arguments it updates in place (a training forward's BatchNorm
statistics) as its last run left them, so that the next run binds and adopts them with no call per argument;
``ArraySignatures`` compares the signatures of arguments that are device arrays (a backward's saved activations)
in loops run by C, and ``SizedSignatures`` those of arguments with symbolic sizes that are kept tensors (a default KV
cache's). ``per_call.DevicePartition`` selects, runs and builds the entries.
"""
from __future__ import annotations

import operator
import weakref
from itertools import repeat
from dataclasses import dataclass, field

import torch

from meganeura.runtime.program import Program
from meganeura.runtime.resident import DeviceArray

from .device_graph import DeviceGraph
from .signatures import fits, signature_item
from ..lower.fx_lowering import LoweredGraph
from ..lower.symbolic import DynamicSizes
from ..tensors.device_tensor import DeviceTensor, fill_host, kept_array, readopt, watch_downloads
from ..tensors.params import ParamStore
from ..tensors.read_ahead import ReadAhead
from ..tensors.resident import TORCH_DTYPE

_VERSION = operator.attrgetter("_version")
_KEPT = operator.attrgetter("_meganeura_kept")
_KEPT_ARRAY = operator.attrgetter("_meganeura_kept.array")
_NEXT = (1).__add__
_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")
_STORAGE = torch.Tensor.data_ptr


@dataclass(eq=False)
class BoundPlan:
    """A compiled signature, and the parameter arguments its program's buffers were last bound from."""

    lowered: LoweredGraph
    program: Program
    key: tuple
    variant: tuple = (False, frozenset())  # (gradients kept, output positions read): ``DevicePartition.forward``
    graph: DeviceGraph | None = None  # what it instantiates: a dynamic graph's guards say which sizes it serves
    dynamic: DynamicSizes | None = None
    bound: tuple | None = None  # ids, versions and storage pointers of the bound parameters, while they all live
    updated: dict = field(default_factory=dict)  # argument index -> output position of the updates kept on the
    # device (``DevicePartition._updates``): those arguments are bound per run, each from its own device array
    _refs: list = field(default_factory=list)
    _store: ParamStore | None = None  # the store the parameters were bound from, and its generation then
    _generation: int = 0
    _updated_ids: tuple = ()  # of the arguments at ``updated`` in the last call that selected this entry
    returns: dict = field(default_factory=dict)  # (positions read, come back) -> how outputs return (``_returns``)
    read_ahead: ReadAhead | None = None  # the updated arguments, as eager code reads them (``read_ahead``)
    along: set = field(default_factory=set)  # the updates read back along with each run that waits (``read_along``)
    steady: "SteadyUpdates | None" = None  # the arguments it updates in place, as its last run left them
    layouts: dict = field(default_factory=dict)  # how its outputs return (``_returns``) -> ``_Layout``

    def __post_init__(self):
        self._param_positions = [i for i, _ in self.lowered.params]
        self._params = taker(self._param_positions)  # args -> the parameter arguments (in C: 272 a decode step)
        self._updated_of = taker(list(self.updated)) if self.updated else _none  # (in C, not a loop per argument)
        params = set(self._param_positions) | set(self.updated)
        dims = dict(self.dynamic.dynamic) if self.dynamic is not None else {}
        free = [(i, item) for i, item in enumerate(self.key) if i not in params and i not in dims]
        self._arrays = ArraySignatures([(i, item) for i, item in free if _on_device(item)])
        self._free = [(i, item) for i, item in free if not _on_device(item)]
        outputs, in_place = self.lowered.outputs, self.graph.plan.in_place if self.graph is not None else {}
        # the updates written into an array of their own: the argument's spare one (``device_tensor.adopt``)
        self.alternating = {i: outputs[k][1] for i, k in self.updated.items() if outputs[k][1] not in in_place}
        names = dict(self.lowered.inputs)
        # what a run feeds from its arguments (``device_graph.feed``): all inputs but those updated in place, which
        # it binds as (argument index, output position, input name, output name, output name if alternating)
        self.fed = [(i, name) for i, name in self.lowered.inputs if i not in self.updated]
        self.update_inputs = [(i, k, names[i], outputs[k][1], self.alternating.get(i)) for i, k in self.updated.items()]
        # checked through the abstract key at every call; not the arguments updated in place, which a replay requires
        # to be the objects of the last call (``replays``), checked then
        self._sized = SizedSignatures([(i, item) for i, item in enumerate(self.key)
                                       if i in dims and i not in self.updated and item is not None])
        # the updates small enough to read back along with a run that waits anyway (``Program.readable_along``)
        self.readable_updates = [(i, out) for i, _, _, out, _ in self.update_inputs
                                 if out in self.program.readable_along]
        self._downloaded = {out: self._on_download(out) for _, out in self.readable_updates}
        self._readable_at = {out: i for i, out in self.readable_updates}  # output name -> argument index
        # the readable updates that the last run through all of them read back and left unwatched (``read_along``);
        # None before that run: every other one reports its downloads
        self._unwatched: frozenset | None = None

    def _on_download(self, out: str):
        """What eager code's download of the update ``out`` calls: from the next run on, it is read back along with
        each run that waits (a step counter that HF's masks read on the host before every decode step)."""
        ref = weakref.ref(self)

        def downloaded() -> None:
            entry = ref()
            if entry is not None:
                entry.along.add(out)

        return downloaded

    def read_along(self, args, steady: bool = False) -> None:
        """After a run: give the updates read back along with it their values on the host (``fill_host``); have the
        others report a download (``watch_downloads``). After a run that adopted its arguments as they were
        (``steady``: the same ``Kept``s, whose watches stay) and read back every update left unwatched, only those
        read back are filled (a static cache's step counter), with no call for each of the others (29 a SmolLM2
        step)."""
        values = self.program.read_along
        if steady and self._unwatched is not None and self._unwatched <= values.keys():
            for out, value in values.items():
                i = self._readable_at.get(out)
                if i is not None:
                    fill_host(args[i], value)
            return
        for i, out in self.readable_updates:
            if out in values:
                fill_host(args[i], values[out])
            else:
                watch_downloads(args[i], self._downloaded[out])
        self._unwatched = frozenset(out for _, out in self.readable_updates if out in values)

    def params_current(self, args) -> bool:
        """Whether every parameter argument is the tensor the last bind used, at the same ``_version`` and storage,
        and the store has replaced no device copy since: then its buffer is bound and current (``p.data = t`` keeps
        the version but not the storage)."""
        if self.bound is None:
            return False
        params = self._params(args)
        ids, versions, storages = self.bound
        with torch._C.DisableTorchFunctionSubclass():  # a kept parameter's override: metadata needs none of it
            return (tuple(map(id, params)) == ids and tuple(map(_VERSION, params)) == versions
                    and tuple(map(_STORAGE, params)) == storages and self._store.generation == self._generation)

    def replays(self, args, sizes: tuple) -> bool:
        """Whether a call with ``args`` can replay this entry as bound, checked without building the signature: the
        non-parameter arguments are compared, each parameter must be the bound object with the same version and
        storage, and each argument updated in place the object of the last call (which the update made a
        ``DeviceTensor``: its kind changed, not its shape or dtype). (Their shapes and dtypes are then the bound
        ones: ``.data`` swaps change the storage, and dynamo's guards check every parameter's metadata before the
        graph runs.) ``sizes``: the call's symbol values (a dynamic graph's)."""
        if len(args) != len(self.key) or tuple(map(id, self._updated_of(args))) != self._updated_ids:
            return False
        with torch._C.DisableTorchFunctionSubclass():  # (kept tensors' metadata: their override needs none of it)
            if not all(signature_item(args[i]) == item for i, item in self._free) or not self._arrays.hold(args):
                return False
            if not self._serves(args, sizes):
                return False
        return self.params_current(args) and not self.program.device.lost

    def select(self, args) -> None:
        """Remember the arguments updated in place of a call that selected this entry by its signature."""
        self._updated_ids = tuple(map(id, self._updated_of(args)))

    def _serves(self, args, sizes: tuple) -> bool:
        """Whether the arguments with symbolic sizes fit the abstract key and their sizes the graph's guards (an
        argument updated in place is the object of the last call, which fitted: ``replays``)."""
        return self._sized.hold(args) and (not sizes or self.graph.holds(sizes))

    def bind(self, args, store: ParamStore) -> None:
        """Bind the parameter arguments' device copies (uploading what changed), or the arrays of those that a graph
        updates on the device (``DeviceTensor``s), and remember them."""
        self.program.bind_params({f"param:{name}": _param_array(args[i], store, name).buffer
                                  for i, name in self.lowered.params})
        params = self._params(args)
        self._store, self._generation = store, store.generation
        self._refs = [weakref.ref(a, self._forget) for a in params]  # a dead one's id may be reused
        with torch._C.DisableTorchFunctionSubclass():
            self.bound = (tuple(map(id, params)), tuple(map(_VERSION, params)), tuple(map(_STORAGE, params)))

    def _forget(self, _ref) -> None:
        self.bound = None



@dataclass(eq=False)
class SteadyUpdates:
    """The arguments an entry updates in place (BatchNorm's running statistics in a training forward, all stored over
    their arrays: ``Plan.in_place``), as its last run left them: each a ``DeviceTensor`` whose ``Kept`` links it to
    the array the plan stores over, at the version its adoption gave it. While a call's arguments there are those,
    at those versions (eager code wrote none of them; aot_autograd's copy of each into itself, a version step that
    writes nothing, aside), the run binds the same arrays and adopts them again with no call per argument
    (``device_tensor.readopt``): 159 binds and adoptions a ResNet-50 step before."""

    take: object  # args -> the updated arguments, in ``update_inputs``' order (``operator.itemgetter``)
    kepts: list
    versions: tuple
    bound: dict  # input name -> the array bound, which the run stores over
    adopted: dict  # output position -> the argument that stands for it

    @staticmethod
    def after(entry: BoundPlan, args, on_device: dict, adopted: dict) -> "SteadyUpdates | None":
        """The arguments ``entry``'s run just adopted, each on the array it was bound from; None where there are
        none."""
        if not entry.update_inputs:
            return None
        take = taker([i for i, *_ in entry.update_inputs])
        tensors = take(args)
        with torch._C.DisableTorchFunctionSubclass():
            versions = tuple(map(_VERSION, tensors))
        return SteadyUpdates(take, list(map(_KEPT, tensors)), versions,
                              {name: on_device[name] for _, _, name, _, _ in entry.update_inputs}, adopted)

    def holds(self, args) -> bool:
        """Whether the updated arguments of a call are the tensors this run adopted (their ``Kept``s, compared by
        identity), at the versions it left them (loops run by C)."""
        tensors = self.take(args)
        try:
            kepts = list(map(_KEPT, tensors))
        except AttributeError:  # (one is no kept tensor any more)
            return False
        with torch._C.DisableTorchFunctionSubclass():
            versions = tuple(map(_VERSION, tensors))
        return kepts == self.kepts and (versions == self.copied or versions == self.versions)

    def readopt(self, args) -> dict:
        """After a run that stored over the bound arrays: the updated arguments of ``args`` adopted again; returns
        them by output position."""
        self.versions = readopt(self.take(args), self.kepts)
        self.copied = tuple(map(_NEXT, self.versions))
        return self.adopted

    def __post_init__(self):
        # the versions after aot_autograd's copy of each into itself (one step that writes nothing: ``Kept``)
        self.copied = tuple(map(_NEXT, self.versions))



class ArraySignatures:
    """The arguments of an entry whose signature is a tensor on the device (a backward's saved activations, which it
    gets as the ``DeviceArray``s of a ``SavedPack``): the shapes and dtypes of those that are arrays compared in loops
    run by C, the others (a ``ResidentTensor``: the image batch) one by one (``signature_item``); before, a call per
    argument (170 a ResNet-50 backward). Which are arrays is decided again where their classes change."""

    def __init__(self, items: list):
        self.items = items  # (argument index, signature item)
        self.take = taker([i for i, _ in items]) if items else _none
        self.classes = None

    def hold(self, args) -> bool:
        """Whether the arguments of a call have these signatures."""
        classes = tuple(map(type, self.take(args)))
        if classes != self.classes:
            self._split(classes)
        arrays = self.take_arrays(args)
        return (tuple(map(tuple, map(_SHAPE, arrays))) == self.shapes
                and tuple(map(TORCH_DTYPE.__getitem__, map(_DTYPE, arrays))) == self.dtypes
                and all(signature_item(args[i]) == item for i, item in self.others))

    def _split(self, classes: tuple) -> None:
        """Which arguments are arrays (``classes``: of the arguments, in order), and their expected shapes and
        torch dtypes."""
        arrays = [item for item, cls in zip(self.items, classes) if cls is DeviceArray]
        self.classes, self.others = classes, [item for item, cls in zip(self.items, classes) if cls is not DeviceArray]
        self.take_arrays = taker([i for i, _ in arrays]) if arrays else _none
        self.shapes = tuple(tuple(item[0]) for _, item in arrays)
        self.dtypes = tuple(item[1] for _, item in arrays)



class SizedSignatures:
    """The tensor arguments of an entry with symbolic sizes, checked against their abstract signatures: where all are
    ``DeviceTensor``s (HF's default cache: each layer's key and value cache, lazy outputs come back, one symbolic
    length each), in loops run by C: their dtypes, their ranks, their sizes at the dimensions that are not symbolic
    (those of one set of such dimensions taken at once), and their kinds ("resident" while a ``Kept`` holds an array:
    ``arg_kind``); else ``fits`` of each, as before for all (a ``fits`` and an ``arg_kind`` call per argument: 4 a
    layer a decode token)."""

    def __init__(self, items: list):
        self.items = items  # (argument index, abstract signature item: None at the symbolic dimensions)
        self.take = taker([i for i, _ in items])
        kinds = {item[2] for _, item in items}  # (a DeviceTensor is "resident" or "tensor", never a "param")
        self.classes = (DeviceTensor,) * len(items) if kinds <= {"resident", "tensor"} else None  # (what C serves)
        self.dtypes = tuple(item[1] for _, item in items)
        self.ranks = tuple(len(item[0]) for _, item in items)
        self.resident = tuple(item[2] == "resident" for _, item in items)
        groups: dict[tuple, list[int]] = {}  # the dimensions that are not symbolic -> the arguments' places in items
        for k, (_, item) in enumerate(items):
            groups.setdefault(tuple(d for d, size in enumerate(item[0]) if size is not None), []).append(k)
        self.groups = [(taker(places), operator.itemgetter(*dims) if dims else _none,
                        tuple(_fixed(items[k][1][0], dims) for k in places))
                       for dims, places in groups.items()]

    def hold(self, args) -> bool:
        """Whether the arguments of a call fit these abstract signatures (``fits`` of each)."""
        if not self.items:
            return True
        tensors = self.take(args)
        if tuple(map(type, tensors)) != self.classes:
            return all(fits(args[i], item) for i, item in self.items)
        shapes = tuple(map(_SHAPE, tensors))
        return (tuple(map(_DTYPE, tensors)) == self.dtypes and tuple(map(len, shapes)) == self.ranks
                and all(tuple(map(fixed, take(shapes))) == sizes for take, fixed, sizes in self.groups)
                and tuple(map(operator.is_not, map(_KEPT_ARRAY, tensors), repeat(None))) == self.resident)


def _fixed(shape: tuple, dims: tuple):
    """``operator.itemgetter(*dims)`` of ``shape``: one size for one dimension, else a tuple; () for none."""
    return operator.itemgetter(*dims)(shape) if dims else ()


def _on_device(item) -> bool:
    """Whether a signature item is a tensor's on the device (``signature_item``)."""
    return type(item) is tuple and item[-1:] == ("resident",)


def _none(args) -> tuple:
    return ()


def taker(positions: list[int]):
    """A function of the arguments returning those at ``positions`` as a tuple, in C (``operator.itemgetter``, which
    returns one item alone; no positions: an empty tuple)."""
    if not positions:
        return _none
    if len(positions) == 1:
        only = positions[0]
        return lambda args: (args[only],)
    return operator.itemgetter(*positions)



def _param_array(t: torch.Tensor, store: ParamStore, name: str) -> DeviceArray:
    """The device array a parameter argument binds: the store's copy, or the array of a buffer that a graph updates
    on the device (BatchNorm's running statistics read by an inference graph after training)."""
    array = kept_array(t, store.device)
    return array if array is not None else store.array(t, f"parameter {name}")

