"""torch-meganeura: run PyTorch models on any Vulkan or Metal GPU through wgpu.

``torch.compile(model, backend="meganeura")`` works after ``pip install`` (entry point); ``explain`` reports
what a model lowers to; ``export`` writes a bundle that ``meganeura.runtime.load`` runs without torch;
``export_lm`` writes a language model's generation bundle (``load(path).generate(ids, n)``);
``compile_train_step`` runs forward, backward and the optimizer update on the device with weights kept there;
``profile`` times every dispatch on the GPU; ``keep_on_device(optimizer)`` keeps the ordinary training loop's
parameters, gradients and optimizer state on the device.

Subpackages, lowest first (a module imports only its own and lower ones: tests/runtime/test_no_torch_imports.py):
- ``lower``: aten to IR (the op registry, the lowerings, decompositions, partitions, sizes of dynamic graphs);
- ``tensors``: values that live on the device (parameters' device copies, ``ResidentTensor``, ``DeviceTensor``);
- ``backend``: the dynamo backend, its per-call path (``backend.per_call``) and the pipeline from an fx graph to a
  program that the backend, the training step and export share (``backend.device_graph``);
- ``training``: ``compile_train_step``, ``keep_on_device`` and the optimizer updates they trace;
- ``bundles``: ``export`` and ``export_lm``;
- ``coverage``: the OpInfo sweep (``python -m torch_meganeura.coverage``);
and ``demo`` (the main job, ``python -m torch_meganeura.demo``).
"""
from meganeura.runtime.device import get_device
from meganeura.runtime.profiler import profile as device_profile

from .backend.entry import FallbackError, meganeura_backend
from .training.keep_on_device import keep_on_device, sync_parameters
from .backend.explain import explain
from .tensors.device_tensor import uploaded
from .bundles.export import ExportError, export
from .training.step import TrainStep, compile_train_step


def export_lm(model, path, **kwargs) -> dict:
    """An HF causal language model as a generation bundle (``lm_export.export_lm``; imports transformers)."""
    from .bundles.lm_export import export_lm as export_generation_bundle  # noqa: PLC0415 - imports transformers

    return export_generation_bundle(model, path, **kwargs)


def to_device(tensor, adapter=None):
    """``tensor``'s values uploaded to the device now, as a CPU tensor (detached) that compiled calls bind without
    uploading it again, as a CUDA tensor made once with ``.cuda()`` is: a batch used by several calls, or put on the
    device ahead of its call. Eager code reads it as any tensor; a write to it goes up at the next compiled call."""
    return uploaded(tensor, get_device(adapter))


def profile(adapter=None):
    """``with torch_meganeura.profile() as prof:`` times every dispatch that the block runs on the device.

    ``prof.top()`` ranks kernels by GPU time and ``prof.save(path)`` writes a chrome trace
    (see ``meganeura.runtime.profiler``)."""
    return device_profile(get_device(adapter))


__version__ = "0.1.0"
__all__ = ["meganeura_backend", "explain", "export", "export_lm", "ExportError", "FallbackError", "compile_train_step",
           "TrainStep", "profile", "keep_on_device", "sync_parameters", "to_device", "__version__"]
