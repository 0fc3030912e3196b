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
  ``DeviceParameter``, which downloads the device's values into the parameter the first time eager code reads its
  data (printing it, ``state_dict()``, ``torch.save``, an eager forward), once per step. Reading metadata (shape,
  ``.grad``, ``_version``) downloads nothing. An eager write (``load_state_dict``, ``p.mul_``) is uploaded before the
  next plan reads the parameter.
- ``optimizer.state[p]`` holds ``step`` as torch keeps it and the state tensors (``exp_avg``...) as ResidentTensors:
  ``optimizer.state_dict()``, ``torch.save`` and ``load_state_dict`` work unchanged.

Eager code that reads or writes a gradient works on its host copy (``resident``): ``clip_grad_norm_`` downloads the
gradients and its scaled ones are uploaded by the step, correct but with that traffic. Gradient accumulation
(several backward calls before a step) adds on the host the same way.
"""
from __future__ import annotations

import types
from collections import OrderedDict

import torch
from torch import nn

from meganeura.runtime.device import get_device

from . import optimizers
from .params import tensor_from_host, upload_array
from .resident import ResidentTensor
from .role_program import RoleProgram
from .roles import Kind, Role
from .train_trace import trace_update_graph



_DATA_ATTRIBUTES = frozenset({"data", "real", "imag", "T", "mT", "H", "mH"})  # properties that return the data
_METADATA_METHODS = frozenset({
    torch.Tensor.size, torch.Tensor.stride, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
    torch.Tensor.element_size, torch.Tensor.data_ptr, torch.Tensor.is_contiguous, torch.Tensor.__hash__,
    torch.Tensor.requires_grad_, torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__len__, torch.Tensor.storage_offset,
    torch.Tensor.get_device, torch.Tensor._is_view, torch.Tensor.__format__,
})
class _Kept:
    """A kept parameter's link to its device copy: ``stale`` while the device holds values the host has not got."""

    __slots__ = ("store", "stale")

    def __init__(self, store):
        self.store, self.stale = store, False


class _EagerOverride:
    """``DeviceParameter.__torch_function__``: the override eager code meets, and none while dynamo traces (a
    tracing context is active), so that dynamo traces a kept parameter as the plain parameter it compiles: tracing
    through an override that calls the function again with subclass overrides off, dynamo misreads a function with
    a dispatch of its own (F.layer_norm, F.rms_norm, F.batch_norm, F.embedding) and breaks the graph there."""

    def __init__(self, function):
        self.function = function

    def __get__(self, instance, owner):
        if torch._guards.TracingContext.try_get() is not None:
            return torch._C._disabled_torch_function_impl
        return types.MethodType(self.function, owner)


def _torch_function(cls, func, types_, args=(), kwargs=None):
    kwargs = kwargs or {}
    _before_eager(cls, func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class DeviceParameter(nn.Parameter):
    """A parameter of an optimizer kept on the device (``keep_on_device``). Eager code that reads its data first
    downloads the device's values into it, without bumping its version (the device copy stays current)."""

    __torch_function__ = _EagerOverride(_torch_function)

    def __reduce_ex__(self, protocol):  # an ordinary parameter, synced (``.data``), without the device link
        return torch._utils._rebuild_parameter, (self.data, self.requires_grad, OrderedDict())

    def __deepcopy__(self, memo):
        result = memo[id(self)] = nn.Parameter(self.data.clone(), self.requires_grad)
        return result


@torch.compiler.disable  # eager code between graphs runs it as it is, not traced into a graph
def _before_eager(cls, func, args, kwargs) -> None:
    """Before eager code runs ``func``: download the kept parameters among its arguments if it reads their data;
    a parameter whose data are replaced (``p.data = t``) holds the truth on the host from then on."""
    reads = _reads_data(func)
    with torch._C.DisableTorchFunctionSubclass():
        for arg in _flat(args, kwargs):
            kept = getattr(arg, "_meganeura_kept", None) if type(arg) is cls else None
            if kept is None:
                continue
            if reads:
                _sync(arg, kept)
            elif _replaces_data(func):
                kept.stale = False


def _flat(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _descriptor(func) -> str | None:
    """The attribute name of a property's getter or setter (``__get__`` of ``Tensor.data``), else None."""
    if getattr(func, "__name__", None) in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", None)
    return None


def _reads_data(func) -> bool:
    attribute = _descriptor(func)
    if attribute is not None:
        return attribute in _DATA_ATTRIBUTES and func.__name__ == "__get__"
    return func not in _METADATA_METHODS


def _replaces_data(func) -> bool:
    return _descriptor(func) == "data" and func.__name__ == "__set__"


def _sync(p: DeviceParameter, kept: _Kept) -> None:
    """Download ``p``'s device values into it where the host copy is stale (torch functions of subclasses off)."""
    if not kept.stale:
        return
    host = tensor_from_host(kept.store.kept(p).numpy()).reshape(p.shape)
    p.data.copy_(host)  # through .data: the version stays, so the store does not upload it back
    kept.stale = False


def sync_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Download every stale parameter of ``optimizer`` now (eager reads do so by themselves, one at a time)."""
    with torch._C.DisableTorchFunctionSubclass():
        for group in optimizer.param_groups:
            for p in group["params"]:
                kept = getattr(p, "_meganeura_kept", None)
                if kept is not None:
                    _sync(p, kept)


def keep_on_device(optimizer: torch.optim.Optimizer, adapter=None) -> torch.optim.Optimizer:
    """Keep ``optimizer``'s parameters, their gradients and its state on the device, and run its ``step()`` there
    (module docstring). ``adapter`` must be the backend's (default: the same default). Returns ``optimizer``."""
    from .backend import param_store  # (the backend imports this module)

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
        p._meganeura_kept = _Kept(store)
    optimizer._meganeura_step = _DeviceStep(optimizer, store)
    # A method of the optimizer: an LR scheduler re-binds ``step.__func__`` to the optimizer when it wraps it.
    optimizer.step = types.MethodType(_kept_step, optimizer)
    return optimizer


def _kept_step(optimizer: torch.optim.Optimizer, closure=None):
    """``step`` of an optimizer kept on the device: the device update, run inside the replaced ``step``."""
    return optimizer._meganeura_step.step(closure)


class _DeviceStep:
    """The device update of a kept optimizer, one compiled plan per set of parameters with gradients (their shapes,
    dtypes and rows of numbers)."""

    def __init__(self, optimizer: torch.optim.Optimizer, store):
        self.optimizer, self.store, self.device = optimizer, store, store.device
        self.opts = optimizers.structure(optimizer)
        self._replaced = optimizer.step  # torch's (or an LR scheduler's wrapper of it): the device update runs in it
        self._plans: dict[tuple, RoleProgram] = {}

    def step(self, closure=None):
        def update():
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._update()
            return loss

        return optimizers.as_optimizer_step(self.optimizer, update, self._replaced)

    def _update(self) -> None:
        active = [(g, p) for g, group in enumerate(self.optimizer.param_groups) for p in group["params"]
                  if p.grad is not None]
        if not active:
            return
        steps = [self._steps_done(p) + 1 for _, p in active]
        pairs = sorted({(g, s) for (g, _), s in zip(active, steps)})
        row_of = {pair: r for r, pair in enumerate(pairs)}
        rows = [row_of[(g, s)] for (g, _), s in zip(active, steps)]
        params = [p for _, p in active]
        key = tuple((tuple(p.shape), p.dtype, r) for p, r in zip(params, rows))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._compile(params, rows, len(pairs))
        arrays = self._arrays(params)
        hyper = optimizers.hyperparameter_rows(self.optimizer, pairs)
        results = plan.run(lambda role: hyper if role.kind is Kind.HYPER else arrays[role])
        self._take(params, arrays, results)
        for p, s in zip(params, steps):
            self._count(p, s)

    def _compile(self, params: list, rows: list[int], n_rows: int) -> RoleProgram:
        names = [str(i) for i in range(len(params))]
        examples = [torch.empty(p.shape, dtype=p.dtype) for p in params]
        hyper = torch.zeros(n_rows, len(optimizers.SGD_FIELDS if self.opts["kind"] == "sgd" else optimizers.ADAM_FIELDS))
        gm, roles, outputs, constants = trace_update_graph(self.opts, rows, examples, hyper, names)
        example = [constants.get(role, hyper if role.kind is Kind.HYPER else examples[int(role.name)]) for role in roles]
        return RoleProgram(gm, roles, outputs, constants, example, self.device)

    def _arrays(self, params: list) -> dict:
        """Each role's device array for this update: parameters (uploaded first where eager code wrote them),
        gradients (resident, or uploaded), optimizer state (created at a parameter's first update)."""
        arrays = {}
        for i, p in enumerate(params):
            name = str(i)
            arrays[Role.param(name)] = self.store.array(p)
            grad = p.grad
            arrays[Role.grad(name)] = (grad if isinstance(grad, ResidentTensor) and grad.array.device is self.device
                                       else upload_array(self.device, grad.detach()))
            state = self.optimizer.state[p]
            for slot in self.opts["slots"]:
                value = state.get(slot)
                if not (isinstance(value, ResidentTensor) and value.array.device is self.device):
                    value = state[slot] = ResidentTensor(upload_array(
                        self.device, torch.zeros_like(p.detach()) if value is None else value.detach()))
                arrays[Role.state(slot, name)] = value
        return arrays

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

    def _steps_done(self, p) -> int:
        """Updates ``p`` has had: its ``step`` (Adam), or whether SGD made its momentum buffer."""
        state = self.optimizer.state.get(p, {})
        if self.opts["kind"] == "sgd":
            return int(state.get("momentum_buffer") is not None)
        step = state.get("step")
        return 0 if step is None else int(step)

    def _count(self, p, step: int) -> None:
        if self.opts["kind"] != "sgd":
            self.optimizer.state[p]["step"] = torch.tensor(float(step))
