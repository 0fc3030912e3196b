"""The forward->backward hand-off of the ordinary training loop in packs (torch_meganeura/backend/packed.py): what
each device partition of a training forward saves crosses autograd as one ``SavedPack``, its arrays one set of pool
buffers; the backward puts each value back. Gradients and the loop's weights against eager PyTorch, the pool flat over
steps, and the ways a saved value reaches eager code: a backward partition that runs in eager PyTorch, saved-tensor
hooks."""
import copy
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_meganeura
from helpers.compare import assert_grads_match
from helpers.saved import saved_packs
from meganeura.runtime.device import get_device
from torch_meganeura.backend.per_call import DevicePartition
from torch_meganeura.tensors.saved_pack import SavedPack

STEPS = 3
# Loss and weights after a few AdamW steps against eager PyTorch in float32: the device sums in other orders
RTOL, ATOL = 1e-4, 1e-5


class ConvNet(nn.Module):
    """Convolutions with BatchNorm (statistics updated on the device; no bias before it, whose gradient is rounding
    noise that AdamW would make a step of), then LayerNorm, GELU and a linear head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                                      nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU())
        self.head = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def _batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 6, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def _compiled_and_reference():
    """A ``ConvNet``, compiled, and an eager copy of it."""
    torch.manual_seed(0)
    model = ConvNet().train()
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    return model, reference, torch.compile(model, backend="meganeura")


def test_the_kept_loop_matches_eager_over_steps():
    model, reference, compiled = _compiled_and_reference()
    opt = torch_meganeura.keep_on_device(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x, y = _batch()
    for step in range(STEPS):
        loss = F.cross_entropy(compiled(x), y)
        assert saved_packs(loss), "the forward's partitions saved no pack"
        loss.backward()
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL, msg=f"step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().clone(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)
    for (name, b), r in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b.clone(), r, rtol=RTOL, atol=ATOL, msg=name)


def test_the_pool_stays_flat_and_a_dropped_graph_gives_its_pack_back():
    torch.manual_seed(0)
    model = ConvNet().train()
    opt = torch_meganeura.keep_on_device(torch.optim.AdamW(model.parameters(), lr=1e-3))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="meganeura")
    x, y = _batch()
    pool = get_device().pool

    def step():
        F.cross_entropy(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    before = (pool.live, pool.pooled_bytes())
    for _ in range(20):
        step()
    assert (pool.live, pool.pooled_bytes()) == before
    loss = F.cross_entropy(compiled(x), y)
    assert pool.live > before[0]
    del loss  # no backward: autograd drops the graph, its packs, and their sets of buffers
    assert pool.live == before[0]


def test_a_backward_partition_in_eager_pytorch_reads_the_packed_values(monkeypatch):
    """A backward partition whose compile fails runs in eager PyTorch: the saved values it reads are downloaded."""
    compile_partition = DevicePartition._compile

    def fail_in_backward(self, *args):
        if not self.lazy_from_first:  # (a forward's partitions: True)
            raise RuntimeError("a backward that does not compile")
        return compile_partition(self, *args)

    monkeypatch.setattr(DevicePartition, "_compile", fail_in_backward)
    model, reference, compiled = _compiled_and_reference()
    x, y = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = F.cross_entropy(compiled(x), y)
        assert saved_packs(loss)
        loss.backward()
    assert any("compiling it failed" in str(w.message) for w in caught)
    F.cross_entropy(reference(x), y).backward()
    assert_grads_match(model, reference, rtol=RTOL, atol=ATOL)


def test_saved_tensor_hooks_get_each_value_as_a_tensor():
    model, reference, compiled = _compiled_and_reference()
    x, y = _batch()
    F.cross_entropy(compiled(x), y).backward()  # compiled, and the backward's plans too
    model.zero_grad()
    packed = []

    def pack(t):
        packed.append(type(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(compiled(x), y)
    assert packed and SavedPack not in packed
    loss.backward()
    F.cross_entropy(reference(x), y).backward()
    assert_grads_match(model, reference, rtol=RTOL, atol=ATOL)
