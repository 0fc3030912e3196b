"""Per-shape matmul tuning: time variants of each tiled GEMM problem on the device and keep the fastest,
remembered per adapter in a JSON file.

A problem (``MatmulProblem``) is a GEMM shape (batch, m, n, k) with its operand layouts (``a_fast``, ``b_fast``),
whether f16 products are allowed (precision "fast"), and the kernel's own prelude: its bindings, the loads of its
operands (a convolution's gather, a view's index math) and its store (a fused epilogue), as the plan compiles it.
Its candidates are the generator's own variant (``default_choice``) and the tile / register-block shapes of
``CONFIGS`` with K cut into 1-16 slices, minus those that would give too few or too many workgroups (tiles past
128x128 need MIN_WORKGROUPS_BIG of them unsplit), or partial sums too large for one binding; where f16 is allowed,
also the f16 variants of the 4x4-block shapes (f32 ones stay candidates, so a shape where f16 is slower keeps f32).
Each is timed with that prelude on scratch buffers of the bindings' sizes, zero-filled (so that an index read from
data stays in range), with ``meganeura.runtime.timing``. The gather can cost as much as the products: on an H200,
ResNet-50's 3x3 convolution 4x256x196x2304 took about 87 us in its plan against 47 us as a GEMM of plain arrays, and
variants timed on plain arrays misjudged it (939f8fd: 4x128x784x1152 tuned 0.45 ms a call against 0.34 ms for the
default). The default stays unless a candidate beats it by ``MIN_GAIN``. A plan's new problems are tuned together:
all their candidates' pipelines compiled in one batch (side by side), then timed problem by problem. A problem whose
own buffers (or its default's partial sums) would not fit the device's binding limit keeps the default untimed.

The file is ``matmul-tuning-<digest>.json`` in the directory the caller gives (None: remembered for the process
only), the digest over the adapter and what the timings depend on besides it (``timed_kernels``: the sources of the
matmul generator and of the timing, and whether kernels keep naga's runtime checks). It records both, and per
problem (keyed by its shape, layouts and a digest of its prelude) the choice and the two times; a file that does not
parse or names another adapter or other kernels is ignored and rewritten, so a changed generator is tuned afresh. A
directory that cannot be written only loses the memory.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from meganeura.runtime import timing
from meganeura.runtime.device import SHADER_CHECKS_ENV
from meganeura.runtime.timing import WARMUP_SECONDS, time_sequences

from . import matmul as matmul_generator
from .matmul import (F16_PRODUCTS, MIN_WORKGROUPS_BIG, SPLIT_MAX, TILE_SIZES, MatmulChoice, _choose_tiled_plan,
                     _max_threads, default_choice, matmul_kernel, split_reduce_kernel)

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
MIN_SLICE_K = 32  # each K slice at least this long
MAX_WORKGROUPS = 4096  # more would only add partial sums to add up
MIN_GAIN = 0.05  # a candidate replaces the default when at least this much faster
FILE_VERSION = 2  # 2: problems keyed by their prelude too


@dataclass(frozen=True)
class MatmulProblem:
    """A tiled GEMM to tune: shape, operand layouts, whether f16 products are allowed, and the kernel's prelude
    with the byte size of each of its bindings but the last, which the prelude declares as ``partial`` (an f32
    array): the split variants' partial sums."""
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


def timed_kernels() -> str:
    """A digest of what tuned timings depend on besides the adapter: the source of the matmul generator, of this
    module and of the timing, and whether kernels compile with naga's runtime checks (``MEGANEURA_SHADER_CHECKS``)."""
    digest = hashlib.sha256()
    for source in (matmul_generator.__file__, __file__, timing.__file__):
        digest.update(Path(source).read_bytes())
    digest.update(f"checks={os.environ.get(SHADER_CHECKS_ENV) == '1'}".encode())
    return digest.hexdigest()[:16]


class MatmulTuner:
    """Chooses tiled matmul variants for one device; ``choose_all`` is ``compile_graph``'s ``choose_matmuls``."""

    def __init__(self, device, directory: Path | None):
        self.device = device
        info = dict(device.adapter.info)
        self.adapter = json.dumps({k: info[k] for k in sorted(info)}, default=str)
        self.kernels = timed_kernels()
        self.fingerprint = hashlib.sha256(f"{self.adapter}|{self.kernels}".encode()).hexdigest()[:16]
        self.path = Path(directory) / f"matmul-tuning-{self.fingerprint}.json" if directory is not None else None
        self.entries: dict[str, dict] = self._load()
        self.tuned = 0  # problems timed by this tuner
        self.seconds = 0.0  # spent timing them (pipelines included)

    def choose_all(self, problems: list[MatmulProblem]) -> list[MatmulChoice]:
        """The variant of each problem; new problems are timed first, their candidates' pipelines compiled together
        (side by side on the device's compile threads)."""
        new = [p for p in dict.fromkeys(problems) if p.key() not in self.entries]
        if new:
            start = time.perf_counter()
            built = [self._variants(p) for p in new]
            requests = [(source, len(p.bindings) + 1, "matmul tuning")
                        for p, (_, passes) in zip(new, built) for variant in passes for source, _ in variant]
            pipelines = dict(zip((source for source, _, _ in requests), self.device.pipelines(requests)))
            warm = False  # the first timed problem warms the GPU up; the rest follow it closely
            for problem, (choices, passes) in zip(new, built):
                self.entries[problem.key()] = self._time(problem, choices, passes, pipelines, warm)
                warm = warm or bool(passes)
            self.seconds += time.perf_counter() - start
            self.tuned += len(new)
            self._save()
        return [_choice(self.entries[p.key()]) for p in problems]

    # ---- timing

    def _variants(self, p: MatmulProblem) -> tuple[list[MatmulChoice], list[list[tuple]]]:
        """The candidates of a problem and each one's passes, (WGSL, workgroups) each; none where it is not timed."""
        limits = dict(self.device.limits, **{F16_PRODUCTS: 1}) if p.f16 else self.device.limits
        limit = self.device.max_binding_size
        choices = candidates(p.batch, p.m, p.n, p.k, limits)
        if max((*p.bindings, _partial_bytes(p, choices[:1]))) > limit or p.k == 0:
            return choices[:1], []
        choices = [c for c in choices if _partial_bytes(p, [c]) <= limit]  # split too far for one binding
        shape = dict(batch=p.batch, m=p.m, n=p.n)
        passes = []
        for c in choices:
            passes.append([matmul_kernel(p.prelude, **shape, k=p.k, limits=limits, a_fast=p.a_fast, b_fast=p.b_fast,
                                         tile=c.tile, block=c.block, split=c.split,
                                         partial=p.partial if c.split > 1 else None, f16=c.f16, looped=p.looped)])
            if c.split > 1:
                passes[-1].append(split_reduce_kernel(p.prelude, **shape, split=c.split, partial=p.partial,
                                                      limits=limits))
        return choices, passes

    def _time(self, problem: MatmulProblem, choices, passes, pipelines, warm: bool) -> dict:
        if not passes:
            return _entry(choices[0], None, None)
        dev = self.device
        sizes = [*problem.bindings, _partial_bytes(problem, choices)]
        buffers = [dev.storage_buffer(max(4, -(-size // 4) * 4), "tuning scratch") for size in sizes]  # zeros
        try:
            group = dev.bind_group([(buffer, 0, buffer.size) for buffer in buffers], "matmul tuning")
            seconds = time_sequences(dev, [[(pipelines[s], group, g) for s, g in p] for p in passes],
                                     0.0 if warm else WARMUP_SECONDS)
        finally:
            for buffer in buffers:
                dev.destroy_buffer(buffer)
        best = min(range(len(choices)), key=seconds.__getitem__)
        if seconds[best] > (1 - MIN_GAIN) * seconds[0]:
            best = 0
        return _entry(choices[best], seconds[best], seconds[0])

    # ---- the file

    def _load(self) -> dict[str, dict]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
            if (data.get("version"), data.get("adapter"), data.get("kernels")) != (FILE_VERSION, self.adapter,
                                                                                  self.kernels):
                return {}
            return {k: v for k, v in data["problems"].items() if _valid(v)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def _save(self) -> None:
        if self.path is None:
            return
        body = json.dumps({"version": FILE_VERSION, "adapter": self.adapter, "kernels": self.kernels,
                           "problems": self.entries}, indent=1)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(temporary, self.path)  # readers see the old file or the new one, never half of one
        except OSError:
            pass


def candidates(batch: int, m: int, n: int, k: int, limits: dict) -> list[MatmulChoice]:
    """The default variant first, then the distinct variants of CONFIGS x SPLITS that suit the problem (with f16
    products too for 4x4 blocks, where ``limits`` allow them)."""
    default = default_choice(batch, m, n, k, limits)
    shared, threads = limits["max-compute-workgroup-storage-size"], _max_threads(limits)
    seen = {(_choose_tiled_plan(batch, m, n, k, shared, threads), default.split, default.f16)}
    found = [default]
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
    return found


def _partial_bytes(problem: MatmulProblem, choices: list[MatmulChoice]) -> int:
    """Bytes of the partial sums of the candidate with the most K slices."""
    return 4 * max(c.split for c in choices) * problem.batch * problem.m * problem.n


def _choice(entry: dict) -> MatmulChoice:
    tile, block = entry["tile"], entry["block"]
    return MatmulChoice(tuple(tile) if tile else None, tuple(block) if block else None, entry["split"],
                        entry.get("f16", False))


def _entry(choice: MatmulChoice, seconds: float | None, default_seconds: float | None) -> dict:
    return {"tile": list(choice.tile) if choice.tile else None, "block": list(choice.block) if choice.block else None,
            "split": choice.split, "f16": choice.f16, "us": None if seconds is None else round(float(seconds) * 1e6, 2),
            "default_us": None if default_seconds is None else round(float(default_seconds) * 1e6, 2)}


def _valid(entry) -> bool:
    """Whether a remembered entry names a variant the generator can build."""
    def pair(value, allowed) -> bool:
        return value is None or (isinstance(value, list) and len(value) == 2 and all(x in allowed for x in value))

    split = entry.get("split")
    edges = {*TILE_SIZES, *(edge for tile, _ in CONFIGS for edge in tile)}
    blocks = {4, 8, *(size for _, block in CONFIGS for size in block)}
    return (isinstance(split, int) and 1 <= split <= SPLIT_MAX and pair(entry.get("tile"), edges)
            and pair(entry.get("block"), blocks) and entry.get("f16", False) in (False, True))
