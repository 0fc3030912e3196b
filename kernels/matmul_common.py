"""What the matmul kernels share (``matmul`` tiled, ``matmul_gemv``) and the attention kernels reuse: the threads a
workgroup takes, a grid folded into the per-dimension limit, and the constants a kernel's header names."""
from __future__ import annotations

from . import wgsl
from .sizes import is_size

THREADS_WANTED = 256          # threads per workgroup when the device allows it


def _max_threads(limits: dict) -> int:
    return min(limits["max-compute-invocations-per-workgroup"],
               limits.get("max-compute-workgroup-size-x", THREADS_WANTED))


def fold_grid(total, max_per_dim: int) -> tuple:
    """Spread `total` workgroups over (x, y, z), each <= max_per_dim, with x * y * z >= total (a symbolic total over
    (x, y) when the plan runs: ``wgsl.grid``)."""
    if is_size(total):
        return wgsl.grid(total, max_per_dim)
    if total <= max_per_dim:
        return (total, 1, 1)
    rows = -(-total // max_per_dim)
    if rows <= max_per_dim:
        x = -(-total // rows)
        return (x, rows, 1)
    layers = -(-total // (max_per_dim * max_per_dim))
    if layers > max_per_dim:
        raise ValueError(f"matmul_kernel: {total} workgroups exceed {max_per_dim}^3")
    per_layer = -(-total // layers)
    rows = -(-per_layer // max_per_dim)
    x = -(-per_layer // rows)
    return (x, rows, layers)


def _thread_count(limits: dict) -> int:
    cap = min(limits["max-compute-invocations-per-workgroup"],
              limits.get("max-compute-workgroup-size-x", THREADS_WANTED), THREADS_WANTED)
    if cap < 64:
        raise ValueError(f"matmul_kernel: device allows only {cap} invocations per workgroup (need 64)")
    return 256 if cap >= 256 else 64


def _pow2_ceil(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _pow2_floor(value: int) -> int:
    return 1 << max(0, value.bit_length() - 1)


def _header(batch: int, m, n: int, k: int, grid: tuple, total, **more) -> str:
    """The constants a matmul kernel names: a symbolic M (and what follows from it) is read from the size buffer,
    and its grid folds when the plan runs (``fold_grid``)."""
    sizes = dict(BATCH=batch, M=m, N=n, K=k, WORKGROUPS=total, **more)
    return "".join(wgsl.size_constant(name, value) for name, value in sizes.items()) + wgsl.grid_constants(grid)


ENTRY = "@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32"


LINEAR_WORKGROUP = """    let wg_linear = wg.x + wg.y * GRID_X + wg.z * GRID_XY;
    let live = wg_linear < WORKGROUPS;  // folded grids round up: extra workgroups only pass barriers
"""
# The sizes the tiled kernel's tile and chunk are chosen for where a size is symbolic: one kernel for every value (a
# long one pays for rows past a ragged edge, a short one for a tile larger than it needs); K as a long one.
SYMBOLIC_CHOICE = {"batch": 1, "m": 64, "n": 64, "k": 1 << 12}
