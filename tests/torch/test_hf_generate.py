"""HF ``generate`` through the backend as users call it: ``model.forward = torch.compile(model.forward,
backend="meganeura")``, greedy, 64 new tokens, with the default (dynamic) KV cache and with the static cache. The
tokens must equal eager's; no kernel is compiled once dynamo has its decode graph, whatever the length (plans over
symbolic sizes); a decode step does not move the KV cache between host and device: the cache tensors a call
returns stay on the device (``device_tensor.DeviceTensor``) and are bound as they are when the next call takes them
back, and a static cache is updated in place on the device; and once compiled, a decode step allocates no device
memory."""
import copy

import pytest
import torch

from helpers.compare import device_counters
from helpers.models import LLAMA, tiny_gemma, tiny_qwen2

PROMPT = 7
NEW_TOKENS = 64
COLD_NEW_TOKENS = 6  # enough for the decode's second and third calls, where a guard that failed would compile again
STEP_UPLOAD_BYTES = 128  # a decode step's token id, positions and sizes (int32 each), with room to spare
STEP_READBACK_EXTRA = 64  # beside the logits: the status words
# Forward calls before the steady state, default cache: the prefill and the decode graph (dynamic from its first
# call: the cache the prefill returned is marked so; kernels compiled last here), then the cache coming back once
# read back (the output tensors are DeviceTensors from the start, so dynamo traces no graph again).
DEFAULT_CACHE_KERNELS_UNTIL, DEFAULT_CACHE_STEADY_FROM = 2, 3
# Static cache: the prefill (which leaves the cache's tensors on the device), then the decode graph.
STATIC_CACHE_KERNELS_UNTIL, STATIC_CACHE_STEADY_FROM = 2, 2
# Default cache, first generate: the first calls, then two steps at each doubling of the decode plan's bound on the
# cache's length (16, 32, 64, 128 positions; measured: 11 steps of 64).
ALLOCATING_STEPS = DEFAULT_CACHE_STEADY_FROM + 2 * 4 + 1


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, "use_cache": True, "max_position_embeddings": 128})).eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config).eval()


class StepCounter:
    """Wraps a compiled forward: the device's bytes moved and pipelines created by each call."""

    KEYS = ("bytes_uploaded", "bytes_downloaded", "pipelines_created", "bytes_allocated", "bind_groups_created")

    def __init__(self, forward):
        self.forward, self.steps = forward, []

    def __call__(self, *args, **kwargs):
        before = device_counters()
        out = self.forward(*args, **kwargs)
        after = device_counters()
        self.steps.append({k: after[k] - before[k] for k in self.KEYS})
        return out


def _generate(model, prompt, **kwargs):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def _check_steps(steps, vocab: int, kernels_until: int, steady_from: int, mask_positions: int = 0) -> None:
    """No kernel from call ``kernels_until`` on; from ``steady_from`` on, each call moves its inputs (and an attention
    mask of ``mask_positions``, int32 each) up and the logits down, not the cache."""
    assert len(steps) == NEW_TOKENS
    for k, step in enumerate(steps):
        if k >= kernels_until:
            assert step["pipelines_created"] == 0, (k, step)
        if k >= steady_from:
            assert step["bytes_uploaded"] <= STEP_UPLOAD_BYTES + 4 * mask_positions, (k, step)
            assert step["bytes_downloaded"] <= 4 * vocab + STEP_READBACK_EXTRA, (k, step)


# (Qwen2 and Gemma, another minute each on lavapipe, in the slow suite: the default one stays within its 10 minutes)
@pytest.mark.parametrize("make", [_llama, pytest.param(tiny_qwen2, marks=pytest.mark.slow),
                                  pytest.param(tiny_gemma, marks=pytest.mark.slow), _gpt2],
                         ids=["llama", "qwen2", "gemma", "gpt2"])
def test_default_cache_gives_eager_tokens_and_keeps_the_cache_on_the_device(make):
    torch._dynamo.reset()
    model = make()
    prompt = torch.randint(0, 128, (1, PROMPT))
    want = _generate(model, prompt)
    model.forward = StepCounter(torch.compile(model.forward, backend="meganeura"))
    graphs = torch._dynamo.utils.counters["stats"]
    first = graphs["unique_graphs"]
    assert _generate(model, prompt).tolist() == want.tolist()
    _check_steps(model.forward.steps, model.config.vocab_size, DEFAULT_CACHE_KERNELS_UNTIL, DEFAULT_CACHE_STEADY_FROM)
    assert graphs["unique_graphs"] - first == 2  # the prefill and the decode
    # A decode step allocates no device memory but where its plan's bounds grow: the cache one token longer takes
    # the buffers the step before gave back (with buffers of exact sizes, every step allocated, and kept, its own).
    allocating = [k for k, s in enumerate(model.forward.steps) if s["bytes_allocated"] > 0]
    assert len(allocating) <= ALLOCATING_STEPS, allocating
    model.forward.steps.clear()
    assert _generate(model, prompt).tolist() == want.tolist()  # everything compiled: every step is steady
    _check_steps(model.forward.steps, model.config.vocab_size, 0, 1)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_static_cache_gives_eager_tokens_and_is_updated_on_the_device(make):
    """The static cache's buffers are updated in place on the device (the position checks run first, in kernels of
    their own), also across generate calls (the cache is reset in eager between them) and prompt lengths."""
    torch._dynamo.reset()
    model = make()
    prompts = [torch.randint(0, 128, (1, PROMPT)), torch.randint(0, 128, (1, PROMPT + 5))]
    wants = [_generate(model, p, cache_implementation="static") for p in prompts]
    model.forward = StepCounter(torch.compile(model.forward, backend="meganeura"))
    cache = PROMPT + 5 + NEW_TOKENS  # positions of the longer call's cache: its mask covers them all
    assert _generate(model, prompts[0], cache_implementation="static").tolist() == wants[0].tolist()
    _check_steps(model.forward.steps, model.config.vocab_size, STATIC_CACHE_KERNELS_UNTIL, STATIC_CACHE_STEADY_FROM,
                 cache)
    model.forward.steps.clear()
    assert _generate(model, prompts[1], cache_implementation="static").tolist() == wants[1].tolist()
    # A new prefill length (its graph dynamic now); the new cache (another length) goes up once, at the first decode
    _check_steps(model.forward.steps, model.config.vocab_size, 1, 2, cache)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert _generate(model, prompts[1], cache_implementation="static").tolist() == wants[1].tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a generate call traced the model again"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_cold_generate_compiles_the_prefill_and_the_decode_once(cache):
    """A cold ``generate`` (HF's auto-compile off, as on a GPU with ``model.forward`` compiled by hand) makes dynamo
    compile two frames with either cache, the prefill and the decode, and none at a second call; eager's tokens. (The
    static cache's ``cumulative_length``, which the prefill updates and returns, was copied on the host and stayed a
    plain tensor; the decode's first run made it a ``DeviceTensor``, and dynamo's guard on its class compiled the
    decode a second time at its second call: a third frame, a third of the cold call.)"""
    torch._dynamo.reset()
    model = _llama()
    prompt = torch.randint(0, 128, (1, PROMPT))
    kwargs = dict(max_new_tokens=COLD_NEW_TOKENS, do_sample=False, disable_compile=True,
                  **({"cache_implementation": "static"} if cache == "static" else {}))
    with torch.no_grad():
        want = model.generate(prompt, **kwargs)
        model.forward = torch.compile(model.forward, backend="meganeura")
        graphs = torch._dynamo.utils.counters["stats"]
        first = graphs["unique_graphs"]
        for _ in range(2):
            assert model.generate(prompt, **kwargs).tolist() == want.tolist()
            assert graphs["unique_graphs"] - first == 2  # the prefill and the decode


def test_a_returned_tensor_reads_as_eager_and_goes_back_without_an_upload():
    """An output that came back as an input of a compiled call stays on the device from the next call on: passed to
    a compiled call it is bound as it is; eager code that reads it gets eager's values (downloaded once, at the
    first read); written in eager, it goes up with the next call."""
    def grow(cache, x):
        return torch.cat([cache, x * 2], dim=1)

    def use(cache, y):
        return (cache * y).sum()

    torch._dynamo.reset()
    grow_c = torch.compile(grow, backend="meganeura", dynamic=False)
    use_c = torch.compile(use, backend="meganeura", dynamic=False)
    cache, x, y = torch.randn(2, 3), torch.randn(2, 1), torch.randn(2, 4)
    want = grow(cache, x)

    use_c(grow_c(cache, x), y)  # read back, and seen again as an input
    kept = grow_c(cache, x)
    before = device_counters()
    torch.testing.assert_close(use_c(kept, y), use(want, y))
    moved = {k: device_counters()[k] - before[k] for k in ("bytes_uploaded", "bytes_downloaded")}
    assert moved["bytes_uploaded"] == y.numel() * 4, moved  # y alone went up: the cache was bound as it was
    assert moved["bytes_downloaded"] < kept.numel() * 4, moved  # the sum came back, not the cache

    torch.testing.assert_close(kept, want)  # an eager read: downloaded once, an ordinary tensor from then on
    assert type(kept) is torch.Tensor
    torch.testing.assert_close(kept[1] + 1, want[1] + 1)
    kept.mul_(3)  # an eager write: goes up with the next call that takes it
    torch.testing.assert_close(use_c(kept, y), use(3 * want, y))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_batch_with_left_padding_gives_eager_tokens(cache):
    """Two prompts, one left-padded (HF's attention mask grows with the cache each step): eager's tokens."""
    torch._dynamo.reset()
    model = _llama()
    ids = torch.randint(1, 128, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    ids[1, :3], mask[1, :3] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    kwargs.update({"cache_implementation": "static"} if cache == "static" else {})
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        model.forward = torch.compile(model.forward, backend="meganeura")
        assert model.generate(ids, **kwargs).tolist() == want.tolist()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_bfloat16_model_generates_within_eager_bfloat16s_error(cache):
    """The model as transformers 5 loads a checkpoint (bfloat16): weights and KV cache stay in 16 bits on the
    device, computed in f32. The scores of each generated token (the decode path) are judged against float64 on the
    same tokens: no farther than 1.5x eager bfloat16's own error (issue 35's gate). (Greedy tokens may differ from
    eager bfloat16's: random weights' top two logits lie within one bfloat16 step of each other.)"""
    torch._dynamo.reset()
    model = _llama().to(torch.bfloat16)
    reference = copy.deepcopy(model).double()
    ids = torch.randint(1, 128, (1, 9))
    kwargs = dict(max_new_tokens=16, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  **({"cache_implementation": "static"} if cache == "static" else {}))
    with torch.no_grad():
        eager_model = copy.deepcopy(model)
        model.forward = torch.compile(model.forward, backend="meganeura")
        ours = model.generate(ids, **kwargs)
        tokens = ours.sequences
        exact = reference(tokens).logits[0, ids.shape[1] - 1:-1]
        eager = eager_model(tokens).logits[0, ids.shape[1] - 1:-1].double()
    got = torch.stack([s[0] for s in ours.scores]).double()

    def error(x):
        return ((x - exact).norm() / exact.norm()).item()

    assert error(got) <= 1.5 * error(eager), (error(got), error(eager))


def test_steady_decode_steps_build_no_bind_groups():
    """Many layers' cache arrays of one size share the pool: each output takes back the buffer it had two steps
    before (``Program._new_output``), so a generate call's steps repeat the buffers of the call before and reuse
    its bind groups from the fourth step on. Dealt in the pool's order, two more steps per call built them again
    (8 layers: 48 bind groups; SmolLM2's 30: 180)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    config = LlamaConfig(**{**LLAMA, "use_cache": True, "max_position_embeddings": 64, "num_hidden_layers": 8})
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 128, (1, PROMPT))
    model.forward = StepCounter(torch.compile(model.forward, backend="meganeura"))
    for _ in range(2):
        model.forward.steps.clear()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    built = [k for k, s in enumerate(model.forward.steps) if s["bind_groups_created"]]
    assert built == list(range(DEFAULT_CACHE_STEADY_FROM + 1)), built  # the prefill and the decode's first calls



# A decode step's dispatches per Llama layer, with either cache: the query/key/value projection, attention with the
# key and value cache writes in its dispatch (the static cache's new rows, the default cache's concatenations; the
# position computed there too; lowering/attention_writes.py), the output projection, gate and up, down: as many as the
# generation bundle's for the adapter's limits (test_export_lm.LLAMA_DECODE_DISPATCHES_PER_LAYER_WIDE). Before: 11
# with the static cache (the position's index arithmetic, its int64 overflow and two bounds checks in kernels of each
# layer's, the counter's own overflow check too, and the value write apart from the key's, the value cache's length
# a symbol of its own), 7 with the default cache (the key's and the value's concatenations in kernels of their own),
# then 6 (the two cache writes in one kernel of their own: lowering/sibling_updates.py).
DECODE_DISPATCHES_PER_LAYER = 5
# Not a layer's, static cache: the position checks of every layer (one kernel at the front), the rotary embedding's
# cosine and sine, the counters' update (one kernel after the last cache write) and the last norm with the head's
# product; default cache: the rotary embedding's and the head's.
DECODE_DISPATCHES_NOT_A_LAYER = {"static": 4, "dynamic": 2}
# Held to WebGPU's default 8 storage bindings (MEGANEURA_LIMITS=webgpu-default, scripts/test-portable.sh), as counted
# on lavapipe: the backend's decode keeps each layer's cache write in a kernel of its own (the merged kernel would bind
# more than 8; the generation bundle's packs its projections' outputs for it, lowering/packed.py, the backend's graph
# not yet), and the static cache's position arithmetic in 4 kernels more (its ``add``s).
PORTABLE_STORAGE_BINDINGS = 8
PORTABLE_DISPATCHES_PER_LAYER = 6
PORTABLE_DISPATCHES_NOT_A_LAYER = {"static": 8, "dynamic": 3}
DECODE_LAYERS = 3  # (the counters' update after the last layer's cache write: outside the first layer's window)
CACHE_ARGS = {"static": {"cache_implementation": "static", "disable_compile": True}, "dynamic": {}}


def _one_row(labels: list[str]) -> bool:
    """Whether dispatch ``labels`` are a decode step's: its products before the first attention are of one row
    (``schedule._label``: the op, then rows x columns x K)."""
    before = labels[:labels.index("attention")] if "attention" in labels else []
    return bool(before) and all(label.startswith("matmul 1x") for label in before if label.startswith("matmul"))


def _decode_plan_labels(monkeypatch, cache: str) -> list[str]:
    """The dispatch labels of the last decode plan a greedy ``generate`` through the backend compiled for a
    DECODE_LAYERS-layer Llama with ``cache``, whose tokens must be eager's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from torch_meganeura.backend import per_call

    plans = []
    program_for = per_call.program_for

    def spy(graph, *args, **kwargs):
        plans.append(graph.plan)
        return program_for(graph, *args, **kwargs)

    monkeypatch.setattr(per_call, "program_for", spy)
    torch._dynamo.reset()
    config = LlamaConfig(**{**LLAMA, "use_cache": True, "max_position_embeddings": 64,
                            "num_hidden_layers": DECODE_LAYERS})
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 128, (1, PROMPT))
    kwargs = dict(max_new_tokens=COLD_NEW_TOKENS, do_sample=False, **CACHE_ARGS[cache])
    with torch.no_grad():
        want = model.generate(prompt, **kwargs)
        model.forward = torch.compile(model.forward, backend="meganeura")
        assert model.generate(prompt, **kwargs).tolist() == want.tolist()
    decode = [labels for labels in ([d.label for d in plan.dispatches] for plan in plans) if _one_row(labels)]
    assert decode, [[d.label for d in plan.dispatches] for plan in plans]
    return decode[-1]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_a_decode_step_takes_a_counted_number_of_dispatches_per_layer(monkeypatch, cache):
    """A layer's decode takes DECODE_DISPATCHES_PER_LAYER dispatches with either cache, the whole step
    DECODE_DISPATCHES_NOT_A_LAYER more (held to WebGPU's default limits, the PORTABLE_ counts); eager's tokens.
    HF's static cache keeps a position counter per layer, each added to ``arange`` and checked (int64 overflow,
    bounds) before the layer's cache write: those checks run in one kernel at the plan's front (a failing one still
    leaves the caches as they were: tests/lowering/test_data_checks.py)."""
    from meganeura.runtime.device import get_device

    labels = _decode_plan_labels(monkeypatch, cache)
    portable = get_device().limits["max-storage-buffers-per-shader-stage"] <= PORTABLE_STORAGE_BINDINGS
    per_layer = PORTABLE_DISPATCHES_PER_LAYER if portable else DECODE_DISPATCHES_PER_LAYER
    not_a_layer = (PORTABLE_DISPATCHES_NOT_A_LAYER if portable else DECODE_DISPATCHES_NOT_A_LAYER)[cache]
    attentions = [i for i, label in enumerate(labels) if label == "attention"]
    assert len(attentions) == DECODE_LAYERS, labels
    assert attentions[1] - attentions[0] == per_layer, labels
    assert len(labels) == DECODE_LAYERS * per_layer + not_a_layer, labels
    if cache == "static":
        assert labels.count("checks") == 1 and labels[0] == "checks", labels
