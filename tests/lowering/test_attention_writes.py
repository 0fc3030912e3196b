"""Cache writes run by the attention that reads the cache (lowering/attention_writes.py): a decode step's new key and
value rows, written at a checked position over the caches (an update with a region, as ``index_put`` lowers it) or
into new caches (a concatenation), are stored by the attention's own dispatch, which reads them from the update's
expressions. The output and the caches equal numpy's; a failed position check leaves the caches as they were; within
WebGPU's default 8 bindings the update keeps a kernel of its own, with the reason. Plans on the recording device
(WebGPU's default limits, no GPU) for what is bound; the real adapter for the values."""
import re

import numpy as np
import pytest

from meganeura.lowering import compile_graph
from meganeura.lowering import expr as E
from meganeura.lowering.builder import GraphBuilder
from meganeura.lowering.ir import Region
from meganeura.runtime.device import get_device
from meganeura.runtime.errors import KernelStatusError
from meganeura.runtime.program import Program
from meganeura.runtime.resident import DeviceArray

from helpers.recording_device import RecordingDevice

RNG = np.random.default_rng(7)
HEADS, KV_HEADS, LENGTH, HEAD = 4, 2, 6, 8  # query heads, key/value heads, cache positions, head size
WIDTH = 12  # the row that ``projected_graph`` projects to the query, key and value
NEW = 2  # the new rows of a step that writes several at once
WIDE_BINDINGS = 16  # storage bindings enough for the attention to run the cache writes (lavapipe's: 32)


def _c(*dims) -> list:
    return [E.const(d, E.I32) if isinstance(d, int) else d for d in dims]


def _attention(b: GraphBuilder, q, k, v, length: int):
    """The forward attention of one query row per head over ``length`` keys (grouped-query: query head h reads
    key/value head h // (HEADS // KV_HEADS))."""
    c = [E.coord(d) for d in range(4)]
    kv = [c[0], E.binary("idiv", c[1], E.const(HEADS // KV_HEADS, E.I32)), c[2], c[3]]
    (out,) = b.attention("forward", [((1, HEADS, 1, HEAD), "float32")], batch=1, heads=HEADS, kv_heads=KV_HEADS,
                         lq=1, lk=length, d=HEAD, dv=HEAD, scale=HEAD ** -0.5, q=b.load(q, c), k=b.load(k, kv),
                         v=b.load(v, kv))
    return out


def static_graph(rows: int = 1):
    """Each cache's ``rows`` new rows written at rows pos.. (checked to lie in the cache), over the cache (an update
    with a region, requested in place); then attention over the updated caches."""
    b = GraphBuilder()
    q = b.input("q", (1, HEADS, 1, HEAD), "float32")
    pos = b.input("pos", (1,), "int32")
    at = b.load(pos, _c(0))
    inside = E.binary("and", E.binary("ge", at, E.const(0, E.I32)),
                      E.binary("le", E.add(at, E.const(rows, E.I32)), E.const(LENGTH, E.I32)))
    checked = b.check(at, inside, "index out of range")
    c = [E.coord(d) for d in range(4)]
    updated, requests = [], {}
    for name in "kv":
        new = b.input(f"new_{name}", (1, KV_HEADS, rows, HEAD), "float32")
        cache = b.input(name, (1, KV_HEADS, LENGTH, HEAD), "float32")
        row = E.binary("sub", c[2], checked)
        written = E.binary("and", E.binary("ge", row, E.const(0, E.I32)), E.binary("lt", row, E.const(rows, E.I32)))
        whole = E.where(written, b.load(new, [c[0], c[1], row, c[3]]), b.load(cache, c))
        region = Region((1, KV_HEADS, rows, HEAD), (c[0], c[1], E.add(c[2], checked), c[3]), E.const(True, E.BOOL),
                        [b.load(new, c)], [cache.id])
        updated.append(b.pointwise(cache.shape, "float32", whole, "index_put", region=region))
        requests[len(b.graph.outputs)] = name
        b.output(updated[-1])
    b.output(_attention(b, q, *updated, LENGTH))
    b.graph.in_place = requests
    return b.graph


def projected_graph():
    """As ``static_graph``, one row a step, but the query and the new key and value rows are one row's products by
    three weights (a layer's projections: one matmul once fusion merges them, its three outputs intermediates)."""
    b = GraphBuilder()
    x = b.input("x", (1, WIDTH), "float32")
    products = {name: b.matmul(x, b.input(f"w{name}", (WIDTH, heads * HEAD), "float32"))
                for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    rows = {name: b.reshape(products[name], (1, HEADS if name == "q" else KV_HEADS, 1, HEAD)) for name in "qkv"}
    pos = b.input("pos", (1,), "int32")
    at = b.load(pos, _c(0))
    checked = b.check(at, E.binary("and", E.binary("ge", at, E.const(0, E.I32)),
                                   E.binary("lt", at, E.const(LENGTH, E.I32))), "index out of range")
    c = [E.coord(d) for d in range(4)]
    updated, requests = [], {}
    for name in "kv":
        cache = b.input(name, (1, KV_HEADS, LENGTH, HEAD), "float32")
        whole = E.where(E.binary("eq", c[2], checked), b.load(rows[name], [c[0], c[1], E.const(0, E.I32), c[3]]),
                        b.load(cache, c))
        region = Region((1, KV_HEADS, 1, HEAD), (c[0], c[1], E.add(c[2], checked), c[3]), E.const(True, E.BOOL),
                        [b.load(rows[name], c)], [cache.id])
        updated.append(b.pointwise(cache.shape, "float32", whole, "index_put", region=region))
        requests[len(b.graph.outputs)] = name
        b.output(updated[-1])
    b.output(_attention(b, rows["q"], *updated, LENGTH))
    b.graph.in_place = requests
    return b.graph


def dynamic_graph():
    """Each cache concatenated with its new row (new tensors, one row longer); then attention over them."""
    b = GraphBuilder()
    q = b.input("q", (1, HEADS, 1, HEAD), "float32")
    caches = [b.cat([b.input(name, (1, KV_HEADS, LENGTH, HEAD), "float32"),
                     b.input(f"new_{name}", (1, KV_HEADS, 1, HEAD), "float32")], 2) for name in "kv"]
    for cache in caches:
        b.output(cache)
    b.output(_attention(b, q, *caches, LENGTH + 1))
    return b.graph


def _attend(q, k, v):
    """float64 attention of ``q`` (1, HEADS, 1, HEAD) over ``k`` and ``v`` (1, KV_HEADS, keys, HEAD)."""
    k, v = (np.repeat(x.astype(np.float64), HEADS // KV_HEADS, axis=1) for x in (k, v))
    scores = q.astype(np.float64) @ k.transpose(0, 1, 3, 2) * HEAD ** -0.5
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def _inputs(rows: int = 1) -> dict:
    return {"q": RNG.standard_normal((1, HEADS, 1, HEAD), dtype=np.float32),
            **{f"new_{name}": RNG.standard_normal((1, KV_HEADS, rows, HEAD), dtype=np.float32) for name in "kv"}}


@pytest.mark.parametrize("rows", [1, NEW], ids=["one_row", "rows"])
def test_the_attention_stores_the_new_rows_over_the_caches_it_reads(rows):
    """Two dispatches (the position check, then attention storing the rows over both caches); the output is numpy's
    attention over the updated caches, which hold the new rows at pos and their old rows elsewhere."""
    device = get_device()
    plan, report = compile_graph(static_graph(rows), device.limits)
    assert [d.label for d in plan.dispatches] == ["checks", "attention"], report.refused
    assert plan.in_place == {"out0": "k", "out1": "v"} and plan.stats["attention_writes"] == 1
    program = Program(device, plan, device_only_inputs=["k", "v"])
    starts = {name: RNG.standard_normal((1, KV_HEADS, LENGTH, HEAD), dtype=np.float32) for name in "kv"}
    arrays = {name: DeviceArray.upload(device, start, "float32") for name, start in starts.items()}
    inputs = {**_inputs(rows), "pos": np.array([3], np.int32)}
    out = program.run(inputs, device_inputs=arrays)["out2"]
    want = {name: starts[name].copy() for name in "kv"}
    for name in "kv":
        want[name][:, :, 3:3 + rows] = inputs[f"new_{name}"]
        np.testing.assert_array_equal(arrays[name].numpy(), want[name])
    np.testing.assert_allclose(out, _attend(inputs["q"], want["k"], want["v"]), rtol=1e-5, atol=1e-6)


def _reads(wgsl: str, function: str) -> str:
    """The statements of ``function`` in ``wgsl`` after its argument casts (``let j_ = i32(j);``)."""
    body = wgsl.split(f"fn {function}(", 1)[1].split("\n}", 1)[0]
    return "\n".join(line for line in body.splitlines()[1:] if not re.fullmatch(r"  let (\w+)_ = i32\(\1\);", line))


def test_the_plain_read_of_a_branching_value_is_the_cache_the_keys_walk():
    """Both sides of the values' branch are plain reads (the cache and the projection's new row): the walk over the
    keys reads the side that follows the key row (``load_v_2``, read 16 at a time), and the update's one row is the
    side taken rarely (``load_v_1``). Taking the new row as the plain read sends every cache row through the walk of
    its own, one read in flight at a time."""
    limits = {**get_device().limits, "max-storage-buffers-per-shader-stage": WIDE_BINDINGS}
    plan, _ = compile_graph(static_graph(), limits)
    (attention,) = [plan.kernels[d.kernel] for d in plan.dispatches if d.label == "attention"]
    assert "j_" in _reads(attention, "load_v_2") and "j_" not in _reads(attention, "load_v_1")
    assert "j_" in _reads(attention, "load_k_24") or "j_" in _reads(attention, "load_k_2")


def test_a_failed_position_check_leaves_the_caches_as_they_were():
    """A position past the cache's end fails the front check: the attention stores nothing (the status word is
    set), and the run raises; the next run with a valid position stores its rows."""
    device = get_device()
    plan, _ = compile_graph(static_graph(), device.limits)
    program = Program(device, plan, device_only_inputs=["k", "v"])
    starts = {name: RNG.standard_normal((1, KV_HEADS, LENGTH, HEAD), dtype=np.float32) for name in "kv"}
    arrays = {name: DeviceArray.upload(device, start, "float32") for name, start in starts.items()}
    with pytest.raises(KernelStatusError, match="index out of range"):
        program.run({**_inputs(), "pos": np.array([LENGTH], np.int32)}, device_inputs=arrays)
    for name in "kv":
        np.testing.assert_array_equal(arrays[name].numpy(), starts[name])
    inputs = {**_inputs(), "pos": np.array([0], np.int32)}
    program.run(inputs, device_inputs=arrays)
    np.testing.assert_array_equal(arrays["k"].numpy()[:, :, 0:1], inputs["new_k"])


def test_the_attention_stores_the_concatenated_caches_it_reads():
    """One dispatch: attention over each cache with its new row, storing both concatenations, which equal numpy's."""
    device = get_device()
    plan, report = compile_graph(dynamic_graph(), device.limits)
    assert [d.label for d in plan.dispatches] == ["attention"], report.refused
    caches = {name: RNG.standard_normal((1, KV_HEADS, LENGTH, HEAD), dtype=np.float32) for name in "kv"}
    inputs = {**_inputs(), **caches}
    got = Program(device, plan).run(inputs)
    want = {name: np.concatenate([caches[name], inputs[f"new_{name}"]], axis=2) for name in "kv"}
    np.testing.assert_array_equal(got["out0"], want["k"])
    np.testing.assert_array_equal(got["out1"], want["v"])
    np.testing.assert_allclose(got["out2"], _attend(inputs["q"], want["k"], want["v"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("limits", ["default", "adapter"])
def test_within_webgpus_default_bindings_the_projections_outputs_side_by_side_are_bound_once(limits):
    """The query, key and value of one matmul: within WebGPU's default 8 storage bindings the attention storing the
    rows reads them through one binding of their range (lowering/packed.py), each at its offset (the recording
    device's 256-byte alignment; the adapter's own, held to 8 bindings); with the checks and the projection, three
    dispatches. Outputs and caches equal float64 numpy's."""
    device = get_device()
    limits = RecordingDevice().limits if limits == "default" else {
        **device.limits, "max-storage-buffers-per-shader-stage": 8}
    plan, report = compile_graph(projected_graph(), limits)
    assert [d.label.split()[0] for d in plan.dispatches] == ["checks", "matmul", "attention"], report.refused
    assert plan.stats["attention_writes"] == 1 and max(len(d.bindings) for d in plan.dispatches) <= 8
    qkv = {(b.offset, b.size) for b in plan.dispatches[2].bindings if b.buffer == "arena"}  # (a vec4 binding too)
    assert len(qkv) == 1 and min(qkv)[1] >= 4 * (HEADS + 2 * KV_HEADS) * HEAD, plan.dispatches[2]
    program = Program(device, plan, device_only_inputs=["k", "v"])
    starts = {name: RNG.standard_normal((1, KV_HEADS, LENGTH, HEAD), dtype=np.float32) for name in "kv"}
    arrays = {name: DeviceArray.upload(device, start, "float32") for name, start in starts.items()}
    inputs = {"x": RNG.standard_normal((1, WIDTH), dtype=np.float32), "pos": np.array([4], np.int32),
              **{f"w{name}": RNG.standard_normal((WIDTH, heads * HEAD), dtype=np.float32)
                 for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}}
    rows = {name: (inputs["x"].astype(np.float64) @ inputs[f"w{name}"]).reshape(1, -1, 1, HEAD) for name in "qkv"}
    out = program.run(inputs, device_inputs=arrays)["out2"]
    for name in "kv":
        want = starts[name].astype(np.float64)
        want[:, :, 4:5] = rows[name]
        np.testing.assert_allclose(arrays[name].numpy(), want, rtol=1e-5, atol=1e-5)
        starts[name] = want
    np.testing.assert_allclose(out, _attend(rows["q"], starts["k"], starts["v"]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("graph", [static_graph, dynamic_graph], ids=["static", "dynamic"])
def test_within_webgpus_default_bindings_the_update_keeps_its_kernel(graph):
    """WebGPU's default 8 storage bindings do not hold the merged kernel: the update is a dispatch of its own, and the
    report says why."""
    plan, report = compile_graph(graph(), RecordingDevice().limits)
    assert "attention" in [d.label for d in plan.dispatches] and len(plan.dispatches) >= 2
    assert plan.stats["attention_writes"] == 0
    assert any("more than 8 storage bindings" in why for _, consumer, why in report.refused
               if consumer.startswith("attention")), report.refused
