"""Matmul kernel generator: WGSL for C[b, i, j] = sum_p A[b, i, p] * B[b, p, j].

The caller owns memory layout: its WGSL prelude declares the bindings and defines
`load_a(b, i, p)`, `load_b(b, p, j)` and `store_c(b, i, j, acc)` (store_c applies any
epilogue). This module owns the loop structure and calls them only with in-range indices,
exactly once per output element for store_c. Shapes are baked into the source as constants.

Two kernel families, chosen by shape:
- tiled: a TILE_M x TILE_N output tile per workgroup of THREADS_SIDE^2 threads, each thread a
  register block of (TILE_M / side) x (TILE_N / side) outputs; K is staged in chunks through
  padded workgroup memory. Tiles come from (64, 32, 16) per dimension, shrunk when the problem
  is too small to fill MIN_WORKGROUPS workgroups or the workgroup storage limit is too small.
- gemv (m == 1 or n == 1): a workgroup owns a few output columns (rows) and splits K over its
  threads ("lanes"), then reduces the partial sums with a workgroup tree reduction.

When the workgroup count exceeds the per-dimension limit, the grid is folded into 2-D / 3-D
and the kernel recovers the linear workgroup index. No atomics: results are deterministic.
"""

from dataclasses import dataclass

THREADS_WANTED = 256          # threads per workgroup when the device allows it
TILE_SIZES = (64, 32, 16)     # output tile edge candidates, largest first
K_CHUNKS = (16, 8, 4)         # K chunk candidates staged per barrier, largest first
SHARED_PAD = 2                # floats of padding per shared-tile row (row stride = 2 mod 32 banks)
MIN_WORKGROUPS = 128          # shrink tiles until a problem gets at least this many workgroups
GEMV_SHORT_K = 256            # gemv: k up to this -> many columns, few lanes per column
GEMV_LONG_K = 4096            # gemv: k from this on -> few columns, many lanes per column


@dataclass(frozen=True)
class TiledPlan:
    tile_m: int
    tile_n: int
    chunk_k: int
    threads_side: int

    def shared_floats(self) -> int:
        return self.chunk_k * (self.tile_m + SHARED_PAD + self.tile_n + SHARED_PAD)


@dataclass(frozen=True)
class GemvPlan:
    columns: int       # outputs per workgroup
    lanes: int         # threads splitting K for one output
    out_fastest: bool  # thread order: neighbouring threads take neighbouring outputs (else neighbouring p)


def matmul_kernel(prelude: str, *, batch: int, m: int, n: int, k: int,
                  limits: dict) -> tuple[str, tuple[int, int, int]]:
    """Return (wgsl_source, workgroups) for C[b, i, j] = sum_p A[b, i, p] * B[b, p, j] over b < batch, i < m, j < n, p < k."""
    if min(batch, m, n) < 1 or k < 0:
        raise ValueError(f"matmul_kernel: need batch, m, n >= 1 and k >= 0, got {batch=} {m=} {n=} {k=}")
    threads = _thread_count(limits)
    if m == 1 or n == 1:
        return _gemv_kernel(prelude, batch=batch, m=m, n=n, k=k, threads=threads, limits=limits)
    return _tiled_kernel(prelude, batch=batch, m=m, n=n, k=k, threads=threads, limits=limits)


def fold_grid(total: int, max_per_dim: int) -> tuple[int, int, int]:
    """Spread `total` workgroups over (x, y, z), each <= max_per_dim, with x * y * z >= total."""
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


def _header(batch: int, m: int, n: int, k: int, grid: tuple[int, int, int], total: int) -> str:
    return (f"const BATCH: u32 = {batch}u;\nconst M: u32 = {m}u;\nconst N: u32 = {n}u;\n"
            f"const K: u32 = {k}u;\nconst WORKGROUPS: u32 = {total}u;\n"
            f"const GRID_X: u32 = {grid[0]}u;\nconst GRID_XY: u32 = {grid[0] * grid[1]}u;\n")


LINEAR_WORKGROUP = """    let wg_linear = wg.x + wg.y * GRID_X + wg.z * GRID_XY;
    let live = wg_linear < WORKGROUPS;  // folded grids round up: extra workgroups only pass barriers
"""


# ---------------------------------------------------------------- tiled


def _choose_tiled_plan(batch: int, m: int, n: int, k: int, threads: int, shared_limit: int) -> TiledPlan:
    side = 16 if threads == 256 else 8
    tile_m = next((t for t in reversed(TILE_SIZES) if t >= m), TILE_SIZES[0])
    tile_n = next((t for t in reversed(TILE_SIZES) if t >= n), TILE_SIZES[0])
    smallest = TILE_SIZES[-1]

    def workgroups(tm: int, tn: int) -> int:
        return batch * -(-m // tm) * -(-n // tn)

    while workgroups(tile_m, tile_n) < MIN_WORKGROUPS and max(tile_m, tile_n) > smallest:
        tile_m, tile_n = _halve_larger(tile_m, tile_n)
    chunk_cap = max(K_CHUNKS[-1], _pow2_ceil(k))
    while True:
        for chunk in K_CHUNKS:
            plan = TiledPlan(tile_m, tile_n, min(chunk, chunk_cap), side)
            if plan.shared_floats() * 4 <= shared_limit:
                return plan
        if max(tile_m, tile_n) == smallest:
            raise ValueError(f"matmul_kernel: workgroup storage limit {shared_limit} B is too small")
        tile_m, tile_n = _halve_larger(tile_m, tile_n)


def _halve_larger(tile_m: int, tile_n: int) -> tuple[int, int]:
    return (tile_m // 2, tile_n) if tile_m >= tile_n else (tile_m, tile_n // 2)


def _stage_tile(plan: TiledPlan, threads: int, a_side: bool) -> str:
    """WGSL that copies one K chunk of A (tile_m rows) or B (tile_n columns) into shared memory."""
    chunk = plan.chunk_k
    edge = plan.tile_m if a_side else plan.tile_n
    # A: p varies fastest across threads (suits row-major A); B: j varies fastest (row-major B).
    if a_side:
        decode = f"let p = e % {chunk}u;\n            let r = e / {chunk}u;"
        fetch = "if (live && row0 + r < M && k0 + p < K) { v = load_a(batch_index, row0 + r, k0 + p); }"
    else:
        decode = f"let r = e % {edge}u;\n            let p = e / {edge}u;"
        fetch = "if (live && col0 + r < N && k0 + p < K) { v = load_b(batch_index, k0 + p, col0 + r); }"
    name = "tile_a" if a_side else "tile_b"
    return f"""        for (var e = lid; e < {edge * chunk}u; e += {threads}u) {{
            {decode}
            var v = 0.0;
            {fetch}
            {name}[p * {edge + SHARED_PAD}u + r] = v;
        }}"""


def _tiled_kernel(prelude: str, *, batch: int, m: int, n: int, k: int, threads: int,
                  limits: dict) -> tuple[str, tuple[int, int, int]]:
    plan = _choose_tiled_plan(batch, m, n, k, threads, limits["max-compute-workgroup-storage-size"])
    side = plan.threads_side
    rows_per_thread, cols_per_thread = plan.tile_m // side, plan.tile_n // side
    tiles_m, tiles_n = -(-m // plan.tile_m), -(-n // plan.tile_n)
    total = batch * tiles_m * tiles_n
    grid = fold_grid(total, limits["max-compute-workgroups-per-dimension"])
    a_stride, b_stride = plan.tile_m + SHARED_PAD, plan.tile_n + SHARED_PAD
    rows, cols = range(rows_per_thread), range(cols_per_thread)

    # Thread (tx, ty) owns rows ty + side*r and columns tx + side*c: shared reads broadcast / stay
    # conflict-free, and neighbouring threads store neighbouring columns.
    acc_decl = "\n".join(f"    var acc_{r}_{c} = 0.0;" for r in rows for c in cols)
    a_regs = "\n".join(f"            let a{r} = tile_a[p * {a_stride}u + ty + {side * r}u];" for r in rows)
    b_regs = "\n".join(f"            let b{c} = tile_b[p * {b_stride}u + tx + {side * c}u];" for c in cols)
    fmas = "\n".join(f"            acc_{r}_{c} = fma(a{r}, b{c}, acc_{r}_{c});" for r in rows for c in cols)
    stores = "\n".join(
        f"    if (live && row0 + ty + {side * r}u < M && col0 + tx + {side * c}u < N) "
        f"{{ store_c(batch_index, row0 + ty + {side * r}u, col0 + tx + {side * c}u, acc_{r}_{c}); }}"
        for r in rows for c in cols)

    kernel = f"""
// ---- matmul: tiled {plan.tile_m}x{plan.tile_n}, K chunk {plan.chunk_k}, {side}x{side} threads
{_header(batch, m, n, k, grid, total)}const TILES_N: u32 = {tiles_n}u;
const TILES_PER_BATCH: u32 = {tiles_m * tiles_n}u;
var<workgroup> tile_a: array<f32, {plan.chunk_k * a_stride}>;
var<workgroup> tile_b: array<f32, {plan.chunk_k * b_stride}>;

@compute @workgroup_size({side * side})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
{LINEAR_WORKGROUP}    let batch_index = wg_linear / TILES_PER_BATCH;
    let tile_index = wg_linear % TILES_PER_BATCH;
    let row0 = (tile_index / TILES_N) * {plan.tile_m}u;
    let col0 = (tile_index % TILES_N) * {plan.tile_n}u;
    let tx = lid % {side}u;
    let ty = lid / {side}u;
{acc_decl}
    for (var k0 = 0u; k0 < K; k0 += {plan.chunk_k}u) {{
{_stage_tile(plan, side * side, a_side=True)}
{_stage_tile(plan, side * side, a_side=False)}
        workgroupBarrier();
        for (var p = 0u; p < {plan.chunk_k}u; p++) {{
{a_regs}
{b_regs}
{fmas}
        }}
        workgroupBarrier();
    }}
{stores}
}}
"""
    return prelude + kernel, grid


# ---------------------------------------------------------------- gemv


def _choose_gemv_plan(outputs: int, k: int, threads: int, out_fastest: bool) -> GemvPlan:
    if k <= GEMV_SHORT_K:
        columns = threads // 4
    elif k < GEMV_LONG_K:
        columns = 16
    else:
        columns = 4
    columns = min(columns, _pow2_ceil(outputs))
    return GemvPlan(columns, threads // columns, out_fastest)


def _gemv_kernel(prelude: str, *, batch: int, m: int, n: int, k: int, threads: int,
                 limits: dict) -> tuple[str, tuple[int, int, int]]:
    # m == 1: outputs are columns j, the vector is A's row, the matrix is B.
    # n == 1: outputs are rows i, the vector is B's column, the matrix is A.
    by_column = m == 1
    outputs = n if by_column else m
    plan = _choose_gemv_plan(outputs, k, threads, out_fastest=by_column)
    if threads * 4 > limits["max-compute-workgroup-storage-size"]:
        raise ValueError("matmul_kernel: workgroup storage limit too small for the gemv reduction")
    blocks = -(-outputs // plan.columns)
    total = batch * blocks
    grid = fold_grid(total, limits["max-compute-workgroups-per-dimension"])
    if by_column:
        product = "load_a(batch_index, 0u, p), load_b(batch_index, p, out_index)"
        store = "store_c(batch_index, 0u, out_index, partial[lid]);"
    else:
        product = "load_a(batch_index, out_index, p), load_b(batch_index, p, 0u)"
        store = "store_c(batch_index, out_index, 0u, partial[lid]);"
    if plan.out_fastest:  # neighbouring threads read neighbouring outputs (row-major B)
        decode = f"let out_local = lid % {plan.columns}u;\n    let lane = lid / {plan.columns}u;"
        partner_step = plan.columns
    else:                 # neighbouring threads read neighbouring p (row-major A)
        decode = f"let lane = lid % {plan.lanes}u;\n    let out_local = lid / {plan.lanes}u;"
        partner_step = 1

    kernel = f"""
// ---- matmul: gemv over {"columns" if by_column else "rows"}, {plan.columns} outputs x {plan.lanes} K lanes
{_header(batch, m, n, k, grid, total)}const OUTPUTS: u32 = {outputs}u;
const BLOCKS: u32 = {blocks}u;
var<workgroup> partial: array<f32, {threads}>;

@compute @workgroup_size({threads})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
{LINEAR_WORKGROUP}    let batch_index = wg_linear / BLOCKS;
    {decode}
    let out_index = (wg_linear % BLOCKS) * {plan.columns}u + out_local;
    let has_output = live && out_index < OUTPUTS;
    var acc = 0.0;
    if (has_output) {{
        for (var p = lane; p < K; p += {plan.lanes}u) {{
            acc = fma({product}, acc);
        }}
    }}
    partial[lid] = acc;
    workgroupBarrier();
    for (var span = {plan.lanes // 2}u; span > 0u; span = span / 2u) {{
        if (lane < span) {{ partial[lid] = partial[lid] + partial[lid + span * {partner_step}u]; }}
        workgroupBarrier();
    }}
    if (has_output && lane == 0u) {{ {store} }}
}}
"""
    return prelude + kernel, grid
