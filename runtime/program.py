"""A plan instantiated on a device: ``Program``, whose ``run`` replays the plan at every call. This module is that
replay, read top to bottom in the order a call takes; what a run binds (buffers, pipelines, bind groups, params) is
built once by the class ``Program`` extends, ``ProgramResources`` (``meganeura.runtime.program_resources``), which also
drops what the replay built over buffers that change.

A program's modules: ``program_resources`` (what is built once), this one (a run), ``program_recording`` (a run's
commands recorded: compute passes submitted in parts, the next run's recorded ahead, bind groups and command lists
over per-run buffers), ``program_inputs`` (a run's device inputs checked and bound), ``program_plan`` (what a program
reads off its plan once: submission parts, indirect slots, a run's sizes, the pipelines to compile) and
``program_checks`` (a plan against the device's limits, a run's arguments, the read-back's bytes taken apart).

``run`` uploads the inputs, records the dispatches into compute passes, copies outputs and status into one staging
buffer and maps it: the numpy outputs are views of the mapped memory (``meganeura.runtime.readback``), not copies. A
run with no host outputs (every output resident or stored in place) returns once it is submitted, and its status is
read at the device's next wait (``meganeura.runtime.in_flight``). A run that waits anyway can bring back, in the same
staging buffer, a few bytes of outputs kept on the device (``run``'s ``read_along``: a step counter that the host
reads before the next run), which would otherwise take a download and a wait of their own; ``read_later`` copies
such outputs into the staging buffer of a run that does not wait, for the host to read a few runs later
(``LaterRead``: a decode step's token ids). A plan of more than a few dozen dispatches is submitted in parts
(``submission_parts``): a short first part, so that the GPU starts while the host records the rest, then parts doubling
up to ``SUBMIT_EVERY`` dispatches; the queue keeps their order, and the host waits once, at the read-back. A run of a
plan of ``AHEAD_MIN_DISPATCHES`` or more then records the next run's dispatches while the GPU works (``_record_ahead``),
over the per-run buffers the next run is likely to bind (``SwapsAhead``: none, this run's, or those of the run before
where two sets alternate, as a decode step's KV cache does): the next run submits that command buffer with its copies
in one submit if it binds those buffers, so recording leaves the path from a call to the GPU (as does a caller's host
work that needs none of the run's host outputs: ``run``'s ``while_running``). A run that waits records it before its
wait; one that does not leaves it to the device's next wait (``InFlight.defer``: a training loop's
forward and backward submit one after the other, and the loop waits at the step's end), and where no wait comes
first, the next run records it itself, in one piece. While a profiler is attached to the device
(``meganeura.runtime.profiler``), each dispatch gets a timestamped pass of its own instead.

Tensors can also stay on the device (``DeviceArray``): resident outputs are written into fresh pool buffers and
returned without a read-back (saved outputs into one set of buffers taken and given back as one: ``BufferSet``), and
``run(..., device_inputs=...)`` binds such arrays as inputs without an upload (a device-only input always comes that
way). ``run(..., into=...)`` writes resident outputs into arrays the caller hands back (a training step alternating
between two sets of weights). Bind groups and whole command lists over those per-run buffers are cached by buffer, so
a loop that alternates between the same buffers builds nothing after its first runs.

A plan over symbolic sizes (``Plan.symbols``: a dynamic graph's) is built at its bounds, and ``run(...,
sizes=...)`` runs it at a call's sizes: their values go to the plan's sizes input, and the workgroup counts that
depend on them to an indirect-dispatch buffer (written only when the sizes change), so that the recorded commands,
and the next run recorded ahead, stay the same whatever the sizes.
"""
from __future__ import annotations

import operator
import time
from collections import deque
from functools import lru_cache, partial

import numpy as np

from .device import Device
from .errors import InputError, KernelStatusError, MeganeuraError
from .native import command_encoder
from .plan import SIZES_INPUT, Plan, TensorSpec
from .program_plan import AHEAD_MIN_DISPATCHES, RunTensors
from .program_recording import PendingAhead, Recording, SwapsAhead, swaps_key
from .program_checks import check_into, from_device_bytes, status_error, to_device_array
from .program_resources import READ_ALONG_BYTES, ProgramResources
from .in_flight import LaterRead
from .resident import BufferSet, DeviceArray, buffer_bytes

RECENT_OUTPUT_BUFFERS = 2  # an output that comes back as the next run's input alternates between two buffers
OUTPUT_SHAPES_KEPT = 64  # output shapes whose bytes are remembered (``_shape_bytes``): those of recent runs
_BUFFER = operator.attrgetter("buffer")  # (an array's buffer; a spec's buffer name)


class Program(ProgramResources, Recording):
    """A plan bound to a device; ``run`` replays it with no allocation. What it binds is ``ProgramResources``'s,
    how it records ``Recording``'s (module docstring)."""

    def __init__(self, device: Device, plan: Plan, resident_outputs=(), device_only_inputs=(), label: str = "",
                 saved_outputs=()):
        """Build the resources (``ProgramResources``), then start the replay's state, host-side only."""
        super().__init__(device, plan, resident_outputs, device_only_inputs, saved_outputs)
        self.label = label or f"a plan of {len(plan.dispatches)} dispatches"  # names the runs in deferred errors
        self.runs = 0  # runs submitted
        self.host_seconds = 0.0  # of the last run: recording and submitting (see run)
        self._sized: tuple = ((), None)  # (sizes, the ``RunTensors`` at them) of the last run (``_plan_for``)
        # bind groups and command lists over per-run buffers, by buffer (``Recording._with_swaps``; the command lists
        # by ``swaps_key``)
        self._swapped_groups: dict[tuple, tuple] = {}
        self._swapped_commands: dict[tuple, list] = {}
        self._ahead, self._swaps_ahead = None, SwapsAhead()  # the next run recorded ahead (see run), and over what
        # the last run's input swaps, its outputs' buffers and names, and the swaps and key made of them
        self._last_swaps: tuple | None = None  # (``_with_outputs``)
        # each resident output's latest buffers, its room and, in a plan without symbols, its buffers' size
        self._recent_outputs: dict[str, tuple[deque, int, int | None]] = {}  # (``_new_output``)
        self.read_along: dict[str, np.ndarray] = {}  # the last run's (``run``); empty if it did not wait
        self.later: LaterRead | None = None  # the last run's outputs ``read_later`` (``run``)

    # ---- a run, in the order it goes

    def run(self, inputs: dict[str, np.ndarray], device_inputs: dict[str, DeviceArray] | None = None,
            into: dict[str, DeviceArray] | None = None, sizes=(), read_along=(), read_later=(),
            while_running=None) -> dict:
        """``_run``; a plan with an arena runs alone on the device (its arena is the device's). ``while_running``: the
        caller's host work that needs none of the run's host outputs, called with its resident outputs (name ->
        ``DeviceArray``) after the submit and the next run's recording ahead, before the wait: done while the GPU
        works on the run (a decode step's KV-cache outputs made as tensors)."""
        if self._arena is None:
            return self._run(inputs, device_inputs, into, sizes, read_along, read_later, while_running)
        with self._arena.running():
            return self._run(inputs, device_inputs, into, sizes, read_along, read_later, while_running)

    def _run(self, inputs: dict[str, np.ndarray], device_inputs: dict[str, DeviceArray] | None,
             into: dict[str, DeviceArray] | None, sizes, read_along, read_later, while_running) -> dict:
        """Upload ``inputs``, bind ``device_inputs``, replay the plan (in ``submission_parts``), read back.

        Returns the outputs by name: numpy arrays, and for each resident output a ``DeviceArray``: the one ``into``
        gives for its name (overwritten), else a new one; an output stored in place (``Plan.in_place``) is the
        device input's array it overwrote. ``host_seconds`` is then the host's share of the call:
        from its start until the plan is submitted, plus recording the next run ahead where it waits (a run that does
        not wait leaves that to the device's next wait) and ``while_running``, before waiting for the GPU.
        A plan over symbolic sizes takes its symbols' values as ``sizes``. ``read_along``: outputs kept on the device
        (of ``readable_along``) that a run that waits anyway reads back too, into ``read_along`` (the attribute).
        ``read_later``: such outputs that the run copies into its staging buffer whether it waits or not, read when
        the host asks ``later`` (the attribute, a ``LaterRead``): a run in flight is then waited for only then.
        ``while_running``: ``run``'s."""
        began = time.perf_counter()
        if self._released:
            raise MeganeuraError("this program was released")
        if not self._ready:
            raise MeganeuraError(f"param buffers {self.missing_params()} are not bound; call bind_params first")
        if self._arena is not None and self._arena_generation != self._arena.generation:
            self._resolve()  # over the arena that replaced the one this program last bound
        device_inputs, into = device_inputs or {}, into or {}
        run, inputs = self._plan_for(sizes, inputs)
        swaps, stored = self._device_inputs.bind(inputs, device_inputs, run.shapes)
        arrays = {name: to_device_array(run.spec(self._input_specs[name]), value) for name, value in inputs.items()}
        check_into(into, device_inputs, self._unsaved, run.shapes, self.device)
        dev = self.device
        kept = self._resident_outputs(into, run)
        swaps, key = self._with_outputs(swaps, kept)
        kept.update(stored)
        self._upload(arrays, swaps)
        commands = self._with_swaps(swaps, key)
        profiler = dev.profiler if commands else None
        ahead = self._take_ahead(key, commands, profiler)
        # A run with no host outputs returns once submitted; its status is read at the next wait (``in_flight``)
        waits = bool(self._output_offsets) or profiler is not None or dev.in_flight.sync
        copies = self._copies if waits or self._status_offsets or read_later else []
        with dev.checked("recording the plan"):
            staging = self._read_back.take() if copies else None
            encoder = command_encoder(dev.wgpu_device)
            if ahead is None:
                encoder = self._record(encoder, commands, profiler)
            for source, src_offset, dst_offset, size in copies:
                encoder.copy_buffer_to_buffer(source, src_offset, staging, dst_offset, size)
            along = self._copy_along(encoder, staging, kept, (*read_along, *read_later) if waits else read_later,
                                     read_later)
        dev.submit(encoder, "plan", before=() if ahead is None else (ahead,))
        self.runs += 1
        upcoming = self._swaps_ahead.next(swaps, key)  # the per-run buffers the next run will likely bind
        if upcoming is not None and profiler is None and len(commands) >= AHEAD_MIN_DISPATCHES:
            self._leave_ahead(PendingAhead(upcoming[1], upcoming[0]), waits)
        if while_running is not None:
            while_running(kept)
        self.host_seconds = time.perf_counter() - began
        data, self.read_along, self.later = self._finish(staging, waits, profiler, run, along, bool(read_later))
        if len(kept) == len(self._outputs):  # (every output on the device: an optimizer update's, in place)
            return dict(zip(self._outputs, map(kept.__getitem__, self._outputs)))
        return {t.name: kept[t.name] if t.name in kept
                else from_device_bytes(run.spec(t), data, self._output_offsets.get(t.name, 0))
                for t in self.plan.outputs}

    def _plan_for(self, sizes, inputs: dict) -> tuple[RunTensors, dict]:
        """The shapes of the inputs and outputs at this run's ``sizes`` (a plan without symbols: its own), and
        ``inputs`` with the sizes' values added (a plan over symbolic sizes)."""
        if self.symbolic is None:
            return self._fixed, inputs
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) != self.symbolic.symbols:
            raise InputError(f"this plan takes the values of {self.symbolic.symbols} symbolic sizes, got {sizes}")
        if any(not 0 <= s <= b for s, b in zip(sizes, self.symbolic.bounds)):
            raise InputError(f"symbolic sizes {sizes} exceed this plan's bounds {self.symbolic.bounds}")
        if self._sized[0] != sizes:  # (the workgroup counts stay in their buffer until the sizes change)
            shapes, counts = self._run_sizes(sizes)
            if self._indirect:
                self.device.write(self._indirect_buffer, 0, np.asarray(counts, np.uint32), "workgroups")
            self._sized = (sizes, RunTensors(dict(zip(self._run_names, shapes))))
        return self._sized[1], {**inputs, SIZES_INPUT: np.asarray(sizes, np.int32)}

    def _resident_outputs(self, into: dict[str, DeviceArray], run) -> dict[str, DeviceArray]:
        """The arrays a run writes its resident outputs into: ``into``'s where given, else new ones; the saved
        outputs' from one set of pool buffers (``BufferSet``)."""
        kept = {name: into[name] if name in into else self._new_output(name, run.shapes[name], t)
                for name, t in self._unsaved.items()}
        if self._saved_set is not None:
            names, sizes, shapes, dtypes = self._saved_set
            kept.update(zip(names, BufferSet(self.device.pool, sizes).arrays(shapes, dtypes)))
        return kept

    def _with_outputs(self, swaps: dict, kept: dict) -> tuple[dict, tuple]:
        """The run's per-run buffers: ``swaps`` (the device inputs', which the run does not change) with the buffers
        of the resident outputs ``kept``, and their ``swaps_key``. Those of the last run where its input swaps were
        the same dict (``DeviceInputs.bind``: a repeated binding) and its outputs' buffers the same, compared in loops
        run by C: a training forward's saved activations come back in the same pool buffers at every step."""
        buffers, names = tuple(map(_BUFFER, kept.values())), tuple(kept)
        last = self._last_swaps
        if last is not None and last[0] is swaps and last[1] == buffers and last[2] == names:
            return last[3], last[4]
        every = dict(swaps)
        every.update(zip(map(_BUFFER, map(self._resident.__getitem__, names)), buffers))
        key = swaps_key(every)
        self._last_swaps = (swaps, buffers, names, every, key)
        return every, key

    def _new_output(self, name: str, shape: tuple, spec: TensorSpec) -> DeviceArray:
        """A resident output's array, in a buffer of its size at the plan's bounds (``spec``'s): the one this output
        had one or two runs before where the pool has it back, so that a run's buffers repeat and its bind groups
        are reused (a KV cache: the cache of two steps before is the one given back; the pool alone deals its
        buffers to the layers in another order, and a generate call's first steps built their groups again)."""
        recent = self._recent_outputs.get(name)
        if recent is None:
            room = self._output_room(spec)
            # a plan without symbols gives the output one shape: its buffer's bytes, known once for every run
            fixed = max(buffer_bytes(shape, spec.dtype), room) if self.symbolic is None else None
            recent = self._recent_outputs[name] = (deque(maxlen=RECENT_OUTPUT_BUFFERS), room, fixed)
        buffers, room, nbytes = recent
        if nbytes is None:
            nbytes = max(_shape_bytes(shape, spec.dtype), room)
        array = DeviceArray.in_pool(self.device.pool, shape, spec.dtype, nbytes, buffers)
        buffers.append(array.buffer)
        return array

    def _upload(self, arrays: dict[str, np.ndarray], swaps: dict) -> None:
        """Write the host inputs into the program's input buffers (not those a device input replaces this run)."""
        for name, offset, parts, block in self._writes:
            if name in swaps:
                continue
            if block is None:
                spec = parts[0][0]
                self.device.write(self._owned[name], offset, arrays[spec.name].reshape(-1), spec.name)
            else:
                for spec, at in parts:
                    block[at : at + spec.nbytes] = arrays[spec.name].reshape(-1).view(np.uint8)
                self.device.write(self._owned[name], offset, block, name)

    def _copy_along(self, encoder, staging, kept: dict, read_along, required=()) -> list[tuple[str, int]]:
        """Record the copies of the outputs ``read_along`` into their staging slots (those that have one; each of
        ``required`` must); returns (name, staging offset) of each."""
        along = [(name, self._along_slot(name)) for name in dict.fromkeys(read_along)]
        missing = [name for name, offset in along if offset is None and name in required]
        if missing:
            raise InputError(f"no room to read {missing} later: {READ_ALONG_BYTES} bytes of outputs at most, taken "
                             f"by {sorted(self._along_slots)}")
        along = [(name, offset) for name, offset in along if offset is not None]
        for name, offset in along:
            encoder.copy_buffer_to_buffer(kept[name].buffer, 0, staging, offset, self.readable_along[name])
        return along

    def _along_slot(self, name: str) -> int | None:
        """The staging offset of ``name``, an output read along: given at its first read, after the read-back and
        the outputs read along before it, while ``READ_ALONG_BYTES`` has room (else None: not read along)."""
        if name not in self.readable_along:
            raise InputError(f"{name!r} cannot be read along: the outputs that can are {sorted(self.readable_along)}")
        offset = self._along_slots.get(name)
        if offset is None and self._along_end + self.readable_along[name] <= self._staging_size:
            offset = self._along_slots[name] = self._along_end
            self._along_end += self.readable_along[name]
        return offset

    def _finish(self, staging, waits: bool, profiler, run: RunTensors, along: list, later: bool) -> tuple:
        """After the submit: wait and read back (host outputs, a profile, ``MEGANEURA_SYNC``), raising a status the
        run set; or leave the run in flight, its status (and the outputs ``along``) copied into ``staging`` (if it
        has one) for the next wait or the host's read. Returns the read-back bytes (none for a run in flight), the
        outputs read along (none for a run in flight) and, if ``later``, the ``LaterRead`` of those outputs."""
        size = self._along_end if along else self._read_size
        if not waits:
            reader = LaterRead(self.device.in_flight, partial(self._read_later, staging, size, run, along)) \
                if later else None
            if staging is not None:
                self.device.in_flight.add(f"run {self.runs} of {self.label}",
                                          reader or partial(self._read_status, staging))
            return b"", {}, reader
        data = self._read_back.read(staging, size)
        if profiler is not None:
            profiler.collect(self.plan.dispatches)
        error = self._status_error(data)
        if error is not None:
            raise error
        values = self._along_values(data, run, along)
        return data, values, LaterRead.done(values) if later else None

    def _along_values(self, data, run: RunTensors, along: list) -> dict[str, np.ndarray]:
        """The outputs copied into a staging buffer at (name, offset) of ``along``, from its bytes ``data``."""
        return {name: from_device_bytes(run.spec(self._outputs[name]), data, offset).copy() for name, offset in along}

    def _read_later(self, staging, size: int, run: RunTensors, along: list) -> tuple:
        """The status error left by a run in flight and its outputs ``along`` (``LaterRead``)."""
        data = self._read_back.read(staging, size)
        try:
            return self._status_error(data), self._along_values(data, run, along)
        finally:
            del data  # the last view of the mapping: the staging buffer goes back

    def _read_status(self, staging) -> KernelStatusError | None:
        """The status error left by a run that was not waited for (its status words copied into ``staging``)."""
        data = self._read_back.read(staging, self._read_size)
        try:
            return self._status_error(data)
        finally:
            del data  # the last view of the mapping: the staging buffer goes back

    def _status_error(self, data) -> KernelStatusError | None:
        return status_error(data, self._status_offsets, self.plan.status_messages)


@lru_cache(maxsize=OUTPUT_SHAPES_KEPT)
def _shape_bytes(shape: tuple, dtype: str) -> int:
    """``buffer_bytes(shape, dtype)``, computed once per shape and dtype of recent runs' outputs: a decode step's
    outputs over symbolic sizes (each layer's KV cache) share one shape, one longer at each step."""
    return buffer_bytes(shape, dtype)
