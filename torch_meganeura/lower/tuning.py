"""The ``tune`` and ``precision`` options: how a plan's matmul variants are chosen and which may use f16.

With ``options={"tune": True}`` (or, where the option is not given, the environment variable ``MEGANEURA_TUNE=1``)
each tiled GEMM kernel of a plan (its shape, and its own loads and store: a convolution's gather, a fused
epilogue) is timed once per adapter in a few variants and the fastest kept (``meganeura.runtime.matmul_tuner``).
The choices are remembered in the plan cache's directory, so the cost (on an H200 0.1-0.9 s per new kernel, mostly
compiling the candidates) is paid once per adapter, and tuned plans are cached apart from untuned ones.

With ``options={"precision": "fast"}`` the forward graphs' (inference and training forward) tiled matmuls and
convolutions may form their products in f16: operands rounded to f16, each K chunk of at most 16 products summed in
f16, the chunks in f32 (``meganeura.kernels.matmul``). Untuned, the 4x4-register-block variants use it; tuned, the
f16 variants are timed beside the f32 ones and kept only where faster. Backward graphs stay f32. It needs the
adapter's shader-f16 feature; without it plans stay f32, with a warning.
"""
from __future__ import annotations

import functools
import os

from meganeura.kernels.matmul_plans import F16_PRODUCTS
from meganeura.lowering import FusedGraph, fuse_graph, schedule_fused
from meganeura.lowering.plan_cache import cache_dir, cached_compile_graph
from meganeura.runtime.matmul_tuner import MatmulTuner

TUNE_ENV = "MEGANEURA_TUNE"


def tuning_enabled(option: bool | None) -> bool:
    """The option where given, else whether ``MEGANEURA_TUNE`` is 1."""
    return option if option is not None else os.environ.get(TUNE_ENV, "") == "1"


@functools.lru_cache(maxsize=None)
def tuner_for(device) -> MatmulTuner:
    return MatmulTuner(device, cache_dir())


def compile_plan(graph, device, tune: bool, f16_products: bool = False, limits: dict | None = None):
    """``cached_compile_graph`` for ``device``, with its tuner's matmul choices where ``tune``, and f16 products
    allowed where ``f16_products`` (the caller checks the shader-f16 feature). The device starts compiling each
    kernel as soon as it is generated. With ``limits`` (a bundle's: WebGPU's defaults) the plan is compiled for
    those instead, untuned, and the device compiles nothing."""
    if limits is not None:
        return cached_compile_graph(graph, limits)
    limits, choose, tuned_for, on_kernel = _compile_options(device, tune, f16_products)
    return cached_compile_graph(graph, limits, choose, tuned_for, on_kernel=on_kernel)


def fuse_for(graph, device, f16_products: bool = False) -> FusedGraph:
    """``graph`` through the fusion passes for ``device`` (``fuse_graph``), not through the plan cache: a dynamic
    graph's, which the cache does not keep, and whose fused graph its compile keeps (``schedule_for``)."""
    return fuse_graph(graph, _compile_options(device, False, f16_products)[0])


def schedule_for(fused: FusedGraph, device, tune: bool, f16_products: bool = False):
    """``fused``'s plan for ``device``, with the options of ``compile_plan`` (``schedule_fused``)."""
    limits, choose, _, on_kernel = _compile_options(device, tune, f16_products)
    return schedule_fused(fused, limits, choose, on_kernel)


def _compile_options(device, tune: bool, f16_products: bool) -> tuple:
    """(limits, matmul chooser, what it tuned for, kernel hook) of a compile for ``device``."""
    limits = dict(device.limits, **{F16_PRODUCTS: 1}) if f16_products else device.limits

    def compile_ahead(source: str, bindings: int, key: str) -> None:
        device.compile_ahead([(source, bindings, key)])

    if not tune:
        return limits, None, None, compile_ahead
    tuner = tuner_for(device)
    return limits, tuner.choose_all, tuner.fingerprint, compile_ahead
