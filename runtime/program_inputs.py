"""How a ``Program`` binds a run's device inputs: each checked, the input buffers they replace for the run (its swaps)
and the outputs stored over them (``Plan.in_place``). One Python pass reads each array once; the swaps and the
in-place outputs are then built in loops run by C over names and buffers. A kept optimizer's update binds four arrays
per parameter at every step (1,280 in the benchmark's SD U-Net): a dict comprehension or a check per input and per
output had made most of its run's host time (issue 50)."""
from __future__ import annotations

from .program_checks import check_device_arrays, check_in_place, check_run_keys
from .resident import DeviceArray


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

    def keep(self, arrays: dict, shapes: dict) -> None:
        """Bind ``arrays`` (device inputs by name, checked now, at ``shapes``) for the runs from now on, until
        ``keep`` binds others: each such run's ``device_inputs`` gives the rest (one given there too replaces the
        kept one for that run). The caller keeps them live and unreleased meanwhile (a kept optimizer's parameters and
        state: ``Program.keep_inputs``)."""
        self.kept = {}
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
        -> array). The arrays ``keep`` bound are checked and read only then."""
        kept = self.kept
        if kept and not (device_inputs.keys().isdisjoint(kept) and inputs.keys().isdisjoint(kept)):  # (given again)
            return self._bind_all(inputs, {**kept, **device_inputs}, shapes)
        check_run_keys(inputs, device_inputs, self.specs, self.device_only, self.alone, kept=kept)
        buffers = self._checked_buffers(device_inputs, shapes)
        ids = list(map(id, buffers))
        if self.in_place and (len(set(ids)) < len(ids) or not self._kept_ids.isdisjoint(ids)):  # (a shared buffer)
            check_in_place({**kept, **device_inputs}, self.in_place)
        swaps = dict(self._kept_swaps)
        swaps.update(zip(map(self._buffer_of.__getitem__, device_inputs), buffers))
        stored = dict(self._kept_stored)
        stored.update(zip(self._stored_outputs, map(device_inputs.__getitem__, self._stored_inputs)))
        return swaps, stored

    def _bind_all(self, inputs: dict, device_inputs: dict, shapes: dict) -> tuple[dict, dict]:
        """``bind`` with every device input given (none kept)."""
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
