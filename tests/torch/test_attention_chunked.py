"""The chunked flash forward (``meganeura.kernels.attention.chunked``) against eager SDPA: output and dQ, dK, dV (the
backward reads the forward's log-sum-exp) elementwise (rtol 1e-3, atol 1e-4) and in relative L2 (1e-4), at head sizes
32, 64, 80 and 128 with query and key lengths that leave partial blocks and tiles (100 rows, 75 and 300 keys: cross-
attention), causal and not, boolean (with a fully masked row) and additive masks, grouped-query attention; under the
device's workgroup storage and under WebGPU's default 16 KiB (chunks of the head size and of the value tile smaller
than whole); in bfloat16 and float16 against float64 (within 2x eager's own error). Then the plans: which form each
adapter's limits give a shape, and that every chunked plan fits the limits it was made for."""
import pytest
import torch
import torch.nn.functional as F

import meganeura.kernels.attention.chunked as chunked_kernels
import meganeura.kernels.attention.plans as attention_plans
from helpers.compare import assert_same, assert_within_eager_error, check_gradients_against_eager
from meganeura.kernels.attention.plans import (AttentionShape, ChunkedPlan, FlashPlan, RowPlan,
                                               chunked_shared_bytes, forward_plan)
from meganeura.kernels.wgsl import SPLIT_TARGET_WORKGROUPS

RTOL, ATOL, REL = 1e-3, 1e-4, 1e-4
WEBGPU_STORAGE = 16384
STORAGE = "max-compute-workgroup-storage-size"
# (head size, query rows, key rows, variant, workgroup storage: None for the device's own)
CASES = [
    (32, 100, 300, "plain", WEBGPU_STORAGE),
    (64, 100, 100, "causal", None),
    (64, 100, 75, "bool_mask", WEBGPU_STORAGE),
    (80, 100, 100, "gqa_causal", WEBGPU_STORAGE),
    (80, 70, 300, "additive_mask", None),
    (128, 100, 75, "gqa", WEBGPU_STORAGE),
    (128, 100, 100, "causal", None),
]


@pytest.fixture
def chunked_only(monkeypatch):
    """The forward goes to the chunked kernel (the flash forward off, no unfused path at any length), and the
    plans it was generated with are recorded."""
    from torch_meganeura.lower.aten import attention

    monkeypatch.setattr(attention_plans, "FLASH_MAX_HEAD", 0)
    monkeypatch.setattr(attention, "UNFUSED_MIN_KEYS", 10**9)
    plans = []
    real = chunked_kernels.chunked_forward

    def spy(prelude, shape, outs, plan, limits, partial):
        plans.append((shape, plan))
        return real(prelude, shape, outs, plan, limits, partial)

    monkeypatch.setattr(chunked_kernels, "chunked_forward", spy)
    return plans


def _inputs(d, lq, lk, variant, dtype=torch.float32):
    heads, kv_heads = (4, 2) if "gqa" in variant else (2, 2)
    q = torch.randn(1, heads, lq, d, dtype=dtype)
    k, v = torch.randn(1, kv_heads, lk, d, dtype=dtype), torch.randn(1, kv_heads, lk, d, dtype=dtype)
    mask = None
    if variant == "bool_mask":
        mask = torch.rand(1, 1, lq, lk) > 0.3
        mask[..., 0] = True
        mask[..., 3, :] = False  # a row with every key masked out: zeros, as eager gives
    if variant == "additive_mask":
        mask = torch.randn(1, heads, lq, lk, dtype=dtype)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal="causal" in variant,
                                              enable_gqa=heads != kv_heads)
    return fn, q, k, v


@pytest.mark.parametrize("d, lq, lk, variant, storage", CASES)
def test_chunked_forward_against_eager(monkeypatch, chunked_only, d, lq, lk, variant, storage):
    from meganeura.runtime.device import get_device

    if storage is not None:
        monkeypatch.setitem(get_device().limits, STORAGE, storage)
    fn, q, k, v = _inputs(d, lq, lk, variant)
    check_gradients_against_eager(fn, q, k, v, rtol=RTOL, atol=ATOL, rel=REL, names="qkv", what=variant)
    assert chunked_only, "the chunked forward was not generated"
    for shape, plan in chunked_only:
        assert chunked_shared_bytes(shape, plan.rows, plan.d_chunk, plan.v_chunk) <= get_device().limits[STORAGE]
    if storage == WEBGPU_STORAGE and d >= 64:  # the head size (and, from 80 on, the value tile) in several chunks
        assert all(plan.d_chunk < -(-d // 4) for _, plan in chunked_only)
        assert d < 80 or all(plan.v_chunk < attention_plans.FLASH_KEYS for _, plan in chunked_only)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_forward_in_half_precision(monkeypatch, chunked_only, dtype):
    """Half precision operands (read as f32 by the loads, no shader-f16 needed): the output within 2x eager's
    distance from float64."""
    from meganeura.runtime.device import get_device

    monkeypatch.setitem(get_device().limits, STORAGE, WEBGPU_STORAGE)
    fn, q, k, v = _inputs(64, 100, 90, "causal", dtype)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend="meganeura")(q, k, v)
    assert got.dtype == dtype and chunked_only
    assert_within_eager_error(got.reshape(-1), fn(q, k, v).reshape(-1),
                              fn(q.double(), k.double(), v.double()).reshape(-1), what=str(dtype))


WEBGPU = {STORAGE: WEBGPU_STORAGE, "max-compute-invocations-per-workgroup": 256, "max-compute-workgroup-size-x": 256}
NVIDIA = dict(WEBGPU, **{STORAGE: 49152})  # what the Vulkan driver of an H100 reports


def test_plans_by_shape_and_adapter():
    """Whisper-tiny's attention (6 heads, 1500 x 1500, d 64) keeps the flash forward where its query block fits
    (48 KiB) and takes the chunked one at WebGPU's 16 KiB (the blocked forward before); head size 128 takes the
    chunked one at either (the per-row kernel before); a short query sequence (decode over a cache: 1 row) takes the
    per-row forward cut into slices of the keys at either (flash where it fit, and the blocked forward at 16 KiB,
    before)."""
    whisper = AttentionShape(1, 6, 6, 1500, 1500, 64, 64, 0.125, False, False)
    assert isinstance(forward_plan(whisper, NVIDIA), FlashPlan)
    assert isinstance(forward_plan(whisper, WEBGPU), ChunkedPlan)
    wide = AttentionShape(1, 8, 8, 2048, 2048, 128, 128, 0.09, True, False)
    assert isinstance(forward_plan(wide, NVIDIA), ChunkedPlan) and isinstance(forward_plan(wide, WEBGPU), ChunkedPlan)
    decode = AttentionShape(1, 9, 3, 1, 300, 64, 64, 0.125, False, False)
    for limits in (NVIDIA, WEBGPU):
        assert isinstance(forward_plan(decode, limits), RowPlan) and forward_plan(decode, limits).splits > 1


def test_a_decode_over_a_long_cache_walks_one_tile_a_slice():
    """At WebGPU's limits a decode step's attention over a long cache is cut into slices of one tile of keys each
    (flash-decoding: a slice's chain of reads is one tile's, wherever the position), up to ROW_SPLIT_MAX slices;
    where the rows alone fill the GPU's target of workgroups (a batch of 8), the slices are fewer and longer."""
    for lk in (2048, 4096):
        plan = forward_plan(AttentionShape(1, 9, 3, 1, lk, 64, 64, 0.125, False, True), WEBGPU)
        assert isinstance(plan, RowPlan) and plan.chunk == attention_plans.ROW_THREADS, (lk, plan)
    batch = forward_plan(AttentionShape(8, 9, 3, 1, 2048, 64, 64, 0.125, False, True), WEBGPU)
    assert batch.splits * 8 * 9 >= SPLIT_TARGET_WORKGROUPS and batch.chunk == 2 * attention_plans.ROW_THREADS
    longest = forward_plan(AttentionShape(1, 9, 3, 1, 16384, 64, 64, 0.125, False, True), WEBGPU)
    assert longest.splits == attention_plans.ROW_SPLIT_MAX


@pytest.mark.parametrize("d", [8, 30, 32, 64, 80, 96, 128])
@pytest.mark.parametrize("limits", [WEBGPU, NVIDIA], ids=["webgpu", "nvidia"])
def test_chunked_plans_fit_their_limits(d, limits):
    """Every chunked plan fits the workgroup storage and invocations it was made for, its chunks divide the head
    size's vec4s and the key tile; and head sizes past CHUNKED_MAX_HEAD get none."""
    shape = AttentionShape(2, 4, 4, 300, 300, d, d, 0.1, False, False)
    plan = attention_plans.chunked_plan(shape, limits)
    assert plan is not None
    d4 = -(-d // 4)
    assert d4 % plan.d_chunk == 0 and attention_plans.FLASH_KEYS % plan.v_chunk == 0
    assert chunked_shared_bytes(shape, plan.rows, plan.d_chunk, plan.v_chunk) <= limits[STORAGE]
    assert plan.rows // 4 * attention_plans.FLASH_KEY_GROUPS <= limits["max-compute-invocations-per-workgroup"]
    too_wide = AttentionShape(2, 4, 4, 300, 300, 160, 160, 0.1, False, False)
    assert attention_plans.chunked_plan(too_wide, limits) is None


def test_chunked_forward_on_a_device_held_to_webgpu_default_limits(monkeypatch, chunked_only):
    """Under ``MEGANEURA_LIMITS=webgpu-default`` (a device created with WebGPU's default limits, which wgpu enforces
    when it builds the pipeline) a head size of 128 over 100 rows runs the chunked forward, within 16 KiB of
    workgroup storage and without subgroups or f16, and matches eager."""
    from meganeura.runtime.device import LIMITS_ENV

    monkeypatch.setenv(LIMITS_ENV, "webgpu-default")
    fn, q, k, v = _inputs(128, 100, 90, "causal")
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend="meganeura")(q, k, v)
    assert chunked_only and all(chunked_shared_bytes(shape, plan.rows, plan.d_chunk, plan.v_chunk) <= WEBGPU_STORAGE
                                for shape, plan in chunked_only)
    assert_same(got, fn(q, k, v), rtol=RTOL, atol=ATOL, rel=REL)


def test_chunked_forward_over_a_symbolic_key_length(chunked_only):
    """A fixed block of 70 query rows over key lengths that change between calls: after the second length the key
    length is symbolic, and one chunked kernel (its key slices sized when the plan runs) serves every length."""
    from meganeura.kernels.sizes import is_size

    fn = _inputs(128, 70, 80, "plain")[0]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="meganeura")
    q = torch.randn(1, 2, 70, 128)
    for length in (80, 100, 130):
        k, v = torch.randn(1, 2, length, 128), torch.randn(1, 2, length, 128)
        with torch.no_grad():
            assert_same(compiled(q, k, v), fn(q, k, v), rtol=RTOL, atol=ATOL, rel=REL, what=f"{length} keys")
    assert any(is_size(shape.lk) and not is_size(shape.lq) for shape, _ in chunked_only)
