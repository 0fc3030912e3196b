"""Program on the recording device (tests/helpers/recording_device.py), with no GPU: the buffers, pipelines, bind
groups and dispatches it builds once and replays, how it submits them, how params rebind, and what it refuses before
building anything. test_program.py runs the same kinds of plans on a real adapter and checks their results."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import meganeura.runtime.program as program_module
import meganeura.runtime.program_plan as program_plan
from meganeura.runtime.errors import InputError, KernelStatusError, LimitError, MeganeuraError
from meganeura.runtime.plan import Binding, BufferSpec, Dispatch
from meganeura.runtime.program import Program

from helpers.plans import (ADD, DOUBLE, add_plan, affine_plan, arena_chain_plan, chain_plan, gather_plan,
                           no_output_plan)
from helpers.recording_device import Copy, RecordingDevice

TESTS = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(0)


def test_recording_device_imports_neither_torch_nor_wgpu():
    code = "import sys, helpers.recording_device; print(sorted(m for m in ('torch', 'wgpu') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(TESTS)}  # (the test scripts keep the working directory off sys.path)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def copies_of(submit) -> list[tuple[str, int, int, int]]:
    """(source label, source offset, staging offset, size) of each copy in ``submit``."""
    return [(c.source.label, c.source_offset, c.destination_offset, c.size)
            for buffer in submit.command_buffers for c in buffer.commands if isinstance(c, Copy)]


@pytest.mark.parametrize("ahead", [False, True])
def test_a_plan_is_built_once_then_replays_the_same_dispatches(monkeypatch, ahead):
    """Construction allocates the plan's own buffers and two staging buffers and compiles each kernel once; every run
    uploads the inputs in one write, submits the same dispatch with the same bindings, copies the output out, and
    creates nothing (also where the run after the first submits what the first recorded ahead)."""
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", 1 if ahead else 10**9)
    device = RecordingDevice()
    program = Program(device, add_plan())
    assert [(b.label, b.size, b.kind) for b in device.buffers] == [
        ("meganeura fence", 4, "storage"), ("inputs", 912, "storage"), ("out", 400, "storage"),
        ("staging", 400, "staging"), ("staging", 400, "staging")]
    assert device.compiled == [(ADD, 3, "add")]
    a, b = RNG.standard_normal(100, dtype=np.float32), RNG.standard_normal(100, dtype=np.float32)
    program.run({"a": a, "b": b})
    first = device.dispatched()
    assert first == [("add", (2, 1, 1), (("inputs", 0, 400), ("inputs", 512, 400), ("out", 0, 400)))]
    inputs = device.buffers[1]
    assert inputs.data[:400] == a.tobytes() and inputs.data[512:] == b.tobytes()
    for _ in range(2):
        before = device.counters.snapshot()
        program.run({"a": a, "b": b})
        after = device.counters.snapshot()
        for key in ("pipelines_created", "buffers_created", "bind_groups_created", "bytes_allocated"):
            assert after[key] == before[key], key
        assert after["submits"] == before["submits"] + 1
        assert after["bytes_uploaded"] == before["bytes_uploaded"] + 912
        assert copies_of(device.submits[-1]) == [("out", 0, 0, 400)]
    assert device.dispatched() == first * 3


@pytest.mark.parametrize("ahead", [False, True])
def test_long_plan_goes_to_the_queue_in_parts_in_order(monkeypatch, ahead):
    """Parts of 2, 4, 4 and 2 dispatches, in the plan's order; a plan that records ahead submits each later run's
    dispatches, recorded during the run before, in one submit."""
    monkeypatch.setattr(program_plan, "FIRST_PART", 2)
    monkeypatch.setattr(program_plan, "SUBMIT_EVERY", 4)
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", 12 if ahead else 13)
    device = RecordingDevice()
    plan = chain_plan(100, 12)
    program = Program(device, plan)
    for run in range(3):
        start = len(device.submits)
        program.run({"a": RNG.standard_normal(100, dtype=np.float32)})
        submits = device.submits[start:]
        assert [len(s.dispatches) for s in submits] == ([12] if ahead and run else [2, 4, 4, 2]), run
        assert [d.pipeline.label for s in submits for d in s.dispatches] == [d.kernel for d in plan.dispatches]
        assert not any(copies_of(s) for s in submits[:-1]) and copies_of(submits[-1]) == [("out", 0, 0, 400)]


def test_arena_chain_binds_one_pipeline_through_two_arena_tensors():
    n = 40
    nb, off = 4 * n, 256
    device = RecordingDevice()
    program = Program(device, arena_chain_plan(n))
    program.run({"x": RNG.standard_normal(n, dtype=np.float32)})
    assert device.compiled == [(DOUBLE, 2, "double")]
    assert device.dispatched() == [
        ("double", (1, 1, 1), (("x", 0, nb), ("arena", 0, nb))),
        ("double", (1, 1, 1), (("arena", 0, nb), ("arena", off, nb))),
        ("double", (1, 1, 1), (("arena", off, nb), ("y", 0, nb))),
    ]
    assert [b.size for b in device.buffers if b.label == "arena"] == [off + nb]
    assert device.counters.bind_groups_created == program.stats()["bind_groups"] == 3


@pytest.mark.parametrize("ahead", [False, True])
def test_params_uploaded_then_rebound_are_what_the_next_run_binds(monkeypatch, ahead):
    """The param buffer is uploaded, then replaced: the replaced one is destroyed and the next run's dispatch binds
    the new one (also where the run before had recorded the next one ahead over the old buffer); binding the same
    buffer again builds nothing."""
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", 1 if ahead else 10**9)
    device = RecordingDevice()
    program = Program(device, affine_plan())
    x = RNG.standard_normal(64, dtype=np.float32)
    with pytest.raises(MeganeuraError, match="weights"):
        program.run({"x": x})
    assert device.submits == []
    w, bias = RNG.standard_normal(64, dtype=np.float32), RNG.standard_normal(64, dtype=np.float32)
    program.upload_params({"w": w, "bias": bias})
    uploaded = device.buffers[-1]
    assert (uploaded.label, uploaded.size, bytes(uploaded.data)) == ("weights", 512, w.tobytes() + bias.tobytes())
    for _ in range(2):
        program.run({"x": x})
        assert [r[0] for r in device.submits[-1].dispatches[0].group.ranges][1:3] == [uploaded, uploaded]
    external = device.upload(np.zeros(128, np.float32), "external weights")
    before = device.counters.snapshot()
    program.bind_params({"weights": external})
    assert device.counters.bind_groups_created == before["bind_groups_created"] + 1
    assert uploaded.destroyed and device.counters.bytes_allocated == before["bytes_allocated"] - 512
    program.run({"x": x})
    assert device.dispatched()[-1][2] == (("x", 0, 256), ("external weights", 0, 256), ("external weights", 256, 256),
                                          ("y", 0, 256))
    before = device.counters.snapshot()
    program.bind_params({"weights": external})
    assert device.counters.snapshot() == before


@pytest.mark.parametrize("ahead", [False, True])
def test_status_words_are_cleared_before_each_runs_dispatches(monkeypatch, ahead):
    """A kernel that raises its status word (here the stand-in ``on_dispatch``) fails that run only: the clears go
    before the dispatches of every run, also those recorded ahead."""
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", 1 if ahead else 10**9)
    raising = []

    def kernel(dispatch):
        if raising:
            status, offset, _ = dispatch.group.ranges[3]
            status.data[offset:offset + 4] = np.uint32(1).tobytes()

    device = RecordingDevice(on_dispatch=kernel)
    program = Program(device, gather_plan(1))
    inputs = {"table": np.zeros(8, np.float32), "idx": np.zeros(20, np.int64)}
    for run in range(4):
        raising[:] = [True] if run == 1 else []
        if run == 1:
            with pytest.raises(KernelStatusError, match="index out of range in embedding"):
                program.run(inputs)
        else:
            program.run(inputs)


def test_resident_output_is_written_into_the_array_given_and_not_read_back():
    """A resident output's dispatch binds the pool buffer of its DeviceArray, or the one ``into`` hands back; the run
    reads nothing back and waits for nothing. Alternating between two arrays builds one bind group per array, then
    nothing."""
    device = RecordingDevice()
    program = Program(device, add_plan(), resident_outputs=["sum"])
    a = np.ones(100, np.float32)
    first = program.run({"a": a, "b": a})["sum"]
    second = program.run({"a": a, "b": a})["sum"]
    assert first.buffer is not second.buffer
    assert copies_of(device.submits[-1]) == [] and device.counters.waits == 0
    before = device.counters.snapshot()
    for array in (first, second, first, second):
        program.run({"a": a, "b": a}, into={"sum": array})
        assert device.submits[-1].dispatches[0].group.ranges[2][0] is array.buffer
    assert device.counters.snapshot()["bind_groups_created"] == before["bind_groups_created"]
    assert device.counters.snapshot()["buffers_created"] == before["buffers_created"]


def test_plan_without_outputs_copies_nothing_and_waits_for_nothing():
    device = RecordingDevice()
    program = Program(device, no_output_plan())
    assert program.run({"x": np.ones(16, np.float32)}) == {}
    assert copies_of(device.submits[-1]) == []
    assert device.counters.bytes_downloaded == 0 and device.counters.waits == 0


def test_runs_in_flight_are_bounded():
    """A loop that never reads keeps at most MAX_IN_FLIGHT runs' staging buffers: the next run reads the oldest."""
    from meganeura.runtime.in_flight import MAX_IN_FLIGHT

    device = RecordingDevice()
    program = Program(device, gather_plan(1), resident_outputs=["out"])
    for _ in range(3 * MAX_IN_FLIGHT):
        program.run({"table": np.zeros(8, np.float32), "idx": np.zeros(20, np.int64)})
    assert len(device.in_flight) == MAX_IN_FLIGHT
    staging = [b for b in device.buffers if b.kind == "staging"]
    assert len(staging) <= MAX_IN_FLIGHT + 2, [b.label for b in staging]


@pytest.mark.parametrize(
    "inputs, pattern",
    [
        ({"a": np.zeros(100, np.float32)}, r"missing inputs \['b'\]"),
        ({"a": np.zeros(100, np.float32), "b": np.zeros(100, np.float32), "c": 1}, r"unexpected inputs \['c'\]"),
        ({"a": np.zeros(99, np.float32), "b": np.zeros(100, np.float32)}, r"'a' expects shape \(100,\), got \(99,\)"),
        ({"a": np.zeros(100, np.float64), "b": np.zeros(100, np.float32)}, "'a' expects dtype float32, got float64"),
        ({"a": [0.0] * 100, "b": np.zeros(100, np.float32)}, "'a' must be a numpy array"),
    ],
)
def test_bad_inputs_raise_input_error(inputs, pattern):
    device = RecordingDevice()
    program = Program(device, add_plan())
    with pytest.raises(InputError, match=pattern) as info:
        program.run(inputs)
    assert isinstance(info.value, ValueError)
    assert device.submits == [] and device.counters.bytes_uploaded == 0


def refused(device, plan, pattern: str):
    """Program(device, plan) raises LimitError matching ``pattern`` before building anything."""
    with pytest.raises(LimitError, match=pattern) as info:
        Program(device, plan)
    assert [b.label for b in device.buffers] == ["meganeura fence"] and device.compiled == []
    return info.value


def test_binding_over_limit():
    pattern = "tensor 'a' needs 400 bytes but this adapter's max-storage-buffer-binding-size is 256"
    refused(RecordingDevice({"max-storage-buffer-binding-size": 256}), add_plan(), pattern)


def test_buffer_over_limit():
    pattern = "buffer 'inputs' needs 912 bytes .* max-buffer-size is 512"
    refused(RecordingDevice({"max-buffer-size": 512}), add_plan(), pattern)


def test_misaligned_binding_offset():
    device = RecordingDevice()
    plan = add_plan()
    bindings = plan.dispatches[0].bindings
    misaligned = (bindings[0], Binding("inputs", device.offset_alignment // 2, 400), bindings[2])
    plan.buffers[0] = BufferSpec("inputs", 1024, "input")
    plan.dispatches[0] = Dispatch("add", misaligned, (2, 1, 1))
    error = refused(device, plan, "min-storage-buffer-offset-alignment")
    assert error.limit == "min-storage-buffer-offset-alignment"


def test_too_many_workgroups():
    device = RecordingDevice()
    plan = add_plan()
    plan.dispatches[0] = Dispatch("add", plan.dispatches[0].bindings, (device.max_workgroups_per_dim + 1, 1, 1))
    refused(device, plan, "max-compute-workgroups-per-dimension")


def test_too_many_storage_buffers():
    refused(RecordingDevice({"max-storage-buffers-per-shader-stage": 2}), add_plan(),
            r"dispatch 0 \(add\) needs 3 storage buffers .* max-storage-buffers-per-shader-stage is 2")
