"""Small models several test modules share, with non-default norm parameters (the defaults 1 and 0 would hide a
wrong load)."""
from __future__ import annotations

import torch
from torch import nn

# A two-layer HF Llama with grouped-query attention.
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, use_cache=False)


def randomize_layer_norms(module: nn.Module) -> nn.Module:
    """Non-trivial LayerNorm affine parameters; the module in eval mode."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.5)
                m.bias.normal_(0.0, 0.5)
    return module.eval()


def randomize_norms(model: nn.Module) -> nn.Module:
    """Non-trivial BatchNorm and GroupNorm affine parameters and running statistics."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.2)
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0.0, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    return model


def llama():
    """``LLAMA`` in eval mode, its RMSNorm weights randomized."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


def resnet50():
    """HF ResNet-50 with its default config, norms randomized."""
    from transformers import ResNetConfig, ResNetForImageClassification

    return randomize_norms(ResNetForImageClassification(ResNetConfig()))


def tiny_qwen2():
    """A 2-layer Qwen2 causal LM with grouped KV heads, the size of ``LLAMA``, in eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128)).eval()


def tiny_gemma():
    """A 2-layer Gemma causal LM (head_dim 16, grouped KV heads), the size of ``LLAMA``, in eval mode."""
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=128)).eval()
