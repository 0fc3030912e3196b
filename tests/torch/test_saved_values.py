"""What a training graph's forward saves (torch_meganeura/backend/saved_values.py): torch's min-cut partition, or its
aggressive one where that saves a quarter fewer bytes, never computing the attention forward again."""
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import _size_of, min_cut_rematerialization_partition

from torch_meganeura.lower.decompositions import aot_decomposition_table
from torch_meganeura.backend.saved_values import partition_joint


def _partition(fn, inputs, partition_fn):
    """The forward's saved bytes and the backward graph's call targets under ``partition_fn``."""
    graphs = {}

    def keep(name):
        def compiler(gm, _example):
            graphs[name] = gm
            return make_boxed_func(gm)
        return compiler

    compiled = aot_function(fn, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                            partition_fn=partition_fn, decompositions=aot_decomposition_table())
    compiled(*inputs).sum().backward()
    outputs = graphs["forward"].graph.find_nodes(op="output")[0].args[0][1:]  # past the one user output
    saved = sum(_size_of(n) for n in outputs if isinstance(n.meta.get("val"), torch.Tensor))
    targets = {n.target for n in graphs["backward"].graph.nodes if n.op == "call_function"}
    return saved, targets


def _inputs(*shapes):
    return [torch.randn(*s, requires_grad=True) for s in shapes]


def test_a_pointwise_chain_between_matmuls_is_computed_again():
    """LayerNorm then GELU feeding a matmul: the backward computes the GELU's output again in its loads, so the
    forward saves at least a quarter less than torch's default partition."""
    def fn(x, w1, w2):
        h = F.gelu(F.layer_norm(x, (64,)) @ w1)
        return F.gelu(h * 1.5 + 0.5) @ w2

    inputs = _inputs((256, 64), (64, 256), (256, 64))
    default, _ = _partition(fn, inputs, min_cut_rematerialization_partition)
    ours, _ = _partition(fn, inputs, partition_joint)
    assert ours <= 0.75 * default, (ours, default)


def test_the_attention_forward_is_never_computed_again():
    """A layer where the aggressive partition is taken (its pointwise chains computed again) keeps the attention's
    output and statistics: torch's aggressive partition would compute the attention again in the backward."""
    def fn(x, w, w2):
        qkv = (F.gelu(F.layer_norm(x, (32,)) * 1.5 + 0.5) @ w).view(2, 64, 3, 2, 16).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape(2, 64, 32)
        return F.gelu(F.gelu(out * 1.5 + 0.5) @ w2 + 0.5)

    inputs = _inputs((2, 64, 32), (32, 96), (32, 128))
    default, _ = _partition(fn, inputs, min_cut_rematerialization_partition)
    ours, targets = _partition(fn, inputs, partition_joint)
    assert ours <= 0.75 * default, (ours, default)  # the aggressive partition
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in targets
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default in targets


def test_where_recomputing_saves_little_the_default_partition_stays():
    def fn(x, w1, w2):
        return (x @ w1) @ w2

    inputs = _inputs((32, 16), (16, 16), (16, 8))
    assert _partition(fn, inputs, partition_joint)[0] == _partition(fn, inputs, min_cut_rematerialization_partition)[0]
