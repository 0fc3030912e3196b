"""What a plan needs of an adapter (features and limits), and the check that a device provides it.

A bundle records its needs so that a runtime refuses an adapter it cannot run on before building anything.
Limits are of two kinds: maxima (``max-*``: the device's value must be at least the required one) and
alignments (``min-*``: the device's value must be at most the required one; alignments are powers of two,
so a smaller one divides a larger one).

Some needs are measured on the plan (the largest binding, buffer and workgroup count, the storage buffers of
the widest dispatch); the limits that shaped the generated WGSL (workgroup size and storage, offset alignment)
are recorded as the values the kernels were generated for. ``compile_limits(..., portable=True)`` generates
for WebGPU's default limits, which every WebGPU adapter provides, so such a plan runs on any adapter whose
binding and buffer sizes are large enough.
"""
from __future__ import annotations

import re

from meganeura.kernels.wgsl import SUBGROUP_OPS  # a device sets it; portable generation leaves it out

from .errors import FeatureError, LimitError
from .plan import Plan

# WebGPU's default limits (https://www.w3.org/TR/webgpu/#limits): what every adapter provides, and what a browser
# gives a page that asks for nothing more (Apple, Intel and mobile adapters often offer little more).
WEBGPU_DEFAULT_LIMITS = {
    "max-texture-dimension-1d": 8192,
    "max-texture-dimension-2d": 8192,
    "max-texture-dimension-3d": 2048,
    "max-texture-array-layers": 256,
    "max-bind-groups": 4,
    "max-bind-groups-plus-vertex-buffers": 24,
    "max-bindings-per-bind-group": 1000,
    "max-dynamic-uniform-buffers-per-pipeline-layout": 8,
    "max-dynamic-storage-buffers-per-pipeline-layout": 4,
    "max-sampled-textures-per-shader-stage": 16,
    "max-samplers-per-shader-stage": 16,
    "max-storage-buffers-per-shader-stage": 8,
    "max-storage-textures-per-shader-stage": 4,
    "max-uniform-buffers-per-shader-stage": 12,
    "max-uniform-buffer-binding-size": 65536,
    "max-storage-buffer-binding-size": 134217728,
    "min-uniform-buffer-offset-alignment": 256,
    "min-storage-buffer-offset-alignment": 256,
    "max-vertex-buffers": 8,
    "max-buffer-size": 268435456,
    "max-vertex-attributes": 16,
    "max-vertex-buffer-array-stride": 2048,
    "max-inter-stage-shader-variables": 16,
    "max-color-attachments": 8,
    "max-color-attachment-bytes-per-sample": 32,
    "max-compute-workgroup-storage-size": 16384,
    "max-compute-invocations-per-workgroup": 256,
    "max-compute-workgroup-size-x": 256,
    "max-compute-workgroup-size-y": 256,
    "max-compute-workgroup-size-z": 64,
    "max-compute-workgroups-per-dimension": 65535,
}
# The default limits the kernel generators read.
PORTABLE_LIMITS = {name: WEBGPU_DEFAULT_LIMITS[name] for name in (
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroup-storage-size",
    "max-compute-workgroups-per-dimension",
    "max-storage-buffers-per-shader-stage",
    "min-storage-buffer-offset-alignment",
)}
GENERATION_LIMITS = (  # recorded as compiled for; the rest of PORTABLE_LIMITS is measured on the plan
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroup-storage-size",
    "min-storage-buffer-offset-alignment",
)
# WGSL that needs a feature: a pattern in the kernel source -> the wgpu feature name.
FEATURE_PATTERNS = {
    re.compile(r"\benable\s+f16\s*;"): "shader-f16",
    re.compile(r"\bsubgroup[A-Z_]\w*"): "subgroup",
}


def is_alignment(limit: str) -> bool:
    return limit.startswith("min-")


def compile_limits(device_limits: dict, portable: bool) -> dict:
    """The limits to generate kernels for: the device's, or with ``portable`` no more than WebGPU's defaults and
    no optional features."""
    limits = dict(device_limits)
    if portable:
        limits.pop(SUBGROUP_OPS, None)
        for name, value in PORTABLE_LIMITS.items():
            pick = max if is_alignment(name) else min
            limits[name] = pick(limits.get(name, value), value)
    return limits


def default_limits(adapter_limits: dict) -> dict:
    """The limits to request of an adapter for a device held to WebGPU's defaults: each default, or the adapter's
    own value where it is stricter (a default above the adapter's maximum could not be requested)."""
    limits = {}
    for name, value in WEBGPU_DEFAULT_LIMITS.items():
        if name in adapter_limits:
            pick = max if is_alignment(name) else min
            limits[name] = pick(adapter_limits[name], value)
    return limits


def plan_requirements(plan: Plan, limits: dict) -> dict:
    """``{"features": [...], "limits": {...}}`` that an adapter needs to run ``plan`` generated for ``limits`` (a plan
    over symbolic sizes: at its bounds, the most it serves)."""
    plan = plan.at(plan.bounds)
    features = sorted({f for wgsl in plan.kernels.values() for pattern, f in FEATURE_PATTERNS.items()
                       if pattern.search(wgsl)})
    bindings = [b for d in plan.dispatches for b in d.bindings]
    tensors = plan.inputs + plan.params + plan.outputs
    needed = {
        "max-storage-buffer-binding-size": max([b.size for b in bindings] + [t.nbytes for t in tensors] + [4]),
        "max-buffer-size": max(b.size for b in plan.buffers),
        "max-storage-buffers-per-shader-stage": max([len(d.bindings) for d in plan.dispatches] + [1]),
        "max-compute-workgroups-per-dimension": max([max(d.workgroups) for d in plan.dispatches] + [1]),
    }
    needed.update({name: limits[name] for name in GENERATION_LIMITS if name in limits})
    return {"features": features, "limits": needed}


def check_requirements(requires: dict, features: set, limits: dict, adapter: str) -> None:
    """Raise FeatureError or LimitError if a device with ``features`` and ``limits`` cannot meet ``requires``."""
    missing = sorted(set(requires["features"]) - set(features))
    if missing:
        raise FeatureError(f"this bundle needs the feature(s) {missing}, which the device on {adapter} does not "
                           f"provide; it has {sorted(features)}", missing=missing)
    for name, wanted in requires["limits"].items():
        if name not in limits:
            raise LimitError(f"this bundle needs the limit {name} = {wanted}, which the device on {adapter} does "
                             f"not report", limit=name, value=0, requested=wanted)
        have = limits[name]
        if (have > wanted) if is_alignment(name) else (have < wanted):
            relation = "at most" if is_alignment(name) else "at least"
            raise LimitError(f"this bundle needs {name} {relation} {wanted}, but the device on {adapter} has "
                             f"{have}", limit=name, value=have, requested=wanted)
