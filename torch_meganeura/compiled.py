"""A device partition: an fx graph of supported aten ops that runs as one plan per input signature.

At a call with a signature (input shapes, dtypes, kinds and Python scalars) not seen before, the graph is
lowered with those concrete shapes, fused, planned and instantiated on the device; later calls with the same
signature only upload inputs (and changed parameters), replay the plan and read outputs back.

Parameters (the forward's static inputs, and ``nn.Parameter`` arguments in any graph) are bound from the
``ParamStore``. Outputs at the positions in ``resident_outputs`` (activations saved for the backward) stay on
the device as ``ResidentTensor``s, and ResidentTensor arguments are bound without an upload.
"""
from __future__ import annotations

import logging
import time
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from meganeura.lowering.plan_cache import cached_compile_graph
from meganeura.runtime.program import Program
from meganeura.runtime.resident import DeviceArray

from .fx_lowering import LoweredGraph, lower_graph
from .params import ParamStore
from .resident import ResidentTensor

log = logging.getLogger("torch_meganeura")

@dataclass
class PlanRecord:
    """What explain() reports about one compiled signature."""

    signature: tuple
    ops: dict
    dispatches: int
    kernels: int
    fused_producers: int
    arena_bytes: int
    unplanned_bytes: int
    compile_seconds: float
    fusion_refusals: list = field(default_factory=list)
    from_cache: bool = False  # the plan came from the persistent plan cache (meganeura.lowering.plan_cache)


@dataclass
class _Entry:
    lowered: LoweredGraph
    program: Program
    bound: list = field(default_factory=list)  # (weakref, _version) of each parameter as the last call bound it

    def params_unchanged(self, args) -> bool:
        """Whether every parameter argument is the tensor the last call bound, at the same version: then its
        buffer is bound and current, and binding again (hundreds of dictionary and buffer checks) is skipped."""
        if len(self.bound) != len(self.lowered.params):
            return False
        for (i, _), (ref, version) in zip(self.lowered.params, self.bound):
            a = args[i]
            if ref() is not a or a._version != version:
                return False
        return True


def arg_kind(a) -> str | None:
    """The kind of a partition argument: ``"resident"``, ``"param"`` or ``"tensor"``; None for a non-tensor.
    Exact types are tested first: ``isinstance`` against ``Parameter`` runs its metaclass's Python check, and a
    call tests every argument."""
    cls = type(a)
    if cls is torch.nn.Parameter:
        return "param"
    if cls is torch.Tensor:
        return "param" if getattr(a, "_is_param", False) else "tensor"  # (what Parameter's isinstance accepts too)
    if isinstance(a, ResidentTensor):
        return "resident"
    if isinstance(a, torch.Tensor):
        return "param" if isinstance(a, torch.nn.Parameter) else "tensor"
    return None


def signature(args) -> tuple:
    sig = []
    for a in args:
        kind = arg_kind(a)
        sig.append(a if kind is None else (a.shape, a.dtype, kind))
    return tuple(sig)


class DevicePartition(torch.nn.Module):
    """Runs ``gm`` on the device; stands in for the fused submodule the partitioner made."""

    def __init__(self, gm: fx.GraphModule, param_indices: set[int], context, resident_outputs=frozenset()):
        super().__init__()
        self.gm = gm
        self.param_indices = set(param_indices)
        self.resident_outputs = frozenset(resident_outputs)
        self.context = context  # the backend's shared state: device, parameter store, records
        self._plans: dict[tuple, _Entry] = {}

    def forward(self, *args):
        key = signature(args)
        if key not in self._plans or self._plans[key] is not None and self._plans[key].program.device.lost:
            self._plans[key] = self._compile_or_fall_back(key, args)  # (again on a new device after a loss)
        entry = self._plans[key]
        if entry is None:
            return self.gm(*[a.materialize() if isinstance(a, ResidentTensor) else a for a in args])
        return self._run(entry, args)

    def _compile_or_fall_back(self, key, args) -> _Entry | None:
        """Compile for this signature; if that fails, run the partition in eager PyTorch (visibly)."""
        try:
            return self._compile(key, args)
        except Exception as err:  # noqa: BLE001 - any compile failure must fall back, never compute garbage
            if self.context.options.fallback == "error":
                raise
            message = f"meganeura: a device partition runs in eager PyTorch because compiling it failed: {err}"
            warnings.warn(message, stacklevel=3)
            log.warning("%s", message)
            self.context.record({"kind": "failed", "error": str(err)})
            return None

    def _compile(self, key, args) -> _Entry:
        start = time.perf_counter()
        device = self.context.device()
        params = self.param_indices | {i for i, a in enumerate(args) if arg_kind(a) == "param"}
        lowered = lower_graph(self.gm, list(args), params)
        plan, report, from_cache = cached_compile_graph(lowered.graph, device.limits)
        resident = {item for k, (kind, item) in enumerate(lowered.outputs) if kind == "plan" and k in self.resident_outputs}
        on_device = [name for i, name in lowered.inputs  # saved activations: never uploaded, so no buffer of ours
                     if isinstance(args[i], ResidentTensor) and args[i].array.device is device]
        program = Program(device, plan, resident_outputs=resident, device_only_inputs=on_device)
        seconds = time.perf_counter() - start
        record = PlanRecord(key, lowered.ops, len(plan.dispatches), len(plan.kernels), len(report.fused),
                            plan.stats["arena_bytes"], plan.stats["unplanned_bytes"], seconds, report.refused,
                            from_cache)
        self.context.record(record)
        log.info("compiled a plan: %d dispatches, %d kernels in %.3f s", record.dispatches, record.kernels, seconds)
        return _Entry(lowered, program)

    def _run(self, entry: _Entry, args):
        lowered, program = entry.lowered, entry.program
        if not entry.params_unchanged(args):
            store: ParamStore = self.context.params()
            program.bind_params({f"param:{name}": store.buffer(args[i], f"parameter {name}")
                                 for i, name in lowered.params})
            entry.bound = [(weakref.ref(args[i]), args[i]._version) for i, _ in lowered.params]
        inputs, device_inputs = {}, {}
        for i, name in lowered.inputs:
            a = args[i]
            if isinstance(a, ResidentTensor) and a.array.device is program.device:
                device_inputs[name] = a.array
            else:
                a = a.materialize() if isinstance(a, ResidentTensor) else a
                inputs[name] = a.detach().cpu().contiguous().numpy()
        if lowered.rng_seed:
            inputs[lowered.rng_seed] = torch.randint(-(2**31), 2**31 - 1, (2,), dtype=torch.int64).int().numpy()
        results = program.run(inputs, device_inputs)
        outs = []
        for kind, item in lowered.outputs:
            if kind == "const":
                outs.append(item)
            elif isinstance(results[item], DeviceArray):
                outs.append(ResidentTensor(results[item]))
            else:  # a numpy array, or a numpy scalar for a 0-d bool (``words != 0`` of a 0-d array)
                outs.append(torch.from_numpy(np.asarray(results[item])))
        return tuple(outs) if lowered.returns_tuple else outs[0]
