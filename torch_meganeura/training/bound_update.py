"""The device update of an optimizer kept on the device (``keep_on_device``), bound once and replayed at every step
whose parameters, gradients and optimizer state are those it was bound from: ``opt.step()``'s per-parameter Python
reduced to identity checks and the reads of what eager code may have written (issue 50).

A step binds (``BoundUpdate``) what it found: every parameter of the param groups in order, which of them have a
gradient, the ``optimizer.state`` mapping and each updated parameter's state dict, the state tensors in them (made
on the device at a parameter's first update), the step counts (``StepCounts``), the compiled plan and the names of
its inputs and outputs. The next step replays the binding while ``holds`` finds nothing of that changed:

- the same parameters in the same param groups, and gradients at the same positions (a parameter replaced or
  added, a gradient set to None: bound again);
- the same ``optimizer.state`` holding the same dicts for the same parameters, and in them the same state tensors
  (``load_state_dict``, a state tensor replaced or deleted: bound again);
- step counts that nothing but the update wrote (a ``step`` replaced or written: bound again, reading them).

What eager code may change in place without that is read at every step, as before: the numbers of ``param_groups``
(learning rate, weight decay, betas: ``optimizers.hyperparameter_rows``), a parameter written on the host (its
version, storage, shape and dtype: ``ParamStore.arrays``; a shape or dtype of its own binds again), a gradient or a
state tensor whose host copy was written (``ResidentTensor``'s twin, uploaded first), a gradient on the host (a
gradient accumulated or clipped by eager code, uploaded).

These checks, and the taking in of the run's results, read every parameter, gradient and state tensor in loops
run by C (``map`` of ``operator`` getters and ``is``), not in a Python loop or call per tensor: a replayed step's
Python calls do not grow with the number of parameters (``tests/bench/test_loop_host_work.py``). The parameters'
device copies are those of the last run while each parameter has the version, storage, shape and dtype it had then
and the store handed out no other array (``ParamStore.generation``); else ``ParamStore.arrays`` reads them. The
state tensors' arrays are those of the last run while none of them got a host copy since (``resident.watch``).
"""
from __future__ import annotations

import operator
from itertools import chain, compress, repeat

import torch

from meganeura.runtime.resident import DeviceArray

from ..lower.registry import logical_dtype
from ..tensors.params import tensor_from_host, upload_array
from ..tensors.resident import ResidentTensor, device_arrays, watch, watched_touches, written_on_device
from .optimizers import OptimizerSpec, hyperparameter_rows
from .roles import Role

_same, _not_none = operator.is_, operator.is_not  # (``_not_none(x, None)``)
_step_of = operator.methodcaller("get", "step")
_version, _data_ptr = operator.attrgetter("_version"), torch.Tensor.data_ptr
_shape, _dtype, _device = operator.attrgetter("shape"), operator.attrgetter("dtype"), operator.attrgetter("device")
_array = operator.attrgetter("array")


class StepCounts:
    """Adam's ``step`` of each updated parameter (``state["step"]``, a 0-d float tensor as torch keeps it) as views
    of one tensor, so that one in-place add counts an update of them all. To eager code each is a tensor of its own
    (its element): ``state_dict``, ``torch.save`` and an eager optimizer that loads them, counting each in place, see
    each parameter's count; writing one steps the version they share, which ``holds`` notices."""

    def __init__(self, states: list[dict], counts: list[int]):
        self.base = torch.tensor([float(c) for c in counts])  # (the default float dtype, as torch.tensor(step))
        self.views = self.base.unbind(0)
        for state, view in zip(states, self.views):
            state["step"] = view
        self.version = self.base._version

    def holds(self, states: list[dict]) -> bool:
        """Whether each of ``states`` still holds its view, and nothing but ``advance`` wrote them."""
        return self.base._version == self.version and all(map(_same, map(_step_of, states), self.views))

    def advance(self) -> None:
        self.base.add_(1)
        self.version = self.base._version


class BoundUpdate:
    """A kept optimizer's update as one step bound it (module docstring): ``run`` while ``holds``.

    ``params``: every parameter of the param groups, in order; ``grads``: their gradients at the binding step;
    ``states``: the state dict of each parameter with a gradient (the state tensors of ``spec.slots`` in them, on
    the device); ``pairs``: the (param group, step count) of each row of numbers the plan reads, the count being that of
    the update to run; ``plan``: the ``RoleProgram`` over the parameters with a gradient, named by their position
    among them (``roles``: (param, grad, ((slot, state role), ...)) each); ``counts``: Adam's step count of each of
    them after the update."""

    def __init__(self, optimizer: torch.optim.Optimizer, store, plan, params: list, grads: list, states: list[dict],
                 spec: OptimizerSpec, pairs: list[tuple[int, int]], roles: list[tuple], counts: list[int]):
        self.optimizer, self.store, self.plan, self.device = optimizer, store, plan, store.device
        self.kind, slots = spec.kind, spec.slots
        self.params, self.sizes = params, [len(group["params"]) for group in optimizer.param_groups]
        self.with_grad = [g is not None for g in grads]
        self.active = None if all(self.with_grad) else list(compress(range(len(params)), self.with_grad))
        self.updated = list(compress(params, self.with_grad))
        self.kept = [p._meganeura_kept for p in self.updated]  # (the link a DeviceParameter keeps for life)
        self.state_map = optimizer.state
        self.state_keys, self.state_values = list(self.state_map), list(self.state_map.values())
        self.states, self.slots = states, slots
        self.state_tensors = [state[slot] for slot in slots for state in states]  # slot by slot
        self.pairs, self.counts, self.first_counts = pairs, None, counts
        self.param_arrays: list | None = None  # the last run's (a new copy is checked against the plan's shapes)
        self.stamps: tuple | None = None  # the updated parameters' ``_stamps`` when ``param_arrays`` was taken
        self.generation = -1  # the store's generation after the last run took its results in
        watch(self.state_tensors)
        self.state_arrays: list | None = None  # the last run's, all left with no host copy, at ``clean_at``
        self.clean_at: int | None = None  # ``watched_touches()`` then (None: some state tensor not written)
        # the (param_arrays, state_arrays) lists whose arrays the plan keeps bound (``RoleProgram.keep_named``): each
        # step binds only the gradients while the step's lists are these ones, unchanged
        self.kept_lists: tuple | None = None
        self.param_specs = [(tuple(p.shape), logical_dtype(p.dtype)) for p in self.updated]
        self._name(roles)

    def _name(self, roles: list[tuple]) -> None:
        """The plan's input names of the device inputs in ``run``'s order (params, grads, state slot by slot), and
        the output names of the parameters and state tensors it writes, with their positions."""
        inputs = self.plan.input_names
        kept = [param for param, _, _ in roles]
        kept += [states[s][1] for s in range(len(self.slots)) for _, _, states in roles]
        grads = [grad for _, grad, _ in roles]
        self.kept_read, self.grad_read = [role in inputs for role in kept], [role in inputs for role in grads]
        self.kept_names = [inputs[role] for role in compress(kept, self.kept_read)]
        self.grad_names = [inputs[role] for role in compress(grads, self.grad_read)]
        outputs, moving = self.plan.output_names, self.plan.swapped
        # (only the outputs the plan does not store over their input's array may come back in another: ``_moved``)
        self.param_moving = _positions_and_names(
            [(k, outputs[param]) for k, (param, _, _) in enumerate(roles) if param in outputs and param in moving])
        state_roles = [states[s][1] for s in range(len(self.slots)) for _, _, states in roles]
        self.state_outputs = _positions_and_names(
            [(i, outputs[role]) for i, role in enumerate(state_roles) if role in outputs])
        self.state_moving = _positions_and_names(
            [(i, outputs[role]) for i, role in enumerate(state_roles) if role in outputs and role in moving])
        self.hyper = Role.hyper()

    def holds(self, params: list, grads: list) -> bool:
        """Whether a step with ``params`` (every parameter of the param groups, in order) and their ``grads`` replays
        this binding (module docstring)."""
        optimizer, state_map = self.optimizer, self.optimizer.state
        return (self.pairs is not None and len(params) == len(self.params) and all(map(_same, params, self.params))
                and [len(group["params"]) for group in optimizer.param_groups] == self.sizes
                and list(map(_not_none, grads, repeat(None))) == self.with_grad
                and state_map is self.state_map and len(state_map) == len(self.state_keys)
                and all(map(_same, state_map, self.state_keys))
                and all(map(_same, state_map.values(), self.state_values))
                and all(map(_same, chain.from_iterable(map(operator.methodcaller("get", slot), self.states)
                                                       for slot in self.slots), self.state_tensors))
                and (self.counts is None or self.counts.holds(self.states)))

    def run(self, grads: list) -> bool:
        """Run the update with ``grads`` (those of ``params``), take its results in and count it. False, having run
        nothing, where a parameter's device copy is no longer of the shape or dtype the plan was compiled for."""
        stamps = _stamps(self.updated)
        if stamps == self.stamps and self.generation == self.store.generation:
            param_arrays = self.param_arrays  # (what ``store.arrays`` would give: nothing written or replaced since)
        else:
            param_arrays = self.store.arrays(self.updated)
            if self.param_arrays is None or not all(map(_same, param_arrays, self.param_arrays)):  # (one replaced)
                if [(a.shape, a.dtype) for a in param_arrays] != self.param_specs:
                    return False
            self.param_arrays, self.stamps = param_arrays, stamps
        if self.active is not None:
            grads = [grads[i] for i in self.active]
        clean = self.clean_at == watched_touches()
        state_arrays = self.state_arrays if clean else device_arrays(self.state_tensors)
        lists = self.kept_lists
        if lists is None or lists[0] is not param_arrays or lists[1] is not state_arrays:
            kept = compress(chain(param_arrays, state_arrays), self.kept_read)
            self.plan.keep_named(dict(zip(self.kept_names, kept)))
            self.kept_lists = (param_arrays, state_arrays)
        hyper = hyperparameter_rows(self.optimizer, self.pairs)
        grads = compress(_grad_arrays(grads, self.device), self.grad_read)
        results = self.plan.run_named(dict(zip(self.grad_names, grads)), {self.hyper: hyper})
        self._take(results, param_arrays, state_arrays, clean)
        self.generation = self.store.generation
        self._count()
        return True

    def _take(self, results: dict, param_arrays: list, state_arrays: list, clean: bool) -> None:
        """Take the run's results in: an output stored over its input's array needs nothing but the host copies
        marked stale (none to mark where the state tensors were ``clean``: no host copy since the last run); another
        becomes the store's copy of the parameter, or the state tensor (here too)."""
        for k, array in _moved(results, self.param_moving, param_arrays):
            self.store.replace(self.updated[k], array)
            param_arrays[k] = array
            self.kept_lists = None  # (the plan keeps the arrays it read: bound again at the next step)
        any(map(setattr, self.kept, repeat("stale"), repeat(True)))  # (setattr returns None: all run, in C)
        tensors, n = self.state_tensors, len(self.states)
        for i, array in _moved(results, self.state_moving, state_arrays):
            slot, k = divmod(i, n)
            self.states[k][self.slots[slot]] = tensors[i] = ResidentTensor(array)
            watch([tensors[i]])
            state_arrays[i] = array
            self.kept_lists = None
        written = self.state_outputs[0]
        if not clean:
            written_on_device(tensors if len(written) == len(tensors) else list(map(tensors.__getitem__, written)))
        every = len(written) == len(tensors)  # (then none has a host copy now)
        self.state_arrays, self.clean_at = (state_arrays, watched_touches()) if every else (None, None)

    def _count(self) -> None:
        """Count the update: Adam's step counts, and the rows' counts of the next update; an SGD update's next
        rows are those of a parameter with its momentum buffer made, and where rows of one group merge (parameters
        that had not all been updated), the binding ends (``pairs`` None: the plan reads other rows)."""
        if self.kind == "sgd":
            following = sorted({(g, 2 if self.slots else 1) for g, _ in self.pairs})
            self.pairs = following if len(following) == len(self.pairs) else None
            return
        if self.counts is None:
            self.counts = StepCounts(self.states, self.first_counts)
        else:
            self.counts.advance()
        self.pairs = [(g, s + 1) for g, s in self.pairs]


def _grad_arrays(grads: list, device) -> list:
    """Each gradient's device array: a parked gradient's (``backend.parked_grads``), a resident tensor's own (its
    host copy uploaded first where eager code wrote it), else an upload of its values (a gradient on the host, or a
    resident tensor of another device)."""
    if all(map(_same, map(type, grads), repeat(DeviceArray))) and all(map(_same, map(_device, grads), repeat(device))):
        return grads
    if (all(map(_same, map(type, grads), repeat(ResidentTensor)))
            and all(map(_same, map(_device, map(_array, grads)), repeat(device)))):
        return device_arrays(grads)
    return [_grad_array(grad, device) for grad in grads]


def _positions_and_names(outputs: list[tuple[int, str]]) -> tuple[list[int], list[str]]:
    """(input positions, output names) of ``outputs`` ((input position, output name) each), as ``_moved`` reads
    them."""
    return [k for k, _ in outputs], [name for _, name in outputs]


def _moved(results: dict, outputs: tuple[list[int], list[str]], inputs: list) -> list[tuple[int, DeviceArray]]:
    """(position, array) of each output (``_positions_and_names``) that the run did not store over its input's
    array in ``inputs``, among those the plan does not store in place (``RoleProgram.swapped``: an output stored in
    place is its input's array, by construction; 483 of 483 a ResNet-50 AdamW step): nearly always none, found so
    in C loops."""
    positions, names = outputs
    arrays = list(map(results.__getitem__, names))
    if all(map(_same, arrays, map(inputs.__getitem__, positions))):
        return []
    return [(k, array) for k, array in zip(positions, arrays) if array is not inputs[k]]


def _stamps(params: list) -> tuple:
    """What ``ParamStore.arrays`` checks of each of ``params`` (version, storage, shape, dtype), read in C loops."""
    with torch._C.DisableTorchFunctionSubclass():  # (metadata of kept parameters: no download)
        return (list(map(_version, params)), list(map(_data_ptr, params)), list(map(_shape, params)),
                list(map(_dtype, params)))


def _grad_array(grad, device):
    if type(grad) is DeviceArray and grad.device is device:
        return grad
    if type(grad) is DeviceArray:
        return upload_array(device, tensor_from_host(grad.numpy()))  # (another device's)
    if isinstance(grad, ResidentTensor) and grad.array.device is device:
        return device_arrays([grad])[0]
    return upload_array(device, grad.detach())

