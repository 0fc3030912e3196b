"""bfloat16 and float16 graphs on the device: stored in 16 bits, computed in f32, rounded as torch rounds.

Conversions are checked bit for bit against torch's over every 16-bit pattern (widening) and 220,000 float32 bit
patterns with the special values (narrowing). Models are judged against float64: ours may be at most
``EAGER_ERROR_FACTOR`` times eager's own error in the same dtype (ours keeps intermediates in f32, so it is
usually closer). HF models are built the way users get them: saved in bfloat16 and loaded with
``from_pretrained``'s default dtype.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from helpers.compare import assert_within_eager_error, device_counters, meganeura_warnings
from helpers.compiled_plans import record_compiled_plans

HALVES = [torch.bfloat16, torch.float16]
SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.99, 65520.0, 6e-8, 3e-8, 2.98e-8,
           1e-40, 3.4e38, -3.4e38, 1.0000001, 5.96e-8, 1.00390625, 1.01171875]


def _compiled_run(fn, *args):
    """``fn`` through the backend: its result, after checking nothing fell back and the device ran it."""
    torch._dynamo.reset()
    before = device_counters()["submits"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="meganeura")(*args)
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    assert device_counters()["submits"] > before, "nothing ran on the device"
    return out


@pytest.mark.parametrize("dtype", HALVES)
def test_widening_is_exact_for_every_bit_pattern(dtype):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    got, want = _compiled_run(lambda t: t.float() * 1.0, bits), bits.float()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("dtype", HALVES)
def test_narrowing_rounds_as_torch_does(dtype):
    gen = torch.Generator().manual_seed(1)
    patterns = torch.randint(-2**31, 2**31 - 1, (200_000,), dtype=torch.int32, generator=gen).view(torch.float32)
    x = torch.cat([patterns, torch.tensor(SPECIAL), torch.randn(10_000, generator=gen) * 1e-5,
                   torch.randn(10_000, generator=gen) * 1e4])
    got, want = _compiled_run(lambda t: (t * 1.0).to(dtype), x), x.to(dtype)
    assert got.dtype == dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    differ = got.view(torch.int16)[~nan] != want.view(torch.int16)[~nan]
    assert not differ.any(), f"{int(differ.sum())} of {x.numel()} conversions differ from torch's"


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("numel", [1, 7, 1000])
def test_odd_sizes_and_mixed_outputs(dtype, numel):
    """Half outputs of odd length (a padded last word), beside a float32 output of the same kernel, reading a
    half and a float32 input."""
    a, b = torch.randn(numel).to(dtype), torch.randn(numel)

    def fn(a, b):
        s = a.float() * b
        return s.to(dtype), s.exp(), (a + 1).sum()

    got = _compiled_run(fn, a, b)
    want = fn(a, b)
    exact = fn(a.double(), b.double())
    for g, w, x in zip(got, want, exact):
        assert g.dtype == w.dtype
        assert_within_eager_error(g, w, x, floor=1e-6)


def test_large_outputs_take_several_pairs_per_thread():
    """Past ``MIN_WORKGROUPS`` workgroups a thread stores several element pairs, a workgroup width apart (a pair
    index times two is an element index: the H200's SmolLM2 logits came out wrong when it was not bracketed)."""
    from meganeura.kernels.pointwise import MIN_WORKGROUPS, WORKGROUP

    n = 2 * 2 * WORKGROUP * MIN_WORKGROUPS + 3  # two pairs a thread, an odd tail
    a = torch.randn(n).to(torch.bfloat16)

    def fn(a):
        s = a.float() * 2 + 1
        return s.to(torch.bfloat16), s.sin()

    got, want = _compiled_run(fn, a), fn(a)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", HALVES)
def test_half_layers_against_float64(dtype):
    """Matmul, convolution, norms, attention and reductions in a half precision graph: outputs in the dtype,
    within eager's error of float64."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    lin = torch.nn.Linear(8, 8)
    norm = torch.nn.LayerNorm(8)

    def fn(x, q, k, v):
        y = torch.nn.functional.group_norm(conv(x), 2).mean((2, 3))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return norm(lin(y)).softmax(-1), att, y.amax(-1)

    inputs = [torch.randn(2, 3, 8, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)]
    for m in (conv, lin, norm):
        m.to(dtype)
    got = _compiled_run(fn, *[t.to(dtype) for t in inputs])
    want = fn(*[t.to(dtype) for t in inputs])
    for m in (conv, lin, norm):
        m.double()
    exact = fn(*[t.to(dtype).double() for t in inputs])
    for i, (g, w, x) in enumerate(zip(got, want, exact)):
        assert g.dtype == dtype, f"output {i} is {g.dtype}"
        assert_within_eager_error(g, w, x, what=f"output {i}")


def _saved_and_loaded(tmp_path, model):
    """``model`` saved in bfloat16 and loaded back as a user loads a checkpoint (default dtype: as stored)."""
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    return type(model).from_pretrained(tmp_path)


def test_llama_checkpoint_in_bfloat16(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = _saved_and_loaded(tmp_path, LlamaForCausalLM(config)).eval()
    assert model.dtype == torch.bfloat16  # what transformers 5 gives by default
    ids = torch.randint(0, 96, (2, 10))
    got = _compiled_run(lambda i: model(i, use_cache=False).logits, ids)
    want = model(ids, use_cache=False).logits
    exact = model.double()(ids, use_cache=False).logits
    assert got.dtype == torch.bfloat16
    assert_within_eager_error(got, want, exact, what="logits")


def test_bfloat16_llama_takes_the_dispatches_of_float32():
    """Rounding to bfloat16 is as cheap as index arithmetic: the rotary embedding and repeated KV heads, rounded to
    the model's dtype, stay attention prologues (they were two dispatches more a layer); the logits' projection
    stores them in bfloat16 itself (96 columns: by pairs), with no narrowing copy after it (it was one more)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from torch_meganeura import explain

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 96, (1, 1))
    counts = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        torch._dynamo.reset()
        with torch.no_grad():
            counts[dtype] = explain(lambda i: model(i, use_cache=False).logits, ids).dispatches
    assert counts[torch.bfloat16] == counts[torch.float32], counts


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
def test_an_attention_output_feeds_its_projection_rounded(dtype):
    """The attention kernel stores float32; in a half precision model the output projection must read its output
    rounded to the dtype (as eager stores it), through the heads' transpose and reshape (HF Whisper's encoder). It
    reads it rounded in its operand loads, with no dispatch of its own: values within eager's error, and float32's
    dispatches (the final layer norm stores the result in the dtype itself, with no narrowing copy)."""
    from transformers import WhisperConfig, WhisperModel

    from torch_meganeura import explain

    torch.manual_seed(0)
    config = WhisperConfig(d_model=32, encoder_attention_heads=4, encoder_layers=2, encoder_ffn_dim=64,
                           decoder_layers=1, decoder_attention_heads=4, num_mel_bins=16, max_source_positions=8)
    encoder = WhisperModel(config).get_encoder().eval()
    features = torch.randn(1, 16, 16)
    counts = {}
    for d in (torch.float32, dtype):
        encoder.to(d)
        torch._dynamo.reset()
        with torch.no_grad():
            counts[d] = explain(lambda x: encoder(x).last_hidden_state, features.to(d)).dispatches
    with torch.no_grad():
        got = _compiled_run(lambda x: encoder(x).last_hidden_state, features.to(dtype))
        want = encoder(features.to(dtype)).last_hidden_state
        exact = encoder.double()(features.double()).last_hidden_state
    assert_within_eager_error(got, want, exact, what="last_hidden_state")
    assert counts[dtype] == counts[torch.float32], counts


def test_training_in_bfloat16_with_labels(tmp_path):
    """bf16 parameters trained directly through the backend with HF's own loss: loss and every gradient within
    eager bf16's error of float64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = _saved_and_loaded(tmp_path, LlamaForCausalLM(config)).train()
    exact = LlamaForCausalLM(config).double().train()
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ids = torch.randint(0, 96, (2, 8))
    loss = _compiled_run(lambda i: model(i, labels=i).loss, ids)
    loss.backward()
    ours = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    eager_loss = model(ids, labels=ids).loss
    eager_loss.backward()
    exact_loss = exact(ids, labels=ids).loss
    exact_loss.backward()
    assert loss.dtype == eager_loss.dtype  # HF computes the loss on logits cast to float32
    assert_within_eager_error(loss, eager_loss, exact_loss, what="loss")
    for name, p in model.named_parameters():
        assert ours[name].dtype == torch.bfloat16
        assert_within_eager_error(ours[name], p.grad, dict(exact.named_parameters())[name].grad, what=f"d {name}")


def test_autocast_region_runs_on_the_device():
    """A CPU autocast region (bf16 matmuls, f32 elsewhere), forward and backward, f32 master weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(6, 16)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().square().mean()

    loss = _compiled_run(step, x)
    loss.backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    eager = step(x)
    eager.backward()
    exact = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).double()
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    exact_loss = exact(x.double()).square().mean()
    exact_loss.backward()
    assert_within_eager_error(loss, eager, exact_loss, what="loss")
    for p, got, e in zip(model.parameters(), ours, exact.parameters()):
        assert got.dtype == torch.float32
        assert_within_eager_error(got, p.grad, e.grad, what="gradient")


# The weight is computed as torch's weight-norm kernel computes it, then convolved and differentiated with the same
# roundings as eager: within 10 % of eager's error (measured 0.91-1.02x over six seeds; three roundings gave 1.15x).
SAME_AS_EAGER = 1.1


@pytest.mark.parametrize("dtype", HALVES)
def test_weight_norm_backward_gets_float32_norms(dtype):
    """A weight-normed convolution (wav2vec2's positional one) trained in half precision. Its forward decomposes
    onto the device and its backward (no lowering) runs torch's CPU kernel, which takes the forward's norms in
    float32 for both halves: torch's decomposition kept float16's in float16 and that kernel raised "expected scalar
    type Float but found Half". The weight is computed in float32 and rounded once, as that kernel does (torch's
    decomposition rounded three times: the output 1.15x eager's error, g's gradient up to 1.9x). Output and
    gradients within eager's error of float64; 32 channels and a kernel of 33 (wav2vec2's is 128), so that each
    gradient has enough elements for its error to be a measurement, not one element's rounding."""
    torch.manual_seed(0)
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(8, 32, 33, padding=16), dim=2)
    conv.to(dtype)
    eager = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(8, 32, 33, padding=16), dim=2)
    exact = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(8, 32, 33, padding=16), dim=2).double()
    eager.to(dtype).load_state_dict(conv.state_dict())
    exact.load_state_dict({k: v.double() for k, v in conv.state_dict().items()})
    x = torch.randn(2, 8, 40).to(dtype)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(conv, backend="meganeura")(x)
        out.double().square().sum().backward()
    assert all("_weight_norm_interface_backward" in w for w in meganeura_warnings(caught)), meganeura_warnings(caught)
    want, truth = eager(x), exact(x.double())
    want.double().square().sum().backward()
    truth.square().sum().backward()
    assert_within_eager_error(out, want, truth, factor=SAME_AS_EAGER, what="output")
    for (name, p), q, r in zip(conv.named_parameters(), eager.parameters(), exact.parameters()):
        assert p.grad.dtype == dtype
        assert_within_eager_error(p.grad, q.grad, r.grad, factor=SAME_AS_EAGER, what=f"d {name}")


def test_half_storage_needs_no_shader_f16(monkeypatch):
    """The kernels of a half precision graph declare no f16 type: they run on adapters without ``shader-f16``."""
    plans = record_compiled_plans(monkeypatch)
    x, w = torch.randn(4, 8).to(torch.float16), torch.randn(8, 8).to(torch.float16)
    got = _compiled_run(lambda x, w: torch.nn.functional.silu(x @ w).sum(0), x, w)
    assert got.dtype == torch.float16 and plans
    sources = [src for plan in plans for src in plan.kernels.values()]
    assert any("mg_widen_f16" in src for src in sources) and any("mg_pack_f16" in src for src in sources)
    assert not any("enable f16" in src or "f16>" in src or ": f16" in src for src in sources)


TORCH_FREE_RUN = textwrap.dedent("""\
    import sys
    sys.modules["torch"] = None  # importing torch now raises ImportError
    import numpy as np
    from meganeura.runtime import load
    bundle, ids, out = sys.argv[1:]
    outputs = load(bundle)(input_ids=np.load(ids))
    np.savez(out, **outputs)
""")


def test_bundle_keeps_bfloat16_and_runs_without_torch(tmp_path):
    """A bf16 checkpoint exports with bf16 weights (safetensors BF16: half the bytes) and runs torch-free, its
    bf16 logits (raw bits in uint16) within eager bf16's error of float64."""
    from safetensors import deserialize
    from transformers import LlamaConfig, LlamaForCausalLM

    import torch_meganeura
    from meganeura.runtime.dtypes import bfloat16_values

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = _saved_and_loaded(tmp_path / "checkpoint", LlamaForCausalLM(config)).eval()
    ids = torch.randint(0, 96, (1, 8))
    manifest = torch_meganeura.export(model, {"input_ids": ids}, tmp_path / "bundle")
    weights_file = (tmp_path / "bundle" / "weights.safetensors").read_bytes()
    stored = {name: entry["dtype"] for name, entry in deserialize(weights_file)}
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for param in manifest["params"]:  # the weights in bf16, rotary frequencies (a float32 buffer) in float32
        want = {torch.bfloat16: "BF16", torch.float32: "F32"}[tensors[param["source"]].dtype]
        assert stored[param["plan_name"]] == want, param
    np.save(tmp_path / "ids.npy", ids.numpy())
    subprocess.run([sys.executable, "-c", TORCH_FREE_RUN, str(tmp_path / "bundle"), str(tmp_path / "ids.npy"),
                    str(tmp_path / "out.npz")], check=True, timeout=300)
    logits = np.load(tmp_path / "out.npz")["logits"]
    assert logits.dtype == np.uint16
    with torch.no_grad():
        eager = model(ids).logits
        exact = model.double()(ids).logits
    assert_within_eager_error(torch.from_numpy(bfloat16_values(logits)), eager, exact, what="logits")


@pytest.mark.parametrize("mode", ["bfloat16", "autocast"])
def test_resident_step_in_half_precision(mode):
    """compile_train_step on bf16 parameters, and on f32 master weights under CPU autocast: after three SGD steps
    with momentum, every parameter within eager's error of float64 (same loop in float64)."""
    import torch_meganeura

    torch.manual_seed(0)
    layers = lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),  # noqa: E731
                                         torch.nn.Linear(32, 4))
    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    ours, eager, exact = layers().to(dtype), layers(), layers()
    eager.load_state_dict(ours.state_dict())
    exact.load_state_dict(ours.state_dict())
    eager.to(dtype)
    exact.double()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def loss_fn(model, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            return torch.nn.functional.cross_entropy(model(x).float(), y)

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = torch_meganeura.compile_train_step(ours, loss_fn, sgd(ours))
        for _ in range(3):
            step(x.to(dtype), y)
        step.sync_to_module()
    assert not meganeura_warnings(caught), meganeura_warnings(caught)
    for model, batch in ((eager, x.to(dtype)), (exact, x.double())):
        opt = sgd(model)
        for _ in range(3):
            opt.zero_grad()
            loss_fn(model, batch, y).backward()
            opt.step()
    grads_loss, grads = step.gradients(x.to(dtype), y)  # read back in the parameters' dtype, not raw bits
    assert grads_loss.dtype == torch.float32 and all(g.dtype == dtype for g in grads.values())
    for (name, got), want, truth in zip(ours.named_parameters(), eager.parameters(), exact.parameters()):
        assert got.dtype == dtype
        assert_within_eager_error(got, want, truth, what=name)
