"""``python -m bench.ulp``: the error of each float32 pointwise function in units in the last place, ours beside
eager's, over dense sweeps of its domain.

    python -m bench.ulp --out bench/results/ulp-lavapipe          # writes OUT.json and the table OUT.md

For each function and range, ``SAMPLES`` inputs (evenly spaced in value, and in magnitude where the range spans
decades) run through the backend and through eager float32; both are compared with float64 on the same inputs,
rounded to float32: the distance in ULPs of that float32 value (0.5 is the best a rounded result can do). Max and
mean per function, ours and eager's. Special values (zeros, infinities, NaN) are checked by the tests.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SAMPLES = 1 << 18
# (name, function, [(lo, hi, spacing)]): "lin" evenly in value over [lo, hi]; "log" evenly in magnitude over
# [lo, hi] (lo > 0), "log2" the same and its negatives. A function of two inputs has the second's ranges after the
# first's (SECOND); its inputs are paired in a fixed shuffled order.
SECOND = {"pow": [(-10.0, 10.0, "lin")]}
FUNCTIONS = [
    ("exp", torch.exp, [(-87.0, 88.0, "lin")]),
    ("exp2", torch.exp2, [(-125.0, 127.0, "lin")]),
    ("expm1", torch.expm1, [(-20.0, 20.0, "lin"), (1e-8, 1.0, "log")]),
    ("log", torch.log, [(1e-30, 1e30, "log")]),
    ("log2", torch.log2, [(1e-30, 1e30, "log")]),
    ("log10", torch.log10, [(1e-30, 1e30, "log")]),
    ("log1p", torch.log1p, [(-0.999, 10.0, "lin"), (1e-8, 1.0, "log")]),
    ("sqrt", torch.sqrt, [(1e-30, 1e30, "log")]),
    ("rsqrt", torch.rsqrt, [(1e-30, 1e30, "log")]),
    ("sin", torch.sin, [(-100.0, 100.0, "lin")]),
    ("cos", torch.cos, [(-100.0, 100.0, "lin")]),
    ("tan", torch.tan, [(-1.5, 1.5, "lin")]),
    ("asin", torch.asin, [(-1.0, 1.0, "lin")]),
    ("acos", torch.acos, [(-1.0, 1.0, "lin")]),
    ("atan", torch.atan, [(1e-6, 1e4, "log2")]),
    ("sinh", torch.sinh, [(-88.0, 88.0, "lin"), (1e-8, 1.0, "log")]),
    ("cosh", torch.cosh, [(-88.0, 88.0, "lin")]),
    ("tanh", torch.tanh, [(-10.0, 10.0, "lin"), (1e-8, 1.0, "log")]),
    ("sigmoid", torch.sigmoid, [(-80.0, 80.0, "lin")]),
    ("erf", torch.erf, [(-4.0, 4.0, "lin"), (1e-8, 1.0, "log")]),
    ("erfc", torch.erfc, [(-2.0, 9.0, "lin")]),
    ("pow", torch.pow, [(1e-3, 1e3, "log")]),
]


def _inputs(ranges):
    parts = []
    n = SAMPLES // len(ranges)
    for lo, hi, spacing in ranges:
        if spacing == "lin":
            parts.append(torch.linspace(lo, hi, n, dtype=torch.float64))
        else:
            mags = torch.logspace(torch.log10(torch.tensor(lo)).item(), torch.log10(torch.tensor(hi)).item(),
                                  n // 2 if spacing == "log2" else n, dtype=torch.float64)
            parts += [mags, -mags] if spacing == "log2" else [mags]
    return torch.cat(parts).float()


def ulp_errors(got, exact64):
    """|got - exact| in ULPs of float32 at exact (rounded to float32); elements whose exact value is not finite in
    float32 are left out."""
    exact = exact64.float()
    finite = torch.isfinite(exact) & torch.isfinite(got)
    exact, exact64, got = exact[finite], exact64[finite], got[finite].double()
    spacing = (torch.nextafter(exact.abs(), torch.tensor(float("inf"))) - exact.abs()).double()
    return ((got - exact64).abs() / spacing)


def measure(name: str, fn, ranges) -> dict:
    inputs = [_inputs(ranges)]
    if name in SECOND:
        inputs.append(_inputs(SECOND[name])[torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0))])
    torch._dynamo.reset()
    ours = torch.compile(fn, backend="meganeura")(*inputs)
    eager = fn(*inputs)
    exact = fn(*(x.double() for x in inputs))
    row = {"function": name, "samples": int(inputs[0].numel()), "ranges": [list(r) for r in ranges]}
    if name in SECOND:
        row["second_ranges"] = [list(r) for r in SECOND[name]]
    for who, values in (("ours", ours), ("eager", eager)):
        errors = ulp_errors(values, exact)
        row[f"{who}_max_ulp"] = float(errors.max())
        row[f"{who}_mean_ulp"] = float(errors.mean())
    return row


def markdown(result: dict) -> str:
    lines = [f"# Float32 pointwise functions: error in ULPs ({result['adapter']}, torch {result['torch']})", "",
             "Distance from float64 on the same inputs, in units in the last place of the float32 result; "
             f"{result['samples']:,} inputs per function over the ranges shown (`python -m bench.ulp`).", "",
             "| function | ranges | ours max | ours mean | eager max | eager mean |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        shown = {"lin": "", "log": " (log)", "log2": " (log, both signs)"}
        listed = [", ".join(f"[{lo:g}, {hi:g}]{shown[s]}" for lo, hi, s in r[key])
                  for key in ("ranges", "second_ranges") if key in r]
        ranges = listed[0] if len(listed) == 1 else f"x in {listed[0]}; y in {listed[1]}"
        lines.append(f"| {r['function']} | {ranges} | {r['ours_max_ulp']:.2f} | {r['ours_mean_ulp']:.3f} | "
                     f"{r['eager_max_ulp']:.2f} | {r['eager_mean_ulp']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ulp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results path without suffix: writes OUT.json and OUT.md")
    p.add_argument("--functions", help="comma-separated names (default: all)")
    args = p.parse_args(argv)
    from meganeura.runtime.device import get_device

    chosen = set(args.functions.split(",")) if args.functions else None
    rows = [measure(name, fn, ranges) for name, fn, ranges in FUNCTIONS if chosen is None or name in chosen]
    result = {"adapter": get_device().describe(), "torch": torch.__version__, "samples": SAMPLES, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
