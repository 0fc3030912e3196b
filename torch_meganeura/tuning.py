"""The ``tune`` option: compile plans with matmul variants timed on the device instead of chosen by rule.

With ``options={"tune": True}`` (or, where the option is not given, the environment variable ``MEGANEURA_TUNE=1``)
each tiled GEMM shape of a plan is timed once per adapter in a few variants and the fastest kept
(``meganeura.kernels.matmul_tuning``). The choices are remembered in the plan cache's directory, so the cost (on
an H200 0.25-0.9 s per new shape, mostly compiling the candidate kernels) is paid once per adapter, and tuned plans
are cached apart from untuned ones.
"""
from __future__ import annotations

import functools
import os

from meganeura.kernels.matmul_tuning import MatmulTuner
from meganeura.lowering.plan_cache import cache_dir, cached_compile_graph

TUNE_ENV = "MEGANEURA_TUNE"


def tuning_enabled(option: bool | None) -> bool:
    """The option where given, else whether ``MEGANEURA_TUNE`` is 1."""
    return option if option is not None else os.environ.get(TUNE_ENV, "") == "1"


@functools.lru_cache(maxsize=None)
def tuner_for(device) -> MatmulTuner:
    return MatmulTuner(device, cache_dir())


def compile_plan(graph, device, tune: bool):
    """``cached_compile_graph`` for ``device``, with its tuner's matmul choices where ``tune``."""
    if not tune:
        return cached_compile_graph(graph, device.limits)
    tuner = tuner_for(device)
    return cached_compile_graph(graph, device.limits, tuner.choose_all, tuner.fingerprint)
