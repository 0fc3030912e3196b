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


def test_the_decode_steps_guard_check_is_timed_on_the_graph_that_serves_it(null_device):
    """``bench.guard_check`` at smoke scale: of the forward's graphs, exactly one passes its guards on the first decode
    step's frame locals (the decode graph, not the prefill's), and its check is timed; the static cache at one length
    runs fewer guards as Python than the default cache (none on its tensors' sizes: ``output_dims_that_vary``)."""
    from bench.guard_check import measure

    rows = {cache: measure(cache, smoke=True) for cache in ("default", "static-one-length")}
    for row in rows.values():
        assert row["entries_passing"].count(True) == 1, row
        assert 0 < row["check_us_min"] <= row["check_us_median"], row
    assert 0 < rows["static-one-length"]["python_guards"] < rows["default"]["python_guards"], rows


def test_a_decode_steps_new_keys_and_values_are_made_while_a_gpu_would_run_it(null_device, monkeypatch):
    """HF's default cache: a decode step's lazy outputs (its new keys and values, kept on the device) are made as
    tensors between the step's submit and its wait (``Program.run``'s ``while_running``), while a GPU works on the
    step, not after the logits' read-back; ``bench.decode_breakdown``'s window then holds them."""
    import torch_meganeura.backend.per_call as per_call

    made, make = [], per_call.lazy_outputs

    def noted(arrays, on_reads):
        made.append((len(arrays), null_device._submitted_since_wait))  # (a submit no wait has followed yet)
        return make(arrays, on_reads)

    monkeypatch.setattr(per_call, "lazy_outputs", noted)
    torch.manual_seed(0)
    model = WORKLOADS["smollm2"].build(True).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 6))
    timers = Timers()
    with instrumented(timers):
        run = _generate(model, prompt, {}, timers, torch.compile(model.forward, backend="meganeura"))
        run(4)  # (compiles)
        made.clear()
        timers.seconds.clear()
        run(4)
    layers = model.config.num_hidden_layers
    assert made and all(count == 2 * layers and waiting for count, waiting in made), made
    assert timers.seconds["window"] > 0, dict(timers.seconds)
