"""The generation bundle: a decoder language model as two plans over one static KV cache and one copy of the weights,
written by ``torch_meganeura.export_lm`` and read without torch.

Layout::

    lm.json               format name and version, producer, the cache, the phases, weights, file hashes
    weights.safetensors   every weight once, keyed by its name in the model's state dict
    tokenizer.json        optional: the Hugging Face ``tokenizers`` file of the model's tokenizer
    prefill/              a bundle (``bundle``) of ``prefill_tokens`` tokens at a time, its weights shared
    decode/               a bundle of one token, its weights shared

Both phases take ``input_ids`` [B, T] (int64; B the manifest's ``batch_size``), ``cache_position`` [T] (int64, the
same slots for every row), ``last`` [1] (the column of the token to predict from), ``temperature`` [1] and
``sampling`` [1] (float32; 0 for greedy) and the cache (``cache_0``...: a key and a value tensor per layer,
[B, kv heads, max_cache_len, head dim]), and where B > 1, ``prompt_start`` [B] (int64: the cache slot of each
row's first token; the rows are left-padded to a common end, their padding masked out); they return ``token`` [B]
(int64: the argmax of the scores, with Gumbel noise where sampling), ``scores`` [B, vocab] (the last column's
logits over the temperature) and the new cache, which the plans store over the old one. Version 2 added
``batch_size`` and ``prompt_start``. ``read_lm_bundle`` checks the
manifest and every file's SHA-256 (``manifest``, as a deploy bundle's), both phases (``read_bundle``) and that they
agree with the manifest on the cache.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .bundle import Bundle, prepare_directory, read_bundle, read_weights_file, weights_file, write_bundle
from .errors import BundleError
from .manifest import Format, check_file_list, check_keys, read_files, read_manifest, sha256

FORMAT_NAME = "meganeura-lm"
FORMAT_VERSION = 2
MANIFEST = "lm.json"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_FILE = "tokenizer.json"
PHASES = ("prefill", "decode")
INPUTS = ("input_ids", "cache_position", "last", "temperature", "sampling")  # then the cache
PADDING_INPUT = "prompt_start"  # after the cache, where batch_size > 1
OUTPUTS = ("token", "scores")  # then the new cache
MANIFEST_KEYS = {"format": str, "format_version": int, "producer": dict, "max_cache_len": int, "batch_size": int,
                 "prefill_tokens": int,
                 "vocab_size": int, "eos_token_ids": list, "cache": list, "weights": list,
                 "tokenizer": (str, type(None)), "files": dict}


def _from_version_1(manifest: dict) -> dict:
    """A version-1 manifest (before batched bundles) as version 2: its plans take one row and no ``prompt_start``."""
    return {**manifest, "format_version": FORMAT_VERSION, "batch_size": 1}


FORMAT = Format(FORMAT_NAME, FORMAT_VERSION, MANIFEST, MANIFEST_KEYS, "generation bundle", "torch_meganeura.export_lm",
                upgrades={1: _from_version_1})


@dataclass(frozen=True)
class WeightEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class LMBundle:
    path: Path
    manifest: dict
    phases: dict[str, Bundle]
    weights: dict[str, np.ndarray]  # by state dict name, shared by the phases

    @property
    def cache(self) -> list[dict]:
        return self.manifest["cache"]


def cache_name(i: int) -> str:
    return f"cache_{i}"


def write_lm_bundle(path, phases: dict, weights: dict[str, np.ndarray], dtypes: dict[str, str], meta: dict,
                    tokenizer: bytes | None = None, overwrite: bool = False) -> dict:
    """Write a generation bundle. ``phases``: phase name -> (plan, description) with shared params; ``weights``:
    host forms by state dict name, of logical ``dtypes``; ``meta``: producer, max_cache_len, batch_size, prefill_tokens,
    vocab_size, eos_token_ids, cache. lm.json is written last."""
    path = Path(path)
    prepare_directory(path, overwrite, MANIFEST)
    files = {WEIGHTS_FILE: weights_file(weights, dtypes)}
    if tokenizer is not None:
        files[TOKENIZER_FILE] = tokenizer
    for name, data in files.items():
        (path / name).write_bytes(data)
    for phase, (plan, description) in phases.items():
        write_bundle(path / phase, plan, description, None)
    manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **meta,
                "weights": [{"name": n, "shape": list(np.shape(a)), "dtype": dtypes[n]} for n, a in weights.items()],
                "tokenizer": TOKENIZER_FILE if tokenizer is not None else None,
                "files": {name: sha256(data) for name, data in sorted(files.items())}}
    check_keys(manifest, MANIFEST_KEYS, MANIFEST)
    _check_manifest(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def is_lm_bundle(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_lm_bundle(path) -> LMBundle:
    """Read and validate the generation bundle at ``path``; raise BundleError naming the problem."""
    path = Path(path)
    try:
        manifest = read_manifest(path, FORMAT)
        _check_manifest(manifest)
        data = read_files(path, manifest, FORMAT)
        specs = {e["name"]: WeightEntry(e["name"], tuple(e["shape"]), e["dtype"]) for e in manifest["weights"]}
        weights = read_weights_file(data[WEIGHTS_FILE], specs)
        for phase in PHASES:
            if not (path / phase).is_dir():
                raise BundleError(f"missing phase {phase}/ (a bundle directory)")
    except BundleError as err:
        raise BundleError(f"generation bundle {path}: {err}") from err.__cause__
    phases = {phase: read_bundle(path / phase, shared_weights=weights) for phase in PHASES}
    for phase, bundle in phases.items():
        try:
            _check_phase(manifest, phase, bundle.manifest)
        except BundleError as err:
            raise BundleError(f"generation bundle {path}: {err}") from None
    return LMBundle(path, manifest, phases, weights)


def _check_manifest(manifest: dict) -> None:
    """The manifest's batch size, prefill length, tokenizer and file list (its keys and their types checked
    before)."""
    if manifest["batch_size"] < 1:
        raise BundleError(f"{MANIFEST}: batch_size {manifest['batch_size']} must be at least 1")
    if not 0 < manifest["prefill_tokens"] <= manifest["max_cache_len"]:
        raise BundleError(f"{MANIFEST}: prefill_tokens {manifest['prefill_tokens']} must lie in 1..max_cache_len")
    expected = {WEIGHTS_FILE} | ({TOKENIZER_FILE} if manifest["tokenizer"] is not None else set())
    if manifest["tokenizer"] not in (None, TOKENIZER_FILE):
        raise BundleError(f"{MANIFEST}: 'tokenizer' is {manifest['tokenizer']!r}, expected {TOKENIZER_FILE!r} or null")
    check_file_list(manifest, expected, FORMAT)


def _check_phase(manifest: dict, phase: str, bundle_manifest: dict) -> None:
    """A phase takes and returns what the module docstring says, its cache as the manifest's, at its length."""
    length = manifest["prefill_tokens"] if phase == "prefill" else 1
    batch = manifest["batch_size"]
    cache = [cache_name(i) for i in range(len(manifest["cache"]))]
    padding = [PADDING_INPUT] if batch > 1 else []
    inputs = {e["name"]: e for e in bundle_manifest["inputs"]}
    outputs = {e["name"]: e for e in bundle_manifest["outputs"]}
    if list(inputs) != [*INPUTS, *cache, *padding] or list(outputs) != [*OUTPUTS, *cache]:
        raise BundleError(f"phase {phase} takes {list(inputs)} and returns {list(outputs)}, expected "
                          f"{[*INPUTS, 'cache_0...', *padding]} and {[*OUTPUTS, 'cache_0...']}")
    if inputs["input_ids"]["shape"] != [batch, length]:
        raise BundleError(f"phase {phase} takes input_ids of shape {inputs['input_ids']['shape']}, expected "
                          f"[{batch}, {length}]")
    for name, entry in zip(cache, manifest["cache"]):
        for side in (inputs[name], outputs[name]):
            if (side["shape"], side["dtype"]) != (entry["shape"], entry["dtype"]):
                raise BundleError(f"phase {phase}'s {name} is {side['dtype']}{side['shape']}, the cache is "
                                  f"{entry['dtype']}{entry['shape']}")
