"""The part of reading a bundle that both kinds share (``bundle``: a deploy bundle; ``lm_bundle``: a generation
bundle): a directory whose JSON manifest names its format and version, holds keys of known types and lists every
other file with its SHA-256.

``read_manifest`` checks the manifest (present, JSON, this format, this version or an older one it upgrades, every
key of its type);
``check_file_list`` the files it lists against those the kind expects; ``read_files`` reads each listed file and
checks it against its hash. Each kind adds its own checks. Only JSON and bytes are read here (no pickle); every
failure raises ``BundleError`` with the problem, which the kind's reader prefixes with the bundle's path.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from .errors import BundleError


@dataclass(frozen=True)
class Format:
    """One kind of bundle: what its manifest says it is, and what to tell a user whose bundle is wrong."""
    name: str  # the manifest's "format"
    version: int  # the manifest's "format_version" this runtime reads
    manifest: str  # the manifest's file name
    keys: dict  # manifest key -> type (or tuple of types)
    kind: str  # the bundle kind in messages: "bundle", "generation bundle"
    writer: str  # the function that writes one: the hint of a missing manifest or an old version
    # older "format_version" -> what makes its manifest this version's (the keys added since, at their old meaning)
    upgrades: dict[int, Callable[[dict], dict]] = field(default_factory=dict)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(path: Path, form: Format) -> dict:
    """The manifest of the bundle at ``path``, checked: present, JSON, of ``form``'s format and version (an older
    version that ``form`` upgrades is read as this one), every key of ``form.keys`` there with its type."""
    file = path / form.manifest
    if not file.is_file():
        raise BundleError(f"no {form.manifest} (a {form.kind} is a directory written by {form.writer})")
    try:
        manifest = json.loads(file.read_bytes())
    except OSError as err:
        raise BundleError(f"no readable {form.manifest}: {err}") from err
    except (ValueError, UnicodeDecodeError) as err:
        raise BundleError(f"{form.manifest} is not valid JSON (truncated or corrupt?): {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != form.name:
        raise BundleError(f"{form.manifest} does not describe a {form.name}")
    version = manifest.get("format_version")
    if version in form.upgrades:
        manifest, version = form.upgrades[version](manifest), form.version
    if version != form.version:
        raise BundleError(f"format version {version!r} is not supported: this runtime reads version {form.version}; "
                          f"export the model again ({form.writer}) with a matching torch-meganeura")
    check_keys(manifest, form.keys, form.manifest)
    return manifest


def check_keys(entry, keys: dict, what: str) -> None:
    """``entry`` is a JSON object holding every key of ``keys`` with its type (a bool is not an int)."""
    if not isinstance(entry, dict):
        raise BundleError(f"{what} is not a JSON object")
    for key, kind in keys.items():
        if key not in entry:
            raise BundleError(f"{what} has no {key!r}")
        if not isinstance(entry[key], kind) or (kind is int and isinstance(entry[key], bool)):
            raise BundleError(f"{what}: {key!r} has the wrong type ({type(entry[key]).__name__})")


def check_file_list(manifest: dict, expected: set[str], form: Format) -> None:
    """The manifest lists exactly the files ``expected``."""
    if set(manifest["files"]) != expected:
        raise BundleError(f"{form.manifest} lists files {sorted(manifest['files'])}, expected {sorted(expected)}")


def read_files(path: Path, manifest: dict, form: Format) -> dict[str, bytes]:
    """Every file the manifest lists (name relative to ``path`` -> bytes), checked against its SHA-256. A missing
    file is named as a kernel (a ``.wgsl`` file) or a file."""
    data = {}
    for name, digest in manifest["files"].items():
        file = path / name
        if not file.is_file():
            what = "kernel" if name.endswith(".wgsl") else "file"
            raise BundleError(f"missing {what} {name}")
        data[name] = file.read_bytes()
        if sha256(data[name]) != digest:
            raise BundleError(f"{name} does not match its SHA-256 in {form.manifest} (truncated or modified)")
    return data
