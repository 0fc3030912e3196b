"""Attention planners: which form runs a pass (flash, chunked flash, blocked or per row), how many rows a workgroup
takes, and how many slices the other sequence is cut into; with the constants they weigh and the scratch the slices
need.

The forward runs the per-row kernel cut into slices of the keys for a decode step's few query rows (``row_plan``),
else flash where ``flash_plan`` gives a plan, else chunked flash where ``chunked_plan`` does (long query sequences),
else the blocked form where ``block_plan`` does, else the per-row kernel unsliced (``forward_plan``); the
gradient passes blocked or per row. A pass cut into slices (``splits`` above 1) writes per-slice partial results to
scratch laid out as ``partial_layout`` says; a second dispatch (``merge``) merges them. Over a symbolic length
(a dynamic graph's KV cache) a run launches and merges only the slices that hold rows (``live_slices``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..sizes import ceil_div, is_size, size_min
from ..wgsl import SPLIT_TARGET_WORKGROUPS

# ---------------------------------------------------------------------------------------------- blocked passes
BLOCK_ROWS = (64, 32, 16)  # rows per workgroup: the largest that still gives BLOCK_MIN_WORKGROUPS
BLOCK_MIN_WORKGROUPS = 128  # fewer row blocks than this take smaller blocks (down to BLOCK_ROWS[-1]) for more
BLOCK_TILES = (32, 16, 8, 4)  # rows of the other sequence per tile, the largest that fits the workgroup storage
BLOCK_MAX_VEC4 = 40  # per-thread vec4 registers of row state (d/4 + dv/4, so d + dv <= 160)
# A long other sequence over too few blocks (Whisper's 1500 frames: 144 blocks) is cut into slices until the pass
# has SPLIT_TARGET_WORKGROUPS workgroups, each slice at least SPLIT_MIN_TILES tiles long.
SPLIT_MIN_TILES = 2
SPLIT_MAX = 16  # slices at most: each adds a row of partial results per output row to the scratch and the merge

# ---------------------------------------------------------------------------------------------- flash forward
FLASH_MAX_HEAD = 64  # query/key and value head sizes up to this take the flash forward (its tiles then fit 48 KiB)
FLASH_ROWS = (64, 32)  # query rows per workgroup: 64 where that gives FLASH_MIN_BLOCKS blocks and fits, else 32
FLASH_MIN_BLOCKS = 128  # fewer query blocks than this take 32 rows, and short key slices (SPLIT_MIN_TILES)
FLASH_KEYS = 32  # keys per tile
FLASH_KEY_GROUPS = FLASH_KEYS // 4  # threads across a tile's keys (4 keys each); as many across value columns
# Keys are cut into slices (merged by a second dispatch): slices of at least SPLIT_MIN_TILES tiles while there are
# fewer than FLASH_MIN_BLOCKS workgroups, then slices of at least FLASH_SLICE_MIN_TILES up to FLASH_TARGET_WORKGROUPS.
# Where the workgroups fill the GPU, a short slice does not pay back its query staging, partial stores and the merge
# pass (about 5 us). H200, GPU us, with slices of 2 tiles against 8 past 128 workgroups: SD U-Net's attention in the
# benchmark (2 x 16 heads, 256 x 256, d 8) 22.0 -> 17.2, the same shape with 8 heads of d 40 37.6 -> 27.3;
# Whisper-tiny's 1500 keys keep their 4 slices (192 us). SmolLM2's (9 heads, causal, 128 keys: 36 workgroups) needs
# its short slices: 19.1 against 19.4 unsliced; in its model, where rotary embeddings make the loads dearer, 4.89
# against 4.99 ms of GPU time per call.
FLASH_TARGET_WORKGROUPS = 512
FLASH_SLICE_MIN_TILES = 8


# ---------------------------------------------------------------------------------------------- chunked flash forward
# The flash forward's register tiles (4 rows x 4 keys of scores, 4 rows x vec4 columns of output a thread) over
# chunks of the head size: for long query sequences where the flash forward's resident query block does not fit the
# workgroup storage (WebGPU's default 16 KiB) or its head size limit, in place of the blocked (one row per thread)
# and per-row kernels.
CHUNKED_MAX_HEAD = 128  # head sizes up to this (a thread's output registers: 4 rows x dv / 8 floats)
CHUNKED_MIN_ROWS = 64  # query rows per (batch, head) at least (a full block of rows); fewer keep the blocked forward
CHUNKED_MIN_KEYS = 64  # keys at least (a symbolic length counts as long)
CHUNKED_ROWS = (64, 32)  # query rows per workgroup, as in the flash forward
CHUNKED_V_CHUNKS = (FLASH_KEYS, 16, 8, 4)  # keys per value chunk, the largest that fits
# Barriers are what the chunks cost: a plan is scored by barriers per key tile per query row (two per head-size
# chunk and per value chunk, one for the rows' max), the fewest first.
CHUNKED_SOFTMAX_BARRIERS = 1


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    kv_heads: int
    lq: int
    lk: int
    d: int  # query/key head size
    dv: int  # value head size
    scale: float
    causal: bool
    has_bias: bool


@dataclass(frozen=True)
class BlockPlan:
    rows: int  # rows of the pass (query rows; key rows for grad_kv) per workgroup, one per thread
    tile: int  # rows of the other sequence per tile staged in workgroup memory
    splits: int = 1  # slices of the other sequence, each a workgroup of its own (merged by a second dispatch)
    chunk: int = 0  # rows of the other sequence per slice, a multiple of ``tile`` (with splits > 1)


@dataclass(frozen=True)
class FlashPlan:
    rows: int  # query rows per workgroup, 4 per thread across rows
    splits: int = 1  # slices of the keys, each a workgroup of its own (merged by a second dispatch)
    chunk: int = 0  # keys per slice, a multiple of FLASH_KEYS (with splits > 1)


@dataclass(frozen=True)
class ChunkedPlan:
    rows: int  # query rows per workgroup, 4 per thread across rows
    d_chunk: int  # vec4 columns of the query and key rows staged per chunk (a divisor of the row's vec4 count)
    v_chunk: int  # keys of a value tile staged per chunk (a divisor of FLASH_KEYS)
    splits: int = 1  # slices of the keys, each a workgroup of its own (merged by a second dispatch)
    chunk: int = 0  # keys per slice, a multiple of FLASH_KEYS (with splits > 1)


def forward_plan(shape: AttentionShape, limits: dict) -> RowPlan | FlashPlan | ChunkedPlan | BlockPlan | None:
    """The forward's form: one workgroup per query row for a decode step's few rows (``row_plan``), else the flash
    forward where it fits, the chunked one for long query sequences, else the blocked one (None: the per-row kernel,
    unsliced)."""
    return (row_plan(shape) or flash_plan(shape, limits) or chunked_plan(shape, limits)
            or block_plan(shape, "forward", limits))


# ---------------------------------------------------------------------------------------------- per-row forward
# A forward of at most this many query rows per head (a decode step's one, a few speculative tokens) runs one
# workgroup per query row with its keys across the threads (the per-row kernel), cut into slices of the keys, where
# the flash and blocked forms give a workgroup a tile of 16-32 rows, all but these few idle. H200, SmolLM2's decode
# (9 heads, one row each, a 256-position cache; ``bench.decode_profile``, one process), GPU us a token over 30
# layers: per row 454.6 (f32) and 500.5 (bf16) against flash's 572.1 and 599.7 at the adapter's limits. (Before the
# per-row kernel read its key and value rows in groups, H100: flash 360, per row 559-562.)
ROW_FORWARD_MAX_ROWS = 4
ROW_THREADS = 64  # threads of a per-row workgroup, and keys per tile
# Slices of the per-row forward at most: one tile each up to a 4,096-key cache (flash-decoding), where the forward's
# time is one tile's chain of reads and barriers whatever the position. H100, SmolLM2's f32 portable bundle over a
# 2,048-position cache in slices of two tiles (SPLIT_MAX): 474 tokens/s up to position 64, 302 past it.
ROW_SPLIT_MAX = 64


@dataclass(frozen=True)
class RowPlan:
    splits: int = 1  # slices of the keys, each a workgroup of its own (merged by a second dispatch)
    chunk: int = 0  # keys per slice, a multiple of ROW_THREADS (with splits > 1)


def row_plan(s: AttentionShape) -> RowPlan | None:
    """The per-row forward's slices, for at most ROW_FORWARD_MAX_ROWS query rows per head of a concrete count (None
    otherwise): slices of at least one tile until the rows' workgroups reach SPLIT_TARGET_WORKGROUPS. A symbolic key
    count (a dynamic graph's KV cache) takes as many slices as the rows alone allow, of which a run launches only
    those that hold keys (``live_slices``)."""
    if is_size(s.batch) or is_size(s.lq) or s.lq > ROW_FORWARD_MAX_ROWS:
        return None
    tiles = ceil_div(s.lk, ROW_THREADS)
    splits = _splits(s.batch * s.heads * s.lq, tiles, SPLIT_TARGET_WORKGROUPS, 1, ROW_SPLIT_MAX)
    return RowPlan(splits, ceil_div(tiles, splits) * ROW_THREADS if splits > 1 else 0)


def pass_plan(shape: AttentionShape, kind: str, limits: dict) -> RowPlan | FlashPlan | ChunkedPlan | BlockPlan | None:
    """The plan of pass ``kind`` (None: the per-row kernel, unsliced)."""
    return forward_plan(shape, limits) if kind == "forward" else block_plan(shape, kind, limits)


def attention_splits(shape: AttentionShape, kind: str, limits: dict) -> int:
    """How many slices of the other sequence pass ``kind`` is cut into (1: not cut). The slices' partial results
    go to scratch of ``partial_floats`` floats, and a second dispatch merges them."""
    plan = pass_plan(shape, kind, limits)
    return 1 if plan is None else plan.splits


def attention_live_slices(shape: AttentionShape, kind: str, limits: dict):
    """How many of pass ``kind``'s slices a run launches and its merge reads (``live_slices``; 1: not cut)."""
    plan = pass_plan(shape, kind, limits)
    return 1 if plan is None else live_slices(shape, kind, plan)


def live_slices(s: AttentionShape, kind: str, plan: RowPlan | FlashPlan | ChunkedPlan | BlockPlan):
    """How many of ``plan``'s slices of pass ``kind`` a run launches, and its merge reads: every one where the other
    sequence is concrete (the plan cuts it into slices that all hold rows); where it is symbolic (a KV cache's
    length, whose plan takes the most slices the rows allow), a size: its tiles, at most the slices. Each slice then
    holds a tile while the tiles are fewer than the slices (the slices past them, empty, are left out: a decode
    step's keys in a 64-slice plan at 1-2 tiles), and all run once they are not."""
    other = s.lq if kind == "grad_kv" else s.lk
    if plan.splits == 1 or not is_size(other):
        return plan.splits
    tile = plan.tile if isinstance(plan, BlockPlan) else ROW_THREADS if isinstance(plan, RowPlan) else FLASH_KEYS
    return size_min(plan.splits, ceil_div(other, tile))


def partial_floats(shape: AttentionShape, kind: str, splits: int) -> int:
    """Floats of scratch that ``splits`` slices of pass ``kind`` write: per slice and row, the unnormalised
    output with its running max and sum (forward), dQ (grad_q), or dK and dV (grad_kv)."""
    rows, width = partial_layout(shape, kind)
    return splits * rows * width


def partial_layout(s: AttentionShape, kind: str) -> tuple[int, int]:
    """Rows of a pass's output and floats per row in one slice of its scratch."""
    if kind == "forward":
        return s.batch * s.heads * s.lq, s.dv + 2
    if kind == "grad_q":
        return s.batch * s.heads * s.lq, s.d
    return s.batch * s.kv_heads * s.lk, s.d + s.dv


# ---------------------------------------------------------------------------------------------- blocked passes
def _block_shared_bytes(kind: str, plan: BlockPlan, d4: int, dv4: int) -> int:
    if kind == "forward":  # key and value tiles, each thread's scores of a tile
        return 16 * plan.tile * (d4 + dv4) + 4 * plan.rows * (plan.tile + 1)
    if kind == "grad_q":  # key and value tiles, each thread's query row
        return 16 * plan.tile * (d4 + dv4) + 16 * plan.rows * (d4 + 1)
    # grad_kv: query, output-gradient, lse and delta tiles, each thread's key and value rows
    return 16 * plan.tile * (d4 + dv4) + 8 * plan.tile + 16 * plan.rows * (d4 + dv4 + 2)


def block_plan(s: AttentionShape, kind: str, limits: dict) -> BlockPlan | None:
    """Rows per workgroup and tile length of a blocked pass, or None where the per-row kernel is the one to use:
    head sizes whose per-thread registers would not fit, or workgroup storage too small for the smallest tile."""
    d4, dv4 = -(-s.d // 4), -(-s.dv // 4)
    if d4 + dv4 > BLOCK_MAX_VEC4:
        return None
    heads = s.kv_heads if kind == "grad_kv" else s.heads
    length, other = (s.lk, s.lq) if kind == "grad_kv" else (s.lq, s.lk)
    rows = BLOCK_ROWS[0]
    while (rows > BLOCK_ROWS[-1] and not is_size(s.batch * length)
           and s.batch * heads * -(-length // rows) < BLOCK_MIN_WORKGROUPS):
        rows //= 2
    rows = min(rows, limits.get("max-compute-invocations-per-workgroup", 256),
               limits.get("max-compute-workgroup-size-x", 256))
    storage = limits.get("max-compute-workgroup-storage-size", 16384)
    longest = other if is_size(other) else max(4, 1 << max(0, other - 1).bit_length())  # (symbolic: any length)
    fits = [BlockPlan(r, tile if is_size(longest) else min(tile, longest))
            for r in BLOCK_ROWS if r <= rows for tile in BLOCK_TILES]  # fewer rows, then shorter tiles
    plan = next((p for p in fits if _block_shared_bytes(kind, p, d4, dv4) <= storage), None)
    if plan is None:
        return None
    blocks = s.batch * heads * ceil_div(length, plan.rows)
    tiles = ceil_div(other, plan.tile)
    splits = _splits(blocks, tiles, SPLIT_TARGET_WORKGROUPS, SPLIT_MIN_TILES)
    return BlockPlan(plan.rows, plan.tile, splits, ceil_div(tiles, splits) * plan.tile if splits > 1 else 0)


def _splits(blocks, tiles, target: int, min_tiles: int, most: int = SPLIT_MAX) -> int:
    """Slices of the other sequence (a power of two up to ``most``) until ``blocks`` workgroups become ``target``,
    each slice keeping ``min_tiles`` tiles. None where the blocks are symbolic (many rows); where only the tiles are
    (a KV cache's length), as many as the blocks alone allow, whatever the length: one kernel for every length
    (a run launches and merges only the slices that hold rows at its length: ``live_slices``)."""
    if is_size(blocks):
        return 1
    splits = 1
    while (blocks * splits < target and splits * 2 <= most
           and (is_size(tiles) or tiles // (splits * 2) >= min_tiles)):
        splits *= 2
    return splits


# ---------------------------------------------------------------------------------------------- flash forward
def flash_forward_fits(d: int, dv: int) -> bool:
    """Whether head sizes ``d`` (query/key) and ``dv`` (value) take the flash forward (where the adapter's
    workgroup storage holds its tiles; otherwise the blocked one runs, as in portable bundles generated for
    WebGPU's 16 KiB: on an H200 about as fast as the unfused form for Whisper-tiny, 325 against 320 us a layer)."""
    return d <= FLASH_MAX_HEAD and dv <= FLASH_MAX_HEAD


def flash_sizes(s: AttentionShape) -> tuple[int, int, int]:
    """(vec4 columns of a query/key row, vec4 columns of a value row padded to the column threads, vec4 columns
    per thread)."""
    dv4 = -(-s.dv // 4)
    per_thread = -(-dv4 // FLASH_KEY_GROUPS)
    return -(-s.d // 4), per_thread * FLASH_KEY_GROUPS, per_thread


def flash_shared_bytes(s: AttentionShape, rows: int) -> int:
    """Workgroup storage of ``rows`` query rows: the query and key tiles (rows padded by a vec4), the value tile,
    the probabilities and the row-maximum exchange."""
    d4, dvp4, _ = flash_sizes(s)
    groups = rows // 4
    vec4s = (d4 + 1) * (rows + FLASH_KEYS) + FLASH_KEYS * dvp4 + FLASH_KEYS * (groups + 1)
    return 16 * vec4s + 4 * rows * (FLASH_KEY_GROUPS + 1)


def flash_plan(s: AttentionShape, limits: dict) -> FlashPlan | None:
    """Rows per workgroup and key slices of the flash forward, or None where it does not apply (head sizes above
    FLASH_MAX_HEAD, or workgroup storage or invocations too small for 32 rows)."""
    if not flash_forward_fits(s.d, s.dv):
        return None
    storage = limits.get("max-compute-workgroup-storage-size", 16384)
    invocations = min(limits.get("max-compute-invocations-per-workgroup", 256),
                      limits.get("max-compute-workgroup-size-x", 256))
    fitting = [r for r in FLASH_ROWS
               if flash_shared_bytes(s, r) <= storage and r // 4 * FLASH_KEY_GROUPS <= invocations]
    if not fitting:
        return None
    if is_size(s.batch * s.lq):  # symbolic rows: the largest block that fits, one kernel for every count
        rows = fitting[0]
    else:
        rows = next((r for r in fitting if s.batch * s.heads * -(-s.lq // r) >= FLASH_MIN_BLOCKS), fitting[-1])
    splits, chunk = _key_slices(s, rows)
    return FlashPlan(rows, splits, chunk)


def _key_slices(s: AttentionShape, rows: int) -> tuple[int, int]:
    """(slices, keys per slice) of a flash forward of ``rows`` query rows per workgroup."""
    blocks = s.batch * s.heads * ceil_div(s.lq, rows)
    tiles = ceil_div(s.lk, FLASH_KEYS)
    if is_size(tiles):
        splits = _splits(blocks, tiles, FLASH_TARGET_WORKGROUPS, FLASH_SLICE_MIN_TILES)
    else:
        splits = 1
        while splits * 2 <= SPLIT_MAX and not is_size(blocks) and (
                blocks * splits < FLASH_MIN_BLOCKS and tiles // (splits * 2) >= SPLIT_MIN_TILES
                or blocks * splits < FLASH_TARGET_WORKGROUPS and tiles // (splits * 2) >= FLASH_SLICE_MIN_TILES):
            splits *= 2
    return splits, ceil_div(tiles, splits) * FLASH_KEYS if splits > 1 else 0


# ---------------------------------------------------------------------------------------------- chunked flash forward
def chunked_shared_bytes(s: AttentionShape, rows: int, d_chunk: int, v_chunk: int) -> int:
    """Workgroup storage of the chunked forward: the probabilities, the row exchange, and one staging area that
    holds a chunk of query and key rows (padded by a vec4) or a chunk of value rows."""
    _, dvp4, _ = flash_sizes(s)
    groups = rows // 4
    staging = max((rows + FLASH_KEYS) * (d_chunk + 1), v_chunk * dvp4)
    return 16 * (FLASH_KEYS * (groups + 1) + staging) + 4 * rows * (FLASH_KEY_GROUPS + 1)


def chunked_plan(s: AttentionShape, limits: dict) -> ChunkedPlan | None:
    """Rows per workgroup, chunk sizes and key slices of the chunked forward, or None where it does not apply:
    head sizes above CHUNKED_MAX_HEAD, a short or symbolic query sequence, short keys, or no plan of 32 rows whose
    smallest chunks fit the workgroup storage and invocations. Of the plans that fit, the fewest barriers per key
    tile and query row (then the larger block)."""
    d4, dvp4, _ = flash_sizes(s)
    if (max(s.d, s.dv) > CHUNKED_MAX_HEAD or is_size(s.lq) or s.lq < CHUNKED_MIN_ROWS
            or (not is_size(s.lk) and s.lk < CHUNKED_MIN_KEYS)):
        return None
    storage = limits.get("max-compute-workgroup-storage-size", 16384)
    invocations = min(limits.get("max-compute-invocations-per-workgroup", 256),
                      limits.get("max-compute-workgroup-size-x", 256))
    candidates = []
    for rows in CHUNKED_ROWS:
        if rows // 4 * FLASH_KEY_GROUPS > invocations:
            continue
        d_chunk = next((c for c in range(d4, 0, -1) if d4 % c == 0
                        and chunked_shared_bytes(s, rows, c, CHUNKED_V_CHUNKS[-1]) <= storage), None)
        v_chunk = next((c for c in CHUNKED_V_CHUNKS
                        if d_chunk and chunked_shared_bytes(s, rows, d_chunk, c) <= storage), None)
        if v_chunk is None:
            continue
        barriers = 2 * (d4 // d_chunk) + 2 * (FLASH_KEYS // v_chunk) + CHUNKED_SOFTMAX_BARRIERS
        candidates.append((barriers / rows, -rows, ChunkedPlan(rows, d_chunk, v_chunk)))
    if not candidates:
        return None
    plan = min(candidates)[2]
    splits, chunk = _key_slices(s, plan.rows)
    return ChunkedPlan(plan.rows, plan.d_chunk, plan.v_chunk, splits, chunk)
