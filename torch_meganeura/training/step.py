"""Device-resident training: forward, backward and the optimizer update of a step in one plan, no host round trip.

``step = compile_train_step(model, loss_fn, optimizer)`` then ``loss = step(*batch)``. ``loss_fn(model, *batch)``
returns the scalar loss. The first call traces one functional step (``make_fx`` over ``torch.func.grad_and_value``
and the optimizer's update from ``optimizers``, functionalized, with the backend's decompositions) and compiles it
into a plan. Parameters, buffers (BatchNorm statistics) and optimizer state live on the device as ``DeviceArray``s:
every call uploads the batch and a few hyperparameters, runs the plan once and reads back the loss only. The plan
stores each new parameter, optimizer state, buffer and accumulator over its old value where that is safe
(``meganeura.lowering.in_place``: the update is pointwise and the last reader of the old value), so they take no
second copy. A role whose update cannot be stored in place alternates between two buffers instead: the new array
is swapped in and the old one receives the next step's result, so the plan's bind groups are built once for each
and then replayed.

Checkpoints: ``save(path)`` writes parameters, buffers, optimizer state and the step count to one safetensors
file (no pickle); ``load(path)`` restores them into a step built over the same model and optimizer types, so a run
resumed in a fresh process continues exactly. The optimizer's hyperparameters and any LR scheduler are the
caller's (schedulers have plain-number state dicts).

Every update runs inside a call of ``optimizer.step`` (as its closure; torch's own update finds no gradient), so
what watches that method sees it: LR schedulers (no warning that ``lr_scheduler.step()`` came first), step pre- and
post-hooks (a pre-hook's change of the learning rate applies to that update), the profiler.

``max_grad_norm`` clips the gradients by their global L2 norm before the update, as
``torch.nn.utils.clip_grad_norm_`` does. ``accumulation_steps=k`` accumulates gradients over k calls (micro-batches)
in device buffers and updates on every k-th call, like the usual loop of ``(loss / k).backward()`` k times then
``optimizer.step()``: each call's loss is divided by k before differentiation, and the call returns that divided
loss. ``steps`` counts optimizer updates.

Data parallel: given a ``DistributedDataParallel`` (or ``process_group=``), a step runs a gradient plan and an update
plan with the gradients averaged across processes in between (``data_parallel``); ``gradients()`` stays local.

When the torch module is current: the device holds the truth between steps. ``sync_to_module()`` copies
parameters, buffers and optimizer state (with its step count) back into ``model`` and ``optimizer``;
``state_dict()`` syncs first. Until then ``model``'s tensors and ``optimizer.state`` keep the values they had when
the step was compiled or last synced. Changing them directly has no effect on the device copy: call
``load_from_module()`` after such a change.
"""
from __future__ import annotations

import json

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from meganeura.runtime.device import get_device
from meganeura.runtime.resident import DeviceArray

from . import data_parallel, optimizers
from ..backend.device_graph import unsupported_listing
from .dynamo_capture import is_capture_limit
from ..tensors.params import tensor_from_host, upload_array
from ..lower.partition import fallback_ops
from ..tensors.resident import TORCH_DTYPE
from .role_program import RoleProgram
from .roles import Kind, Mode, Role
from .segments import SegmentedLoss, SegmentedStep
from .spec import StepSpec
from .trace import per_parameter_rows, trace_step, trace_update
from ..lower.tuning import tuning_enabled


CHECKPOINT_FORMAT = "meganeura-train-step-1"
LOSS = Role.loss()  # looked up at every call: no function of roles.py runs in a steady step


class TrainStep:
    """A compiled training step over ``model``'s trainable parameters and ``optimizer``'s update."""

    def __init__(self, model: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer, adapter=None,
                 max_grad_norm: float | None = None, accumulation_steps: int = 1, process_group=None,
                 tune: bool | None = None):
        optimizers.check(optimizer)
        model, self.data_parallel = data_parallel.resolve(model, process_group)
        self.spec = StepSpec.of(model, loss_fn, optimizer, accumulation_steps, max_grad_norm)
        if self.data_parallel is not None and self.data_parallel.broadcast_at_start:
            self.data_parallel.broadcast_module(model)
        self.micro_batches = 0  # calls since the last update (always 0 without accumulation)
        self.adapter, self.device = adapter, get_device(adapter)
        self.tune = tuning_enabled(tune)
        self._plans: dict[tuple, _CompiledStep | SegmentedStep] = {}
        self._spare: dict[Role, DeviceArray] = {}  # by role: last step's array, which the next step overwrites
        self._segmented: SegmentedLoss | None = None  # set where dynamo cannot capture the loss whole
        self.arrays_generation = 0  # changes whenever an array of ``_arrays`` is replaced
        self.steps = 0
        self.load_from_module()
        if self.data_parallel is not None:
            params = dict(model.named_parameters())
            self.data_parallel.reducer = data_parallel.GradientReducer(
                self.device, self.data_parallel.group, self.data_parallel.world, list(self.spec.trainable),
                [tuple(params[n].shape) for n in self.spec.trainable])

    @property
    def model(self) -> torch.nn.Module:
        return self.spec.model

    @property
    def loss_fn(self):
        return self.spec.loss_fn

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.spec.optimizer

    @property
    def max_grad_norm(self) -> float | None:
        return self.spec.max_grad_norm

    @property
    def accumulation_steps(self) -> int:
        return self.spec.accumulation_steps

    # ---- device state

    @property
    def graph_breaks(self) -> list[str]:
        """Why dynamo could not capture the loss as one graph (empty where it could): the step then runs it as
        several device graphs with eager Python between them (``train_segments``)."""
        return list(self._segmented.graph_breaks) if self._segmented is not None else []

    def load_from_module(self) -> None:
        """(Re)upload parameters, buffers and optimizer state from the torch module and optimizer."""
        self._release_spares()
        self.arrays_generation += 1
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        self._arrays = {Role.param(n): upload_array(self.device, params[n]) for n in self.spec.trainable}
        self._arrays.update({Role.frozen(n): upload_array(self.device, params[n]) for n in self.spec.frozen})
        self._arrays.update({Role.buffer(n): upload_array(self.device, buffers[n]) for n in self.spec.buffers})
        steps = set()
        for n in self.spec.trainable:
            state = self.optimizer.state.get(params[n], {})
            if "step" in state:
                steps.add(int(state["step"]))
            for slot in self.spec.update.slots:
                value = state.get(slot)
                value = torch.zeros_like(params[n]) if value is None else value
                self._arrays[Role.state(slot, n)] = upload_array(self.device, value)
        if len(steps) > 1:
            raise ValueError(f"optimizer state has different step counts {sorted(steps)} across parameters")
        self.steps = steps.pop() if steps else 0
        self._param_steps = None  # a segmented step's counts per parameter, once they differ (``param_steps``)
        if not self.steps and any(self.optimizer.state.get(params[n], {}).get("momentum_buffer") is not None
                                  for n in self.spec.trainable):
            self.steps = 1  # SGD counts no steps; a momentum buffer means the next step is not its first
        if self.accumulation_steps > 1:
            self._arrays.update({Role.acc(n): upload_array(self.device, torch.zeros_like(params[n]))
                                 for n in self.spec.trainable})
        self.micro_batches = 0

    def _release_spares(self) -> None:
        for array in self._spare.values():
            array.release()
        self._spare = {}

    def sync_to_module(self) -> None:
        """Copy the device's parameters, buffers and optimizer state into the torch module and optimizer."""
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for n in self.spec.trainable:
                params[n].copy_(_download(self._arrays[Role.param(n)], params[n]))
                state = self.optimizer.state[params[n]]
                for slot in self.spec.update.slots:
                    state[slot] = _download(self._arrays[Role.state(slot, n)], params[n]).clone()
                if self.spec.update.kind != "sgd":
                    state["step"] = torch.tensor(float(self.param_steps()[n]))
            for n in self.spec.buffers if self._segmented is None else ():  # (segmented: the module's are current)
                buffers[n].copy_(_download(self._arrays[Role.buffer(n)], buffers[n]))

    def param_steps(self) -> dict[str, int]:
        """Each trainable parameter's count of updates: the step's count, but where a segmented step left a parameter
        with no gradient alone (``train_segments``)."""
        if self._param_steps is None:
            return dict.fromkeys(self.spec.trainable, self.steps)
        return dict(self._param_steps)

    def counted(self, names: set[str]) -> None:
        """The parameters ``names`` were updated once more (a segmented step's update)."""
        steps = self.param_steps()
        self._param_steps = {n: steps[n] + (n in names) for n in self.spec.trainable}

    def _refresh_buffers(self) -> None:
        """Segmented steps change the module's buffers, not the step's arrays: copy them up before reading these."""
        if self._segmented is None:
            return
        buffers = dict(self.model.named_buffers())
        for n in self.spec.buffers:
            self._arrays.pop(Role.buffer(n)).release()
            self._arrays[Role.buffer(n)] = upload_array(self.device, buffers[n])

    def device_weights(self) -> dict[str, np.ndarray]:
        """Parameters and buffers by state-dict name, read from the device; the module is not touched."""
        self._refresh_buffers()
        return {role.name: array.numpy() for role, array in self._arrays.items()
                if role.kind in (Kind.PARAM, Kind.FROZEN, Kind.BUFFER)}

    def state_dict(self) -> dict:
        """The module's state dict, synced from the device first."""
        self.sync_to_module()
        return self.model.state_dict()

    def save(self, path) -> None:
        """Write the device state (parameters, buffers, optimizer state) and the step count to a safetensors file."""
        self._refresh_buffers()
        tensors = {role.key: array.numpy() for role, array in self._arrays.items() if role.kind is not Kind.FROZEN}
        metadata = {"format": CHECKPOINT_FORMAT, "steps": str(self.steps), "micro_batches": str(self.micro_batches),
                    "optimizer": self.spec.update.kind}
        if self._param_steps is not None:
            metadata["param_steps"] = json.dumps(self._param_steps)
        save_file(tensors, str(path), metadata=metadata)

    def load(self, path) -> None:
        """Restore a checkpoint written by ``save`` for the same model and optimizer kind."""
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != CHECKPOINT_FORMAT:
                raise ValueError(f"{path} is not a meganeura training checkpoint (format {meta.get('format')!r})")
            if meta.get("optimizer") != self.spec.update.kind:
                raise ValueError(f"{path} holds {meta.get('optimizer')} state, this step uses {self.spec.update.kind}")
            role_of = {role.key: role for role in self._arrays if role.kind is not Kind.FROZEN}
            expected, found = set(role_of), set(f.keys())
            if found != expected:
                raise ValueError(f"{path} does not match this model: missing {sorted(expected - found)[:5]}, "
                                 f"unexpected {sorted(found - expected)[:5]}")
            loaded = {role_of[key]: f.get_tensor(key) for key in sorted(found)}
        for role, value in loaded.items():
            old = self._arrays[role]
            if tuple(value.shape) != old.shape:
                raise ValueError(f"{path}: {role} has shape {tuple(value.shape)}, the model's is {old.shape}")
        self._release_spares()
        self.arrays_generation += 1
        for role, value in loaded.items():
            dtype = self._arrays[role].dtype
            self._arrays.pop(role).release()
            self._arrays[role] = DeviceArray.upload(self.device, value, dtype)
        if self._segmented is not None:  # the module's buffers are the segmented step's: restore them there
            buffers = dict(self.model.named_buffers())
            with torch.no_grad():
                for n in self.spec.buffers:
                    buffers[n].copy_(_download(self._arrays[Role.buffer(n)], buffers[n]))
        self.steps = int(meta["steps"])
        self._param_steps = json.loads(meta["param_steps"]) if "param_steps" in meta else None
        self.micro_batches = int(meta.get("micro_batches", "0"))

    # ---- stepping

    def compiled_step(self, batch: tuple, mode: Mode) -> "_CompiledStep | SegmentedStep":
        """The step of ``mode`` for this batch signature: one captured plan, or, once dynamo could not capture the
        loss whole, the loss through the backend beside an update plan (``train_segments``)."""
        key = (mode, *((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in batch))
        compiled = self._plans.get(key)
        if compiled is None:
            compiled = self._plans[key] = self._new_step(batch, mode)
        return compiled

    def _new_step(self, batch: tuple, mode: Mode) -> "_CompiledStep | SegmentedStep":
        if self._segmented is None or mode is Mode.UPDATE:
            try:
                return _CompiledStep(self, batch, mode)
            except Exception as err:  # noqa: BLE001 - is_capture_limit picks what the backend can run instead
                if not is_capture_limit(err):
                    raise
                if self.data_parallel is not None or mode is Mode.UPDATE:
                    raise NotImplementedError("a data-parallel compile_train_step needs a loss that dynamo "
                                              f"captures as one graph: {err}") from err
                self._segmented = SegmentedLoss(self, err)
        return SegmentedStep(self._segmented, mode, self)

    def trace_update(self):
        """The graph of the update alone (``train_trace.trace_update``): a data-parallel step's, whose parameters
        share their group's step count, or a segmented step's, whose parameters count their own (a row each)."""
        params = dict(self.model.named_parameters())
        if self._segmented is not None:
            rows, hyper = list(range(len(self.spec.trainable))), per_parameter_rows(self.spec)
        else:
            rows, hyper = list(self.spec.groups), self._hyper(max(self.steps, 1))
        return trace_update(self.spec.update, rows, [params[n].detach() for n in self.spec.trainable], hyper,
                            list(self.spec.trainable), self.max_grad_norm)

    def gradients(self, *batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and every trainable parameter's gradient (clipped if ``max_grad_norm``) at the current device
        state, changing nothing: no update, no BatchNorm statistics. For inspection and correctness checks."""
        loss, grads = self.compiled_step(batch, Mode.GRADS).run(self._arrays, batch, self._hyper(self.steps + 1))
        params = dict(self.model.named_parameters())
        return loss, {role.name: tensor_from_host(np.asarray(g).copy()).reshape(params[role.name].shape)
                      for role, g in grads.items()}

    def release_plans(self, mode: Mode | None = None) -> None:
        """Give back the device memory of the compiled plans (of ``mode`` only, e.g. ``Mode.GRADS`` after a check
        with ``gradients()``): their arenas, outputs and staging. Parameters and optimizer state stay; a later call
        compiles its plan again (from the persistent plan cache where it is on)."""
        for key in [key for key in self._plans if mode is None or key[0] is mode]:
            compiled = self._plans.pop(key)
            if isinstance(compiled, _CompiledStep):
                compiled.release()

    def _hyper(self, step: int) -> torch.Tensor:
        return optimizers.hyperparameters(self.optimizer, step)

    def __call__(self, *batch) -> torch.Tensor:
        if self.data_parallel is not None:
            return self._data_parallel_call(batch)
        micro_batches = self.micro_batches + 1
        if self.accumulation_steps == 1:
            mode = Mode.STEP
        else:
            mode = Mode.APPLY if micro_batches == self.accumulation_steps else Mode.ACCUMULATE
        compiled = self.compiled_step(batch, mode)
        steps = self.steps if mode is Mode.ACCUMULATE else self.steps + 1

        def run() -> torch.Tensor:  # the counts move only once the step has run (a failed check raises before)
            loss, updated = compiled.run(self._arrays, batch, self._hyper(max(steps, 1)), self._spare)
            self._swap_in(updated)
            self.steps, self.micro_batches = steps, micro_batches if mode is Mode.ACCUMULATE else 0
            return loss

        if mode is Mode.ACCUMULATE:
            return run()
        return optimizers.as_optimizer_step(self.optimizer, run)

    def _data_parallel_call(self, batch: tuple) -> torch.Tensor:
        """A call of a data-parallel step (see ``data_parallel``): local gradients, all-reduce, update."""
        dp = self.data_parallel
        if self.micro_batches == 0:
            local = self.compiled_step(batch, Mode.LOCAL)  # compiled first: it says which buffers the forward changes
            dp.broadcast_arrays([self._arrays[r] for r in local.state_outputs if r.kind is Kind.BUFFER])
        self.micro_batches += 1
        if self.micro_batches < self.accumulation_steps:
            loss, updated = self.compiled_step(batch, Mode.ACCUMULATE).run(self._arrays, batch, self._hyper(1),
                                                                           self._spare)
            self._swap_in(updated)
            return loss
        self.micro_batches = 0
        self.steps += 1
        loss, outputs = self.compiled_step(batch, Mode.LOCAL).run(self._arrays, batch, self._hyper(self.steps),
                                                              self._spare)
        grads = {role.name: outputs.pop(role) for role in list(outputs) if role.kind is Kind.GRAD}
        self._swap_in(outputs)
        averaged = dp.reducer.reduce(grads)
        update = self.compiled_step((), Mode.UPDATE)

        def run() -> torch.Tensor:
            arrays = {**self._arrays, **{Role.grad(n): a for n, a in averaged.items()}}
            _, updated = update.run(arrays, (), self._hyper(self.steps), self._spare)
            self._swap_in(updated)
            return loss

        return optimizers.as_optimizer_step(self.optimizer, run)

    def _swap_in(self, updated: dict) -> None:
        """Take ``updated`` arrays in; each replaced array receives the next step's output of its role, so the plan
        alternates between two buffers per role and replays cached bind groups. An array updated in place (the
        plan stored the role's new value over its old one) stays, with no spare."""
        for role, array in updated.items():
            if array is self._arrays[role]:
                continue
            self._spare[role] = self._arrays[role]
            self._arrays[role] = array
        self.arrays_generation += 1


def compile_train_step(model: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer, *,
                       max_grad_norm: float | None = None, accumulation_steps: int = 1, adapter=None,
                       process_group=None, tune: bool | None = None) -> TrainStep:
    """A training step that keeps ``model``'s parameters and ``optimizer``'s state on the device (module docstring).
    ``tune`` times matmul variants on the device, as the backend's option of that name does (``tuning.py``).

    Data parallel (``data_parallel``) when ``model`` is a ``DistributedDataParallel`` or ``process_group`` is
    given: ``loss_fn`` then receives DDP's ``module``, and gradients are averaged across the group every step."""
    return TrainStep(model, loss_fn, optimizer, adapter, max_grad_norm, accumulation_steps, process_group, tune)


class _CompiledStep:
    """The traced and compiled step for one batch signature and ``mode`` (see ``train_trace.trace_step``). The loss
    (and the gradients in ``Mode.GRADS``) are read back; every other output stays on the device."""

    def __init__(self, owner: TrainStep, batch: tuple, mode: Mode):  # no reference to owner: no cycle
        traced = owner.trace_update() if mode is Mode.UPDATE else trace_step(owner.spec, batch, mode)
        if mode is not Mode.UPDATE and fallback_ops(traced[0]):  # a backward formula with no lowering: differentiate
            traced = trace_step(owner.spec, batch, mode, decompose_all=True)  # the decomposed ops (less accurate)
        gm, roles, outputs, constants = traced
        unsupported = fallback_ops(gm)
        if unsupported:
            raise NotImplementedError("compile_train_step needs every op on the device; these are not: "
                                      + unsupported_listing(unsupported))
        example = [constants[role] if role in constants else _example(owner, role, batch) for role in roles]
        # A segmented step's update drops the new values of parameters that got no gradient (eager skips them):
        # their old arrays must survive it, so it stores nothing in place.
        segmented = mode is Mode.UPDATE and owner._segmented is not None
        self.plan = RoleProgram(gm, roles, outputs, constants, example, owner.device, tune=owner.tune,
                                in_place=not segmented)
        self.state_outputs = [role for role in outputs if role is not LOSS]

    @property
    def program(self):
        return self.plan.program

    def run(self, arrays: dict, batch: tuple, hyper: torch.Tensor, into: dict | None = None):
        """Run the step on the state ``arrays``; outputs of the roles in ``into`` overwrite those arrays."""
        def value_of(role: Role):
            if role.kind is Kind.BATCH:
                return batch[role.index]
            return hyper if role.kind is Kind.HYPER else arrays[role]

        results = self.plan.run(value_of, into)
        loss = results.pop(LOSS, None)
        return (None if loss is None else tensor_from_host(np.asarray(loss).copy())), results

    def release(self) -> None:
        self.plan.release()


def _example(owner: TrainStep, role: Role, batch: tuple):
    if role.kind is Kind.BATCH:
        return batch[role.index]
    if role.kind is Kind.HYPER:  # (a segmented step's update: a row per parameter, ``trace_update``)
        return (per_parameter_rows(owner.spec) if owner._segmented is not None
                else optimizers.hyperparameters(owner.optimizer, 1))
    if role.kind is Kind.GRAD:
        param = dict(owner.model.named_parameters())[role.name]
        return torch.empty(param.shape, dtype=param.dtype)
    array = owner._arrays[role]
    return torch.empty(array.shape, dtype=TORCH_DTYPE[array.dtype])


def _download(array: DeviceArray, like: torch.Tensor) -> torch.Tensor:
    return tensor_from_host(array.numpy()).to(like.dtype).reshape(like.shape)

