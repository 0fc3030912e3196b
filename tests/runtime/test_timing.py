"""meganeura.runtime.timing: a sequence of more work measures longer, and every measurement is positive."""
import numpy as np

from meganeura.runtime.device import get_device
from meganeura.runtime.timing import time_sequences

BUSY = """@group(0) @binding(0) var<storage, read_write> data: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) id: vec3<u32>) {
  var x = data[id.x];
  for (var i = 0u; i < 2000u; i++) { x = x * 0.999 + 0.001; }
  data[id.x] = x;
}
"""


def test_more_dispatches_take_longer():
    dev = get_device()
    buffer = dev.storage_buffer(64 * 64 * 4, "timed")
    dev.write(buffer, 0, np.ones(64 * 64, np.float32))
    pipeline = dev.pipeline(BUSY, 1, "busy")
    group = dev.bind_group([(buffer, 0, buffer.size)], "timed")
    one, four = time_sequences(dev, [[(pipeline, group, (64, 1, 1))], [(pipeline, group, (64, 1, 1))] * 4],
                               warmup_seconds=0.0)
    assert 0 < one < four
    dev.destroy_buffer(buffer)
