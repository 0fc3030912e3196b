"""Program: hand-built plans run on the default adapter (lavapipe on CPU machines), checked against numpy."""
import json
import time

import numpy as np
import pytest

from meganeura.runtime.device import get_device
from meganeura.runtime.errors import InputError, KernelStatusError, MeganeuraError
from meganeura.runtime.plan import Binding, BufferSpec, Dispatch, Plan, TensorSpec
from meganeura.runtime.program import Program

from helpers.plans import (ADD, add_plan, affine_plan, align, arena_chain_plan, chain_plan, gather_plan, groups,
                           kernel, no_output_plan)

RNG = np.random.default_rng(0)


def test_add_matches_numpy():
    program = Program(get_device(), add_plan())
    a, b = RNG.standard_normal(100, dtype=np.float32), RNG.standard_normal(100, dtype=np.float32)
    out = program.run({"a": a, "b": b})
    np.testing.assert_allclose(out["sum"], a + b, rtol=1e-6)
    assert out["sum"].dtype == np.float32


def test_host_seconds_is_the_part_of_a_run_before_the_wait():
    program = Program(get_device(), add_plan())
    a, b = RNG.standard_normal(100, dtype=np.float32), RNG.standard_normal(100, dtype=np.float32)
    start = time.perf_counter()
    program.run({"a": a, "b": b})
    wall = time.perf_counter() - start
    assert 0.0 < program.host_seconds < wall


def test_second_run_creates_nothing():
    device = get_device()
    program = Program(device, add_plan())
    a, b = np.ones(100, np.float32), np.arange(100, dtype=np.float32)
    program.run({"a": a, "b": b})
    before = device.counters.snapshot()
    out = program.run({"a": a, "b": b})
    after = device.counters.snapshot()
    for key in ("pipelines_created", "buffers_created", "bind_groups_created", "bytes_allocated"):
        assert after[key] == before[key], key
    assert after["submits"] == before["submits"] + 1
    assert after["bytes_uploaded"] == before["bytes_uploaded"] + program.plan.buffer("inputs").size
    np.testing.assert_array_equal(out["sum"], a + b)


def test_pipelines_are_cached_across_programs():
    device = get_device()
    Program(device, add_plan())
    before = device.counters.pipelines_created
    Program(device, add_plan(37))
    assert device.counters.pipelines_created == before


def test_json_round_trip_gives_same_results():
    plan = add_plan(50)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    a, b = RNG.standard_normal(50, dtype=np.float32), RNG.standard_normal(50, dtype=np.float32)
    out1 = Program(get_device(), plan).run({"a": a, "b": b})
    out2 = Program(get_device(), again).run({"a": a, "b": b})
    np.testing.assert_array_equal(out1["sum"], out2["sum"])


@pytest.mark.parametrize("ahead", [False, True])
def test_params_upload_and_rebind(monkeypatch, ahead):
    """Params uploaded, then replaced by another buffer: the next run reads the new one (also where a run had
    recorded the next one ahead over the old buffer)."""
    import meganeura.runtime.program as program_module

    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", 1 if ahead else 10**9)
    device = get_device()
    plan = affine_plan()
    program = Program(device, plan)
    x = RNG.standard_normal(64, dtype=np.float32)
    with pytest.raises(MeganeuraError, match="weights"):
        program.run({"x": x})
    w, bias = RNG.standard_normal(64, dtype=np.float32), RNG.standard_normal(64, dtype=np.float32)
    program.upload_params({"w": w, "bias": bias})
    # drivers may contract to fma
    np.testing.assert_allclose(program.run({"x": x})["y"], x * w + bias, rtol=1e-6, atol=1e-6)

    block = np.zeros(plan.buffer("weights").size // 4, np.float32)
    block[:64], block[64:128] = 2.0, 1.0
    external = device.upload(block, "external weights")
    before = device.counters.snapshot()
    program.bind_params({"weights": external})  # replaces (and frees) the uploaded buffer
    assert device.counters.bind_groups_created == before["bind_groups_created"] + 1
    assert device.counters.bytes_allocated == before["bytes_allocated"] - plan.buffer("weights").size
    np.testing.assert_allclose(program.run({"x": x})["y"], x * 2 + 1, rtol=1e-6)
    before = device.counters.snapshot()
    program.bind_params({"weights": external})  # the same buffer again: nothing rebuilt
    assert device.counters.snapshot() == before
    with pytest.raises(InputError, match="not a param buffer"):
        program.bind_params({"x": external})
    with pytest.raises(InputError, match="unknown params"):
        program.upload_params({"nope": w})


def test_arena_chain_reuses_one_pipeline():
    """Three dispatches of one kernel through two arena tensors: out = 8 x."""
    n = 40
    nb, off = 4 * n, align(4 * n)
    plan = arena_chain_plan(n)
    program = Program(get_device(), plan)
    x = RNG.standard_normal(n, dtype=np.float32)
    np.testing.assert_allclose(program.run({"x": x})["y"], 8 * x, rtol=1e-6)
    stats = program.stats()
    assert stats["dispatches"] == 3 and stats["kernels"] == 1 and stats["bind_groups"] == 3
    assert stats["bytes_by_role"] == {"input": nb, "arena": off + nb, "output": nb}


def int_plan(n: int = 10) -> Plan:
    """(int64 x) + 1 and (int32 k) * 3, both outputs in one buffer."""
    nb, off = 4 * n, align(4 * n)
    inc = kernel([("x", "i32"), ("out", "i32")], "out[i] = x[i] + 1;")
    triple = kernel([("k", "i32"), ("out", "i32")], "out[i] = k[i] * 3;")
    return Plan(
        buffers=[BufferSpec("ins", off + nb, "input"), BufferSpec("outs", off + nb, "output")],
        inputs=[TensorSpec("x", "ins", 0, (2, n // 2), "int64"), TensorSpec("k", "ins", off, (n,), "int32")],
        params=[],
        outputs=[TensorSpec("x1", "outs", 0, (2, n // 2), "int64"), TensorSpec("k3", "outs", off, (n,), "int32")],
        kernels={"inc": inc, "triple": triple},
        dispatches=[
            Dispatch("inc", (Binding("ins", 0, nb), Binding("outs", 0, nb)), groups(n)),
            Dispatch("triple", (Binding("ins", off, nb), Binding("outs", off, nb)), groups(n)),
        ],
    )


def test_int64_and_int32_round_trip():
    program = Program(get_device(), int_plan())
    x = np.array([[-(2**31), -5, 0, 7, 2**31 - 2], [1, 2, 3, 4, 5]], dtype=np.int64)
    k = np.arange(-5, 5, dtype=np.int32)
    out = program.run({"x": x, "k": k})
    assert out["x1"].dtype == np.int64 and out["k3"].dtype == np.int32
    np.testing.assert_array_equal(out["x1"], x + 1)
    np.testing.assert_array_equal(out["k3"], k * 3)
    with pytest.raises(InputError, match="'x'.*outside int32"):
        program.run({"x": x * 2**20, "k": k})


def test_bool_input_and_output():
    n = 33
    body = kernel([("x", "f32"), ("mask", "u32"), ("out", "u32")], "out[i] = u32(x[i] > 0.0) & mask[i];")
    plan = Plan(
        buffers=[BufferSpec("x", 4 * n, "input"), BufferSpec("m", 4 * n, "input"), BufferSpec("o", 4 * n, "output")],
        inputs=[TensorSpec("x", "x", 0, (3, 11), "float32"), TensorSpec("mask", "m", 0, (3, 11), "bool")],
        params=[],
        outputs=[TensorSpec("pos", "o", 0, (3, 11), "bool")],
        kernels={"k": body},
        dispatches=[Dispatch("k", (Binding("x", 0, 4 * n), Binding("m", 0, 4 * n), Binding("o", 0, 4 * n)), groups(n))],
    )
    x = RNG.standard_normal((3, 11), dtype=np.float32)
    mask = RNG.random((3, 11)) > 0.5
    out = Program(get_device(), plan).run({"x": x, "mask": mask})
    assert out["pos"].dtype == np.bool_
    np.testing.assert_array_equal(out["pos"], (x > 0) & mask)


@pytest.mark.parametrize("ahead", [False, True])
def test_status_raises_then_clears(monkeypatch, ahead):
    """A kernel's status code raises; the next run starts from cleared status words, also where the runs after the
    first submit dispatches recorded ahead (the clears recorded with them)."""
    import meganeura.runtime.program as program_module

    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", 1 if ahead else 10**9)
    device = get_device()
    program = Program(device, gather_plan(1))
    table = RNG.standard_normal(8, dtype=np.float32)
    idx = RNG.integers(0, 8, 20)
    np.testing.assert_array_equal(program.run({"table": table, "idx": idx})["out"], table[idx])
    bad = idx.copy()
    bad[3] = 8
    with pytest.raises(KernelStatusError, match="index out of range in embedding") as info:
        program.run({"table": table, "idx": bad})
    assert info.value.code == 1
    before = device.counters.submits
    np.testing.assert_array_equal(program.run({"table": table, "idx": idx})["out"], table[idx])
    assert device.counters.submits == before + 1


def test_status_without_message_names_the_code():
    program = Program(get_device(), gather_plan(7))
    with pytest.raises(KernelStatusError, match="status code 7"):
        program.run({"table": np.zeros(8, np.float32), "idx": np.full(20, -1, np.int64)})


def test_a_status_set_by_a_run_in_flight_raises_at_the_next_wait_naming_it():
    """A run with no host outputs returns once submitted; the index out of range it met is raised at the next wait
    (a download, another run's read-back, ``synchronize``), naming that run and the op, once; later runs go on."""
    device = get_device()
    device.synchronize()
    program = Program(device, gather_plan(1), resident_outputs=["out"], label="the gather plan")
    table = RNG.standard_normal(8, dtype=np.float32)
    idx = RNG.integers(0, 8, 20)
    bad = idx.copy()
    bad[3] = 8
    waits = device.counters.waits
    program.run({"table": table, "idx": idx})
    failed = program.run({"table": table, "idx": bad})["out"]  # no error yet: nothing was waited for
    good = program.run({"table": table, "idx": idx})["out"]
    assert device.counters.waits == waits
    with pytest.raises(KernelStatusError, match=r"index out of range in embedding \(set by run 2 of the gather plan"):
        good.numpy()
    np.testing.assert_array_equal(good.numpy(), table[idx])  # raised once; the run after it computed its result
    assert failed.numpy()[3] == 0
    device.synchronize()


def test_a_status_set_by_a_run_in_flight_raises_at_a_later_read_through_it():
    """Runs whose small outputs are read later (``read_later``): reading the third of four reads the first three,
    raises the index out of range that the second met, naming it, and leaves the fourth in flight; the values of the
    runs read are there, the failed run's with its clamped index's 0."""
    device = get_device()
    device.synchronize()
    program = Program(device, gather_plan(1, n=4), resident_outputs=["out"], label="the gather plan")
    table = RNG.standard_normal(8, dtype=np.float32)
    idx = RNG.integers(0, 8, 4)
    bad = idx.copy()
    bad[1] = 8
    laters = []
    for run_idx in (idx, bad, idx, idx):
        program.run({"table": table, "idx": run_idx}, read_later=["out"])
        laters.append(program.later)
    with pytest.raises(KernelStatusError, match=r"index out of range in embedding \(set by run 2 of the gather plan"):
        laters[2].values()
    assert len(device.in_flight) == 1
    for k in (0, 2):
        np.testing.assert_array_equal(laters[k].values()["out"], table[idx])
    assert laters[1].values()["out"][1] == 0
    np.testing.assert_array_equal(laters[3].values()["out"], table[idx])


def test_empty_tensors():
    n = 8
    plan = add_plan(n)
    plan.buffers.append(BufferSpec("nothing", 4, "input"))
    plan.inputs.append(TensorSpec("empty_in", "nothing", 0, (0, 3), "float32"))
    plan.outputs.append(TensorSpec("empty_out", "out", 0, (2, 0), "int64"))
    program = Program(get_device(), plan)
    a = np.ones(n, np.float32)
    out = program.run({"a": a, "b": a, "empty_in": np.zeros((0, 3), np.float32)})
    np.testing.assert_array_equal(out["sum"], 2 * a)
    assert out["empty_out"].shape == (2, 0) and out["empty_out"].dtype == np.int64


def test_shader_error_names_the_kernel():
    plan = add_plan()
    plan.kernels["add"] = ADD.replace("a[i] + b[i]", "a[i] + nope[i]")
    with pytest.raises(MeganeuraError, match=r"(?s)kernel 'add'.*nope"):
        Program(get_device(), plan)


def test_release_frees_buffers():
    device = get_device()
    before = device.counters.bytes_allocated
    program = Program(device, affine_plan())
    program.upload_params({"w": np.ones(64, np.float32), "bias": np.zeros(64, np.float32)})
    assert device.counters.bytes_allocated > before
    program.release()
    assert device.counters.bytes_allocated == before
    with pytest.raises(MeganeuraError, match="released"):
        program.run({"x": np.zeros(64, np.float32)})


def test_plan_without_outputs_returns_once_submitted(monkeypatch):
    """A run that reads nothing back does not wait for the GPU (``meganeura.runtime.in_flight``);
    ``Device.synchronize`` waits, and under ``MEGANEURA_SYNC`` every run waits."""
    plan = no_output_plan()
    device = get_device()
    program = Program(device, plan)
    device.synchronize()
    before = device.counters.snapshot()
    assert program.run({"x": np.ones(16, np.float32)}) == {}
    assert device.counters.submits == before["submits"] + 1
    assert device.counters.waits == before["waits"]
    assert device.counters.bytes_downloaded == before["bytes_downloaded"]
    device.synchronize()
    assert device.counters.waits == before["waits"] + 1
    monkeypatch.setattr(device.in_flight, "sync", True)
    program.run({"x": np.ones(16, np.float32)})
    assert device.counters.waits == before["waits"] + 2


def test_submission_parts_start_short_and_grow():
    from meganeura.runtime.program_plan import FIRST_PART, SUBMIT_EVERY, submission_parts

    assert submission_parts(1) == [(0, 1)]
    assert submission_parts(2 * FIRST_PART - 1) == [(0, 2 * FIRST_PART - 1)]  # too short to be worth a second submit
    for count in (2 * FIRST_PART, 105, 1000):
        parts = submission_parts(count)
        assert parts[0] == (0, FIRST_PART) and parts[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, in order
        sizes = [end - start for start, end in parts]
        assert all(FIRST_PART <= size for size in sizes)
        assert all(b == min(2 * a, SUBMIT_EVERY) for a, b in zip(sizes[:-2], sizes[1:-1]))
        assert max(sizes[:-1]) <= SUBMIT_EVERY and sizes[-1] < SUBMIT_EVERY + FIRST_PART


def test_long_plan_submitted_in_parts_keeps_dispatch_order(monkeypatch):
    """A long plan goes to the queue in parts; each part reads what the previous one wrote."""
    import meganeura.runtime.program_plan as program_plan

    n, steps = 100, 12
    monkeypatch.setattr(program_plan, "FIRST_PART", 2)
    monkeypatch.setattr(program_plan, "SUBMIT_EVERY", 4)
    device = get_device()
    program = Program(device, chain_plan(n, steps))
    a = RNG.standard_normal(n, dtype=np.float32)
    before = device.counters.submits
    out = program.run({"a": a})
    assert device.counters.submits - before == 4  # parts of 2, 4, 4 and 2 dispatches
    np.testing.assert_allclose(out["out"], a * (2**steps - 1), rtol=1e-6)


def test_later_runs_submit_the_dispatches_recorded_ahead(monkeypatch):
    """A run records the next run's dispatches while the GPU works; the next run submits them with its copies in one
    submit, on its own fresh inputs. A profiled run in between still times every dispatch, and the runs after it are
    right again."""
    import meganeura.runtime.program as program_module
    import meganeura.runtime.program_plan as program_plan
    from meganeura.runtime.profiler import profile

    n, steps = 100, 12
    monkeypatch.setattr(program_plan, "FIRST_PART", 2)
    monkeypatch.setattr(program_plan, "SUBMIT_EVERY", 4)
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", steps)
    device = get_device()
    program = Program(device, chain_plan(n, steps))
    for run in range(5):
        a = RNG.standard_normal(n, dtype=np.float32)
        before = device.counters.submits
        if run == 2:
            with profile(device) as prof:
                out = program.run({"a": a})
            assert [e["name"] for e in prof.events] == [d.label for d in program.plan.dispatches]
        else:
            out = program.run({"a": a})
            assert device.counters.submits - before == (4 if run in (0, 3) else 1), run  # parts, or all ahead
        np.testing.assert_allclose(out["out"], a * (2**steps - 1), rtol=1e-6)
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", steps + 1)  # a shorter plan records each run itself
    short = Program(device, chain_plan(n, steps))
    for _ in range(2):
        before = device.counters.submits
        short.run({"a": RNG.standard_normal(n, dtype=np.float32)})
        assert device.counters.submits - before == 4


@pytest.mark.parametrize("into", [True, False])
def test_runs_over_repeating_per_run_buffers_submit_what_the_run_before_recorded_ahead(monkeypatch, into):
    """A run whose per-run buffers (a device input, a resident output) are those of the run before (an output written
    into the same array: a static KV cache) or of the run two before (a new output each run, which the pool hands
    the buffer it had two runs before: a decode step's KV cache) submits the dispatches the run before recorded
    ahead over them, in one submit; the results stay right."""
    import meganeura.runtime.program as program_module
    import meganeura.runtime.program_plan as program_plan
    from meganeura.runtime.resident import DeviceArray

    n, steps = 100, 12
    monkeypatch.setattr(program_plan, "FIRST_PART", 2)
    monkeypatch.setattr(program_plan, "SUBMIT_EVERY", 4)
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", steps)
    device = get_device()
    program = Program(device, chain_plan(n, steps), resident_outputs=["out"], device_only_inputs=["a"])
    a = RNG.standard_normal(n, dtype=np.float32)
    given = DeviceArray.upload(device, a, "float32")
    target = DeviceArray.upload(device, np.zeros(n, np.float32), "float32")
    submits, out = [], None
    for _ in range(6):
        before = device.counters.submits
        out = program.run({}, device_inputs={"a": given}, into={"out": target} if into else None)["out"]
        submits.append(device.counters.submits - before)
        np.testing.assert_allclose(out.numpy(), a * (2**steps - 1), rtol=1e-6)
    # parts (4 submits) until the buffers have repeated once, then what the run before recorded ahead (1)
    assert submits == ([4, 4, 1, 1, 1, 1] if into else [4, 4, 4, 1, 1, 1]), submits


def test_a_run_that_does_not_wait_leaves_the_next_runs_recording_to_the_next_wait(monkeypatch):
    """A run that stays in flight records the next run ahead at the device's next wait, not after its submit (a
    training loop's forward and backward submit one after the other); the run after the wait submits that in one
    submit, and a run with no wait before it records it itself, in one piece. The results stay right, each run's
    input written anew into the same device buffer."""
    import meganeura.runtime.program as program_module
    import meganeura.runtime.program_plan as program_plan
    import meganeura.runtime.program_recording as recording
    from meganeura.runtime.resident import DeviceArray

    n, steps = 100, 12
    monkeypatch.setattr(program_plan, "FIRST_PART", 2)
    monkeypatch.setattr(program_plan, "SUBMIT_EVERY", 4)
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", steps)
    passes = []
    monkeypatch.setattr(recording, "compute_pass", lambda e, c, g=None, real=recording.compute_pass: (
        passes.append(len(c)), real(e, c, g)))
    device = get_device()
    device.synchronize()
    program = Program(device, chain_plan(n, steps), resident_outputs=["out"], device_only_inputs=["a"])
    given = DeviceArray.upload(device, np.zeros(n, np.float32), "float32")
    target = DeviceArray.upload(device, np.zeros(n, np.float32), "float32")
    recorded = []  # (passes recorded, submits) by each run, then by each wait
    for run in range(5):
        a = RNG.standard_normal(n, dtype=np.float32)
        device.write(given.buffer, 0, a, "a")
        before, passes[:] = device.counters.submits, []
        program.run({}, device_inputs={"a": given}, into={"out": target})
        recorded.append((list(passes), device.counters.submits - before))
        if run in (1, 2):
            passes[:] = []
            device.synchronize()
            recorded.append((list(passes), "wait"))
    np.testing.assert_allclose(target.numpy(), a * (2**steps - 1), rtol=1e-6)
    # in parts (4 passes of 2, 4, 4, 2 dispatches, 4 submits) until the buffers repeat; the second run's next is
    # recorded at the wait after it, as is the third's; the fifth records its own at once, with no wait before it
    assert recorded == [([2, 4, 4, 2], 4), ([2, 4, 4, 2], 4), ([12], "wait"), ([], 1), ([12], "wait"), ([], 1),
                        ([12], 1)], recorded


def test_a_run_recorded_ahead_over_buffers_destroyed_since_is_dropped(monkeypatch):
    """A run that does not wait leaves the next run's recording for the next wait, over the per-run buffers it
    expects the next run to bind. Where one of those is destroyed before that wait (the kept optimizer empties the
    device's pool at its first update, where a backward's saved activations wait), nothing is recorded over it:
    wgpu-core aborts the process when a command encoder is finished over a destroyed buffer. The next run, over a
    new buffer, computes the right result."""
    import meganeura.runtime.program as program_module
    from meganeura.runtime.resident import DeviceArray

    n, steps = 64, 4
    monkeypatch.setattr(program_module, "AHEAD_MIN_DISPATCHES", steps)
    device = get_device()
    device.synchronize()
    program = Program(device, chain_plan(n, steps), resident_outputs=["out"], device_only_inputs=["a"])
    target = DeviceArray.upload(device, np.zeros(n, np.float32), "float32")
    first, second = (DeviceArray.upload(device, np.zeros(n, np.float32), "float32") for _ in range(2))
    for given in (first, second, first):  # the buffers alternate: the next run is expected to bind the second's
        program.run({}, device_inputs={"a": given}, into={"out": target})
    destroyed = second.buffer
    second.release()
    device.pool.clear()
    assert device.any_destroyed([destroyed])
    device.synchronize()  # the wait where the next run was to be recorded
    a = RNG.standard_normal(n, dtype=np.float32)
    third = DeviceArray.upload(device, a, "float32")
    program.run({}, device_inputs={"a": third}, into={"out": target})
    np.testing.assert_allclose(target.numpy(), a * (2**steps - 1), rtol=1e-6)


def test_large_download_is_copied_in_slices_exactly(monkeypatch):
    """A download of several slices (a device array to the host) is copied by threads: every byte lands where it
    belongs."""
    from meganeura.runtime import native
    from meganeura.runtime.resident import DeviceArray

    n = 3 * 16384 + 77  # about 3 x 64 KiB: three page-aligned slices, the last one short
    monkeypatch.setattr(native, "COPY_SLICE_BYTES", 1 << 16)
    monkeypatch.setattr(native, "COPY_THREADS", 3)
    copies = []
    monkeypatch.setattr(native, "_copy_in_slices",
                        lambda d, s, t, real=native._copy_in_slices: (copies.append(t), real(d, s, t)))
    a = RNG.standard_normal(n, dtype=np.float32)
    array = DeviceArray.upload(get_device(), a, "float32")
    np.testing.assert_array_equal(array.numpy(), a)
    array.release()
    assert copies == [3]


def test_outputs_are_the_mapped_read_back_and_free_it_when_gone():
    """Outputs are views of the mapped staging buffer: a run while earlier outputs live takes another buffer, and
    each buffer comes back for reuse once its outputs are gone."""
    import gc

    device = get_device()
    program = Program(device, add_plan())
    runs = [(RNG.standard_normal(100, dtype=np.float32), RNG.standard_normal(100, dtype=np.float32)) for _ in range(3)]
    held = [program.run({"a": a, "b": b})["sum"] for a, b in runs]
    assert program._read_back.held == 3
    for out, (a, b) in zip(held, runs):  # each run's result intact: none was overwritten by a later run
        np.testing.assert_array_equal(out, a + b)
    held[0][:] = 7.0  # the outputs are writable host memory; writing them changes no later run
    del held, out
    gc.collect()
    assert program._read_back.held == 0
    before = device.counters.snapshot()
    a, b = runs[0]
    np.testing.assert_array_equal(program.run({"a": a, "b": b})["sum"], a + b)
    assert device.counters.snapshot()["buffers_created"] == before["buffers_created"]  # a freed buffer was reused


def test_outputs_outlive_their_program():
    """A released program's outputs stay readable; their buffer is destroyed when they are gone."""
    import gc

    device = get_device()
    before = device.counters.bytes_allocated
    program = Program(device, add_plan())
    a, b = RNG.standard_normal(100, dtype=np.float32), RNG.standard_normal(100, dtype=np.float32)
    out = program.run({"a": a, "b": b})["sum"]
    program.release()
    assert device.counters.bytes_allocated > before  # the mapped staging buffer, still under ``out``
    np.testing.assert_array_equal(out, a + b)
    del out
    gc.collect()
    assert device.counters.bytes_allocated == before
