"""The resident training step's path of the OpInfo coverage sweep (``python -m torch_meganeura.coverage --path step``).

A differentiable sample whose tensors that require grad are float32 becomes a module (``SampleModule``): those
tensors are its parameters, named ``t{i}`` after their position among the sample's tensors; tensors that the op
changes in place (BatchNorm's running statistics) are its buffers, the other tensors are the batch; the loss is the
backend path's, the sum over differentiable outputs of ``(out * cotangent).sum()``, with the same fixed random
cotangents (captured constants). Through ``compile_train_step`` with ``torch.optim.SGD(lr=0.1)`` the loss and every
gradient (``gradients()``) are compared with eager PyTorch, then one step runs and its loss, the updated parameters
(``sync_to_module``) and buffers are compared with eager's ``p - 0.1 * grad`` and eager's buffers after one call, by
the backend path's rules (``compare.compare_pairs``). Each sample is one of:

- ``lowered``: the step compiled into one device plan and everything compared is correct;
- ``fell-back``: compile_train_step refused the sample because some ops have no device lowering (``fallback_ops``
  names them), or, correct, dynamo broke the loss's graph and the step ran it as several device graphs with eager
  PyTorch between them (``train_segments``; ``fallback_ops`` has the graph breaks and the backend's fallbacks);
- ``wrong``, ``error``: as in the backend path (an exception of the backend hidden by a graph break included);
- ``skipped``: as in the backend path, and also: the op is random or not differentiable, no input requires grad
  (an op without float32), an input that requires grad is not a dense float32 tensor, or no output is
  differentiable.
"""
from __future__ import annotations

import re
import time
import warnings

import torch
from torch.utils import _pytree as pytree

from . import compare, sweep
from ..backend.entry import BackendContext
from ..training.step import compile_train_step

LR = 0.1
REFUSAL = "compile_train_step needs every op on the device; these are not: "
REFUSED_OP = re.compile(r"(\S+) \((.*?)\)(?=, \S+ \(|$)")  # "op (why), op (why)" after REFUSAL


class SampleModule(torch.nn.Module):
    """A sample as a module: ``forward(*batch)`` is the loss of the sample's op; of the sample's tensors (by
    position), ``trained`` are parameters ``t{i}``, ``buffered`` are buffers ``t{i}``, the others are ``batch``."""

    def __init__(self, call: sweep.Call, trained: list[int], buffered: list[int], cotangents: list):
        super().__init__()
        self.call, self.cotangents = call, cotangents
        self.held = set(trained) | set(buffered)
        for i in trained:
            value = call.tensors[i].detach().clone(memory_format=torch.contiguous_format)
            self.register_parameter(f"t{i}", torch.nn.Parameter(value))
        for i in buffered:
            self.register_buffer(f"t{i}", call.tensors[i].detach().clone(memory_format=torch.contiguous_format))

    def forward(self, *batch):
        rest = iter(batch)
        tensors = [getattr(self, f"t{i}") if i in self.held else next(rest) for i in range(len(self.call.tensors))]
        leaves, _ = pytree.tree_flatten(self.call.process(self.call.fn(*tensors)))
        return sweep.cotangent_loss(sweep.differentiable(leaves), self.cotangents)


def run_sample(op, sample) -> dict:
    """The step path's result for one sample (module docstring)."""
    start = time.perf_counter()
    try:
        entry = _run(op, sample)
    except sweep.EagerFailure as err:
        entry = {"status": "skipped", "reason": str(err)}
    except Exception as err:  # noqa: BLE001 - a sample the harness cannot handle is reported, not fatal
        entry = {"status": "error", "error": f"coverage harness: {type(err).__name__}: {sweep.first_line(err)}"}
    entry["seconds"] = round(time.perf_counter() - start, 3)
    return entry


def skip_reason(op, sample, call: sweep.Call) -> str | None:
    """Why the step path does not run the sample, or None."""
    if sweep.is_random(op, sample):
        return "random values (the step path compares values)"
    if not op.supports_autograd:
        return "the op is not differentiable"
    grad = [t for t in call.tensors if t.requires_grad]
    if not grad:
        return "no input requires grad"
    if any(t.dtype != torch.float32 or t.layout != torch.strided for t in grad):
        return "an input that requires grad is not a dense float32 tensor"
    return None


def _run(op, sample) -> dict:
    """``run_sample`` but for the timing and the samples skipped because eager PyTorch or torch.compile fails."""
    call = sweep.Call.of(op, sample)
    reason = skip_reason(op, sample, call)
    if reason:
        return {"status": "skipped", "reason": reason}
    ref32, cots, ref64 = sweep.eager_references(call, op, backward=True)
    if cots is None:
        return {"status": "skipped", "reason": "no output is differentiable"}
    trained = [i for i, t in enumerate(call.tensors) if t.requires_grad]
    changed = changed_in_place(call)
    try:
        got = run_step(call, trained, sorted(changed), cots)
    except Exception as err:  # noqa: BLE001 - one sample's failure must not stop the sweep
        refused = refusal(err)
        if refused:
            return refused
        torch_failure = sweep.aot_eager_fails(call, True, cots)
        if torch_failure:
            raise sweep.EagerFailure(torch_failure) from err
        return sweep.error_entry(err)
    pairs = comparisons(call, trained, got, ref32, ref64)
    pairs += [(f"buffer t{i} after the step", got["buffers"][i], value, None) for i, value in changed.items()]
    result = compare.compare_pairs(pairs)
    if result["status"] == "ok":
        result.update(sweep.status_when_correct(got["fallbacks"], call, True, cots))
    return {**result, "fallback_ops": got["fallbacks"]}


def changed_in_place(call: sweep.Call) -> dict[int, torch.Tensor]:
    """The sample's tensors that do not require grad and that the op changes in place (BatchNorm's running
    statistics) -> their values after one eager call."""
    inputs = call.inputs()
    call.fn(*inputs)
    return {i: after.detach() for i, (before, after) in enumerate(zip(call.tensors, inputs))
            if not before.requires_grad and not torch.equal(before, after)}


def run_step(call: sweep.Call, trained: list[int], buffered: list[int], cotangents: list) -> dict:
    """compile_train_step on the sample: the loss and gradients of ``gradients()`` (no update), then the loss of
    one SGD step and the parameters and buffers (by position) after it, and what ran in eager PyTorch
    (``segmented``)."""
    model = SampleModule(call, trained, buffered, cotangents)
    batch = [t for i, t in enumerate(call.inputs()) if i not in model.held]
    torch._dynamo.utils.counters.clear()
    records: list = []
    BackendContext.recorders.append(records)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a segmented step warns about its graph breaks; fallback_ops has them
            step = compile_train_step(model, lambda m, *b: m(*b), torch.optim.SGD(model.parameters(), lr=LR))
            loss, grads = step.gradients(*batch)
            step_loss = step(*batch)
        step.sync_to_module()
    finally:
        BackendContext.recorders.remove(records)
    return {"loss": loss, "grads": [grads[f"t{i}"] for i in trained], "step loss": step_loss,
            "params": [getattr(model, f"t{i}").detach() for i in trained],
            "buffers": {i: getattr(model, f"t{i}") for i in buffered}, "fallbacks": segmented(step, records)}


def segmented(step, records: list) -> dict[str, str]:
    """Where dynamo broke the loss's graph: each graph break, and what the backend ran in eager PyTorch
    (``sweep.eager_ops``); nothing where the step is one device plan."""
    if not step.graph_breaks:
        return {}
    why = "the step runs the loss as several device graphs with eager PyTorch between them"
    return {**{f"<graph break> {reason}"[:200]: why for reason in step.graph_breaks}, **sweep.eager_ops(records)}


def comparisons(call: sweep.Call, trained: list[int], got: dict, ref32, ref64) -> list:
    """(what, got, eager float32, eager float64 or None) for the loss, each gradient, the step's loss and each
    updated parameter; eager's update is ``p - LR * grad``."""
    loss, grads, step_loss, params = got["loss"], got["grads"], got["step loss"], got["params"]
    loss64 = None if ref64 is None else ref64.loss
    pairs = [("loss", loss, ref32.loss, loss64)]
    pairs += [(f"grad of t{i}", grads[j], ref32.grads[j], None if ref64 is None else ref64.grads[j])
              for j, i in enumerate(trained)]
    pairs.append(("loss of the step", step_loss, ref32.loss, loss64))
    for j, i in enumerate(trained):
        p = call.tensors[i].detach()
        want64 = None if ref64 is None else p.double() - LR * ref64.grads[j]
        pairs.append((f"t{i} after the step", params[j], p - LR * ref32.grads[j], want64))
    return pairs


def refusal(err: BaseException) -> dict | None:
    """A fell-back result where compile_train_step refused the sample because ops have no device lowering, else
    None."""
    text = str(err)
    if isinstance(err, NotImplementedError) and text.startswith(REFUSAL):
        return {"status": "fell-back", "fallback_ops": dict(REFUSED_OP.findall(text[len(REFUSAL):].strip()))}
    return None
