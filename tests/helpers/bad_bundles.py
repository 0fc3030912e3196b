"""Damage that either kind of bundle must refuse with the same message: a deploy bundle (``manifest.json``) and a
generation bundle (``lm.json``) share their manifest and file reader (``meganeura.runtime.manifest``), so
tests/torch/test_export.py and test_export_lm.py each run every case of ``SHARED`` on their kind.

Each case is ``(damage, message)``: ``damage(path, kind)`` breaks the bundle at ``path``; ``message`` is a template
that ``expected(case, kind)`` fills in with the kind's manifest name, format and writer.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from meganeura.runtime import bundle, lm_bundle


@dataclass(frozen=True)
class Kind:
    manifest: str  # the manifest's file name
    format: str  # the manifest's "format"
    kind: str  # the kind's name in messages
    writer: str  # the function that writes one
    kernels: str  # a folder of kernels, relative to the bundle
    version: int  # the format version this runtime reads


DEPLOY = Kind("manifest.json", "meganeura-bundle", "bundle", "torch_meganeura.export", "kernels", bundle.FORMAT_VERSION)
GENERATION = Kind("lm.json", "meganeura-lm", "generation bundle", "torch_meganeura.export_lm", "decode/kernels",
                  lm_bundle.FORMAT_VERSION)


def edit_manifest(path: Path, kind: Kind, edit) -> None:
    manifest = json.loads((path / kind.manifest).read_text())
    edit(manifest)
    (path / kind.manifest).write_text(json.dumps(manifest))


def replace(path: Path, kind: Kind, name: str, data: bytes) -> None:
    """Replace a file and record its new hash: a consistent-looking bundle, so the deeper checks are reached."""
    (path / name).write_bytes(data)
    edit_manifest(path, kind, lambda m: m["files"].__setitem__(name, hashlib.sha256(data).hexdigest()))


def truncate(path: Path, name: str) -> None:
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) // 2])


def kernel(path: Path, kind: Kind) -> Path:
    return sorted((path / kind.kernels).iterdir())[0]


SHARED = {
    "not a bundle": (lambda p, k: (p / k.manifest).unlink(),
                     "no {manifest} (a {kind} is a directory written by {writer})"),
    "truncated manifest": (lambda p, k: truncate(p, k.manifest),
                           "{manifest} is not valid JSON (truncated or corrupt?)"),
    "another format": (lambda p, k: edit_manifest(p, k, lambda m: m.update(format="meganeura-other")),
                       "{manifest} does not describe a {format}"),
    "wrong format version": (lambda p, k: edit_manifest(p, k, lambda m: m.update(format_version=99)),
                             "format version 99 is not supported: this runtime reads version {version}; export the "
                             "model again ({writer}) with a matching torch-meganeura"),
    "manifest without a key": (lambda p, k: edit_manifest(p, k, lambda m: m.pop("producer")),
                               "{manifest} has no 'producer'"),
    "key of the wrong type": (lambda p, k: edit_manifest(p, k, lambda m: m.update(producer=[])),
                              "{manifest}: 'producer' has the wrong type (list)"),
    "manifest lists another file": (lambda p, k: edit_manifest(p, k, lambda m: m["files"].update({"x.bin": "0"})),
                                    "{manifest} lists files"),
    "missing weights": (lambda p, k: (p / "weights.safetensors").unlink(), "missing file weights.safetensors"),
    "truncated weights": (lambda p, k: truncate(p, "weights.safetensors"),
                          "weights.safetensors does not match its SHA-256 in {manifest} (truncated or modified)"),
    "truncated safetensors, hash updated": (
        lambda p, k: replace(p, k, "weights.safetensors", (p / "weights.safetensors").read_bytes()[:100]),
        "weights.safetensors is not a valid safetensors file"),
    "missing kernel": (lambda p, k: kernel(p, k).unlink(), "missing kernel kernels/"),
    "modified kernel": (lambda p, k: kernel(p, k).write_text("fn main() {}"),
                        ".wgsl does not match its SHA-256 in manifest.json"),
}


def expected(case: str, kind: Kind) -> str:
    """The message ``SHARED[case]`` must raise on a bundle of ``kind``."""
    return SHARED[case][1].format(manifest=kind.manifest, format=kind.format, kind=kind.kind, writer=kind.writer,
                                 version=kind.version)
