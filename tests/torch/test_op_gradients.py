"""Backward of each lowered op family through backend="meganeura": every input gradient against eager.

Each case is a function of float inputs (fresh random values, shifted away from the points where an op is not
differentiable); the compiled function's output is reduced with a random weighting so every output element
gets its own upstream gradient. Tolerances: rtol 1e-3, atol 1e-4, relative L2 1e-4 per gradient.
"""

import pytest
import torch
import torch.nn.functional as F

from helpers.compare import check_gradients_against_eager

RTOL, ATOL, REL = 1e-3, 1e-4, 1e-4
IDX = torch.tensor([2, 0, 2, 1])


def pos(x):
    return x.abs() + 0.5


CASES = {
    # pointwise derivatives
    "exp_log_sqrt": (lambda x: torch.exp(x * 0.5) + torch.log(pos(x)) + torch.sqrt(pos(x)) + torch.rsqrt(pos(x)),
                     [(3, 5)]),
    "trig_hyperbolic": (lambda x: torch.sin(x) * torch.cos(x) + torch.tanh(x) + torch.sigmoid(x) + torch.atan(x),
                        [(3, 5)]),
    "activations": (lambda x: F.relu(x) + F.gelu(x) + F.gelu(x, approximate="tanh") + F.silu(x) + F.elu(x)
                    + F.leaky_relu(x, 0.2) + F.hardtanh(x, -0.7, 0.8) + F.softplus(x), [(4, 6)]),
    "binary_broadcast": (lambda x, y: x * y + x / pos(y) - torch.maximum(x, y) + torch.minimum(x, y * 2),
                         [(2, 3, 4), (4,)]),
    "pow_abs_clamp_where": (lambda x, y: pos(x) ** y + x.abs() * 2 + x.clamp(-0.5, 0.7)
                            + torch.where(x > y, x * y, y - x), [(3, 4), (3, 4)]),
    "erf_square_reciprocal": (lambda x: torch.erf(x) + x.square() + torch.reciprocal(pos(x)), [(5,)]),
    # reductions and row programs
    "sum_mean_prod": (lambda x: x.sum(1) + x.mean(-1) * 3 + pos(x).prod(1), [(3, 4)]),
    "amax_max_min": (lambda x: x.amax(-1) + x.max(0).values.sum() + x.amin((0, 1)), [(4, 5)]),
    "var_std": (lambda x: x.var(-1) + x.std(0).sum() + torch.var_mean(x, 1)[0], [(4, 6)]),
    "softmax_log_softmax": (lambda x: F.softmax(x, -1) * 2 + F.log_softmax(x, 0), [(3, 7)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (6,), w, b, 1e-5), [(2, 3, 6), (6,), (6,)]),
    "rms_norm": (lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, [(2, 3, 8), (8,)]),
    "norm": (lambda x: torch.linalg.vector_norm(x, dim=-1) + x.norm() + x.norm(p=1, dim=0).sum()
             + torch.linalg.vector_norm(x, 3.0, dim=1), [(3, 5)]),
    "cumsum_cumprod": (lambda x: x.cumsum(1) + (x * 0.5).cumprod(0).sum(0), [(3, 6)]),
    # matmuls: the backward multiplies by transposed views
    "mm_addmm": (lambda a, b, c: a @ b + torch.addmm(c, a, b, beta=0.5, alpha=2.0), [(4, 6), (6, 5), (5,)]),
    "bmm_broadcast": (lambda a, b: torch.matmul(a, b), [(2, 3, 4, 5), (5, 6)]),
    "matvec_dot": (lambda a, v: a @ v + (v @ v), [(4, 5), (5,)]),
    "linear_transposed": (lambda x, w: F.linear(x, w).transpose(0, 1) @ x, [(4, 3), (2, 3)]),
    # views, cat, slices, indexing
    "views": (lambda x: x.permute(2, 0, 1).reshape(4, -1)[:, 1::2] * x.transpose(0, 2).flatten()[:12].view(4, 3)[:, :1],
              [(2, 3, 4)]),
    "cat_stack_split": (lambda x, y: torch.cat([x, y * 2], 1).split([2, 4], 1)[1]
                        + torch.stack([x, x], 0).sum(0).repeat(1, 2)[:, :4],
                        [(3, 2), (3, 4)]),
    "slice_select_pad": (lambda x: F.pad(x[:, 1:, ::2], (1, 2, 0, 1), value=0.5)[..., 0] + x.select(2, 2), [(2, 4, 5)]),
    "gather_index_select": (lambda x: x.gather(1, IDX.view(1, 4).expand(3, 4) % 3) + x.index_select(1, IDX).flip(0)
                            + x[IDX % 3].T,
                            [(3, 3)]),
    "diagonal_trace": (lambda x: torch.diagonal(x, 1) * 2 + torch.diagonal(x, -1, 1, 0).sum() + torch.trace(x[:, :4]),
                       [(4, 5)]),
    "unfold_erfc": (lambda x: x.unfold(1, 3, 2).sum(-1) * torch.special.erfc(x[:, 1::2]), [(2, 7)]),
    "sgn_circular_pad": (lambda x: torch.sgn(x) * x + F.pad(x, (2, 1), mode="circular")[..., 1:-2], [(2, 3, 5)]),
    "expand_broadcast_sum": (lambda x, y: (x.expand(3, 4, 5) * y).sum((0, 2)), [(4, 1), (3, 1, 5)]),
    "losses": (lambda x, t: F.mse_loss(x, t) + F.l1_loss(x, t) + F.smooth_l1_loss(x, t)
               + F.binary_cross_entropy_with_logits(x, t.sigmoid()),
               [(4, 5), (4, 5)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_op_gradient(name):
    fn, shapes = CASES[name]
    check_gradients_against_eager(fn, *[torch.randn(*s) for s in shapes], rtol=RTOL, atol=ATOL, rel=REL, what=name)
