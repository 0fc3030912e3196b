"""Pooling, upsampling and normalisation through backend="meganeura": forward and backward against eager.

Each case is a module run in train mode on fresh random inputs: the output, weighted by a random tensor, is
backpropagated, and the output, the input gradient, every parameter gradient and every buffer (BatchNorm's
running statistics) must match eager (rtol 1e-3, atol 1e-4, relative L2 1e-4) with no fallback warning.
Max pooling is also checked on ties (integer-valued inputs), NaN and -inf, where its indices and the routing of
the gradient must follow eager exactly.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.compare import assert_same, check_against_eager, meganeura_warnings

RTOL, ATOL, REL = 1e-3, 1e-4, 1e-4


def check_training(model: nn.Module, x: torch.Tensor):
    """Compile ``model``, run forward + backward on ``x`` and compare everything with an eager copy."""
    ref = copy.deepcopy(model)
    x = x.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="meganeura")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
        weight = torch.randn(out.shape)
        (out * weight).sum().backward()
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    want = ref(ref_x)
    (want * weight).sum().backward()
    assert_same(out, want, rtol=RTOL, atol=ATOL, rel=REL, what="output")
    assert_same(x.grad, ref_x.grad, rtol=RTOL, atol=ATOL, rel=REL, what="input gradient")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.grad, q.grad, rtol=RTOL, atol=ATOL, rel=REL, what=f"gradient of {name}")
    for (name, buf), ref_buf in zip(model.named_buffers(), ref.buffers()):
        assert_same(buf, ref_buf, rtol=RTOL, atol=ATOL, rel=REL, what=f"buffer {name}")


# ---------------------------------------------------------------------------------------------- pooling
MAX_POOLS = [  # kernel, stride, padding, dilation, ceil_mode
    (2, 1, 0, 1, False), (2, 2, 1, 1, True), (2, 2, 0, 2, False), (2, 1, 1, 2, True),
    (3, 1, 1, 1, False), (3, 2, 0, 1, True), (3, 2, 1, 2, False), (3, 1, 0, 2, True), (3, 2, 1, 1, True),
]


@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil_mode", MAX_POOLS)
def test_max_pool2d(kernel, stride, padding, dilation, ceil_mode):
    check_training(nn.MaxPool2d(kernel, stride, padding, dilation, ceil_mode=ceil_mode), torch.randn(2, 3, 8, 7))


def test_max_pool1d_and_unbatched():
    check_training(nn.MaxPool1d(3, 2, 1, ceil_mode=True), torch.randn(2, 3, 10))
    check_training(nn.MaxPool2d(3, 2, 1), torch.randn(3, 7, 6))


@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, 1), (2, 1, 0), (3, 2, 1)])
def test_max_pool2d_ties_route_like_eager(kernel, stride, padding):
    """Integer values make ties in most windows: eager takes the first maximum in scan order."""
    check_training(nn.MaxPool2d(kernel, stride, padding), torch.randint(0, 3, (2, 2, 7, 7)).float())
    x = torch.randint(0, 3, (2, 2, 7, 7)).float()
    check_against_eager(lambda t: F.max_pool2d(t, kernel, stride, padding, return_indices=True), x)


def test_max_pool2d_nan_and_all_minus_inf_windows():
    """A NaN wins its window (the last NaN in scan order, as eager); an all -inf window points at its first
    tap inside the input, also when the window starts in the padding. The gradient follows the indices."""
    x = torch.randn(1, 2, 6, 6)
    x[0, 0, 0:4, 0:4] = float("-inf")
    x[0, 1, 2, 2] = x[0, 1, 3, 3] = x[0, 1, 3, 1] = float("nan")
    check_training(nn.MaxPool2d(3, 1, 1), x)
    check_against_eager(lambda t: (F.max_pool2d(t, 3, 1, 1, return_indices=True),
                                   F.max_pool2d(t, 3, 1, 1, dilation=2, return_indices=True)), x)
    check_against_eager(lambda t: F.adaptive_max_pool2d(t, (4, 3), return_indices=True), x)


@pytest.mark.parametrize("kernel,stride,padding,ceil_mode,count_include_pad,divisor", [
    (2, 2, 0, False, True, None), (3, 1, 1, False, True, None), (3, 2, 1, True, True, None),
    (3, 2, 1, True, False, None), (2, 1, 1, False, False, None), (2, 2, 1, True, True, 3),
])
def test_avg_pool2d(kernel, stride, padding, ceil_mode, count_include_pad, divisor):
    pool = nn.AvgPool2d(kernel, stride, padding, ceil_mode, count_include_pad, divisor_override=divisor)
    check_training(pool, torch.randn(2, 3, 7, 8))


def test_avg_pool1d():
    check_training(nn.AvgPool1d(3, 2, 1, ceil_mode=True, count_include_pad=False), torch.randn(2, 3, 10))


@pytest.mark.parametrize("size,out", [((7, 5), (1, 1)), ((7, 5), (3, 3)), ((5, 7), (2, 4)), ((3, 4), (5, 6))])
def test_adaptive_avg_pool2d(size, out):
    check_training(nn.AdaptiveAvgPool2d(out), torch.randn(2, 3, *size))


@pytest.mark.parametrize("size,out", [((7, 5), (3, 3)), ((3, 4), (5, 6))])
def test_adaptive_max_pool2d(size, out):
    check_training(nn.AdaptiveMaxPool2d(out), torch.randn(2, 3, *size))


# ------------------------------------------------------------------------------------------- upsampling
@pytest.mark.parametrize("mode,align_corners,scale,size", [
    ("nearest", None, 1.5, None), ("nearest", None, None, (7, 9)), ("bilinear", False, 2, None),
    ("bilinear", True, 1.5, None), ("bilinear", False, None, (7, 9)),
])
def test_upsample(mode, align_corners, scale, size):
    up = nn.Upsample(size=size, scale_factor=scale, mode=mode, align_corners=align_corners)
    check_training(up, torch.randn(2, 3, 4, 5))


# ---------------------------------------------------------------------------------------- normalisation
@pytest.mark.parametrize("groups,affine", [(1, True), (2, True), (4, True), (2, False)])
def test_group_norm(groups, affine):
    norm = nn.GroupNorm(groups, 4, affine=affine)
    if affine:
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
    check_training(norm, torch.randn(2, 4, 5, 3) * 2 + 1)


@pytest.mark.parametrize("affine,track", [(False, False), (True, True)])
def test_instance_norm(affine, track):
    norm = nn.InstanceNorm2d(4, affine=affine, track_running_stats=track)
    check_training(norm, torch.randn(2, 4, 5, 3) * 2 + 1)


def test_batch_norm_train_updates_running_stats():
    norm = nn.BatchNorm2d(4).train()
    nn.init.normal_(norm.weight)
    check_training(norm, torch.randn(3, 4, 5, 3) * 2 + 1)
    assert norm.num_batches_tracked.item() == 1


def test_batch_norm_eval():
    norm = nn.BatchNorm2d(4)
    norm.running_mean.normal_()
    norm.running_var.uniform_(0.5, 2.0)
    check_training(norm.eval(), torch.randn(3, 4, 5, 3))
