"""Attention kernel generator: fused scaled-dot-product attention that never stores the (lq, lk) score matrix.

The caller's WGSL prelude declares the bindings and defines the loads the pass needs: ``load_q(b, h, i, c)``,
``load_k(b, h, j, c)``, ``load_v(b, h, j, c)`` (h is the query head; grouped-query attention maps it to its KV
head inside the load), optionally ``load_bias(b, h, i, j)`` (an additive mask), and for the backward passes
``load_dout(b, h, i, c)``, ``load_lse(b, h, i)`` and ``load_delta(b, h, i)`` (delta = rowsum(dout * out)).
Outputs are written contiguously into the arrays named by the caller.

Three passes (forward, grad_q, grad_kv), each in two forms, and the forward in two more:
  ``blocked``/``blocked_grad``  a block of rows per workgroup, one row per thread, tiles of the other sequence in
                                workgroup memory (head sizes up to d + dv = 160);
  ``per_row``                   one workgroup per row (otherwise; and a decode step's few query rows where flash
                                does not fit, cut into slices of the keys: ``plans.row_plan``);
  ``flash``                     the forward, register-tiled, its block of query rows resident in workgroup memory
                                (head sizes up to ``plans.FLASH_MAX_HEAD``, where the workgroup storage holds it);
  ``chunked``                   the flash forward's register tiles over chunks of the head size and of the value
                                tile, for long query sequences where ``flash`` does not fit (WebGPU's 16 KiB; head
                                sizes up to ``plans.CHUNKED_MAX_HEAD``).
Where row blocks are too few to fill the GPU, the other sequence is cut into slices whose partial results a second
dispatch merges (``merge``). A forward of a few query rows with a mask walks only the keys some row leaves unmasked
(``common.key_range``: a decode step over a static cache). ``plans`` picks the form (``forward_plan``: flash, per row
for a few rows, chunked, blocked, per row), rows per workgroup and slices; ``dispatch`` assembles a pass's
dispatches; ``common`` holds the WGSL pieces the passes share.
(Modules: ``blocked``, ``blocked_grad``, ``per_row``, ``flash``, ``chunked``, ``merge``, ``plans``, ``dispatch``,
``common``.)

A score at or below ``MASKED`` (an additive mask of -inf or the dtype's minimum) counts as masked out; a row with
every score masked outputs zeros (like PyTorch's math attention).

Tests that switch a form off patch the module that reads the name: ``plans.FLASH_MAX_HEAD``,
``plans.CHUNKED_MAX_HEAD``, ``flash.flash_forward``, ``chunked.chunked_forward``.
"""
from .common import MASKED, with_side_stores
from .dispatch import attention_kernel
from .plans import AttentionShape, BlockPlan, FlashPlan, attention_splits, flash_forward_fits, partial_floats

__all__ = ["MASKED", "AttentionShape", "BlockPlan", "FlashPlan", "attention_kernel", "attention_splits",
           "flash_forward_fits", "partial_floats", "with_side_stores"]
