"""Per-shape matmul tuning, the kernel side: the problems, their candidate variants and each candidate's passes
(WGSL). ``meganeura.runtime.matmul_tuner`` times them on a device and remembers the fastest.

A problem (``MatmulProblem``) is a GEMM shape (batch, m, n, k) with its operand layouts (``a_fast``, ``b_fast``),
whether f16 products are allowed (precision "fast"), and the kernel's own prelude: its bindings, the loads of its
operands (a convolution's gather, a view's index math) and its store (a fused epilogue), as the plan compiles it.
Its candidates are the generator's own variant (``default_choice``), its plain form (``plain_choice``) and the tile /
register-block shapes of ``CONFIGS`` with K cut into 1-16 slices, minus those that would give too few or too many
workgroups (tiles past 128x128 need MIN_WORKGROUPS_BIG of them unsplit), or partial sums too large for one binding;
where f16 is allowed, also the f16 variants of the 4x4-block shapes (f32 ones stay candidates, so a shape where f16
is slower keeps f32), and of each shape unsplit in f32, its double-buffered variant where two chunks fit the
workgroup storage limit (for tiles of TIGHT_DOUBLE_MIN_TILE outputs whose two padded chunks do not fit: two unpadded
ones, and two of a smaller chunk, where those fit).
Tiles of VECTOR_MIN_TILE outputs or more add, per split up to VECTOR_MAX_SPLIT, a variant with quad staging and
thread patches, and its double-buffered one unsplit (``meganeura.kernels.matmul``'s module docstring says what each
does).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from .matmul import matmul_kernel
from .matmul_common import _max_threads
from .matmul_plans import (F16_PRODUCTS, K_CHUNKS, MIN_WORKGROUPS_BIG, MatmulChoice, _choose_tiled_plan,
                           default_choice, plain_choice)
from .matmul_split_sum import split_reduce_kernel

# (tile, register block) shapes tried: H200 sweeps of the five workloads' GEMMs found each of these the
# fastest for some shape, and none of the others. 128x256: 4096^3 3.53 -> 3.17 ms, 2048^3 452 -> 418 us. Tuned
# beside it on the H200, 8x8 blocks of 64x64 and 64x128 tiles and 8x16 blocks of 128x128 tiles won none of 112
# problems (ResNet-50, SmolLM2, SmolVLA, part of SD U-Net, the micro benchmarks) and only lengthened tuning.
# 64x96 (384 threads, 24 across the 96): Whisper-tiny's 1500x1536x384 79 -> 70 us, 1500x384x1536 80 -> 74 us. Nine
# other shapes with a 96 or 192 edge (96x128, 128x96, 96x96, 96x64, 192x128, 128x192, 96x192; 4x4 to 8x8 blocks)
# won none of 12 problems besides those two.
CONFIGS = (((64, 64), (4, 4)), ((64, 64), (8, 4)), ((64, 64), (4, 8)), ((64, 128), (4, 4)), ((128, 64), (4, 4)),
           ((128, 128), (8, 8)), ((32, 64), (4, 4)), ((64, 32), (4, 4)), ((128, 256), (8, 16)), ((64, 96), (4, 4)))
SPLITS = (1, 2, 4, 8, 16)
# Tiles of at least this many outputs also get a candidate with quad staging and thread patches (each split up to
# VECTOR_MAX_SPLIT, and double-buffered unsplit): where the products dominate, fewer staging instructions and shared
# reads may tell; below, the tile's loads are few either way and the candidates would only lengthen tuning.
VECTOR_MIN_TILE = 64 * 64
VECTOR_MAX_SPLIT = 4  # and only up to this many K slices: past it a slice's products are too few to tell
# Tiles of at least this many outputs whose chunk does not fit twice in the workgroup storage get double-buffered
# candidates that do: unpadded (128x256 at 48 KiB: two chunks of 16 in exactly 48 KiB; 128x128 at WebGPU's 16 KiB:
# two of 8 in 16 KiB) and at a smaller chunk (128x256 at 48 KiB: two of 8 in 25 KiB), one barrier a chunk against the
# single buffer's two. The big square GEMMs' tiles (issue 51); below, the rule's chunk fits twice from 32 KiB on.
TIGHT_DOUBLE_MIN_TILE = 128 * 128
MIN_DOUBLE_CHUNK = 8  # K steps between barriers at least: fewer, and a barrier a chunk costs more than it saves
MIN_SLICE_K = 32  # each K slice at least this long
MAX_WORKGROUPS = 4096  # more would only add partial sums to add up


@dataclass(frozen=True)
class MatmulProblem:
    """A tiled GEMM to tune: shape, operand layouts, whether f16 products are allowed, and the kernel's prelude
    with the byte size of each of its bindings before the one it declares as ``partial`` (an f32 array: the split
    variants' partial sums) and of each after it (``aliases``)."""
    batch: int
    m: int
    n: int
    k: int
    a_fast: str
    b_fast: str
    f16: bool
    prelude: str
    bindings: tuple[int, ...]
    partial: str
    looped: str = ""  # matmul_kernel's ``looped``: an operand fetched in a loop
    vector_loads: str = ""  # matmul_kernel's ``vector_loads`` (quad-staged variants): operands read as vec4s
    aliases: tuple[int, ...] = ()  # bytes of the bindings after ``partial`` (vec4 bindings of those operands)
    pairs: bool = False  # matmul_kernel's ``pairs``: the prelude stores pairs of columns (``store_c2``)

    def key(self) -> str:
        digest = hashlib.sha256(self.prelude.encode()).hexdigest()[:12]
        return (f"{self.batch}x{self.m}x{self.n}x{self.k}:{self.a_fast}{self.b_fast}" + (":f16" if self.f16 else "")
                + (f":looped-{self.looped}" if self.looped else "") + f":{digest}")


def plain_problem(batch: int, m: int, n: int, k: int, a_fast: str = "p", b_fast: str = "j",
                  f16: bool = False) -> MatmulProblem:
    """A problem over plain arrays a, b, c laid out as ``a_fast`` and ``b_fast`` say (no gather, no epilogue)."""
    a_index = f"(bi * {m}u + i) * {k}u + p" if a_fast == "p" else f"(bi * {k}u + p) * {m}u + i"
    b_index = f"(bi * {n}u + j) * {k}u + p" if b_fast == "p" else f"(bi * {k}u + p) * {n}u + j"
    prelude = f"""
@group(0) @binding(0) var<storage, read_write> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<storage, read_write> partial: array<f32>;
fn load_a(bi: u32, i: u32, p: u32) -> f32 {{ return a[{a_index}]; }}
fn load_b(bi: u32, p: u32, j: u32) -> f32 {{ return b[{b_index}]; }}
fn store_c(bi: u32, i: u32, j: u32, acc: f32) {{ c[(bi * {m}u + i) * {n}u + j] = acc; }}
"""
    return MatmulProblem(batch, m, n, k, a_fast, b_fast, f16, prelude,
                         (4 * batch * m * k, 4 * batch * k * n, 4 * batch * m * n), "partial")


def variants(p: MatmulProblem, limits: dict, max_binding: int) -> tuple[list[MatmulChoice], list[list[tuple]]]:
    """The candidates of a problem for a device of ``limits`` whose bindings hold at most ``max_binding`` bytes, and
    each one's passes, (WGSL, workgroups) each; only the default, with no passes, where the problem is not timed
    (its own buffers or its default's partial sums too large for a binding, or K empty)."""
    limits = dict(limits, **{F16_PRODUCTS: 1}) if p.f16 else limits
    choices = candidates(p.batch, p.m, p.n, p.k, limits)
    if max((*p.bindings, partial_bytes(p, choices[:1]))) > max_binding or p.k == 0:
        return choices[:1], []
    choices = [c for c in choices if partial_bytes(p, [c]) <= max_binding]  # split too far for one binding
    shape = dict(batch=p.batch, m=p.m, n=p.n)
    passes = []
    for c in choices:
        passes.append([matmul_kernel(p.prelude, **shape, k=p.k, limits=limits, a_fast=p.a_fast, b_fast=p.b_fast,
                                     tile=c.tile, block=c.block, split=c.split,
                                     partial=p.partial if c.split > 1 else None, f16=c.f16, looped=p.looped,
                                     double=c.double, quads=c.quads, patches=c.patches, chunk=c.chunk,
                                     unpadded=c.unpadded,
                                     vector_loads=p.vector_loads, pairs=p.pairs)])
        if c.split > 1:
            passes[-1].append(split_reduce_kernel(p.prelude, **shape, split=c.split, partial=p.partial, limits=limits,
                                                  pairs=p.pairs))
    return choices, passes


def candidates(batch: int, m: int, n: int, k: int, limits: dict) -> list[MatmulChoice]:
    """The default variant first, then its plain form (``plain_choice``) where that differs, then the distinct
    variants of CONFIGS x SPLITS that suit the problem (with f16 products too for 4x4 blocks, where ``limits`` allow
    them)."""
    shared, threads = limits["max-compute-workgroup-storage-size"], _max_threads(limits)
    found, seen = [], set()
    for choice in (default_choice(batch, m, n, k, limits), plain_choice(batch, m, n, k, limits)):
        plan = _choose_tiled_plan(batch, m, n, k, shared, threads, choice.tile, choice.block, choice.double,
                                  choice.quads, choice.patches, choice.chunk, choice.unpadded)
        key = (plan, choice.split, choice.f16)
        if key not in seen:
            seen.add(key)
            found.append(choice)
    modes = (False, True) if limits.get(F16_PRODUCTS) else (False,)
    for tile, block in CONFIGS:
        if (tile[0] > 2 * m and tile[0] > 32) or (tile[1] > 2 * n and tile[1] > 32):
            continue  # mostly padding
        plan = _choose_tiled_plan(batch, m, n, k, shared, threads, tile, block)
        tiles = batch * -(-m // plan.tile_m) * -(-n // plan.tile_n)
        if plan.tile_m * plan.tile_n > 128 * 128 and tiles < MIN_WORKGROUPS_BIG:
            continue  # a tile past 128x128 won only where it alone made enough workgroups (2048^3, 4096^3)
        for split in SPLITS:
            if split > 1 and (k // split < MIN_SLICE_K or tiles * split > MAX_WORKGROUPS):
                continue
            for f16 in modes:
                if f16 and (plan.rows_per_thread, plan.cols_per_thread) != (4, 4):
                    continue  # 8-wide blocks do not keep their f16 sums in registers
                if (plan, split, f16) not in seen:
                    seen.add((plan, split, f16))
                    found.append(MatmulChoice(tile, block, split, f16))
            if (plan.tile_m * plan.tile_n >= VECTOR_MIN_TILE and split <= VECTOR_MAX_SPLIT
                    and (wide := _wide(plan, split)) not in seen):
                seen.add(wide)
                found.append(MatmulChoice(tile, block, split, quads=True, patches=True))
        found += _double_buffered((batch, m, n, k), limits, tile, block, plan, seen)
    return found


def _double_buffered(shape: tuple, limits: dict, tile, block, plan, seen: set) -> list[MatmulChoice]:
    """The unsplit double-buffered candidates of a (tile, block) whose rule gives ``plan``: element staged, and quad
    staged with patches where the tile has VECTOR_MIN_TILE outputs, each where two of its chunks fit the workgroup
    storage. For a tile of TIGHT_DOUBLE_MIN_TILE outputs or more where they do not: two chunks of the rule's size
    without the shared rows' pad, and two of the largest smaller chunk that fit, each chunk at least
    MIN_DOUBLE_CHUNK. Those not in ``seen`` (which they join)."""
    shared, threads = limits["max-compute-workgroup-storage-size"], _max_threads(limits)
    outputs = plan.tile_m * plan.tile_n
    found = []
    for quads in (False, True) if outputs >= VECTOR_MIN_TILE else (False,):
        variant = MatmulChoice(tile, block, 1, double=True, quads=quads, patches=quads)
        tries = [[variant]]
        if _doubled_plan(shape, shared, threads, variant).buffers == 1 and outputs >= TIGHT_DOUBLE_MIN_TILE:
            smaller = [c for c in K_CHUNKS if MIN_DOUBLE_CHUNK <= c < plan.chunk_k]
            unpadded = [replace(variant, unpadded=True)] if plan.chunk_k >= MIN_DOUBLE_CHUNK else []
            tries = [unpadded, [replace(variant, chunk=c) for c in smaller]]
        for options in tries:  # the first of each list of options that fits
            for choice in options:
                doubled = _doubled_plan(shape, shared, threads, choice)
                if doubled.buffers == 2:
                    if (doubled, 1, False) not in seen:
                        seen.add((doubled, 1, False))
                        found.append(choice)
                    break
    return found


def _doubled_plan(shape: tuple, shared: int, threads: int, choice: MatmulChoice):
    """The plan of a double-buffered ``choice`` (one buffer where two do not fit)."""
    return _choose_tiled_plan(*shape, shared, threads, choice.tile, choice.block, double=True, quads=choice.quads,
                              patches=choice.patches, chunk=choice.chunk, unpadded=choice.unpadded)


def _wide(plan, split: int) -> tuple:
    """The seen-key of ``plan`` staged in quads with thread patches (where they fit its thread grid)."""
    return replace(plan, quads=True, patches=plan.patches_fit()), split, False


def partial_bytes(problem: MatmulProblem, choices: list[MatmulChoice]) -> int:
    """Bytes of the partial sums of the candidate with the most K slices."""
    return 4 * max(c.split for c in choices) * problem.batch * problem.m * problem.n
