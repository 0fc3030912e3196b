"""Vision models through backend="meganeura": HF ResNet-50 (train and eval) and a small diffusers U-Net.

Train mode compares logits, loss, every parameter gradient and the updated BatchNorm running statistics with
eager. Tolerances (the issue's): rtol 1e-3, atol 1e-4 elementwise, relative L2 1e-4 per tensor; gradients
whose RMS is below atol are zero in exact arithmetic and are checked elementwise only (helpers.compare).

ResNet-50 in train mode at batch 2 and 64x64 normalises its last stage over 8 values per channel, which
amplifies rounding enormously: eager float32 itself is 2e-4 (relative L2) from the float64 result on the logits
and 2e-2 to 5e-2 on most parameter gradients (measured). No float32 implementation can meet 1e-4 against eager
float32 there, so the reference is eager in float64 and each tensor may be off by the usual tolerances plus
a multiple of eager float32's own error (``helpers.compare.assert_as_accurate_as_eager``); ours measured 0.1x-0.9x
eager's relative L2 error on every tensor on lavapipe, up to 2.2x on the H200.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import torch_meganeura
from helpers.compare import assert_as_accurate_as_eager, assert_grads_match, assert_same, meganeura_warnings
from helpers.models import randomize_norms, resnet50

RTOL, ATOL, REL = 1e-3, 1e-4, 1e-4


def _compiled_step(model, loss_fn, *inputs):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="meganeura")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(*inputs)
        loss = loss_fn(out)
        loss.backward()
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    return out, loss


@pytest.mark.slow  # about a minute on the 2-core CI machine: the slow stage (docs/architecture.md, Tests)
def test_resnet50_train_step():
    model = resnet50().train()
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    x, labels = torch.randn(2, 3, 64, 64), torch.tensor([1, 0])
    out, loss = _compiled_step(model, lambda o: o.loss, x, labels)
    want, want64 = eager(x, labels), exact(x.double(), labels)
    want.loss.backward()
    want64.loss.backward()
    check = assert_as_accurate_as_eager
    check(out.logits, want.logits, want64.logits, rtol=RTOL, atol=ATOL, rel=REL, what="logits")
    check(loss, want.loss, want64.loss, rtol=RTOL, atol=ATOL, rel=REL, what="loss")
    triples = zip(model.named_parameters(), eager.parameters(), exact.parameters())
    for (name, p), q, r in triples:
        check(p.grad, q.grad, r.grad, rtol=RTOL, atol=ATOL, rel=REL, what=f"grad of {name}")
    for (name, buf), ref_buf, exact_buf in zip(model.named_buffers(), eager.buffers(), exact.buffers()):
        if buf.is_floating_point():
            check(buf, ref_buf, exact_buf, rtol=RTOL, atol=ATOL, rel=REL, what=f"buffer {name}")
        else:
            assert torch.equal(buf, ref_buf), f"buffer {name}"


def test_resnet50_eval():
    model = resnet50().eval()
    x = torch.randn(2, 3, 64, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="meganeura")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(x).logits
        want = model(x).logits
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    assert_same(got, want, rtol=RTOL, atol=ATOL, rel=REL, what="logits")


@pytest.mark.slow  # about a minute on the 2-core CI machine: the slow stage (docs/architecture.md, Tests)
def test_resnet50_explain_training_step():
    report = torch_meganeura.explain(resnet50().train(), torch.randn(2, 3, 32, 32), torch.tensor([1, 0]),
                                     loss_fn=lambda out: out.loss)
    assert report.fallback_ops == {}, report.fallback_ops
    assert report.mode.startswith("training step")
    assert report.dispatches > 0
    print(report)


def test_unet2d_forward_and_backward():
    UNet2DModel = pytest.importorskip("diffusers").UNet2DModel  # a test extra; absent on the GPU machine

    unet = randomize_norms(UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=8)).train()
    ref = copy.deepcopy(unet)

    class Denoise(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, t):
            return self.net(x, t).sample

    x, t = torch.randn(2, 3, 16, 16), torch.tensor([10, 500])
    target = torch.randn(2, 3, 16, 16)
    loss_fn = lambda out: torch.nn.functional.mse_loss(out, target)  # noqa: E731
    out, loss = _compiled_step(Denoise(unet), loss_fn, x, t)
    want = Denoise(ref)(x, t)
    loss_fn(want).backward()
    assert_same(out, want, rtol=RTOL, atol=ATOL, rel=REL, what="sample")
    assert_grads_match(unet, ref)
