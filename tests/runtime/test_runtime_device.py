"""Device: adapter choice (with fake adapters), caching, limits, buffers and error translation."""
import threading
import time

import numpy as np
import pytest
import wgpu

from meganeura.runtime import device as device_module
from meganeura.runtime.device import Device, get_device, list_adapters
from meganeura.runtime.errors import DeviceLostError, MeganeuraError, NoAdapterError
from meganeura.runtime.plan import Binding, BufferSpec, Dispatch, Plan, TensorSpec
from meganeura.runtime.program import Program


class FakeAdapter:
    def __init__(self, device: str, adapter_type: str, backend: str = "Vulkan", description: str = ""):
        self.info = {
            "device": device, "description": description, "vendor": "", "adapter_type": adapter_type,
            "backend_type": backend,
        }


FAKES = [
    FakeAdapter("llvmpipe", "CPU"),
    FakeAdapter("Intel UHD", "IntegratedGPU", description="Mesa Intel"),
    FakeAdapter("NVIDIA H200", "DiscreteGPU", backend="OpenGL"),
    FakeAdapter("NVIDIA H200", "DiscreteGPU"),
    FakeAdapter("virtio", "VirtualGPU"),
]


@pytest.mark.parametrize(
    "choice, expected",
    [(None, 3), (0, 0), ("4", 4), ("h200", 3), ("MESA INTEL", 1), ("llvm", 0)],
)
def test_adapter_choice(choice, expected):
    assert device_module._choose_adapter(FAKES, choice) == expected


def test_each_local_rank_takes_its_own_gpu_of_the_best_backend():
    adapters = [FakeAdapter("llvmpipe", "CPU"), FakeAdapter("GPU A", "DiscreteGPU", backend="D3D12"),
                FakeAdapter("GPU A", "DiscreteGPU"), FakeAdapter("GPU B", "DiscreteGPU"),
                FakeAdapter("GPU B", "DiscreteGPU", backend="D3D12")]
    picks = [device_module._choose_adapter(adapters, None, rank) for rank in range(3)]
    assert picks == [1, 4, 1], "D3D12 ranks first here (enumeration order); its two GPUs, then round robin"
    assert device_module._choose_adapter(adapters, "gpu b", 0) == 3, "an explicit choice wins over the rank"
    cpu_only = [FakeAdapter("llvmpipe", "CPU"), FakeAdapter("gl", "CPU", "OpenGL")]
    assert [device_module._choose_adapter(cpu_only, None, rank) for rank in range(2)] == [0, 0]


def test_opengl_only_when_nothing_else():
    gl_gpu, cpu = FakeAdapter("gl", "DiscreteGPU", "OpenGL"), FakeAdapter("cpu", "CPU")
    assert device_module._choose_adapter([gl_gpu, cpu], None) == 1
    assert device_module._choose_adapter([FakeAdapter("gl", "CPU", "OpenGL")], None) == 0


@pytest.mark.parametrize("choice, pattern", [(9, "out of range"), ("radeon", "no adapter name contains")])
def test_bad_adapter_choice(choice, pattern):
    with pytest.raises(NoAdapterError, match=pattern):
        device_module._choose_adapter(FAKES, choice)


def test_no_adapter_tells_how_to_install_one():
    with pytest.raises(NoAdapterError, match="mesa-vulkan-drivers"):
        device_module._choose_adapter([], None)


def test_device_is_cached_and_env_var_selects(monkeypatch):
    device = get_device()
    assert get_device() is device
    assert device.backend != "OpenGL"
    index = next(a["index"] for a in list_adapters() if a["name"] == device.name and a["backend"] == device.backend)
    monkeypatch.setenv(device_module.ADAPTER_ENV, str(index))
    assert get_device() is device


def _count_device_inits(monkeypatch) -> list:
    """Start from no device (the process-wide one is put back afterwards); the list collects each Device built."""
    monkeypatch.setattr(device_module, "_devices", {})
    created = []
    real_init = Device.__init__

    def counting_init(self, adapter, *limits):
        created.append((self, threading.current_thread().name))
        real_init(self, adapter, *limits)

    monkeypatch.setattr(Device, "__init__", counting_init)
    return created


def test_prepare_device_creates_the_device_in_the_background(monkeypatch):
    """prepare_device's thread creates the device, and the caller's get_device returns that one (waiting for it if
    need be); a bad choice is raised, with its message, by the caller's own get_device, not lost on the thread."""
    created = _count_device_inits(monkeypatch)
    device_module.prepare_device()
    deadline = time.monotonic() + 60
    while not created and time.monotonic() < deadline:
        time.sleep(0.001)
    device = get_device()
    assert created == [(device, "meganeura-device")]
    device_module.prepare_device("no adapter is called this")
    with pytest.raises(NoAdapterError, match="no adapter is called this"):
        get_device("no adapter is called this")


def test_concurrent_first_get_device_calls_create_one_device(monkeypatch):
    """Two threads asking for a device that does not exist yet get the same new one, created once."""
    created = _count_device_inits(monkeypatch)
    got = []
    threads = [threading.Thread(target=lambda: got.append(get_device())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(created) == 1 and got == [created[0][0], created[0][0]]


def test_device_properties():
    device = get_device()
    assert device.name in device.describe() and device.adapter_type in device.describe()
    assert device.offset_alignment == device.limits["min-storage-buffer-offset-alignment"]
    assert device.max_binding_size <= device.max_buffer_size
    assert device.max_workgroups_per_dim >= 65535
    adapter_features = set(device.adapter.features)
    for feature in ("shader-f16", "subgroup", "timestamp-query"):
        assert (feature in device.features) == (feature in adapter_features)
    listed = list_adapters()
    assert [a["index"] for a in listed] == list(range(len(listed)))
    assert {"index", "name", "type", "backend", "features", "limits"} <= set(listed[0])


def test_buffer_counters():
    device = get_device()
    before = device.counters.snapshot()
    buffer = device.upload(np.arange(16, dtype=np.float32), "sixteen")
    after = device.counters.snapshot()
    assert after["buffers_created"] == before["buffers_created"] + 1
    assert after["bytes_allocated"] == before["bytes_allocated"] + 64
    assert after["bytes_uploaded"] == before["bytes_uploaded"] + 64
    device.destroy_buffer(buffer)
    assert device.counters.bytes_allocated == before["bytes_allocated"]


def test_validation_error_names_the_label():
    device = get_device()
    buffer = device.storage_buffer(64, "small")
    with pytest.raises(MeganeuraError, match=r"(?s)bind group 'misaligned'.*offset"):
        device.bind_group([(buffer, 4, 16)], "misaligned")
    device.destroy_buffer(buffer)


def test_device_lost_raises():
    """A second, private device is destroyed; the next run says the device was lost instead of crashing."""
    index = device_module._choose_adapter(device_module._enumerate_adapters(), None)
    device = Device(wgpu.gpu.enumerate_adapters_sync()[index])
    plan = Plan(
        buffers=[BufferSpec("x", 16, "input"), BufferSpec("y", 16, "output")],
        inputs=[TensorSpec("x", "x", 0, (4,), "float32")],
        params=[],
        outputs=[TensorSpec("y", "y", 0, (4,), "float32")],
        kernels={"copy": "@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n"
                         "@group(0) @binding(1) var<storage, read_write> y: array<f32>;\n"
                         "@compute @workgroup_size(4) fn main(@builtin(global_invocation_id) g: vec3<u32>) "
                         "{ y[g.x] = x[g.x]; }"},
        dispatches=[Dispatch("copy", (Binding("x", 0, 16), Binding("y", 0, 16)), (1, 1, 1))],
    )
    program = Program(device, plan)
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(program.run({"x": x})["y"], x)
    device.wgpu_device.destroy()
    with pytest.raises(DeviceLostError):
        program.run({"x": x})
    assert device.lost
    with pytest.raises(DeviceLostError):
        program.run({"x": x})


def _kernel(value: float) -> str:
    return (f"@group(0) @binding(0) var<storage, read_write> out: array<f32>;\n"
            f"@compute @workgroup_size(1) fn main() {{ out[0] = {value!r}; }}\n")


def test_pipelines_are_compiled_side_by_side_once_per_source():
    dev = get_device()
    before = dev.counters.pipelines_created
    sources = [_kernel(1000.0 + i) for i in range(6)]
    built = dev.pipelines([(s, 1, f"k{i}") for i, s in enumerate(sources)] + [(sources[0], 1, "again")])
    assert dev.counters.pipelines_created - before == 6
    assert built[0] is built[-1] and len({id(p) for p in built}) == 6
    assert dev.pipelines([(sources[3], 1, "k3")])[0] is built[3]
    assert dev.counters.pipelines_created - before == 6


def test_compiled_ahead_pipelines_are_taken_by_pipelines():
    """compile_ahead returns before its pipelines are done; pipelines() then takes those same pipelines (no second
    compile), and a source given twice is compiled once."""
    dev = get_device()
    before = dev.counters.pipelines_created
    sources = [_kernel(7000.0 + i) for i in range(5)]
    dev.compile_ahead([(s, 1, f"k{i}") for i, s in enumerate(sources)] + [(sources[1], 1, "twice")])
    dev.compile_ahead([(sources[2], 1, "again")])
    assert dev.counters.pipelines_created - before == 5
    built = dev.pipelines([(s, 1, f"k{i}") for i, s in enumerate(sources)])
    assert len({id(p) for p in built}) == 5
    assert dev.pipelines([(sources[4], 1, "k4")])[0] is built[4]
    assert dev.counters.pipelines_created - before == 5


def test_a_program_raises_a_compile_error_when_its_params_are_bound():
    """A program's kernels compile while its params upload: a kernel that does not compile is raised, named, by the
    bind that completes the program (and by wait_pipelines), not lost on the compiling thread."""
    dev = get_device()
    plan = Plan(
        buffers=[BufferSpec("param:w", 4, "param"), BufferSpec("out0", 4, "output")],
        inputs=[], params=[TensorSpec("w", "param:w", 0, (1,), "float32")],
        outputs=[TensorSpec("out0", "out0", 0, (1,), "float32")],
        kernels={"broken": "fn main( {"},
        dispatches=[Dispatch("broken", (Binding("param:w", 0, 4), Binding("out0", 0, 4)), (1, 1, 1), "the broken one")],
    )
    program = Program(dev, plan)
    with pytest.raises(MeganeuraError, match="broken"):
        program.upload_params({"w": np.ones(1, np.float32)})
    with pytest.raises(MeganeuraError, match="broken"):
        program.wait_pipelines()


def test_a_bad_kernel_among_many_is_named():
    """The broken kernel is named; the others compiled meanwhile are kept, and the broken one is tried again (and
    named again) when asked for again, not answered from a cached failure's absence."""
    dev = get_device()
    jobs = [(_kernel(2000.0 + i), 1, f"fine{i}") for i in range(3)] + [("fn main( {", 1, "the broken one")]
    with pytest.raises(MeganeuraError, match="the broken one"):
        dev.pipelines(jobs)
    before = dev.counters.pipelines_created
    assert len(dev.pipelines(jobs[:3])) == 3 and dev.counters.pipelines_created == before
    with pytest.raises(MeganeuraError, match="broken, again"):
        dev.pipelines([("fn main( {", 1, "broken, again")])
    assert dev.counters.pipelines_created == before + 1


def test_an_invalid_dispatch_in_a_raw_pass_raises_at_submit():
    """The plan's passes are recorded through raw wgpu-native calls; a recording error must still raise (at
    finish, through the checked API), not go to wgpu's log while the queue runs nothing."""
    dev = get_device()
    out = dev.storage_buffer(4, "out")
    encoder = device_module.native.command_encoder(dev.wgpu_device)
    too_many = dev.max_workgroups_per_dim + 1
    device_module.native.compute_pass(encoder, [(dev.pipeline(_kernel(5.0), 1, "one"), dev.bind_group([(out, 0, 4)]),
                                                 (too_many, 1, 1))])
    with pytest.raises(MeganeuraError, match=r"(?s)submit 'raw'.*refused"):
        dev.submit(encoder, "raw")


def _encode_single(dev, pipeline, out):
    """An encoder holding one dispatch of ``pipeline`` (one workgroup) over the 4-byte buffer ``out``."""
    encoder = dev.wgpu_device.create_command_encoder()
    compute_pass = encoder.begin_compute_pass()
    compute_pass.set_pipeline(pipeline)
    compute_pass.set_bind_group(0, dev.bind_group([(out, 0, 4)]))
    compute_pass.dispatch_workgroups(1)
    compute_pass.end()
    return encoder


def _run_single(dev, pipeline) -> float:
    out = dev.storage_buffer(4, "out")
    dev.submit(_encode_single(dev, pipeline, out))
    return float(np.frombuffer(dev.wgpu_device.queue.read_buffer(out, 0, 4), np.float32)[0])


def test_kernels_compile_without_runtime_checks_unless_asked(monkeypatch):
    dev = get_device()
    unchecked = []
    real = device_module.native.create_unchecked_shader_module

    def spy(*args):
        module = real(*args)
        unchecked.append(module is not None)
        return module

    monkeypatch.setattr(device_module.native, "create_unchecked_shader_module", spy)
    monkeypatch.delenv(device_module.SHADER_CHECKS_ENV, raising=False)
    assert _run_single(dev, dev.pipeline(_kernel(3001.0), 1, "fast")) == 3001.0
    assert unchecked == [True]  # wgpu-native's trusted entry point was found and used
    monkeypatch.setenv(device_module.SHADER_CHECKS_ENV, "1")
    assert _run_single(dev, dev.pipeline(_kernel(3002.0), 1, "checked")) == 3002.0
    assert unchecked == [True]  # the checked kernel went through wgpu-py's own create_shader_module


@pytest.mark.parametrize("value, adapter_type, seconds", [
    (None, "CPU", 0.0), (None, "DiscreteGPU", device_module.SPIN_WAIT_MS / 1e3), (None, "IntegratedGPU", 0.02),
    ("0", "DiscreteGPU", 0.0), ("2.5", "CPU", 0.0025),
])
def test_spin_wait_defaults_to_gpus_only_and_follows_the_env_var(monkeypatch, value, adapter_type, seconds):
    if value is None:
        monkeypatch.delenv(device_module.SPIN_WAIT_ENV, raising=False)
    else:
        monkeypatch.setenv(device_module.SPIN_WAIT_ENV, value)
    assert device_module._spin_seconds(adapter_type) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_bad_spin_wait_is_named(monkeypatch, value):
    monkeypatch.setenv(device_module.SPIN_WAIT_ENV, value)
    with pytest.raises(MeganeuraError, match="MEGANEURA_SPIN_WAIT_MS"):
        device_module._spin_seconds("DiscreteGPU")


class _PollRecorder:
    """wgpu-native's functions, with each wgpuDevicePoll's ``wait`` flag recorded."""

    def __init__(self, lib):
        self._lib, self.waits = lib, []

    def wgpuDevicePoll(self, device, wait, index):
        self.waits.append(bool(wait))
        return self._lib.wgpuDevicePoll(device, wait, index)

    def __getattr__(self, name):
        return getattr(self._lib, name)


@pytest.mark.parametrize("spin_seconds, blocks", [(0.0, True), (30.0, False)])
def test_read_back_spins_then_blocks(monkeypatch, spin_seconds, blocks):
    native = device_module.native
    if native._lib is None:
        pytest.skip("wgpu-py's native backend is not in use")
    dev = get_device()
    pipeline = dev.pipeline(_kernel(4001.0 + spin_seconds), 1, "spin")
    out, staging = dev.storage_buffer(4, "out"), dev.staging_buffer(4, "staging")
    encoder = _encode_single(dev, pipeline, out)
    encoder.copy_buffer_to_buffer(out, 0, staging, 0, 4)
    recorder = _PollRecorder(native._lib)
    monkeypatch.setattr(native, "_lib", recorder)
    dev.submit(encoder)
    data = native.read_back(dev.wgpu_device, staging, 4, spin_seconds)
    assert np.frombuffer(data, np.float32)[0] == 4001.0 + spin_seconds
    assert recorder.waits  # it polled
    assert (True in recorder.waits) == blocks  # a 30 s spin returns on the callback, long before it would block


def test_a_device_held_to_webgpu_defaults_gets_them_and_wgpu_enforces_them():
    """``get_device(limits="webgpu-default")`` (``MEGANEURA_LIMITS=webgpu-default``) is a device of its own, requested
    with WebGPU's default limits and no shader-f16 or subgroups; wgpu refuses what exceeds them."""
    from meganeura.runtime.requirements import SUBGROUP_OPS, WEBGPU_DEFAULT_LIMITS, is_alignment

    held = get_device(limits="webgpu-default")
    assert held is get_device(limits="webgpu-default") and held is not get_device()
    assert held.restricted and "WebGPU default limits" in held.describe()
    adapter = held.adapter.limits
    for name, default in WEBGPU_DEFAULT_LIMITS.items():
        if name in adapter and name != "max-bind-groups-plus-vertex-buffers":  # wgpu-native reports 0 for it
            assert held.limits[name] == (max if is_alignment(name) else min)(adapter[name], default), name
    assert held.limits["max-storage-buffers-per-shader-stage"] == 8
    assert held.limits["max-compute-workgroup-storage-size"] == 16384
    assert not {"shader-f16", "subgroup"} & held.features and SUBGROUP_OPS not in held.limits
    with pytest.raises(MeganeuraError, match="limit is 8, count was 9"):
        held.bind_group_layout(9)
    with pytest.raises(MeganeuraError, match="maximum buffer size"):
        held.storage_buffer(WEBGPU_DEFAULT_LIMITS["max-buffer-size"] + 4, "too large")
    wide = "@compute @workgroup_size(512) fn main() {}"
    with pytest.raises(MeganeuraError, match="workgroup size"):
        held.pipeline(wide, 1, "512 threads")
    with pytest.raises(MeganeuraError, match="not one of"):
        get_device(limits="unlimited")
