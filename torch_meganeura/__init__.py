"""torch-meganeura: run PyTorch models on any Vulkan or Metal GPU through wgpu.

``torch.compile(model, backend="meganeura")`` works after ``pip install`` (entry point); ``explain`` reports
what a model lowers to; ``export`` writes a bundle that ``meganeura.runtime.load`` runs without torch;
``compile_train_step`` runs forward, backward and the optimizer update on the device with weights kept there.
"""
from .backend import FallbackError, meganeura_backend
from .explain import explain
from .export import ExportError, export
from .train_step import TrainStep, compile_train_step

__version__ = "0.1.0"
__all__ = ["meganeura_backend", "explain", "export", "ExportError", "FallbackError", "compile_train_step", "TrainStep",
           "__version__"]
