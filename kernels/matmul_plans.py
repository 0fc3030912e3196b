"""Matmul plans: which variant a GEMM takes by default (``default_choice``, with the rules and the measurements
behind them), a variant's description (``MatmulChoice``), K slices (``split_k``), and the tiled kernel's plan: tile,
K chunk, register block, buffers and staging (``TiledPlan``, ``_choose_tiled_plan``). ``matmul`` generates the
kernels from them; ``matmul_tuning`` lists the other candidates."""

from dataclasses import dataclass, replace

from .matmul_common import SYMBOLIC_CHOICE, _max_threads, _pow2_ceil
from .matmul_staging import SHARED_PAD_VEC4
from .sizes import is_size, upper
from .wgsl import SPLIT_TARGET_WORKGROUPS

TILE_SIZES = (128, 64, 32, 16)  # output tile edge candidates, largest first
K_CHUNKS = (16, 8, 4)         # K chunk candidates staged per barrier, largest first
# The largest chunk whose staging (each thread's share of the A and B chunks, held in registers while the products
# run) stays within this many floats. H200 (a sweep, GPU time): 4096^3 with 128x128 tiles of 8x16 blocks (128
# threads) 3.56 ms at chunk 16 (32 floats) against 3.29 at chunk 8 (16); 128x256 tiles (256 threads) 3.17 ms at
# chunk 16 (24 floats) against 3.34 at chunk 8.
MAX_STAGED_PER_THREAD = 24
# Tile choice, from timings on an H200 (bench/results/h200-matmul-tiles.json): a 128 edge pays off from 128
# workgroups on; below, 64x64-class tiles win down to about 32 workgroups; smaller problems shrink further.
BIG_TILE_EDGE = 64
# Split K until the workgroups reach SPLIT_TARGET_WORKGROUPS, while every slice keeps SPLIT_MIN_K of K. H200, the
# workloads' projections (a sweep, GPU time): 50x720 @ 720x2048 43.5 -> 27.6 us (split 2 -> 8), 128x1536 @
# 1536x576 48.6 -> 37.4, 1500x1536 @ 1536x384 196 -> 122 (split 1 -> 4); splits past ~1,000 workgroups gain nothing.
SPLIT_MIN_K = 64
SPLIT_MAX = 64
# The least K that split_k cuts: below it a small output gets its workgroups from smaller tiles instead, in one pass.
# A split adds a dispatch (its slices' sum), and a dispatch costs what a short K saves: about 4 us of GPU time in a
# dependent chain on an H100 (500 small dispatches in 2.06 ms) and 8-9 us of host time there to record and submit,
# which is what bounds the training steps on that machine (the loop's and the resident step's wall = CPU). A K under
# 512 is at most 32 chunks of 16 per tile. Full-size training steps (null device, lavapipe's limits): SD U-Net
# 1034 -> 894 dispatches, SmolLM2 1831 -> 1561, ResNet-50 562 -> 524 (bench/results/null-dispatches-s16.json). Not
# yet timed on a GPU.
SPLIT_FROM_K = 512
MIN_WORKGROUPS_BIG = 128      # a tile with a 128 edge needs at least this many workgroups
MIN_WORKGROUPS = 32           # shrink any tile until a problem gets at least this many workgroups
# The default for large outputs of whole tiles where the adapter's limits allow it (``wide_tile_suits``): 128x256
# tiles of 8x16 blocks (256 threads), unsplit. H200 (a sweep, GPU time) against the rule's 128x128 tiles of 8x8:
# 4096^3 3.53 -> 3.17 ms, 2048^3 452 -> 418 us (the tuner's candidate since); at K chunk 8 (a 16 KiB storage limit)
# 4096^3 took 3.34, so the default asks for the storage of a chunk of 16 (24.5 KiB), which desktop GPUs give (NVIDIA
# 48 KiB, AMD and Intel 64, Apple 32) and WebGPU's default limit (16 KiB) does not: there the rule's tile stays.
WIDE_TILE, WIDE_BLOCK = (128, 256), (8, 16)
# Where two of its chunks of 16 fit the workgroup storage unpadded (48 KiB: NVIDIA's limit), the wide tile's default
# is double-buffered, quad staged, in thread patches and unpadded (``wide_choice``). H100 against cuBLAS f32 (TF32
# off; bench/results/h100-sgemm-candidates-s12.md, GPU time): 4096^3 3175 -> 2855 us (0.86 -> 0.96 x cuBLAS), 2048^3
# 432 -> 381 us (0.81 -> 0.92 x); each part alone lost or barely gained (quad staging and patches single-buffered 3276
# and 429 us, double-buffered unpadded with element staging 3222 and 444). Padded, two chunks would take 49 KiB: an
# adapter of 64 KiB could hold them, but the unpadded variant is the one measured, so it is taken there too.
# An output of whole QUAD_TILE tiles, QUAD_TILE_MIN_WORKGROUPS of them or more, whose K (QUAD_TILE_MIN_K or more)
# is no longer than either output edge, gets 64x64 tiles of 8x4 blocks, quad staged in thread patches, unsplit,
# where the rule would cut K into slices (``quad_tile_suits``). H100 (the same run), 1024^3: the rule's 64x128 tiles
# of 4x8 blocks in 8 K slices took 102 us (0.67 x cuBLAS), this variant 68 us (1.02 x); the same tile split in 2 and
# 4 took 72 and 74 us. Of the run's 40 single-buffered (tile, block, staging) groups whose tile alone made 128
# workgroups or more, every split variant lost to the unsplit one in 34; the others were the 64x96 tile (ragged at
# these sizes) and the quad-staged 128x128 one at 2048 and 4096. The split rule's own figures (SPLIT_MIN_K) are all
# shapes whose K is longer than an output edge, which this rule leaves to it, as it does shapes of K under 1024 and
# ragged outputs (Whisper's 1500x1536 @ 1536x384, ResNet-50's 3136x128 @ 128x512): no figure for them.
QUAD_TILE, QUAD_BLOCK = (64, 64), (8, 4)
QUAD_TILE_MIN_WORKGROUPS = 2 * MIN_WORKGROUPS_BIG  # 256: 1024^3's 64x64 tiles, the smallest count measured
QUAD_TILE_MIN_K = 1024  # the shortest K measured (1024^3)
# Thread patches (``TiledPlan.patches``): 32 neighbouring invocations as 4 x 8 thread positions. In a 128x128 tile of
# 8x8 blocks (16x16 threads in strips of 16) a warp's K step reads 4 distinct vec4s of A and 32 of B from shared
# memory; as a 4 x 8 patch, 8 and 16 (24 rather than 36).
PATCH_ROWS, PATCH_COLS = 4, 8
PATCH_THREADS = PATCH_ROWS * PATCH_COLS


@dataclass(frozen=True)
class TiledPlan:
    tile_m: int
    tile_n: int
    chunk_k: int
    rows_per_thread: int  # each thread's register block: rows_per_thread x cols_per_thread outputs (4 or 8 each)
    cols_per_thread: int
    buffers: int = 1  # K chunks held in workgroup memory: 2 for the double-buffered variant
    quads: bool = False  # quad staging: each thread fetches 4 neighbouring elements (``matmul_staging``)
    patches: bool = False  # threads in patches of PATCH_ROWS x PATCH_COLS (see ``patches_fit``)
    padded: bool = True  # shared rows padded (``matmul_staging``); false: two chunks fit where the pad would not

    @property
    def threads_m(self) -> int:
        return self.tile_m // self.rows_per_thread

    @property
    def threads_n(self) -> int:
        return self.tile_n // self.cols_per_thread

    @property
    def threads(self) -> int:
        return self.threads_m * self.threads_n

    def shared_floats(self) -> int:
        pad = 8 * SHARED_PAD_VEC4 if self.padded else 0  # (floats per K step: a vec4 per row of A and of B)
        return self.buffers * self.chunk_k * (self.tile_m + self.tile_n + pad)

    def patches_fit(self) -> bool:
        """Whether the threads can go in patches: each run of PATCH_THREADS neighbouring invocations (a warp on
        NVIDIA, half a wave64 on AMD) takes PATCH_ROWS x PATCH_COLS thread positions rather than a strip of
        ``threads_n``. Any patch width is correct; only which shared-memory reads coincide changes."""
        return self.threads_m % PATCH_ROWS == 0 and self.threads_n % PATCH_COLS == 0

    def sums(self) -> list[tuple[int, int, int]]:
        """Each thread's vec4 sums (g, i, h): thread (tx, ty) owns rows 4 * (ty + threads_m * g) + i and columns
        4 * (tx + threads_n * h) + j."""
        return [(g, i, h) for g in range(self.rows_per_thread // 4) for i in range(4)
                for h in range(self.cols_per_thread // 4)]

    def staged_per_thread(self) -> int:
        """Floats of the next K chunk that each thread holds in registers (its shares of A and B)."""
        return -(-self.chunk_k * self.tile_m // self.threads) + -(-self.chunk_k * self.tile_n // self.threads)


# Not a wgpu limit: set in the limits a plan is compiled for under precision "fast" (see the module docstring)
F16_PRODUCTS = "meganeura-f16-products"


@dataclass(frozen=True)
class MatmulChoice:
    """A tiled matmul's variant: forced tile and register block (None: the generator's rule), K slices, whether
    products are formed in f16 (fast precision only), whether its K chunks are double-buffered (where they fit),
    staged in quads, and its threads laid out in patches (where the thread grid allows); ``chunk`` caps the K chunk
    (0: the rule's) and ``unpadded`` leaves the shared rows unpadded (see ``matmul_kernel``)."""
    tile: tuple[int, int] | None
    block: tuple[int, int] | None
    split: int
    f16: bool = False
    double: bool = False
    quads: bool = False
    patches: bool = False
    chunk: int = 0
    unpadded: bool = False


def wide_tile_suits(batch, m, n, k, limits: dict) -> bool:
    """Whether the default takes WIDE_TILE unsplit: the output is whole wide tiles, at least MIN_WORKGROUPS_BIG of
    them, and the adapter gives the tile its threads and the workgroup storage of a K chunk of 16 (see WIDE_TILE)."""
    if any(map(is_size, (batch, m, n, k))) or not is_tiled(m, n) or m % WIDE_TILE[0] or n % WIDE_TILE[1]:
        return False
    plan = TiledPlan(*WIDE_TILE, K_CHUNKS[0], *WIDE_BLOCK)
    return (batch * (m // plan.tile_m) * (n // plan.tile_n) >= MIN_WORKGROUPS_BIG
            and plan.threads <= _max_threads(limits)
            and plan.shared_floats() * 4 <= limits["max-compute-workgroup-storage-size"])


def wide_choice(batch, m, n, k, limits: dict) -> MatmulChoice:
    """WIDE_TILE's variant where ``wide_tile_suits``: double-buffered, quad staged, in thread patches and unpadded
    where the adapter's workgroup storage holds its two chunks of 16 (48 KiB), else single-buffered and element
    staged (see WIDE_TILE)."""
    plain = MatmulChoice(WIDE_TILE, WIDE_BLOCK, 1)
    fast = replace(plain, double=True, quads=True, patches=True, unpadded=True)
    plan = _choose_tiled_plan(batch, m, n, k, limits["max-compute-workgroup-storage-size"], _max_threads(limits),
                              fast.tile, fast.block, double=True, quads=True, patches=True, unpadded=True)
    return fast if plan.buffers == 2 else plain


def quad_tile_suits(batch, m, n, k, limits: dict) -> bool:
    """Whether the default takes QUAD_TILE's quad-staged variant unsplit: the output is whole QUAD_TILE tiles, at
    least QUAD_TILE_MIN_WORKGROUPS of them, K runs from QUAD_TILE_MIN_K to the shorter output edge, the rule would
    cut K into slices (``split_k``), and the adapter's limits keep the tile (see QUAD_TILE)."""
    if any(map(is_size, (batch, m, n, k))) or not is_tiled(m, n) or m % QUAD_TILE[0] or n % QUAD_TILE[1]:
        return False
    if (not QUAD_TILE_MIN_K <= k <= min(m, n)
            or batch * (m // QUAD_TILE[0]) * (n // QUAD_TILE[1]) < QUAD_TILE_MIN_WORKGROUPS):
        return False
    plan = _choose_tiled_plan(batch, m, n, k, limits["max-compute-workgroup-storage-size"], _max_threads(limits),
                              QUAD_TILE, QUAD_BLOCK, quads=True, patches=True)
    return (plan.tile_m, plan.tile_n) == QUAD_TILE and plan.patches and split_k(batch, m, n, k, limits) > 1


def is_tiled(m: int, n: int) -> bool:
    """Whether an (m, n) output gets the tiled kernel (else the gemv kernel)."""
    return m > 1 and n > 1


def default_choice(batch: int, m: int, n: int, k: int, limits: dict) -> MatmulChoice:
    """The generator's own variant: the wide tile's (``wide_choice``) where ``wide_tile_suits``, QUAD_TILE's quad-
    staged one where ``quad_tile_suits``, else ``plain_choice``'s."""
    if wide_tile_suits(batch, m, n, k, limits):
        return wide_choice(batch, m, n, k, limits)
    if quad_tile_suits(batch, m, n, k, limits):
        return MatmulChoice(QUAD_TILE, QUAD_BLOCK, 1, quads=True, patches=True)
    return plain_choice(batch, m, n, k, limits)


def plain_choice(batch: int, m: int, n: int, k: int, limits: dict) -> MatmulChoice:
    """The default's element-staged, single-buffered form (a tuner candidate beside the default): WIDE_TILE unsplit
    where ``wide_tile_suits``, else the tile by rule and K slices by ``split_k``; f16 products where the limits ask
    for them (``F16_PRODUCTS``) and the tile's register block is 4x4."""
    if wide_tile_suits(batch, m, n, k, limits):
        return MatmulChoice(WIDE_TILE, WIDE_BLOCK, 1)
    split = split_k(batch, m, n, k, limits)
    if not limits.get(F16_PRODUCTS) or not is_tiled(m, n):
        return MatmulChoice(None, None, split)
    plan = _choose_tiled_plan(batch, m, n, k, limits["max-compute-workgroup-storage-size"], _max_threads(limits))
    return MatmulChoice(None, None, split, (plan.rows_per_thread, plan.cols_per_thread) == (4, 4))


def split_k(batch, m, n, k, limits: dict) -> int:
    """Slices to cut K into: 1, or a power of two when the output tiles alone make too few workgroups for a long K
    (a convolution's weight gradient, a narrow projection). The slices' partial sums go through workgroup-owned
    scratch and a second, deterministic reduction pass. Symbolic sizes (a dynamic graph's) count at their bounds,
    the most the plan serves (a token count's weight gradient: slices past the end sum nothing); none where the
    outputs are symbolic (they give the workgroups)."""
    if is_size(m) or is_size(n) or is_size(batch) or not is_tiled(m, n):
        return 1
    k = upper(k)
    if k < SPLIT_FROM_K:
        return 1
    plan = _choose_tiled_plan(batch, m, n, k, limits["max-compute-workgroup-storage-size"], _max_threads(limits))
    workgroups = batch * -(-m // plan.tile_m) * -(-n // plan.tile_n)
    split = 1
    while (workgroups * split * 2 <= SPLIT_TARGET_WORKGROUPS and k // (split * 2) >= SPLIT_MIN_K
           and split * 2 <= SPLIT_MAX):
        split *= 2
    return split


def _tile_edge(size: int) -> int:
    return next((t for t in reversed(TILE_SIZES) if t >= size), TILE_SIZES[0])


def _choose_tiled_plan(batch, m, n, k, shared_limit: int, max_threads: int,
                       tile: tuple[int, int] | None = None, block: tuple[int, int] | None = None,
                       double: bool = False, quads: bool = False, patches: bool = False,
                       chunk: int = 0, unpadded: bool = False) -> TiledPlan:
    """The tile, chunk and register block (see the module docstring), the chunk at most ``chunk`` where that is
    given; with ``double``, two buffers of that chunk where they fit ``shared_limit``; with ``quads``, quad staging;
    with ``patches``, thread patches where they fit the thread grid; with ``unpadded``, shared rows without pad."""
    chosen = replace(_single_tiled_plan(batch, m, n, k, shared_limit, max_threads, tile, block, chunk), quads=quads,
                     padded=not unpadded)
    chosen = replace(chosen, patches=patches and chosen.patches_fit())
    doubled = replace(chosen, buffers=2)
    return doubled if double and doubled.shared_floats() * 4 <= shared_limit else chosen


def _single_tiled_plan(batch, m, n, k, shared_limit: int, max_threads: int, tile: tuple[int, int] | None,
                       block: tuple[int, int] | None, chunk: int = 0) -> TiledPlan:
    # A symbolic size counts as a typical one: the tile and chunk serve every value (SYMBOLIC_CHOICE)
    batch, m, n, k = (SYMBOLIC_CHOICE[name] if is_size(x) else x
                      for name, x in (("batch", batch), ("m", m), ("n", n), ("k", k)))
    tile_m, tile_n = tile or (_tile_edge(m), _tile_edge(n))
    smallest = TILE_SIZES[-1]

    def workgroups(tm: int, tn: int) -> int:
        return batch * -(-m // tm) * -(-n // tn)

    def plan(tm: int, tn: int, chunk: int) -> TiledPlan:
        rows, cols = block or (8 if tm >= 128 else 4, 8 if tn >= 128 else 4)
        return TiledPlan(tm, tn, chunk, min(rows, tm), min(cols, tn))

    if tile is None:
        while max(tile_m, tile_n) > BIG_TILE_EDGE and workgroups(tile_m, tile_n) < MIN_WORKGROUPS_BIG:
            tile_m, tile_n = _halve_larger(tile_m, tile_n)
        while (workgroups(tile_m, tile_n) < MIN_WORKGROUPS and max(tile_m, tile_n) > smallest
               and k < SPLIT_FROM_K):  # a long K gets its workgroups from split_k instead
            tile_m, tile_n = _halve_larger(tile_m, tile_n)
    while plan(tile_m, tile_n, K_CHUNKS[-1]).threads > max_threads:
        tile_m, tile_n = _halve_larger(tile_m, tile_n)
    chunk_cap = max(K_CHUNKS[-1], _pow2_ceil(k))  # (with a split K, slices are whole chunks of this size)
    chunks = [c for c in K_CHUNKS if not chunk or c <= chunk] or K_CHUNKS[-1:]
    while True:
        fitting = [chosen for chosen in (plan(tile_m, tile_n, min(c, chunk_cap)) for c in chunks)
                   if chosen.shared_floats() * 4 <= shared_limit]
        if fitting:
            return next((p for p in fitting if p.staged_per_thread() <= MAX_STAGED_PER_THREAD), fitting[-1])
        if max(tile_m, tile_n) == smallest:
            raise ValueError(f"matmul_kernel: workgroup storage limit {shared_limit} B is too small")
        tile_m, tile_n = _halve_larger(tile_m, tile_n)


def _halve_larger(tile_m: int, tile_n: int) -> tuple[int, int]:
    return (tile_m // 2, tile_n) if tile_m >= tile_n else (tile_m, tile_n // 2)
