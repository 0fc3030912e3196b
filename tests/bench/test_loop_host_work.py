"""Host work of the ordinary loop's step (``torch.compile`` + ``keep_on_device(AdamW)``) as a model gets deeper:
a small convolutional network with BatchNorm at two depths, the calls of our tensor overrides (interceptions) and
the tensor wrappers made in each phase of a step, counted as ``bench.host`` counts them (issue 50).

- ``opt.step()`` and ``opt.zero_grad()`` intercept nothing and make no wrapper, at any depth;
- BatchNorm's running statistics, updated on the device at every forward, are intercepted nowhere, nor the
  parameters the forward saves for the backward (one ``SavedPack`` of them: aot_autograd's ``_is_view`` of each
  met its override before): the forward intercepts one call at both depths, the loss function's op on the logits;
  before, each parameter cost one, and each statistic (three per block) three more.

- BatchNorm's running statistics are stored in place by the training forward's plan (the reduction's row results
  over the statistics, the ``num_batches_tracked`` increments over the counters, the loss's target check run first),
  and a warm forward binds and adopts them with no call per statistic (``bound_plan.SteadyUpdates``): before, every
  request was refused, and each statistic cost a ``device_input``, a ``spare_array`` and an ``adopt`` per step.

- the forward's hand-off to the backward (``backend.packed``): the activations it saves, more at each depth, cross
  autograd as one ``SavedPack`` per device partition, their arrays taken from the pool as one set: the forward makes
  as many wrappers and pool acquires at both depths.

- the backward's gradients of the kept parameters, more at each depth, are parked on the parameters
  (``backend.parked_grads``), their arrays taken from the pool as one set: the backward makes no wrapper and
  intercepts nothing at both depths, and as many pool acquires (before: a wrapper per gradient, another for
  AccumulateGrad's ``detach`` of each, and a pool acquire each).

- ``opt.step()``'s plan keeps the parameters' and optimizer state's arrays bound from one step to the next: its run
  checks and binds the gradients only.
"""
import cProfile
import functools
import pstats

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_meganeura
from bench.host import call_counts
from helpers.compiled_plans import record_compiled_plans
from helpers.saved import saved_packs

DEPTHS = (2, 4)
POOL_ACQUIRES = ("acquire", "acquire_set")  # runtime/resident.py's BufferPool
PER_UPDATE = ("adopt", "device_input", "spare_array")  # tensors/device_tensor.py: per argument a graph updates
STEP_FOLDERS = ("torch_meganeura/training/", "torch_meganeura/tensors/")  # the kept step's own code
WARM_STEPS = 2  # the first compiles; the second binds the optimizer state's and statistics' second arrays


class ConvBlocks(nn.Module):
    def __init__(self, depth: int, channels: int = 4, classes: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                                    nn.BatchNorm2d(channels), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.blocks(x).mean((2, 3)))


def _profiled(call):
    profile = cProfile.Profile()
    profile.enable()
    try:
        result = call()
    finally:
        profile.disable()
    counts = call_counts(profile)
    stats = pstats.Stats(profile).stats.items()
    counts["pool_acquires"] = sum(s[1] for (path, _, name), s in stats if name in POOL_ACQUIRES
                                  and path.endswith("resident.py"))
    counts["per_update"] = sum(s[1] for (path, _, name), s in stats if name in PER_UPDATE
                               and path.endswith("device_tensor.py"))
    return result, counts


def _kept_loop(depth: int):
    """The loop's model at ``depth`` blocks, its kept AdamW and a function computing the loss of one batch through
    the compiled model."""
    torch.manual_seed(0)
    model = ConvBlocks(depth).train()
    opt = torch_meganeura.keep_on_device(torch.optim.AdamW(model.parameters(), lr=1e-3))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="meganeura")
    x, y = torch.randn(2, 4, 8, 8), torch.randint(0, 3, (2,))
    return model, opt, lambda: F.cross_entropy(compiled(x), y)


@functools.cache  # (each test reads the counts of both depths: compiled once for all of them)
def phase_counts(depth: int) -> dict[str, dict[str, int]]:
    """{phase: {"interceptions": n, "wrappers": n}} of one warm step of the loop at ``depth`` blocks."""
    model, opt, loss_of = _kept_loop(depth)
    for _ in range(WARM_STEPS):
        loss_of().backward()
        opt.step()
        opt.zero_grad()
    loss, forward = _profiled(loss_of)
    forward["saved"] = sum(len(pack.values) for pack in saved_packs(loss))  # (values saved in packs)
    _, backward = _profiled(loss.backward)
    _, step = _profiled(opt.step)
    _, zero = _profiled(opt.zero_grad)
    assert all(p.grad is None for p in model.parameters())
    return {"forward": forward, "backward": backward, "step": step, "zero_grad": zero,
            "parameters": sum(1 for _ in model.parameters())}


def test_optimizer_and_buffer_updates_make_no_per_layer_interception():
    counts = {depth: phase_counts(depth) for depth in DEPTHS}
    for depth, phases in counts.items():
        for phase in ("step", "zero_grad"):
            assert phases[phase] == {"interceptions": 0, "wrappers": 0, "pool_acquires": 0, "per_update": 0}, (
                depth, phase)
    for depth, phases in counts.items():  # (the one: the loss function's op on the logits, a lazy output)
        assert phases["forward"]["interceptions"] == 1, (depth, phases["forward"])


def test_a_warm_forward_binds_and_adopts_the_statistics_with_no_call_per_statistic():
    """The forward updates three statistics per BatchNorm, more at depth, all stored in place: a warm step binds their
    arrays and adopts them again as one (before: ``device_input``, ``spare_array`` and ``adopt`` of each)."""
    for depth in DEPTHS:
        assert phase_counts(depth)["forward"]["per_update"] == 0, depth


def backend_calls(depth: int) -> dict[str, int]:
    """Calls made by the backend's own code (``torch_meganeura/backend``, and what it calls) in a warm forward and
    backward of the loop at ``depth`` blocks."""
    _, opt, loss_of = _kept_loop(depth)
    for _ in range(WARM_STEPS + 1):
        opt.zero_grad()
        forward = cProfile.Profile()
        forward.enable()
        loss = loss_of()
        forward.disable()
        backward = cProfile.Profile()
        backward.enable()
        loss.backward()
        backward.disable()
        opt.step()
    return {phase: _calls_in(profile, ("torch_meganeura/backend/",))
            for phase, profile in (("forward", forward), ("backward", backward))}


def test_the_forward_and_the_backward_make_no_call_per_layer():
    """A warm forward's and backward's own work is as many calls at both depths: the statistics bound and adopted as
    one (``bound_plan.SteadyUpdates``), the outputs put together from a pool in C (``per_call._Layout``), the saved
    arrays' signatures compared in C (``bound_plan.ArraySignatures``), the gradient accumulators read in C (before: a
    call or more per statistic, saved value, output and parameter)."""
    shallow, deep = (backend_calls(depth) for depth in DEPTHS)
    assert shallow == deep, (shallow, deep)


def test_batchnorm_statistics_are_stored_in_place_with_the_loss_inside(monkeypatch):
    """With the loss inside the compiled function, its target check (cross entropy's ``ignore_index``) runs before
    the forward's updates, and every statistic's update is stored over it: the running mean and variance by the
    reduction that computes the batch's, ``num_batches_tracked`` by its increment (before: all refused)."""
    plans = record_compiled_plans(monkeypatch)
    model, opt, _ = _kept_loop(DEPTHS[1])
    compiled = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend="meganeura")
    x, y = torch.randn(2, 4, 8, 8), torch.randint(0, 3, (2,))
    for _ in range(WARM_STEPS):
        compiled(x, y).backward()
        opt.step()
        opt.zero_grad()
    (forward,) = [plan for plan in plans if plan.stats.get("separated_checks")]
    statistics = 3 * DEPTHS[1]
    assert forward.stats["in_place_outputs"] == statistics and forward.stats["in_place_refused"] == {}, forward.stats


def test_the_forward_hands_its_saved_values_over_in_packs():
    shallow, deep = (phase_counts(depth)["forward"] for depth in DEPTHS)
    assert deep["saved"] > shallow["saved"] > 0, (shallow, deep)  # more saved at depth, all in packs
    assert (deep["wrappers"], deep["pool_acquires"]) == (shallow["wrappers"], shallow["pool_acquires"]), (shallow, deep)


def test_the_backward_parks_the_gradients_with_no_per_layer_work():
    counts = {depth: phase_counts(depth) for depth in DEPTHS}
    shallow, deep = (counts[depth]["backward"] for depth in DEPTHS)
    assert counts[DEPTHS[1]]["parameters"] > counts[DEPTHS[0]]["parameters"]
    assert (deep["interceptions"], deep["wrappers"]) == (0, 0), deep
    assert (shallow["interceptions"], shallow["wrappers"]) == (0, 0), shallow
    assert deep["pool_acquires"] == shallow["pool_acquires"], (shallow, deep)


def _calls_in(profile: cProfile.Profile, folders: tuple[str, ...]) -> int:
    """Calls of code under ``folders``, and calls (of Python functions and builtins alike) made from it, in a
    profiled call."""
    return sum(counts[1] for (path, _, _), (_, _, _, _, callers) in pstats.Stats(profile).stats.items()
               for (caller, _, _), counts in callers.items()
               if any(folder in path or folder in caller for folder in folders))


def step_calls(depth: int, phase: str = "step") -> int:
    """Calls made by the kept optimizer's own code (``training``, ``tensors``) in one warm ``opt.step()`` (outside
    its plan run), or ``opt.zero_grad()`` (``phase``), at ``depth`` blocks."""
    _, opt, loss_of = _kept_loop(depth)
    for _ in range(WARM_STEPS + 1):
        opt.zero_grad()
        loss_of().backward()
        profile = cProfile.Profile()
        for call in (opt.step, opt.zero_grad):
            if call.__name__ == f"_kept_{phase}":
                profile.enable()
            call()
            profile.disable()
    return _calls_in(profile, STEP_FOLDERS)


def test_a_kept_optimizer_step_makes_no_per_parameter_call():
    """A replayed ``opt.step()`` checks and binds its parameters, gradients and state tensors in loops run by C
    (``map``), not a Python call or loop iteration per tensor: as many calls at both depths."""
    shallow, deep = (step_calls(depth) for depth in DEPTHS)
    assert shallow == deep, (shallow, deep)


def step_binding(depth: int, monkeypatch) -> dict[str, int]:
    """In one warm ``opt.step()`` at ``depth`` blocks: the device arrays its plan run checked and bound (``arrays``)
    and the times it bound its kept arrays again (``keeps``), with the model's parameter count."""
    from meganeura.runtime.program_inputs import DeviceInputs

    model, opt, loss_of = _kept_loop(depth)
    seen = {"arrays": 0, "keeps": 0}
    checked, keep = DeviceInputs._checked_buffers, DeviceInputs.keep

    def counted_check(self, arrays, shapes):
        seen["arrays"] += len(arrays)
        return checked(self, arrays, shapes)

    def counted_keep(self, arrays, shapes):
        seen["keeps"] += 1
        return keep(self, arrays, shapes)

    for step in range(WARM_STEPS + 1):
        opt.zero_grad()
        loss_of().backward()
        if step == WARM_STEPS:
            monkeypatch.setattr(DeviceInputs, "_checked_buffers", counted_check)
            monkeypatch.setattr(DeviceInputs, "keep", counted_keep)
        opt.step()
    return {**seen, "parameters": sum(1 for _ in model.parameters())}


def test_a_kept_optimizer_step_binds_only_the_gradients(monkeypatch):
    """A replayed ``opt.step()``'s plan keeps the parameters' and AdamW state's arrays bound from the step before
    (``RoleProgram.keep_named``), and its gradients come back in the buffers of the step before (the backward's
    set from the pool): its run repeats the last one's binding (``DeviceInputs.bind``) and checks no array one by
    one (before: one per parameter, its gradient; before that, four, and the parameter and state arrays read again
    at every step)."""
    for depth in DEPTHS:
        binding = step_binding(depth, monkeypatch)
        monkeypatch.undo()
        assert binding == {"arrays": 0, "keeps": 0, "parameters": binding["parameters"]}, depth


def test_zero_grad_of_the_loop_makes_no_per_parameter_call():
    """``opt.zero_grad()`` after a step of the ordinary loop drops the parked gradients in loops run by C (before: a
    Python call per parameter, then torch's ``zero_grad`` over parameters with no ``.grad``)."""
    shallow, deep = (step_calls(depth, "zero_grad") for depth in DEPTHS)
    assert shallow == deep, (shallow, deep)
