"""Gradients of kept parameters parked on the parameter instead of crossing autograd (issue 50).

A training backward whose forward ran with every parameter kept on the device (``KeptGradients``) gets each kept
parameter's gradient from its device partition as a ``DeviceArray``. Handed to autograd, each became a
``ResidentTensor`` wrapper, a Python ``__torch_dispatch__`` call for AccumulateGrad's ``detach`` (another wrapper),
and the engine's accumulation work: per parameter, at every step. Instead the compiled backward returns None for it
(autograd accumulates nothing) and parks the array on the parameter (``Kept.grad``), where the engine would have
stored it:

- ``p.grad`` then stands for it: the parameter's override (``device_tensor``) gives it to ``.grad`` as a
  ``ResidentTensor`` at the first read (``unpark_grad``), and a write of ``.grad`` replaces it. Eager code sees the
  gradient autograd would have stored; the kept optimizer's step and ``zero_grad`` read and drop the arrays
  without a wrapper (``keep_on_device``).
- Only where autograd would store it as it is: the engine runs this parameter's accumulator in this backward
  (``.backward()``, or ``backward(inputs=...)`` naming it; not ``torch.autograd.grad``, which captures gradients),
  the parameter has no gradient yet (nothing to add to: a second backward accumulates as before, the parked one
  given to ``.grad`` first), no hook on its gradient, and no process group (DDP) is set up. A gradient autograd
  stores besides in the same backward (an eager term on the parameter) is added to the parked one when it is read.
"""
from __future__ import annotations

import operator
from itertools import compress, repeat

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from meganeura.runtime.resident import DeviceArray

from ..tensors.device_tensor import unpark_grad
from ..tensors.resident import ResidentTensor
from .bound_plan import taker

_KEPT, _ACCUMULATOR = operator.attrgetter("_meganeura_kept"), operator.attrgetter("accumulator")
_GRAD, _PARKED = operator.attrgetter("grad"), operator.attrgetter("_meganeura_kept.grad")
_HOOKS, _POST_HOOKS = operator.attrgetter("_backward_hooks"), operator.attrgetter("_post_accumulate_grad_hooks")

_executes = torch._C._will_engine_execute_node


class GradientParking:
    """Parks a backward's gradients of kept parameters (module docstring). ``static``: the backward's output positions
    that are gradients of the forward's static inputs, in order (those ``kept.params`` holds: ``KeptGradients``)."""

    def __init__(self, static: list[int], kept):
        self.slots, self.kept = list(zip(static, range(len(static)))), kept
        self.positions = static
        self._gradients = taker(static)  # (the backward's outputs at ``positions``, in C)

    def __call__(self, result) -> list:
        """``result`` (the backward's outputs) with each kept gradient parked (None) or as a ``ResidentTensor``."""
        result, params = list(result), self.kept.params
        if self.positions and len(params) == len(self.positions) and self._parked_all(result, params):
            return result
        slots = [(i, params[k]) for i, k in self.slots if type(result[i]) is DeviceArray]
        if not slots:
            return result
        with torch._C.DisableTorchFunctionSubclass():  # (metadata of kept parameters)
            parks = _parkable([p for _, p in slots])
            for (i, p), park in zip(slots, parks):
                if park:
                    p._meganeura_kept.grad, result[i] = result[i], None
                else:
                    unpark_grad(p)  # (a second backward: autograd adds to the first's gradient)
                    result[i] = ResidentTensor(result[i])
        return result

    def _parked_all(self, result: list, params) -> bool:
        """Park every gradient at once where each is a device array (the positions of parameters without one, a
        buffer's, hold None) and every parameter with one may have it parked (the ordinary loop's backward), in loops
        run by C, setting their positions of ``result`` to None; whether it did (else nothing changed)."""
        gradients = self._gradients(result)
        given = list(map(operator.is_not, gradients, repeat(None)))
        gradients = list(compress(gradients, given))
        if not all(map(operator.is_, map(type, gradients), repeat(DeviceArray))):
            return False
        params = list(compress(params, given))
        with torch._C.DisableTorchFunctionSubclass():  # (metadata of kept parameters)
            if not _all_parkable(params):
                return False
            any(map(setattr, map(_KEPT, params), repeat("grad"), gradients))  # (setattr returns None: all run)
        any(map(result.__setitem__, compress(self.positions, given), repeat(None)))
        return True


def _all_parkable(params) -> bool:
    """``all(_parkable(params))``, read in loops run by C (call with subclass overrides off)."""
    if dist.is_available() and dist.is_initialized():
        return False
    try:
        runs = all(map(_executes, _accumulators(params)))
    except (RuntimeError, AttributeError):  # (``torch.autograd.grad``, as in ``_parkable``; a parameter not kept)
        return False
    return (runs and all(map(operator.is_, map(_GRAD, params), repeat(None)))
            and all(map(operator.is_, map(_PARKED, params), repeat(None)))
            and all(map(operator.is_, map(_HOOKS, params), repeat(None)))
            and all(map(operator.is_, map(_POST_HOOKS, params), repeat(None))))


def _parkable(params: list) -> list[bool]:
    """Whether each of ``params`` may have its gradient parked (module docstring): its accumulator runs in this
    backward and stores the gradient as it is. None in a process group (DDP's reducer hooks each accumulator and
    reads the gradient it stored)."""
    if dist.is_available() and dist.is_initialized():
        return [False] * len(params)
    try:
        runs = list(map(_executes, _accumulators(params)))
    except RuntimeError:  # (``torch.autograd.grad`` over a parameter: gradients are captured, not stored)
        return [False] * len(params)
    return [run and p.grad is None and p._meganeura_kept.grad is None and p._backward_hooks is None
            and p._post_accumulate_grad_hooks is None for p, run in zip(params, runs)]


def _accumulators(params: list) -> list:
    """Each parameter's gradient accumulator, kept on its link (autograd keeps it only while something holds it):
    read in loops run by C, looked up where not kept yet."""
    kepts = list(map(_KEPT, params))
    found = list(map(_ACCUMULATOR, kepts))
    if None in found:
        for p, kept in zip(params, kepts):
            if kept.accumulator is None:
                kept.accumulator = get_gradient_edge(p).node
        found = list(map(_ACCUMULATOR, kepts))
    return found
