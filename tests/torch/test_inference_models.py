"""Inference through backend="meganeura" against eager PyTorch: small MLPs, op-heavy models, HF Llama and BERT."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.compare import check_against_eager
from helpers.models import llama, randomize_layer_norms


class MLP(nn.Module):
    def __init__(self, approximate: str):
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.ln1 = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 24)
        self.ln2 = nn.LayerNorm(24, eps=1e-3)
        self.fc3 = nn.Linear(24, 5)
        self.approximate = approximate

    def forward(self, x):
        h = F.gelu(self.ln1(self.fc1(x)), approximate=self.approximate)
        h = F.gelu(self.ln2(self.fc2(h)), approximate=self.approximate)
        return self.fc3(h)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_mlp_layernorm_gelu(approximate):
    model = randomize_layer_norms(MLP(approximate))
    check_against_eager(model, torch.randn(2, 3, 12) * 2)


def test_gelu_modes_differ():
    """The two GELU modes give different results on these inputs, so the test above tells them apart."""
    x = torch.randn(64) * 3
    assert (F.gelu(x) - F.gelu(x, approximate="tanh")).abs().max() > 1e-4


def views(x, y):
    """Broadcasting, permutes, slicing with steps and negative bounds, select, cat and where."""
    a = x * y + 1.5  # (2, 3, 4, 5) * (5,)
    b = a.permute(0, 2, 3, 1)  # (2, 4, 5, 3)
    c = b[:, 1:, ::2, -2:]  # steps and a negative start
    d = x[:, -2:, 1::2, :-1]  # negative bounds, step 2 from 1
    e = x[..., -1]  # negative select: (2, 3, 4)
    f = x[:, :, 1:100:3]  # end past the size is clamped
    g = torch.cat([e, e * 2, x[:, :, :, 0]], dim=-1)  # (2, 3, 12)
    h = torch.cat([x[:1], x[1:] - 1], dim=0)
    i = torch.where(g > 0, g, -g * 0.5)
    j = torch.where(x[:, :1] > 0.3, 0.0, x)  # broadcast condition, scalar branch
    k = (x.transpose(1, 3) @ torch.ones(3, 2)).reshape(2, -1)  # transpose feeding a matmul, then a reshape
    return b, c, d, e, f, g, h, i, j, k


def test_views_broadcast_cat_where():
    check_against_eager(views, torch.randn(2, 3, 4, 5), torch.randn(5))


def test_split_chunk_expand_and_indexing():
    def fn(x, i, j):
        return (*x.split(2, dim=1), *x.chunk(3, dim=-1), *x.unbind(0), x.narrow(1, 1, 2), x.flatten(1),
                x.unsqueeze(1).expand(4, 3, 5, 6), x[:, None, 1:3].squeeze(1),
                x[i, j], x[:, i], x[i, :, j], x[i[:, None], j])  # advanced indexing, numpy placement rules

    check_against_eager(fn, torch.randn(4, 5, 6), torch.tensor([0, 3, -1]), torch.tensor([2, 4, 0]))


def test_reductions_longer_than_a_workgroup():
    """Rows of 1000 elements: threads stride over the row before the tree reduction."""
    def fn(x):
        return x.sum(-1), x.amax(-1), x.argmax(-1), torch.softmax(x, -1), x.var(-1), F.layer_norm(x, (1000,))

    check_against_eager(fn, torch.randn(3, 1000))


@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions_several_dims(keepdim):
    def reductions(x):
        return (
            x.sum(dim=(1, 3), keepdim=keepdim),
            x.sum(dim=(0, 2), keepdim=keepdim),
            x.mean(dim=(0, 2), keepdim=keepdim),
            x.mean(dim=-1, keepdim=keepdim),
            x.amax(dim=(1, 2), keepdim=keepdim),
            x.amin(dim=(0, 3), keepdim=keepdim),
            x.var(dim=(2, 3), keepdim=keepdim),
            x.var(dim=(0, 1), keepdim=keepdim, correction=0),
            x.argmax(dim=1, keepdim=keepdim),
            x.argmax(dim=-1, keepdim=keepdim),
            x.argmin(dim=0, keepdim=keepdim),
            x.argmax(),
            x.max(dim=2, keepdim=keepdim),
            x.sum(),
        )

    check_against_eager(reductions, torch.randn(2, 3, 4, 5))


def test_integer_reductions():
    """Reductions of int64 tensors compare and accumulate in integers (exactly)."""
    def reductions(i):
        return i.sum(dim=(0, 2)), i.amax(dim=1), i.argmax(dim=1), i.argmin(dim=2, keepdim=True), i.max(dim=0)

    check_against_eager(reductions, torch.randint(-50, 50, (3, 4, 5)))


def test_softmax_log_softmax():
    def softmaxes(x):
        return (
            torch.softmax(x, dim=-1),
            torch.softmax(x * 4, dim=1),
            torch.log_softmax(x, dim=-1),
            torch.log_softmax(x, dim=0),
            F.softmax(x.permute(2, 0, 1), dim=-1),
        )

    check_against_eager(softmaxes, torch.randn(3, 4, 6) * 3)


def test_integer_arithmetic():
    def arith(idx, x):
        a = (idx * 3 + 7) // 2 - idx % 3  # floor division and remainder of negatives
        b = torch.div(idx, 4, rounding_mode="trunc") + torch.div(idx, -3, rounding_mode="floor")
        c = idx.abs() - (-idx).clamp(min=-2, max=5)
        d = idx / 4  # true division promotes to float
        e = x * idx  # int tensor * float tensor -> float
        f = (idx > 2) & (idx < 8)
        g = torch.where(f, idx, -idx)
        h = idx.sum(dim=1, keepdim=True) * idx
        return a, b, c, d, e, f, g, h

    idx = torch.randint(-20, 20, (4, 6))
    check_against_eager(arith, idx, torch.randn(4, 6))


def test_bitwise_and_sign_ops():
    """Bitwise ops on int64 (computed in i32, exact for values in range), signbit/copysign on signed zeros and NaN,
    fmax/fmin ignoring NaN, rounding to decimals, isfinite (bool * bool in its decomposition)."""
    def ops(i, j, x, y):
        return (i & j, i | 5, i ^ j, ~i, torch.signbit(x), torch.copysign(x, y), torch.fmax(x, y), torch.fmin(x, y),
                torch.round(x * 100, decimals=1), torch.round(x * 1000, decimals=-2), torch.isfinite(x / y))

    i, j = torch.randint(-1000, 1000, (4, 6)), torch.randint(-1000, 1000, (4, 6))
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    x[0, :3] = torch.tensor([0.0, -0.0, float("nan")])
    y[0, :3] = torch.tensor([-0.0, float("nan"), 1.0])
    y[1, 0] = 0.0
    check_against_eager(ops, i, j, x, y)


def test_erfc_keeps_relative_precision_in_the_tail():
    """erfc(x) for large x is not 1 - erf(x) (which is 0 in float32 beyond x ~ 4)."""
    x = torch.cat([torch.linspace(-4, 9, 200), torch.tensor([float("nan"), float("inf"), -float("inf")])])
    check_against_eager(torch.special.erfc, x, rtol=2e-5, atol=0.0)


def test_diagonal_views():
    def diagonals(x):
        return (torch.diagonal(x), torch.diagonal(x, 2), torch.diagonal(x, -1, 1, 2), x.diagonal(0, -1, 0),
                torch.trace(x[0]), torch.diag_embed(x[0, 0]))

    check_against_eager(diagonals, torch.randn(3, 4, 5))


def test_llama_causal_lm_logits():
    model = llama()
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)

    def logits(ids, mask):
        return model(input_ids=ids, attention_mask=mask).logits

    check_against_eager(logits, ids, mask)


def test_llama_without_mask():
    """Without an attention mask transformers looks for packed sequences with ``cumsum``: on the device too."""
    model = llama()
    ids = torch.randint(0, 128, (1, 16))
    check_against_eager(lambda ids: model(input_ids=ids).logits, ids)


def test_bert_with_padding_mask():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, initializer_range=0.1)
    model = randomize_layer_norms(BertModel(config))
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, 11:] = 0
    mask[1, 5:] = 0
    types = torch.zeros(2, 16, dtype=torch.long)
    types[:, 8:] = 1

    def bert(ids, mask, types):
        return model(input_ids=ids, attention_mask=mask, token_type_ids=types)  # last_hidden_state, pooler_output

    check_against_eager(bert, ids, mask, types)
    with torch.no_grad():  # the mask matters: unmasking changes the first sequence's outputs
        other = model(input_ids=ids, token_type_ids=types).last_hidden_state
        assert (other[0] - model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state[0]
                ).abs().max() > 1e-3


@pytest.mark.parametrize("dims", [[0], [-1], [0, 2], []])
def test_flip(dims):
    check_against_eager(lambda x: torch.flip(x, dims) * x, torch.randn(2, 3, 4))


def test_cumsum_of_an_attention_mask_and_repeat():
    """Position ids from a padding mask (int64 cumsum), a float cumprod along dim 0, and repeat."""
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]])
    check_against_eager(lambda m, x: ((m.cumsum(-1) - 1) * m, (m > 0).cumsum(1), x.cumprod(0), x.repeat(2, 1, 3)),
                        mask, torch.rand(3, 4) + 0.5)
