"""The ``meganeura`` dynamo backend: aot_autograd with our decompositions and a graph compiler that sends
supported regions to the device and the rest to eager PyTorch (visibly).

Registered under the ``torch_dynamo_backends`` entry point, so ``torch.compile(model, backend="meganeura")``
works without importing this package. ``torch._dynamo.reset()`` calls ``meganeura_backend.reset()``.
"""
from __future__ import annotations

import functools
import itertools
import logging
import operator
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.schemas import OutputType

from meganeura.runtime.device import get_device, prepare_device
from meganeura.runtime.profiler import attach as attach_profiler

from .bound_plan import taker
from .per_call import DevicePartition
from .signatures import SHARED_GRAPHS
from ..lower.decompositions import aot_decomposition_table
from ..tensors.device_tensor import DeviceParameter, copy_into, mark_updated
from .device_graph import unsupported_listing
from .options import Options
from ..tensors.params import ParamStore, upload_array
from ..lower.registry import TORCH_TO_LOGICAL
from ..tensors.resident import TORCH_DTYPE, ResidentTensor
from ..lower.partition import fallback_ops, partition
from .saved_values import partition_joint
from .packed import Handoff, of_this_graph
from .parked_grads import GradientParking

log = logging.getLogger("torch_meganeura")


class FallbackError(NotImplementedError):
    """Raised under ``options={"fallback": "error"}`` when a graph has ops the device cannot run."""


class BackendContext:
    """State shared by the graphs compiled with one set of options: device, parameter copies, records."""

    _warned: set[str] = set()
    recorders: list = []  # explain() pushes a list here to collect records

    def __init__(self, options: Options, params: ParamStore | None = None):
        self.options = options
        self._params = params  # given: parameters are bound from it (a training step's device arrays)
        self._own_params = params is None

    def device(self):
        device = get_device(self.options.adapter)
        if self.options.profile and device.profiler is None:
            attach_profiler(device, self.options.profile)
        return device

    def params(self) -> ParamStore:
        device = self.device()
        if self._own_params and (self._params is None or self._params.device is not device):
            self._params = param_store(device)  # first use, or the last device was lost
        return self._params

    def f16_products(self, device) -> bool:
        """Whether ``device`` can form products in f16 (precision "fast"); warns once per device where it cannot."""
        if "shader-f16" in device.features:
            return True
        key = f"precision fast on {device.describe()}"
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"meganeura: precision 'fast' needs the shader-f16 feature, which {device.describe()} lacks; "
                          "its plans stay in f32", stacklevel=3)
        return False

    def record(self, item) -> None:
        for rec in self.recorders:
            rec.append(item)


@functools.lru_cache(maxsize=None)
def param_store(device) -> ParamStore:
    """The backend's device copies of parameters on ``device``, shared by every compiled graph (and by the
    optimizers kept on the device, ``device_optimizer``)."""
    return ParamStore(device)


def _fw_metadata():
    ctx = torch._guards.TracingContext.try_get()
    return getattr(ctx, "fw_metadata", None) if ctx is not None else None


def _saved_for_backward(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes a training forward returns only to save them for the backward (after the user-visible returns)."""
    meta = _fw_metadata()
    if meta is None:
        return set()
    outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    user, saved = outputs[: meta.num_forward_returns], outputs[meta.num_forward_returns:]
    return {n for n in saved if isinstance(n, fx.Node)} - {n for n in user if isinstance(n, fx.Node)}


def _parameter_gradients(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes a backward returns as gradients of parameters (its outputs align with the forward's inputs)."""
    meta = _fw_metadata()
    if meta is None:
        return set()
    outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    return {outputs[i] for i in meta.static_input_indices or () if i < len(outputs) and isinstance(outputs[i], fx.Node)}


def _plain_user_outputs(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes an inference graph or a training forward returns to the user as they are: each may stay on the device
    until eager code reads it (a KV cache that Python only hands back, a loss nobody prints). Not the new values of
    mutated inputs, the bases of aliases (intermediates, or user outputs that another output is a view of) or the
    outputs aliasing something: aot_autograd's runtime copies those into the
    inputs, or makes views of them, with subclass overrides off, so it would read their stale host copies."""
    meta = _fw_metadata()
    if meta is None:
        return set()
    outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    first = len(getattr(meta, "tokens", None) or ()) + meta.num_mutated_inp_runtime_indices
    user = outputs[first:first + meta.num_outputs]
    plain = {n for n, info in zip(user, meta.output_info) if info.output_type == OutputType.non_alias}
    others = [n for k, n in enumerate(outputs) if not first <= k < first + meta.num_outputs]
    others += [n for n, info in zip(user, meta.output_info) if info.output_type != OutputType.non_alias]
    others += [user[info.base_idx] for info in meta.output_info  # (CLIP's logits_per_image = logits_per_text.t())
               if info.output_type == OutputType.alias_of_intermediate_base_is_user_output]
    return {n for n in plain if isinstance(n, fx.Node)} - set(others)


def _mutated_inputs(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """A forward or inference graph's outputs that are new values of its inputs (BatchNorm's running statistics in
    training, a static KV cache's ``index_copy_``), each to the placeholder it updates: aot_autograd copies them into
    the inputs after the call. (Both kinds of graph return them first, in the order of
    ``mutated_inp_runtime_indices``.)"""
    meta = _fw_metadata()
    if meta is None:
        return {}
    outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first = len(getattr(meta, "tokens", None) or ())
    updates = {}
    for k, i in enumerate(meta.mutated_inp_runtime_indices):
        info = meta.input_info[i]
        if info.mutates_data and not info.mutates_metadata and isinstance(outputs[first + k], fx.Node):
            updates[outputs[first + k]] = placeholders[i]
    return updates


def _take_input_copies(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """The writes of graph inputs that aot_autograd keeps in the graph (``keep_inference_input_mutations``:
    BatchNorm's running statistics in training, a static KV cache's update): ``copy_(input, value)`` that nothing
    reads but the output, of a value of the input's shape and dtype. Each is taken out, its value returned as an
    extra output (a device partition then returns it) until ``_put_back_input_copies``. Where the graph returns the
    copy's result, it returns the input itself (what ``copy_`` returns; its new value by then): the input that a
    function updates in place and hands back (HF's static cache's ``cumulative_length`` at the prefill, where the
    cache's first update assigns it to itself) is then updated on the device as the others are, where a copy on
    the host left it a plain tensor that the decode's first run made a ``DeviceTensor``, and dynamo's guards on its
    class traced the decode again at its second call. Returns (placeholder index, output position) of each."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if not isinstance(output.args[0], (tuple, list)):
        return []
    index_of = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    values, copies, taken = list(output.args[0]), [], []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default or set(node.users) - {output}:
            continue
        dst, value = node.args[0], node.args[1]
        if dst not in index_of or not isinstance(value, fx.Node) or value in values[len(values) - len(copies):]:
            continue
        want, have = dst.meta.get("val"), value.meta.get("val")
        if not isinstance(have, torch.Tensor) or (want.shape, want.dtype) != (have.shape, have.dtype):
            continue
        copies.append((index_of[dst], len(values)))
        values = [dst if v is node else v for v in values] + [value]
        taken.append(node)
    if copies:
        output.args = (type(output.args[0])(values),)
        for node in taken:
            gm.graph.erase_node(node)
        gm.recompile()
    return copies


def _put_back_input_copies(gm: fx.GraphModule, copies: list[tuple[int, int]], stepped: set[int]) -> dict:
    """The writes ``_take_input_copies`` took out, back in ``gm`` (partitioned) as one call of ``store_inputs`` at the
    end; and, first, one of ``inputs_version_stepped`` over those inputs whose version aot_autograd steps before each
    call (``stepped``: its ``mutated_graph_handled_indices_seen_by_autograd``). One call each for all the inputs, not
    one per input: a static KV cache has three updated inputs per layer, and every decode step ran both. Returns each
    value's node -> the placeholder it updates, as ``_mutated_inputs`` does."""
    if not copies:
        return {}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = list(output.args[0])
    output.args = (type(output.args[0])(values[:copies[0][1]]),)
    stepped_inputs = tuple(placeholders[index] for index, _ in copies if index in stepped)
    if stepped_inputs:
        with gm.graph.inserting_after(placeholders[-1]):
            gm.graph.call_function(inputs_version_stepped, stepped_inputs)
    with gm.graph.inserting_before(output):
        gm.graph.call_function(store_inputs, (tuple(placeholders[index] for index, _ in copies),
                                              tuple(values[position] for _, position in copies)))
    gm.recompile()
    return {values[position]: placeholders[index] for index, position in copies}


_KEPT_NAME, _NONE = itertools.repeat("_meganeura_kept"), itertools.repeat(None)  # (``getattr``'s, mapped)


def inputs_version_stepped(*inputs: torch.Tensor) -> None:
    """aot_autograd stepped the version of each of ``inputs`` before calling the graph that updates them (updates
    kept in the graph), writing nothing: a ``DeviceTensor``'s device values are still current
    (``device_tensor.bound_array``)."""
    for kept in map(getattr, inputs, _KEPT_NAME, _NONE):  # (no Python call per statistic)
        if kept is not None:
            kept.version += 1


def store_inputs(inputs: tuple, values: tuple) -> None:
    """A graph's writes of its new ``values`` of ``inputs`` (``_take_input_copies``): nothing where a device partition
    kept the update in the input itself (``device_tensor.adopt``; no version step follows: aot_autograd made it
    before the call, ``inputs_version_stepped``), else an eager copy (a partition that fell back, a process that
    shares buffers: ``_buffers_shared``)."""
    for t, value, kept in zip(inputs, values, map(getattr, inputs, _KEPT_NAME, _NONE)):
        if value is not t:
            copy_into(t, value)
        elif kept is not None:
            kept.self_copy = False


def _updates_in_place(node: fx.Node, mutated: dict[fx.Node, fx.Node]) -> dict[int, int]:
    """Partition call ``node``'s outputs that are new values of its own arguments: output position -> argument
    index (the plan stores them over the argument's device array: ``DevicePartition``)."""
    args = list(node.args)
    outputs = {0: node} if node in mutated else {}  # (a partition of one output is its value)
    outputs.update({u.args[1]: u for u in node.users if u.target is operator.getitem and u in mutated})
    return {position: args.index(mutated[out]) for position, out in outputs.items() if mutated[out] in args}


def _resident_outputs(node: fx.Node, saved: set[fx.Node]) -> set[int]:
    """Output positions of partition call ``node`` whose only use is being returned in ``saved``."""
    output = next(n for n in node.graph.nodes if n.op == "output")
    if node in saved and set(node.users) == {output}:
        return {0}
    positions = set()
    for user in node.users:
        if user.target is operator.getitem and user in saved and set(user.users) == {output}:
            positions.add(user.args[1])
    return positions


def compile_graph_module(gm: fx.GraphModule, example_inputs, *, context: BackendContext, mode: str,
                         graph_inputs=()):
    """The aot_autograd compiler for ``mode`` "forward" (of training), "backward" or "inference": returns a boxed
    callable running ``gm`` on the device where it can. A training forward keeps its saved activations there, and a
    backward the gradients of parameters kept on the device (``KeptGradients``). ``graph_inputs``: the real tensors
    of dynamo's graph (``backend_with_context``), whose buffers that ``gm`` updates are marked as such."""
    backward = mode == "backward"
    meta = None if backward else _fw_metadata()
    param_indices = set(getattr(meta, "static_input_indices", None) or [])
    copies = _take_input_copies(gm)
    handoff = Handoff(gm, mode)  # (its names, taken before partitioning)
    fallbacks = _warn_about_fallbacks(gm, context)
    fused, partitions = partition(gm, 0 if backward else getattr(meta, "num_forward_returns", None))
    stepped = set(getattr(meta, "mutated_graph_handled_indices_seen_by_autograd", ())) if meta is not None else set()
    copied = _put_back_input_copies(fused, copies, stepped)
    saved = _saved_for_backward(fused) if mode == "forward" else set()  # stay on the device for the backward
    kept = KeptGradients.of_this_graph(create=mode == "forward")
    gradients = _parameter_gradients(fused) if backward and kept is not None else set()
    returned = set() if backward else _plain_user_outputs(fused)  # stay on the device until read
    mutated = ({} if backward or mode == "forward" and _buffers_shared()  # (kept on the device)
               else {**_mutated_inputs(fused), **copied})
    placeholders = [n for n in fused.graph.nodes if n.op == "placeholder"]
    if mode == "forward":
        _mark_updated(placeholders, set(mutated.values()), graph_inputs)
    index_of = {n: i for i, n in enumerate(placeholders)}
    for node in fused.graph.nodes:
        if node.op == "call_module" and node.target in partitions:
            updates = _updates_in_place(node, mutated)  # (a buffer updated in place is bound as a device input)
            sub_params = {j for j, a in enumerate(node.args)
                          if index_of.get(a) in param_indices and j not in updates.values()}
            setattr(fused, node.target, DevicePartition(
                getattr(fused, node.target), sub_params, context, _resident_outputs(node, saved),
                fast=not backward and context.options.precision == "fast",
                kept_gradients=_resident_outputs(node, gradients), kept=kept,
                lazy_outputs=_resident_outputs(node, returned), mutated=updates, lazy_from_first=mode == "forward",
                pack_saved=handoff.packing))
    unpack = handoff.finish(fused, partitions, getattr(meta, "num_forward_returns", 0), param_indices)
    # what the call's outputs go through: a forward's saved parameters packed, a backward's kept gradients parked
    finish = handoff.inputs or (GradientParking(_gradient_positions(), kept) if gradients else None)
    context.record({"kind": "graph", "mode": mode, "partitions": len(partitions), "fallback_ops": fallbacks})
    watched = sorted(param_indices) if mode == "forward" else []
    shared = (_shared_inputs(fused, saved - set(mutated.values()), param_indices, partitions)
              if mode == "forward" else [])

    statics_of = taker(watched) if watched else None  # (a forward's static inputs, taken in C)

    def run(args):
        if statics_of is not None:
            kept.note(statics_of(args))
        for i in shared:  # uploaded once, for the forward's partitions and the backward's
            if type(args[i]) is torch.Tensor:  # (a resident or kept tensor is bound as it is)
                args[i] = ResidentTensor(upload_array(context.device(), args[i]))
        if unpack:
            unpack(args)
        result = fused(*args)
        args.clear()
        return finish(result) if finish is not None else result

    run._boxed_call = True
    return run


def _gradient_positions() -> list[int]:
    """A backward's output positions that are gradients of the forward's static inputs (``_parameter_gradients``)."""
    meta = _fw_metadata()
    return sorted(getattr(meta, "static_input_indices", None) or ()) if meta is not None else []


def _shared_inputs(gm: fx.GraphModule, saved: set[fx.Node], static: set[int], partitions) -> list[int]:
    """The inputs of a training forward that it saves for the backward as they are (the image batch, which the
    first convolution's weight gradient reads) and that only device partitions read: the forward uploads each into
    a device array and passes it as a ``ResidentTensor``, which its partitions bind and the backward gets, where
    each would upload it again. Parameters and buffers are not among them (their device copies are kept), nor
    inputs the graph updates, nor values whose dtype the device stores as another (int64)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    shared = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        value = node.meta.get("val")
        readers = [u for u in node.users if u is not output]
        if (node in saved and i not in static and isinstance(value, torch.Tensor) and _kept_as_is(value.dtype)
                and readers and all(u.op == "call_module" and u.target in partitions for u in readers)):
            shared.append(i)
    return shared


def _kept_as_is(dtype: torch.dtype) -> bool:
    """Whether a device array of ``dtype`` values has that torch dtype again (int64 is stored as int32)."""
    logical = TORCH_TO_LOGICAL.get(dtype)
    return logical is not None and TORCH_DTYPE.get(logical) == dtype


def _buffers_shared() -> bool:
    """Whether this process trains in a group of several (torch.distributed): DDP's ``broadcast_buffers`` then
    reads and writes the module buffers' host copies from C++, below ``device_tensor``'s override, so a training
    forward's buffer updates come back to the host, and aot_autograd writes them into the buffers."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _mark_updated(placeholders: list[fx.Node], updated: set[fx.Node], graph_inputs) -> None:
    """Make the real tensors of the ``updated`` placeholders the ``DeviceTensor``s that the first run's update makes
    of them (``device_tensor.adopt``) now, before dynamo builds the frame's guards: the guards then expect that
    class, where a class changed at the first run would make dynamo trace the frame again. Only where the
    placeholders are dynamo's graph inputs one for one, only plain tensors, and only a training forward's (buffers,
    which live as long as their module): an inference graph's updated inputs (HF's static cache) are new tensors at
    each ``generate`` call, plain again, and guards expecting the class made each call trace the model again."""
    if len(placeholders) != len(graph_inputs):
        return
    for node, t in zip(placeholders, graph_inputs):
        value = node.meta.get("val")
        if node in updated and type(t) is torch.Tensor and value is not None and value.shape == t.shape:
            mark_updated(t)


def _all_kept(statics: tuple) -> bool:
    """Whether the static inputs (parameters and buffers) of a forward call hold a parameter kept on the device
    and no trainable parameter that is not: their classes read in a loop run by C, each one's ``requires_grad`` only
    where some are plain parameters."""
    classes = set(map(type, statics))
    if torch.nn.Parameter in classes and any(type(t) is torch.nn.Parameter and t.requires_grad for t in statics):
        return False
    return DeviceParameter in classes


def _warn_about_fallbacks(gm: fx.GraphModule, context: BackendContext) -> dict[str, str]:
    """Warn once per op that ``gm`` runs in eager PyTorch (or raise, under ``fallback="error"``); returns them."""
    fallbacks = fallback_ops(gm)
    if not fallbacks:
        return fallbacks
    listing = unsupported_listing(fallbacks)
    if context.options.fallback == "error":
        raise FallbackError(f"meganeura cannot run these ops on the device: {listing}")
    new = sorted(set(fallbacks) - BackendContext._warned)
    if new:
        BackendContext._warned.update(new)
        warnings.warn(f"meganeura: running in eager PyTorch (no device lowering): {listing}", stacklevel=3)
    return fallbacks


@dataclass
class KeptGradients:
    """Whether the last call of a training graph's forward had every parameter kept on the device by an optimizer
    (``device_optimizer``): its backward then parks their gradients on them (``parked_grads``) or returns them as
    ResidentTensors. ``params``: the last call's static inputs, in order (while ``kept``). The forward's compiler
    makes one per graph and leaves it in the tracing context, where the backward's compiler (of the same graph)
    finds it."""

    kept: bool = False
    params: tuple = ()

    def note(self, statics: tuple) -> None:
        """Note a forward call's static inputs: whether all its parameters are kept (``_all_kept``), and if so them."""
        self.kept = _all_kept(statics)
        self.params = statics if self.kept else ()

    @staticmethod
    def of_this_graph(create: bool) -> "KeptGradients | None":
        return of_this_graph("meganeura_kept_gradients", KeptGradients, create)


def meganeura_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """``torch.compile`` backend entry point. The device is created on a background thread meanwhile: aot_autograd
    traces the graph first, and the device is needed only at the first call."""
    opts = Options.from_user(options)
    prepare_device(opts.adapter)
    return backend_with_context(gm, example_inputs, BackendContext(opts))


def backend_with_context(gm: fx.GraphModule, example_inputs, context: BackendContext):
    """aot_autograd over ``gm`` with the device compilers sharing ``context``."""
    compiler = functools.partial(compile_graph_module, context=context, graph_inputs=example_inputs)
    return aot_autograd(
        fw_compiler=functools.partial(compiler, mode="forward"),
        bw_compiler=functools.partial(compiler, mode="backward"),
        inference_compiler=functools.partial(compiler, mode="inference"),
        partition_fn=partition_joint,
        decompositions=aot_decomposition_table(),
        keep_inference_input_mutations=True,  # in training too: BatchNorm's statistics (``_take_input_copies``)
    )(gm, example_inputs)


def _reset() -> None:
    BackendContext._warned.clear()
    SHARED_GRAPHS.clear()


meganeura_backend.reset = _reset
