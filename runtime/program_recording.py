"""How a ``Program`` records a run's commands: the dispatches in compute passes submitted in parts, the next run's
recorded ahead, timestamped one by one under a profiler, and over per-run buffers (bind groups and whole command lists
cached by buffer identity, so that a loop alternating between the same buffers builds nothing after its first runs). A
run that does not wait leaves the next run's recording for the device's next wait (``PendingAhead``). A mixin of
``program.Program``, called by its run (``Program._run``); it reads what ``program_resources.ProgramResources`` built
(the commands, status buffers, sizes group and bind groups) and keeps the caches over per-run buffers, which the
resources drop when the buffers under them change."""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

from .native import command_encoder, compute_pass, finish, record_dispatches
from .program_plan import submission_parts

SWAPPED_GROUPS_PER_DISPATCH = 8  # bound on cached bind groups over per-run buffers, per dispatch
SWAPPED_COMMAND_LISTS = 4  # command lists kept for the most recent sets of per-run buffers


class Recording:
    """``Program``'s recording of its runs (module docstring)."""

    def _record(self, encoder, commands, profiler):
        """Record the status clears and ``commands`` into ``encoder``: in parts, each but the last submitted as soon
        as it is recorded, or timestamped one by one for ``profiler``. Returns the encoder holding the rest."""
        dev = self.device
        self._clear_status(encoder)
        if profiler is not None:
            self._record_profiled(encoder, commands, profiler)
            return encoder
        for start, end in submission_parts(len(commands)):
            if start:
                dev.submit(encoder, "plan part")
                encoder = command_encoder(dev.wgpu_device)
            compute_pass(encoder, commands[start:end], self._sizes_group)
        return encoder

    def _take_ahead(self, key: tuple, commands, profiler):
        """The command buffer of this run's status clears and ``commands`` recorded ahead by the run before, if it
        was recorded over this run's per-run buffers (``key``: their ``swaps_key``), else None (the run records its
        own, in parts). Where the run before left it for the device's next wait (``PendingAhead``) and no wait has
        come, it is recorded now, in one piece as it would have been: the GPU has the runs before it to work on."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or profiler is not None or ahead[0] != key:
            return None
        return self._record_ahead(commands) if type(ahead) is PendingAhead else ahead[1]

    def _leave_ahead(self, pending: "PendingAhead", waits: bool) -> None:
        """Record the next run ahead (``pending``) now, before this run's wait, or, where this run does not wait, at
        the device's next wait (``InFlight.defer``)."""
        self._ahead = pending
        if waits:
            self._record_pending(pending)
        else:
            self.device.in_flight.defer(self, partial(self._record_pending, pending))

    def _record_pending(self, pending: "PendingAhead") -> None:
        """Record the next run ahead, as ``pending`` (``_ahead`` still) says, unless the program dropped it since
        (a run, a rebind or a new arena: ``_ahead`` is no longer ``pending``), no longer has the commands over its
        per-run buffers (their bind groups rebuilt), or one of those buffers was destroyed since a run bound it (a
        pool emptied, an array released: ``Device.any_destroyed``)."""
        arena = self._arena
        if self._ahead is not pending or arena is not None and self._arena_generation != arena.generation:
            return
        commands = self._commands_over(pending.swaps, pending.key)
        if commands is None or self.device.any_destroyed(pending.swaps.values()):
            self._ahead = None
            return
        with self.device.checked("recording the plan ahead"):
            self._ahead = (pending.key, self._record_ahead(commands))

    def _record_ahead(self, commands):
        """The next run's status clears and ``commands``, recorded into one command buffer now, while the GPU works on
        this run: the next run submits it before its own copies if it binds the same per-run buffers (a rebind
        drops it)."""
        encoder = command_encoder(self.device.wgpu_device)
        self._clear_status(encoder)
        compute_pass(encoder, commands, self._sizes_group)
        return finish(encoder)

    def _clear_status(self, encoder) -> None:
        for name, _, _ in self._status_offsets:
            encoder.clear_buffer(self._owned[name])

    def _record_profiled(self, encoder, commands, profiler) -> None:
        """Each dispatch in a compute pass of its own, its beginning and end timestamped."""
        profiler.prepare(len(commands))
        for i, command in enumerate(commands):
            compute = encoder.begin_compute_pass(timestamp_writes=profiler.timestamp_writes(i))
            if self._sizes_group is not None:
                compute.set_bind_group(1, self._sizes_group)
            record_dispatches(compute, [command])
            compute.end()
        profiler.resolve(encoder, len(commands))

    def _commands_over(self, swaps: dict, key: tuple):
        """The command list over the per-run buffers ``swaps`` (``key``: their ``swaps_key``) if it is built already
        (``_with_swaps`` built it for an earlier run, over buffers live then), else None: what a run records ahead
        for the next."""
        if not swaps:
            return self._commands
        return self._swapped_commands.get(key)

    def _with_swaps(self, swaps: dict, key: tuple):
        """The command list with bind groups over this run's per-run buffers (cached by ``key``, their
        ``swaps_key``)."""
        if not swaps:
            return self._commands
        commands = self._swapped_commands.get(key)
        if commands is not None:
            return commands
        commands = self._build_swapped(swaps)
        if len(self._swapped_commands) >= SWAPPED_COMMAND_LISTS:
            self._swapped_commands.pop(next(iter(self._swapped_commands)))
        self._swapped_commands[key] = commands  # (the key holds the buffers, so that none is another's now)
        return commands

    def _build_swapped(self, swaps: dict) -> list:
        commands = []
        for i, (pipeline, group, workgroups) in enumerate(self._commands):
            names = [n for n in self._swap_names[i] if n in swaps]
            if names:
                key = (i, *(id(swaps[n]) for n in names))
                entry = self._swapped_groups.get(key)
                if entry is None:
                    if len(self._swapped_groups) > SWAPPED_GROUPS_PER_DISPATCH * len(self._commands):
                        self._swapped_groups.clear()
                    bufs = [swaps[n] for n in names]  # kept alive with the group, so their ids stay unique
                    entry = self._swapped_groups[key] = (self._group(self.plan.dispatches[i], swaps), bufs)
                group = entry[0]
            commands.append((pipeline, group, workgroups))
        return commands


class PendingAhead(NamedTuple):
    """The next run to record ahead, over the per-run buffers ``swaps`` (``key``: their ``swaps_key``): a run that
    does not wait leaves it for the device's next wait (``InFlight.defer``), so that recording it is not between
    this run's submit and the next plan's, where the GPU may have nothing queued (a training loop's forward,
    backward and optimizer update submit one after another, and the host waits at the step's end)."""

    key: tuple
    swaps: dict


def swaps_key(swaps: dict) -> tuple:
    """What identifies a run's per-run buffers ``swaps`` (input buffer name -> buffer): its names, then the buffer
    objects themselves, in order. Built once per run and compared, hashed and cached as it is: tuples compare their
    items by identity first, so two keys of the same buffers compare in a loop run by C without a call per buffer,
    and a cached key holds its buffers, so that no other buffer takes one's place (as ids of dead objects may)."""
    return (*swaps, *swaps.values())


class SwapsAhead:
    """Which per-run buffers a program's next run is likely to bind, from the last two runs': none (the program's own
    buffers only); the same as this run's (a static KV cache, updated in place); or, where the buffers alternate
    between two sets, those of the run before (a KV cache that each decode step writes anew: the pool hands each
    output the buffer it had two steps before, ``Program._new_output``). None where no pattern repeats yet (a run
    records the next ahead only on a likely hit: a miss records it twice)."""

    def __init__(self):
        self._last: tuple | None = None  # (swaps, swaps_key) of the last run, and of the run before
        self._before: tuple | None = None

    def next(self, swaps: dict, key: tuple) -> tuple | None:
        """(swaps, swaps_key) the next run will likely bind, after a run that bound ``swaps`` (``key``: their
        ``swaps_key``); None where no pattern repeats yet."""
        last, before = self._last, self._before
        self._before, self._last = last, (swaps, key)
        if not swaps or last is not None and last[1] == key:
            return swaps, key
        if last is not None and before is not None and before[1] == key:
            return last
        return None
