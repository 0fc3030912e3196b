"""Outputs and gradients of the backend judged against eager PyTorch (and float64 where eager is itself inexact).

``check_against_eager`` compiles with backend="meganeura", runs the compiled and the eager function and compares;
``check_gradients_against_eager`` does the same through backward. The ``assert_*`` functions compare results
already computed.
"""
from __future__ import annotations

import warnings

import torch

REL_L2 = 1e-5


def flatten_outputs(out) -> list:
    """The leaves of a model's output: tensors and Python values, HF ModelOutputs through ``to_tuple()``."""
    if hasattr(out, "to_tuple") and callable(out.to_tuple):
        out = out.to_tuple()
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [leaf for key in sorted(out) for leaf in flatten_outputs(out[key])]
    if isinstance(out, (list, tuple)):
        return [leaf for item in out for leaf in flatten_outputs(item)]
    return [out]


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over the positions where ``want`` is finite (in float64)."""
    got, want = got.detach().double(), want.detach().double()
    finite = torch.isfinite(want)
    diff = torch.linalg.vector_norm((got - want)[finite]).item()
    norm = torch.linalg.vector_norm(want[finite]).item()
    if norm == 0.0:
        return diff
    return diff / norm


def assert_same(got, want, *, rtol: float, atol: float, rel: float = REL_L2, what: str = "output") -> None:
    """Elementwise (NaN == NaN) and relative-L2 comparison of two output structures."""
    got_leaves, want_leaves = flatten_outputs(got), flatten_outputs(want)
    assert len(got_leaves) == len(want_leaves), f"{what}: {len(got_leaves)} leaves, eager has {len(want_leaves)}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if not isinstance(w, torch.Tensor):
            assert g == w, f"{what} leaf {i}: {g!r} != eager {w!r}"
            continue
        assert isinstance(g, torch.Tensor), f"{what} leaf {i}: got {type(g).__name__}, eager gives a tensor"
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what} leaf {i}: {m}")
        if w.is_floating_point() and w.numel():
            err = rel_l2(g, w)
            assert err <= rel, f"{what} leaf {i}: relative L2 error {err:.3g} > {rel:.1g}"


def assert_grads_match(model, ref, *, rtol: float = 1e-3, atol: float = 1e-4, rel: float = 1e-4) -> None:
    """Every parameter gradient of ``model`` against ``ref``'s: elementwise, and relative L2 per tensor.

    Some gradients are exactly zero in exact arithmetic (a bias before a BatchNorm, the key bias of attention):
    eager returns rounding noise for them (RMS ~1e-7), where a relative error means nothing. The relative L2 is
    therefore checked on every gradient whose RMS exceeds ``atol``; the others are within atol elementwise."""
    checked = 0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, f"{name}: eager has no gradient, the compiled run has one"
            continue
        assert p.grad is not None, f"{name}: no gradient from the compiled run"
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m: f"grad of {name}: {m}")
        diff = torch.linalg.vector_norm((p.grad - q.grad).double()).item()
        norm = torch.linalg.vector_norm(q.grad.double()).item()
        if norm > atol * q.grad.numel() ** 0.5:
            assert diff <= rel * norm, f"grad of {name}: relative L2 error {diff / norm:.3g}"
        checked += 1
    assert checked > 0


def assert_as_accurate_as_eager(got, eager, exact, *, rtol: float = 1e-3, atol: float = 1e-4, rel: float = 1e-4,
                                what: str = "tensor") -> None:
    """For ill-conditioned networks where eager float32 itself is far from the exact result (ResNet-50 training
    at batch 2, whose BatchNorms normalise over a handful of values): compare ``got`` with the float64 result
    ``exact``, allowing a multiple of eager float32's own error on top of the usual tolerances.

    Elementwise: |got - exact| <= atol + rtol |exact| + 32 max|eager - exact|, a guard against gross local
    errors only: rounding in another summation order, amplified the same way, put single elements of
    multi-million-element gradients ~4x beyond eager's worst one on lavapipe and 10x-18x on the H200.
    Relative L2, the real check: at most max(rel, 4 x eager's relative L2 error); measured ratios were 0.1-0.9
    on lavapipe and a median of 1.1 (worst 1.85) over ResNet-50's parameters on the H200. A wrong lowering is
    off by far more than rounding (an O(1) relative error) and fails."""
    got, eager, exact = got.detach().double(), eager.detach().double(), exact.detach().double()
    slack = 32 * (eager - exact).abs().max().item() if exact.numel() else 0.0
    excess = (got - exact).abs() - (atol + rtol * exact.abs() + slack)
    assert not bool((excess > 0).any()), (
        f"{what}: {int((excess > 0).sum())} of {exact.numel()} elements off by more than the tolerance "
        f"(worst by {excess.max().item():.3g}; eager float32's worst error {slack / 32:.3g})")
    if exact.numel() and exact.norm() > atol * exact.numel() ** 0.5:
        ours, theirs = rel_l2(got, exact), rel_l2(eager, exact)
        assert ours <= max(rel, 4 * theirs), f"{what}: relative L2 error {ours:.3g}, eager float32's {theirs:.3g}"


EAGER_ERROR_FACTOR = 2.0  # ours may be this many times eager float32's own distance from float64
ERROR_FLOOR = 1e-6  # relative L2 below this is rounding noise whatever eager's error (eager can be exact)


def assert_within_eager_error(got, eager, exact, *, factor: float = EAGER_ERROR_FACTOR, floor: float = ERROR_FLOOR,
                              what: str = "tensor") -> None:
    """Judged against float64: ``got``'s relative L2 distance from ``exact`` is at most ``factor`` times eager
    float32's own (``eager``), plus ``floor``."""
    ours, theirs = rel_l2(got, exact), rel_l2(eager, exact)
    assert ours <= factor * theirs + floor, (f"{what}: relative L2 from float64 {ours:.3g}, eager float32's "
                                            f"{theirs:.3g} (allowed {factor} x eager + {floor:g})")


def check_gradients_against_eager(fn, *inputs, rtol: float = 1e-3, atol: float = 1e-4, rel: float = 1e-4,
                                  names=None, what: str = "") -> None:
    """Compile ``fn``, run it on copies of the float ``inputs`` and backward with a random upstream gradient, do
    the same in eager, and compare the output and every input gradient (no meganeura fallback allowed).

    A gradient whose RMS is within ``atol`` is zero in exact arithmetic (e.g. dq of attention over one key);
    eager returns rounding noise there, so it is compared elementwise only."""
    names = names or [f"input {i}" for i in range(len(inputs))]
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    ref = [t.detach().clone().requires_grad_() for t in inputs]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="meganeura")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(*leaves)
        upstream = torch.randn(out.shape)
        grads = torch.autograd.grad(out, leaves, upstream)
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    want = fn(*ref)
    want_grads = torch.autograd.grad(want, ref, upstream)
    assert_same(out, want, rtol=rtol, atol=atol, rel=rel, what=f"{what} output")
    for name, got, exp in zip(names, grads, want_grads):
        tiny = exp.norm() <= atol * exp.numel() ** 0.5
        assert_same(got, exp, rtol=rtol, atol=atol, rel=float("inf") if tiny else rel, what=f"{what} d({name})")


def device_counters() -> dict:
    from meganeura.runtime.device import get_device

    return get_device().counters.snapshot()


def meganeura_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("meganeura")]


def check_against_eager(fn, *inputs, rtol: float = 1e-4, atol: float = 1e-5, rel: float = REL_L2,
                        allow_fallback: bool = False, on_device: bool = True, options: dict | None = None):
    """Compile ``fn`` with backend="meganeura", run it and eager on ``inputs`` under no_grad, compare.

    Unless ``allow_fallback``, the compiled run must emit no meganeura fallback warning; if ``on_device``, it
    must submit work to the device (so an all-eager fallback cannot pass for a device result). Returns the
    compiled callable, with the first call's meganeura warnings in ``compiled.meganeura_warnings``.
    """
    torch._dynamo.reset()  # also resets the backend's once-per-op warnings
    kwargs = {} if options is None else {"options": options}
    compiled = torch.compile(fn, backend="meganeura", **kwargs)
    with torch.no_grad():
        want = fn(*inputs)
        before = device_counters()["submits"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(*inputs)
        submits = device_counters()["submits"] - before
    if not allow_fallback:
        assert not meganeura_warnings(caught), f"unexpected fallback: {meganeura_warnings(caught)}"
    if on_device:
        assert submits > 0, "the compiled call submitted no work to the device"
    assert_same(got, want, rtol=rtol, atol=atol, rel=rel)
    compiled.meganeura_warnings = meganeura_warnings(caught)  # for tests that expect a particular fallback
    return compiled


class Compiles:
    """Counts, while active, the plans the backend compiles and the pipelines the device creates."""

    def __enter__(self):
        from meganeura.runtime.device import get_device
        from torch_meganeura.backend.entry import BackendContext
        from torch_meganeura.backend.per_call import PlanRecord

        self._device, self._kind, self._records = get_device(), PlanRecord, []
        self._context = BackendContext
        BackendContext.recorders.append(self._records)
        self._pipelines = self._device.counters.pipelines_created
        return self

    def __exit__(self, *exc):
        self._context.recorders.remove(self._records)

    @property
    def plans(self) -> int:
        return sum(isinstance(r, self._kind) for r in self._records)

    @property
    def pipelines(self) -> int:
        return self._device.counters.pipelines_created - self._pipelines

    @property
    def kernels(self) -> int:
        """Distinct kernels of the plans compiled."""
        return sum(r.kernels for r in self._records if isinstance(r, self._kind))

    @property
    def dynamic(self) -> list[str]:
        """The symbolic sizes of the plans compiled (each "placeholder[dim] <= bound")."""
        return [d for r in self._records if isinstance(r, self._kind) for d in r.dynamic]
