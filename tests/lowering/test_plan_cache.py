"""The persistent plan cache: a second compile of the same graph reads the plan back; corrupt, tampered and
foreign entries are ignored and replaced; the key follows the graph and the limits."""
import json

import numpy as np
import pytest

from meganeura.lowering import expr as E
from meganeura.lowering import plan_cache
from meganeura.lowering.builder import GraphBuilder
from meganeura.runtime.device import get_device
from meganeura.runtime.program import Program

RNG = np.random.default_rng(5)


def softmax_graph(scale: float = 2.0):
    """exp(scale * x) / its row sums: a pointwise producer, a reduction and an epilogue."""
    b = GraphBuilder()
    x = b.input("x", (6, 10), "float32")
    y = b.map(lambda a: E.unary("exp", E.mul(a, E.const(scale, E.F32))), x, dtype="float32")
    s = b.reduce_simple(y, (1,), "sum", "float32")
    b.output(b.map(lambda a, c: E.binary("div", a, c), y, b.reshape(s, (6, 1)), dtype="float32"))
    return b.graph


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.CACHE_ENV, str(tmp_path))
    return tmp_path


def test_second_compile_reads_the_plan_back_and_it_runs(cache):
    limits = get_device().limits
    first, first_report, hit = plan_cache.cached_compile_graph(softmax_graph(), limits)
    assert not hit and len(list(cache.glob("*.json"))) == 1
    second, second_report, hit = plan_cache.cached_compile_graph(softmax_graph(), limits)
    assert hit
    assert second.to_dict() == first.to_dict()
    assert (second_report.fused, second_report.refused) == (first_report.fused, first_report.refused)
    x = RNG.standard_normal((6, 10)).astype(np.float32)
    out = Program(get_device(), second).run({"x": x})[second.outputs[0].name]
    want = np.exp(2.0 * x) / np.exp(2.0 * x).sum(1, keepdims=True)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_key_follows_the_graph_and_the_limits(cache):
    limits = dict(get_device().limits)
    plan_cache.cached_compile_graph(softmax_graph(2.0), limits)
    assert not plan_cache.cached_compile_graph(softmax_graph(3.0), limits)[2], "another constant, same entry"
    other = dict(limits, **{"max-compute-invocations-per-workgroup": 64})
    assert not plan_cache.cached_compile_graph(softmax_graph(2.0), other)[2], "other limits, same entry"
    assert len(list(cache.glob("*.json"))) == 3


def _only_entry(cache):
    (path,) = cache.glob("*.json")
    return path


@pytest.mark.parametrize("damage", ["truncated", "not json", "tampered kernel", "foreign key"])
def test_damaged_entries_are_ignored_and_replaced(cache, damage):
    limits = get_device().limits
    plan, _, _ = plan_cache.cached_compile_graph(softmax_graph(), limits)
    path = _only_entry(cache)
    text = path.read_text()
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "not json":
        path.write_bytes(b"\x00\xff" * 40)
    else:
        entry = json.loads(text)
        body = entry["body"]
        if damage == "tampered kernel":  # the checksum no longer matches
            name = next(iter(body["plan"]["kernels"]))
            body["plan"]["kernels"][name] += "\n// injected"
        else:  # a consistent entry written for another key (another graph, adapter or compiler)
            body["key"] = "0" * 64
            entry["sha256"] = plan_cache._checksum(body)
        path.write_text(json.dumps(entry))
    again, _, hit = plan_cache.cached_compile_graph(softmax_graph(), limits)
    assert not hit
    assert again.to_dict() == plan.to_dict()
    assert plan_cache.cached_compile_graph(softmax_graph(), limits)[2], "the entry was not rewritten"


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert plan_cache.cache_dir() is None
    assert not plan_cache.cached_compile_graph(softmax_graph(), get_device().limits)[2]
    assert list(tmp_path.rglob("*")) == []


def test_unwritable_directory_only_loses_the_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(plan_cache.CACHE_ENV, str(blocker / "plans"))  # a directory under a file: cannot exist
    plan, _, hit = plan_cache.cached_compile_graph(softmax_graph(), get_device().limits)
    assert not hit and plan.dispatches


def test_the_compiler_digest_covers_every_kernel_module_by_its_path():
    """A changed module anywhere in the kernel and lowering packages, the attention kernels' subpackage included,
    changes the key: every such file is digested, under a name that tells same-named files apart."""
    from pathlib import Path

    import meganeura.kernels as kernels

    names = [name for name, _ in plan_cache.compiler_sources()]
    package = Path(kernels.__file__).parent
    every = {f"kernels/{f.relative_to(package).as_posix()}" for f in package.rglob("*.py")}
    assert every <= set(names) and "kernels/attention/flash.py" in names
    assert len(names) == len(set(names))
