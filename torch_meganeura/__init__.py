"""torch-meganeura: run PyTorch models on any Vulkan or Metal GPU through wgpu.

``torch.compile(model, backend="meganeura")`` works after ``pip install`` (entry point); ``explain`` reports
what a model lowers to; ``export`` writes a bundle that ``meganeura.runtime.load`` runs without torch;
``export_lm`` writes a language model's generation bundle (``load(path).generate(ids, n)``);
``compile_train_step`` runs forward, backward and the optimizer update on the device with weights kept there;
``profile`` times every dispatch on the GPU; ``keep_on_device(optimizer)`` keeps the ordinary training loop's
parameters, gradients and optimizer state on the device.

Modules, by the way a graph travels:
- entry points: ``backend`` (the dynamo backend), ``options`` (its options, validated), ``tuning`` (the ``tune`` and
  ``precision`` options), ``explain``, ``export`` (a deploy bundle), ``lm_export`` (a generation bundle), ``demo``
  (the main job, ``python -m torch_meganeura.demo``);
- aten to IR: ``decompositions`` (the table handed to aot_autograd), ``registry`` (aten overload -> lowering) and
  ``aten`` (the lowerings, one module per op family), ``partition`` (device partitions and eager fallbacks, with
  reasons), ``fx_lowering`` (an fx graph into the IR), ``symbolic`` (a dynamic graph's sizes);
- running: ``device_graph`` (fx graph -> plan -> program, shared by the backend, the step and export), ``compiled``
  (a device partition, one plan per input signature), ``params`` (device copies of parameters and buffers),
  ``resident`` (``ResidentTensor``: data left on the device), ``device_tensor`` (``DeviceParameter``,
  ``DeviceTensor``);
- training: ``saved_values`` (what a forward keeps for its backward), ``train_step`` (``compile_train_step``),
  ``train_spec`` (what a step trains, fixed once),
  ``train_trace`` (a step traced into one graph), ``train_segments`` (a loss dynamo cannot capture whole),
  ``roles`` and ``role_program`` (a step's graphs by role), ``optimizers`` (torch.optim updates as traceable
  functions), ``device_optimizer`` (``keep_on_device``), ``data_parallel`` (gradients averaged across processes),
  ``dynamo_capture`` (logging calls that would break a graph);
- the OpInfo sweep: ``coverage`` (``python -m torch_meganeura.coverage``), ``coverage_step`` (the resident step's
  path), ``coverage_compare`` (how a result is judged), ``coverage_report`` (the JSON and markdown report).
"""
from meganeura.runtime.device import get_device
from meganeura.runtime.profiler import profile as device_profile

from .backend import FallbackError, meganeura_backend
from .device_optimizer import keep_on_device, sync_parameters
from .explain import explain
from .export import ExportError, export
from .train_step import TrainStep, compile_train_step


def export_lm(model, path, **kwargs) -> dict:
    """An HF causal language model as a generation bundle (``lm_export.export_lm``; imports transformers)."""
    from .lm_export import export_lm as export_generation_bundle  # noqa: PLC0415 - imports transformers

    return export_generation_bundle(model, path, **kwargs)


def profile(adapter=None):
    """``with torch_meganeura.profile() as prof:`` times every dispatch that the block runs on the device.

    ``prof.top()`` ranks kernels by GPU time and ``prof.save(path)`` writes a chrome trace
    (see ``meganeura.runtime.profiler``)."""
    return device_profile(get_device(adapter))


__version__ = "0.1.0"
__all__ = ["meganeura_backend", "explain", "export", "export_lm", "ExportError", "FallbackError", "compile_train_step", "TrainStep",
           "profile", "keep_on_device", "sync_parameters", "__version__"]
