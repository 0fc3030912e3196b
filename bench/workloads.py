"""The five benchmark workloads, built from public libraries with random weights (nothing is downloaded).

Each workload builds a fresh model (seeded, float32, on the CPU), makes a batch at the ``minimal`` size (batch 1,
one token, action chunk 1) or at the workload's ``full`` size, and says what a call computes: ``output`` (the
tensor inference returns and the correctness gate compares) and ``loss`` (the scalar a training step
differentiates). Dropout is off everywhere so that every competitor computes the same function. Every model also
runs as ``model.to(dtype)`` in bfloat16 and float16, fed the batch's float tensors in that dtype.

At the ``smoke`` scale every workload keeps its architecture but shrinks depth, widths or inputs, so that CI can
run the whole benchmark path (compile, gates, report) on a CPU Vulkan driver in seconds; timings at that scale
are not the benchmark.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

SIZES = ("minimal", "full")


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[bool], nn.Module]  # (smoke) -> model
    batch: Callable[[str, torch.Generator, bool], tuple]  # (size, generator, smoke) -> tensors
    output: Callable  # (model, *batch) -> tensor
    loss: Callable  # (model, *batch) -> scalar tensor
    train_mode: bool = True  # whether training steps run the module in train mode (``module.train()``)


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


# ---- ResNet-50 (HF transformers' default ResNetConfig is ResNet-50)

def _resnet50(smoke: bool) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    if smoke:
        return ResNetForImageClassification(ResNetConfig(embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1],
                                                         num_labels=10))
    return ResNetForImageClassification(ResNetConfig(num_labels=1000))


def _resnet_batch(size, gen, smoke):
    n = 1 if size == "minimal" else (2 if smoke else 4)
    side, labels = (32, 10) if smoke else (224, 1000)
    return _randn(gen, n, 3, side, side), torch.randint(0, labels, (n,), generator=gen)


RESNET50 = Workload(
    "resnet50", "HF ResNet-50 (default ResNetConfig), 224x224, batch 4 (minimal: 1), cross-entropy loss",
    _resnet50, _resnet_batch,
    output=lambda m, x, y: m(pixel_values=x).logits,
    loss=lambda m, x, y: F.cross_entropy(m(pixel_values=x).logits, y),
)


# ---- SmolLM2-135M (HF Llama with its configuration)

def _smollm2(smoke: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if smoke:
        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=72, intermediate_size=96,
                                            num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                                            max_position_embeddings=64, tie_word_embeddings=True))
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _token_batch(size, gen, smoke):
    ids = torch.randint(0, 256 if smoke else 49152, (1, 1 if size == "minimal" else (16 if smoke else 128)),
                        generator=gen)
    return (ids,)


SMOLLM2 = Workload(
    "smollm2", "HF Llama at SmolLM2-135M's config (576 hidden, 30 layers, 9/3 heads, vocab 49152, tied head), "
    "seq 128 (minimal: 1 token), next-token loss",
    _smollm2, _token_batch,
    output=lambda m, ids: m(input_ids=ids, use_cache=False).logits,
    loss=lambda m, ids: m(input_ids=ids, labels=ids, use_cache=False).loss,
)


# ---- SmolVLA's action expert (built from torch.nn: the expert is a small Llama-like decoder)

class _ExpertBlock(nn.Module):
    """Pre-norm block: self- or cross-attention (15 query heads, 5 KV heads, head_dim 64) and a SiLU-gated MLP."""

    def __init__(self, width: int, context_width: int, cross: bool, heads=15, kv_heads=5, head_dim=64, ffn=2048):
        super().__init__()
        self.cross, self.heads, self.kv_heads, self.head_dim = cross, heads, kv_heads, head_dim
        kv_in = context_width if cross else width
        self.norm1, self.norm2 = nn.RMSNorm(width, eps=1e-6), nn.RMSNorm(width, eps=1e-6)
        self.q = nn.Linear(width, heads * head_dim, bias=False)
        self.k = nn.Linear(kv_in, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(kv_in, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, width, bias=False)
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def _split(self, x, heads):
        return x.view(x.shape[0], x.shape[1], heads, self.head_dim).transpose(1, 2)

    def forward(self, x, context):
        h = self.norm1(x)
        source = context if self.cross else h
        q = self._split(self.q(h), self.heads)
        k, v = self._split(self.k(source), self.kv_heads), self._split(self.v(source), self.kv_heads)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ActionExpert(nn.Module):
    """SmolVLA's action expert shape: width 720, 16 layers alternating self- and cross-attention to a VLM context
    of width 320, action in/out projections (action dim 32) and a timestep embedding added to every action."""

    def __init__(self, width=720, layers=16, context_width=320, action_dim=32):
        super().__init__()
        self.action_in = nn.Linear(action_dim, width)
        self.time_mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList(_ExpertBlock(width, context_width, cross=i % 2 == 1) for i in range(layers))
        self.norm = nn.RMSNorm(width, eps=1e-6)
        self.action_out = nn.Linear(width, action_dim)
        self.width = width

    def forward(self, actions, context, t):
        half = self.width // 2
        freqs = torch.exp(-torch.arange(half, dtype=torch.float32, device=t.device) * (9.210340371976184 / half))
        angle = t[:, None] * freqs[None]  # float32 (promoted from a half t): then in the model's dtype
        temb = self.time_mlp(torch.cat([angle.sin(), angle.cos()], dim=-1).to(actions.dtype))
        x = self.action_in(actions) + temb[:, None]
        for block in self.blocks:
            x = block(x, context)
        return self.action_out(self.norm(x))


def _expert(smoke: bool) -> nn.Module:
    return ActionExpert(layers=2) if smoke else ActionExpert()


def _expert_batch(size, gen, smoke):
    chunk = 1 if size == "minimal" else (8 if smoke else 50)
    return (_randn(gen, 1, chunk, 32), _randn(gen, 1, 16, 320), torch.rand(1, generator=gen),
            _randn(gen, 1, chunk, 32))


SMOLVLA = Workload(
    "smolvla_expert", "SmolVLA action expert (torch.nn): width 720, 16 layers alternating self/cross-attention to "
    "16 context tokens of width 320, 15/5 heads, head_dim 64, FFN 2048, chunk 50 (minimal: 1), MSE loss",
    _expert, _expert_batch,
    output=lambda m, a, c, t, target: m(a, c, t),
    loss=lambda m, a, c, t, target: F.mse_loss(m(a, c, t), target),
)


# ---- A small Stable-Diffusion-style U-Net (diffusers UNet2DModel)

def _unet(smoke: bool) -> nn.Module:
    from diffusers import UNet2DModel

    if smoke:
        return UNet2DModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                           block_out_channels=(16, 32), norm_num_groups=8,
                           down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                           up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    return UNet2DModel(sample_size=32, in_channels=4, out_channels=4, layers_per_block=2,
                       block_out_channels=(64, 128, 256),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"))


def _unet_batch(size, gen, smoke):
    n, side = 1 if size == "minimal" else 2, 8 if smoke else 32
    return (_randn(gen, n, 4, side, side), torch.randint(0, 1000, (n,), generator=gen),
            _randn(gen, n, 4, side, side))


SD_UNET = Workload(
    "sd_unet", "diffusers UNet2DModel: base 64, 3 levels (attention in the lower two), 32x32x4, batch 2 "
    "(minimal: 1), MSE loss against noise",
    _unet, _unet_batch,
    output=lambda m, x, t, noise: m(x, t).sample,
    loss=lambda m, x, t, noise: F.mse_loss(m(x, t).sample, noise),
)


# ---- Whisper-tiny encoder

def _whisper_encoder(smoke: bool) -> nn.Module:
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(d_model=384, encoder_layers=1 if smoke else 4, encoder_attention_heads=6,
                        encoder_ffn_dim=1536, decoder_layers=1, decoder_attention_heads=6, decoder_ffn_dim=1536,
                        num_mel_bins=80, max_source_positions=16 if smoke else 1500)
    return WhisperModel(cfg).get_encoder()


def _mel_batch(size, gen, smoke):
    # the encoder takes exactly 2 x max_source_positions frames: minimal is the full size. The regression target:
    # a loss of the layer-normed output alone (mean(h^2) is 1 up to eps) has gradients that are rounding noise
    frames = 16 if smoke else 1500
    return _randn(gen, 1, 80, 2 * frames), _randn(gen, 1, frames, 384)


WHISPER = Workload(
    "whisper_tiny", "HF Whisper-tiny encoder (d_model 384, 4 layers, 6 heads), mel 80x3000, batch 1 (minimal is "
    "the same: the encoder takes exactly 3000 frames), MSE loss against a random target, training steps in eval "
    "mode (dropout is 0)",
    _whisper_encoder, _mel_batch,
    output=lambda m, mel, target: m(mel).last_hidden_state,
    loss=lambda m, mel, target: F.mse_loss(m(mel).last_hidden_state, target),
    # in train mode, older transformers (5.17) draw a random number per layer and branch on it for layerdrop, which
    # no whole-graph capture can follow; with dropout and layerdrop 0 (and no BatchNorm) eval computes the same
    train_mode=False,
)


WORKLOADS = {w.name: w for w in (RESNET50, SMOLLM2, SMOLVLA, SD_UNET, WHISPER)}
