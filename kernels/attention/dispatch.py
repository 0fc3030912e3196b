"""``attention_kernel``: the dispatches of one attention pass, in the form its plan picks (flash forward, chunked flash
forward, blocked, or per row: sliced for a decode step's few rows), followed by the merge where the pass is cut into
slices."""
from __future__ import annotations

from dataclasses import replace

from ..sizes import concrete
from . import blocked, blocked_grad, chunked, flash, merge, per_row
from .plans import AttentionShape, BlockPlan, ChunkedPlan, FlashPlan, RowPlan, live_slices, pass_plan


def attention_kernel(prelude: str, kind: str, shape: AttentionShape, outs: list[str], limits: dict,
                     partial: str | None = None) -> list[tuple[str, tuple[int, int, int]]]:
    """WGSL and workgroup grid of each dispatch of pass ``kind`` ("forward", "grad_q" or "grad_kv"); ``outs``
    names the output arrays: [out, lse] for forward ([out] where nothing reads the log-sum-exp), [dq] for grad_q,
    [dk, dv] for grad_kv. Where ``attention_splits`` is above 1 and ``partial`` names the scratch array, there are
    two dispatches: the slices, then their merge; with no ``partial`` (the scheduler had no storage binding left for
    it) one, unsliced."""
    plan = pass_plan(shape, kind, limits)
    if plan is None:  # (its sizes concrete: a dynamic graph's plan then holds for these alone)
        concrete_shape = replace(shape, batch=concrete(shape.batch), lq=concrete(shape.lq), lk=concrete(shape.lk))
        return [per_row.per_row_kernel(prelude, kind, concrete_shape, outs, limits)]
    if isinstance(plan, RowPlan):
        generate = per_row.sliced_forward
    elif isinstance(plan, FlashPlan):
        generate = flash.flash_forward  # read at call time: tests swap it for a spy
    elif isinstance(plan, ChunkedPlan):
        generate = chunked.chunked_forward
    else:
        assert isinstance(plan, BlockPlan)
        generate = {"forward": blocked.blocked_forward, "grad_q": blocked_grad.blocked_grad_q,
                    "grad_kv": blocked_grad.blocked_grad_kv}[kind]
    if plan.splits > 1 and partial is None:
        plan = replace(plan, splits=1, chunk=0)
    passes = [generate(prelude, shape, outs, plan, limits, partial)]
    if plan.splits > 1:
        passes.append(merge.merge_slices(prelude, shape, kind, outs, live_slices(shape, kind, plan), partial, limits))
    return passes
