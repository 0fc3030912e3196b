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

- The backend's backward graphs park the gradients of kept parameters on them (``backend.parked_grads``): ``.grad``
  reads each as a ``ResidentTensor`` (``resident``), whose data stay on the device until eager code reads them; the
  step reads the parked arrays, and ``zero_grad`` drops them, without a wrapper.
- ``opt.step()`` runs one device plan that updates every parameter with a gradient, and its optimizer state, in
  place (torch.optim SGD, Adam and AdamW, traced from ``optimizers``, as ``compile_train_step``'s update). It runs as
  the closure of the optimizer's own ``step`` (``optimizers.as_optimizer_step``): LR schedulers, step hooks and the
  profiler see a step, and the learning rate and other numbers are read from ``param_groups`` at every step.
- After a step the device holds the parameters' values. Each parameter keeps its identity; its class becomes
  ``device_tensor.DeviceParameter``, which downloads the device's values into the parameter the first time eager code
  reads its data (printing it, ``state_dict()``, ``torch.save``, an eager forward), once per step. Reading metadata
  (shape, ``.grad``, ``_version``) downloads nothing. An eager write (``load_state_dict``, ``p.mul_``) is uploaded
  before the next plan reads the parameter.
- ``optimizer.state[p]`` holds ``step`` as torch keeps it (a 0-d tensor of its own to eager code; a view of one
  tensor of all the counts, ``bound_update.StepCounts``) and the state tensors (``exp_avg``...) as ResidentTensors:
  ``optimizer.state_dict()``, ``torch.save`` and ``load_state_dict`` work unchanged.
- A step whose parameters, gradients and state are the last step's objects replays the update that step bound,
  with no per-parameter work but identity checks and the reads of what eager code may have written
  (``bound_update``).

Eager code that reads or writes a gradient works on its host copy (``resident``): ``clip_grad_norm_`` downloads the
gradients and its scaled ones are uploaded by the step, correct but with that traffic. Gradient accumulation
(several backward calls before a step) adds on the host the same way.
"""
from __future__ import annotations

import operator
import types
from itertools import chain, repeat

import torch
from torch import nn

from meganeura.runtime.device import get_device

from . import optimizers
from ..backend.entry import param_store
from ..tensors.device_tensor import DeviceParameter, Kept, sync, unpark_grad
from ..tensors.params import upload_array
from ..tensors.read_ahead import ReadAhead
from ..tensors.resident import ResidentTensor
from .bound_update import BoundUpdate
from .role_program import RoleProgram
from .roles import Kind, Role
from .trace import trace_update

_grad_of, _parked_grad_of = operator.attrgetter("grad"), operator.attrgetter("_meganeura_kept.grad")
_kept_link = operator.attrgetter("_meganeura_kept")


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
    read_ahead = ReadAhead(params)  # eager reads after a step (state_dict()) download them in a few waits
    for position, p in enumerate(params):
        p.__class__ = DeviceParameter  # the same object: modules, optimizer state and hooks still find it
        p._meganeura_kept = Kept(store=store, read_ahead=read_ahead, position=position)
    optimizer._meganeura_step = _DeviceStep(optimizer, store, read_ahead)
    # A method of the optimizer: an LR scheduler re-binds ``step.__func__`` to the optimizer when it wraps it.
    optimizer.step = types.MethodType(_kept_step, optimizer)
    optimizer.zero_grad = types.MethodType(_kept_zero_grad, optimizer)
    return optimizer


def _kept_step(optimizer: torch.optim.Optimizer, closure=None):
    """``step`` of an optimizer kept on the device: the device update, run inside the replaced ``step``."""
    return optimizer._meganeura_step.step(closure)


def _kept_zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True):
    """``zero_grad`` of an optimizer kept on the device: the parked gradients dropped (``backend.parked_grads``; to
    be zeroed, given to ``.grad`` first), then torch's, with subclass overrides off (it reads and writes ``.grad``
    only), where each parameter's reads and writes would meet its override (``DeviceParameter``). The ordinary loop's
    (every parameter kept, no ``.grad`` set, ``set_to_none``) drops the parked gradients in loops run by C, and leaves
    out torch's, which would find no ``.grad`` to set to None."""
    if set_to_none and _dropped_parked(list(chain.from_iterable(g["params"] for g in optimizer.param_groups))):
        return None
    for group in optimizer.param_groups:
        for p in group["params"]:
            kept = getattr(p, "_meganeura_kept", None)
            if kept is not None and kept.grad is not None:
                unpark_grad(p, keep=not set_to_none)
    with torch._C.DisableTorchFunctionSubclass():
        return optimizer._meganeura_step.zero_grad(set_to_none)


def _dropped_parked(params: list) -> bool:
    """Drop the parked gradients of ``params`` if each is kept and has no ``.grad`` (nothing else for ``zero_grad``
    to set to None); whether it did."""
    with torch._C.DisableTorchFunctionSubclass():  # (metadata of kept parameters)
        if not all(map(operator.is_, map(_grad_of, params), repeat(None))):
            return False
        try:
            links = list(map(_kept_link, params))
        except AttributeError:  # (a parameter not kept)
            return False
    any(map(setattr, links, repeat("grad"), repeat(None)))  # (setattr returns None: ``any`` runs them all)
    return True


def current_grads(params: list) -> list:
    """The gradient of each of ``params``: a kept parameter's parked one (a ``DeviceArray``) where ``.grad`` is None,
    else ``.grad`` (with the parked one added, ``unpark_grad``)."""
    with torch._C.DisableTorchFunctionSubclass():  # (metadata of kept parameters)
        grads = list(map(_grad_of, params))
        if not any(map(operator.is_not, grads, repeat(None))):  # (the ordinary loop: all parked, read in C loops)
            try:
                return list(map(_parked_grad_of, params))
            except AttributeError:  # (a parameter not kept)
                pass
        for k, p in enumerate(params):
            kept = getattr(p, "_meganeura_kept", None)
            if kept is not None and kept.grad is not None:
                if grads[k] is None:
                    grads[k] = kept.grad
                else:
                    unpark_grad(p)
                    grads[k] = p.grad
    return grads


class _DeviceStep:
    """The device update of a kept optimizer, one compiled plan per set of parameters with gradients (their shapes,
    dtypes and rows of numbers), bound at a step and replayed while it holds (``bound_update``). Its per-step work
    reads parameters' metadata only, with subclass overrides off."""

    def __init__(self, optimizer: torch.optim.Optimizer, store, read_ahead: ReadAhead):
        self.optimizer, self.store, self.device, self.read_ahead = optimizer, store, store.device, read_ahead
        self.update_spec = optimizers.spec(optimizer)
        self._replaced = optimizer.step  # torch's (or an LR scheduler's wrapper of it): the device update runs in it
        self.zero_grad = optimizer.zero_grad  # torch's
        self._plans: dict[tuple, RoleProgram] = {}
        self._roles: list[tuple] = []  # per parameter position: its param, grad and state roles (``_roles_of``)
        self._bound: BoundUpdate | None = None  # the last step's (``bound_update``)

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
        """Run the update: the last step's binding where it holds (``bound_update``), else a new one."""
        params = list(chain.from_iterable(group["params"] for group in self.optimizer.param_groups))
        grads = current_grads(params)
        bound, self._bound = self._bound, None  # (a run that raises leaves no binding behind)
        if bound is None or not bound.holds(params, grads) or not bound.run(grads):
            if all(g is None for g in grads):
                return
            bound = self._bind(params, grads)
            bound.run(grads)  # (runs: it was bound from these parameters' shapes and dtypes)
        self._bound = bound
        self.read_ahead.restart()

    def _bind(self, params: list, grads: list) -> BoundUpdate:
        """Bind the update of the parameters with gradients: their step counts and rows of numbers, the plan
        compiled for their shapes and dtypes, and their optimizer state (made on the device where missing)."""
        groups = [g for g, group in enumerate(self.optimizer.param_groups) for _ in group["params"]]
        active = [(g, p) for g, p, grad in zip(groups, params, grads) if grad is not None]
        states = [self.optimizer.state[p] for _, p in active]  # once a step: a tensor's hash is a Python call
        steps = [self._steps_done(state) + 1 for state in states]
        pairs = sorted({(g, s) for (g, _), s in zip(active, steps)})
        row_of = {pair: r for r, pair in enumerate(pairs)}
        rows = [row_of[(g, s)] for (g, _), s in zip(active, steps)]
        updated = [p for _, p in active]
        for p in updated:
            if type(p) is not DeviceParameter or p._meganeura_kept.store is not self.store:
                raise TypeError(f"a parameter of this optimizer (shape {tuple(p.shape)}) is not kept on its device: "
                                "keep_on_device keeps the parameters the optimizer has when it is called; add "
                                "parameters before calling it")
        key = tuple((tuple(p.shape), p.dtype, r) for p, r in zip(updated, rows))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._compile(updated, rows, len(pairs))
        self._make_state(updated, states)
        return BoundUpdate(self.optimizer, self.store, plan, params, grads, states, self.update_spec, pairs,
                           self._roles_of(len(updated))[:len(updated)], steps)

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

    def _make_state(self, params: list, states: list) -> None:
        """Put each parameter's optimizer state tensors on the device (``states``, by parameter): made at its first
        update, uploaded where eager code set them (``load_state_dict``)."""
        pool_cleared = False
        for p, state in zip(params, states):
            for slot in self.update_spec.slots:
                value = state.get(slot)
                if isinstance(value, ResidentTensor) and value.array.device is self.device:
                    continue
                if not pool_cleared:
                    # The state is made once, after the first backward, whose saved activations wait in the
                    # device's pool for the next forward: they would sit beside the new state at the run's peak
                    # (full-size Whisper-tiny: 165 MiB), so they go first, and the next forward makes them again.
                    self.device.pool.clear()
                    pool_cleared = True
                state[slot] = ResidentTensor(upload_array(
                    self.device, torch.zeros_like(p.detach()) if value is None else value.detach()))

    def _steps_done(self, state: dict) -> int:
        """Updates a parameter with optimizer ``state`` has had: its ``step`` (Adam), or whether SGD made its
        momentum buffer."""
        if self.update_spec.kind == "sgd":
            return int(state.get("momentum_buffer") is not None)
        step = state.get("step")
        return 0 if step is None else int(step)
