"""The torch-free runtime: load a plan, run it on a wgpu device. Imports only numpy, wgpu, safetensors and
``meganeura.kernels`` (the generators' limit names; the matmul tuner's candidates), never ``meganeura.lowering``.

Modules: ``plan`` (the plan format), ``dtypes`` (logical dtypes, their device storage and host form), ``device``
(adapter choice, the process-wide device), ``program`` (a plan instantiated on a device, and the replay of it at
every call) with ``program_resources`` (what a program builds once: buffers, pipelines, bind groups, params),
``program_recording`` (how its runs' commands are recorded), ``program_plan``
(what a program reads off its plan once: submission parts, indirect slots, a run's sizes), ``program_checks`` (a plan
against the device's limits, host arrays against their specs, the read-back's bytes taken apart),
``program_inputs`` (a run's device inputs checked and bound in loops run by C), ``arena`` (the
intermediates' buffer, one per device), ``readback`` (the staging buffers whose mapped memory the outputs view),
``in_flight`` (runs submitted and not yet waited for: asynchronous execution, deferred status errors),
``native`` (the replay loop's direct wgpu-native calls), ``profiler`` (per-dispatch GPU timestamps), ``resident``
(arrays kept on the device and their buffer pool), ``bundle`` (the deploy bundle format), ``manifest`` (the
manifest and file reader both bundle kinds share), ``requirements`` (what a plan needs of an adapter), ``model``
(``load``: a bundle as a callable), ``lm_bundle`` and ``generate`` (a language model's generation bundle and its
``LanguageModel``) with ``run_ahead`` (decode steps submitted ahead of the reads of their tokens), ``cli`` and
``__main__`` (the ``meganeura`` command), ``timing`` and ``matmul_tuner`` (kernel variants timed on the device),
``errors``, ``counters``.
``Device``, ``get_device``, ``list_adapters``, ``Program``, ``load``, ``Model`` and ``LanguageModel`` are
importable from here; they load on first use so that importing ``meganeura.runtime.plan`` stays free of wgpu.
"""
from importlib import import_module

from .errors import (
    BundleError, DeviceLostError, FeatureError, InputError, KernelStatusError, LimitError, MeganeuraError,
    NoAdapterError,
)
from .plan import Plan

_LAZY = {
    "Device": "device", "get_device": "device", "list_adapters": "device", "Program": "program",
    "load": "model", "Model": "model", "LanguageModel": "generate",
}

__all__ = [
    "BundleError", "DeviceLostError", "FeatureError", "InputError", "KernelStatusError", "LimitError",
    "MeganeuraError", "NoAdapterError", "Plan",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
