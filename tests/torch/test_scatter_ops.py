"""Scatter-family ops against eager: scatter, scatter_add, scatter_reduce, index_put, slice/select/diagonal
scatter and constant_pad_nd, plus the backward graphs that emit them (embedding, cross-entropy, slicing)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers.compare import assert_same, check_against_eager, device_counters, meganeura_warnings

aten = torch.ops.aten

# (self shape, dim, index shape): index may be shorter than self off ``dim`` and longer along it
SCATTER_CASES = {
    "1d": ((5,), 0, (7,)),
    "2d_dim0": ((4, 5), 0, (6, 3)),
    "2d_dim1": ((4, 5), 1, (3, 7)),
    "3d_dim1": ((3, 4, 5), 1, (2, 6, 5)),
    "3d_dim-1": ((3, 4, 5), -1, (3, 2, 3)),
}


def _scatter_inputs(case, unique=False):
    shape, dim, ishape = SCATTER_CASES[case]
    x = torch.randn(shape)
    if unique:  # distinct targets along dim, so an overwrite has one winner
        ishape = tuple(min(s, shape[dim]) if d == dim % len(shape) else s for d, s in enumerate(ishape))
        full = tuple(shape[dim] if d == dim % len(shape) else s for d, s in enumerate(ishape))
        index = torch.argsort(torch.rand(full), dim=dim).narrow(dim, 0, ishape[dim])
    else:
        index = torch.randint(0, shape[dim], ishape)
    src = torch.randn(tuple(s + 1 for s in ishape))  # src may be larger than index
    return x, dim, index, src


@pytest.mark.parametrize("case", list(SCATTER_CASES))
def test_scatter_add(case):
    x, dim, index, src = _scatter_inputs(case)
    check_against_eager(lambda x, i, s: torch.scatter_add(x, dim, i, s), x, index, src)


@pytest.mark.parametrize("case", list(SCATTER_CASES))
def test_scatter_src_and_value(case):
    x, dim, index, src = _scatter_inputs(case, unique=True)
    check_against_eager(lambda x, i, s: (torch.scatter(x, dim, i, s), x.scatter(dim, i, 2.5)), x, index, src)


def test_scatter_int64_and_0d():
    x, index, src = torch.randint(-9, 9, (4, 5)), torch.randint(0, 5, (4, 6)), torch.randint(-9, 9, (4, 6))
    check_against_eager(lambda x, i, s: torch.scatter_add(x, 1, i, s), x, index, src)
    x0, i0, s0 = torch.randn(()), torch.tensor(0), torch.randn(())
    check_against_eager(lambda x, i, s: (torch.scatter_add(x, 0, i, s), torch.scatter(x, 0, i, s)), x0, i0, s0)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
def test_scatter_reduce(reduce, include_self):
    x, index, src = torch.randn(4, 5), torch.randint(0, 4, (4, 6)), torch.randn(4, 7)  # column 4 never hit

    def fn(x, i, s):
        return torch.scatter_reduce(x, 1, i, s, reduce, include_self=include_self)

    check_against_eager(fn, x, index, src)


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax"])
def test_scatter_reduce_int64(reduce):
    x, index, src = torch.randint(-9, 9, (3, 5)), torch.randint(0, 5, (3, 8)), torch.randint(-9, 9, (3, 8))
    check_against_eager(lambda x, i, s: torch.scatter_reduce(x, 1, i, s, reduce), x, index, src)


# ------------------------------------------------------------------------------------------- index_put
def _index_put_cases():
    """name -> (self, indices (None = full slice), values, accumulate)."""
    t = torch.tensor
    return {
        "embedding_backward": (torch.zeros(7, 3), [t([[1, 6, 1], [0, 1, 6]])], torch.randn(2, 3, 3), True),
        "1d_duplicates": (torch.randn(6), [t([0, 5, 5, 2, 0, 5])], torch.randn(6), True),
        "negative_accumulate": (torch.randn(6, 4), [t([-1, 2, 5, -6])], torch.randn(4, 4), True),
        "negative_overwrite": (torch.randn(6, 4), [t([-1, 2, 0])], torch.randn(3, 4), False),
        "two_indices_broadcast": (torch.randn(4, 5), [t([[0], [3], [1]]), t([4, 0])], torch.randn(3, 2), False),
        "two_indices_accumulate": (torch.randn(4, 5), [t([0, 1, 1, 0]), t([2, 3, 3, 2])], torch.randn(4), True),
        "values_broadcast": (torch.randn(4, 5), [t([2, 0])], torch.randn(1, 5), False),
        "scalar_value": (torch.randn(4, 5), [t([3, 1]), t([0, 4])], torch.randn(()), False),
        "slice_before": (torch.randn(3, 4, 5), [None, t([3, 0])], torch.randn(3, 2, 5), True),
        "slice_between": (torch.randn(3, 4, 5), [t([2, 0]), None, t([[1, 4]])], torch.randn(2, 4), False),
        "int32_index_3d": (torch.randn(3, 4, 5), [t([1, 1], dtype=torch.int32)], torch.randn(2, 4, 5), True),
        "int64_self": (torch.randint(-5, 5, (5, 2)), [t([4, 4, 0])], torch.randint(-5, 5, (3, 2)), True),
        # fewer entries than rows: the sparse path (representative per row, then per-target sums)
        "sparse_accumulate": (torch.randn(50, 4), [t([[3, 7, 3, 49], [0, 3, -1, 7]])], torch.randn(2, 4, 4), True),
        "sparse_overwrite_duplicates": (torch.randn(20, 3), [t([5, 2, 5, 19, 5])], torch.randn(5, 3), False),
        "sparse_two_indices_slice": (torch.randn(6, 3, 7), [t([5, 0, 5]), None, t([6, 1, 6])], torch.randn(3, 3),
                                     True),
    }


@pytest.mark.parametrize("name", list(_index_put_cases()))
def test_index_put(name):
    x, indices, values, accumulate = _index_put_cases()[name]
    tensors = [i for i in indices if i is not None]

    def fn(x, values, *tensors):
        it = iter(tensors)
        return aten.index_put.default(x, [None if i is None else next(it) for i in indices], values, accumulate)

    check_against_eager(fn, x, values, *tensors)


def test_index_put_through_setitem():
    def fn(x, i, j, v):
        y = x.clone()
        y[i, j] += v
        y[:, j[0]] = 0.5
        return y

    check_against_eager(fn, torch.randn(4, 5), torch.tensor([0, 3, 1]), torch.tensor([2, 4, 0]), torch.randn(3))


def test_boolean_index_put_falls_back():
    def fn(x, mask, v):
        return aten.index_put.default(x, [mask], v, True)

    x, mask = torch.randn(5, 3), torch.tensor([True, False, True, True, False])
    compiled = check_against_eager(fn, x, mask, torch.randn(3), allow_fallback=True, on_device=False)
    assert any("index_put" in w and "boolean" in w for w in compiled.meganeura_warnings), compiled.meganeura_warnings


# ------------------------------------------------------------------------- slice/select/diagonal, padding
@pytest.mark.parametrize("dim,start,end,step", [(0, 1, 4, 1), (1, 0, 5, 2), (1, -4, 4, 3), (-1, 2, 2, 1)])
def test_slice_scatter(dim, start, end, step):
    x = torch.randn(4, 5)
    src = torch.randn_like(x[:, start:end:step] if dim % 2 else x[start:end:step])
    check_against_eager(lambda x, s: torch.slice_scatter(x, s, dim, start, end, step) * 2, x, src)


def test_slice_scatter_3d_int():
    x, src = torch.randint(-9, 9, (2, 6, 3)), torch.randint(-9, 9, (2, 2, 3))
    check_against_eager(lambda x, s: torch.slice_scatter(x, s, 1, 1, 6, 3), x, src)


@pytest.mark.parametrize("dim,index", [(0, 1), (1, -1), (2, 0)])
def test_select_scatter(dim, index):
    x = torch.randn(2, 3, 4)
    src = torch.randn_like(x.select(dim, index))
    check_against_eager(lambda x, s: torch.select_scatter(x, s, dim, index), x, src)


@pytest.mark.parametrize("offset,dim1,dim2", [(0, 0, 1), (1, 0, 1), (-2, 1, 0), (1, 2, 0)])
def test_diagonal_scatter(offset, dim1, dim2):
    x = torch.randn(4, 5, 3)
    src = torch.randn_like(torch.diagonal(x, offset, dim1, dim2))
    check_against_eager(lambda x, s: torch.diagonal_scatter(x, s, offset, dim1, dim2), x, src)


@pytest.mark.parametrize("shape,pad", [((5,), (2, 1)), ((3, 4), (1, 0, 2, 3)), ((3, 4), (-1, 2, 0, -2)),
                                       ((2, 3, 4), (1, 1, -1, 2, 1, 0)), ((2, 3, 4), (-2, -1))])
def test_constant_pad_nd(shape, pad):
    x = torch.randn(shape)
    check_against_eager(lambda x: (F.pad(x, pad, value=-1.5), F.pad(x, pad)), x)


def test_constant_pad_nd_int():
    check_against_eager(lambda x: F.pad(x, (2, -1), value=7), torch.randint(-9, 9, (3, 4)))


# ------------------------------------------------------------------------------------ backward graphs
def _grads(loss_fn, params, *inputs, compile: bool):
    """(loss, grads) of ``loss_fn`` (compiled or eager), with the meganeura warnings and device submits."""
    fn = loss_fn
    if compile:
        torch._dynamo.reset()
        fn = torch.compile(loss_fn, backend="meganeura")
    for p in params:
        p.grad = None
    before = device_counters()["submits"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = fn(*params, *inputs)
        loss.backward()
    grads = [p.grad.clone() for p in params]
    return loss.detach(), grads, meganeura_warnings(caught), device_counters()["submits"] - before


def _check_training(loss_fn, params, *inputs):
    want_loss, want_grads, _, _ = _grads(loss_fn, params, *inputs, compile=False)
    loss, grads, caught, submits = _grads(loss_fn, params, *inputs, compile=True)
    assert caught == [], caught
    assert submits > 0
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_embedding_backward_on_device():
    weight = torch.randn(11, 4, requires_grad=True)
    idx = torch.tensor([[3, 1, 3, 10], [0, 3, 1, 1]])  # repeated rows accumulate

    def loss_fn(weight, idx):
        return (F.embedding(idx, weight) * torch.arange(4.0)).pow(2).sum()

    _check_training(loss_fn, [weight], idx)


def test_cross_entropy_backward_on_device():
    logits = torch.randn(6, 5, requires_grad=True)
    target = torch.tensor([1, 4, 0, 4, -100, 2])  # ignore_index included

    def loss_fn(logits, target):
        return F.cross_entropy(logits, target) + F.nll_loss(torch.log_softmax(logits, 1), target.clamp(min=0))

    _check_training(loss_fn, [logits], target)


def test_pad_and_slice_backward_on_device():
    x = torch.randn(4, 6, requires_grad=True)

    def loss_fn(x):
        return (F.pad(x, (1, -2, 2, 0), value=0.5).sin().sum() + x[1:3, 1:5:2].cos().sum()
                + x[:, 2].exp().sum())

    _check_training(loss_fn, [x])


def test_open_ended_slice_backward_on_device():
    x = torch.randn(4, 6, requires_grad=True)
    _check_training(lambda x: x[:, 2:].sin().sum(), [x])


# ----------------------------------------------------------------------------------- out-of-range indices
def _scatter_add_case():
    def fn(x, i):
        return torch.scatter_add(x, 1, i, torch.ones(3, 2)) * 2
    return fn, torch.randn(3, 4), torch.tensor([[0, 3], [1, 1], [2, 0]]), [torch.tensor([[0, 4], [1, 1], [2, 0]]),
                                                                           torch.tensor([[0, 1], [-1, 1], [2, 0]])]


def _scatter_case():
    def fn(x, i):
        return torch.scatter(x, 0, i, 1.0) + 1
    return fn, torch.randn(3, 4), torch.tensor([[0, 2, 1, 1]]), [torch.tensor([[0, 3, 1, 1]])]


def _index_put_case():
    def fn(x, i):
        return aten.index_put.default(x, [i], torch.ones(3, 2), True) * 2
    return fn, torch.randn(4, 2), torch.tensor([0, 3, -4]), [torch.tensor([0, 4, 1]), torch.tensor([-5, 0, 1])]


@pytest.mark.parametrize("case", [_scatter_add_case, _scatter_case, _index_put_case],
                         ids=["scatter_add", "scatter", "index_put"])
def test_index_out_of_range(case):
    fn, x, good, bads = case()
    compiled = check_against_eager(fn, x, good)
    for bad in bads:
        with pytest.raises((IndexError, RuntimeError)):
            fn(x, bad)
        with pytest.raises(RuntimeError, match="index out of range"):
            with torch.no_grad():
                compiled(x, bad)
    with torch.no_grad():  # the error state does not stick to later calls
        assert_same(compiled(x, good), fn(x, good), rtol=1e-4, atol=1e-5)
