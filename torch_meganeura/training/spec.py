"""What a device training step trains, fixed once when it is built: ``StepSpec``.

``compile_train_step`` builds one (``StepSpec.of``) and hands it to the tracing functions (``train_trace``) and the
segmented step (``train_segments``), which read nothing else of the step: the mutable state (device arrays, step
counts, compiled plans) stays in ``train_step.TrainStep``. ``keep_on_device`` builds the optimizer's part alone
(``optimizers.OptimizerSpec``): the ordinary loop has no loss function or model of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import optimizers


@dataclass(frozen=True)
class StepSpec:
    """A model's parameters and buffers by name, how its loss is computed, and the optimizer's update."""

    model: torch.nn.Module
    loss_fn: Callable  # loss_fn(model, *batch) -> the scalar loss
    optimizer: torch.optim.Optimizer  # its param_groups give each step's numbers (``optimizers.hyperparameters``)
    update: optimizers.OptimizerSpec
    trainable: tuple[str, ...]  # the parameters that require grad, in ``named_parameters`` order
    groups: tuple[int, ...]  # each trainable parameter's param group in ``optimizer``
    frozen: tuple[str, ...]  # the parameters that do not require grad
    buffers: tuple[str, ...]
    accumulation_steps: int  # micro-batches per update
    max_grad_norm: float | None  # the global L2 norm gradients are clipped to, if any

    @classmethod
    def of(cls, model: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer, accumulation_steps: int = 1,
           max_grad_norm: float | None = None) -> "StepSpec":
        """The spec of training ``model`` with ``optimizer``; every parameter that requires grad must be in it."""
        optimizers.check(optimizer)
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        missing = [n for n, p in named if id(p) not in group_of]
        if missing:
            raise ValueError(f"parameters {missing[:5]} require grad but are not in the optimizer")
        return cls(model, loss_fn, optimizer, optimizers.spec(optimizer), tuple(n for n, _ in named),
                   tuple(group_of[id(p)] for _, p in named),
                   tuple(n for n, p in model.named_parameters() if not p.requires_grad),
                   tuple(n for n, _ in model.named_buffers()), accumulation_steps, max_grad_norm)
