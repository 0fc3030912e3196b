"""ResidentTensor as eager code sees it: one download, writes in place reach the device at the next bind, views
that escape keep it uploading, pickling and copies give ordinary tensors."""
import copy
import io

import numpy as np
import torch

from meganeura.runtime.device import get_device
from meganeura.runtime.resident import DeviceArray
from torch_meganeura.tensors.resident import ResidentTensor


def resident(values: np.ndarray) -> ResidentTensor:
    return ResidentTensor(DeviceArray.upload(get_device(), values, "float32"))


def test_read_once_then_from_the_host_copy():
    values = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    r = resident(values)
    counters = get_device().counters
    before = counters.bytes_downloaded
    torch.testing.assert_close(r * 2, torch.from_numpy(values) * 2)
    torch.testing.assert_close(r.sum(0), torch.from_numpy(values).sum(0))
    assert counters.bytes_downloaded - before == values.nbytes
    assert repr(r) == repr(torch.from_numpy(values)) and r.tolist() == values.tolist()


def test_in_place_writes_reach_the_device():
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    r = resident(values)
    assert r.mul_(2) is r  # the wrapper, as torch returns self
    torch._foreach_add_([r], 1.0)
    np.testing.assert_array_equal(r.device_array().numpy(), values * 2 + 1)
    alias = r.detach()
    assert type(alias) is ResidentTensor and alias.array is r.array
    alias.zero_()
    np.testing.assert_array_equal(r.device_array().numpy(), np.zeros_like(values))


def test_an_escaped_view_keeps_the_host_copy_authoritative():
    r = resident(np.zeros((2, 3), dtype=np.float32))
    row = r[1]
    assert type(row) is torch.Tensor
    np.testing.assert_array_equal(r.device_array().numpy(), np.zeros((2, 3)))
    row.fill_(5.0)  # through the view: no op on r itself
    np.testing.assert_array_equal(r.device_array().numpy(), [[0, 0, 0], [5, 5, 5]])


def test_pickles_and_copies_as_ordinary_tensors():
    values = np.random.default_rng(1).standard_normal(5).astype(np.float32)
    r = resident(values)
    buffer = io.BytesIO()
    torch.save({"r": r}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["r"]
    assert type(loaded) is torch.Tensor and type(copy.deepcopy(r)) is torch.Tensor
    torch.testing.assert_close(loaded, torch.from_numpy(values))


def test_a_device_write_drops_the_host_copy():
    r = resident(np.ones(4, dtype=np.float32))
    assert float(r.sum()) == 4.0
    values = np.full(4, 3.0, dtype=np.float32)
    get_device().write(r.array.buffer, 0, values, "test")  # as a plan storing over the array would
    r.written_on_device()
    assert float(r.sum()) == 12.0
