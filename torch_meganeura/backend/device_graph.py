"""One pipeline from an fx graph of aten ops to a plan and a device program, shared by the three ways a graph
runs: the backend (``compiled``), the resident training step (``train_step``) and export (``export``).

They differ only in how they capture the graph (aot_autograd; make_fx over grad-and-update; torch.export) and what
they do with the outputs. Everything between is here, once:

- ``unsupported_listing``: the ops the device cannot run, named with their reasons (each entry point words its own
  refusal or warning around it);
- ``compile_device_graph``: lowering with the example values (a dynamic graph's sizes as symbols, ``symbolic``),
  then fusion, memory planning and kernels through the persistent plan cache, with tuned matmul variants where
  asked (``tuning``);
- ``program_for``: the plan instantiated on the device, outputs kept resident and inputs bound from the device where
  asked;
- ``feed``: one call's inputs: torch tensors as host arrays (the program checks and converts them), resident
  tensors and device arrays bound as they are, and the random ops' seed drawn from torch's default generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx

from meganeura.lowering import FusedGraph
from meganeura.lowering.fusion import FusionReport
from meganeura.runtime.plan import Plan
from meganeura.runtime.program import Program
from meganeura.runtime.resident import DeviceArray
from meganeura.kernels.sizes import Guards

from ..lower.fx_lowering import LoweredGraph, lower_graph
from ..tensors.params import host_form, tensor_from_host
from ..tensors.device_tensor import kept_array
from ..tensors.resident import ResidentTensor
from ..lower.symbolic import DynamicSizes, NotModelled
from ..lower.tuning import compile_plan, fuse_for, schedule_for

RNG_SEED_WORDS = 2  # random ops draw from a key of two int32 (``meganeura.lowering.expr.uniform``)


def unsupported_listing(ops: dict[str, str]) -> str:
    """``op (why), ...`` for the ops of ``partition.fallback_ops``, sorted."""
    return ", ".join(f"{op} ({why})" for op, why in sorted(ops.items()))


@dataclass
class DeviceGraph:
    """A graph lowered to the IR and compiled into a plan for ``device`` (not yet a program on it)."""

    lowered: LoweredGraph
    plan: Plan
    report: FusionReport
    from_cache: bool  # the plan came from the persistent plan cache
    device: object = None
    guards: Guards | None = None  # a dynamic graph's: the sizes the plan holds for (``meganeura.kernels.sizes``)
    fused: FusedGraph | None = None  # a dynamic graph's IR after fusion, scheduled again past its bounds
    fusion_guards: tuple = ()  # a dynamic graph's guards recorded before scheduling (lowering's and fusion's)

    def holds(self, values) -> bool:
        """Whether the plan serves a call whose symbols have ``values`` (a static graph's: always)."""
        return self.guards is None or self.guards.check(values)


def compile_device_graph(gm: fx.GraphModule, example: list, param_indices: set[int], device, *,
                         tune: bool = False, f16_products: bool = False, limits: dict | None = None,
                         in_place: dict[int, int] | None = None, dynamic: DynamicSizes | None = None) -> DeviceGraph:
    """Lower ``gm`` with the example values of its placeholders (those at ``param_indices`` become long-lived
    param buffers) and compile the plan for ``device`` (or for ``limits``, e.g. WebGPU's defaults for a bundle,
    then untuned: a bundle runs on other adapters).

    ``in_place`` (output index -> placeholder index) names outputs that may be stored over the buffer of an input
    whose old value the caller will not read again (a parameter and its update); the plan does so where it is safe
    (``meganeura.lowering.in_place``), and the run then returns that input's device array, overwritten.

    A ``dynamic`` graph (one dynamo traced with symbolic sizes) is lowered with its sizes as ``Size``s hinted with
    the example's values; the decisions taken from them are the plan's guards (``DeviceGraph.holds``). Its fused IR
    is kept (``rescheduled``), unless the plan is for ``limits``."""
    if dynamic is None:
        return _compiled(_lowered(gm, example, param_indices, in_place), device, tune, f16_products, limits)
    guards = dynamic.guards(example)
    with guards.recording():
        try:
            symbolic = dynamic.example(gm, example)
        except NotModelled:  # sizes we cannot express: a plan for these values alone
            symbolic = dynamic.pin(example)
        lowered = _lowered(gm, symbolic, param_indices, in_place)
        if limits is not None:  # (a bundle's: compiled once)
            graph = _compiled(lowered, device, tune, f16_products, limits)
        else:
            fused = fuse_for(lowered.graph, device, f16_products)
            fusion_guards = tuple(guards.items)
            graph = DeviceGraph(lowered, schedule_for(fused, device, tune, f16_products), fused.report, False,
                                device, fused=fused, fusion_guards=fusion_guards)
    lowered.graph = None  # (the IR, compiled: see ``LoweredGraph.graph``; a dynamic graph keeps its fused IR)
    graph.guards = guards
    return graph


def _compiled(lowered: LoweredGraph, device, tune, f16_products, limits) -> DeviceGraph:
    plan, report, from_cache = compile_plan(lowered.graph, device, tune, f16_products, limits)
    lowered.graph = None  # (the IR, compiled: see ``LoweredGraph.graph``)
    return DeviceGraph(lowered, plan, report, from_cache, device)


def rescheduled(graph: DeviceGraph, example: list, dynamic: DynamicSizes, device, *, tune: bool = False,
                f16_products: bool = False) -> DeviceGraph | None:
    """A plan for a call with placeholder values ``example`` that dynamic ``graph``'s plan does not hold, scheduled
    from its fused IR, where the decisions of its lowering and fusion (``DeviceGraph.fusion_guards``) hold for the
    call's sizes: only the guards the schedule recorded failed, as a symbol past its bound does (a decode step's
    length past the power of two its plan's buffers were sized for). The lowering and fusion of the graph would
    take the same decisions again, so they are not run again; the schedule runs under the call's hints, sizing the
    buffers for the new bounds. None where a decision of the fusion, or one the schedule takes again, does not hold
    (the caller then compiles the graph anew)."""
    if graph.fused is None or graph.device is not device:
        return None
    values = dynamic.values(example)
    guards = dynamic.guards(example)
    for item in graph.fusion_guards:
        guards.record(*item)
    if not guards.check(values):
        return None
    with guards.recording():
        plan = schedule_for(graph.fused, device, tune, f16_products)
    if not guards.check(values):
        return None
    return DeviceGraph(graph.lowered, plan, graph.report, False, device, guards, graph.fused, graph.fusion_guards)


def _lowered(gm, example, param_indices, in_place) -> LoweredGraph:
    lowered = lower_graph(gm, example, param_indices)
    if in_place:
        lowered.graph.in_place = _in_place_request(lowered, in_place)
    return lowered


def _in_place_request(lowered: LoweredGraph, in_place: dict[int, int]) -> dict[int, str]:
    """``in_place`` (output index -> placeholder index) as the IR's request: graph output position -> input name."""
    names = dict(lowered.inputs)
    request = {}
    for output, placeholder in in_place.items():
        kind, name = lowered.outputs[output]
        if kind == "plan" and placeholder in names:
            request[int(name[len("out"):])] = names[placeholder]
    return request


def program_for(graph: DeviceGraph, device, resident_outputs=(), device_only_inputs=(), saved_outputs=()) -> Program:
    """``graph``'s plan on ``device``; the kernels compile on background threads meanwhile (``Program``).
    ``saved_outputs``: resident outputs that a run writes into one set of buffers (a training forward's saved
    activations, which live and die together)."""
    return Program(device, graph.plan, resident_outputs=list(resident_outputs),
                   device_only_inputs=list(device_only_inputs), saved_outputs=list(saved_outputs))


def feed(lowered: LoweredGraph, args, device, inputs=None) -> tuple[dict, dict]:
    """(host inputs, device inputs) by plan input name for one call with placeholder values ``args`` (of the plan
    inputs ``inputs``, (argument index, name) pairs; all of ``lowered``'s where None): a
    ``DeviceArray`` or a ``ResidentTensor`` on ``device`` is bound as it is (a resident tensor's host copy goes up
    first where eager code wrote it), anything else goes up in device layout (a resident tensor or device array of
    another device is downloaded first). The seed of the random ops is added where the plan has them."""
    host, on_device = {}, {}
    for i, name in lowered.inputs if inputs is None else inputs:
        value = args[i]
        if type(value) is DeviceArray and value.device is device:  # (no subclass: a call less per saved value)
            on_device[name] = value
        elif isinstance(value, ResidentTensor) and value.array.device is device:
            on_device[name] = value.device_array()
        elif (kept := kept_array(value, device)) is not None:  # a lazy output handed back (device_tensor)
            on_device[name] = kept
        else:  # the program checks the dtype, shape and int32 range, and converts to device layout
            value = value.materialize() if isinstance(value, ResidentTensor) else value
            value = tensor_from_host(value.numpy()) if isinstance(value, DeviceArray) else value
            with torch._C.DisableTorchFunctionSubclass():  # (a graph's input is not eager code reading it)
                host[name] = host_form(value.as_subclass(torch.Tensor))
    if lowered.rng_seed:
        host[lowered.rng_seed] = rng_seed()
    return host, on_device


def rng_seed() -> np.ndarray:
    """The key of one run's random ops, drawn from torch's default generator (``torch.manual_seed`` repeats it)."""
    return torch.randint(-(2**31), 2**31, (RNG_SEED_WORDS,), dtype=torch.int64).int().numpy()  # all of int32
