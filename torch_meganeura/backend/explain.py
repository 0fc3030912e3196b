"""``explain(model, *inputs)``: compile and run once, then report what ran where and what it cost."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from meganeura.runtime.device import get_device

from .entry import BackendContext, meganeura_backend


@dataclass
class ExplainReport:
    lowered_ops: dict[str, int] = field(default_factory=dict)  # aten op -> count, run on the device
    fallback_ops: dict[str, str] = field(default_factory=dict)  # aten op -> why it runs in eager PyTorch
    graphs: int = 0  # fx graphs aot_autograd handed over (forward, backward)
    partitions: int = 0  # device partitions
    kernels: int = 0  # distinct fused kernels
    dispatches: int = 0  # dispatches per call, or per training step with loss_fn (sum over partitions)
    fused_producers: int = 0  # pointwise producers folded into their consumers
    planned_bytes: int = 0  # arena size after lifetime planning
    unplanned_bytes: int = 0  # sum of all intermediates
    compile_seconds: float = 0.0  # first call, compile included
    device_compile_seconds: float = 0.0  # of it, meganeura's plans: lowering, fusion, kernels, parameter uploads
    cached_plans: int = 0  # partitions whose plan came from the persistent plan cache
    plans: int = 0  # plans compiled (one per partition, and per variant of its sizes or signature)
    dynamic_dims: list = field(default_factory=list)  # symbolic sizes of the plans ("placeholder[dim] <= bound")
    adapter: str = ""
    mode: str = ""  # "inference" or "training forward" (grad enabled and parameters that require it)

    def __str__(self) -> str:
        lines = [
            f"adapter:            {self.adapter}",
            f"graph:              {self.mode}",
            f"graphs / partitions: {self.graphs} / {self.partitions}",
            f"ops on device:      {sum(self.lowered_ops.values())} ({len(self.lowered_ops)} kinds)",
            f"ops in eager:       {len(self.fallback_ops)}" + "".join(
                f"\n  {op}: {why}" for op, why in sorted(self.fallback_ops.items())),
            f"fused producers:    {self.fused_producers}",
            f"plans / kernels:    {self.plans} / {self.kernels}",
            f"dynamic sizes:      {', '.join(self.dynamic_dims) or 'none (every size specialised)'}",
            f"dispatches per call: {self.dispatches}",
            f"intermediates:      {self.planned_bytes:,} B planned vs {self.unplanned_bytes:,} B unplanned",
            f"first call:         {self.compile_seconds:.3f} s (compile included; {self.cached_plans} of the "
            f"plans from the plan cache)",
            f"  of which plans:   {self.device_compile_seconds:.3f} s (lowering, fusion, kernels, parameter "
            f"uploads; the rest is torch's tracing and the run)",
        ]
        return "\n".join(lines)


def explain(model, *inputs, loss_fn=None, options: dict | None = None, dynamic: bool | None = None) -> ExplainReport:
    """Compile ``model`` with the meganeura backend, call it once on ``inputs`` and report.

    With ``loss_fn``, the call is a training step: ``loss_fn(output).backward()`` runs too, and the counts
    (dispatches, kernels, fallbacks) cover the forward and the backward graphs. ``dynamic`` goes to
    ``torch.compile``: with True the sizes are symbolic from the first call, and the report names them."""
    records: list = []
    BackendContext.recorders.append(records)
    try:
        compiled = torch.compile(model, backend=lambda gm, ex: meganeura_backend(gm, ex, options=options),
                                 dynamic=dynamic)
        start = time.perf_counter()
        out = compiled(*inputs)
        if loss_fn is not None:
            loss_fn(out).backward()
        elapsed = time.perf_counter() - start
    finally:
        BackendContext.recorders.remove(records)
    training = torch.is_grad_enabled() and any(
        p.requires_grad for p in getattr(model, "parameters", lambda: [])())
    if loss_fn is not None:
        mode = "training step (forward + backward)"
    else:
        mode = "training forward (saved activations are outputs)" if training else "inference"
    report = ExplainReport(compile_seconds=elapsed, mode=mode)
    for rec in records:
        if isinstance(rec, dict) and rec["kind"] == "failed":
            report.fallback_ops["<partition>"] = rec["error"]
            continue
        if isinstance(rec, dict):
            report.graphs += 1
            report.partitions += rec["partitions"]
            report.fallback_ops.update(rec["fallback_ops"])
            continue
        for op, n in rec.ops.items():
            report.lowered_ops[op] = report.lowered_ops.get(op, 0) + n
        report.kernels += rec.kernels
        report.dispatches += rec.dispatches
        report.fused_producers += rec.fused_producers
        report.planned_bytes += rec.arena_bytes
        report.unplanned_bytes += rec.unplanned_bytes
        report.cached_plans += rec.from_cache
        report.device_compile_seconds += rec.compile_seconds
        report.plans += 1
        report.dynamic_dims += [d for d in rec.dynamic if d not in report.dynamic_dims]
    report.adapter = get_device((options or {}).get("adapter")).describe()
    return report
