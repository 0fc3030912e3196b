"""A graph whose placeholders and outputs are named by ``Role`` (``roles``), compiled once and run on device arrays
by role: the machinery that the resident training step (``train_step``) and the optimizer kept on the device
(``device_optimizer``) share.

Every input is a device array bound as it is, except the ones uploaded at each run (``HOST_KINDS``: the batch and the
step's numbers). Every output stays on the device except the ones read back (``READ_BACK_KINDS``: the loss and
gradients asked for). Each new parameter, optimizer state, buffer or accumulator is stored over the array of its own
role where the plan finds that safe (``meganeura.lowering.in_place``); the others come back as new arrays, or into
the arrays the caller hands back (``run(into=...)``).
"""
from __future__ import annotations

import torch.fx as fx

from ..backend.device_graph import compile_device_graph, feed, program_for, rng_seed
from ..tensors.params import host_form, upload_array
from .roles import Kind, Role

UPDATED_KINDS = (Kind.PARAM, Kind.STATE, Kind.BUFFER, Kind.ACC)  # outputs that replace the input of their role
HOST_KINDS = (Kind.HYPER, Kind.BATCH)
READ_BACK_KINDS = (Kind.LOSS, Kind.GRAD)


class RoleProgram:
    """``gm`` (placeholders named by ``roles``, outputs by ``outputs``) compiled for ``device`` from the example
    values ``example``. ``constants`` (by role) are uploaded once and bound at every run."""

    def __init__(self, gm: fx.GraphModule, roles: list[Role], outputs: list[Role], constants: dict, example: list,
                 device, *, tune: bool = False, in_place: bool = True):
        placeholder = {role: i for i, role in enumerate(roles)}
        updates = {k: placeholder[role] for k, role in enumerate(outputs)
                   if in_place and role in placeholder and role.kind in UPDATED_KINDS}
        graph = compile_device_graph(gm, example, set(), device, tune=tune, in_place=updates)
        self.roles, self.lowered = roles, graph.lowered
        placeholder_of = dict(self.lowered.inputs)
        self.used = frozenset(placeholder_of)  # the placeholders the plan reads
        self.input_names = {role: placeholder_of[i] for i, role in enumerate(roles) if i in placeholder_of}
        if any(kind != "plan" for kind, _ in self.lowered.outputs):
            raise NotImplementedError("a device step's output folded to a constant; cannot keep it on the device")
        self.output_names = dict(zip(outputs, (name for _, name in self.lowered.outputs)))
        stored_over = set(graph.plan.in_place)
        self.swapped = frozenset(role for role, name in self.output_names.items()  # kept in two arrays
                                 if role.kind not in READ_BACK_KINDS and name not in stored_over)
        resident = [name for role, name in self.output_names.items() if role.kind not in READ_BACK_KINDS]
        on_device = [name for role, name in self.input_names.items() if role.kind not in HOST_KINDS]
        self.program = program_for(graph, device, resident, on_device)
        self.constants = {role: upload_array(device, value) for role, value in constants.items()}
        self._constant_inputs = {self.input_names[role]: array for role, array in self.constants.items()
                                 if role in self.input_names}
        self._constants_kept = False  # bound with the inputs ``keep_named`` keeps

    def run(self, value_of, into: dict | None = None) -> dict:
        """Run once, each placeholder fed ``value_of(role)`` (a device array, a resident tensor, or a host tensor for
        ``HOST_KINDS``); outputs of the roles in ``into`` are written into those arrays. Returns the outputs by
        role: device arrays, and numpy arrays for ``READ_BACK_KINDS``."""
        constants = self.constants
        values = [(constants[role] if role in constants else value_of(role)) if i in self.used else None
                  for i, role in enumerate(self.roles)]
        host, device_inputs = feed(self.lowered, values, self.program.device)
        into = {self.output_names[role]: array for role, array in (into or {}).items() if role in self.swapped}
        results = self.program.run(host, device_inputs, into)
        return {role: results[name] for role, name in self.output_names.items()}

    def keep_named(self, device_inputs: dict) -> None:
        """Bind ``device_inputs`` (by plan input name, as ``run_named`` takes them) and the constants for every
        ``run_named`` from now on (``Program.keep_inputs``), whose ``device_inputs`` then give the others; the caller
        keeps those arrays live until it keeps others."""
        self.program.keep_inputs({**device_inputs, **self._constant_inputs})
        self._constants_kept = True

    def run_named(self, device_inputs: dict, host: dict) -> dict:
        """``run`` with the device arrays given by plan input name (``input_names``'s, bound as they are; the
        constants are added here) and the host tensors (``HOST_KINDS``) by role: for a caller that keeps its inputs'
        names from one run to the next (``bound_update``). Returns the outputs by plan output name
        (``output_names``'s): device arrays, and numpy arrays for ``READ_BACK_KINDS``."""
        if not self._constants_kept:
            device_inputs.update(self._constant_inputs)
        host_inputs = {self.input_names[role]: host_form(value) for role, value in host.items()
                       if role in self.input_names}
        if self.lowered.rng_seed:
            host_inputs[self.lowered.rng_seed] = rng_seed()
        return self.program.run(host_inputs, device_inputs)

    def release(self) -> None:
        self.program.release()
        for array in self.constants.values():
            array.release()
