"""Fused attention against eager SDPA: output and dQ, dK, dV elementwise (rtol 1e-3, atol 1e-4, relative L2 1e-4), over
head_dim {32, 64, 80, 128} x seq {1, 7, 128, 300} plus head_dim 256 at seq 7 and 128, with causal masking, boolean
and additive masks (broadcast over batch and heads), custom scales, grouped-query attention and cross-attention
cycling through the grid (head_dim up to 64 runs the flash forward and the blocked gradient kernels, 80 the blocked
kernels, 128 and 256 the per-row ones; the blocked forward again with flash off); then the memory
plan of a long sequence, HF Llama with the SmolLM2-135M attention shape, and the dispatches a Llama layer costs
(rotary embeddings and repeat-KV fold into the attention loads), and passes cut into slices of the other sequence
(merged by a second dispatch) where the row blocks alone are too few."""
import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F

import meganeura.kernels.attention as attention_kernels
import meganeura.kernels.attention.flash as flash_kernels
import meganeura.kernels.attention.plans as attention_plans
import torch_meganeura
from helpers.compare import (assert_as_accurate_as_eager, assert_grads_match, assert_same,
                             check_gradients_against_eager, meganeura_warnings)

RTOL, ATOL, REL = 1e-3, 1e-4, 1e-4
GRID = list(itertools.product((32, 64, 80, 128), (1, 7, 128, 300))) + [(256, 7), (256, 128)]
VARIANTS = ["plain", "causal", "bool_mask", "additive_mask", "gqa", "cross", "scale", "gqa_causal_cross"]


def _case(d, seq, variant):
    heads, kv_heads, lk = 2, 2, seq
    mask, causal, scale = None, False, None
    if "gqa" in variant:
        heads, kv_heads = 4, 2
    if "cross" in variant:
        lk = max(1, seq // 2 + 3)
    if "causal" in variant:
        causal = True
    if variant == "bool_mask":
        mask = torch.rand(1, 1, seq, lk) > 0.3
        mask[..., 0] = True  # every query row keeps at least one key
    if variant == "additive_mask":
        mask = torch.randn(2, 1, seq, lk)
    if variant == "scale":
        scale = 0.3
    return d, seq, heads, kv_heads, lk, mask, causal, scale, variant


@pytest.mark.parametrize("index", range(len(GRID)))
def test_sdpa(index):
    _check_sdpa(*GRID[index], VARIANTS[index % len(VARIANTS)])


def _check_sdpa(d, seq, variant):
    d, seq, heads, kv_heads, lk, mask, causal, scale, variant = _case(d, seq, variant)
    q = torch.randn(2, heads, seq, d)
    k, v = torch.randn(2, kv_heads, lk, d), torch.randn(2, kv_heads, lk, d)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=heads != kv_heads)

    check_gradients_against_eager(fn, q, k, v, rtol=RTOL, atol=ATOL, rel=REL, names="qkv", what=variant)


UNFUSED_CASES = [(64, 128, v) for v in VARIANTS] + [(32, 7, "causal"), (80, 1, "gqa"), (128, 300, "bool_mask")]


@pytest.mark.parametrize("d, seq, variant", UNFUSED_CASES)
def test_unfused_attention(monkeypatch, d, seq, variant):
    """The matmul-softmax-matmul path that long rows take (here forced at every length) against eager: output and
    dQ, dK, dV over every variant (masks, causal, GQA, cross-attention, custom scale)."""
    from meganeura.lowering import compile_graph
    from meganeura.runtime.device import get_device
    from torch_meganeura.lower.fx_lowering import lower_graph
    from torch_meganeura.lower.aten import attention

    monkeypatch.setattr(attention, "UNFUSED_MIN_KEYS", 1)
    monkeypatch.setattr(attention_plans, "FLASH_MAX_HEAD", 0)  # the forward too, not only the backward
    q = torch.randn(1, 2, 16, 32)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    gm = torch.fx.symbolic_trace(lambda q, k, v: op(q, k, v, 0.0, False))
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["val"] = (torch.empty(1, 2, 16, 32), torch.empty(1, 2, 16))
    plan, _ = compile_graph(lower_graph(gm, [q, q, q], set()).graph, get_device().limits)
    assert "attention" not in [d.label for d in plan.dispatches], [d.label for d in plan.dispatches]
    _check_sdpa(d, seq, variant)


def test_unfused_backward_holds_one_score_matrix():
    """The unfused backward computes dV from S first, then stores dS over S, its last reader
    (``meganeura.lowering.in_place.arena_aliases``): its arena holds one score matrix, not two (full-size Whisper-tiny:
    51.5 MiB each; the resident step's peak 356 -> 307 MiB, below CUDA eager's 333)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from meganeura.lowering import compile_graph
    from meganeura.runtime.device import get_device
    from torch_meganeura.lower.decompositions import aot_decomposition_table
    from torch_meganeura.lower.fx_lowering import lower_graph

    q, k, v, grad = (torch.randn(1, 2, 128, 16) for _ in range(4))

    def gradients(q, k, v, grad):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad)

    gm = make_fx(gradients, decomposition_table=aot_decomposition_table())(q, k, v, grad)
    plan, _ = compile_graph(lower_graph(gm, [q, k, v, grad], set()).graph, get_device().limits)
    assert "attention_grad_scores 2x128x128x16" in [d.label for d in plan.dispatches]  # the unfused backward
    score_bytes = 2 * 128 * 128 * 4
    assert score_bytes <= plan.stats["arena_bytes"] < 1.5 * score_bytes


FLASH_OFF_CASES = [(32, 7, "causal"), (64, 128, "gqa_causal_cross"), (64, 300, "bool_mask"), (16, 1, "cross")]


@pytest.mark.parametrize("d, seq, variant", FLASH_OFF_CASES)
def test_blocked_forward_where_flash_is_off(monkeypatch, d, seq, variant):
    """Head sizes up to 64 take the flash forward; where an adapter's workgroup storage cannot hold its tiles, the
    chunked forward runs for long query sequences (``test_attention_chunked``) and the blocked forward for the rest:
    the same checks with flash and chunked off."""
    monkeypatch.setattr(attention_plans, "FLASH_MAX_HEAD", 0)
    monkeypatch.setattr(attention_plans, "CHUNKED_MAX_HEAD", 0)
    monkeypatch.setattr(flash_kernels, "flash_forward", _not_called)
    _check_sdpa(d, seq, variant)


def _not_called(*args, **kwargs):
    raise AssertionError("the flash forward was generated")


def _flash_fits(d: int) -> bool:
    """Whether the device's workgroup storage holds the flash forward's tiles for head size ``d`` (not WebGPU's
    default 16 KiB for d 30 or 64: the blocked forward runs there)."""
    from meganeura.runtime.device import get_device

    shape = attention_plans.AttentionShape(1, 1, 1, 64, 64, d, d, 1.0, False, False)
    return attention_plans.flash_plan(shape, get_device().limits) is not None


def test_head_sizes_up_to_64_run_the_flash_forward(monkeypatch):
    """The forward of a head size up to 64 is generated by the flash kernel where the device's workgroup storage
    holds its tiles (and matches eager)."""
    generated = []
    real = flash_kernels.flash_forward

    def spy(*args, **kwargs):
        generated.append(args[1])  # the AttentionShape
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_kernels, "flash_forward", spy)
    torch._dynamo.reset()
    _check_sdpa(64, 300, "causal")
    assert all(shape.d == 64 for shape in generated) and bool(generated) == _flash_fits(64)


def test_whole_vec4_rows_are_read_a_vec4_at_a_time(monkeypatch):
    """Operands whose rows are whole vec4s (head size a multiple of 4, each row starting at a multiple of 4 elements)
    are read a vec4 at a time through a second binding of the same value, in every pass; a key tensor sliced one
    element in (rows of 64 starting at odd elements) is read element by element by the forward. Outputs and
    gradients match eager either way. Where the adapter's storage-binding limit leaves no room, no second binding
    is added."""
    from meganeura.runtime.device import get_device

    preludes = {}
    real = attention_kernels.attention_kernel

    def spy(prelude, kind, *args, **kwargs):
        preludes[kind] = prelude
        return real(prelude, kind, *args, **kwargs)

    monkeypatch.setattr(attention_kernels, "attention_kernel", spy)

    def fn(q, k_wide, v):
        return F.scaled_dot_product_attention(q, k_wide[..., 1:], v)

    q, k_wide, v = torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 65), torch.randn(2, 2, 40, 64)
    check_gradients_against_eager(fn, q, k_wide, v, rtol=RTOL, atol=ATOL, rel=REL, names=["q", "k", "v"])
    assert set(preludes) == {"forward", "grad_q", "grad_kv"}
    vec4_reads = {kind: [x for x in ("q", "k", "v", "dout") if f"fn load_{x}4(" in p] for kind, p in preludes.items()}
    limit = "max-storage-buffers-per-shader-stage"
    if get_device().limits[limit] >= 13:  # room for grad_kv's 8 values, its scratch and 4 second bindings
        # the forward reads k through the slice; the backward passes read the contiguous copy saved for them
        assert vec4_reads == {"forward": ["q", "v"], "grad_q": ["q", "k", "v", "dout"],
                              "grad_kv": ["q", "k", "v", "dout"]}
        assert all("array<vec4<f32>>" in prelude for prelude in preludes.values())
    assert "k" not in vec4_reads["forward"]

    monkeypatch.setitem(get_device().limits, limit, 8)
    preludes.clear()
    check_gradients_against_eager(fn, q, k_wide, v, rtol=RTOL, atol=ATOL, rel=REL, names=["q", "k", "v"])
    for kind, prelude in preludes.items():
        assert prelude.count("@binding(") <= 8, kind


def test_flash_forward_with_head_sizes_off_the_vec4_grid(monkeypatch):
    """Rows of 30 floats, not a multiple of 4: the flash forward reads zeros past each row's end, and values and
    gradients match eager."""
    generated = []
    real = flash_kernels.flash_forward

    def spy(*args, **kwargs):
        generated.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_kernels, "flash_forward", spy)
    torch._dynamo.reset()
    q, k, v = torch.randn(2, 3, 70, 30), torch.randn(2, 3, 45, 30), torch.randn(2, 3, 45, 30)
    check_gradients_against_eager(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v, rtol=RTOL,
                                  atol=ATOL, rel=REL, names="qkv", what="d 30")
    assert [(shape.d, shape.dv) for shape in generated] == ([(30, 30)] if _flash_fits(30) else [])


def test_flash_forward_plans_fit_the_adapter():
    """64 query rows per workgroup where that gives enough blocks, else 32; keys cut into slices for few blocks:
    short slices for very few, slices of at least 8 tiles past 128 workgroups; no flash plan where workgroup storage
    cannot hold 32 rows' tiles (the chunked forward runs then for long query sequences)."""
    from meganeura.kernels.attention import AttentionShape, attention_kernel
    from meganeura.kernels.attention.plans import flash_plan, flash_shared_bytes

    big = {"max-compute-workgroup-storage-size": 49152, "max-compute-invocations-per-workgroup": 1024,
           "max-compute-workgroup-size-x": 1024}
    whisper = AttentionShape(1, 6, 6, 1500, 1500, 64, 64, 0.125, False, False)
    plan = flash_plan(whisper, big)
    assert (plan.rows, plan.splits) == (64, 4) and flash_shared_bytes(whisper, 64) <= 49152
    smollm2 = AttentionShape(1, 9, 3, 128, 128, 64, 64, 0.125, True, False)  # 36 blocks of 32 rows: 2 slices
    assert (flash_plan(smollm2, big).rows, flash_plan(smollm2, big).splits) == (32, 2)
    sd_unet = AttentionShape(2, 16, 16, 256, 256, 8, 8, 0.35, False, False)  # 128 blocks of 64 rows, 8 key tiles
    assert (flash_plan(sd_unet, big).rows, flash_plan(sd_unet, big).splits) == (64, 1)
    small = dict(big, **{"max-compute-workgroup-storage-size": 16384})
    assert flash_plan(whisper, small) is None
    passes = attention_kernel("", "forward", whisper, ["out", "lse"], small, partial="scratch")
    assert "(chunked flash)" in passes[0][0]
    assert flash_plan(AttentionShape(1, 6, 6, 1500, 1500, 80, 64, 0.1, False, False), big) is None


def test_fully_masked_rows_give_zeros_fused_and_unfused(monkeypatch):
    """A query row whose keys are all masked out outputs zeros and passes no gradient, as in eager, on every path:
    the flash forward, the blocked one, and the unfused one."""
    from torch_meganeura.lower.aten import attention

    mask = torch.rand(1, 1, 9, 600) > 0.5
    mask[:, :, 3] = False

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q = torch.randn(1, 2, 9, 16)
    k, v = torch.randn(1, 2, 600, 16), torch.randn(1, 2, 600, 16)
    for flash_max, min_keys in ((64, 10**9), (0, 10**9), (0, 1)):
        monkeypatch.setattr(attention_plans, "FLASH_MAX_HEAD", flash_max)
        monkeypatch.setattr(attention, "UNFUSED_MIN_KEYS", min_keys)
        torch._dynamo.reset()
        check_gradients_against_eager(fn, q, k, v, rtol=RTOL, atol=ATOL, rel=REL, names="qkv",
                                      what=f"a masked row, flash up to {flash_max}, min keys {min_keys}")


def test_inference_attention_is_one_fused_kernel():
    """Inference drops the log-sum-exp output; the kernel must still run and write the attention output. The
    scaled key (q * 0.5) is a cheap prologue: it folds into the key loads instead of running as its own kernel."""
    q = torch.randn(1, 2, 16, 32)

    def fn(q):
        return F.scaled_dot_product_attention(q, q * 0.5, q, is_causal=True)

    with torch.no_grad():
        report = torch_meganeura.explain(fn, q)
        torch._dynamo.reset()
        got = torch.compile(fn, backend="meganeura")(q)
    assert report.fallback_ops == {} and report.dispatches == 1, str(report)
    assert report.lowered_ops["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 1
    assert_same(got, fn(q), rtol=RTOL, atol=ATOL, rel=REL)


def test_long_other_sequence_over_few_blocks_is_cut_into_slices():
    """Whisper's shape (6 heads, 1500 frames) makes too few row blocks: every pass cuts the other sequence into
    slices merged by a second dispatch. Causal attention over 600 rows (slices past the diagonal are empty) runs
    the same path against eager."""
    from meganeura.kernels.attention import AttentionShape, attention_splits
    from meganeura.runtime.device import get_device

    whisper = AttentionShape(1, 6, 6, 1500, 1500, 64, 64, 0.125, False, False)
    assert all(attention_splits(whisper, kind, get_device().limits) > 1 for kind in ("forward", "grad_q", "grad_kv"))
    q, k, v = (torch.randn(1, 2, 600, 64) for _ in range(3))
    causal = AttentionShape(1, 2, 2, 600, 600, 64, 64, 0.125, True, False)
    assert all(attention_splits(causal, kind, get_device().limits) > 1 for kind in ("forward", "grad_q", "grad_kv"))

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    check_gradients_against_eager(fn, q, k, v, rtol=RTOL, atol=ATOL, rel=REL, names="qkv", what="causal slices")


def test_long_sequence_plan_holds_no_score_matrix():
    """seq 4096, 8 heads, head_dim 64: no buffer of the plan is as large as one head's seq x seq scores."""
    from meganeura.lowering import compile_graph
    from meganeura.runtime.device import get_device
    from torch_meganeura.lower.fx_lowering import lower_graph

    seq = 4096
    q = torch.randn(1, 8, seq, 64)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    gm = torch.fx.symbolic_trace(lambda q, k, v: op(q, k, v, 0.0, True))
    for node in gm.graph.nodes:  # the metadata lower_graph checks shapes and dtypes against
        if node.op == "call_function":
            node.meta["val"] = (torch.empty(1, 8, seq, 64), torch.empty(1, 8, seq))
    lowered = lower_graph(gm, [q, q, q], set())
    plan, _ = compile_graph(lowered.graph, get_device().limits)
    largest = max(b.size for b in plan.buffers)
    assert largest < 4 * seq * seq, f"a buffer of {largest} bytes: the score matrix is materialised"
    # one pass, or (keys cut into slices for enough workgroups) the slices and their merge
    assert [d.label for d in plan.dispatches] in (["attention"], ["attention", "attention (merge of slices)"])


def test_llama_smollm2_attention_shape_gradients():
    """HF Llama with SmolLM2-135M's widths (hidden 576, 9 heads / 3 KV heads, FFN 1536), 2 layers, seq 128.

    Compared with float64 eager, allowing a multiple of eager float32's own error: eager float32 on the CPU is not
    deterministic here. Its q_proj/k_proj gradients moved between runs by up to 1.1e-4 relative L2 (ours stay
    bit-identical, 1.3e-6 from eager's usual result), past the 1e-4 of a plain comparison in about 1 run of 10."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).train()
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    ids = torch.randint(0, 128, (1, 128))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="meganeura")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = compiled(ids, labels=ids).loss
        loss.backward()
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    want, want64 = eager(ids, labels=ids).loss, exact(ids, labels=ids).loss
    want.backward()
    want64.backward()
    assert_as_accurate_as_eager(loss, want, want64, rtol=RTOL, atol=ATOL, rel=REL, what="loss")
    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
        assert_as_accurate_as_eager(p.grad, q.grad, r.grad, rtol=RTOL, atol=ATOL, rel=REL, what=f"grad of {name}")


@pytest.mark.parametrize("kv_heads", [9, 3], ids=["mha", "gqa"])
def test_llama_layer_dispatches_rotary_and_repeat_kv_fold_into_attention(kv_heads):
    """An inference Llama layer is 8 dispatches: 2 RMS norms, 5 matmuls (the q, k and v projections of the normed
    input side by side in one; residual adds and SiLU-gating are matmul epilogues) and 1 attention. The rotary
    embedding of q and k and HF's repeat-KV (expand + reshape) add none: they are recomputed inside the attention
    kernel's loads, within WebGPU's default 8 storage bindings too (q, k, v, cos, sin and the 2 outputs; the causal
    mask, compared from positions, is computed by the attention: ``lowering/data_checks.py``). Measured as 3 layers
    minus 2 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def dispatches(layers):
        cfg = LlamaConfig(vocab_size=64, hidden_size=72, intermediate_size=96, num_hidden_layers=layers,
                          num_attention_heads=9, num_key_value_heads=kv_heads, max_position_embeddings=64)
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(0, 64, (1, 16))
        torch._dynamo.reset()
        with torch.no_grad():
            report = torch_meganeura.explain(lambda i: model(i, use_cache=False).logits, ids)
        assert report.fallback_ops == {}, str(report)
        return report.dispatches

    assert dispatches(3) - dispatches(2) == 8


def test_whisper_tiny_encoder_forward_and_backward():
    """HF Whisper encoder with whisper-tiny's widths (d_model 384, 6 heads, 4 layers) on a short mel input:
    conv1d stem, positional embedding, bidirectional attention; an MSE loss against a random target (mean(h^2) of
    the layer-normed output is 1 up to eps: its gradients would be rounding noise) and every gradient."""
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(d_model=384, encoder_attention_heads=6, encoder_layers=4, encoder_ffn_dim=1536,
                        decoder_layers=1, decoder_attention_heads=6, num_mel_bins=80, max_source_positions=32)
    encoder = WhisperModel(cfg).get_encoder().train()
    ref = WhisperModel(cfg).get_encoder().train()
    ref.load_state_dict(encoder.state_dict())
    mel = torch.randn(1, 80, 2 * cfg.max_source_positions)
    target = torch.randn(1, cfg.max_source_positions, 384)
    torch._dynamo.reset()
    compiled = torch.compile(encoder, backend="meganeura")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hidden = compiled(mel).last_hidden_state
        F.mse_loss(hidden, target).backward()
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    want = ref(mel).last_hidden_state
    F.mse_loss(want, target).backward()
    assert_same(hidden, want, rtol=RTOL, atol=ATOL, rel=REL, what="encoder output")
    assert_grads_match(encoder, ref, rtol=RTOL, atol=ATOL, rel=REL)


def test_attention_dropout_in_training_uses_the_device_rng():
    """dropout_p > 0: PyTorch takes its math path (dropout on the probabilities), which runs on the device with
    the counter-based RNG. Under one seed the output is linear in v, and the backward must use the forward's
    mask: f(v1) + f(v2) == f(v1 + v2) and <upstream, f(v)> == <grad_v, v>."""
    q, k = torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)

    def fn(v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="meganeura")
    v1, v2 = torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for v in (v1, v2, v1 + v2):
            torch.manual_seed(7)
            outs.append(compiled(v))
        torch.manual_seed(7)
        leaf = v1.clone().requires_grad_()
        out = compiled(leaf)
        upstream = torch.randn(out.shape)
        (grad_v,) = torch.autograd.grad(out, leaf, upstream)
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    torch.testing.assert_close(outs[0] + outs[1], outs[2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close((upstream * out).sum(), (grad_v * v1).sum(), rtol=1e-4, atol=1e-4)
    assert not torch.equal(outs[0], compiled(v1)), "a new draw must give a new dropout mask"
    assert not torch.equal(outs[0], F.scaled_dot_product_attention(q, k, v1)), "dropout had no effect"


def _cpu_adapter() -> bool:
    from meganeura.runtime.device import get_device

    return get_device().adapter_type == "CPU"


@pytest.mark.skipif(_cpu_adapter(), reason="seq 4096 x 8 heads takes minutes on a CPU Vulkan driver; runs on GPUs")
def test_long_sequence_runs():
    q, k, v = (torch.randn(1, 8, 4096, 64) for _ in range(3))

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend="meganeura")(q, k, v)
        want = fn(q, k, v)
    assert_same(got, want, rtol=RTOL, atol=ATOL, rel=REL)


@pytest.mark.parametrize("keys", [64, 256])
def test_attention_gradients_through_a_residual_on_a_transposed_view(keys):
    """diffusers' VAE attention: q, k, v from a transposed view of x, the output added back to that view. With 256
    keys (the unfused path) every gradient upstream was wrong (relative L2 from float64 1.4; eager 1e-7): fusion
    renamed a coordinate twice. Output and gradients within 2x eager float32's distance from float64."""
    from helpers.compare import assert_within_eager_error

    def f(x, wq, wk, wv):
        h = x.transpose(1, 2)
        q, k, v = [(h @ w).view(1, keys, 1, 32).transpose(1, 2) for w in (wq, wk, wv)]
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, keys, 32)
        return ((o + h) ** 2).mean()

    inputs = [torch.randn(1, 32, keys)] + [torch.randn(32, 32) / 6 for _ in range(3)]

    def grads(fn, dtype):
        leaves = [t.detach().clone().to(dtype).requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward()
        return [out.detach()] + [t.grad for t in leaves]

    exact, eager = grads(f, torch.float64), grads(f, torch.float32)
    got = grads(torch.compile(f, backend="meganeura", options={"fallback": "error"}), torch.float32)
    for name, g, e, want in zip(["loss", "x", "wq", "wk", "wv"], got, eager, exact):
        assert_within_eager_error(g.reshape(-1), e.reshape(-1), want.reshape(-1), what=name)


def _cache_masks(rows: int, keys: int) -> dict:
    """Masks of a few query rows over a cache of ``keys`` positions, as generation makes them: the positions up to
    each row's own (a static cache), a left-padded prompt's, two spans with a hole between, and HF's additive form
    (the dtype's minimum where masked)."""
    position = torch.arange(keys)
    up_to = torch.stack([position <= 37 + 100 * r for r in range(rows)])
    padded = torch.stack([(position >= 20) & (position <= 90 + r) for r in range(rows)])
    holes = ((position < 6) | ((position >= 600) & (position < 611))).expand(rows, keys)
    additive = torch.zeros(rows, keys).masked_fill(~up_to, torch.finfo(torch.float32).min)
    return {"up to the position": up_to, "left-padded": padded, "two spans": holes, "additive": additive}


@pytest.mark.parametrize("form", ["per_row", "flash", "blocked"])
@pytest.mark.parametrize("rows", [1, 3])
def test_few_query_rows_over_a_masked_cache_walk_only_the_unmasked_span(monkeypatch, form, rows):
    """A decode step (one query row, or a few) over a static cache of 700 positions: each forward form narrows its
    loop over keys to the span some row leaves unmasked (``common.key_range``): the per-row form cut into slices of
    the keys (``plans.row_plan``), the flash form where it fits (with the per-row plan off), and the blocked form
    (with both off), against eager for every mask kind (grouped-query attention, head size 64)."""
    import meganeura.kernels.attention.blocked as blocked_kernels
    import meganeura.kernels.attention.per_row as per_row_kernels

    if form == "flash" and not _flash_fits(64):
        pytest.skip("the device's workgroup storage does not hold the flash forward's tiles")
    if form != "flash":  # as under WebGPU's default 16 KiB of workgroup storage (a portable bundle's)
        monkeypatch.setattr(attention_plans, "flash_plan", lambda shape, limits: None)
    if form != "per_row":
        monkeypatch.setattr(attention_plans, "row_plan", lambda shape: None)
    module, name = {"per_row": (per_row_kernels, "sliced_forward"), "flash": (flash_kernels, "flash_forward"),
                    "blocked": (blocked_kernels, "blocked_forward")}[form]
    sources, generate = [], getattr(module, name)

    def spy(*args, **kwargs):
        sources.append(generate(*args, **kwargs)[0])
        return generate(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    q, k, v = torch.randn(1, 4, rows, 64), torch.randn(1, 2, 700, 64), torch.randn(1, 2, 700, 64)
    for what, mask in _cache_masks(rows, 700).items():
        def fn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        torch._dynamo.reset()
        sources.clear()
        with torch.no_grad():
            got = torch.compile(fn, backend="meganeura")(q, k, v)
        assert sources and all("key_first" in source for source in sources), what
        assert_same(got, fn(q, k, v), rtol=RTOL, atol=ATOL, rel=REL, what=what)


# Key counts of a decode step over a dynamic graph's cache, and the slices of 64 keys (one tile each, the most the
# plan takes: ROW_SPLIT_MAX) that hold them: a run launches and merges those alone.
SYMBOLIC_CACHE_LENGTHS = {1: 1, 20: 1, 64: 1, 65: 2, 300: 5, 4096: 64, 5000: 64}


def test_a_decode_step_over_a_symbolic_cache_launches_and_merges_only_the_slices_that_hold_keys():
    """One query row per head over a symbolic key count: the per-row forward cut into ROW_SPLIT_MAX slices, of which a
    run's grid holds only those with keys (SYMBOLIC_CACHE_LENGTHS), and the merge reads as many; the plan decides
    nothing about the length (a decision outside a compile raises)."""
    from meganeura.kernels.attention import AttentionShape, attention_kernel
    from meganeura.kernels.attention.plans import ROW_SPLIT_MAX, RowPlan, forward_plan, live_slices
    from meganeura.kernels.sizes import evaluator, symbol
    from meganeura.kernels.wgsl import size_u32
    from meganeura.runtime.device import get_device

    limits = get_device().limits
    shape = AttentionShape(1, 9, 3, 1, symbol(0, 20), 64, 64, 0.125, False, True)
    plan = forward_plan(shape, limits)
    assert isinstance(plan, RowPlan) and plan.splits == ROW_SPLIT_MAX, plan
    (slices, grid), (merge, _) = attention_kernel("", "forward", shape, ["out"], limits, partial="scratch")
    live = live_slices(shape, "forward", plan)
    assert f"s < {size_u32(live)};" in merge
    workgroups, counts = evaluator(grid), evaluator([live])
    for length, holding_keys in SYMBOLIC_CACHE_LENGTHS.items():
        x, y, z = workgroups([length])
        assert x * y * z == 9 * holding_keys and counts([length]) == (holding_keys,), length


def test_a_decode_step_over_a_dynamic_cache_gives_eager_outputs_at_every_length(monkeypatch):
    """A decode step's attention (one query row, grouped-query heads, HF's additive mask) over a cache of dynamic
    length, its output projected as o_proj does (the projection merges the slices as it reads them): eager's output
    at lengths whose keys fill 1, 2 and 5 slices, from the per-row sliced forward over a symbolic length, whose
    slices the projection merges as many as the run's length fills."""
    import meganeura.kernels.attention.per_row as per_row_kernels
    import meganeura.lowering.slice_merges as slice_merges
    from meganeura.kernels.sizes import is_size

    forwards, generate = [], per_row_kernels.sliced_forward
    monkeypatch.setattr(per_row_kernels, "sliced_forward", lambda *a, **k: forwards.append(a[1]) or generate(*a, **k))
    merged, merge = [], slice_merges.merged_function
    monkeypatch.setattr(slice_merges, "merged_function", lambda *a: merged.append(a[2]) or merge(*a))
    o_proj = torch.nn.Linear(64, 64, bias=False)

    def step(q, k, v, mask):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return o_proj(out.transpose(1, 2).reshape(1, 1, 64))

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="meganeura")
    for length in (20, 70, 300):
        q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, length, 16), torch.randn(1, 2, length, 16)
        mask = torch.zeros(1, 1, 1, length).masked_fill(torch.rand(1, 1, 1, length) > 0.8, torch.finfo().min)
        for x in (k, v, mask):
            torch._dynamo.mark_dynamic(x, x.dim() - (1 if x is mask else 2))
        with torch.no_grad():
            assert_same(compiled(q, k, v, mask), step(q, k, v, mask), rtol=RTOL, atol=ATOL, rel=REL, what=length)
    # (scheduled again as the plan's bound on the length grows: one forward and one merging projection each time)
    assert forwards and all(is_size(shape.lk) for shape in forwards), forwards
    assert len(merged) == len(forwards) and all(map(is_size, merged)), merged


def test_gradients_over_a_symbolic_key_count_in_slices():
    """16 query rows over keys of a dynamic count (cross-attention to a context of varying length): the flash
    forward and the blocked dQ pass cut the keys into slices of which a run launches and merges those that hold keys
    (``plans.live_slices``: 2, 4 and 10 of 16 here); output and gradients equal eager's at each length."""
    from meganeura.kernels.attention.plans import AttentionShape, live_slices, pass_plan
    from meganeura.kernels.sizes import is_size, symbol
    from meganeura.runtime.device import get_device

    shape = AttentionShape(1, 2, 2, 16, symbol(0, 40), 16, 16, 0.25, False, False)
    plan = pass_plan(shape, "grad_q", get_device().limits)
    assert plan.splits > 1 and is_size(live_slices(shape, "grad_q", plan)), plan

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="meganeura")
    for length in (40, 100, 300):
        q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for n in (16, length, length))
        for x in (k, v):
            torch._dynamo.mark_dynamic(x, 2)
        out = compiled(q, k, v)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad)
        want_out = fn(q, k, v)
        want = torch.autograd.grad(want_out, (q, k, v), grad)
        assert_same((out, *got), (want_out, *want), rtol=RTOL, atol=ATOL, rel=REL, what=length)
