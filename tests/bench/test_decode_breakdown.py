"""``bench.decode_breakdown`` on the null device at smoke scale: a generate call timed at each entry point (HF's
``generate``, dynamo's frame, aot_autograd's wrappers, our compiled function, the device partitions, their programs'
runs, the device API), each inside the one that calls it, so that the shares split the whole call; the entry points
put back after."""
import pytest
import torch

import torch_meganeura.backend.entry as entry
from bench.decode_breakdown import TIMED, Timers, _generate, instrumented, split
from bench.workloads import WORKLOADS
from helpers.recording_device import RecordingDevice

NESTED = ("generate", "forward", "aot", "ours", "partition", "program", "device_in_program")  # each in the one before
SHARES = ("hf", "dynamo", "aot_autograd", "ours", "device")


def test_a_generate_call_is_timed_at_each_entry_point_inside_the_one_before(null_device):
    compile_graph_module, submit = entry.compile_graph_module, RecordingDevice.submit
    timers = Timers()
    torch.manual_seed(0)
    model = WORKLOADS["smollm2"].build(True).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 6))
    with instrumented(timers):
        run = _generate(model, prompt, {}, timers, torch.compile(model.forward, backend="meganeura"))
        run(3)  # (compiles)
        timers.seconds.clear()
        run(3)
    seconds = timers.seconds
    for outer, inner in zip(NESTED, NESTED[1:]):
        assert seconds[outer] >= seconds[inner] > 0, (outer, inner, dict(seconds))
    assert seconds["device"] >= seconds["device_in_program"]
    shares = split({key: seconds[key] * 1e6 for key in TIMED})
    assert sum(shares[key] for key in SHARES) == pytest.approx(shares["total"])
    assert shares["ours_graph"] + shares["ours_per_call"] + shares["ours_runtime"] == pytest.approx(shares["ours"])
    assert entry.compile_graph_module is compile_graph_module and RecordingDevice.submit is submit
