"""Matmul kernel generator: WGSL for C[b, i, j] = sum_p A[b, i, p] * B[b, p, j].

The caller owns memory layout: its WGSL prelude declares the bindings and defines
`load_a(b, i, p)`, `load_b(b, p, j)` and `store_c(b, i, j, acc)` (store_c applies any
epilogue). This module owns the loop structure and calls them only with in-range indices,
exactly once per output element for store_c. Shapes are baked into the source as constants.

Which variant a GEMM takes (tile, register block, K slices, staging, buffers), the constants of those rules and the
measurements behind them are ``matmul_plans``'s; the names in capitals below are defined there.

Two kernel families, chosen by shape:
- tiled: a TILE_M x TILE_N output tile per workgroup. Tiles come from (128, 64, 32, 16) per dimension, shrunk when
  the problem is too small to fill enough workgroups (MIN_WORKGROUPS_BIG for a 128 edge, MIN_WORKGROUPS for any) or
  the tile does not fit the workgroup storage or invocation limit; the default for large outputs of whole 128x256
  tiles where the limits allow is WIDE_TILE (``wide_tile_suits``; double-buffered, quad staged and unpadded where two
  chunks fit: ``wide_choice``), for square-class outputs that the rule would split QUAD_TILE quad staged
  (``quad_tile_suits``); the tuner may force others (CONFIGS).
  - Threads and registers: one thread per register block of rows x columns outputs (4x4; 8 along an edge of 128; 8x16
    in the wide tile), so a 128x128 tile of 8x8 blocks takes 16x16 = 256 threads. Thread (tx, ty) owns rows
    4 * (ty + threads_m * g) + i and columns 4 * (tx + threads_n * h) + j: groups of 4 a quarter or half tile apart,
    held as vec4 accumulators. Threads lie in row-major strips of threads_n, or in 4x8 patches (``patches``).
  - K step: K is staged in chunks of 16, 8 or 4 (the largest whose staging fits MAX_STAGED_PER_THREAD registers per
    thread and the workgroup storage limit: 128x128 at chunk 16 needs 16.5 KiB, so WebGPU's default 16 KiB gives it
    chunk 8), one or two barriers a chunk. The chunk's K steps are written out unrolled; per step a thread reads
    rows / 4 vec4s of A and columns / 4 of B from shared memory and does rows * columns / 4 vec4 FMAs (8x8: 4 reads
    for 16 FMAs).
  - Loads: scalar, through the prelude's ``load_a`` / ``load_b`` (any layout, gather or view), the operand's
    unit-stride axis fastest across threads (coalesced); the next chunk is fetched into registers before the current
    chunk's products (register prefetch), stored into shared memory after them. Quad staging (``quads``) fetches 4
    neighbouring elements per thread (``matmul_staging``), as one vec4 load where the prelude has a vec4 loader
    for the operand (``vector_loads``: rows of whole vec4s).
  - Shared memory: both operands K-major (A transposed), a row of tile_edge / 4 vec4s per K step plus one vec4 of
    padding (``matmul_staging`` has the layout and its bank conflicts: none on the products' reads, none or 2-way on
    the stores). Per chunk 4 * chunk * (TILE_M + TILE_N + 8) bytes, times two when double-buffered.
  Range checks (rows and columns past a ragged tile edge, K past a slice that is not whole chunks, workgroups of a
  rounded-up folded grid) are written only where the shape can fail them: on an H200 (a sweep, GPU time, best
  variant each) 4096^3 3.88 -> 3.53 ms, 1024^3 79 -> 71 us, Whisper's 1500x1536 @ 1536x384 93 -> 81 us.
  Variants, each a tuner candidate (``matmul_tuning``):
  - double-buffered (``double``; where twice the chunk fits the workgroup storage limit): two chunks in workgroup
    memory, each round's products read one while the next chunk is stored into the other, one barrier a chunk
    instead of two; where two of the rule's chunks do not fit, two unpadded ones (``unpadded``: a 128x128 tile's
    chunks of 8 in WebGPU's 16 KiB, a 128x256 tile's of 16 in 48 KiB; an operand stored along K swizzled) or two
    of a smaller chunk (``chunk`` caps it);
  - quad staging (``quads``) and thread patches (``patches``; where the thread grid is whole 4x8 patches): fewer
    staging instructions, vec4 stores into shared memory where the operand is contiguous along the tile's edge, and
    fewer distinct shared-memory reads per warp (PATCH_ROWS);
  - split K (``split``; by default where the output tiles make too few workgroups for a long K: ``split_k``): each
    workgroup sums one slice of K into partial sums, and a second pass (``matmul_split_sum.split_reduce_kernel``)
    adds the slices in a fixed order, for skinny shapes (small M * N, long K).
- gemv (m == 1 or n == 1): a workgroup owns a few output columns (rows) and splits K over its threads ("lanes", as
  many as give each a short run of K: GEMV_PER_LANE), then reduces the partial sums with a workgroup tree reduction.
  A lane loads GEMV_UNROLL products before adding them (in the order of a plain loop): loads in flight, not one
  memory latency each. Over columns with K contiguous, a half precision matrix whose rows are whole groups of 8
  along K is read by groups instead (``gemv_width``): one vec4<u32> load per 8 elements, widened in registers.

Half precision outputs (two to a u32 word) are stored by pairs of neighbouring columns (``pairs``): the tiled kernel's
register blocks hold groups of 4 adjacent columns, the gemv's even outputs take their neighbour's sum from
workgroup memory, and split K's second pass adds up a pair per thread; each word is written by one thread, after
the epilogue of both columns, so no narrowing pass follows the matmul.

When the workgroup count exceeds the per-dimension limit, the grid is folded into 2-D / 3-D
and the kernel recovers the linear workgroup index. No atomics: results are deterministic.

Fast precision (a plan compiled for limits with ``F16_PRODUCTS`` set; it needs the shader-f16 feature): a tiled
variant with ``f16`` stages its operands in workgroup memory as f16 and sums each K chunk's products (16 at most)
in f16 registers, then adds the chunk's sums to f32 accumulators. Operands are rounded to f16 (relative error
2^-11), so a product of random operands lands within about 1e-3 relative L2 of f32's; values beyond f16's range
(65504) overflow. By default only variants of 4x4 register blocks use it: with 8x8 blocks the second set of
accumulators does not fit the registers (an H200 4096^3 took 7.98 ms against 3.94 in f32).
"""

from .matmul_common import ENTRY, LINEAR_WORKGROUP, _header, _max_threads, _thread_count, fold_grid
from .matmul_gemv import _gemv_kernel
from .matmul_plans import PATCH_COLS, PATCH_ROWS, PATCH_THREADS, TiledPlan, _choose_tiled_plan, is_tiled
from .matmul_staging import Checks, Staging, shared_row
from .sizes import ceil_div, is_size


def matmul_kernel(prelude: str, *, batch: int, m: int, n: int, k: int, limits: dict, a_fast: str = "p",
                  b_fast: str = "j", tile: tuple[int, int] | None = None, block: tuple[int, int] | None = None,
                  split: int = 1, partial: str | None = None, f16: bool = False,
                  looped: str = "", double: bool = False, quads: bool = False, patches: bool = False,
                  vector_loads: str = "", products: int = 0, row_phases: int = 0,
                  gemv_width: int = 0, pairs: bool = False, staged: bool = False,
                  chunk: int = 0, unpadded: bool = False) -> tuple[str, tuple[int, int, int]]:
    """Return (wgsl_source, workgroups) for C[b, i, j] = sum_p A[b, i, p] * B[b, p, j]
    over b < batch, i < m, j < n, p < k.

    ``a_fast`` ("p" or "i") and ``b_fast`` ("j" or "p") name the operand axis along which memory is contiguous,
    so that neighbouring threads read neighbouring addresses; any value is correct, the right one is faster.
    ``tile`` forces the tiled kernel's (tile_m, tile_n) (each a multiple of its register block: an edge of
    TILE_SIZES or of the tuner's shapes, such as 96) and ``block`` each thread's register block (rows, columns; 4 or 8
    each, default 8 along an edge of 128, else 4), e.g. for tuning.
    With ``split`` > 1 (see ``split_k``) the kernel sums one of ``split`` slices of K and writes its partial
    sums into the array named ``partial`` (split * batch * m * n floats, slice-major) instead of calling
    store_c; ``matmul_split_sum``'s pass then adds the slices up and stores. ``f16`` forms the tiled kernel's products
    in f16 (see the module docstring; the WGSL then enables f16). ``looped`` ("a", "b" or "") names an operand whose
    loader is costly to write out many times (sibling matmuls' chain over their tensors): the tiled kernel fetches
    it in a loop, with one call of its loader. ``double`` double-buffers the tiled kernel's K chunks in workgroup
    memory where twice the chunk fits its storage limit (else it is ignored). ``quads`` stages the operands in quads
    (see ``matmul_staging``), ``patches`` lays the tiled kernel's threads out in patches (``TiledPlan.patches_fit``;
    else it is ignored). ``chunk`` > 0 caps the tiled kernel's K chunk (one of K_CHUNKS): the largest chunk up to it
    that the rule would take (with ``double``, two buffers of a chunk of 8 where two of 16 do not fit, for example);
    ``unpadded`` leaves its shared rows without their pad (``matmul_staging``: swizzled instead), so that
    two chunks fit where the pad would pass the storage limit (a 128x128 tile's two chunks of 8 in WebGPU's 16 KiB,
    a 128x256 tile's two of 16 in 48 KiB). ``vector_loads`` names the operands ("a", "b", both or none) whose
    prelude also defines ``load_a4(b, i, c4)`` / ``load_b4(b, j, c4)`` (unit-stride axis K: elements 4 * c4 ..
    4 * c4 + 3 along p) or ``load_a4(b, p, c4)`` / ``load_b4(b, p, c4)`` (unit-stride axis i or j), for an axis whose
    length is a multiple of 4: quad staging then loads each quad as one vec4.
    ``products`` > 0: the prelude defines ``load_b1`` ... as further B operands, each summed against A, and
    ``store_c`` takes their sums after ``acc`` (``acc1``, ...); ``row_phases`` > 0: it defines ``row_phase0`` ... (terms
    over (b, i, p) summed over K, each before the next) and private ``row_stat0`` ... that hold their sums, which
    ``load_a`` reads. Only the gemv kernel over columns (m == 1) takes either (see ``_gemv_kernel``).
    ``gemv_width`` > 0 (the gemv over columns with K contiguous, K a multiple of it): the prelude defines
    ``load_a<w>(b, i, c)``, ``load_b<w>(b, j, c)`` and ``load_b<k>_<w>(b, j, c)`` in place of ``load_b`` and the
    further products' loaders, each returning group c of w elements along K (``kernels.prelude.gemv_wide_loaders``),
    and the gemv reads by groups.
    ``pairs``: the prelude defines ``store_c2(b, i, j, acc, acc1, ...)`` in place of ``store_c``, storing the outputs
    at columns j and j + 1 (j even; each acc a vec2 of their sums), and the kernel calls it once per such pair, from
    one thread: a half precision output stores the two as one u32 word (``kernels.prelude.pair_store_function``).
    It needs an even ``n`` and, unsplit, the kernel over columns (m == 1) or the tiled one.
    ``staged``: the gemv over columns computes A's row once per workgroup into workgroup memory, where its lanes read
    it (``kernels.matmul_gemv``'s ``staged``: for a costly ``load_a``; ``gemv_stage_fits`` says where it fits)."""
    _check_arguments(batch, m, n, k, a_fast, b_fast, tile=tile, split=split, partial=partial, pairs=pairs,
                     gemv_only=bool(products or row_phases or staged))
    if tile is None and not is_tiled(m, n):
        return _gemv_kernel(prelude, batch=batch, m=m, n=n, k=k, threads=_thread_count(limits), limits=limits,
                            contiguous_k=(b_fast if m == 1 else a_fast) == "p", products=products,
                            row_phases=row_phases, width=gemv_width, pairs=pairs, staged=staged)
    return _tiled_kernel(prelude, batch=batch, m=m, n=n, k=k, limits=limits, a_fast=a_fast, b_fast=b_fast, tile=tile,
                         block=block, split=split, partial=partial, f16=f16, looped=looped, double=double,
                         quads=quads, patches=patches, vector_loads=vector_loads, pairs=pairs, chunk=chunk,
                         unpadded=unpadded)


def _check_arguments(batch, m, n, k, a_fast: str, b_fast: str, *, tile, split: int, partial, pairs: bool,
                     gemv_only: bool) -> None:
    """Refuse ``matmul_kernel`` arguments that no kernel serves (``gemv_only``: further products, a row prologue or
    a staged row, which only the gemv over columns takes)."""
    if gemv_only and (m != 1 or tile is not None or split > 1):
        raise ValueError("matmul_kernel: further products, a row prologue and a staged row need the gemv kernel over "
                         "columns (m == 1)")
    if split > 1 and (partial is None or m == 1 or n == 1):
        raise ValueError("matmul_kernel: a split K needs the tiled kernel (m, n > 1) and a partial-sum array")
    if min(batch, m, n) < 1 or k < 0:
        raise ValueError(f"matmul_kernel: need batch, m, n >= 1 and k >= 0, got {batch=} {m=} {n=} {k=}")
    if a_fast not in ("p", "i") or b_fast not in ("p", "j"):
        raise ValueError(f"matmul_kernel: a_fast must be 'p' or 'i' and b_fast 'p' or 'j', got {a_fast=} {b_fast=}")
    if pairs and (is_size(n) or n % 2):
        raise ValueError(f"matmul_kernel: pairs of columns need an even column count, got {n=}")


# ---------------------------------------------------------------- tiled


def _tiled_kernel(prelude: str, *, batch: int, m: int, n: int, k: int, limits: dict, a_fast: str, b_fast: str,
                  tile: tuple[int, int] | None, block: tuple[int, int] | None, split: int,
                  partial: str | None, f16: bool, looped: str, double: bool, quads: bool,
                  patches: bool, vector_loads: str, pairs: bool, chunk: int = 0,
                  unpadded: bool = False) -> tuple[str, tuple[int, int, int]]:
    plan = _choose_tiled_plan(batch, m, n, k, limits["max-compute-workgroup-storage-size"], _max_threads(limits), tile,
                              block, double, quads, patches, chunk, unpadded)
    element = "f16" if f16 else "f32"
    tm, tn = plan.threads_m, plan.threads_n
    tiles_m, tiles_n = ceil_div(m, plan.tile_m), ceil_div(n, plan.tile_n)
    total = split * batch * tiles_m * tiles_n
    grid = fold_grid(total, limits["max-compute-workgroups-per-dimension"])
    k_slice = ceil_div(ceil_div(k, split), plan.chunk_k) * plan.chunk_k  # K per slice, whole chunks
    checks = Checks(live=is_size(total) or grid[0] * grid[1] * grid[2] != total,
                    rows=is_size(m) or m % plan.tile_m != 0, cols=is_size(n) or n % plan.tile_n != 0,
                    k=is_size(k) or k == 0 or k % (split * plan.chunk_k) != 0)
    a_row, b_row = shared_row(plan.tile_m, plan.padded), shared_row(plan.tile_n, plan.padded)
    stage_a = Staging(plan, True, a_fast, looped == "a", "a" in vector_loads)
    stage_b = Staging(plan, False, b_fast, looped == "b", "b" in vector_loads)
    vectors = "".join(name for name, stage in (("A", stage_a), ("B", stage_b)) if stage.vector)
    vector_note = f", vec4 loads of {vectors}" if vectors else ""

    slots = plan.sums()
    acc_decl = "\n".join(f"    var acc_{g}_{i}_{h} = vec4<f32>();" for g, i, h in slots)
    if split > 1:
        epilogue = _partial_stores(slots, tm, tn, checks, partial)
    else:
        epilogue = _store_loop(slots, tm, tn, checks, pairs)

    live = LINEAR_WORKGROUP if checks.live else "    let wg_linear = wg.x + wg.y * GRID_X + wg.z * GRID_XY;\n"
    header = _header(batch, m, n, k, grid, total, TILES_N=tiles_n, TILES_PER_BATCH=tiles_m * tiles_n,
                     TILES_ALL=batch * tiles_m * tiles_n, K_SLICE=k_slice)
    kernel = f"""
// ---- matmul: tiled {plan.tile_m}x{plan.tile_n}, K chunk {plan.chunk_k}, {tm}x{tn} threads of \
{plan.rows_per_thread}x{plan.cols_per_thread}, A along {a_fast}, B along {b_fast}\
{f", K in {split} slices" if split > 1 else ""}{", double-buffered" if plan.buffers == 2 else ""}\
{", quad staging" if plan.quads else ""}{", thread patches" if plan.patches else ""}\
{"" if plan.padded else ", unpadded"}\
{vector_note}
{header}var<workgroup> tile_a: array<vec4<{element}>, {plan.buffers * plan.chunk_k * a_row}>;
var<workgroup> tile_b: array<vec4<{element}>, {plan.buffers * plan.chunk_k * b_row}>;

@compute @workgroup_size({plan.threads})
fn main({ENTRY}) {{
{live}    let slice = wg_linear / TILES_ALL;
    let batch_index = (wg_linear % TILES_ALL) / TILES_PER_BATCH;
    let tile_index = wg_linear % TILES_PER_BATCH;
    let row0 = (tile_index / TILES_N) * {plan.tile_m}u;
    let col0 = (tile_index % TILES_N) * {plan.tile_n}u;
    let k_begin = slice * K_SLICE;
    let k_end = min(K, k_begin + K_SLICE);
{_thread_position(plan)}
{acc_decl}
{(_double_k_loop if plan.buffers == 2 else _k_loop)(plan, stage_a, stage_b, checks, f16, k > 0)}
{epilogue}
}}
"""
    return ("enable f16;\n" if f16 else "") + prelude + kernel, grid


def _thread_position(plan: TiledPlan) -> str:
    """WGSL for the thread's position (tx, ty) in the tm x tn thread grid: row-major strips by default, else in
    patches of PATCH_ROWS x PATCH_COLS (neighbouring invocations), the patches row-major."""
    tn = plan.threads_n
    if not plan.patches:
        return f"    let tx = lid % {tn}u;\n    let ty = lid / {tn}u;"
    across = tn // PATCH_COLS
    return f"""    let patch_index = lid / {PATCH_THREADS}u;
    let in_patch = lid % {PATCH_THREADS}u;
    let tx = (patch_index % {across}u) * {PATCH_COLS}u + in_patch % {PATCH_COLS}u;
    let ty = (patch_index / {across}u) * {PATCH_ROWS}u + in_patch / {PATCH_COLS}u;"""


def _k_loop(plan: TiledPlan, stage_a: Staging, stage_b: Staging, checks: Checks, f16: bool,
            fetch_first: bool) -> str:
    """The tiled kernel's walk over its K slice: staging registers for A and B, the first chunk fetched (where K is
    not empty), then per chunk: stored into shared memory, the next one fetched (its loads overlap the products),
    and the products (``_chunk_products``)."""
    element = "f16" if f16 else "f32"
    first_fetch = (f"{stage_a.fetch('k_begin', checks)}\n{stage_b.fetch('k_begin', checks)}" if fetch_first else "")
    return f"""{stage_a.declare()}
{stage_b.declare()}
{first_fetch}
    for (var k0 = k_begin; k0 < k_end; k0 += {plan.chunk_k}u) {{
        workgroupBarrier();
{stage_a.store(element)}
{stage_b.store(element)}
        workgroupBarrier();
        let k_next = k0 + {plan.chunk_k}u;  // fetched now, stored next round: the loads overlap the FMAs
        if (k_next < k_end) {{
{stage_a.fetch("k_next", checks)}
{stage_b.fetch("k_next", checks)}
        }}
{_chunk_products(plan, f16, a_span=stage_a.swizzle, b_span=stage_b.swizzle)}
    }}"""


def _double_k_loop(plan: TiledPlan, stage_a: Staging, stage_b: Staging, checks: Checks, f16: bool,
                   fetch_first: bool) -> str:
    """``_k_loop`` over two buffers of workgroup memory: the first chunk fetched and stored into buffer 0, then per
    chunk: the next one fetched, the products of this one (buffer ``half``), the next one stored into the other buffer
    (which no thread reads this round: all finished the round that read it before the last barrier), one barrier."""
    element = "f16" if f16 else "f32"
    a_half, b_half = (plan.chunk_k * shared_row(plan.tile_m, plan.padded),
                      plan.chunk_k * shared_row(plan.tile_n, plan.padded))
    first = (f"{stage_a.fetch('k_begin', checks)}\n{stage_b.fetch('k_begin', checks)}\n"
             f"{stage_a.store(element)}\n{stage_b.store(element)}" if fetch_first else "")
    next_a, next_b = f"(1u - half) * {a_half}u + ", f"(1u - half) * {b_half}u + "
    return f"""{stage_a.declare()}
{stage_b.declare()}
{first}
    workgroupBarrier();
    var half = 0u;
    for (var k0 = k_begin; k0 < k_end; k0 += {plan.chunk_k}u) {{
        let k_next = k0 + {plan.chunk_k}u;
        let more = k_next < k_end;  // the same for every thread of the workgroup
        if (more) {{
{stage_a.fetch("k_next", checks)}
{stage_b.fetch("k_next", checks)}
        }}
        let a_base = half * {a_half}u;
        let b_base = half * {b_half}u;
{_chunk_products(plan, f16, "a_base + ", "b_base + ", stage_a.swizzle, stage_b.swizzle)}
        if (more) {{
{stage_a.store(element, next_a)}
{stage_b.store(element, next_b)}
        }}
        workgroupBarrier();
        half = 1u - half;
    }}"""


def _chunk_products(plan: TiledPlan, f16: bool, a_base: str = "", b_base: str = "", a_span: int = 0,
                    b_span: int = 0) -> str:
    """The tiled kernel's products of one K chunk staged in shared memory: each thread's register block of sums.
    One vec4 read of shared memory per group of 4 rows or columns, the reads of neighbouring threads adjacent (B) or
    identical (A, a broadcast). With ``f16`` the chunk's products go to f16 sums, added to the f32 ones after the
    chunk. ``a_base`` and ``b_base`` (WGSL text ending in " + ") offset the reads into the buffer of a double-buffered
    kernel; ``a_span`` and ``b_span`` (``Staging.swizzle``) XOR the index of a swizzled operand's reads."""
    tm, tn = plan.threads_m, plan.threads_n
    a_row, b_row = shared_row(plan.tile_m, plan.padded), shared_row(plan.tile_n, plan.padded)
    row_groups, col_groups = plan.rows_per_thread // 4, plan.cols_per_thread // 4
    sums = plan.sums()
    element, target = ("f16", "chunk") if f16 else ("f32", "acc")
    def reads(name: str, base: str, row: int, thread: str, spread: int, groups: int, span: int, p: int) -> str:
        lines = []
        for g in range(groups):
            index = f"{thread} + {spread * g}u"
            if span and p % span:  # a swizzled operand: (thread ^ c) + spread * g where spread is whole spans (the
                index = (f"({thread} ^ {p % span}u) + {spread * g}u" if spread % span == 0  # same, and the XOR
                         else f"(({index}) ^ {p % span}u)")  # of the thread's position is shared by its groups)
            lines.append(f"            let {name}{g} = tile_{name}[{base}p * {row}u + {index}];")
        return "\n".join(lines)

    fmas = "\n".join(f"            {target}_{g}_{i}_{h} = fma(vec4<{element}>(a{g}[{i}]), b{h}, {target}_{g}_{i}_{h});"
                     for g, i, h in sums)
    # The chunk's K steps written out one by one (constant shared-memory offsets): 1024^3 0.219 -> 0.161 ms and
    # 4096^3 5.30 -> 4.84 ms on an H200 against the same code in a loop, which the driver did not unroll.
    inner = "\n".join(f"        {{\n            let p = {p}u;\n"
                      f"{reads('a', a_base, a_row, 'ty', tm, row_groups, a_span, p)}\n"
                      f"{reads('b', b_base, b_row, 'tx', tn, col_groups, b_span, p)}\n{fmas}\n        }}"
                      for p in range(plan.chunk_k))
    if not f16:
        return inner
    return "\n".join([*(f"        var chunk_{g}_{i}_{h} = vec4<f16>();" for g, i, h in sums), inner,
                      *(f"        acc_{g}_{i}_{h} += vec4<f32>(chunk_{g}_{i}_{h});" for g, i, h in sums)])


def _partial_stores(slots: list[tuple[int, int, int]], tm: int, tn: int, checks: Checks, partial: str) -> str:
    """The stores of a tiled kernel whose K is cut into slices: each sum, written out per component, into this
    slice's partial sums (``split_reduce_kernel`` adds the slices up and calls ``store_c``)."""
    stores = []
    for g, i, h in slots:
        row = f"row0 + 4u * (ty + {tm * g}u) + {i}u"
        for j in range(4):
            col = f"col0 + 4u * (tx + {tn * h}u) + {j}u"
            store = f"{partial}[((slice * BATCH + batch_index) * M + {row}) * N + {col}] = acc_{g}_{i}_{h}[{j}];"
            conds = (["live"] if checks.live else []) + ([f"{row} < M"] if checks.rows else []) + (
                [f"{col} < N"] if checks.cols else [])
            stores.append(f"    if ({' && '.join(conds)}) {{ {store} }}" if conds else f"    {{ {store} }}")
    return "\n".join(stores)


def _store_loop(slots: list[tuple[int, int, int]], tm: int, tn: int, checks: Checks, pairs: bool = False) -> str:
    """The tiled kernel's stores: a loop over the thread's accumulators (a switch picks one, with its row and first
    column), then over its 4 columns, so that ``store_c`` is written once. Written out per component, its 64 copies
    in an 8x8 block with a normalisation and residual epilogue made the H200 driver's compile of ResNet-50's
    convolution take 1.3-1.5 s; so, 0.37 s. With ``pairs``, the 4 columns go as 2 pairs to ``store_c2`` (a pair's
    first column is even: the column count is even, so the pair is in range wherever its first column is)."""
    cases = "\n".join(f"            case {s}u: {{ v = acc_{g}_{i}_{h}; row = row0 + 4u * (ty + {tm * g}u) + {i}u; "
                      f"col = col0 + 4u * (tx + {tn * h}u); }}" for s, (g, i, h) in enumerate(slots))
    conds = (["live"] if checks.live else []) + (["row < M"] if checks.rows else []) + (
        ["col + j < N"] if checks.cols else [])
    store = ("store_c2(batch_index, row, col + j, vec2<f32>(v[j], v[j + 1u]));" if pairs
             else "store_c(batch_index, row, col + j, v[j]);")
    guarded = f"if ({' && '.join(conds)}) {{ {store} }}" if conds else store
    return f"""    for (var s = 0u; s < {len(slots)}u; s++) {{
        var v = vec4<f32>();
        var row = 0u;
        var col = 0u;
        switch s {{
{cases}
            default: {{}}
        }}
        for (var j = 0u; j < 4u; {"j += 2u" if pairs else "j++"}) {{
            {guarded}
        }}
    }}"""
