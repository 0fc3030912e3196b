"""How the OpInfo sweep (``coverage``, ``coverage_step``) judges a result against eager PyTorch.

An element passes if it is within ATOL + RTOL of eager's result, or, where the op runs in float64, within the same
tolerance plus 4x eager's largest error of the float64 result. RTOL is that of the result's dtype: 1e-5 in
float32, one unit in the last place at 1.0 in bfloat16 and float16 (eager rounds each op's result to the half
dtype and so may we, at another point of a fused chain).

Beside the verdict, ``precision`` is the worst over a sample's outputs and gradients of our relative L2 distance
from float64 over eager's (eager's taken as at least PRECISION_FLOOR): above PRECISION_BOUND, ours is correct by
the tolerances yet less accurate than eager's own error allows.
"""
from __future__ import annotations

import torch

ATOL, EAGER_ERROR_FACTOR = 1e-5, 4.0
RTOL = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}  # a half dtype's spacing at 1.0
RTOL_FLOAT32 = 1e-5
PRECISION_FLOOR = 1e-7  # relative L2 from float64 that counts as exact: eager's error, where smaller, is taken as this
PRECISION_BOUND = 2.0  # issue 39's bound on ``precision``: ours at most twice eager's distance from float64


def compare(got, ref32, ref64, values: bool) -> dict:
    """status "ok" or "wrong" (with the first mismatch), and the worst errors over all outputs and gradients of
    ``got`` against eager's ``ref32`` (``coverage.Result``s; eager in the sample's dtype) and ``ref64``."""
    if got.spec != ref32.spec or len(got.grads) != len(ref32.grads):
        return {"status": "wrong", "mismatch": f"output structure {got.spec} vs eager {ref32.spec}"}
    pairs = [(f"output {i}", g, w, None if ref64 is None else ref64.outputs[i])
             for i, (g, w) in enumerate(zip(got.outputs, ref32.outputs))]
    pairs += [(f"grad {i}", g, w, None if ref64 is None else ref64.grads[i])
              for i, (g, w) in enumerate(zip(got.grads, ref32.grads))]
    return compare_pairs(pairs, values)


def compare_pairs(pairs: list, values: bool = True) -> dict:
    """``compare`` over (what, got, eager float32, eager float64 or None) tuples."""
    worst = {"max_abs_error": 0.0, "rel_l2": 0.0}
    for what, g, w, w64 in pairs:
        problem = compare_leaf(g, w, w64, values, worst)
        if problem:
            return {"status": "wrong", "mismatch": f"{what}: {problem}", **worst}
    return {"status": "ok", **worst}


def compare_leaf(got, want, want64, values: bool, worst: dict) -> str | None:
    if not isinstance(want, torch.Tensor):
        return None if got == want or not values else f"{got!r} != eager {want!r}"
    if not isinstance(got, torch.Tensor):
        return f"got {type(got).__name__}, eager gives a tensor"
    if got.shape != want.shape or got.dtype != want.dtype or got.layout != want.layout:
        return f"{got.dtype}{list(got.shape)} {got.layout} vs eager {want.dtype}{list(want.shape)} {want.layout}"
    if want.layout != torch.strided:
        got, want, want64 = got.to_dense(), want.to_dense(), None if want64 is None else want64.to_dense()
    if not values or got.numel() == 0:
        return None
    if not (want.is_floating_point() or want.is_complex()):
        return None if torch.equal(got, want) else f"{int((got != want).sum())} of {got.numel()} elements differ"
    return compare_floats(got, want, want64, worst)


def compare_floats(got, want, want64, worst: dict) -> str | None:
    rtol = RTOL.get(want.dtype, RTOL_FLOAT32)
    wide = torch.complex128 if got.is_complex() else torch.float64
    got, want = got.to(wide), want.to(wide)
    exact = want if want64 is None or want64.shape != want.shape else want64.to(wide)
    same_special = (torch.isnan(got) & torch.isnan(want)) | (got == want)
    finite = torch.isfinite(exact) & torch.isfinite(want)
    err = (got - exact).abs()
    eager_err = (want - exact).abs()[finite]
    slack = EAGER_ERROR_FACTOR * eager_err.max().item() if eager_err.numel() else 0.0
    near32 = (got - want).abs() <= ATOL + rtol * want.abs()
    near64 = err <= ATOL + rtol * exact.abs() + slack
    ok = same_special | near32 | near64
    finite_err = err[finite & torch.isfinite(got)]
    worst["max_abs_error"] = max(worst["max_abs_error"], finite_err.max().item() if finite_err.numel() else 0.0)
    norm = exact[finite].abs().norm().item()
    diff = (got - exact)[finite].abs().norm().item()
    if diff == diff:  # not NaN
        worst["rel_l2"] = max(worst["rel_l2"], diff / norm if norm else diff)
        if exact is not want and norm:
            eager_rel = (want - exact)[finite].abs().norm().item() / norm
            worst["precision"] = max(worst.get("precision", 0.0), diff / norm / max(eager_rel, PRECISION_FLOOR))
    if bool(ok.all()):
        return None
    bad = (~ok).nonzero()[0].tolist()
    return (f"{int((~ok).sum())} of {ok.numel()} elements off (first at {bad}: {got[tuple(bad)].item():.6g} vs "
            f"eager {want[tuple(bad)].item():.6g}); max abs error {worst['max_abs_error']:.3g}")
