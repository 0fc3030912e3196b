"""The device's shared arena (``meganeura.runtime.arena``): programs that never run at once hold one arena buffer,
the size of the largest live plan's, counted by the device's allocation counters; each program binds the current
buffer before its run, so results stay right when a larger or smaller one replaces it."""
import gc

import numpy as np

from meganeura.runtime.arena import SharedArena
from meganeura.runtime.device import get_device
from meganeura.runtime.program import Program
from meganeura.runtime.readback import START_BUFFERS

from helpers.plans import affine_arena_plan, arena_chain_plan

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


def test_params_bound_after_another_program_replaced_the_arena(monkeypatch):
    """A segmented training step binds new parameter arrays before each run of its plans, and binding builds the
    bind groups: over the arena buffer as the program last took it, which a larger program's run had destroyed since
    (wgpu: "Buffer with 'arena' label has been destroyed"). Binding takes the current arena first."""
    device = get_device()
    monkeypatch.setattr(device, "arena", SharedArena(device))
    n = 40
    small = Program(device, affine_arena_plan(n))
    x = RNG.standard_normal(n, dtype=np.float32)
    for step in range(2):
        w, bias = RNG.standard_normal(n, dtype=np.float32), RNG.standard_normal(n, dtype=np.float32)
        small.upload_params({"w": w, "bias": bias})  # the second: after the larger program replaced the arena
        np.testing.assert_allclose(small.run({"x": x})["y"], 2 * (x * w + bias), rtol=1e-6)
        if step == 0:
            large = Program(device, arena_chain_plan(4000))
            check(large, 4000)
            assert arena_bytes(large) > small.plan.buffer("arena").size
