"""What a ``Program`` builds once, before its first run: its resources. The replay that uses them per call
(``run``) is ``meganeura.runtime.program``'s; ``Program`` is this class and the replay in one object, so that a call
reads top to bottom there while what it binds, and when that is built or dropped, is read here.

``ProgramResources.__init__`` checks the plan against the device's limits (``program_checks.check_limits``) and which
of its tensors have roles of their own: outputs named in ``resident_outputs`` stay on the device (written per run
into pool buffers, those also named in ``saved_outputs``, a training forward's saved activations, into one set of
buffers taken and given back as one: ``BufferSet``), outputs stored over an input (``Plan.in_place``), and inputs
named in ``device_only_inputs``, always bound from device arrays: the program allocates no buffer of its own for those.
It then allocates the input, output and status buffers (the arena is the device's, shared by its programs:
``meganeura.runtime.arena``), starts compiling every kernel on background threads (``Device.compile_ahead``), lays
out the input writes and the staging buffer that a run reads back through (the outputs for the host, each status
buffer, then room for a few bytes of outputs kept on the device: ``READ_ALONG_BYTES``) and creates that staging
buffer (``meganeura.runtime.readback``). Param buffers come from outside (``bind_params`` or ``upload_params``),
uploaded while the kernels compile; binding the last of them waits for the kernels (``wait_pipelines``) and raises a
compile error there, then builds the bind groups and the command and copy lists that a run replays (``_resolve``).
``keep_inputs`` binds device inputs for every run from now on (``program_inputs.DeviceInputs.keep``).

What the replay builds over per-run buffers (bind groups and whole command lists over a run's device arrays, cached
by buffer in ``program_recording``; the next run's commands recorded ahead) is dropped here when the buffers under
it change: a param buffer bound anew, or the device's arena replaced by another program's run
(``_use_current_arena``). ``release`` destroys the buffers the program owns; ``stats`` counts what it built.

A plan over symbolic sizes (``Plan.symbols``: a dynamic graph's) is built at its bounds: buffers and bindings sized
for them, with an indirect-dispatch buffer for the workgroup counts that depend on the sizes, which a run writes
(``run_sizes``, ``indirect_slots``: ``meganeura.runtime.program_plan``).
"""
from __future__ import annotations

import numpy as np

from meganeura.kernels.sizes import is_size

from .device import Device
from .errors import InputError
from .native import Indirect
from .plan import SIZES_INPUT, Binding, Plan, TensorSpec
from .program_plan import RunTensors, indirect_slots, pipeline_jobs, run_sizes
from .program_recording import SwapsAhead
from .program_checks import check_limits, require_own_buffers, to_device_array
from .program_inputs import DeviceInputs
from .readback import ReadBackBuffers
from .resident import DeviceArray, buffer_bytes

OWNED_ROLES = ("input", "output", "status")  # and the arena, the device's (``meganeura.runtime.arena``)
BATCH_BYTES = 1 << 16  # inputs of one buffer spanning at most this many bytes go up in a single write
# Outputs kept on the device, of this many bytes in all (step counters: HF's static cache's ``cumulative_length``,
# which HF's masks read on the host before every decode step), may be copied into the staging buffer of a run that
# waits anyway (``run``'s ``read_along``): the host's later read of one then needs no download and no second wait
READ_ALONG_BYTES = 64


class ProgramResources:
    """A ``Program``'s buffers, pipelines, bind groups and params (module docstring); ``Program`` adds the replay."""

    def __init__(self, device: Device, plan: Plan, resident_outputs=(), device_only_inputs=(), saved_outputs=()):
        plan.validate()
        self.device = device
        # A plan over symbolic sizes runs as its plan at its bounds (buffers and bindings sized for them), with the
        # shapes and workgroup counts of each run's sizes (``Program._plan_for``)
        self.symbolic = plan if plan.symbols else None
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
                            for d in plan.dispatches]  # the per-run buffers each dispatch binds (``_with_swaps``)
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

    def _output_room(self, t: TensorSpec) -> int:
        """The most bytes output ``t`` holds in any run: its size at the plan's bounds, or for a plan over symbolic
        sizes the room its buffer has, which the compile sized for the largest value of its size (``sizes.upper``).
        A size that shrinks as a symbol grows (``13 // s``, a convolution over a symbolic stride) is largest at the
        symbol's least value, not at its bound."""
        if self.symbolic is None:
            return t.nbytes
        return max(t.nbytes, self._specs[t.buffer].size - t.offset)

    # ---- bind groups, and the commands and copies a run replays

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
        self._last_swaps = None
        self._uploaded_params = set()
        self._device_inputs.keep({}, {})  # (lets go of the arrays kept bound)
        self._released = True
        if self._arena is not None:
            self._arena.release(self)
        self._ready = False
