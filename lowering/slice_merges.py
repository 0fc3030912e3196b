"""Slice merges read by their consumer: a forward attention pass cut into slices of the keys (flash-decoding) whose
output only a matrix-vector product reads loses its merge dispatch; the product merges the slices' partial results as
it loads its vector.

A decode step's attention has one query row per head, too few workgroups to fill a GPU, so the keys are cut into
slices whose partial results (each row's unnormalised output, running max and sum) a second dispatch merges
(``kernels.attention.merge``), and the output projection then reads the merged rows as its vector. Here that
projection's kernel (the gemv over columns) computes its vector once per workgroup into workgroup memory (the gemv's
``staged`` row), each element merged from the slices (``merge.merged_function``): one dispatch per layer fewer, for
every model whose attention output goes straight into a projection (Llama, Qwen2, Gemma, GPT-2). The slices' scratch
then lives until the projection's step, and the attention's own output, never written, has neither arena space nor a
binding (``schedule``).

It applies where the attention pass stores no log-sum-exp (``fusion`` drops an unread one), its output has no buffer
of its own, one kernel reads it, a one-row product over columns that loads it only in its vector (not its matrix,
epilogue, further products or row prologue), unsliced itself, with concrete sizes and a row that fits the workgroup
storage (``gemv_stage_fits``).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from meganeura.kernels import matmul_plans
from meganeura.kernels.attention.merge import merged_function
from meganeura.kernels.attention.plans import attention_live_slices
from meganeura.kernels.matmul_gemv import gemv_stage_fits
from meganeura.kernels.sizes import is_size

from . import expr as E
from .ir import Attention, Matmul, Node
from .node_kernels import attention_shape


class SliceMerge(NamedTuple):
    """An attention pass whose slices its reader merges: the pass, its reader and the reader's step, and how many
    slices a run launches (``kernels.attention.plans.live_slices``: a size where a KV cache's length is)."""
    attention: Attention
    reader: Matmul
    reader_step: int
    live: object  # int or kernels.sizes.Size


def slice_merges(kernels: list[Node], placement: dict, limits: dict, variants: dict,
                 slices: Callable[[Node], int]) -> dict[int, SliceMerge]:
    """{id of the attention node: its ``SliceMerge``} for the passes whose merge their reader takes (the module
    docstring says where); ``slices(node)``: how many slices the scheduler cuts ``node`` into."""
    readers: dict[int, list[int]] = {}
    for step, node in enumerate(kernels):
        for vid in {ld.args[0] for e in node.exprs() for ld in E.loads_of(e)}:
            readers.setdefault(vid, []).append(step)
    merges = {}
    for node in kernels:
        if not (isinstance(node, Attention) and node.kind == "forward" and len(node.own_outs) == 1):
            continue
        out = node.out
        steps = readers.get(out.id, [])
        if out.id in placement or len(steps) != 1 or slices(node) < 2:
            continue
        reader = kernels[steps[0]]
        if _reads_as_vector(reader, out.id, limits, variants) and _concrete(node):
            live = attention_live_slices(attention_shape(node), "forward", limits)
            merges[id(node)] = SliceMerge(node, reader, steps[0], live)
    return merges


def _reads_as_vector(reader: Node, vid: int, limits: dict, variants: dict) -> bool:
    """Whether ``reader`` is an unsliced gemv over columns that loads ``vid`` in its vector alone, with room to stage
    that vector."""
    if not isinstance(reader, Matmul) or reader.rows != 1 or matmul_plans.is_tiled(reader.rows, reader.columns):
        return False
    if variants[id(reader)].split != 1 or any(map(is_size, (reader.batch, reader.columns, reader.k))):
        return False
    others = reader.exprs()[1:]
    if any(ld.args[0] == vid for e in others for ld in E.loads_of(e)):
        return False
    return gemv_stage_fits(reader.k, len(reader.products), limits)


def _concrete(node: Attention) -> bool:
    """Whether the pass's output rows and head size are concrete (the merge reads its scratch by them)."""
    s = attention_shape(node)
    return not any(map(is_size, (s.batch, s.heads, s.lq, s.dv)))


class ReaderMerge(NamedTuple):
    """What the reader of a merged pass needs: the output's value id, the arena key of the slices' scratch, the
    pass's shape and the slices it reads (those a run launches)."""
    vid: int
    key: int
    shape: object  # kernels.attention.AttentionShape
    live: object  # int or kernels.sizes.Size

    @classmethod
    def of(cls, merge: SliceMerge, scratch: tuple[int, int]) -> ReaderMerge:
        """The reader's view of ``merge``, whose attention pass has ``scratch`` (slices, arena key)."""
        _, key = scratch
        return cls(merge.attention.out.id, key, attention_shape(merge.attention), merge.live)

    def read(self, slot: int, index: E.Expr) -> E.Expr:
        """Element ``index`` of the output, merged from the scratch bound at ``slot``."""
        return E.call(f"mg_merged{slot}", index)

    def function(self, slot: int, name: Callable[[int], str]) -> str:
        """WGSL of the function ``read`` calls, over the scratch bound at ``slot`` (``name``: slot -> WGSL name)."""
        return merged_function(f"mg_merged{slot}", self.shape, self.live, name(slot))
