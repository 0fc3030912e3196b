"""What a training graph's forward keeps for its backward: torch's min-cut partition, recomputing more.

aot_autograd splits the joint graph with ``min_cut_rematerialization_partition``, which saves what the backward
reads unless it may recompute it cheaply. Its default bans on recomputation are Inductor's costs: a value a matmul
or a convolution reads in the backward would be written to memory there again, a long chain of pointwise ops would
be computed twice, an op outside a short allowlist might be slow. Here the backward's fusion computes such values
inside the loads of the kernels that read them (a GELU output in a matmul's operand load, BatchNorm and ReLU in a
convolution's gather), or in the backward's arena for the kernels in between, which lives one run; what the forward
saves lives from the forward to the end of the backward, beside every gradient. So the partition also runs with
torch's ``aggressive_recomputation`` (every ban lifted but those of reductions, random and compute-intensive ops:
matmuls and convolutions are never computed twice, nor here the attention forward), and that partition is taken
where it saves a quarter less (``AGGRESSIVE_MIN_SAVING``). The operands of the attention backward are saved too: its
kernels read them from memory (no producer fuses into their loads), so a rotary embedding or repeated KV heads computed
again would cost kernels of their own; they are saved, as eager PyTorch saves them.

Full size (``python -m bench.memory --null-device``), the kept loop's peak MiB and dispatches of 3 steps, torch's
default partition -> aggressive: Whisper-tiny 356.8 -> 279.7 MiB, 1,053 -> 1,014 dispatches; ResNet-50 791.5 ->
663.2; SD U-Net 327.3 -> 308.1; but SmolLM2 2,362 -> 2,309 MiB for 6,444 -> 7,095 dispatches (its saved values are
mostly what no recomputation removes: matmul outputs, attention operands), so there the default partition stays.
"""
from __future__ import annotations

import torch
import torch._functorch.config as functorch_config
from torch._functorch.partitioners import _size_of, min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten

# Forward ops torch's aggressive partition would compute again (it bans only matmuls, convolutions, reductions and
# random ops): the attention forward is a matmul pair, as costly again in the backward.
NEVER_AGAIN = (aten._scaled_dot_product_flash_attention_for_cpu.default,)
# Backward ops whose tensor operands are read from memory as they are: computing one again costs a kernel.
OPERANDS_SAVED = (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,)
# The aggressive partition is taken where it saves at least this fraction less than the default one: below, the
# backward's extra kernels cost more than the bytes are worth (SmolLM2: 2 % less memory for 10 % more dispatches).
AGGRESSIVE_MIN_SAVING = 0.25


def partition_joint(joint_module, joint_inputs, *, num_fwd_outputs: int, **kwargs):
    """torch's default min-cut partition, or its ``aggressive_recomputation`` one where that saves
    ``AGGRESSIVE_MIN_SAVING`` less (the module docstring)."""
    kwargs["num_fwd_outputs"] = num_fwd_outputs
    default = min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
    for node in _must_save(joint_module.graph):
        node.meta.setdefault("recompute", CheckpointPolicy.MUST_SAVE)
    with functorch_config.patch(aggressive_recomputation=True):
        aggressive = min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
    saved = [_saved_bytes(forward, num_fwd_outputs) for forward, _ in (default, aggressive)]
    return aggressive if saved[1] <= (1 - AGGRESSIVE_MIN_SAVING) * saved[0] else default


def _must_save(graph) -> list:
    """The nodes the backward must not compute again: ``NEVER_AGAIN`` ops and the operands of ``OPERANDS_SAVED``."""
    return [operand for node in graph.nodes if node.op == "call_function"
            for operand in ([node] if node.target in NEVER_AGAIN else
                            node.all_input_nodes if node.target in OPERANDS_SAVED else [])]


def _saved_bytes(forward, num_fwd_outputs: int) -> int:
    """The bytes of what ``forward`` saves for the backward (its outputs past the user's), at the sizes' hints."""
    outputs = forward.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:]
    return sum(_size_of(node) for node in outputs if isinstance(node.meta.get("val"), torch.Tensor))
