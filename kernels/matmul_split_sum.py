"""The pass that sums a matmul's K slices: ``matmul_plans.split_k`` cuts a long K into slices whose partial sums the
tiled kernel writes to scratch; this pass adds them up in the slices' order (deterministic) and stores each output
through the prelude's ``store_c``, or by pairs of columns through ``store_c2``."""
from __future__ import annotations

from . import wgsl
from .matmul_common import THREADS_WANTED, fold_grid
from .sizes import ceil_div


def split_reduce_kernel(prelude: str, *, batch, m, n, split: int, partial: str, limits: dict,
                        pairs: bool = False) -> tuple[str, tuple[int, int, int]]:
    """Return (wgsl_source, workgroups) that sums the ``split`` slices of ``partial`` and calls store_c once per
    output element; with ``pairs`` (``matmul_kernel``'s, n even), store_c2 once per pair of neighbouring columns,
    a thread per pair adding up elements e and e + 1, each in the slices' order."""
    total = batch * m * n
    width = 2 if pairs else 1
    grid = fold_grid(ceil_div(total, width * THREADS_WANTED), limits["max-compute-workgroups-per-dimension"])
    sizes = "".join(wgsl.size_constant(name, value) for name, value in (("OUTPUTS", total), ("M", m), ("N", n)))
    linear = f"(wg.x + wg.y * GRID_X + wg.z * GRID_XY) * {THREADS_WANTED}u + lid"
    if pairs:
        first, zero, store = f"2u * ({linear})", "vec2<f32>()", "store_c2"
        add = (f"{{\n        acc += vec2<f32>({partial}[s * OUTPUTS + e], {partial}[s * OUTPUTS + e + 1u]);\n    }}")
    else:
        first, zero, store = linear, "0.0", "store_c"
        add = f"{{ acc += {partial}[s * OUTPUTS + e]; }}"
    kernel = f"""
// ---- matmul: sum of {split} K slices{", by pairs of columns" if pairs else ""}
{sizes}{wgsl.grid_constants(grid)}
@compute @workgroup_size({THREADS_WANTED})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
    let e = {first};
    if (e >= OUTPUTS) {{ return; }}
    var acc = {zero};
    for (var s = 0u; s < {split}u; s++) {add}
    {store}(e / (M * N), (e / N) % M, e % N, acc);
}}
"""
    return prelude + kernel, grid
