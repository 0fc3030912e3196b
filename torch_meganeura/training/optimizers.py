"""torch.optim updates written as functions of tensors, so they trace into a device training plan.

Each supported optimizer (SGD, Adam, AdamW) follows torch.optim's single-tensor update op for op, so a device step
matches an eager step to rounding. torch's CPU kernels round lerp, addcmul and add(alpha=) as fused multiply-adds
(of 1e5 elements, all equal the fma's result, 75-79% the product and sum rounded apart); here product and sum round
apart, as WGSL's fma is not fused on every driver (lavapipe). Fed the same gradients for 8 steps, Adam and AdamW on
lavapipe are 0.82-1.15x torch's distance from float64, and 41-83% of the elements equal torch's.

Per-step numbers (learning rate, weight decay, betas, bias corrections, whether a momentum buffer is new) are not
baked into the plan: ``hyperparameters`` computes them on the host every step from ``optimizer.param_groups`` and the
step count, and the plan reads them from a small input tensor (one row per param group). An LR scheduler, or a change
of weight decay between steps, therefore needs no recompilation.
Options that change the update's structure (nesterov, maximize) are read once at trace time; ``check`` refuses the
ones not implemented (amsgrad) with a clear error.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.optim import optimizer as torch_optimizer

SGD_FIELDS = ("lr", "weight_decay", "momentum", "dampening", "first")
ADAM_FIELDS = ("lr", "weight_decay", "decay", "beta1_weight", "beta2", "one_minus_beta2", "eps", "step_size",
               "bias_correction2_sqrt")


def kind(optimizer: torch.optim.Optimizer) -> str:
    """"sgd", "adam" or "adamw"; raises NotImplementedError for other optimizers and unsupported options."""
    if type(optimizer) is torch.optim.SGD:
        return "sgd"
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for group in optimizer.param_groups:
            if group.get("amsgrad"):
                raise NotImplementedError("meganeura's device optimizer does not implement amsgrad")
            if group.get("decoupled_weight_decay"):
                return "adamw"
        return "adamw" if type(optimizer) is torch.optim.AdamW else "adam"
    raise NotImplementedError(f"meganeura's device training supports torch.optim SGD, Adam and AdamW, not "
                              f"{type(optimizer).__name__}")


def check(optimizer: torch.optim.Optimizer) -> None:
    kind(optimizer)
    maximize = {bool(g.get("maximize", False)) for g in optimizer.param_groups}
    nesterov = {bool(g.get("nesterov", False)) for g in optimizer.param_groups}
    if len(maximize) > 1 or len(nesterov) > 1:
        raise NotImplementedError("param groups differing in maximize or nesterov are not supported")


def state_slots(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """Names of the per-parameter state tensors the update keeps (as torch.optim names them)."""
    k = kind(optimizer)
    if k == "sgd":
        return ("momentum_buffer",) if any(g["momentum"] != 0 for g in optimizer.param_groups) else ()
    return ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class OptimizerSpec:
    """What an optimizer's update is made of, read once from the torch optimizer (``spec``): the options that change
    which ops the update has. Its numbers (learning rate, betas...) are not here: ``hyperparameters`` reads them
    from ``param_groups`` at every step."""

    kind: str  # "sgd", "adam" or "adamw"
    maximize: bool
    nesterov: bool
    slots: tuple[str, ...]  # the per-parameter state tensors, named as torch.optim names them

    @property
    def fields(self) -> tuple[str, ...]:
        """The columns of this update's rows of hyperparameters."""
        return SGD_FIELDS if self.kind == "sgd" else ADAM_FIELDS


def spec(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """``optimizer``'s ``OptimizerSpec`` (``check`` it first)."""
    group = optimizer.param_groups[0]
    return OptimizerSpec(kind(optimizer), bool(group.get("maximize", False)), bool(group.get("nesterov", False)),
                         state_slots(optimizer))


def hyperparameters(optimizer: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """The per-group numbers of update ``step`` (1-based) as a float32 tensor [groups, fields]."""
    return hyperparameter_rows(optimizer, [(g, step) for g in range(len(optimizer.param_groups))])


def hyperparameter_rows(optimizer: torch.optim.Optimizer, rows: list[tuple[int, int]]) -> torch.Tensor:
    """The numbers of each (param group, update step) of ``rows`` as a float32 tensor [rows, fields]: parameters
    that skipped updates (no gradient) are at an earlier step than the rest of their group."""
    k = kind(optimizer)
    out = []
    for group, step in rows:
        g = optimizer.param_groups[group]
        lr = float(g["lr"])
        if k == "sgd":
            out.append([lr, g["weight_decay"], g["momentum"], g["dampening"], 1.0 if step == 1 else 0.0])
            continue
        beta1, beta2 = g["betas"]
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        out.append([lr, g["weight_decay"], 1 - lr * g["weight_decay"], 1 - beta1, beta2, 1 - beta2, g["eps"],
                    lr / bias_correction1, bias_correction2 ** 0.5])
    return torch.tensor(out, dtype=torch.float32)


def group_fields(spec: OptimizerSpec, hyper: torch.Tensor) -> list[dict]:
    """Each row of ``hyperparameters`` (a param group's) or ``hyperparameter_rows`` as named scalars, taken apart
    once per row (traced once, not once per parameter)."""
    return [dict(zip(spec.fields, row.unbind(0))) for row in hyper.unbind(0)]


def update(spec: OptimizerSpec, param, grad, state: list, h: dict) -> tuple[torch.Tensor, list]:
    """One parameter's update; ``h`` is its group's entry of ``group_fields``. Returns (param, state)."""
    if spec.maximize:
        grad = -grad
    if spec.kind == "sgd":
        return _sgd(spec, param, grad, state, h)
    return _adam(spec, param, grad, state, h)


def _with_weight_decay(grad, param, weight_decay):
    """grad + weight_decay * param where weight_decay is not 0: torch skips the term at 0, and 0 * inf is NaN."""
    return torch.where(weight_decay != 0, grad + weight_decay * param, grad)


def _sgd(spec: OptimizerSpec, param, grad, state, h):
    grad = _with_weight_decay(grad, param, h["weight_decay"])
    if spec.slots:
        (buf,) = state
        buf = torch.where(h["first"] > 0.5, grad, buf * h["momentum"] + (1 - h["dampening"]) * grad)
        grad = grad + h["momentum"] * buf if spec.nesterov else buf
        state = [buf]
    return param - h["lr"] * grad, state


def _adam(spec: OptimizerSpec, param, grad, state, h):
    exp_avg, exp_avg_sq = state
    if spec.kind == "adamw":
        param = param * h["decay"]
    else:
        grad = _with_weight_decay(grad, param, h["weight_decay"])
    weight = h["beta1_weight"]  # torch's lerp: start + w (end - start) for w < 0.5, else end - (end - start)(1 - w)
    exp_avg = torch.where(weight < 0.5, exp_avg + weight * (grad - exp_avg), grad - (grad - exp_avg) * (1 - weight))
    exp_avg_sq = exp_avg_sq * h["beta2"] + h["one_minus_beta2"] * grad * grad
    denom = exp_avg_sq.sqrt() / h["bias_correction2_sqrt"] + h["eps"]
    # torch's addcdiv_(exp_avg, denom, value=-step_size) on the CPU: param + (value * exp_avg) / denom, in this order
    return param - h["step_size"] * exp_avg / denom, [exp_avg, exp_avg_sq]


def clip_by_global_norm(grads, max_norm: float):
    """torch.nn.utils.clip_grad_norm_: scale every gradient by min(1, max_norm / (total norm + 1e-6))."""
    norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
    total = torch.linalg.vector_norm(norms)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return [g * coef for g in grads]


def as_optimizer_step(optimizer: torch.optim.Optimizer, update, step=None, user_code: bool = True) -> torch.Tensor:
    """Run ``update()`` (a device update; it returns the loss) as the closure of a call of ``optimizer.step``, so that
    what watches ``optimizer.step`` sees the step taken on the device: the step pre-hooks run before the update (a
    change they make to the param groups applies to it) and the post-hooks after it, an LR scheduler records that
    the optimizer stepped, the profiler times it under ``Optimizer.step#...``. torch's own update then finds no
    gradient and changes nothing: once ``update`` has run, every ``.grad`` of the optimizer's parameters is hidden
    from it, and given back after. SGD, Adam and AdamW (what ``check`` accepts) call the closure first, once.
    ``step`` is the method to call: default ``optimizer.step``, ``device_optimizer`` passes the one it replaced.
    Where ``update`` runs no user code (``user_code``: a closure given to the step) and no step hook is registered,
    torch's step runs with subclass overrides off: it then runs no eager code that reads a parameter's data, and
    its loops over the parameters (``.grad`` reads) would each meet a kept parameter's override
    (``device_tensor.DeviceParameter``). Nothing else then sees the parameters until torch's step returns, and the
    param groups' lists of parameters are hidden from it instead of each gradient: its loops have nothing to visit."""
    quiet = not user_code and not _step_hooks(optimizer)
    hide = _hide_param_lists if quiet else _hide_gradients
    hidden, result = [], []

    def closure() -> torch.Tensor:
        result.append(update())
        hidden.append(hide(optimizer))
        return result[0]

    try:
        with torch._C.DisableTorchFunctionSubclass() if quiet else contextlib.nullcontext():
            (step or optimizer.step)(closure)
    finally:
        for give_back in hidden:
            give_back()
    if not result:
        raise RuntimeError("meganeura runs its device update as the closure of optimizer.step, which did not call "
                           "it: was optimizer.step replaced?")
    return result[0]


def _hide_gradients(optimizer: torch.optim.Optimizer):
    """Set every ``.grad`` of ``optimizer``'s parameters to None; returns the function that gives them back."""
    with torch._C.DisableTorchFunctionSubclass():  # (metadata only)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        links = [getattr(p, "_meganeura_kept", None) for p in params]
        parked = [None if kept is None else kept.grad for kept in links]  # (``backend.parked_grads``)
        for p, kept in zip(params, links):
            p.grad = None
            if kept is not None:
                kept.grad = None

    def give_back() -> None:
        with torch._C.DisableTorchFunctionSubclass():
            for p, grad, kept, array in zip(params, grads, links, parked):
                p.grad = grad
                if kept is not None:
                    kept.grad = array

    return give_back


def _hide_param_lists(optimizer: torch.optim.Optimizer):
    """Empty the lists of parameters of ``optimizer``'s param groups (each group's list replaced by an empty one);
    returns the function that puts them back."""
    lists = [(group, group["params"]) for group in optimizer.param_groups]
    for group, _ in lists:
        group["params"] = []

    def give_back() -> None:
        for group, params in lists:
            group["params"] = params

    return give_back


def _step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step pre- or post-hook (global, or of ``optimizer``) is registered; True where this torch keeps
    them elsewhere than ``torch.optim.optimizer`` reads them from."""
    try:
        return bool(torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks
                    or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks)
    except AttributeError:
        return True
