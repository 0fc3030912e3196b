"""The ordinary loop (``torch.compile`` + ``keep_on_device(AdamW)``) on the five benchmark workloads' smoke models,
asynchronous against synchronous (``MEGANEURA_SYNC``'s switch, ``InFlight.sync``): 10 steps from the same weights
and batch give identical losses and final weights, elementwise; an asynchronous step that reads nothing waits for
nothing, and one that reads the loss waits once (the device's counters)."""
import contextlib
import copy

import pytest
import torch

import torch_meganeura
from bench.workloads import WORKLOADS
from meganeura.runtime.device import get_device

STEPS = 10
READ_EVERY = 3  # steps that read the loss; the others read nothing


def kept_loop(workload, base: torch.nn.Module):
    """A fresh copy of ``base`` in the workload's training mode, its AdamW kept on the device, and its loss compiled
    afresh by the backend, once the device's runs in flight are done."""
    get_device().synchronize()
    model = copy.deepcopy(base).train(workload.train_mode)
    opt = torch_meganeura.keep_on_device(torch.optim.AdamW(model.parameters(), lr=1e-3))
    torch._dynamo.reset()
    return model, opt, torch.compile(lambda *args: workload.loss(model, *args), backend="meganeura")


@contextlib.contextmanager
def waiting_after_every_run(sync: bool):
    """The device synchronous (``MEGANEURA_SYNC``'s switch) or asynchronous inside, as it was after."""
    device = get_device()
    was, device.in_flight.sync = device.in_flight.sync, sync
    try:
        yield device
    finally:
        device.in_flight.sync = was


def final_weights(model: torch.nn.Module, opt) -> dict:
    torch_meganeura.sync_parameters(opt)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def loop(workload, base: torch.nn.Module, batch: tuple, sync: bool) -> tuple[list[float], dict, list[int]]:
    """(losses, final parameters, waits of each step) of ``STEPS`` AdamW steps of the loop."""
    model, opt, compiled = kept_loop(workload, base)
    losses, waits = [], []
    with waiting_after_every_run(sync) as device:
        for step in range(STEPS):
            before = device.counters.waits
            loss = compiled(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % READ_EVERY == 0:
                losses.append(loss.item())
            waits.append(device.counters.waits - before)
    return losses, final_weights(model, opt), waits


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_asynchronous_loop_equals_the_synchronous_one(name):
    workload = WORKLOADS[name]
    torch.manual_seed(0)
    base = workload.build(True)
    batch = workload.batch("full", torch.Generator().manual_seed(0), True)
    sync_losses, sync_weights, _ = loop(workload, base, batch, sync=True)
    losses, weights, waits = loop(workload, base, batch, sync=False)
    assert losses == sync_losses
    for n, p in weights.items():
        assert torch.equal(p, sync_weights[n]), n
    steady = waits[2:]  # (the first steps compile: plans that read nothing back still upload and may time)
    assert steady == [1 if step % READ_EVERY == 0 else 0 for step in range(2, STEPS)], waits




@pytest.mark.parametrize("name", ["sd_unet"])
def test_a_gradient_check_then_the_loop(name):
    """A first call whose gradients are read (as the benchmark's gate compares them with eager's), then the loop
    with zero_grad(set_to_none=True) first: the second forward leaves its next run to be recorded at the next wait,
    over output buffers that its backward gives back to the device's pool, and the kept AdamW's first update empties
    that pool (its state is made then). That wait must record nothing over them: wgpu-core aborted the process there.
    Losses and final weights are those of the synchronous loop."""
    workload = WORKLOADS[name]
    torch.manual_seed(0)
    base = workload.build(True)
    batch = workload.batch("full", torch.Generator().manual_seed(0), True)
    results = []
    for sync in (False, True):
        model, opt, compiled = kept_loop(workload, base)
        with waiting_after_every_run(sync):
            compiled(*batch).backward()
            grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
            losses = []
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                loss = compiled(*batch)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        results.append((grads, losses, final_weights(model, opt)))
    (grads, losses, weights), (sync_grads, sync_losses, sync_weights) = results
    assert grads.keys() == sync_grads.keys() and losses == sync_losses
    for n, g in grads.items():
        assert torch.equal(g, sync_grads[n]), n
    for n, p in weights.items():
        assert torch.equal(p, sync_weights[n]), n
