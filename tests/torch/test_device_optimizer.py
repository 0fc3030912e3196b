"""The ordinary training loop with ``keep_on_device(optimizer)``: backend forward, ``loss.backward()``,
``optimizer.step()``, against the same loop in eager PyTorch from the same weights.

Criteria: the loss at every step within 1e-4 relative of eager's (the device and eager sum in different orders;
over 30 AdamW steps eager's own float32 noise stays below that), final parameters and optimizer state elementwise
(``assert_close`` rtol 1e-3, atol 1e-4, the training tests' tolerances); the bytes a step moves between host and
device counted (the batch and what eager code reads, not the weights), and the bind groups it builds (none once
its buffers repeat). BatchNorm's running statistics stay on the device, read as eager's through ``state_dict()`` and
printing, in eval mode after training, and with eager writes between steps.
"""
import copy
import io
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_meganeura
from helpers.compare import meganeura_warnings
from helpers.models import llama, randomize_norms
from meganeura.runtime.device import LIMITS_ENV, get_device
from meganeura.runtime.errors import KernelStatusError


from torch_meganeura.backend.per_call import DevicePartition
from torch_meganeura.tensors.device_tensor import DeviceParameter, DeviceTensor
from torch_meganeura.tensors.resident import ResidentTensor

RTOL, ATOL, LOSS_REL = 1e-3, 1e-4, 1e-4
PRINTED_DIGITS = 8  # printed well below ATOL's digits


class Loops:
    """``model`` trained by the kept loop (through the backend) and a deep copy trained by eager PyTorch."""

    def __init__(self, model: nn.Module, make_optimizer, loss_of):
        self.model, self.ref = model, copy.deepcopy(model)
        self.opt, self.ref_opt = make_optimizer(self.model.parameters()), make_optimizer(self.ref.parameters())
        torch_meganeura.keep_on_device(self.opt)
        torch._dynamo.reset()
        self.compiled = torch.compile(self.model, backend="meganeura")
        self.loss_of = loss_of
        self.moved: list[int] = []  # bytes up and down of each kept step
        self.groups: list[int] = []  # bind groups each kept step built

    def step(self, *batch, micro_batches: int = 1, between=None) -> tuple[float, float]:
        """One step of both loops (``micro_batches`` backward calls, then ``between(model, optimizer)`` if given,
        then the optimizer's step); returns (kept loss, eager loss) of the last micro-batch."""
        counters = get_device().counters
        before = counters.bytes_uploaded + counters.bytes_downloaded
        groups = counters.bind_groups_created
        losses = []
        for module, opt in ((self.compiled, self.opt), (self.ref, self.ref_opt)):
            for _ in range(micro_batches):
                loss = self.loss_of(module, *batch)
                (loss / micro_batches).backward()
            if between is not None:
                between(self.model if module is self.compiled else self.ref, opt)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if module is self.compiled:
                self.moved.append(counters.bytes_uploaded + counters.bytes_downloaded - before)
                self.groups.append(counters.bind_groups_created - groups)
        return losses[0], losses[1]

    def assert_parameters_match(self) -> None:
        for (name, p), q in zip(self.model.named_parameters(), self.ref.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def assert_losses_match(got: float, want: float, step: int) -> None:
    assert abs(got - want) <= LOSS_REL * abs(want), f"step {step}: loss {got} vs eager {want}"


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_llama_30_adamw_steps_with_hf_labels_loss():
    """HF's own ``labels=`` loss, train mode, AdamW with weight decay. Gradients stay resident, the step runs on the
    device, and each step moves the batch and the logits (the model returns them), never the weights."""
    loops = Loops(llama().train(), lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01),
                  lambda m, ids: m(ids, labels=ids).loss)
    batches = [torch.randint(0, 64, (2, 9)) for _ in range(4)]
    for step in range(30):
        assert_losses_match(*loops.step(batches[step % 4]), step)
        if step == 0:
            assert {type(p.grad) for p in loops.model.parameters()} == {type(None)}  # zero_grad: set to None
    loops.assert_parameters_match()
    logits = 2 * 9 * 128 * 4
    steady = loops.moved[1:]
    assert len(set(steady)) == 1, steady
    # the ids, the logits down and their zero gradient up (autograd's for an unused output), the loss and the
    # step's numbers: no weight
    assert steady[0] <= 2 * 9 * 8 + 2 * logits + 1024, steady[0]
    assert steady[0] < 0.1 * parameter_bytes(loops.model)
    w = loops.model.model.layers[0].mlp.up_proj.weight
    torch.testing.assert_close(loops.opt.state[w]["exp_avg_sq"],
                               loops.ref_opt.state[loops.ref.model.layers[0].mlp.up_proj.weight]["exp_avg_sq"],
                               rtol=RTOL, atol=1e-7)


def resnet_loops() -> Loops:
    """HF ResNet (basic blocks, 32x32 images), train mode, AdamW."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=5)
    return Loops(randomize_norms(ResNetForImageClassification(config)).train(),
                 lambda ps: torch.optim.AdamW(ps, lr=1e-3), lambda m, x, y: F.cross_entropy(m(x).logits, y))


def assert_buffers_match(loops: Loops, state: dict | None = None) -> None:
    """The model's buffers (or ``state``, its ``state_dict()``) elementwise as eager's."""
    got = state.items() if state is not None else loops.model.named_buffers()
    want = dict(loops.ref.named_buffers())
    names = [name for name, _ in got]
    assert set(want) <= set(names) if state is not None else names == list(want)
    for name, b in got:
        if name in want:
            torch.testing.assert_close(b, want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def assert_printed_as(t: torch.Tensor, want: torch.Tensor) -> None:
    """``t``'s printed values (its first read) are ``want``'s."""
    torch.set_printoptions(precision=PRINTED_DIGITS)
    try:
        text = str(t)
    finally:
        torch.set_printoptions(profile="default")
    numbers = [float(v) for v in re.findall(r"-?\d+\.\d*(?:e[-+]\d+)?", text)]
    torch.testing.assert_close(torch.tensor(numbers), want, rtol=RTOL, atol=ATOL)


def test_resnet_30_adamw_steps_in_train_mode(monkeypatch):
    """BatchNorm in training updates its running statistics on the device, where they stay (each forward and
    backward replays its entry as bound: no signature built, no bind group, nothing uploaded but the batch, once)
    while the optimizer runs there too; ``state_dict()`` and printing read them as eager's."""
    loops = resnet_loops()
    batches = [(torch.randn(2, 3, 32, 32), torch.randint(0, 5, (2,))) for _ in range(3)]
    looked_up = []  # entries selected by signature, each step
    entry_for = DevicePartition._entry_for
    monkeypatch.setattr(DevicePartition, "_entry_for", lambda *a: looked_up.append(len(loops.moved)) or entry_for(*a))
    for step in range(30):
        assert_losses_match(*loops.step(*batches[step % 3]), step)
    assert max(looked_up) == 0, looked_up  # from the second step every partition call replays its entry
    loops.assert_parameters_match()
    stats = loops.model.resnet.embedder.embedder.normalization.running_mean
    assert type(stats) is DeviceTensor and stats._meganeura_kept.stale  # not read back by the steps
    assert_buffers_match(loops, loops.model.state_dict())
    assert_printed_as(stats, loops.ref.resnet.embedder.embedder.normalization.running_mean)
    assert_buffers_match(loops)
    # the images up once (the forward passes them on to the backward, whose first convolution's weight gradient
    # reads them), the labels, the logits and the loss: no weight, no running statistic
    images = batches[0][0].nbytes
    assert max(loops.moved[1:]) <= images + 1024
    # from the fourth step: the first optimizer step frees the pool's buffers (the first saved activations'), and
    # the next steps bind the new ones (the statistics, stored over their own arrays, keep them)
    assert loops.groups[3:] == [0] * len(loops.groups[3:]), loops.groups


def test_state_dict_of_a_kept_model_downloads_in_a_few_waits():
    """After kept steps, one parameter read alone downloads its own bytes alone; ``state_dict()`` then reads every
    parameter and running statistic as eager's in a number of waits that grows with the log of the tensors
    (``tensors/read_ahead.py``: each read downloads twice the stale tensors of the read before in its group, the
    parameters or the buffers of one graph), not one wait per tensor."""
    loops = resnet_loops()
    images, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 5, (2,))
    for step in range(2):
        assert_losses_match(*loops.step(images, labels), step)
    counters = get_device().counters
    first = loops.model.resnet.embedder.embedder.convolution.weight
    waits, down = counters.waits, counters.bytes_downloaded
    torch.testing.assert_close(first * 1, loops.ref.resnet.embedder.embedder.convolution.weight, rtol=RTOL, atol=ATOL)
    assert (counters.waits - waits, counters.bytes_downloaded - down) == (1, first.nbytes)
    waits = counters.waits
    state = loops.model.state_dict()
    params, buffers = len(list(loops.model.parameters())), len(list(loops.model.buffers()))
    groups_waits = sum(math.ceil(math.log2(n + 1)) for n in (params, buffers))
    assert counters.waits - waits <= groups_waits < params + buffers, (counters.waits - waits, params, buffers)
    want = loops.ref.state_dict()
    assert list(state) == list(want)
    for name, value in state.items():
        torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_batchnorm_statistics_written_by_eager_code_and_read_in_eval_mode():
    """Eager writes to the running statistics between steps (``zero_``, which downloads nothing, and ``mul_``, which
    reads them first) reach the device; eval mode after training, and again after another training step, reads
    the statistics the device holds."""
    loops = resnet_loops()
    images = [torch.randn(2, 3, 32, 32) for _ in range(2)]
    labels = torch.randint(0, 5, (2,))

    def write_statistics(model, opt):
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.zero_()
                m.running_var.mul_(0.5)

    for step in range(4):
        loops.step(images[step % 2], labels, between=write_statistics if step == 2 else None)
    assert_buffers_match(loops)
    for train_again in (False, True):
        if train_again:
            loops.model.train(), loops.ref.train()
            loops.step(images[0], labels)
        loops.model.eval(), loops.ref.eval()
        with torch.no_grad():
            got, want = loops.compiled(images[1]).logits, loops.ref(images[1]).logits
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert_buffers_match(loops)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(12, 32), nn.LayerNorm(32), nn.Linear(32, 5)
        self.unused = nn.Linear(3, 3)  # in the optimizer, never in the loss: its .grad stays None

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


def mlp_loops(make_optimizer) -> Loops:
    return Loops(MLP(), make_optimizer, lambda m, x, y: F.cross_entropy(m(x), y))


def batch():
    return torch.randn(8, 12), torch.randint(0, 5, (8,))


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1)], ids=["sgd", "adam"])
def test_clipping_scheduler_and_accumulation_as_eager(make):
    """Two micro-batches per step, ``clip_grad_norm_`` on the accumulated gradients (their host copies, uploaded by
    the step), a cosine LR schedule; a parameter that gets no gradient is left alone, as eager leaves it."""
    loops = mlp_loops(make)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(loops.opt, T_max=6)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(loops.ref_opt, T_max=6)

    def clip(model, opt):
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        assert total > 0.5  # the clipping changes something

    data = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for step in range(6):
            assert_losses_match(*loops.step(*data, micro_batches=2, between=clip), step)
            sched.step()
            ref_sched.step()
    loops.assert_parameters_match()
    assert loops.model.unused not in loops.opt.state and not loops.opt.state.get(loops.model.unused.weight)


def test_eager_reads_see_the_device_values_and_eager_writes_reach_the_device():
    """After device steps the parameters read as the device holds them (printing, ``state_dict``, ``torch.save``,
    an eager forward), each downloaded once; ``load_state_dict`` writes go up before the next step."""
    loops = mlp_loops(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    data = batch()
    for step in range(3):
        loops.step(*data)
    weight = loops.model.fc1.weight
    assert type(weight) is DeviceParameter and weight._meganeura_kept.stale
    counters = get_device().counters
    before = counters.bytes_downloaded
    assert repr(weight).startswith("Parameter containing")
    assert counters.bytes_downloaded - before == weight.numel() * 4  # downloaded
    torch.testing.assert_close(weight, loops.ref.fc1.weight, rtol=RTOL, atol=ATOL)
    assert counters.bytes_downloaded - before == weight.numel() * 4  # not again
    state = loops.model.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    for name, value in loops.ref.state_dict().items():
        assert type(saved[name]) is torch.Tensor
        torch.testing.assert_close(saved[name], value, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loops.model(data[0]), loops.ref(data[0]), rtol=RTOL, atol=ATOL)  # eager forward

    torch_meganeura.sync_parameters(loops.opt)  # every stale parameter at once
    assert not any(p._meganeura_kept.stale for p in loops.model.parameters())
    torch.testing.assert_close(loops.model.fc2.weight.data, loops.ref.fc2.weight, rtol=RTOL, atol=ATOL)

    restart = MLP().state_dict()  # new weights written from the host, in both loops
    loops.model.load_state_dict(restart)
    loops.ref.load_state_dict(restart)
    assert_losses_match(*loops.step(*data), 3)
    loops.assert_parameters_match()


def test_optimizer_state_dict_saves_and_resumes():
    """``optimizer.state_dict()`` through ``torch.save`` holds ordinary tensors; a fresh kept optimizer loading it
    continues as the uninterrupted eager run."""
    loops = mlp_loops(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    data = batch()
    for step in range(3):
        loops.step(*data)
    buffer = io.BytesIO()
    torch.save({"model": loops.model.state_dict(), "opt": loops.opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    assert all(type(v) is torch.Tensor for s in checkpoint["opt"]["state"].values() for v in s.values())
    model = MLP()
    model.load_state_dict(checkpoint["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(checkpoint["opt"])
    torch_meganeura.keep_on_device(opt)
    compiled = torch.compile(model, backend="meganeura")
    for step in range(3, 6):
        loss = F.cross_entropy(compiled(data[0]), data[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        want = F.cross_entropy(loops.ref(data[0]), data[1])
        want.backward()
        loops.ref_opt.step()
        loops.ref_opt.zero_grad()
        assert_losses_match(loss.item(), want.item(), step)
    for (name, p), q in zip(model.named_parameters(), loops.ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    assert isinstance(opt.state[model.fc1.weight]["exp_avg"], ResidentTensor)


def test_refuses_what_it_cannot_keep():
    with pytest.raises(NotImplementedError, match="amsgrad"):
        torch_meganeura.keep_on_device(torch.optim.AdamW(nn.Linear(2, 2).parameters(), amsgrad=True))
    with pytest.raises(TypeError, match="nn.Parameter"):
        torch_meganeura.keep_on_device(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1))
    opt = torch_meganeura.keep_on_device(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already"):
        torch_meganeura.keep_on_device(opt)


def test_a_model_whose_optimizer_is_not_kept_trains_as_before():
    """With one optimizer kept, another model's backward still returns ordinary host gradients."""
    loops = mlp_loops(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    x, y = batch()
    loops.step(x, y)
    other = MLP()
    F.cross_entropy(torch.compile(other, backend="meganeura")(x), y).backward()
    grads = [p.grad for p in other.parameters() if p.grad is not None]
    assert grads and all(type(g) is torch.Tensor for g in grads)


class Norms(nn.Module):
    """Kept parameters in functions with a dispatch of their own (F.embedding, F.layer_norm, F.rms_norm,
    F.batch_norm), where dynamo tracing the parameters' override broke the graph."""

    def __init__(self):
        super().__init__()
        self.embed, self.ln, self.rms = nn.Embedding(16, 8), nn.LayerNorm(8), nn.RMSNorm(8)
        self.bn, self.out = nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, ids):
        h = self.rms(self.ln(self.embed(ids)))
        return self.out(self.bn(h.transpose(1, 2)).transpose(1, 2))


def test_kept_parameters_trace_as_one_graph():
    """dynamo traces kept parameters as plain ones: one graph, no break, and the loop matches eager."""
    torch.manual_seed(0)
    loops = Loops(Norms().train(), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                  lambda m, ids, y: F.cross_entropy(m(ids).flatten(0, 1), y))
    ids, y = torch.randint(0, 16, (2, 5)), torch.randint(0, 3, (10,))
    torch._dynamo.utils.counters.clear()
    for step in range(3):
        assert_losses_match(*loops.step(ids, y), step)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    loops.assert_parameters_match()


class Embedded(nn.Module):
    """Token ids through an embedding into the MLP's head: an id out of range is a kernel's status, not a crash."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 16), nn.Linear(16, 5)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids))).mean(1)


def test_a_step_that_reads_nothing_waits_for_nothing():
    """As CUDA's launches: forward, backward and the optimizer's step return once submitted; reading the loss is the
    one wait of a step. Losses and weights stay eager's."""
    model = MLP()
    ref = copy.deepcopy(model)
    opt = torch_meganeura.keep_on_device(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend="meganeura")
    data, counters = batch(), get_device().counters
    for step in range(6):
        waits = counters.waits
        loss = compiled(*data)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert counters.waits == waits, f"step {step} waited {counters.waits - waits} times, reading nothing"
        ref_loss = F.cross_entropy(ref(data[0]), data[1])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step % 2:
            assert_losses_match(loss.item(), ref_loss.item(), step)
            assert counters.waits == waits + 1, "reading the loss: one wait"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_an_index_out_of_range_raises_at_the_next_read_naming_the_op_and_the_loop_goes_on():
    """An embedding id out of range in a step that reads nothing raises at the next read of a value (``loss.item()``
    of the next step), naming the op; the steps after it run and train as eager does from there."""
    model = Embedded()
    opt = torch_meganeura.keep_on_device(torch.optim.SGD(model.parameters(), lr=0.1))
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids, y: F.cross_entropy(model(ids), y), backend="meganeura")
    good, bad, y = torch.randint(0, 10, (4, 6)), torch.randint(0, 10, (4, 6)), torch.randint(0, 5, (4,))
    bad[1, 2] = 10
    for ids in (good, bad):
        loss = compiled(ids, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    loss = compiled(good, y)
    with pytest.raises(KernelStatusError, match="index out of range in .*embedding"):
        loss.item()
    ref = copy.deepcopy(model)  # the state the failed step left (its clamped ids read row 0), then eager steps
    with torch.no_grad():
        for (_, p), q in zip(model.named_parameters(), ref.parameters()):
            q.copy_(p)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        loss = compiled(good, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = F.cross_entropy(ref(good), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_losses_match(loss.item(), ref_loss.item(), step)


def test_an_eager_op_mixing_a_kept_parameter_and_a_lazy_output_reads_both():
    """The override of a call's first tensor subclass runs it with overrides off: it downloads every kept argument,
    a ``DeviceParameter``'s and a ``DeviceTensor``'s alike (it synced only its own class: the other was read stale)."""
    model = MLP()
    opt = torch_meganeura.keep_on_device(torch.optim.SGD(model.parameters(), lr=0.1))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend="meganeura")
    data = batch()
    for _ in range(2):
        compiled(*data).backward()
        opt.step()
        opt.zero_grad()
    loss = compiled(*data)  # stays on the device until read
    bias = model.fc2.bias  # stale on the host after the device's steps
    assert type(loss) is DeviceTensor and type(bias) is DeviceParameter
    mixed = torch.mul(bias, loss)  # the parameter's override runs the op
    want = bias.detach().clone() * loss.item()
    torch.testing.assert_close(mixed.detach(), want)
    assert loss.item() > 0.1


class BatchNormBlocks(nn.Module):
    """Convolutions with BatchNorm, ``depth`` of them, and the loss inside the compiled module: its target check
    (cross entropy's ``ignore_index``) is the training forward's last kernel."""

    def __init__(self, depth: int, channels: int = 4, classes: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                                    nn.BatchNorm2d(channels), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.blocks(x).mean((2, 3))), y)


def batchnorm_loops(depth: int) -> Loops:
    return Loops(randomize_norms(BatchNormBlocks(depth)).train(), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                 lambda m, x, y: m(x, y))


def train_on_one_batch(loops: Loops, steps: int) -> list[str]:
    """``steps`` steps of both loops on one random batch of ``BatchNormBlocks``' shapes, each step's losses
    compared; returns the warnings of ours they raised."""
    data = (torch.randn(2, 4, 8, 8), torch.randint(0, 3, (2,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            assert_losses_match(*loops.step(*data), step)
    return meganeura_warnings(caught)


def test_more_batchnorm_counters_than_bindings_with_the_loss_inside_train_as_eager(monkeypatch):
    """Ten BatchNorm layers under WebGPU's default limits (8 storage bindings): their ``num_batches_tracked``
    increments merge into kernels that store over the counters, which the loss's check at the end of the forward
    then refuses; the merged kernels are cut back within the limit (they raised before, and the partition fell
    back). Nothing falls back, and losses, weights and statistics stay eager's."""
    monkeypatch.setenv(LIMITS_ENV, "webgpu-default")
    loops = batchnorm_loops(10)
    caught = train_on_one_batch(loops, 4)
    assert not caught
    loops.assert_parameters_match()
    assert_buffers_match(loops)


def test_a_forward_partition_in_eager_pytorch_reads_kept_parameters_and_statistics(monkeypatch):
    """A forward partition whose compile fails runs in eager PyTorch at every step, on the kept parameters and
    running statistics (host copies of device values; aot_autograd's first call runs it under a dispatch mode that
    refuses tensor subclasses), and writes the statistics back: the loop trains as eager's."""
    compile_partition = DevicePartition._compile

    def fail_in_forward(self, *args):
        if self.lazy_from_first:  # (a forward's partitions)
            raise RuntimeError("a forward that does not compile")
        return compile_partition(self, *args)

    monkeypatch.setattr(DevicePartition, "_compile", fail_in_forward)
    loops = batchnorm_loops(2)
    caught = train_on_one_batch(loops, 3)
    assert any("compiling it failed" in w for w in caught)
    loops.assert_parameters_match()
    assert_buffers_match(loops)
