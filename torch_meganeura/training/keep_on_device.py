"""The ordinary training loop with parameters, gradients and optimizer state kept on the device.

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch_meganeura.keep_on_device(opt)              # the one call: before the first step
    compiled = torch.compile(model, backend="meganeura")
    for x, y in data:
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

What a step then moves between host and device is the batch and what eager code reads (the loss), not the weights:

- The backend's backward graphs return the gradients of kept parameters as ``ResidentTensor``s (``resident``):
  ``.grad`` holds a tensor whose data stay on the device until eager code reads it (``backend.KeptGradients``).
- ``opt.step()`` runs one device plan that updates every parameter with a gradient, and its optimizer state, in
  place (torch.optim SGD, Adam and AdamW, traced from ``optimizers``, as ``compile_train_step``'s update). It runs as
  the closure of the optimizer's own ``step`` (``optimizers.as_optimizer_step``): LR schedulers, step hooks and the
  profiler see a step, and the learning rate and other numbers are read from ``param_groups`` at every step.
- After a step the device holds the parameters' values. Each parameter keeps its identity; its class becomes
  ``device_tensor.DeviceParameter``, which downloads the device's values into the parameter the first time eager code
  reads its data (printing it, ``state_dict()``, ``torch.save``, an eager forward), once per step. Reading metadata
  (shape, ``.grad``, ``_version``) downloads nothing. An eager write (``load_state_dict``, ``p.mul_``) is uploaded
  before the next plan reads the parameter.
- ``optimizer.state[p]`` holds ``step`` as torch keeps it and the state tensors (``exp_avg``...) as ResidentTensors:
  ``optimizer.state_dict()``, ``torch.save`` and ``load_state_dict`` work unchanged.

Eager code that reads or writes a gradient works on its host copy (``resident``): ``clip_grad_norm_`` downloads the
gradients and its scaled ones are uploaded by the step, correct but with that traffic. Gradient accumulation
(several backward calls before a step) adds on the host the same way.
"""
from __future__ import annotations

import types

import torch
from torch import nn

from meganeura.runtime.device import get_device

from . import optimizers
from ..backend.entry import param_store
from ..tensors.device_tensor import DeviceParameter, Kept, sync
from ..tensors.params import upload_array
from ..tensors.resident import ResidentTensor
from .role_program import RoleProgram
from .roles import Kind, Role
from .trace import trace_update



def sync_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Download every stale parameter of ``optimizer`` now (eager reads do so by themselves, one at a time)."""
    sync(p for group in optimizer.param_groups for p in group["params"])


def keep_on_device(optimizer: torch.optim.Optimizer, adapter=None) -> torch.optim.Optimizer:
    """Keep ``optimizer``'s parameters, their gradients and its state on the device, and run its ``step()`` there
    (module docstring). ``adapter`` must be the backend's (default: the same default). Returns ``optimizer``."""
    optimizers.check(optimizer)
    if hasattr(optimizer, "_meganeura_step"):
        raise ValueError("this optimizer is already kept on the device")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        if type(p) is not nn.Parameter or p.device.type != "cpu":
            raise TypeError(f"keep_on_device takes an optimizer over CPU nn.Parameters (what a module holds); got "
                            f"{type(p).__name__} on {p.device}")
    store = param_store(get_device(adapter))
    for p in params:
        p.__class__ = DeviceParameter  # the same object: modules, optimizer state and hooks still find it
        p._meganeura_kept = Kept(store=store)
    optimizer._meganeura_step = _DeviceStep(optimizer, store)
    # A method of the optimizer: an LR scheduler re-binds ``step.__func__`` to the optimizer when it wraps it.
    optimizer.step = types.MethodType(_kept_step, optimizer)
    optimizer.zero_grad = types.MethodType(_kept_zero_grad, optimizer)
    return optimizer


def _kept_step(optimizer: torch.optim.Optimizer, closure=None):
    """``step`` of an optimizer kept on the device: the device update, run inside the replaced ``step``."""
    return optimizer._meganeura_step.step(closure)


def _kept_zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True):
    """``zero_grad`` of an optimizer kept on the device: torch's, with subclass overrides off (it reads and writes
    ``.grad`` only), where each parameter's reads and writes would meet its override (``DeviceParameter``)."""
    with torch._C.DisableTorchFunctionSubclass():
        return optimizer._meganeura_step.zero_grad(set_to_none)


class _DeviceStep:
    """The device update of a kept optimizer, one compiled plan per set of parameters with gradients (their shapes,
    dtypes and rows of numbers). Its per-step work reads parameters' metadata only, with subclass overrides off."""

    def __init__(self, optimizer: torch.optim.Optimizer, store):
        self.optimizer, self.store, self.device = optimizer, store, store.device
        self.update_spec = optimizers.spec(optimizer)
        self._replaced = optimizer.step  # torch's (or an LR scheduler's wrapper of it): the device update runs in it
        self.zero_grad = optimizer.zero_grad  # torch's
        self._plans: dict[tuple, RoleProgram] = {}
        self._roles: list[tuple] = []  # per parameter position: its param, grad and state roles (``_roles_of``)
        self._counted: dict[int, tuple] = {}  # id(step tensor) -> (it, its _version, the count it holds) (``_count``)

    def step(self, closure=None):
        def update():
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            with torch._C.DisableTorchFunctionSubclass():  # (metadata of kept parameters)
                self._update()
            return loss

        return optimizers.as_optimizer_step(self.optimizer, update, self._replaced, user_code=closure is not None)

    def _update(self) -> None:
        active = [(g, p) for g, group in enumerate(self.optimizer.param_groups) for p in group["params"]
                  if p.grad is not None]
        if not active:
            return
        states = [self.optimizer.state[p] for _, p in active]  # once a step: a tensor's hash is a Python call
        steps = [self._steps_done(state) + 1 for state in states]
        pairs = sorted({(g, s) for (g, _), s in zip(active, steps)})
        row_of = {pair: r for r, pair in enumerate(pairs)}
        rows = [row_of[(g, s)] for (g, _), s in zip(active, steps)]
        params = [p for _, p in active]
        key = tuple((tuple(p.shape), p.dtype, r) for p, r in zip(params, rows))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._compile(params, rows, len(pairs))
        arrays = self._arrays(params, states)
        hyper = optimizers.hyperparameter_rows(self.optimizer, pairs)
        results = plan.run(lambda role: hyper if role.kind is Kind.HYPER else arrays[role])
        self._take(params, arrays, results)
        self._count(states, steps)

    def _compile(self, params: list, rows: list[int], n_rows: int) -> RoleProgram:
        names = [str(i) for i in range(len(params))]
        examples = [torch.empty(p.shape, dtype=p.dtype) for p in params]
        hyper = torch.zeros(n_rows, len(self.update_spec.fields))
        gm, roles, outputs, constants = trace_update(self.update_spec, rows, examples, hyper, names)
        example = [constants.get(role, hyper if role.kind is Kind.HYPER else examples[int(role.name)])
                   for role in roles]
        return RoleProgram(gm, roles, outputs, constants, example, self.device)

    def _roles_of(self, n: int) -> list[tuple]:
        """The roles of the first ``n`` parameter positions: (param, grad, ((slot, state role), ...)) each."""
        while len(self._roles) < n:
            name = str(len(self._roles))
            self._roles.append((Role.param(name), Role.grad(name),
                                tuple((slot, Role.state(slot, name)) for slot in self.update_spec.slots)))
        return self._roles

    def _arrays(self, params: list, states: list) -> dict:
        """Each role's device array for this update: parameters (uploaded first where eager code wrote them),
        gradients (resident, or uploaded), optimizer state (``states``, by parameter; created at a parameter's first
        update)."""
        arrays, pool_cleared = {}, False
        for p, state, (param, grad_role, slots) in zip(params, states, self._roles_of(len(params))):
            arrays[param] = self.store.array(p)
            grad = p.grad
            arrays[grad_role] = grad if self._on_device(grad) else upload_array(self.device, grad.detach())
            for slot, role in slots:
                value = state.get(slot)
                if not self._on_device(value):
                    if not pool_cleared:
                        # The state is made once, after the first backward, whose saved activations wait in the
                        # device's pool for the next forward: they would sit beside the new state at the run's peak
                        # (full-size Whisper-tiny: 165 MiB), so they go first, and the next forward makes them again.
                        self.device.pool.clear()
                        pool_cleared = True
                    value = state[slot] = ResidentTensor(upload_array(
                        self.device, torch.zeros_like(p.detach()) if value is None else value.detach()))
                arrays[role] = value
        return arrays

    def _on_device(self, value) -> bool:
        """Whether ``value`` is a tensor kept on this optimizer's device."""
        return isinstance(value, ResidentTensor) and value.array.device is self.device

    def _take(self, params: list, arrays: dict, results: dict) -> None:
        """Take the update's results in: an output stored over its input's array needs nothing; another becomes the
        role's array (the store's copy of the parameter, or the state's ResidentTensor)."""
        for role, array in results.items():
            p = params[int(role.name)]
            if role.kind is Kind.PARAM:
                if array is not arrays[role]:
                    self.store.replace(p, array)
                p._meganeura_kept.stale = True
            elif array is not arrays[role].array:
                self.optimizer.state[p][role.slot] = ResidentTensor(array)
            else:
                arrays[role].written_on_device()

    def _steps_done(self, state: dict) -> int:
        """Updates a parameter with optimizer ``state`` has had: its ``step`` (Adam), or whether SGD made its
        momentum buffer. A step tensor that ``_count`` wrote and nothing wrote since is not read again (a read is a
        call into torch)."""
        if self.update_spec.kind == "sgd":
            return int(state.get("momentum_buffer") is not None)
        step = state.get("step")
        if step is None:
            return 0
        counted = self._counted.get(id(step))
        if counted is not None and counted[0] is step and counted[1] == step._version:
            return counted[2]
        return int(step)

    def _count(self, states: list, steps: list[int]) -> None:
        """Set each parameter's ``step`` (in its optimizer state, ``states``) to its count: its own tensor, written
        in place (as torch's Adam increments it), or a new one where it has none or shares it with another
        parameter."""
        if self.update_spec.kind == "sgd":
            return
        counted = {}
        for state, s in zip(states, steps):
            step = state.get("step")
            if step is None or id(step) in counted:
                step = state["step"] = torch.tensor(float(s))
            else:
                step.fill_(s)  # (0.8 us; a new tensor costs 5, and _foreach_add_ of 0-d tensors 3 a tensor)
            counted[id(step)] = (step, step._version, s)
        self._counted = counted
