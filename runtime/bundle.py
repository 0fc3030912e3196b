"""The deploy bundle: a directory holding a model's plan, kernels and weights, written and read without torch.

Layout (the directory form; there is no single-file form)::

    manifest.json         format name and version, producer, inputs/outputs/params, requirements, file hashes
    plan.json             the static dispatch plan (``Plan.to_dict``), each kernel named, its WGSL in kernels/
    kernels/<name>.wgsl   one WGSL compute shader per kernel, entry point ``main``
    weights.safetensors   every param tensor, keyed by its plan name, in its logical dtype; absent where the
                          manifest says ``"weights": "shared"``: a phase of a generation bundle (``lm_bundle``)
                          takes its params, by ``source`` name, from the weights of the bundle around it

``read_bundle`` validates everything before anything reaches a device: the manifest's format, version and
shape; every file against its SHA-256 in the manifest (a truncated or edited file is refused by name); the plan
(``Plan.from_dict``); the manifest against the plan (names, shapes, dtypes, kernels); the weights against the
plan's params. Only JSON, safetensors (no pickle) and WGSL are read; nothing in the bundle is executed except
the WGSL later handed to wgpu. Every failure raises ``BundleError`` naming the bundle and the problem.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors
from safetensors import SafetensorError, deserialize, serialize

from .errors import BundleError
from .dtypes import HOST_DTYPE
from meganeura.kernels.sizes import Guards, SizeError, size_json

from .manifest import Format, check_file_list, check_keys, read_files, read_manifest, sha256
from .plan import SIZES_INPUT, Plan, TensorSpec

FORMAT_NAME = "meganeura-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN_FILE = "plan.json"
WEIGHTS_FILE = "weights.safetensors"
KERNEL_DIR = "kernels"

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")  # input/output names: also file names in ``meganeura run``
KERNEL_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
# Manifest keys -> type; a tensor entry's keys -> type.
MANIFEST_KEYS = {"format": str, "format_version": int, "producer": dict, "inputs": list, "outputs": list,
                 "params": list, "rng_input": (str, type(None)), "kernels": list, "requires": dict, "files": dict}
TENSOR_KEYS = {"name": str, "plan_name": str, "shape": list, "dtype": str}
SYMBOL_KEYS = {"input": str, "dim": int, "min": int, "max": int}  # a dynamic dimension of the manifest's inputs
SHARED_WEIGHTS = "shared"  # the manifest's optional "weights": params by source name, from the containing bundle
FORMAT = Format(FORMAT_NAME, FORMAT_VERSION, MANIFEST, MANIFEST_KEYS, "bundle", "torch_meganeura.export")


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: dict
    plan: Plan
    weights: dict[str, np.ndarray]  # plan param name -> array


def kernel_file(name: str) -> str:
    return f"{KERNEL_DIR}/{name}.wgsl"


def tensor_entry(name: str, spec: TensorSpec, **extra) -> dict:
    """The manifest entry of a plan tensor exposed as ``name`` (a symbolic size in its JSON form: ``dynamic``)."""
    return {"name": name, "plan_name": spec.name, "shape": _shape_json(spec.shape), "dtype": spec.dtype, **extra}


def _shape_json(shape) -> list:
    return [size_json(s) for s in shape]


# ---- writing


def write_bundle(path, plan: Plan, description: dict, weights: dict[str, np.ndarray] | None,
                 overwrite: bool = False) -> dict:
    """Write ``plan``, its kernels and ``weights`` under ``path`` and return the manifest.

    ``description`` holds the manifest's producer, inputs, outputs, params, rng_input and requires; this adds the
    format, the kernel names and the file hashes. ``weights`` None writes a bundle whose params are shared (each
    param entry names its ``source`` in the containing bundle's weights). The manifest is written last, so an
    interrupted write leaves no loadable bundle. An existing bundle at ``path`` is replaced only with ``overwrite``."""
    path = Path(path)
    plan_dict = plan.to_dict()
    plan_dict["kernels"] = sorted(plan.kernels)
    files = {PLAN_FILE: json.dumps(plan_dict, indent=1).encode()}
    if weights is not None:
        files[WEIGHTS_FILE] = weights_file(weights, {t.name: t.dtype for t in plan.params})
    files.update({kernel_file(name): wgsl.encode() for name, wgsl in plan.kernels.items()})
    manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **description,
                "kernels": sorted(plan.kernels), "files": {name: sha256(data) for name, data in sorted(files.items())}}
    if weights is None:
        manifest["weights"] = SHARED_WEIGHTS
    check_keys(manifest, MANIFEST_KEYS, MANIFEST)
    _check_manifest(manifest)  # also: every kernel name is a safe file name
    prepare_directory(path, overwrite)
    (path / KERNEL_DIR).mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def prepare_directory(path: Path, overwrite: bool, manifest: str = MANIFEST) -> None:
    """An empty directory at ``path``: created, or emptied where ``overwrite`` and it holds a bundle (``manifest``);
    anything else there is refused, untouched."""
    if path.exists() and not path.is_dir():
        raise BundleError(f"{path} exists and is not a directory")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise BundleError(f"{path} exists and is not empty; pass overwrite=True to replace a bundle there")
        if not (path / manifest).is_file():
            raise BundleError(f"{path} is not empty and holds no bundle: not replaced")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)


# ---- reading


def read_bundle(path, shared_weights: dict[str, np.ndarray] | None = None) -> Bundle:
    """Read and validate the bundle at ``path`` (see the module docstring); raise BundleError on any problem. A
    bundle with shared weights takes them from ``shared_weights`` (by source name, read by its container)."""
    path = Path(path)
    try:
        manifest = read_manifest(path, FORMAT)
        _check_manifest(manifest)
        data = read_files(path, manifest, FORMAT)
        plan = _read_plan(data, manifest)
        _check_against_plan(manifest, plan)
        specs = {t.name: t for t in plan.params}
        if manifest.get("weights") != SHARED_WEIGHTS:
            weights = read_weights_file(data[WEIGHTS_FILE], specs)
        elif shared_weights is None:
            raise BundleError("its weights are those of the generation bundle around it: load that bundle")
        else:
            weights = _shared(manifest, specs, shared_weights)
    except BundleError as err:
        raise BundleError(f"bundle {path}: {err}") from err.__cause__
    return Bundle(path, manifest, plan, weights)


def _shared(manifest: dict, specs: dict, shared: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The plan's params from the container's weights, by each param entry's ``source``, checked."""
    weights = {}
    for entry in manifest["params"]:
        source = entry.get("source")
        if source not in shared:
            raise BundleError(f"param {entry['plan_name']!r} names source {source!r}, which the shared weights lack")
        spec, array = specs[entry["plan_name"]], shared[source]
        if array.shape != spec.shape or array.dtype != np.dtype(HOST_DTYPE[spec.dtype]):
            raise BundleError(f"shared weight {source!r} is {array.dtype}{list(array.shape)}, param "
                              f"{spec.name!r} needs {spec.dtype}{list(spec.shape)}")
        weights[spec.name] = array
    return weights


def _check_manifest(manifest: dict) -> None:
    """The manifest's names, requirements, kernels and file list (its keys and their types checked before)."""
    for group in ("inputs", "outputs", "params"):
        for entry in manifest[group]:
            check_keys(entry, TENSOR_KEYS, f"an entry of {group}")
            if group != "params" and not NAME.match(entry["name"]):
                raise BundleError(f"{group[:-1]} name {entry['name']!r} is not a plain name")
        names = [entry["name"] for entry in manifest[group]]
        if len(set(names)) != len(names):
            raise BundleError(f"{group} names are not unique: {names}")
    requires = manifest["requires"]
    if not (isinstance(requires.get("features"), list) and all(isinstance(f, str) for f in requires["features"])
            and isinstance(requires.get("limits"), dict)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in requires["limits"].values())):
        raise BundleError("'requires' must hold a list of feature names and a dict of integer limits")
    for name in manifest["kernels"]:
        if not isinstance(name, str) or not KERNEL_NAME.match(name):
            raise BundleError(f"kernel name {name!r} is not a safe file name")
    if "dynamic" in manifest:
        dynamic_sizes(manifest)
    if manifest.get("weights", SHARED_WEIGHTS) != SHARED_WEIGHTS:
        raise BundleError(f"'weights' is {manifest['weights']!r}; the only value it may take is {SHARED_WEIGHTS!r}")
    own = set() if manifest.get("weights") == SHARED_WEIGHTS else {WEIGHTS_FILE}
    expected = {PLAN_FILE} | own | {kernel_file(name) for name in manifest["kernels"]}
    check_file_list(manifest, expected, FORMAT)


def dynamic_sizes(manifest: dict) -> tuple[list[dict], Guards]:
    """A bundle's dynamic dimensions (``manifest["dynamic"]``): each symbol's input, dimension and declared range,
    and the guards the plan's sizes must meet. Checked here; anything else raises BundleError."""
    dynamic = manifest.get("dynamic", {"symbols": [], "lower": [], "guards": []})
    inputs = {entry["name"]: entry for entry in manifest["inputs"]}
    symbols = dynamic.get("symbols") if isinstance(dynamic, dict) else None
    if not isinstance(symbols, list):
        raise BundleError("'dynamic' must hold a list of symbols")
    for symbol in symbols:
        check_keys(symbol, SYMBOL_KEYS, "a dynamic symbol")
        entry = inputs.get(symbol["input"])
        if entry is None or not 0 <= symbol["dim"] < len(entry["shape"]) or not 0 <= symbol["min"] <= symbol["max"]:
            raise BundleError(f"dynamic symbol {symbol} does not name a dimension of an input with a range")
    try:
        guards = Guards.from_json(dynamic, len(symbols))
    except SizeError as err:
        raise BundleError(f"'dynamic': {err}") from err
    return symbols, guards


def _read_plan(data: dict[str, bytes], manifest: dict) -> Plan:
    try:
        plan_dict = json.loads(data[PLAN_FILE])
        names = plan_dict["kernels"]
        if sorted(names) != sorted(manifest["kernels"]):
            raise BundleError(f"{PLAN_FILE} names kernels {sorted(names)}, {MANIFEST} names "
                              f"{sorted(manifest['kernels'])}")
        plan_dict["kernels"] = {name: data[kernel_file(name)].decode() for name in names}
        return Plan.from_dict(plan_dict)
    except BundleError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise BundleError(f"{PLAN_FILE} is not a valid plan: {err}") from err


def _check_against_plan(manifest: dict, plan: Plan) -> None:
    """Names, shapes and dtypes of the manifest's inputs, outputs and params against the plan's tensors."""
    rng = [manifest["rng_input"]] if manifest["rng_input"] else []
    rng += [SIZES_INPUT] if plan.symbols else []  # (the runtime writes the symbols' values there itself)
    groups = (("inputs", plan.inputs, rng), ("outputs", plan.outputs, []), ("params", plan.params, []))
    for group, specs, extra in groups:
        by_name = {t.name: t for t in specs}
        listed = [entry["plan_name"] for entry in manifest[group]] + extra
        if sorted(set(listed)) != sorted(by_name):
            raise BundleError(f"{MANIFEST} {group} {sorted(set(listed))} do not match the plan's {sorted(by_name)}")
        for entry in manifest[group]:
            spec = by_name[entry["plan_name"]]
            if entry["shape"] != _shape_json(spec.shape) or entry["dtype"] != spec.dtype:
                raise BundleError(f"{MANIFEST} says {group[:-1]} {entry['name']!r} is {entry['dtype']}"
                                  f"{entry['shape']}, the plan says {spec.dtype}{list(spec.shape)}")


# Logical dtype <-> safetensors' header name. safetensors' numpy API has no bfloat16 (numpy has none), so weights go
# through its framework-free serialize/deserialize, with bfloat16 in its host form (raw bits as uint16).
SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", "int32": "I32",
                     "bool": "BOOL"}


def weights_file(weights: dict[str, np.ndarray], dtypes: dict[str, str]) -> bytes:
    """``weights`` (host forms, by name) as a safetensors file that names each one's logical dtype (``dtypes``)."""
    arrays = {name: np.array(array, HOST_DTYPE[dtypes[name]], order="C")  # 0-d stays 0-d
              for name, array in weights.items()}
    if hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.8 serializes raw memory, dtypes spelled as numpy's
        return serialize({name: safetensors.TensorSpec(dtype=dtypes[name], shape=list(a.shape), data_ptr=a.ctypes.data,
                                                       data_len=a.nbytes) for name, a in arrays.items()})
    return serialize({name: {"dtype": SAFETENSORS_DTYPE[dtypes[name]], "shape": list(a.shape), "data": a.tobytes()}
                      for name, a in arrays.items()})


def read_weights_file(data: bytes, specs: dict) -> dict[str, np.ndarray]:
    """The weights in ``data`` (a safetensors file) in host form, each checked against ``specs`` (name -> an object
    with ``shape`` and logical ``dtype``: a plan param, or a generation bundle's weight entry)."""
    try:
        entries = dict(deserialize(data))
    except (SafetensorError, ValueError) as err:
        raise BundleError(f"{WEIGHTS_FILE} is not a valid safetensors file: {err}") from err
    if sorted(entries) != sorted(specs):
        raise BundleError(f"{WEIGHTS_FILE} holds {sorted(entries)}, expected {sorted(specs)}")
    weights = {}
    for name, entry in entries.items():
        spec = specs[name]
        if tuple(entry["shape"]) != tuple(spec.shape) or entry["dtype"] != SAFETENSORS_DTYPE[spec.dtype]:
            raise BundleError(f"weight {name!r} is {entry['dtype']}{list(entry['shape'])}, it must be "
                              f"{SAFETENSORS_DTYPE[spec.dtype]}{list(spec.shape)} ({spec.dtype})")
        try:
            weights[name] = np.frombuffer(entry["data"], HOST_DTYPE[spec.dtype]).reshape(spec.shape)
        except ValueError as err:
            raise BundleError(f"weight {name!r}: {err}") from err
    return weights
