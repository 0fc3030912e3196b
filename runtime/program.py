"""A plan instantiated on a device: buffers, pipelines and bind groups built once, then replayed by ``run``.

``Program(device, plan)`` checks the plan against the device's limits, allocates the input, output and status buffers
(the arena is the device's, shared by its programs: ``meganeura.runtime.arena``), starts compiling every kernel on
background threads (``Device.compile_ahead``) and prepares the read-back. Param buffers come from outside
(``bind_params`` or ``upload_params``), uploaded while the kernels compile; binding the last of them waits for the
kernels (``wait_pipelines``) and raises a compile error there. ``run`` then uploads the inputs, records the dispatches
into compute passes, copies outputs and status into one staging buffer and maps it: the numpy outputs are views of the
mapped memory (``meganeura.runtime.readback``), not copies. A run with no host outputs (every output resident or stored
in place) returns once it is submitted, and its status is read at the device's next wait
(``meganeura.runtime.in_flight``). A run that waits anyway can bring back, in the same staging buffer, a few bytes of
outputs kept on the device (``run``'s ``read_along``: a step counter that the host reads before the next run), which
would otherwise take a download and a wait of their own; ``read_later`` copies such outputs into the staging buffer
of a run that does not wait, for the host to read a few runs later (``LaterRead``: a decode step's token ids). A
plan of more than a few dozen dispatches is submitted in parts (``submission_parts``): a short first part, so that
the GPU starts while the host records the rest, then parts doubling up to ``SUBMIT_EVERY`` dispatches; the queue
keeps their order, and the host waits once, at the read-back. A run of a plan of ``AHEAD_MIN_DISPATCHES`` or more
then records the next run's dispatches while the GPU works, before it waits (``_record_ahead``), over the per-run
buffers the next run is likely to bind (``SwapsAhead``: none, this run's, or those of the run before where two sets
alternate, as a decode step's KV cache does): the next run submits that command buffer with its copies in one
submit if it binds those buffers, so recording leaves the path from a call to the GPU. While a profiler is attached to
the device (``meganeura.runtime.profiler``), each dispatch gets a timestamped pass of its own instead.

Tensors can also stay on the device (``DeviceArray``): outputs named in ``resident_outputs`` are written into fresh
pool buffers and returned without a read-back (those also named in ``saved_outputs``, a training forward's saved
activations, into one set of buffers taken and given back as one: ``BufferSet``), and ``run(...,
device_inputs=...)`` binds such arrays as inputs without an upload. Inputs named in ``device_only_inputs`` are
always bound that way: the program allocates no buffer of its own for them. ``run(..., into=...)`` writes resident
outputs into arrays the caller hands back (a training step alternating between two sets of weights). Bind groups and
whole command lists over those per-run buffers are cached by buffer, so a loop that alternates between the same
buffers builds nothing after its first runs.

A plan over symbolic sizes (``Plan.symbols``: a dynamic graph's) is built at its bounds, and ``run(...,
sizes=...)`` runs it at a call's sizes: their values go to the plan's sizes input, and the workgroup counts that
depend on them to an indirect-dispatch buffer (written only when the sizes change), so that the recorded commands,
and the next run recorded ahead, stay the same whatever the sizes.
"""
from __future__ import annotations

import time
from collections import deque
from functools import lru_cache, partial

import numpy as np

from meganeura.kernels.sizes import is_size

from .device import Device
from .errors import InputError, KernelStatusError, MeganeuraError
from .native import Indirect, command_encoder
from .plan import SIZES_INPUT, Binding, Plan, TensorSpec
from .program_plan import (AHEAD_MIN_DISPATCHES, RunTensors, indirect_slots, pipeline_jobs, run_sizes)
from .program_recording import Recording, SwapsAhead, same_buffers
from .program_checks import (check_into, check_limits, from_device_bytes,
                             require_own_buffers, status_error, to_device_array)
from .program_inputs import DeviceInputs
from .in_flight import LaterRead
from .readback import ReadBackBuffers
from .resident import BufferSet, DeviceArray, buffer_bytes

OWNED_ROLES = ("input", "output", "status")  # and the arena, the device's (``meganeura.runtime.arena``)
BATCH_BYTES = 1 << 16  # inputs of one buffer spanning at most this many bytes go up in a single write
RECENT_OUTPUT_BUFFERS = 2  # an output that comes back as the next run's input alternates between two buffers
# Outputs kept on the device, of this many bytes in all (step counters: HF's static cache's ``cumulative_length``,
# which HF's masks read on the host before every decode step), may be copied into the staging buffer of a run that
# waits anyway (``run``'s ``read_along``): the host's later read of one then needs no download and no second wait
READ_ALONG_BYTES = 64
OUTPUT_SHAPES_KEPT = 64  # output shapes whose bytes are remembered (``_shape_bytes``): those of recent runs


class Program(Recording):
    """A plan bound to a device; ``run`` replays it with no allocation."""

    def __init__(self, device: Device, plan: Plan, resident_outputs=(), device_only_inputs=(), label: str = "",
                 saved_outputs=()):
        plan.validate()
        self.device = device
        self.label = label or f"a plan of {len(plan.dispatches)} dispatches"  # names the runs in deferred errors
        self.runs = 0  # runs submitted
        # A plan over symbolic sizes runs as its plan at its bounds (buffers and bindings sized for them), with the
        # shapes and workgroup counts of each run's sizes (``_sized``)
        self.symbolic = plan if plan.symbols else None
        self._sized: tuple = ((), None)  # (sizes, the ``RunTensors`` at them) of the last run
        # Dispatches with symbolic workgroup counts read them from this buffer, written when a run's sizes change
        self._indirect, slots = indirect_slots(plan)
        self._indirect_buffer = device.indirect_buffer(12 * len(slots), "workgroups") if slots else None
        if self.symbolic is not None:
            self._run_sizes = run_sizes(plan, slots)
            self._run_names = [t.name for t in plan.inputs + plan.outputs]  # (``run_sizes``'s order)
        self.plan = plan = plan.at(plan.bounds)
        self._fixed = RunTensors({t.name: t.shape for t in plan.inputs + plan.outputs})  # a plan without symbols'
        check_limits(device, plan)
        self._released = False
        self.host_seconds = 0.0  # of the last run: recording and submitting (see run)
        self._specs = {b.name: b for b in plan.buffers}
        self._take_roles(plan, resident_outputs, device_only_inputs, saved_outputs)
        input_specs = self._input_specs
        per_run = {t.buffer for t in self._resident.values()} | {input_specs[n].buffer for n in self._device_only}
        sizes_buffer = f"input:{SIZES_INPUT}" if self.symbolic is not None else None
        self._owned = {
            b.name: (device.uniform_buffer if b.name == sizes_buffer else device.storage_buffer)(b.size, b.name)
            for b in plan.buffers if b.role in OWNED_ROLES and b.name not in per_run
        }
        # group 1 of every pass: the sizes' uniform (``meganeura.kernels.wgsl.SIZES_VAR``)
        self._sizes_group = device.sizes_group(self._owned[sizes_buffer]) if sizes_buffer else None
        arena = next((b for b in plan.buffers if b.role == "arena"), None)
        self._arena = device.arena if arena is not None else None
        if arena is not None:
            self._arena.claim(self, arena.size)
        swappable = per_run | {t.buffer for t in plan.inputs}
        self._swap_names = [tuple(dict.fromkeys(b.buffer for b in d.bindings if b.buffer in swappable))
                            for d in plan.dispatches]
        self._swapped_groups: dict[tuple, tuple] = {}
        self._swapped_commands: dict[tuple, list] = {}
        self._params: dict[str, object] = {}
        self._uploaded_params: set[str] = set()  # param buffers created by upload_params, owned by this program
        self._kernel_jobs = pipeline_jobs(plan)
        device.compile_ahead(self._kernel_jobs)  # taken by wait_pipelines: params upload meanwhile
        self._pipelines: dict[str, object] = {}
        self._writes = self._plan_writes()
        self._plan_readback()
        self._read_back = ReadBackBuffers(device, self._staging_size, "staging")
        self._bind_groups: dict[tuple[Binding, ...], object] = {}
        self._commands: list[tuple] = []
        self._copies: list[tuple] = []
        self._ahead, self._swaps_ahead = None, SwapsAhead()  # the next run recorded ahead (see run), and over what
        # each resident output's latest buffers, its room and, in a plan without symbols, its buffers' size
        self._recent_outputs: dict[str, tuple[deque, int, int | None]] = {}  # (``_new_output``)
        self._ready = False  # True once every param buffer is bound and the commands are built
        if self._arena is not None:
            self._use_current_arena()
        if not self.missing_params():
            self._resolve()

    # ---- construction

    def _take_roles(self, plan: Plan, resident_outputs, device_only_inputs, saved_outputs) -> None:
        """Check and keep which outputs stay on the device (``_resident``), which are stored over an input
        (``_in_place``) and which inputs are bound from device arrays only (``_device_only``); each of those needs a
        buffer of its own (``_alone``), swapped per run; and which resident outputs are saved (``_take_saved``)."""
        stored = [t for t in plan.inputs + plan.params + plan.outputs if t.name not in plan.in_place]
        counts: dict[str, int] = {}
        for t in stored:
            counts[t.buffer] = counts.get(t.buffer, 0) + 1
        self._alone = {t.name for t in stored if not t.offset and counts[t.buffer] == 1}
        self._in_place = dict(plan.in_place)  # output -> the device input it is stored over, returned as that array
        self._resident = {t.name: t for t in plan.outputs
                          if t.name in set(resident_outputs) and t.name not in self._in_place}
        unknown = sorted(set(resident_outputs) - set(self._resident) - set(self._in_place))
        if unknown:
            raise InputError(f"resident outputs {unknown} are not outputs of this plan")
        require_own_buffers(self._resident.values(), self._alone, "a resident output")
        input_specs = self._input_specs = {t.name: t for t in plan.inputs}
        unknown = sorted(set(device_only_inputs) - set(input_specs))
        if unknown:
            raise InputError(f"device-only inputs {unknown} are not inputs of this plan")
        self._device_only = frozenset(device_only_inputs)
        uploaded = sorted(name for name in self._in_place.values() if name not in self._device_only)
        if uploaded:
            raise InputError(f"inputs {uploaded} have outputs stored over them, so they must be device-only inputs")
        require_own_buffers([input_specs[n] for n in self._device_only], self._alone, "a device-only input")
        self._device_inputs = DeviceInputs(input_specs, self._in_place, self._alone, self._device_only, self.device)
        self._take_saved(saved_outputs)

    def _take_saved(self, saved_outputs) -> None:
        """Keep which resident outputs a run writes into one set of pool buffers (``BufferSet``: one acquire and one
        release per run, not one per output), as (names, buffer sizes, shapes, dtypes); the others are
        ``_unsaved``. Only a plan without symbols (one shape per output)."""
        saved = [t for name, t in self._resident.items() if name in set(saved_outputs)]
        self._saved_set = None
        if saved and self.symbolic is None:
            self._saved_set = (tuple(t.name for t in saved),
                               tuple(max(buffer_bytes(t.shape, t.dtype), t.nbytes) for t in saved),
                               [tuple(t.shape) for t in saved], [t.dtype for t in saved])
        names = set(self._saved_set[0]) if self._saved_set else set()
        self._unsaved = {name: t for name, t in self._resident.items() if name not in names}

    def wait_pipelines(self) -> None:
        """Wait for the plan's pipelines, compiling since construction; raises a kernel's compile error. Binding
        the last params (or constructing a plan that has none) waits too."""
        if not self._pipelines:
            built = self.device.pipelines(self._kernel_jobs)
            self._pipelines = {key: pipeline for (_, _, key), pipeline in zip(self._kernel_jobs, built)}

    def _plan_writes(self) -> list[tuple]:
        """Input uploads: (buffer name, offset, [(spec, offset in host block)], host block or None)."""
        by_buffer: dict[str, list[TensorSpec]] = {}
        for t in self.plan.inputs:
            if t.nbytes and t.name not in self._device_only:  # (those are bound, never uploaded)
                by_buffer.setdefault(t.buffer, []).append(t)
        writes = []
        for name, specs in by_buffer.items():
            start = min(t.offset for t in specs)
            span = max(t.offset + t.nbytes for t in specs) - start
            if len(specs) > 1 and span <= BATCH_BYTES:
                writes.append((name, start, [(t, t.offset - start) for t in specs], np.zeros(span, np.uint8)))
            else:
                writes.extend((name, t.offset, [(t, 0)], None) for t in specs)
        return writes

    def _plan_readback(self) -> None:
        """Lay out the staging buffer: each output buffer's span of output tensors, then each status buffer.

        Sets ``_readback`` (copies as buffer name, source offset, staging offset, size), ``_output_offsets``
        (staging offset per output tensor), ``_status_offsets`` and ``_staging_size``.
        """
        spans: dict[str, tuple[int, int]] = {}
        for t in self.plan.outputs:
            if t.nbytes and t.name not in self._resident and t.name not in self._in_place:
                start, end = spans.get(t.buffer, (t.offset // 4 * 4, t.offset + self._output_room(t)))
                spans[t.buffer] = (min(start, t.offset // 4 * 4), max(end, t.offset + self._output_room(t)))
        self._readback, cursor, placed = [], 0, {}
        for name, (start, end) in spans.items():
            self._readback.append((name, start, cursor, end - start))
            placed[name] = cursor - start
            cursor += end - start
        self._output_offsets = {t.name: placed[t.buffer] + t.offset for t in self.plan.outputs
                                if t.nbytes and t.name not in self._resident and t.name not in self._in_place}
        self._status_offsets = []
        for b in self.plan.buffers:
            if b.role == "status":
                self._status_offsets.append((b.name, cursor, b.size))
                self._readback.append((b.name, 0, cursor, b.size))
                cursor += b.size
        self._read_size = max(cursor, 4)  # what a run reads back, but the outputs read along
        self._outputs = {t.name: t for t in self.plan.outputs}
        self.read_along: dict[str, np.ndarray] = {}  # the last run's (``run``); empty if it did not wait
        self.later: LaterRead | None = None  # the last run's outputs ``read_later`` (``run``)
        self.readable_along = self._plan_read_along()
        self._along_slots: dict[str, int] = {}  # staging offset of each output read along so far (``_along_slot``)
        self._along_end = self._read_size
        self._staging_size = self._read_size + min(READ_ALONG_BYTES, sum(self.readable_along.values()))

    def _plan_read_along(self) -> dict[str, int]:
        """Output name -> bytes of the outputs kept on the device (resident, or stored in place) that a run that waits
        anyway may read back too (``READ_ALONG_BYTES``): each in whole words, as buffer copies go, and of a size no
        symbol changes."""
        symbolic = {t.name for t in self.symbolic.outputs if any(map(is_size, t.shape))} if self.symbolic else set()
        return {t.name: t.nbytes for t in self.plan.outputs
                if (t.name in self._resident or t.name in self._in_place) and t.name not in symbolic
                and 0 < t.nbytes <= READ_ALONG_BYTES and t.nbytes % 4 == 0}

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

    def _output_room(self, t: TensorSpec) -> int:
        """The most bytes output ``t`` holds in any run: its size at the plan's bounds, or for a plan over symbolic
        sizes the room its buffer has, which the compile sized for the largest value of its size (``sizes.upper``).
        A size that shrinks as a symbol grows (``13 // s``, a convolution over a symbolic stride) is largest at the
        symbol's least value, not at its bound."""
        if self.symbolic is None:
            return t.nbytes
        return max(t.nbytes, self._specs[t.buffer].size - t.offset)

    def _buffer(self, name: str, swaps: dict | None = None):
        if swaps and name in swaps:
            return swaps[name]
        return self._owned[name] if name in self._owned else self._params[name]

    def _group(self, d, swaps: dict | None = None):
        ranges = [(buffer, b.offset, min(b.size, buffer.size - b.offset))  # (a run's array of symbolic size: its own)
                  for b in d.bindings for buffer in [self._buffer(b.buffer, swaps)]]
        return self.device.bind_group(ranges, d.label or d.kernel)

    def _resolve(self) -> None:
        """Build the missing bind groups, then the command and copy lists that ``run`` replays.

        Dispatches that bind a resident output get their group per run (``_with_swaps``); here None. Groups are
        built over the arena of now: another program's run may have replaced it since this one last ran."""
        if self._arena is not None:
            self._use_current_arena()
        self.wait_pipelines()
        self._commands = []
        indirect = {i: Indirect(self._indirect_buffer, 12 * slot) for i, slot in self._indirect.items()}
        for i, d in enumerate(self.plan.dispatches):
            group = self._bind_groups.get(d.bindings)
            if group is None and not any(b.buffer not in self._owned and b.buffer not in self._params
                                         for b in d.bindings):
                group = self._bind_groups[d.bindings] = self._group(d)
            self._commands.append((self._pipelines[d.kernel], group, indirect.get(i, d.workgroups)))
        self._copies = [(self._buffer(n), src, dst, size) for n, src, dst, size in self._readback]
        if not self._copies:  # nothing to read back: still wait for the GPU through a 4-byte copy
            self._copies = [(self.device.fence, 0, 0, 4)]
        self._ahead = None  # recorded over the old bind groups
        self._ready = True

    def _use_current_arena(self) -> None:
        """Take the device's arena buffer as it is now; what was built over an older one (destroyed when it was
        replaced) is dropped, to be built again by ``_resolve`` or per run."""
        buffer = self._arena.buffer()
        self._arena_generation = self._arena.generation
        if self._owned.get("arena") is buffer:
            return
        self._owned["arena"] = buffer
        for key in [k for k in self._bind_groups if any(b.buffer == "arena" for b in k)]:
            del self._bind_groups[key]
        self._swapped_groups, self._swapped_commands = {}, {}  # built over the old buffer
        self._ahead = None

    # ---- params

    def param_buffers(self) -> list[str]:
        return [b.name for b in self.plan.buffers if b.role == "param"]

    def missing_params(self) -> list[str]:
        return [name for name in self.param_buffers() if name not in self._params]

    def bind_params(self, mapping: dict[str, object]) -> None:
        """Bind GPU buffers to param buffers by name; bind groups over a replaced buffer are rebuilt."""
        params = set(self.param_buffers())
        for name, buffer in mapping.items():
            if name not in params:
                raise InputError(f"{name!r} is not a param buffer of this plan; param buffers are {sorted(params)}")
            if buffer.size < self._specs[name].size:
                raise InputError(
                    f"param buffer {name!r} needs {self._specs[name].size} bytes, the buffer given has {buffer.size}"
                )
        changed = {name for name, buffer in mapping.items() if self._params.get(name) is not buffer}
        if not changed:
            return
        for key in [k for k in self._bind_groups if any(b.buffer in changed for b in k)]:
            del self._bind_groups[key]
        self._swapped_groups, self._swapped_commands = {}, {}  # built over the old buffers
        for name in changed & self._uploaded_params:
            self.device.destroy_buffer(self._params[name])
        self._uploaded_params -= changed
        self._params.update({name: mapping[name] for name in changed})
        if not self.missing_params():
            self._resolve()

    def upload_params(self, arrays: dict[str, np.ndarray]) -> None:
        """Create param buffers from arrays keyed by param tensor name, and bind them."""
        specs = {t.name: t for t in self.plan.params}
        unknown = sorted(set(arrays) - set(specs))
        if unknown:
            raise InputError(f"unknown params {unknown}; this plan's params are {sorted(specs)}")
        touched = {specs[name].buffer for name in arrays}
        missing = sorted(t.name for t in self.plan.params if t.buffer in touched and t.name not in arrays)
        if missing:
            raise InputError(f"params {missing} share a buffer with given params but were not given")
        converted = {name: to_device_array(specs[name], value, "param") for name, value in arrays.items()}
        created = {name: self.device.storage_buffer(self._specs[name].size, name) for name in touched}
        for name, array in converted.items():
            if array.size:
                self.device.write(created[specs[name].buffer], specs[name].offset, array.reshape(-1), name)
        self.bind_params(created)
        self._uploaded_params.update(created)

    def keep_inputs(self, arrays: dict[str, DeviceArray]) -> None:
        """Bind device inputs for every run from now on (``program_inputs.DeviceInputs.keep``): a run's
        ``device_inputs`` then give the others. The caller keeps these arrays live and unreleased until it keeps
        others. Not for a plan over symbolic sizes, whose shapes change from run to run."""
        if self.symbolic is not None:
            raise InputError("a plan over symbolic sizes takes its device inputs at every run")
        self._device_inputs.keep(arrays, self._fixed.shapes)

    # ---- running

    def run(self, inputs: dict[str, np.ndarray], device_inputs: dict[str, DeviceArray] | None = None,
            into: dict[str, DeviceArray] | None = None, sizes=(), read_along=(), read_later=()) -> dict:
        """``_run``; a plan with an arena runs alone on the device (its arena is the device's)."""
        if self._arena is None:
            return self._run(inputs, device_inputs, into, sizes, read_along, read_later)
        with self._arena.running():
            return self._run(inputs, device_inputs, into, sizes, read_along, read_later)

    def _run(self, inputs: dict[str, np.ndarray], device_inputs: dict[str, DeviceArray] | None,
             into: dict[str, DeviceArray] | None, sizes, read_along, read_later) -> dict:
        """Upload ``inputs``, bind ``device_inputs``, replay the plan (in ``submission_parts``), read back.

        Returns the outputs by name: numpy arrays, and for each resident output a ``DeviceArray``: the one ``into``
        gives for its name (overwritten), else a new one; an output stored in place (``Plan.in_place``) is the
        device input's array it overwrote. ``host_seconds`` is then the host's share of the call:
        from its start until the plan is submitted, plus recording the next run ahead, before waiting for the GPU.
        A plan over symbolic sizes takes its symbols' values as ``sizes``. ``read_along``: outputs kept on the device
        (of ``readable_along``) that a run that waits anyway reads back too, into ``read_along`` (the attribute).
        ``read_later``: such outputs that the run copies into its staging buffer whether it waits or not, read when
        the host asks ``later`` (the attribute, a ``LaterRead``): a run in flight is then waited for only then."""
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
        swaps.update({self._resident[name].buffer: array.buffer for name, array in kept.items()})
        kept.update(stored)
        self._upload(arrays, swaps)
        commands = self._with_swaps(swaps)
        profiler = dev.profiler if commands else None
        ahead, self._ahead = self._ahead, None  # (buffers it was recorded over, command buffer)
        ahead = ahead[1] if ahead is not None and profiler is None and same_buffers(ahead[0], swaps) else None
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
        upcoming = self._swaps_ahead.next(swaps)  # the per-run buffers the next run will likely bind
        upcoming_commands = self._commands_over(upcoming) if upcoming is not None else None
        if upcoming_commands is not None and profiler is None and len(commands) >= AHEAD_MIN_DISPATCHES:
            with dev.checked("recording the plan ahead"):
                self._ahead = (upcoming, self._record_ahead(upcoming_commands))
        self.host_seconds = time.perf_counter() - began
        data, self.read_along, self.later = self._finish(staging, waits, profiler, run, along, bool(read_later))
        if len(kept) == len(self._outputs):  # (every output on the device: an optimizer update's, in place)
            return dict(zip(self._outputs, map(kept.__getitem__, self._outputs)))
        return {t.name: kept[t.name] if t.name in kept
                else from_device_bytes(run.spec(t), data, self._output_offsets.get(t.name, 0))
                for t in self.plan.outputs}

    def _resident_outputs(self, into: dict[str, DeviceArray], run) -> dict[str, DeviceArray]:
        """The arrays a run writes its resident outputs into: ``into``'s where given, else new ones; the saved
        outputs' from one set of pool buffers (``BufferSet``)."""
        kept = {name: into[name] if name in into else self._new_output(name, run.shapes[name], t)
                for name, t in self._unsaved.items()}
        if self._saved_set is not None:
            names, sizes, shapes, dtypes = self._saved_set
            kept.update(zip(names, BufferSet(self.device.pool, sizes).arrays(shapes, dtypes)))
        return kept

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

    def _status_error(self, data) -> KernelStatusError | None:
        return status_error(data, self._status_offsets, self.plan.status_messages)

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

    # ---- reporting and teardown

    def stats(self) -> dict:
        by_role: dict[str, int] = {}
        for b in self.plan.buffers:
            by_role[b.role] = by_role.get(b.role, 0) + b.size
        return {
            "dispatches": len(self.plan.dispatches),
            "kernels": len(self._kernel_jobs),
            "bind_groups": len(self._bind_groups),
            "bytes_by_role": by_role,
            "staging_bytes": self._staging_size,
        }

    def release(self) -> None:
        """Destroy the buffers this program owns; the program cannot run afterwards."""
        if self._released:
            return
        owned = [b for name, b in self._owned.items() if name != "arena"]
        owned += [self._params[n] for n in self._uploaded_params]
        owned += [self._indirect_buffer] if self._indirect_buffer is not None else []
        for buffer in owned:
            self.device.destroy_buffer(buffer)
        self._read_back.release()
        self._owned, self._bind_groups, self._commands, self._copies, self._ahead = {}, {}, [], [], None
        self._swapped_groups, self._swapped_commands, self._swaps_ahead = {}, {}, SwapsAhead()
        self._uploaded_params = set()
        self._device_inputs.keep({}, {})  # (lets go of the arrays kept bound)
        self._released = True
        if self._arena is not None:
            self._arena.release(self)
        self._ready = False


@lru_cache(maxsize=OUTPUT_SHAPES_KEPT)
def _shape_bytes(shape: tuple, dtype: str) -> int:
    """``buffer_bytes(shape, dtype)``, computed once per shape and dtype of recent runs' outputs: a decode step's
    outputs over symbolic sizes (each layer's KV cache) share one shape, one longer at each step."""
    return buffer_bytes(shape, dtype)
