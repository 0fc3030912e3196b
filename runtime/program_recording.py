"""How a ``Program`` records a run's commands: the dispatches in compute passes submitted in parts, the next run's
recorded ahead, timestamped one by one under a profiler, and over per-run buffers (bind groups and whole command
lists cached by buffer identity, so that a loop alternating between the same buffers builds nothing after its
first runs). A mixin of ``program.Program``, whose state it reads: its commands, status buffers, sizes group and
caches."""
from __future__ import annotations

import operator

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

    def _record_ahead(self):
        """The next run's status clears and dispatches, recorded into one command buffer now, while the GPU works on
        this run: the next run submits it before its own copies, over the same buffers (a rebind drops it)."""
        encoder = command_encoder(self.device.wgpu_device)
        self._clear_status(encoder)
        compute_pass(encoder, self._commands, self._sizes_group)
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

    def _with_swaps(self, swaps: dict):
        """The command list with bind groups over this run's per-run buffers (cached by buffer identity)."""
        if not swaps:
            return self._commands
        key = tuple(map(id, swaps.values()))
        cached = self._swapped_commands.get(key)
        if cached is not None and all(map(operator.is_, cached[1], swaps.values())):
            return cached[0]
        commands = self._build_swapped(swaps)
        if len(self._swapped_commands) >= SWAPPED_COMMAND_LISTS:
            self._swapped_commands.pop(next(iter(self._swapped_commands)))
        self._swapped_commands[key] = (commands, list(swaps.values()))  # the buffers keep their ids unique
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
