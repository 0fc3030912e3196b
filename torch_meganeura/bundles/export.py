"""``export(model, example_inputs, path)``: trace a model once and write a torch-free deploy bundle.

Tracing: ``torch.export.export`` (not the dynamo/AOT path of ``torch.compile``). It gives one whole graph or a
clear error, never graph breaks; a bundle cannot contain eager PyTorch, so a graph break would have nowhere to
go. Its graph signature says which placeholders are parameters, buffers and constants (their values come from
the exported program's state) and which are user inputs, with the argument names that become the bundle's
input names. ``run_decompositions(decomposition_table())`` brings the graph to the same aten ops the backend
lowers, and ``device_graph.compile_device_graph`` (the backend's and the training step's pipeline) turns it into
one plan for the whole model, through the plan cache. Data-dependent
control flow that torch.export cannot trace is reported with torch's own error (``ExportError``). An HF model whose
config asks for a KV cache is traced without it (with a warning): a cache object is not a tensor.

Refused, with ``ExportError`` naming the cause: ops the device cannot run (``partition.fallback_ops``), a model
that mutates its buffers (BatchNorm in training mode: call ``model.eval()``), outputs that are Python constants
rather than tensors, and inputs or outputs of kinds a plan cannot hold (tokens, custom objects).

Outputs: the model's output structure (tensor, tuple, dict, HF ``ModelOutput``) is flattened to named outputs:
a dict key or ModelOutput field gives its name (``logits``, ``last_hidden_state``), positions give numbers
joined by dots; a bare tensor is ``output`` and a tuple's items are ``output.0``, ``output.1``... The manifest
lists them in the flattened order. Weights: every parameter, buffer and lifted constant the graph reads, keyed
by its plan name; the manifest's ``params`` maps each to its name in the model's state dict (``source``).

Kernels are generated for WebGPU's default limits unless ``portable=False`` (see
``meganeura.runtime.requirements``), so a bundle exported on one adapter runs on others.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from meganeura.runtime.bundle import tensor_entry, write_bundle
from meganeura.runtime.plan import Plan
from meganeura.runtime.device import get_device, prepare_device
from meganeura.runtime.requirements import compile_limits, plan_requirements

from ..lower.decompositions import decomposition_table
from ..backend.device_graph import compile_device_graph, unsupported_listing
from ..tensors.params import host_form
from ..lower.partition import fallback_ops
from ..lower.registry import LoweringError
from ..lower.symbolic import DynamicSizes
from ..training.step import TrainStep

STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
ASSERTIONS = {  # checks torch.export inserts; the runtime checks input shapes and dtypes itself
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


class ExportError(RuntimeError):
    """The model cannot be exported to a bundle; the message says why."""


def export(model: torch.nn.Module, example_inputs, path, *, adapter: str | int | None = None,
           portable: bool = True, overwrite: bool = False, dynamic_shapes=None) -> dict:
    """Trace ``model`` on ``example_inputs`` and write its bundle to the directory ``path``; return the manifest.

    ``example_inputs``: a tensor, a tuple of positional arguments, or a dict of keyword arguments. The bundle is
    specialised to their shapes and dtypes, but for the dimensions ``dynamic_shapes`` declares (torch.export's
    form: ``{"input_ids": {1: torch.export.Dim("seq", max=512)}}``), each with a largest value: the plan is then
    over symbolic sizes, sized for those values, and a call may take any size in the range. The model is traced as it
    is: call ``model.eval()`` first for inference behaviour. A ``torch.compile``d model is exported through its original
    module, with its current (e.g. trained) weights. A ``compile_train_step`` step exports its module (traced as it is:
    call ``step.model.eval()`` first) with the weights it holds on the device, read directly: the module's own tensors
    need not be synced and are not touched. ``adapter`` picks the device whose limits the plan is generated for."""
    prepare_device(adapter)  # created while torch.export traces: only its limits are needed, after the trace
    resident = model.device_weights() if isinstance(model, TrainStep) else {}
    module = model.model if isinstance(model, TrainStep) else getattr(model, "_orig_mod", model)
    args, kwargs = _split_inputs(example_inputs)
    program = trace(module, args, kwargs, dynamic_shapes)
    device = get_device(adapter)
    compiled = compile_program(program, args, kwargs, device, compile_limits(device.limits, portable), module)
    weights = {name: resident[source] if source in resident else host_form(compiled.state[source])
               for name, source in compiled.sources.items()}
    return write_bundle(path, compiled.plan, compiled.description, weights, overwrite=overwrite)


@dataclass
class CompiledProgram:
    """An exported program compiled into a plan, with its manifest's description (producer, inputs, outputs,
    params, rng input, requirements)."""

    plan: Plan
    description: dict
    sources: dict[str, str]  # plan param name -> state dict name
    state: dict[str, torch.Tensor]  # the program's parameters, buffers and lifted constants by state dict name


def compile_program(program: torch.export.ExportedProgram, args: tuple, kwargs: dict, device, limits: dict,
                    module: torch.nn.Module, in_place: dict[int, int] | None = None) -> CompiledProgram:
    """Check and compile ``program`` (traced on ``args``, ``kwargs``) for ``limits``. ``in_place``: flattened
    output index -> flattened user input index, outputs the plan may store over that input (a KV cache)."""
    gm = program.graph_module
    _drop_assertions(gm)
    _check_supported(program, gm)
    dynamic = _dynamic_sizes(program, gm)
    lowered, plan, sources, guards = _compile(program, gm, args, kwargs, device, limits, in_place, dynamic)
    specs = {t.name: t for t in plan.inputs + plan.outputs + plan.params}
    input_specs = program.graph_signature.input_specs
    outputs = zip(_output_names(program), lowered.outputs)
    description = {
        "producer": _producer(module),
        "inputs": [tensor_entry(input_specs[i].arg.name, specs[name]) for i, name in lowered.inputs],
        "outputs": [tensor_entry(name, specs[item]) for name, (_, item) in outputs],
        "params": [tensor_entry(name, specs[name], source=sources[name]) for _, name in lowered.params],
        "rng_input": lowered.rng_seed,
        "requires": plan_requirements(plan, limits),
    }
    if dynamic is not None:
        names = {i: input_specs[i].arg.name for i, _ in lowered.inputs}
        symbols = [{"input": names[i], "dim": d, "min": low, "max": high}
                   for (i, d), low, high in zip(dynamic.sources, dynamic.lower, plan.bounds)]
        description["dynamic"] = {"symbols": symbols, **guards.to_json()}
    return CompiledProgram(plan, description, sources, _state(program))


def _dynamic_sizes(program: torch.export.ExportedProgram, gm: fx.GraphModule) -> DynamicSizes | None:
    """The exported graph's dynamic dimensions, each with its declared range; a dimension with no largest value
    is refused (a bundle's buffers are sized for it)."""
    dynamic = DynamicSizes.of(gm, program.range_constraints)
    if dynamic is None:
        return None
    unbounded = [name for name, high in zip(dynamic.names, dynamic.upper) if high is None]
    if unbounded or any(d is None for _, d in dynamic.sources):
        raise ExportError(f"dynamic dimensions {unbounded} have no largest value: declare one (torch.export.Dim("
                          "..., max=N)); a bundle's buffers are sized for it")
    return dynamic


def _split_inputs(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def trace(module, args: tuple, kwargs: dict, dynamic_shapes=None) -> torch.export.ExportedProgram:
    """``module`` on ``args``, ``kwargs`` as an exported program decomposed to the ops the backend lowers."""
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"export takes an nn.Module, got {type(module).__name__}")
    with _without_kv_cache(module, kwargs):
        try:
            program = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes)
        except Exception as err:  # noqa: BLE001 - any tracing failure is reported with torch's message
            raise ExportError(f"torch.export could not trace {type(module).__name__}{_cause(err)}: "
                              f"{type(err).__name__}: {err}") from err
    return program.run_decompositions(decomposition_table())


@contextlib.contextmanager
def _without_kv_cache(module, kwargs: dict):
    """An HF model whose config asks for a KV cache (``use_cache``, true by default in language models) returns a
    cache object, which a bundle cannot hold, and which a forward of fixed shapes has no use for: trace it with
    ``config.use_cache`` off (restored after), and say so. A ``use_cache`` the caller passes is left as it is."""
    config = getattr(module, "config", None)
    if not getattr(config, "use_cache", False) or "use_cache" in kwargs:
        yield
        return
    warnings.warn(f"meganeura: exporting {type(module).__name__} without its KV cache output (config.use_cache is "
                  "turned off while tracing): a bundle is one forward of fixed shapes and returns tensors",
                  stacklevel=5)  # the caller of export (through this generator, contextlib, trace, export)
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def _cause(err: Exception) -> str:
    """What a tracing failure means for a bundle, where torch's message says it."""
    text = str(err)
    if "data-dependent" in text or "data dependent" in text:
        return " (a bundle needs one whole graph: control flow that depends on tensor values cannot be traced)"
    if "in output, which is not a known type" in text:
        return " (its outputs hold an object that is not a tensor, and a bundle returns tensors)"
    if "in input" in text and "not a known type" in text:
        return " (its inputs hold an object that is not a tensor, and a bundle takes tensors)"
    return ""


def _drop_assertions(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in ASSERTIONS and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _check_supported(program: torch.export.ExportedProgram, gm: fx.GraphModule) -> None:
    signature = program.graph_signature
    allowed = (*STATE_KINDS, InputKind.USER_INPUT)
    odd_inputs = sorted({s.kind.name for s in signature.input_specs if s.kind not in allowed})
    mutations = sorted(s.target or s.arg.name for s in signature.output_specs if s.kind != OutputKind.USER_OUTPUT)
    if odd_inputs:
        raise ExportError(f"the exported graph has inputs of kinds {odd_inputs}, which a bundle cannot hold")
    if mutations:
        raise ExportError(f"the model mutates {mutations} when it runs (BatchNorm in training mode? call "
                          "model.eval() first); a bundle computes outputs only")
    fallbacks = fallback_ops(gm)
    if fallbacks:
        raise ExportError("the device cannot run these ops, and a bundle cannot contain eager PyTorch: "
                          + unsupported_listing(fallbacks))


def _compile(program, gm: fx.GraphModule, args: tuple, kwargs: dict, device, limits: dict, in_place=None,
             dynamic: DynamicSizes | None = None):
    """Lower and compile ``gm`` with every placeholder's value for ``limits``; return the lowered graph, the plan,
    plan param name -> state dict name, and the guards of a plan over ``dynamic`` sizes (else None)."""
    state = _state(program)
    kwargs_spec = _children(program.call_spec.in_spec)[1]  # torch.export orders kwargs by the signature
    user_values = iter(pytree.tree_leaves((args, {key: kwargs[key] for key in kwargs_spec.context})))
    values, state_indices, targets, user_placeholders = [], set(), {}, []
    for i, spec in enumerate(program.graph_signature.input_specs):
        if spec.kind in STATE_KINDS:
            values.append(state[spec.target])
            state_indices.add(i)
            targets[i] = spec.target
        else:
            values.append(next(user_values))
            user_placeholders.append(i)
    stored_over = {out: user_placeholders[i] for out, i in (in_place or {}).items()}
    try:
        graph = compile_device_graph(gm, values, state_indices, device, limits=limits, in_place=stored_over,
                                     dynamic=dynamic)
    except LoweringError as err:
        raise ExportError(f"lowering the exported graph failed: {err}") from err
    lowered = graph.lowered
    constants = [repr(item) for kind, item in lowered.outputs if kind == "const"]
    if constants:
        raise ExportError(f"outputs {constants} are Python constants, not tensors computed by the model; a bundle "
                          "returns tensors only")
    return lowered, graph.plan, {name: targets[i] for i, name in lowered.params}, graph.guards


def _output_names(program) -> list[str]:
    """Names of the flattened outputs (see the module docstring)."""
    spec = program.call_spec.out_spec
    names, seen = [], set()
    for path in _leaf_paths(spec):
        name = re.sub(r"[^A-Za-z0-9_.]", "_", ".".join(path))
        if not name or not (name[0].isalpha() or name[0] == "_"):
            name = "output" + ("." + name if name else "")
        while name in seen:
            name += "_"
        seen.add(name)
        names.append(name)
    return names


def _leaf_paths(spec, prefix: tuple = ()):
    if spec.is_leaf():
        yield prefix
        return
    children = _children(spec)
    keys = spec.context if isinstance(spec.context, (list, tuple)) and len(spec.context) == len(children) else None
    for i, child in enumerate(children):
        yield from _leaf_paths(child, prefix + (str(keys[i] if keys else i),))


def _state(program) -> dict[str, torch.Tensor]:
    """Parameters, buffers and lifted constants (non-persistent buffers among them) by state dict name."""
    return {**program.state_dict, **program.constants}


def _children(spec) -> list:
    return spec.children() if hasattr(spec, "children") else spec.children_specs  # children_specs: older torch


def _producer(module) -> dict:
    from .. import __version__  # noqa: PLC0415 - the package imports this module: read once it is set

    return {"package": "torch-meganeura", "version": __version__, "torch": torch.__version__,
            "model": type(module).__name__}
