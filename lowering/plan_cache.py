"""A persistent cache of compiled plans, so that a second process compiling the same model skips fusion and
scheduling (``compile_graph``).

An entry is keyed by a fingerprint of the graph (every node's fields and expressions, value ids, shapes and
dtypes, input names), the device limits the plan was compiled for (the only thing ``compile_graph`` reads about the
adapter), what tuned its matmul variants if anything did (``tuned_for``: the tuner's adapter fingerprint) and a
digest of the compiler's own source (``meganeura.lowering``, ``meganeura.kernels`` with its subpackages, and the plan
format), so a changed compiler never reads an older plan. An entry is one JSON file holding its key, the plan,
the fusion report and a SHA-256 of those; a file that does not parse, whose checksum or key does not match, or
whose plan does not validate is ignored and replaced, never used.

The directory is ``$MEGANEURA_CACHE_DIR``, else ``$XDG_CACHE_HOME/meganeura/plans`` (``~/.cache/...``);
``MEGANEURA_CACHE_DIR=off`` turns the cache off. A directory that cannot be written only loses the cache.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

from meganeura import kernels
from meganeura.runtime import plan as plan_module
from meganeura.runtime.plan import Plan

from . import compile_graph
from . import expr as E
from .fusion import FusionReport
from .ir import Graph
from .schedule import symbol_count

CACHE_ENV = "MEGANEURA_CACHE_DIR"
ENTRY_VERSION = 1
_source_digest: str | None = None


def cache_dir() -> Path | None:
    """Where entries live, or None when the cache is off."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meganeura" / "plans"


def cached_compile_graph(graph: Graph, limits: dict, choose_matmuls=None, tuned_for: str | None = None,
                         on_kernel=None) -> tuple[Plan, FusionReport, bool]:
    """``compile_graph(graph, limits, choose_matmuls)`` through the cache: (plan, report, whether it came from the
    cache). ``tuned_for`` names what ``choose_matmuls`` tunes for (an adapter), part of the key; a plan compiled
    with ``choose_matmuls`` but no ``tuned_for`` is not cached. ``on_kernel`` goes to ``compile_graph`` (a plan read
    from the cache calls it for none).

    On a miss the graph is compiled (and, as always, fused in place) and the entry written; on a hit the graph is
    left as it was."""
    cacheable = (choose_matmuls is None or tuned_for is not None) and not symbol_count()  # (guards not kept)
    directory = cache_dir() if cacheable else None
    key = _key(graph, limits, tuned_for) if directory is not None else None
    path = directory / f"{key}.json" if key is not None else None
    if path is not None:
        found = _read(path, key)
        if found is not None:
            return found[0], found[1], True
    plan, report = compile_graph(graph, limits, choose_matmuls, on_kernel)
    if path is not None:
        _write(path, key, plan, report)
    return plan, report, False


def graph_fingerprint(graph: Graph) -> str | None:
    """SHA-256 of a canonical rendering of ``graph``; None if it holds something with no stable rendering."""
    memo: dict[int, str] = {}
    try:
        text = _render(graph, memo)
    except TypeError:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _key(graph: Graph, limits: dict, tuned_for: str | None = None) -> str | None:
    fingerprint = graph_fingerprint(graph)
    if fingerprint is None:
        return None
    limits_text = json.dumps({k: limits[k] for k in sorted(limits)}, sort_keys=True, default=str)
    text = f"{ENTRY_VERSION}|{fingerprint}|{limits_text}|{_compiler_digest()}|{tuned_for or ''}"
    return hashlib.sha256(text.encode()).hexdigest()


def compiler_sources() -> list[tuple[str, Path]]:
    """(name, path) of every module that makes a plan: the lowering and kernel packages with their subpackages (the
    attention kernels are ``kernels/attention``), and the plan's own module; each named by its path in its
    package."""
    sources = []
    for package in (Path(__file__).parent, Path(kernels.__file__).parent):
        sources += [(f"{package.name}/{f.relative_to(package).as_posix()}", f) for f in sorted(package.rglob("*.py"))]
    return sources + [("plan", Path(plan_module.__file__))]


def _compiler_digest() -> str:
    """SHA-256 over the source of the modules that make a plan (computed once per process)."""
    global _source_digest
    if _source_digest is None:
        digest = hashlib.sha256()
        for name, f in compiler_sources():
            digest.update(name.encode())
            digest.update(f.read_bytes())
        _source_digest = digest.hexdigest()
    return _source_digest


def _render(x, memo: dict[int, str]) -> str:
    """Canonical text of IR data: expressions by a digest of their structure (shared subtrees rendered once)."""
    if isinstance(x, E.Expr):
        found = memo.get(id(x))
        if found is None:
            inner = ",".join(_render(a, memo) for a in x.args)
            found = hashlib.sha256(f"{x.op}:{x.dtype}({inner})".encode()).hexdigest()[:32]
            memo[id(x)] = found
        return found
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = ",".join(f"{f.name}={_render(getattr(x, f.name), memo)}" for f in dataclasses.fields(x))
        return f"{type(x).__name__}({fields})"
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(_render(a, memo) for a in x) + "]"
    if isinstance(x, dict):
        return "{" + ",".join(f"{_render(k, memo)}:{_render(v, memo)}" for k, v in sorted(x.items())) + "}"
    if isinstance(x, float):
        return x.hex()
    if x is None or isinstance(x, (bool, int, str)):
        return repr(x)
    raise TypeError(f"no canonical rendering for {type(x).__name__}")


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read(path: Path, key: str) -> tuple[Plan, FusionReport] | None:
    try:
        entry = json.loads(path.read_text())
        body = entry["body"]
        if entry.get("sha256") != _checksum(body) or body.get("key") != key:
            return None
        plan = Plan.from_dict(body["plan"])  # validates the plan's structure
        report = FusionReport([tuple(f) for f in body["fused"]], [tuple(r) for r in body["refused"]])
        return plan, report
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write(path: Path, key: str, plan: Plan, report: FusionReport) -> None:
    body = {"key": key, "plan": plan.to_dict(), "fused": [list(f) for f in report.fused],
            "refused": [list(r) for r in report.refused]}
    text = json.dumps({"sha256": _checksum(body), "body": body})
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            temporary = f.name
            f.write(text)
        os.replace(temporary, path)  # readers see the old entry or the whole new one
    except OSError:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
