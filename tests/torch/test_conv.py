"""Implicit-GEMM convolution against eager: forward, input gradient, weight gradient and bias gradient.

A covering sweep over stride {1, 2}, padding {0, 1, 'same'}, dilation {1, 2} and groups {1, 2, C} (every
combination; 'same' only with stride 1, as torch requires), with the kernel size cycling through {1, 3, 5, 7};
then conv1d and conv_transpose2d. Tolerances: rtol 1e-3, atol 1e-4, relative L2 1e-4.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

from helpers.compare import assert_same, check_gradients_against_eager

RTOL, ATOL, REL = 1e-3, 1e-4, 1e-4
C = 4  # input channels; groups C makes a depthwise convolution

SWEEP = [(s, p, d, g) for s, p, d, g in itertools.product((1, 2), (0, 1, "same"), (1, 2), (1, 2, C))
         if not (p == "same" and s == 2)]
KERNELS = (1, 3, 5, 7)


def check_conv(fn, x, w, bias):
    check_gradients_against_eager(fn, x, w, bias, rtol=RTOL, atol=ATOL, rel=REL, names=("input", "weight", "bias"))


@pytest.mark.parametrize("index", range(len(SWEEP)))
def test_conv2d(index):
    stride, padding, dilation, groups = SWEEP[index]
    k = KERNELS[index % len(KERNELS)]
    x = torch.randn(2, C, 14, 13)
    w = torch.randn(6 if groups != C else C, C // groups, k, k) * 0.3
    bias = torch.randn(w.shape[0])
    check_conv(lambda x, w, b: F.conv2d(x, w, b, stride, padding, dilation, groups), x, w, bias)


@pytest.mark.parametrize("k,stride,padding,dilation,groups", [
    (3, 1, 1, 1, 1), (5, 2, 2, 1, 2), (3, 1, "same", 2, C), (1, 2, 0, 1, 1), (7, 3, 3, 1, 1), (4, 1, "same", 1, 1)])
def test_conv1d(k, stride, padding, dilation, groups):
    x = torch.randn(2, C, 17)
    w = torch.randn(6 if groups != C else C, C // groups, k) * 0.3
    check_conv(lambda x, w, b: F.conv1d(x, w, b, stride, padding, dilation, groups), x, w, torch.randn(w.shape[0]))


@pytest.mark.parametrize("k,stride,padding,output_padding,dilation,groups", [
    (3, 1, 0, 0, 1, 1), (3, 2, 1, 1, 1, 1), (4, 2, 1, 0, 1, 2), (3, 2, 1, 1, 2, C), (5, 3, 2, 2, 1, 1),
    (1, 1, 0, 0, 1, 2)])
def test_conv_transpose2d(k, stride, padding, output_padding, dilation, groups):
    x = torch.randn(2, C, 5, 6)
    w = torch.randn(C, 6 // groups if groups != C else 1, k, k) * 0.3
    bias = torch.randn(w.shape[1] * groups)
    check_conv(lambda x, w, b: F.conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation),
               x, w, bias)


def test_conv3d_falls_back_visibly():
    x, w = torch.randn(1, 2, 4, 4, 4), torch.randn(3, 2, 3, 3, 3)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: F.conv3d(x, w), backend="meganeura")
    with pytest.warns(UserWarning, match="3-D convolution"):
        out = compiled(x, w)
    torch.testing.assert_close(out, F.conv3d(x, w), rtol=1e-5, atol=1e-5)


def test_bias_residual_and_activation_run_in_the_conv_kernel():
    import torch_meganeura

    conv = torch.nn.Conv2d(C, 6, 3, padding=1)
    x, residual = torch.randn(2, C, 8, 8), torch.randn(2, 6, 8, 8)
    with torch.no_grad():
        report = torch_meganeura.explain(lambda x, r: F.relu(conv(x) + r), x, residual)
        torch._dynamo.reset()
        got = torch.compile(lambda x, r: F.relu(conv(x) + r), backend="meganeura")(x, residual)
        want = F.relu(conv(x) + residual)
    assert report.fallback_ops == {} and report.dispatches == 1, str(report)
    assert_same(got, want, rtol=RTOL, atol=ATOL, rel=REL)
