"""HF ``generate`` through the backend as users call it: ``model.forward = torch.compile(model.forward,
backend="meganeura")``, greedy, with the default (dynamic) KV cache and with the static cache. The tokens must equal
eager's, and a decode step must not move the KV cache between host and device: the cache tensors a call returns stay
on the device (``device_tensor.DeviceTensor``) and are bound as they are when the next call takes them back."""
import pytest
import torch

from helpers.compare import device_counters
from helpers.models import LLAMA

PROMPT = 7
NEW_TOKENS = 12
STEP_UPLOAD_BYTES = 64  # a decode step's token id and cache position (int32 each), with room to spare
STEP_READBACK_EXTRA = 64  # beside the logits: the status words


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, "use_cache": True})).eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config).eval()


class StepCounter:
    """Wraps a compiled forward: the device's bytes moved by each call."""

    def __init__(self, forward):
        self.forward, self.steps = forward, []

    def __call__(self, *args, **kwargs):
        before = device_counters()
        out = self.forward(*args, **kwargs)
        after = device_counters()
        self.steps.append({k: after[k] - before[k] for k in ("bytes_uploaded", "bytes_downloaded")})
        return out


def _generate(model, prompt, **kwargs):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_default_cache_gives_eager_tokens_and_keeps_the_cache_on_the_device(make):
    torch._dynamo.reset()
    model = make()
    prompt = torch.randint(0, 128, (1, PROMPT))
    want = _generate(model, prompt)
    model.forward = StepCounter(torch.compile(model.forward, backend="meganeura"))
    assert _generate(model, prompt).tolist() == want.tolist()
    model.forward.steps.clear()
    assert _generate(model, prompt).tolist() == want.tolist()  # every length compiled: steady steps only
    vocab_bytes = 4 * model.config.vocab_size
    decode = model.forward.steps[1:]
    assert len(decode) == NEW_TOKENS - 1
    for step in decode:
        assert step["bytes_uploaded"] <= STEP_UPLOAD_BYTES, step
        assert step["bytes_downloaded"] <= vocab_bytes + STEP_READBACK_EXTRA, step


def test_static_cache_gives_eager_tokens():
    torch._dynamo.reset()
    model = _llama()
    prompt = torch.randint(0, 128, (1, PROMPT))
    want = _generate(model, prompt, cache_implementation="static")
    model.forward = torch.compile(model.forward, backend="meganeura")
    assert _generate(model, prompt, cache_implementation="static").tolist() == want.tolist()


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

    torch.testing.assert_close(kept, want)  # an eager read: downloaded once
    torch.testing.assert_close(kept[1] + 1, want[1] + 1)
    kept.mul_(3)  # an eager write: goes up with the next call that takes it
    torch.testing.assert_close(use_c(kept, y), use(3 * want, y))
