"""compile_train_step on the loss functions users write, against eager torch.optim.

Selects and row-wise ops after a matmul (``m(x)[0].amax(-1)``, ``logits[0]`` into cross-entropy): the reproductions
of a fusion bug that renamed a coordinate twice and gave every selected row the first row's values, first-step
losses off by up to 6 %. HF's own ``labels=`` loss (GPT-2's calls ``logger.warning_once``), a layerdrop-style
data-dependent branch with a logging call (dynamo breaks the graph: the step runs the loss as several device graphs
with eager Python between them), and parameters the loss does not read (AdamW leaves them alone)."""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from helpers.compare import assert_within_eager_error
from torch_meganeura import compile_train_step

LOSS_RTOL = 1e-5
WEIGHT_RTOL, WEIGHT_ATOL = 1e-4, 1e-6
SELECT_LOSSES = {
    "amax": lambda m, x: m(x)[0].amax(-1).mean(),
    "exp": lambda m, x: m(x)[0].exp().mean(),
    "logsumexp": lambda m, x: torch.logsumexp(m(x)[0], -1).mean(),
    "square": lambda m, x: m(x).square().mean(),
}


def _grads(model, loss_fn, *batch):
    model.zero_grad()
    loss = loss_fn(model, *batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(SELECT_LOSSES))
def test_select_of_a_matmul_output_then_a_row_op(name):
    """The issue's reproduction: first-step loss equal to eager (rel 1e-5), every gradient within 2x eager float32's
    distance from float64."""
    loss_fn = SELECT_LOSSES[name]
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 1000))
    x = torch.randint(0, 1000, (1, 8))
    step = compile_train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.0))
    loss, grads = step.gradients(x)
    want, eager = _grads(model, loss_fn, x)
    exact_loss, exact = _grads(copy.deepcopy(model).double(), loss_fn, x)
    torch.testing.assert_close(loss, want, rtol=LOSS_RTOL, atol=0)
    for n in eager:
        assert_within_eager_error(grads[n], eager[n], exact[n], what=f"grad of {n}")


def _llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=1,
                  num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides})).train()


def test_cross_entropy_of_the_first_sequence_of_llama_logits():
    model = _llama()
    x = torch.randint(0, 100, (1, 12))
    t = torch.randint(0, 100, (12,))

    def loss_fn(m, x, t):
        return F.cross_entropy(m(x).logits[0], t)

    step = compile_train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.0))
    loss, grads = step.gradients(x, t)
    want, eager = _grads(model, loss_fn, x, t)
    _, exact = _grads(copy.deepcopy(model).double(), loss_fn, x, t)
    torch.testing.assert_close(loss, want, rtol=LOSS_RTOL, atol=0)
    for n in eager:
        assert_within_eager_error(grads[n], eager[n], exact[n], what=f"grad of {n}")


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _train_both(model, loss_fn, batches, steps, make_optimizer=_adamw):
    """``steps`` optimizer steps through compile_train_step and eagerly on a copy; (step, reference, losses)."""
    ref = copy.deepcopy(model)
    opt, ref_opt = make_optimizer(model.parameters()), make_optimizer(ref.parameters())
    step = compile_train_step(model, loss_fn, opt)
    losses = []
    for i in range(steps):
        batch = batches(i)
        torch.manual_seed(100 + i)
        got = step(*batch)
        torch.manual_seed(100 + i)
        ref_opt.zero_grad()
        want = loss_fn(ref, *batch)
        want.backward()
        ref_opt.step()
        losses.append((float(got), float(want)))
    step.sync_to_module()
    return step, ref, losses


def _assert_trained_alike(model, ref, losses):
    for i, (got, want) in enumerate(losses):
        assert got == pytest.approx(want, rel=1e-4), f"step {i}: loss {got} vs eager {want}"
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL,
                                   msg=lambda m: f"{n}: {m}")


def test_hf_labels_loss_with_a_logging_call_trains_as_one_graph():
    """GPT-2's ``labels=`` loss calls ``logger.warning_once``, which dynamo refuses under fullgraph; logging calls
    are no-ops inside the capture, so the step stays one device plan. SGD with momentum: the key bias's gradient is
    zero in exact arithmetic, and AdamW would scale eager's rounding noise there up to full-size steps."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # dropout off: eager and the device draw differently
    model = GPT2LMHeadModel(config).train()
    ids = [torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(i)) for i in range(5)]
    step, ref, losses = _train_both(model, lambda m, x: m(x, labels=x).loss, lambda i: (ids[i],), 5,
                                    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert step.graph_breaks == []
    _assert_trained_alike(model, ref, losses)


_log = logging.getLogger("tests.layerdrop")


class _DroppedBlock(torch.nn.Module):
    """HF Whisper's layerdrop (up to transformers 5.17): skip the block when a uniform draw is below ``p``."""

    def __init__(self, width: int, p: float):
        super().__init__()
        self.linear, self.p = torch.nn.Linear(width, width), p

    def forward(self, x):
        if self.training and torch.rand([]) < self.p:
            return x
        _log.debug("block ran")
        return x + torch.tanh(self.linear(x))


class _LayerDropNet(torch.nn.Module):
    def __init__(self, p: float, width: int = 16):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_DroppedBlock(width, p) for _ in range(3)])
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_data_dependent_branch_trains_as_device_graphs_with_eager_glue(p):
    """A branch on a random draw breaks dynamo's graph; the step still trains, weights and AdamW state resident,
    equal to eager where the branch is deterministic (p 0: every block runs; p 1: none does, and the loop's frame
    runs in eager PyTorch, reading the parameters the device updated)."""
    model = _LayerDropNet(p).train()
    x, t = torch.randn(5, 16), torch.randint(0, 4, (5,))
    with pytest.warns(UserWarning, match="Data-dependent branching"):
        step, ref, losses = _train_both(model, lambda m, x, t: F.cross_entropy(m(x), t), lambda i: (x, t), 4)
    assert step.graph_breaks and "Data-dependent" in step.graph_breaks[0]
    _assert_trained_alike(model, ref, losses)


def test_segments_whose_arenas_differ_train_alike():
    """Each segment of a step that breaks its graph is a program of its own, made, bound and run in turn, sharing
    the device's arena. At width 32 and 4 x 10 tokens the segments' arenas differ in size: the first program's
    params were bound after a later segment's run had replaced the arena, over the destroyed buffer, and the first
    step crashed (wgpu: "Buffer with 'arena' label has been destroyed"; HF Whisper-tiny's encoder alike)."""
    model = _LayerDropNet(0.0, width=32).train()
    batches = [(torch.randn(4, 10, 32), torch.randint(0, 4, (4, 10))) for _ in range(3)]
    loss_fn = lambda m, x, t: F.cross_entropy(m(x).flatten(0, 1), t.flatten())  # noqa: E731
    with pytest.warns(UserWarning, match="Data-dependent branching"):
        step, ref, losses = _train_both(model, loss_fn, lambda i: batches[i], 3,
                                        lambda params: torch.optim.AdamW(params, lr=1e-3))
    _assert_trained_alike(model, ref, losses)


def test_parameters_the_loss_does_not_read_are_left_alone():
    """Eager AdamW skips a parameter whose .grad is None (no weight decay); the step leaves it as it is too."""
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
    before = model["unused"].weight.detach().clone()
    x = torch.randn(3, 4)
    _, ref, losses = _train_both(model, lambda m, x: m["used"](x).square().mean(), lambda i: (x,), 3)
    _assert_trained_alike(model, ref, losses)
    assert torch.equal(model["unused"].weight.detach(), before)


def test_gradient_accumulation_through_device_graphs_with_eager_glue():
    """Two micro-batches per update through the segmented step (a layerdrop branch) against the usual loop of
    ``(loss / 2).backward()`` twice then ``step()``; a stale ``.grad`` left before the first call is not added."""
    model = _LayerDropNet(0.0).train()
    ref = copy.deepcopy(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # left by earlier eager code: the step must not add it
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    loss_fn = lambda m, x, t: F.cross_entropy(m(x), t)  # noqa: E731
    batches = [(torch.randn(5, 16), torch.randint(0, 4, (5,))) for _ in range(4)]
    with pytest.warns(UserWarning, match="Data-dependent branching"):
        step = compile_train_step(model, loss_fn, opt, accumulation_steps=2)
        got = [float(step(*b)) for b in batches]
    want = []
    for i, b in enumerate(batches):
        loss = loss_fn(ref, *b) / 2
        loss.backward()
        want.append(float(loss))
        if i % 2:
            ref_opt.step()
            ref_opt.zero_grad()
    assert got == pytest.approx(want, rel=1e-5)
    step.sync_to_module()
    _assert_trained_alike(model, ref, [])
