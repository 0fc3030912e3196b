"""The device's shared arena (``meganeura.runtime.arena``): programs that never run at once hold one arena buffer,
the size of the largest live plan's, counted by the device's allocation counters; each program binds the current
buffer before its run, so results stay right when a larger or smaller one replaces it."""
import gc

import numpy as np

from meganeura.runtime.arena import SharedArena
from meganeura.runtime.device import get_device
from meganeura.runtime.program import Program
from meganeura.runtime.readback import START_BUFFERS

from helpers.plans import arena_chain_plan, arena_param_plan

RNG = np.random.default_rng(0)


def own_bytes(program: Program) -> int:
    """The bytes a program allocates for itself: its plan's buffers but the arena, and its read-back's staging."""
    plan = program.plan
    return sum(b.size for b in plan.buffers if b.role != "arena") + START_BUFFERS * program.stats()["staging_bytes"]


def arena_bytes(program) -> int:
    """The arena bytes of a program's plan, or of a plan."""
    return getattr(program, "plan", program).buffer("arena").size


def check(program: Program, n: int) -> None:
    x = RNG.standard_normal(n, dtype=np.float32)
    np.testing.assert_allclose(program.run({"x": x})["y"], 8 * x, rtol=1e-6)


def test_programs_share_the_largest_arena_and_give_it_back(monkeypatch):
    """A training loop's forward, backward and optimizer programs each held an arena, all at once (full-size
    Whisper-tiny through the backend: 55 and 193 MiB). Two programs with arenas of 416 and 16,256 bytes now
    allocate 16,256 for both; releasing the larger gives its arena back at once (the smaller's is made again for its
    next run), and a collected program's claim goes with it."""
    device = get_device()
    monkeypatch.setattr(device, "arena", SharedArena(device))  # alone on it: other tests' programs claim none
    counters = device.counters
    before = counters.bytes_allocated
    small = Program(device, arena_chain_plan(40))
    assert counters.bytes_allocated - before == own_bytes(small) + arena_bytes(small)
    check(small, 40)
    large_plan = arena_chain_plan(4000)
    large = Program(device, large_plan)
    assert arena_bytes(large) > 30 * arena_bytes(small)
    assert counters.bytes_allocated - before == own_bytes(small) + own_bytes(large) + arena_bytes(large)
    for _ in range(2):  # the small program binds the larger buffer at its next run
        check(small, 40)
        check(large, 4000)
    large.release()
    assert counters.bytes_allocated - before == own_bytes(small)  # the arena is made again for the next run
    check(small, 40)
    assert counters.bytes_allocated - before == own_bytes(small) + arena_bytes(small)
    large = Program(device, large_plan)
    held = counters.bytes_allocated
    del large
    gc.collect()
    device.arena.shrink()
    assert counters.bytes_allocated == held - arena_bytes(large_plan)
    check(small, 40)


def test_params_bound_after_the_arena_was_replaced(monkeypatch):
    """A program made before another program's run replaced the arena, whose params are bound only after that run
    (a training step whose loss runs in segments: each segment's program is made, the next one runs, then the first
    one's params are bound), builds its bind groups over the current arena, never the destroyed one. The bind
    groups were made at ``bind_params`` over the arena of the program's construction: wgpu refused them ("Buffer
    with 'arena' label has been destroyed")."""
    device = get_device()
    monkeypatch.setattr(device, "arena", SharedArena(device))
    waiting = Program(device, arena_param_plan(40))  # params not bound yet: nothing built
    large = Program(device, arena_chain_plan(4000))
    check(large, 4000)  # the arena grows: the buffer the first program knew is destroyed
    large.release()  # and shrinks again: replaced a second time
    w = RNG.standard_normal(40, dtype=np.float32)
    waiting.upload_params({"w": w})
    x = RNG.standard_normal(40, dtype=np.float32)
    np.testing.assert_allclose(waiting.run({"x": x})["y"], 4 * x * w, rtol=1e-6)


def test_rebinding_params_between_other_programs_runs(monkeypatch):
    """Params rebound (an optimizer's new weights) after another program grew the arena: the rebuilt groups bind the
    arena of now, and the run's result is right."""
    device = get_device()
    monkeypatch.setattr(device, "arena", SharedArena(device))
    small = Program(device, arena_param_plan(40))
    small.upload_params({"w": np.ones(40, np.float32)})
    x = RNG.standard_normal(40, dtype=np.float32)
    np.testing.assert_allclose(small.run({"x": x})["y"], 4 * x, rtol=1e-6)
    large = Program(device, arena_chain_plan(4000))
    check(large, 4000)
    w = RNG.standard_normal(40, dtype=np.float32)
    small.upload_params({"w": w})
    np.testing.assert_allclose(small.run({"x": x})["y"], 4 * x * w, rtol=1e-6)
