"""Half precision operands read in groups (``lowering/node_kernels.py``'s ``_gemv_wide`` and ``_quad_rows``): a gemv of
bfloat16 or float16 weights reads 8 of them per vec4<u32> load, the tiled matmul's quad staging and attention 4 per
vec2<u32> load, widened in registers. Where a row's elements along K are no whole groups (K not a multiple of the
group, a row offset that is not one) the kernels read element by element, as before. Every case runs through the
backend and is judged against float64 within eager's own error in the same dtype."""
from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers.compare import assert_within_eager_error, meganeura_warnings
from helpers.compiled_plans import record_compiled_plans

HALVES = [torch.bfloat16, torch.float16]
GROUPED_GEMV = "groups of 8"  # the gemv kernel's comment line when it reads by groups (kernels/matmul_gemv.py)


@pytest.fixture
def sources(monkeypatch):
    """The WGSL of every kernel of the plans compiled while the test runs."""
    return record_compiled_plans(monkeypatch, lambda plan: plan.kernels.values())


def _run_against_float64(fn, *args, exact_fn=None):
    """``fn`` through the backend (nothing may fall back), judged against float64 (``exact_fn``, default ``fn``, of
    the arguments in float64) within eager's error."""
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(fn, backend="meganeura")(*args)
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    exact = (exact_fn or fn)(*(a.double() for a in args))
    assert_within_eager_error(got, fn(*args), exact, floor=1e-6)


def _linear(x, w):
    return F.linear(x, w.to(x.dtype))


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("vector", ["half", "float32"])
def test_gemv_reads_half_weights_by_groups(dtype, vector, sources):
    """Decode's projection: one row against half weights of 64 columns (8 groups of 8), the row in the same half
    precision (read by groups too) or in float32 (its row widened to f32 first, as a cast of the weights)."""
    x = torch.randn(1, 64).to(dtype if vector == "half" else torch.float32)
    w = torch.randn(40, 64).to(dtype)
    _run_against_float64(_linear, x, w)
    assert any(GROUPED_GEMV in s and f"mg_widen8_{'bf16' if dtype == torch.bfloat16 else 'f16'}" in s
               for s in sources)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("columns", [20, 21])
def test_gemv_reads_by_elements_where_k_is_no_whole_groups(dtype, columns, sources):
    """K of 20 (whole vec4s of f32, not groups of 8) and 21 (odd: a row's last element shares its word with the
    next row's first): element by element."""
    x, w = torch.randn(1, columns).to(dtype), torch.randn(24, columns).to(dtype)
    _run_against_float64(_linear, x, w)
    assert sources and not any(GROUPED_GEMV in s for s in sources)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("offset, grouped", [(4, False), (8, True)])
def test_gemv_of_a_column_slice_reads_by_groups_only_where_rows_start_on_one(dtype, offset, grouped, sources):
    """Weights sliced from 72 columns at ``offset``: row j starts at element 72 j + offset, a multiple of 8 only for
    offset 8; at 4 (half a group) the gemv reads element by element. (The row in float32: a half row read by groups
    the same way as the weights would hide a mix-up of elements within a group.)"""
    x, w = torch.randn(1, 64), torch.randn(24, 72).to(dtype)
    _run_against_float64(lambda x, w: F.linear(x, w[:, offset:offset + 64].to(x.dtype)), x, w)
    assert any(GROUPED_GEMV in s for s in sources) == grouped


class _DecodeLayer(torch.nn.Module):
    """A Llama-like layer at one token: RMS norm, sibling q/k/v projections of the normed row, and an MLP whose gate
    and up projections share the normed row (the decode fusions' gemvs: blocked weights, further products and a
    row prologue)."""

    def __init__(self, hidden: int = 64, inner: int = 96):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-6)
        self.q, self.k, self.v = (torch.nn.Linear(hidden, size, bias=False) for size in (hidden, 32, 32))
        self.gate, self.up = (torch.nn.Linear(hidden, inner, bias=False) for _ in range(2))
        self.down = torch.nn.Linear(inner, hidden, bias=False)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.3)

    def forward(self, x):
        h = self.norm(x)
        mixed = self.q(h) + torch.cat([self.k(h), self.v(h)], dim=-1)
        y = x + mixed
        g = self.norm(y)
        return y + self.down(F.silu(self.gate(g)) * self.up(g))


@pytest.mark.parametrize("dtype", HALVES)
def test_decode_layer_gemvs_read_half_weights_by_groups(dtype, sources):
    """The layer in half precision at one token: its projections read the weights by groups, the SwiGLU pair as
    two matrices of one kernel (``load_b1_8``)."""
    torch.manual_seed(0)
    layer = _DecodeLayer().to(dtype).eval()
    x = torch.randn(1, 1, 64).to(dtype)
    with torch.no_grad():
        _run_against_float64(layer, x, exact_fn=copy.deepcopy(layer).double())
    grouped = [s for s in sources if GROUPED_GEMV in s]
    assert len(grouped) >= 3, len(grouped)
    assert any("load_b1_8" in s for s in grouped)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("vector", ["half", "float32"])
@pytest.mark.parametrize("k, grouped", [(96, True), (90, False)])
def test_tiled_matmul_stages_half_quads_by_vec2_loads(dtype, vector, k, grouped, sources, monkeypatch):
    """The tiled kernel with quad staging (a variant the tuner may pick; forced here): half operands whose rows are
    whole groups of 4 (K 96) are fetched one vec2<u32> per quad, else (K 90) element by element; the rows of A
    in the same half precision or in float32."""
    from meganeura.kernels import matmul_plans

    chosen = matmul_plans.default_choice
    monkeypatch.setattr(matmul_plans, "default_choice",
                        lambda *a, **kw: dataclasses.replace(chosen(*a, **kw), quads=True))
    x, w = torch.randn(48, k).to(dtype if vector == "half" else torch.float32), torch.randn(40, k).to(dtype)
    _run_against_float64(_linear, x, w)
    tiled = [s for s in sources if "quad staging" in s]
    assert tiled and any("array<vec2<u32>>" in s for s in tiled) == grouped


@pytest.mark.parametrize("dtype", HALVES)
def test_attention_reads_half_rows_by_vec2_loads(dtype, sources):
    """Scaled dot-product attention of half q, k, v (head size 32): rows read 4 elements per vec2<u32> load."""
    q, k, v = (torch.randn(1, 2, 24, 32).to(dtype) for _ in range(3))
    _run_against_float64(F.scaled_dot_product_attention, q, k, v)
    assert any("array<vec2<u32>>" in s and "mg_widen4_" in s for s in sources)


@pytest.mark.parametrize("dtype", HALVES)
def test_attention_reads_repeated_half_kv_heads_by_vec2_loads(dtype, sources):
    """Grouped KV heads repeated for the query heads (as HF's ``repeat_kv`` does, through float32 and back as a
    cache's copy may go): attention still reads the k and v rows by groups, through the repeat."""
    q = torch.randn(1, 4, 24, 32).to(dtype)
    k, v = (torch.randn(1, 2, 24, 32).to(dtype) for _ in range(2))

    def attend(q, k, v):
        repeat = lambda t: t.float().to(t.dtype)[:, :, None].expand(1, 2, 2, 24, 32).reshape(1, 4, 24, 32)  # noqa: E731
        return F.scaled_dot_product_attention(q, repeat(k), repeat(v))

    _run_against_float64(attend, q, k, v)
    assert any("fn load_k4(" in s and "fn load_v4(" in s and "array<vec2<u32>>" in s for s in sources)


def test_rounding_a_half_read_to_its_own_precision_is_left_out():
    """A gemv whose weights are rounded to bfloat16 after their load from bfloat16 (as a copy of a half value is, a
    repeated KV head of a half cache): the rounding is exact, the read stays plain, and the gemv reads by groups.
    Against float64."""
    import numpy as np

    from meganeura.lowering import compile_graph
    from meganeura.lowering import expr as E
    from meganeura.lowering.builder import GraphBuilder
    from meganeura.runtime.device import get_device
    from meganeura.runtime.dtypes import bfloat16_bits, bfloat16_values
    from meganeura.runtime.program import Program

    b = GraphBuilder()
    x, w = b.input("x", (1, 64), "float32"), b.input("w", (40, 64), "bfloat16")
    weights = E.unary("round_bf16", b.load(w, [E.coord(2), E.coord(1)]))
    b.output(b.gemm(1, 1, 40, 64, b.load(x, [E.coord(1), E.coord(2)]), weights))
    plan, _ = compile_graph(b.graph, get_device().limits)
    source = plan.kernels[plan.dispatches[0].kernel]
    assert GROUPED_GEMV in source and "mg_round_bf16" not in source
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((1, 64)).astype(np.float32),
            "w": bfloat16_bits(rng.standard_normal((40, 64)).astype(np.float32))}
    got = Program(get_device(), plan).run(data)[plan.outputs[0].name]
    want = data["x"].astype(np.float64) @ bfloat16_values(data["w"]).astype(np.float64).T
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5)
