"""Options accepted from ``torch.compile(..., backend="meganeura", options={...})``, validated once."""
from __future__ import annotations

from dataclasses import dataclass, fields

FALLBACK_POLICIES = ("warn", "error")
PRECISIONS = ("strict", "fast")


@dataclass(frozen=True)
class Options:
    adapter: str | int | None = None  # adapter index or name substring; default: env MEGANEURA_ADAPTER, then best GPU
    fallback: str = "warn"  # "warn": ops without a lowering run in eager PyTorch with a warning; "error": raise
    profile: str | None = None  # path: time every dispatch on the GPU, write a chrome trace there at exit
    tune: bool | None = None  # time matmul variants per GEMM shape on the device (see tuning.py); None: MEGANEURA_TUNE
    precision: str = "strict"  # "fast": forward matmuls and convolutions may form products in f16 (see tuning.py)

    @classmethod
    def from_user(cls, options: dict | None) -> "Options":
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown meganeura option(s) {unknown}; valid options are {sorted(known)}")
        opts = cls(**options)
        if opts.tune not in (None, True, False):
            raise ValueError(f"option tune={opts.tune!r} must be True or False")
        if opts.precision not in PRECISIONS:
            raise ValueError(f"option precision={opts.precision!r} must be one of {PRECISIONS}")
        if opts.fallback not in FALLBACK_POLICIES:
            raise ValueError(f"option fallback={opts.fallback!r} must be one of {FALLBACK_POLICIES}")
        return opts
