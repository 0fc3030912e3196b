"""The GPU profiler: per-dispatch timestamps while attached, same results, a chrome trace, and nothing when off."""
import json

import numpy as np
import pytest

from meganeura.runtime.device import get_device
from meganeura.runtime.errors import FeatureError
from meganeura.runtime.plan import Binding, BufferSpec, Dispatch, Plan, TensorSpec
from meganeura.runtime.profiler import Profiler, profile
from meganeura.runtime.program import Program

N = 1000
SCALE = """@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  if (gid.x < arrayLength(&y)) { y[gid.x] = 2.0 * x[gid.x] + 1.0; }
}"""


def chain_plan(steps: int) -> Plan:
    """``steps`` dispatches of y = 2x + 1, ping-ponging between the input and the output buffer."""
    nb = 4 * N
    buffers = [BufferSpec("x", nb, "input"), BufferSpec("y", nb, "output")]
    order = [("x", "y"), ("y", "x")]
    dispatches = [Dispatch("scale", (Binding(order[i % 2][0], 0, nb), Binding(order[i % 2][1], 0, nb)),
                           (-(-N // 64), 1, 1), f"step {i % 3}") for i in range(steps)]
    return Plan(buffers, [TensorSpec("x", "x", 0, (N,), "float32")], [], [TensorSpec("y", "y", 0, (N,), "float32")],
                {"scale": SCALE}, dispatches)


def expected(x: np.ndarray, steps: int) -> np.ndarray:
    """What the plan leaves in y: the result of the last dispatch that wrote y."""
    last_y = steps if steps % 2 else steps - 1
    for _ in range(last_y):
        x = 2 * x + 1
    return x


def test_profiled_runs_time_every_dispatch_and_keep_results(tmp_path):
    device = get_device()
    if "timestamp-query" not in device.features:
        pytest.skip(f"{device.describe()} has no timestamp-query feature")
    steps = 7
    program = Program(device, chain_plan(steps))
    x = np.random.default_rng(0).standard_normal(N, dtype=np.float32) * 1e-3
    plain = program.run({"x": x})["y"]
    with profile(device) as prof:
        for _ in range(2):
            profiled = program.run({"x": x})["y"]
    assert device.profiler is None
    np.testing.assert_allclose(plain, expected(x.astype(np.float64), steps), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(profiled, plain)
    assert prof.runs == 2 and len(prof.events) == 2 * steps
    assert [e["name"] for e in prof.events[:steps]] == [f"step {i % 3}" for i in range(steps)]
    assert all(e["duration_ns"] > 0 for e in prof.events)
    starts = [e["start_ns"] for e in prof.events[:steps]]
    assert starts == sorted(starts)  # dispatches ran in plan order
    top = prof.top()
    assert sorted(k.calls for k in top) == [4, 4, 6]
    assert sum(k.share for k in top) == pytest.approx(1.0)
    path = tmp_path / "trace.json"
    prof.save(str(path))
    trace = json.loads(path.read_text())
    assert len(trace["traceEvents"]) == 2 * steps
    assert {e["ph"] for e in trace["traceEvents"]} == {"X"} and {e["tid"] for e in trace["traceEvents"]} == {0, 1}


def test_profiler_needs_timestamp_queries():
    class NoTimestamps:
        features = {"shader-f16"}

        def describe(self):
            return "a device without timestamps"

    with pytest.raises(FeatureError, match="timestamp-query"):
        Profiler(NoTimestamps())


def test_profiler_grows_its_query_sets_and_frees_the_old_buffers():
    device = get_device()
    if "timestamp-query" not in device.features:
        pytest.skip(f"{device.describe()} has no timestamp-query feature")
    prof = Profiler(device)
    before = device.counters.bytes_allocated
    prof.prepare(10)
    one_set = device.counters.bytes_allocated - before
    sets, resolve, staging = prof.prepare(3000)  # 6000 queries: a second query set of 4096
    assert len(sets) == 2 and resolve.size == staging.size == 2 * 4096 * 8
    assert device.counters.bytes_allocated - before == 2 * one_set  # the one-set buffers were destroyed
    prof.prepare(5)
    assert device.counters.bytes_allocated - before == 2 * one_set  # never shrinks, never reallocates
