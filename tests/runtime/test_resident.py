"""Resident tensors: outputs kept on the device as DeviceArrays and bound as inputs of a later plan."""
import gc

import numpy as np
import pytest

from meganeura.lowering import compile_graph
from meganeura.lowering import expr as E
from meganeura.lowering.builder import GraphBuilder
from meganeura.runtime.device import get_device
from meganeura.runtime.errors import InputError
from meganeura.runtime.program import Program
from meganeura.runtime.resident import DeviceArray

RNG = np.random.default_rng(3)


def affine_program(scale: float, shift: float, n: int, resident=(), device_only=()):
    """A program computing y = x * scale + shift; ``y`` is output ``out0``."""
    b = GraphBuilder()
    x = b.input("x", (n,), "float32")
    b.output(b.map(lambda v: E.add(E.mul(v, E.const(scale, E.F32)), E.const(shift, E.F32)), x, dtype="float32"))
    dev = get_device()
    plan, _ = compile_graph(b.graph, dev.limits)
    return Program(dev, plan, resident_outputs=resident, device_only_inputs=device_only)


def test_resident_output_feeds_the_next_plan_without_transfers():
    first = affine_program(2.0, 1.0, 50, resident=["out0"])
    second = affine_program(3.0, 0.0, 50)
    x = RNG.standard_normal(50, dtype=np.float32)
    kept = first.run({"x": x})["out0"]
    assert isinstance(kept, DeviceArray) and kept.shape == (50,) and kept.dtype == "float32"
    np.testing.assert_allclose(kept.numpy(), x * 2 + 1, rtol=1e-5, atol=1e-6)
    counters = get_device().counters
    before = counters.snapshot()
    y = second.run({}, device_inputs={"x": kept})["out0"]
    after = counters.snapshot()
    np.testing.assert_allclose(y, (x * 2 + 1) * 3, rtol=1e-5, atol=1e-6)
    assert after["bytes_uploaded"] == before["bytes_uploaded"]
    assert after["bytes_downloaded"] - before["bytes_downloaded"] == 50 * 4


def test_pool_recycles_buffers_and_bind_groups_across_steps():
    gc.collect()
    first = affine_program(1.5, -1.0, 40, resident=["out0"])
    second = affine_program(-2.0, 0.5, 40)
    dev = get_device()
    x = RNG.standard_normal(40, dtype=np.float32)

    def step():
        kept = first.run({"x": x})["out0"]
        out = second.run({}, device_inputs={"x": kept})["out0"]
        kept.release()
        return out

    want = (x * 1.5 - 1.0) * -2.0 + 0.5
    for _ in range(3):
        np.testing.assert_allclose(step(), want, rtol=1e-5, atol=1e-6)
    before = dev.counters.snapshot()
    live = dev.pool.live
    for _ in range(20):
        np.testing.assert_allclose(step(), want, rtol=1e-5, atol=1e-6)
    after = dev.counters.snapshot()
    assert dev.pool.live == live
    assert after["bytes_allocated"] == before["bytes_allocated"]
    assert after["buffers_created"] == before["buffers_created"]
    assert after["bind_groups_created"] == before["bind_groups_created"]


def test_garbage_collected_array_returns_its_buffer():
    program = affine_program(1.0, 2.0, 30, resident=["out0"])
    pool = get_device().pool
    kept = program.run({"x": RNG.standard_normal(30, dtype=np.float32)})["out0"]
    live = pool.live
    del kept
    gc.collect()
    assert pool.live == live - 1


def test_device_inputs_are_checked():
    first = affine_program(1.0, 0.0, 30, resident=["out0"])
    other = affine_program(1.0, 0.0, 31)
    kept = first.run({"x": RNG.standard_normal(30, dtype=np.float32)})["out0"]
    with pytest.raises(InputError, match=r"expects float32\[31\], got float32\[30\]"):
        other.run({}, device_inputs={"x": kept})
    same = affine_program(1.0, 0.0, 30)
    with pytest.raises(InputError, match="given twice"):
        same.run({"x": np.zeros(30, np.float32)}, device_inputs={"x": kept})
    kept.release()
    with pytest.raises(InputError, match="live DeviceArray"):
        same.run({}, device_inputs={"x": kept})
    with pytest.raises(InputError, match="not outputs of this plan"):
        affine_program(1.0, 0.0, 30, resident=["nope"])


def test_a_run_over_the_last_runs_buffers_binds_as_it_did_and_still_checks_its_arrays():
    """``DeviceInputs.bind``: a run whose device array is another object over the last run's buffer (what a kept
    optimizer's gradients and a backward's saved activations are at every step) binds the last run's swaps, and
    computes over the buffer's current values; an array of another shape or dtype over that buffer, or a released
    one, is refused all the same."""
    program = affine_program(2.0, 1.0, 32, device_only=["x"])
    dev = get_device()
    x = RNG.standard_normal(32, dtype=np.float32)
    base = DeviceArray.upload(dev, x, "float32")
    np.testing.assert_allclose(program.run({}, device_inputs={"x": base.reshaped((32,))})["out0"], x * 2 + 1,
                               rtol=1e-6)
    swaps = program._device_inputs._last.swaps
    dev.write(base.buffer, 0, -x, "new values")
    np.testing.assert_allclose(program.run({}, device_inputs={"x": base.reshaped((32,))})["out0"], -x * 2 + 1,
                               rtol=1e-6)
    assert program._device_inputs._last.swaps is swaps  # (repeated, not bound again)
    with pytest.raises(InputError, match=r"expects float32\[32\], got float32\[4, 8\]"):
        program.run({}, device_inputs={"x": base.reshaped((4, 8))})
    other = DeviceArray.__new__(DeviceArray)
    other.device, other.shape, other.dtype, other.buffer, other._pool = dev, (32,), "int32", base.buffer, None
    with pytest.raises(InputError, match=r"expects float32\[32\], got int32\[32\]"):
        program.run({}, device_inputs={"x": other})
    other.buffer = None  # (not given back: it was never its own)
    view = base.reshaped((32,))
    view.release()
    with pytest.raises(InputError, match="live DeviceArray"):
        program.run({}, device_inputs={"x": view})
    np.testing.assert_allclose(program.run({}, device_inputs={"x": base})["out0"], -x * 2 + 1, rtol=1e-6)


def test_device_only_input_has_no_buffer_of_its_own_and_refuses_host_data():
    n = 1 << 14
    dev = get_device()
    before = dev.counters.bytes_allocated
    plain = affine_program(2.0, 0.0, n)  # noqa: F841 - kept alive: its buffers count in plain_bytes
    plain_bytes = dev.counters.bytes_allocated - before
    before = dev.counters.bytes_allocated
    lean = affine_program(2.0, 0.0, n, device_only=["x"])
    assert plain_bytes - (dev.counters.bytes_allocated - before) >= 4 * n  # x's buffer was not created
    x = RNG.standard_normal(n, dtype=np.float32)
    array = DeviceArray.upload(dev, x, "float32")
    np.testing.assert_allclose(lean.run({}, device_inputs={"x": array})["out0"], x * 2, rtol=1e-6)
    with pytest.raises(InputError, match="device-only"):
        lean.run({"x": x})
    with pytest.raises(InputError, match="not inputs"):
        affine_program(1.0, 0.0, 8, device_only=["y"])


def test_outputs_written_into_given_arrays_alternate_without_new_bind_groups():
    program = affine_program(0.5, 1.0, 64, resident=["out0"], device_only=["x"])
    dev = get_device()
    x = RNG.standard_normal(64, dtype=np.float32)
    current = DeviceArray.upload(dev, x, "float32")
    spare = DeviceArray(dev.pool, (64,), "float32")
    want = x.copy()

    def step(current, spare):
        out = program.run({}, device_inputs={"x": current}, into={"out0": spare})["out0"]
        assert out is spare
        return out, current

    for _ in range(3):
        current, spare = step(current, spare)
        want = want * 0.5 + 1.0
    before = dev.counters.snapshot()
    for _ in range(6):
        current, spare = step(current, spare)
        want = want * 0.5 + 1.0
    after = dev.counters.snapshot()
    np.testing.assert_allclose(current.numpy(), want, rtol=1e-5, atol=1e-6)
    assert after["bind_groups_created"] == before["bind_groups_created"]
    assert after["buffers_created"] == before["buffers_created"]
    with pytest.raises(InputError, match="also bound as a device input"):
        program.run({}, device_inputs={"x": current}, into={"out0": current})
    with pytest.raises(InputError, match=r"must be float32\[64\], got float32\[8\]"):
        program.run({}, device_inputs={"x": current}, into={"out0": DeviceArray(dev.pool, (8,), "float32")})
    with pytest.raises(InputError, match="not resident outputs"):
        program.run({}, device_inputs={"x": current}, into={"y": spare})
    np.testing.assert_allclose(current.numpy(), want, rtol=1e-5, atol=1e-6)  # refused runs changed nothing


def test_a_small_resident_output_is_read_back_along_with_a_run_that_waits():
    """``run(read_along=...)``: a resident output of a few bytes (a step counter) comes back in the staging buffer of
    a run that reads a host output anyway, with no wait of its own; a run that waits for nothing reads none."""
    b = GraphBuilder()
    x = b.input("x", (2,), "float32")
    h = b.input("h", (64,), "float32")
    b.output(b.map(lambda v: E.add(v, E.const(1.0, E.F32)), x, dtype="float32"))  # out0: the counter, kept
    b.output(b.map(lambda v: E.mul(v, E.const(3.0, E.F32)), h, dtype="float32"))  # out1: read back
    dev = get_device()
    plan, _ = compile_graph(b.graph, dev.limits)
    program = Program(dev, plan, resident_outputs=["out0"])
    assert program.readable_along == {"out0": 8}
    counter, values = np.array([1.0, 5.0], np.float32), RNG.standard_normal(64, dtype=np.float32)
    before = dev.counters.snapshot()
    plain = program.run({"x": counter, "h": values})
    middle = dev.counters.snapshot()
    along = program.run({"x": counter, "h": values}, read_along=["out0"])
    after = dev.counters.snapshot()
    np.testing.assert_allclose(program.read_along["out0"], counter + 1)
    np.testing.assert_allclose(along["out0"].numpy(), counter + 1)
    np.testing.assert_allclose(along["out1"], values * 3, rtol=1e-6)
    assert after["waits"] - middle["waits"] == middle["waits"] - before["waits"]  # (the numpy() above came after)
    assert (after["bytes_downloaded"] - middle["bytes_downloaded"]) - (
        middle["bytes_downloaded"] - before["bytes_downloaded"]) == 8
    assert isinstance(plain["out0"], DeviceArray)
    kept_only = affine_program(1.0, 1.0, 2, resident=["out0"])
    kept_only.run({"x": counter}, read_along=["out0"])
    assert kept_only.read_along == {}  # (nothing read back: the run did not wait)


def test_a_reshaped_view_binds_as_an_input_of_another_shape_and_holds_its_buffer():
    """``DeviceArray.reshaped``: a [6] output bound as a [2, 3] input (a step's tokens as the next step's ids); the
    buffer goes back to the pool when both the array and its view are gone, not before; a view of another element
    count is refused."""
    first = affine_program(2.0, 1.0, 6, resident=["out0"])
    b = GraphBuilder()
    x = b.input("x", (2, 3), "float32")
    b.output(b.map(lambda v: E.mul(v, E.const(3.0, E.F32)), x, dtype="float32"))
    dev = get_device()
    second = Program(dev, compile_graph(b.graph, dev.limits)[0])
    values = RNG.standard_normal(6, dtype=np.float32)
    kept = first.run({"x": values})["out0"]
    view = kept.reshaped((2, 3))
    assert view.shape == (2, 3) and view.buffer is kept.buffer and view.dtype == kept.dtype
    with pytest.raises(ValueError, match=r"cannot view float32\[6\] as shape \[4\]"):
        kept.reshaped((4,))
    live = dev.pool.live
    del kept
    gc.collect()
    assert dev.pool.live == live  # the view holds the buffer
    np.testing.assert_allclose(second.run({}, device_inputs={"x": view})["out0"], (values * 2 + 1).reshape(2, 3) * 3,
                               rtol=1e-5, atol=1e-6)
    del view
    gc.collect()
    assert dev.pool.live == live - 1


def test_a_small_resident_output_is_read_later_from_a_run_in_flight(monkeypatch):
    """``run(read_later=...)``: runs that wait for nothing carry a resident output of a few bytes in their staging
    buffers; reading the second of three (``LaterRead.values``) waits once and reads the first with it, the third
    stays in flight until its own read. Under ``MEGANEURA_SYNC`` the run waits and its values are read at once."""
    program = affine_program(2.0, 1.0, 2, resident=["out0"])
    dev = get_device()
    dev.synchronize()
    inputs = [RNG.standard_normal(2, dtype=np.float32) for _ in range(3)]
    waits = dev.counters.waits
    laters = []
    for x in inputs:
        program.run({"x": x}, read_later=["out0"])
        laters.append(program.later)
    assert dev.counters.waits == waits and len(dev.in_flight) == 3
    np.testing.assert_allclose(laters[1].values()["out0"], inputs[1] * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose(laters[0].values()["out0"], inputs[0] * 2 + 1, rtol=1e-6)
    assert dev.counters.waits == waits + 1 and len(dev.in_flight) == 1
    np.testing.assert_allclose(laters[2].values()["out0"], inputs[2] * 2 + 1, rtol=1e-6)
    assert dev.counters.waits == waits + 2 and not dev.in_flight
    monkeypatch.setattr(dev.in_flight, "sync", True)
    program.run({"x": inputs[0]}, read_later=["out0"])
    assert not dev.in_flight and dev.counters.waits == waits + 3
    np.testing.assert_allclose(program.later.values()["out0"], inputs[0] * 2 + 1, rtol=1e-6)


def test_kept_device_inputs_are_bound_for_every_run_until_given_again():
    """``Program.keep_inputs``: the arrays kept are bound at every later run, which gives the other device inputs
    only; one given again replaces the kept one for that run; a kept array is checked when it is kept."""
    b = GraphBuilder()
    x, w = b.input("x", (30,), "float32"), b.input("w", (30,), "float32")
    b.output(b.map(lambda u, v: E.add(E.mul(u, v), v), x, w, dtype="float32"))
    dev = get_device()
    plan, _ = compile_graph(b.graph, dev.limits)
    program = Program(dev, plan, device_only_inputs=["x", "w"])
    xs, ws = (RNG.standard_normal(30, dtype=np.float32) for _ in range(2))
    x_arr, w_arr, other_w = (DeviceArray.upload(dev, v, "float32") for v in (xs, ws, ws * 2))
    program.keep_inputs({"w": w_arr})
    for _ in range(2):
        np.testing.assert_allclose(program.run({}, device_inputs={"x": x_arr})["out0"], xs * ws + ws, rtol=1e-6)
    replaced = program.run({}, device_inputs={"x": x_arr, "w": other_w})["out0"]
    np.testing.assert_allclose(replaced, xs * ws * 2 + ws * 2, rtol=1e-6)
    with pytest.raises(InputError, match=r"missing inputs \[.x.\]"):
        program.run({}, device_inputs={})
    with pytest.raises(InputError, match="expects float32"):
        program.keep_inputs({"w": DeviceArray.upload(dev, ws[:10], "float32")})
