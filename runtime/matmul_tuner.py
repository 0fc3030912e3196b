"""Per-shape matmul tuning on a device: time the candidate variants of each tiled GEMM problem and keep the fastest,
remembered per adapter in a JSON file.

The problems, their candidates and each candidate's passes (WGSL) come from ``meganeura.kernels.matmul_tuning``;
this module runs them. Each candidate is timed with its problem's prelude on scratch buffers of the bindings' sizes,
zero-filled (so that an index read from data stays in range), with ``meganeura.runtime.timing``. The gather can cost
as much as the products: on an H200, ResNet-50's 3x3 convolution 4x256x196x2304 took about 87 us in its plan against
47 us as a GEMM of plain arrays, and variants timed on plain arrays misjudged it (939f8fd: 4x128x784x1152 tuned
0.45 ms a call against 0.34 ms for the default). The default stays unless a candidate beats it by ``MIN_GAIN``. A
plan's new problems are tuned together: all their candidates' pipelines compiled in one batch (side by side), then
timed problem by problem. A problem whose own buffers (or its default's partial sums) would not fit the device's
binding limit keeps the default untimed.

The file is ``matmul-tuning-<digest>.json`` in the directory the caller gives (None: remembered for the process
only), the digest over the adapter with the device's limits (a choice made under the adapter's own limits may not fit
WebGPU's defaults, ``MEGANEURA_LIMITS``) and what the timings depend on besides it (``timed_kernels``: the sources of
the matmul generator, its candidates, this tuner and the timing, and whether kernels keep naga's runtime checks). It
records both, and per problem (keyed by its shape, layouts and a digest of its prelude) the choice and the two
times; a file that does not parse or names another adapter or other kernels is ignored and rewritten, so a changed
generator is tuned afresh. A directory that cannot be written only loses the memory.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from meganeura.kernels import matmul as matmul_generator
from meganeura.kernels import matmul_common, matmul_plans, matmul_staging, matmul_tuning
from meganeura.kernels.matmul_plans import K_CHUNKS, SPLIT_MAX, TILE_SIZES, MatmulChoice
from meganeura.kernels.matmul_tuning import MatmulProblem, partial_bytes, variants

from . import timing
from .device import SHADER_CHECKS_ENV
from .timing import WARMUP_SECONDS, time_sequences

MIN_GAIN = 0.05  # a candidate replaces the default when at least this much faster
FILE_VERSION = 2  # 2: problems keyed by their prelude too


def timed_kernels() -> str:
    """A digest of what tuned timings depend on besides the adapter: the source of the matmul generator (and of the
    modules it draws its plans, staging and header from), of its candidates, of this module and of the timing, and
    whether kernels compile with naga's runtime checks (``MEGANEURA_SHADER_CHECKS``)."""
    digest = hashlib.sha256()
    for source in (matmul_generator.__file__, matmul_plans.__file__, matmul_staging.__file__, matmul_common.__file__,
                   matmul_tuning.__file__, __file__, timing.__file__):
        digest.update(Path(source).read_bytes())
    digest.update(f"checks={os.environ.get(SHADER_CHECKS_ENV) == '1'}".encode())
    return digest.hexdigest()[:16]


class MatmulTuner:
    """Chooses tiled matmul variants for one device; ``choose_all`` is ``compile_graph``'s ``choose_matmuls``."""

    def __init__(self, device, directory: Path | None):
        self.device = device
        info = dict(device.adapter.info)
        self.adapter = json.dumps(dict(info, limits=device.limits), sort_keys=True, default=str)
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
            built = [variants(p, self.device.limits, self.device.max_binding_size) for p in new]
            pipelines = self._pipelines(new, built)
            warm = False  # the first timed problem warms the GPU up; the rest follow it closely
            for problem, (choices, passes) in zip(new, built):
                self.entries[problem.key()] = self._time(problem, choices, passes, pipelines, warm)
                warm = warm or bool(passes)
            self.seconds += time.perf_counter() - start
            self.tuned += len(new)
            self._save()
        return [_choice(self.entries[p.key()]) for p in problems]

    def time_candidates(self, problem: MatmulProblem) -> tuple[list[MatmulChoice], list[float] | None]:
        """Every candidate of ``problem`` and its seconds a run as the tuner times it (None where the problem is not
        timed), remembering nothing: what ``choose_all`` would weigh (``pick`` says which it keeps), for benchmarks
        that show every candidate."""
        choices, passes = built = variants(problem, self.device.limits, self.device.max_binding_size)
        if not passes:
            return choices, None
        return choices, self._seconds(problem, choices, passes, self._pipelines([problem], [built]), False)

    # ---- timing

    def _pipelines(self, problems: list[MatmulProblem], built: list[tuple]) -> dict:
        """Source -> pipeline of every pass of the problems' candidates (``variants``), compiled in one batch."""
        requests = [(source, len(p.bindings) + 1 + len(p.aliases), "matmul tuning")
                    for p, (_, passes) in zip(problems, built) for variant in passes for source, _ in variant]
        return dict(zip((source for source, _, _ in requests), self.device.pipelines(requests)))

    def _time(self, problem: MatmulProblem, choices, passes, pipelines, warm: bool) -> dict:
        if not passes:
            return _entry(choices[0], None, None)
        seconds = self._seconds(problem, choices, passes, pipelines, warm)
        best = pick(seconds)
        return _entry(choices[best], seconds[best], seconds[0])

    def _seconds(self, problem: MatmulProblem, choices, passes, pipelines, warm: bool) -> list[float]:
        """Seconds a run of each candidate's passes, on zero-filled scratch buffers of the problem's bindings."""
        dev = self.device
        sizes = [*problem.bindings, partial_bytes(problem, choices), *problem.aliases]
        buffers = [dev.storage_buffer(max(4, -(-size // 4) * 4), "tuning scratch") for size in sizes]  # zeros
        try:
            group = dev.bind_group([(buffer, 0, buffer.size) for buffer in buffers], "matmul tuning")
            return time_sequences(dev, [[(pipelines[s], group, g) for s, g in p] for p in passes],
                                  0.0 if warm else WARMUP_SECONDS)
        finally:
            for buffer in buffers:
                dev.destroy_buffer(buffer)

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


def pick(seconds: list[float]) -> int:
    """The candidate the tuner keeps, by index into ``seconds`` (the default's first): the fastest, where it beats
    the default by MIN_GAIN, else the default."""
    best = min(range(len(seconds)), key=seconds.__getitem__)
    return best if seconds[best] <= (1 - MIN_GAIN) * seconds[0] else 0


def _choice(entry: dict) -> MatmulChoice:
    tile, block = entry["tile"], entry["block"]
    return MatmulChoice(tuple(tile) if tile else None, tuple(block) if block else None, entry["split"],
                        entry.get("f16", False), entry.get("double", False), entry.get("quads", False),
                        entry.get("patches", False), entry.get("chunk", 0), entry.get("unpadded", False))


def _entry(choice: MatmulChoice, seconds: float | None, default_seconds: float | None) -> dict:
    return {"tile": list(choice.tile) if choice.tile else None, "block": list(choice.block) if choice.block else None,
            "split": choice.split, "f16": choice.f16, "double": choice.double, "quads": choice.quads,
            "patches": choice.patches, "chunk": choice.chunk, "unpadded": choice.unpadded,
            "us": None if seconds is None else round(float(seconds) * 1e6, 2),
            "default_us": None if default_seconds is None else round(float(default_seconds) * 1e6, 2)}


def _valid(entry) -> bool:
    """Whether a remembered entry names a variant the generator can build."""
    def pair(value, allowed) -> bool:
        return value is None or (isinstance(value, list) and len(value) == 2 and all(x in allowed for x in value))

    split = entry.get("split")
    configs = matmul_tuning.CONFIGS
    edges = {*TILE_SIZES, *(edge for tile, _ in configs for edge in tile)}
    blocks = {4, 8, *(size for _, block in configs for size in block)}
    return (isinstance(split, int) and 1 <= split <= SPLIT_MAX and pair(entry.get("tile"), edges)
            and pair(entry.get("block"), blocks) and entry.get("f16", False) in (False, True)
            and all(entry.get(flag, False) in (False, True) for flag in ("double", "quads", "patches", "unpadded"))
            and entry.get("chunk", 0) in (0, *K_CHUNKS))
