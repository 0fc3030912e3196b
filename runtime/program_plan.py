"""What a ``Program`` reads off its plan once, before any run: how a run is submitted in parts
(``submission_parts``), which dispatches take their workgroup counts from the indirect buffer (``indirect_slots``),
the function that evaluates a run's shapes and counts at its symbol values (``run_sizes``, ``RunTensors``), and the
pipelines to compile (``pipeline_jobs``)."""
from __future__ import annotations

from typing import NamedTuple

from meganeura.kernels.sizes import is_size

from .plan import Plan, TensorSpec

# Submitted parts of a plan: the first of FIRST_PART dispatches, each next one twice as long up to SUBMIT_EVERY. A
# submit costs about as much host time as recording ten dispatches (H200: 37 us), and ResNet-50's 105 dispatches
# took 0.9 ms to record before the GPU got any of them, in one part.
FIRST_PART = 16
SUBMIT_EVERY = 128
# Plans of at least this many dispatches record the next run ahead (see run). H200, untuned inference, alternating
# blocks of calls, ahead on against off: Whisper-tiny (45 dispatches) 2.85 against 2.94 ms, ResNet-50 (91) 3.39
# against 3.46, SmolLM2 (402) 5.10 against 5.30; a one-dispatch plan (a 1024^3 matmul) 0.64 against 0.53.
AHEAD_MIN_DISPATCHES = 2 * FIRST_PART



class RunTensors(NamedTuple):
    """The shapes of a run's inputs and outputs, by name: a plan over symbolic sizes has them at the run's sizes.
    Specs at those shapes are made only for the tensors that cross to or from the host (``spec``): a decode step's
    KV cache arrays, bound and kept on the device, need their shapes alone."""

    shapes: dict[str, tuple]

    def spec(self, t: TensorSpec) -> TensorSpec:
        """``t`` (the plan's, at its bounds) at this run's shape."""
        shape = self.shapes[t.name]
        return t if shape == t.shape else TensorSpec(t.name, t.buffer, t.offset, shape, t.dtype)


def submission_parts(count: int) -> list[tuple[int, int]]:
    """(start, end) of each submitted part of ``count`` dispatches: FIRST_PART, then doubling up to SUBMIT_EVERY; a
    remainder shorter than the first part joins the last part rather than costing a submit of its own."""
    parts, start, size = [], 0, min(FIRST_PART, SUBMIT_EVERY)
    while count - start >= size + min(FIRST_PART, SUBMIT_EVERY):
        parts.append((start, start + size))
        start, size = start + size, min(2 * size, SUBMIT_EVERY)
    return parts + [(start, count)]


def _literal(items) -> str:
    """A Python tuple literal of ``items``: ints, or Sizes as expressions over ``s[k]``, the value of symbol k."""
    return "(" + "".join(f"{x.python('s') if is_size(x) else int(x)}, " for x in items) + ")"


def indirect_slots(plan: Plan) -> tuple[dict[int, int], list[int]]:
    """The dispatches with symbolic workgroup counts, each to its slot in the indirect buffer, and the first dispatch
    of each slot: one slot per distinct count expression, so that a run writes as many counts as there are distinct
    ones (every layer's attention over the KV cache has the same: the bytes written per decode step do not grow
    with the model's depth)."""
    slots: dict[tuple, int] = {}
    of_dispatch, firsts = {}, []
    for i, d in enumerate(plan.dispatches):
        if any(map(is_size, d.workgroups)):
            key = tuple(w.key() if is_size(w) else w for w in d.workgroups)
            if key not in slots:
                slots[key] = len(firsts)
                firsts.append(i)
            of_dispatch[i] = slots[key]
    return of_dispatch, firsts


def run_sizes(plan: Plan, indirect: list[int]):
    """A function of a plan's symbol values giving (the shapes of its inputs then its outputs, the workgroup counts of
    the dispatches at ``indirect``, flat): what a run at those values checks, reads back and writes to the indirect
    buffer, evaluated in one call and nothing else (``Plan.sized`` also gives every other dispatch's counts)."""
    shapes = "(" + "".join(f"{_literal(t.shape)}, " for t in plan.inputs + plan.outputs) + ")"
    counts = _literal([w for i in indirect for w in plan.dispatches[i].workgroups])
    return eval(f"lambda s: ({shapes}, {counts})")  # noqa: S307 - built from Sizes and ints


def pipeline_jobs(plan: Plan) -> list[tuple[str, int, str]]:
    """(WGSL, binding count, kernel key) of each kernel ``plan`` dispatches, in order of first dispatch."""
    counts: dict[str, set[int]] = {}
    for d in plan.dispatches:
        counts.setdefault(d.kernel, set()).add(len(d.bindings))
    for key, n in counts.items():
        if len(n) != 1:
            raise ValueError(f"kernel {key!r} is dispatched with different binding counts {sorted(n)}")
    return [(plan.kernels[key], n.pop(), key) for key, n in counts.items()]
