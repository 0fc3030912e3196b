"""Data checks run before any input is overwritten (lowering/data_checks.py): a static KV cache's position, a counter
plus ``arange`` whose overflow and bounds are checked, as HF's ``StaticLayer`` computes it for each layer. The checks
that read only inputs run in one kernel at the plan's front (as many as the binding limit asks), the index arithmetic
inlines into the cache writes, the counter's update follows the last of them; a failing check leaves every input as
it was. Plans on the recording device (WebGPU's default limits, no GPU) for their dispatches; the real adapter for
the values."""
import numpy as np
import pytest

from meganeura.lowering import compile_graph
from meganeura.lowering import expr as E
from meganeura.lowering.builder import GraphBuilder
from meganeura.runtime.device import get_device
from meganeura.runtime.errors import KernelStatusError
from meganeura.runtime.program import Program
from meganeura.runtime.resident import DeviceArray

from helpers.recording_device import RecordingDevice

RNG = np.random.default_rng(5)
ROWS, WIDTH = 6, 4  # cache positions, and the width of a row


def _inside(at: E.Expr) -> E.Expr:
    return E.binary("and", E.binary("ge", at, E.const(0, E.I32)), E.binary("lt", at, E.const(ROWS, E.I32)))


def position_graph(layers: int):
    """Per layer: the counter's update first (pos + 1, over pos), then index = pos + arange(1) (overflow checked) and
    the key and value caches' writes of a new row at row index (bounds checked), over the caches. Layer l's rows are
    WIDTH + l wide: each layer's writes are a kernel of their own, as a model's are (attention reads the caches
    between them)."""
    b = GraphBuilder()
    requests = {}
    for layer in range(layers):
        new = b.input(f"new{layer}", (1, WIDTH + layer), "float32")
        pos = b.input(f"pos{layer}", (1,), "int32")
        caches = [b.input(f"{name}{layer}", (ROWS, WIDTH + layer), "float32") for name in "kv"]
        requests[len(b.graph.outputs)] = f"pos{layer}"
        b.output(b.map(lambda p: E.add(p, E.const(1, E.I32)), pos, dtype="int32"))
        index = b.map(lambda p: b.check(E.add(E.coord(0), p), E.binary("ge", E.add(E.coord(0), p), p),
                                        "position overflowed"), pos, dtype="int32")
        at = b.load(index, [E.const(0, E.I32)])
        for cache in caches:
            value = E.where(E.binary("eq", E.coord(0), at), b.load(new, [E.const(0, E.I32), E.coord(1)]),
                            b.load(cache, [E.coord(0), E.coord(1)]))
            requests[len(b.graph.outputs)] = f"{'kv'[caches.index(cache)]}{layer}"
            b.output(b.pointwise((ROWS, WIDTH + layer), "float32", b.check(value, _inside(at), "index out of range")))
    b.graph.in_place = requests
    return b.graph


def test_position_checks_run_at_the_front_and_the_index_inlines_into_one_cache_write():
    """Three dispatches: the checks, the two caches' writes with the index computed in them, the counter's update
    after them (it reads the counter they read); every request granted."""
    plan, _ = compile_graph(position_graph(1), RecordingDevice().limits)
    assert [d.label for d in plan.dispatches][0] == "checks" and len(plan.dispatches) == 3, plan.dispatches
    assert plan.in_place == {"out0": "pos0", "out1": "k0", "out2": "v0"}, plan.stats["in_place_refused"]


@pytest.mark.parametrize("layers, kernels", [(3, 1), (10, 2)])
def test_the_front_checks_take_as_few_kernels_as_the_bindings_allow(layers, kernels):
    """Each layer's checks read its counter: six counters to a check kernel within WebGPU's default 8 bindings (its
    result and the status buffer beside them)."""
    limits = RecordingDevice().limits
    plan, _ = compile_graph(position_graph(layers), limits)
    labels = [d.label for d in plan.dispatches]
    assert labels.count("checks") == kernels and labels[:kernels] == ["checks"] * kernels, labels
    bound = [[b.buffer for b in d.bindings] for d in plan.dispatches]
    writes = [buffers for buffers in bound if any(name.startswith("input:k") for name in buffers)]
    assert len(writes) == layers and not any("arena" in buffers for buffers in writes), writes  # (index inlined)
    assert all(len(d.bindings) <= limits["max-storage-buffers-per-shader-stage"] for d in plan.dispatches)
    assert len(plan.in_place) == 3 * layers, plan.stats["in_place_refused"]


def test_a_failed_position_check_leaves_the_caches_and_the_counter_as_they_were():
    device = get_device()
    plan, _ = compile_graph(position_graph(1), device.limits)
    program = Program(device, plan, device_only_inputs=["pos0", "k0", "v0"])
    starts = {"pos0": np.array([2], np.int32), "k0": RNG.standard_normal((ROWS, WIDTH), dtype=np.float32),
              "v0": RNG.standard_normal((ROWS, WIDTH), dtype=np.float32)}
    new = RNG.standard_normal((1, WIDTH), dtype=np.float32)
    arrays = {name: DeviceArray.upload(device, start, str(start.dtype)) for name, start in starts.items()}
    program.run({"new0": new}, device_inputs=arrays)
    for name in "kv":
        want = starts[f"{name}0"].copy()
        want[2] = new[0]
        np.testing.assert_array_equal(arrays[f"{name}0"].numpy(), want)
    np.testing.assert_array_equal(arrays["pos0"].numpy(), [3])
    starts = {name: array.numpy() for name, array in arrays.items()}
    arrays["pos0"] = DeviceArray.upload(device, np.array([ROWS], np.int32), "int32")
    program.run({"new0": new}, device_inputs=arrays)
    with pytest.raises(KernelStatusError, match="index out of range"):  # (no host output: raised at the next wait)
        device.synchronize()
    for name in "kv":
        np.testing.assert_array_equal(arrays[f"{name}0"].numpy(), starts[f"{name}0"])
    np.testing.assert_array_equal(arrays["pos0"].numpy(), [ROWS])


def masked_graph():
    """A causal mask over the cache's rows (row <= pos, as HF builds it: the flat row index's int64 overflow checked,
    a check that holds whatever it reads, x + 0 >= x, and the position's bounds), then the cache's write of a new row
    at pos (requested in place), then a kernel that reads the mask and the written cache (the rows past pos zeroed)."""
    b = GraphBuilder()
    pos = b.input("pos", (1,), "int32")
    new = b.input("new", (1, WIDTH), "float32")
    cache = b.input("k", (ROWS, WIDTH), "float32")
    at = b.check(b.load(pos, [E.const(0, E.I32)]), _inside(b.load(pos, [E.const(0, E.I32)])), "index out of range")
    row = E.coord(0)
    zero = E.const(0, E.I32)
    added = E.binary("or", E.binary("and", E.binary("ge", zero, zero), E.binary("ge", row, row)),
                     E.binary("and", E.binary("lt", zero, zero), E.binary("lt", row, row)))
    mask = b.pointwise((ROWS,), "bool", E.binary("le", b.check(row, added, "position overflowed"), at), "mask")
    written = b.pointwise((ROWS, WIDTH), "float32",
                          E.where(E.binary("eq", E.coord(0), at), b.load(new, [zero, E.coord(1)]),
                                  b.load(cache, [E.coord(0), E.coord(1)])))
    b.output(written)
    b.graph.in_place = {0: "k"}
    b.output(b.pointwise((ROWS, WIDTH), "float32", E.where(b.load(mask, [E.coord(0)]), b.load(written, [
        E.coord(0), E.coord(1)]), E.const(0.0, E.F32))))
    return b.graph


def test_a_mask_compared_from_the_position_is_computed_by_its_readers():
    """The mask is index arithmetic too: its position check runs at the front, the check that always holds nowhere,
    and its readers compute it (no kernel of its own: the checks, then the write stored by its reader). The reader's
    output is the written cache with the rows past pos zeroed."""
    plan, _ = compile_graph(masked_graph(), RecordingDevice().limits)
    assert [d.label for d in plan.dispatches] == ["checks", "pointwise"], plan.dispatches
    device = get_device()
    plan, _ = compile_graph(masked_graph(), device.limits)
    start, new = (RNG.standard_normal(shape, dtype=np.float32) for shape in ((ROWS, WIDTH), (1, WIDTH)))
    arrays = {"k": DeviceArray.upload(device, start, "float32")}
    got = Program(device, plan, device_only_inputs=["k"]).run({"pos": np.array([3], np.int32), "new": new},
                                                              device_inputs=arrays)["out1"]
    want = start.copy()
    want[3] = new[0]
    np.testing.assert_array_equal(arrays["k"].numpy(), want)
    want[4:] = 0
    np.testing.assert_array_equal(got, want)
