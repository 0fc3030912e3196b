"""Inference outputs that eager code does not read stay on the device, and the call returns once its run is
submitted: what a compiled call waits for and downloads, by whether its last output was read, and that outputs kept
unread hold a bounded amount of device memory, chain into other compiled calls without a round trip, and raise a
device error where they are read; and inputs put on the device once (``torch_meganeura.to_device``)."""
import torch
import torch.nn as nn

import torch_meganeura
from helpers.compare import assert_same, check_against_eager, device_counters
from meganeura.runtime.device import get_device
from torch_meganeura.tensors.device_tensor import DeviceTensor


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _call(compiled, *args):
    with torch.no_grad():
        return compiled(*args)


def _moved(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in ("waits", "bytes_downloaded")}


def _is_lazy(t: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return type(t) is DeviceTensor and t._meganeura_kept.stale


def test_a_call_after_an_unread_output_waits_for_nothing_and_its_output_reads_right():
    """Also: ``synchronize`` waits for a run in flight, and for nothing after a run that waited itself."""
    torch.manual_seed(0)
    model = Small().eval()
    compiled = check_against_eager(model, torch.randn(3, 8))  # (reads its output: the next call reads back too)
    _call(compiled, torch.randn(3, 8))  # read back, not read by anyone
    xs = [torch.randn(3, 8) for _ in range(2)]
    before = device_counters()
    out = _call(compiled, xs[0])
    moved = _moved(before, device_counters())
    assert _is_lazy(out), "an output nobody read last time should stay on the device"
    assert moved == {"waits": 0, "bytes_downloaded": 0}, moved
    get_device().synchronize()
    assert device_counters()["waits"] - before["waits"] == 1, "synchronize should wait for the run in flight"
    with torch.no_grad():
        assert_same(out, model(xs[0]), rtol=1e-4, atol=1e-5)  # the first read downloads it
        assert type(out) is torch.Tensor
        before = device_counters()
        second = compiled(xs[1])  # its last output was read: read back by the run, one wait
        get_device().synchronize()  # (nothing submitted since that wait: nothing to wait for)
        after = device_counters()
        assert _moved(before, after)["waits"] == 1 and after["submits"] - before["submits"] == 1
        assert not _is_lazy(second)
        assert_same(second, model(xs[1]), rtol=1e-4, atol=1e-5)


def test_outputs_kept_unread_in_a_list_hold_at_most_two_on_the_device():
    torch.manual_seed(0)
    model = Small().eval()
    compiled = check_against_eager(model, torch.randn(3, 8))
    xs = [torch.randn(3, 8) for _ in range(8)]
    outs = [_call(compiled, x) for x in xs]  # an evaluation loop collecting outputs, reading them at the end
    assert sum(map(_is_lazy, outs)) <= 2, [_is_lazy(t) for t in outs]
    assert any(map(_is_lazy, outs)), "outputs nobody read should have stayed on the device for a while"
    with torch.no_grad():
        assert_same(torch.stack(outs), torch.stack([model(x) for x in xs]), rtol=1e-4, atol=1e-5)


def test_an_unread_output_goes_into_the_next_compiled_call_without_a_round_trip():
    torch.manual_seed(0)
    first, second = Small().eval(), nn.Linear(4, 5).eval()
    encode = check_against_eager(first, torch.randn(3, 8))
    decode = check_against_eager(second, torch.randn(3, 4))
    for _ in range(2):  # (then neither call's output was read the call before)
        _call(decode, _call(encode, torch.randn(3, 8)))
    x = torch.randn(3, 8)
    before = device_counters()
    hidden = _call(encode, x)
    out = _call(decode, hidden)
    after = device_counters()
    assert _is_lazy(hidden) and _is_lazy(out)
    up = after["bytes_uploaded"] - before["bytes_uploaded"] - x.numel() * 4
    assert 0 <= up < hidden.numel() * 4, f"{up} B went up besides x: the hidden state should not have"
    assert _moved(before, after) == {"waits": 0, "bytes_downloaded": 0}
    with torch.no_grad():
        assert_same(out, second(first(x)), rtol=1e-4, atol=1e-5)


def test_an_index_out_of_range_in_a_call_nobody_waited_for_raises_where_it_is_read():
    def fn(table, ids):
        return nn.functional.embedding(ids, table) * 2

    table, good = torch.randn(10, 3), torch.tensor([0, 3, 9])
    compiled = check_against_eager(fn, table, good)
    _call(compiled, table, good)  # unread: the next call's output stays on the device
    bad = _call(compiled, table, torch.tensor([0, 10, 1]))
    assert _is_lazy(bad)
    try:
        bad.sum()
    except RuntimeError as err:
        assert "index out of range in embedding" in str(err), err
    else:
        raise AssertionError("reading the output of a run with an index out of range did not raise")
    with torch.no_grad():  # the next call runs, and gives eager's values
        assert_same(compiled(table, good), fn(table, good), rtol=0, atol=0)


def test_an_input_put_on_the_device_once_goes_up_only_when_eager_code_writes_it():
    torch.manual_seed(0)
    model = Small().eval()
    compiled = check_against_eager(model, torch.randn(3, 8))
    x = torch_meganeura.to_device(torch.randn(3, 8))
    for _ in range(2):
        before = device_counters()
        out = _call(compiled, x)
        assert device_counters()["bytes_uploaded"] == before["bytes_uploaded"], "x should not go up again"
        with torch.no_grad():
            assert_same(out, model(x), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        x.mul_(-2.0)  # eager code writes it: the next call binds the new values
        before = device_counters()
        assert_same(_call(compiled, x), model(x), rtol=1e-4, atol=1e-5)
    assert device_counters()["bytes_uploaded"] - before["bytes_uploaded"] == x.numel() * 4


def test_an_input_updated_in_place_and_returned_is_the_input_with_eagers_values():
    """A function that updates its input in place and returns it (``x.add_(...)``; HF's static cache's
    ``cumulative_length`` at the prefill): the call returns the input itself, updated on the device (a
    ``DeviceTensor`` from the first call, as an input updated and not returned is), with eager's values at every
    call and at eager reads between calls."""
    def step(x, y):
        x.add_(y * 2)
        return x

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="meganeura")
    x, y = torch.randn(5), torch.randn(5)
    want = x.clone()
    for _ in range(3):
        out = _call(compiled, x, y)
        step(want, y)
        assert out is x and type(x) is DeviceTensor
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # (one f32 multiply-add per call)
