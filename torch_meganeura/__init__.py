"""torch-meganeura: run PyTorch models on any Vulkan or Metal GPU through wgpu.

``torch.compile(model, backend="meganeura")`` works after ``pip install`` (entry point); ``explain`` reports
what a model lowers to; ``export`` writes a bundle that ``meganeura.runtime.load`` runs without torch.
"""
from .backend import FallbackError, meganeura_backend
from .explain import explain
from .export import ExportError, export

__version__ = "0.1.0"
__all__ = ["meganeura_backend", "explain", "export", "ExportError", "FallbackError", "__version__"]
