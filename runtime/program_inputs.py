"""How a ``Program`` binds a run's device inputs: each checked, the input buffers they replace for the run (its swaps)
and the outputs stored over them (``Plan.in_place``). One Python pass reads each array once; the swaps and the
in-place outputs are then built in loops run by C over names and buffers. A kept optimizer's update binds four arrays
per parameter at every step (1,280 in the benchmark's SD U-Net): a dict comprehension or a check per input and per
output had made most of its run's host time (issue 50). A run whose inputs have the names of the last run's and whose
device arrays lie in the same buffers, at the same shapes and dtypes, binds as that run did: its swaps are the last
run's (``_Repeat``), found in a few loops run by C, with no check or dict built per input (a kept optimizer's
gradients and a backward's saved activations come back in the same pool buffers at every step)."""
from __future__ import annotations

import operator
from itertools import repeat
from typing import NamedTuple

from .program_checks import check_device_arrays, check_in_place, check_run_keys
from .resident import DeviceArray

_BUFFER, _SHAPE, _DTYPE, _DEVICE = (operator.attrgetter(name) for name in ("buffer", "shape", "dtype", "device"))


class _Repeat(NamedTuple):
    """What the last run bound (``DeviceInputs.bind``): the names of its host and device inputs, the device arrays'
    buffers, shapes and dtypes, the run's shapes (the dict, by identity) and the swaps it returned."""

    host_names: tuple
    names: tuple
    buffers: tuple
    shapes: tuple
    dtypes: tuple
    run_shapes: dict
    swaps: dict


class DeviceInputs:
    """A program's binding of device inputs (module docstring). ``specs``: its input specs by name; ``in_place``:
    output -> the device input it is stored over; ``alone``: the tensors alone in a buffer (a device input must be);
    ``device_only``: the inputs bound from the device only."""

    def __init__(self, specs: dict, in_place: dict[str, str], alone: set[str], device_only: frozenset, device):
        self.specs, self.in_place, self.alone, self.device_only, self.device = (specs, in_place, alone, device_only,
                                                                                 device)
        self._buffer_of = {name: t.buffer for name, t in specs.items()}
        self._dtype_of = {name: t.dtype for name, t in specs.items()}
        self._stored_outputs, self._stored_inputs = list(in_place), list(in_place.values())  # (not kept: ``keep``)
        self.kept: dict = {}  # the device inputs bound for every run (``keep``), their swaps, buffer ids and outputs
        self._kept_swaps, self._kept_ids, self._kept_stored = {}, frozenset(), {}
        self._last: _Repeat | None = None  # what the last run bound, which a run of the same buffers repeats

    def keep(self, arrays: dict, shapes: dict) -> None:
        """Bind ``arrays`` (device inputs by name, checked now, at ``shapes``) for the runs from now on, until
        ``keep`` binds others: each such run's ``device_inputs`` gives the rest (one given there too replaces the
        kept one for that run). The caller keeps them live and unreleased meanwhile (a kept optimizer's parameters and
        state: ``Program.keep_inputs``)."""
        self.kept, self._last = {}, None
        check_run_keys({}, arrays, self.specs, self.device_only, self.alone, partial=True)
        buffers = self._checked_buffers(arrays, shapes)
        self.kept, self._kept_swaps = dict(arrays), dict(zip(map(self._buffer_of.__getitem__, arrays), buffers))
        self._kept_ids = frozenset(map(id, buffers))
        self._kept_stored = {out: arrays[name] for out, name in self.in_place.items() if name in arrays}
        rest = [(out, name) for out, name in self.in_place.items() if name not in arrays]
        self._stored_outputs, self._stored_inputs = [out for out, _ in rest], [name for _, name in rest]

    def bind(self, inputs: dict, device_inputs: dict, shapes: dict) -> tuple[dict, dict]:
        """Check a run's ``inputs`` (host) and ``device_inputs`` (``check_run_inputs``'s conditions, ``shapes``: the
        run's), and return the swaps (input buffer name -> the array's buffer) and the in-place outputs (output name
        -> array). The arrays ``keep`` bound are checked and read only then. A run that repeats the last one's binding
        (``_repeats``) gets its swaps, the same dict: the caller reads them and the stored outputs, never writes
        them."""
        last = self._last
        if last is not None and self._repeats(last, inputs, device_inputs, shapes):
            return last.swaps, self._stored(device_inputs)
        kept = self.kept
        if kept and not (device_inputs.keys().isdisjoint(kept.keys()) and inputs.keys().isdisjoint(kept.keys())):
            return self._bind_all(inputs, {**kept, **device_inputs}, shapes)  # (given again)
        check_run_keys(inputs, device_inputs, self.specs, self.device_only, self.alone, kept=kept)
        buffers = self._checked_buffers(device_inputs, shapes)
        ids = list(map(id, buffers))
        if self.in_place and (len(set(ids)) < len(ids) or not self._kept_ids.isdisjoint(ids)):  # (a shared buffer)
            check_in_place({**kept, **device_inputs}, self.in_place)
        swaps = dict(self._kept_swaps)
        swaps.update(zip(map(self._buffer_of.__getitem__, device_inputs), buffers))
        arrays = tuple(device_inputs.values())
        self._last = _Repeat(tuple(inputs), tuple(device_inputs), tuple(buffers), tuple(map(_SHAPE, arrays)),
                             tuple(map(_DTYPE, arrays)), shapes, swaps)
        return swaps, self._stored(device_inputs)

    def _repeats(self, last: _Repeat, inputs: dict, device_inputs: dict, shapes: dict) -> bool:
        """Whether a run binds as the ``last`` did: the same run shapes, input names and device arrays' buffers (which
        the last run checked, each its input's alone where it had to be), the arrays live on this device, of the
        same shapes and dtypes."""
        if shapes is not last.run_shapes or tuple(device_inputs) != last.names or tuple(inputs) != last.host_names:
            return False
        arrays = tuple(device_inputs.values())
        return (all(map(operator.is_, map(type, arrays), repeat(DeviceArray)))
                and tuple(map(_BUFFER, arrays)) == last.buffers
                and all(map(operator.is_, map(_DEVICE, arrays), repeat(self.device)))
                and tuple(map(_SHAPE, arrays)) == last.shapes and tuple(map(_DTYPE, arrays)) == last.dtypes)

    def _stored(self, device_inputs: dict) -> dict:
        """The outputs stored in place (output name -> the array stored over): the kept inputs', the same dict at
        every run, and those of ``device_inputs``."""
        if not self._stored_outputs:
            return self._kept_stored
        stored = dict(self._kept_stored)
        stored.update(zip(self._stored_outputs, map(device_inputs.__getitem__, self._stored_inputs)))
        return stored

    def _bind_all(self, inputs: dict, device_inputs: dict, shapes: dict) -> tuple[dict, dict]:
        """``bind`` with every device input given (none kept); not repeated (``_repeats``)."""
        self._last = None
        check_run_keys(inputs, device_inputs, self.specs, self.device_only, self.alone)
        buffers = self._checked_buffers(device_inputs, shapes)
        if self.in_place and len(set(map(id, buffers))) < len(buffers):  # (two inputs in one buffer)
            check_in_place(device_inputs, self.in_place)
        swaps = dict(zip(map(self._buffer_of.__getitem__, device_inputs), buffers))
        return swaps, {out: device_inputs[name] for out, name in self.in_place.items()}

    def _checked_buffers(self, device_inputs: dict, shapes: dict) -> list:
        """The buffer of each device input, each array checked on the way (``check_device_arrays``): one pass over
        the arrays, each read once (a pass per property, in C, read a thousand arrays scattered in memory five
        times, and was slower in a training step)."""
        buffers, device, dtype_of = [], self.device, self._dtype_of
        keep = buffers.append
        for name, array in device_inputs.items():
            if (type(array) is not DeviceArray or array.device is not device or array.shape != shapes[name]
                    or array.dtype != dtype_of[name] or array.buffer is None):
                check_device_arrays({name: array}, self.specs, shapes, device)  # (raises, naming the input)
            keep(array.buffer)
        return buffers
