"""A training step over a loss that dynamo cannot capture whole: device plans with the eager glue between them.

``compile_train_step`` first captures the loss as one graph. Where dynamo breaks the graph (a data-dependent
branch such as HF's layerdrop ``if torch.rand([]) < p``, a call it cannot trace), the step runs the loss through
the backend instead: dynamo splits it into graphs, each runs as device plans (forward and, through
``loss.backward()``, backward), and the Python between them runs eagerly, as under ``torch.compile``. Parameters
and optimizer state stay on the device all the same: the backend binds the trainable parameters from the step's
device arrays (``StepParams``), the gradients come back from the backward plans, and the step's update plan (the
one data-parallel steps use) writes the new parameters and state on the device. The eager Python between the graphs
may read parameters (where dynamo cannot resume inside a loop it runs the rest of the frame, layers and all, in
eager PyTorch), so the new parameters are also copied down into the module after each update: per step the
gradients cross the bus twice and the parameters once (down); nothing is uploaded but the batch and the gradients.
A parameter with no gradient (``.grad`` None: unused this step, a layer that layerdrop skipped) is left as it is,
as torch's optimizers leave it, its step count included: each parameter counts its own updates (``TrainStep.
param_steps``), and the update reads a row of hyperparameters per parameter (Adam's bias corrections, SGD's first
momentum step) from those counts.

Buffers that the forward changes (BatchNorm statistics) are written into the torch module by the backend, so in
this mode the module's buffers are the current ones, and the step's buffer arrays are refreshed from them before
they are read (``TrainStep._refresh_buffers``).
"""
from __future__ import annotations

import types
import warnings
import weakref

import torch

from ..backend.entry import BackendContext, backend_with_context
from .dynamo_capture import quiet_logging_for_dynamo
from ..backend.options import Options
from .optimizers import clip_by_global_norm
from ..tensors.params import ParamStore, tensor_from_host, upload_array
from .roles import Mode, Role
from .trace import per_parameter_rows


class StepParams(ParamStore):
    """The backend's parameter store for a segmented step: a trainable parameter's device copy is the step's
    current array for it; other tensors (frozen parameters, buffers) are copied as ``ParamStore`` does. The step
    replaces its arrays after every update, which changes ``generation``: plans bind the new arrays."""

    def __init__(self, owner):
        super().__init__(owner.device)
        self._owner = weakref.ref(owner)
        params = dict(owner.spec.model.named_parameters())
        self._role_of = {id(params[n]): Role.param(n) for n in owner.spec.trainable}

    @property
    def generation(self) -> int:
        return self._owner().arrays_generation

    def buffer(self, t: torch.Tensor, what: str = "parameter"):
        role = self._role_of.get(id(t))
        if role is None:
            return super().buffer(t, what)
        return self._owner()._arrays[role].buffer


class SegmentedLoss:
    """The loss of ``owner`` compiled with the backend (graph breaks allowed), its parameters bound from the step's
    device arrays. ``graph_breaks`` says why the step could not be traced whole, then where dynamo split it."""

    def __init__(self, owner, reason: BaseException):
        self.graph_breaks = [_first_line(reason)]
        context = BackendContext(Options(adapter=owner.adapter, tune=owner.tune), StepParams(owner))
        model, loss_fn = owner.spec.model, owner.spec.loss_fn

        def call(*batch):
            return loss_fn(model, *batch)

        call = types.FunctionType(call.__code__.replace(), call.__globals__, closure=call.__closure__)

        def backend(gm, example_inputs, **kwargs):
            return backend_with_context(gm, example_inputs, context)

        self._compiled = torch.compile(call, backend=backend, dynamic=False)
        self._reported = False

    def loss_and_grads(self, owner, batch: tuple, scale: float) -> torch.Tensor:
        """Run the loss and ``(loss * scale).backward()``: gradients accumulate into the parameters' ``.grad``."""
        torch._dynamo.utils.counters["graph_break"].clear()
        with quiet_logging_for_dynamo():
            loss = self._compiled(*batch)
        (loss * scale).backward()
        if not self._reported:
            self._reported = True
            self.graph_breaks += [r for r in _graph_break_reasons() if r not in self.graph_breaks]
            warnings.warn("meganeura: compile_train_step runs the loss as several device graphs with eager Python "
                          f"between them; it could not be traced as one graph: {'; '.join(self.graph_breaks)}",
                          stacklevel=4)
        return loss.detach()


class SegmentedStep:
    """A step of ``mode`` over a ``SegmentedLoss``, run like a compiled step (``run`` as ``_CompiledStep.run``)."""

    def __init__(self, loss: SegmentedLoss, mode: Mode, owner):
        self.loss, self.mode = loss, mode
        self._owner = weakref.ref(owner)

    def run(self, arrays: dict, batch: tuple, hyper: torch.Tensor, into: dict | None = None):
        owner = self._owner()
        spec = owner.spec
        params = dict(spec.model.named_parameters())
        trainable = [params[n] for n in spec.trainable]
        scale = 1.0 / spec.accumulation_steps if self.mode in (Mode.ACCUMULATE, Mode.APPLY) else 1.0
        if self.mode in (Mode.STEP, Mode.GRADS) or (self.mode is Mode.ACCUMULATE and owner.micro_batches == 0):
            _zero_grads(trainable)  # a first micro-batch starts from no gradient, whatever .grad held
        kept = {n: b.detach().clone() for n, b in spec.model.named_buffers()} if self.mode is Mode.GRADS else {}
        loss = self.loss.loss_and_grads(owner, batch, scale) * scale
        _restore_buffers(spec.model, kept)  # Mode.GRADS changes nothing, BatchNorm statistics included
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach() for p in trainable]
        if self.mode is Mode.ACCUMULATE:
            return loss, {}
        if self.mode is Mode.GRADS:
            if spec.max_grad_norm is not None:
                grads = clip_by_global_norm(grads, spec.max_grad_norm)
            _zero_grads(trainable)
            return loss, {Role.grad(n): g.numpy() for n, g in zip(spec.trainable, grads)}
        untouched = {n for n, p in zip(spec.trainable, trainable) if p.grad is None}  # eager skips them too
        uploaded = {Role.grad(n): upload_array(owner.device, g) for n, g in zip(spec.trainable, grads)}
        _zero_grads(trainable)
        rows = per_parameter_rows(spec, owner.param_steps())
        try:
            _, updated = owner.compiled_step((), Mode.UPDATE).run({**arrays, **uploaded}, (), rows, into)
        finally:
            for array in uploaded.values():
                array.release()
        owner.counted({n for n in spec.trainable if n not in untouched})
        updated = {role: a for role, a in updated.items() if role.name not in untouched}
        _copy_params_down(owner, trainable, updated)
        return loss, updated


def _copy_params_down(owner, trainable, updated: dict) -> None:
    """The eager Python between the graphs may read parameters (dynamo runs a frame it cannot trace in eager
    PyTorch, layers and all): the module's copies are kept current with the device's."""
    with torch.no_grad():
        for n, p in zip(owner.spec.trainable, trainable):
            array = updated.get(Role.param(n))
            if array is not None:
                p.copy_(tensor_from_host(array.numpy()).reshape(p.shape))


def _restore_buffers(model, kept: dict) -> None:
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for n, value in kept.items():
            buffers[n].copy_(value)


def _zero_grads(params) -> None:
    for p in params:
        p.grad = None


def _graph_break_reasons() -> list[str]:
    return [_first_line(reason) for reason in torch._dynamo.utils.counters["graph_break"]]


def _first_line(reason) -> str:
    text = str(reason).strip()
    return text.splitlines()[0][:200] if text else type(reason).__name__
