"""meganeura.runtime.timing: a sequence of more work measures longer, and every measurement is positive; the warm-up
keeps the GPU busy in long passes."""
import numpy as np

from meganeura.runtime import timing
from meganeura.runtime.device import get_device
from meganeura.runtime.timing import time_sequences

BUSY = """@group(0) @binding(0) var<storage, read_write> data: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) id: vec3<u32>) {
  var x = data[id.x];
  for (var i = 0u; i < 2000u; i++) { x = x * 0.999 + 0.001; }
  data[id.x] = x;
}
"""


def _busy(dev):
    buffer = dev.storage_buffer(64 * 64 * 4, "timed")
    dev.write(buffer, 0, np.ones(64 * 64, np.float32))
    pipeline = dev.pipeline(BUSY, 1, "busy")
    return buffer, [(pipeline, dev.bind_group([(buffer, 0, buffer.size)], "timed"), (64, 1, 1))]


def test_more_dispatches_take_longer():
    dev = get_device()
    buffer, sequence = _busy(dev)
    one, four = time_sequences(dev, [sequence, sequence * 4], warmup_seconds=0.0)
    assert 0 < one < four
    dev.destroy_buffer(buffer)


def test_warm_up_runs_passes_as_long_as_the_measured_ones(monkeypatch):
    """After its first pass the warm-up repeats the sequence within each pass, up to about TARGET_SECONDS, instead of
    submitting and waiting for one run at a time (which left an H200's clocks low), and it lasts its seconds."""
    dev = get_device()
    buffer, sequence = _busy(dev)
    passes = []
    real = timing._Timer.measure
    monkeypatch.setattr(timing._Timer, "measure",
                        lambda self, seq, reps: (passes.append(reps), real(self, seq, reps))[1])
    monkeypatch.setattr(timing, "TARGET_SECONDS", 1.0)  # longer than any one run here: the cap decides
    monkeypatch.setattr(timing, "MAX_WARMUP_REPS", 3)
    start = timing.time.perf_counter()
    time_sequences(dev, [sequence], warmup_seconds=0.2)
    assert timing.time.perf_counter() - start >= 0.2
    warm_up = passes[:-2 * timing.ROUNDS]  # then ROUNDS single runs to size the passes, ROUNDS measured passes
    assert warm_up[0] == 1 and len(warm_up) >= 2 and set(warm_up[1:]) == {3}, passes
    dev.destroy_buffer(buffer)
