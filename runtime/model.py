"""``load(path)``: a deploy bundle as a callable model, numpy arrays in, numpy arrays out, no torch.

The bundle is read and validated first (``bundle.read_bundle``), then checked against the device's features and
limits (``requirements.check_requirements``); only then are device objects built: one ``Program`` (buffers,
pipelines, bind groups) and the weights, uploaded once. Every call uploads the inputs and replays the same plan.

Calling: ``model(a, b)`` binds positional arrays to the manifest's inputs in order, ``model(input_ids=...)``
binds them by name (the names of the traced model's arguments); both may be mixed. Arrays must have exactly
the shape and dtype the manifest lists (``model.inputs``), else ``InputError``. A call returns a dict of the
outputs by name, in the manifest's order (``model.outputs``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from meganeura.kernels.sizes import from_json

from .bundle import Bundle, dynamic_sizes, read_bundle
from .device import Device, get_device
from .errors import InputError
from .generate import LanguageModel
from .lm_bundle import is_lm_bundle, read_lm_bundle
from .program import Program
from .requirements import check_requirements

_INT32 = np.iinfo(np.int32)


def load(path, adapter: str | int | None = None, seed: int | None = None):
    """Load the bundle at ``path`` onto ``adapter`` (index or name substring; default as ``get_device``): a
    ``Model``, or for a generation bundle (``torch_meganeura.export_lm``) a ``generate.LanguageModel``.

    ``seed`` seeds the generator that keys random ops (dropout, rand), for bundles that have them."""
    if is_lm_bundle(path):
        return LanguageModel(read_lm_bundle(path), get_device(adapter))
    bundle = read_bundle(path)
    return Model(bundle, get_device(adapter), seed)


class Model:
    """A bundle instantiated on a device. ``inputs`` / ``outputs``: the manifest's entries (name, shape, dtype)."""

    def __init__(self, bundle: Bundle, device: Device, seed: int | None = None):
        check_requirements(bundle.manifest["requires"], device.features, device.limits, device.describe())
        self.path: Path = bundle.path
        self.manifest = bundle.manifest
        self.device = device
        self.inputs = bundle.manifest["inputs"]
        self.outputs = bundle.manifest["outputs"]
        self.dynamic, self._guards = dynamic_sizes(bundle.manifest)  # dimensions that may vary, and their rules
        self._rng_input = bundle.manifest["rng_input"]
        self._rng = np.random.default_rng(seed)
        self.program = Program(device, bundle.plan)
        self.program.upload_params(bundle.weights)

    @property
    def input_names(self) -> list[str]:
        return [entry["name"] for entry in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [entry["name"] for entry in self.outputs]

    def __call__(self, *args: np.ndarray, **kwargs: np.ndarray) -> dict[str, np.ndarray]:
        arrays, sizes = self._bind(args, kwargs)
        feed = {entry["plan_name"]: arrays[entry["name"]] for entry in self.inputs}
        if self._rng_input:
            feed[self._rng_input] = self._rng.integers(_INT32.min, _INT32.max, size=2, dtype=np.int32, endpoint=True)
        results = self.program.run(feed, sizes=sizes)
        return {entry["name"]: results[entry["plan_name"]] for entry in self.outputs}

    def _bind(self, args: tuple, kwargs: dict) -> tuple[dict[str, np.ndarray], tuple]:
        """The inputs by name, checked, and the values of the bundle's dynamic dimensions in them."""
        names = self.input_names
        if len(args) > len(names):
            raise InputError(f"{len(args)} positional inputs given, the model takes {len(names)}: {names}")
        bound = dict(zip(names, args))
        twice = sorted(set(bound) & set(kwargs))
        unknown = sorted(set(kwargs) - set(names))
        bound.update(kwargs)
        missing = [name for name in names if name not in bound]
        problems = [f"{what} {items}" for what, items in
                    (("given twice:", twice), ("unknown:", unknown), ("missing:", missing)) if items]
        if problems:
            raise InputError(f"inputs {'; '.join(problems)}; the model takes {names}")
        sizes = self._sizes(bound)
        for entry in self.inputs:
            _check_input(entry, bound[entry["name"]], sizes)
        return bound, sizes

    def _sizes(self, bound: dict) -> tuple:
        """The dynamic dimensions' values in the inputs ``bound``, each within its declared range and all meeting
        the plan's guards."""
        sizes = []
        for symbol in self.dynamic:
            value = bound[symbol["input"]]
            shape = getattr(value, "shape", ())
            if not isinstance(value, np.ndarray) or len(shape) <= symbol["dim"]:
                continue  # (reported by _check_input)
            size = shape[symbol["dim"]]
            if not symbol["min"] <= size <= symbol["max"]:
                raise InputError(f"input {symbol['input']!r} dimension {symbol['dim']} is {size}; this bundle takes "
                                 f"{symbol['min']} to {symbol['max']}")
            sizes.append(size)
        if len(sizes) == len(self.dynamic) and not self._guards.check(tuple(sizes)):
            failed = ", ".join(self._guards.describe(sizes)) or "each at least its min"
            raise InputError(f"sizes {tuple(sizes)} of the dynamic dimensions ({self._dims()}) are not ones this "
                             f"bundle's plan serves: it needs {failed} (s[k]: the k-th dynamic dimension)")
        return tuple(sizes)

    def _dims(self) -> str:
        return ", ".join(f"{s['input']}[{s['dim']}]" for s in self.dynamic)

    def release(self) -> None:
        """Free the device buffers of this model; it cannot be called afterwards."""
        self.program.release()

    def __repr__(self) -> str:
        shapes = ", ".join(f"{e['name']}: {e['dtype']}{e['shape']}" for e in self.inputs)
        return f"<meganeura Model {self.path} ({shapes}) on {self.device.describe()}>"


def _check_input(entry: dict, value, sizes: tuple) -> None:
    """``value`` must be a numpy array of exactly the entry's dtype and shape (no silent conversion; a dynamic
    dimension at the size its symbols' values give)."""
    shape = tuple(from_json(s, sizes) for s in entry["shape"]) if len(sizes) else tuple(entry["shape"])
    wanted = tuple(s if isinstance(s, int) else s.hint for s in shape)
    want = f"{entry['dtype']} array of shape {wanted}"
    if not isinstance(value, np.ndarray):
        raise InputError(f"input {entry['name']!r} must be a numpy {want}, got {type(value).__name__}")
    if value.dtype != np.dtype(entry["dtype"]) or value.shape != wanted:
        raise InputError(f"input {entry['name']!r} must be a {want}, got {value.dtype} of shape {value.shape}")
