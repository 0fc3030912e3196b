"""Correctness gates of the benchmark: relative L2 per tensor against eager PyTorch in float64.

A tensor passes when its relative L2 error against the float64 result is below ``TOLERANCE`` (1e-3), or below
``EAGER_FACTOR`` times the error of eager PyTorch f32 on the CPU against the same float64 result. The second clause
exists because some gradients are ill-conditioned in f32 for every implementation: in ResNet-50 at batch 4 a few
BatchNorm weight gradients differ by 2-3% between PyTorch CPU and PyTorch CUDA, so f32 cannot reach 1e-3 there, and
the honest question is whether a competitor is as accurate as eager f32. A competitor that rounds on purpose
(meganeura's precision "fast", f16 products) is held to ``FAST_TOLERANCE`` (1e-2) instead.

A cell in a half dtype (bfloat16, float16: the model and its float inputs cast with ``.to(dtype)``) is judged against
float64 of the same half-precision weights and inputs, and must be within ``HALF_FACTOR`` (1.5) times the error of
eager PyTorch on the CPU at that dtype; ``HALF_TOLERANCE`` (1e-6) only keeps the limit above zero where eager is
exact. Eager rounds every intermediate to the dtype; a compiler that keeps intermediates in f32 is usually closer.

The relative L2 of a tensor is ||got - want|| / max(||want||, FLOOR * sqrt(numel)): a tensor whose reference RMS is
below ``FLOOR`` (a gradient that is zero in exact arithmetic) is judged by its absolute error instead. Non-finite
reference positions must match exactly (NaN == NaN, same infinities).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

TOLERANCE = 1e-3
FAST_TOLERANCE = 1e-2  # precision "fast": the bound for f16 products, forward and gradients
EAGER_FACTOR = 2.0
HALF_TOLERANCE = 1e-6  # half dtypes: judged by eager's own error at that dtype (far above this floor)
HALF_FACTOR = 1.5
FLOOR = 1e-6


@dataclass
class Gate:
    passed: bool
    output_rel_l2: float | None = None  # inference output, or the training loss, against float64
    worst_grad_rel_l2: float | None = None  # the gradient with the smallest margin, against float64
    worst_grad: str | None = None
    worst_grad_eager_rel_l2: float | None = None  # eager's error on that gradient (f32, or the cell's dtype)
    gradients: int = 0
    reason: str = ""
    eager_rel_l2: float | None = None  # eager's own error on the output (or loss) at the cell's dtype

    def as_dict(self) -> dict:
        return asdict(self)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return float("inf")
    finite = torch.isfinite(want)
    if not torch.equal(got[~finite].nan_to_num(0.5), want[~finite].nan_to_num(0.5)):
        return float("inf")
    diff = torch.linalg.vector_norm((got - want)[finite]).item()
    norm = max(torch.linalg.vector_norm(want[finite]).item(), FLOOR * max(int(finite.sum()), 1) ** 0.5)
    return diff / norm


def allowance(eager_error: float, tolerance: float = TOLERANCE, factor: float = EAGER_FACTOR) -> float:
    return max(tolerance, factor * eager_error)


def gate_output(got, exact, eager, tolerance: float = TOLERANCE, factor: float = EAGER_FACTOR) -> Gate:
    eager_err = rel_l2(eager, exact)
    err, limit = rel_l2(got, exact), allowance(eager_err, tolerance, factor)
    ok = err < limit
    return Gate(ok, output_rel_l2=err, reason="" if ok else f"output relative L2 {err:.3g} >= {limit:.3g}",
                eager_rel_l2=eager_err)


def gate_gradients(loss, grads: dict, exact_loss, exact_grads: dict, eager_loss, eager_grads: dict,
                   tolerance: float = TOLERANCE, factor: float = EAGER_FACTOR) -> Gate:
    eager_loss_err = rel_l2(eager_loss, exact_loss)
    loss_err, loss_limit = rel_l2(loss, exact_loss), allowance(eager_loss_err, tolerance, factor)
    if set(grads) != set(exact_grads):
        missing, extra = sorted(set(exact_grads) - set(grads)), sorted(set(grads) - set(exact_grads))
        return Gate(False, loss_err, reason=f"gradients missing {missing[:5]}, unexpected {extra[:5]}")
    margins = {}
    for name, want in exact_grads.items():
        err, eager_err = rel_l2(grads[name], want), rel_l2(eager_grads[name], want)
        margins[name] = (err / allowance(eager_err, tolerance, factor), err, eager_err)
    worst = max(margins, key=lambda n: margins[n][0]) if margins else None
    ratio, worst_err, worst_eager = margins[worst] if worst else (0.0, 0.0, 0.0)
    ok = loss_err < loss_limit and ratio < 1.0
    reason = "" if ok else (f"loss relative L2 {loss_err:.3g} (limit {loss_limit:.3g}), gradient {worst} "
                            f"{worst_err:.3g} (limit {allowance(worst_eager, tolerance, factor):.3g})")
    return Gate(ok, loss_err, worst_err, worst, worst_eager, len(margins), reason, eager_loss_err)
