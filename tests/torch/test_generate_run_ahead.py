"""Run-ahead decoding (``meganeura.runtime.run_ahead``): a Llama bundle submits decode steps ahead of reading their
tokens, and gives the tokens of the synchronous way (``run_ahead = 1``) and of HF eager's greedy ``generate``: one
prompt and a batch of prompts of different lengths, greedy with and without an end-of-sequence id met mid-way, and
seeded temperature sampling. The host waits for the GPU about once per two tokens, not once per token; the stats
count the tokens a user got; a status error set by a decode step is raised at the read of its tokens, naming the
op; ``MEGANEURA_SYNC=1`` reads each step before the next."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_meganeura
from helpers.models import LLAMA
from meganeura.runtime import KernelStatusError, load
from meganeura.runtime.device import get_device
from meganeura.runtime.run_ahead import RUN_AHEAD

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
CACHE = 64
NEW = 40
PROMPT = 8
LENGTHS = (5, 37, 1, 12)  # a batch: one prompt past the prefill chunk of 32, one of a single token
SYNC = 1  # ``run_ahead`` of the synchronous way


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, "max_position_embeddings": 128})).eval()


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """A Llama, its one-row bundle and its bundle of batch_size=4."""
    torch.manual_seed(0)
    model = _llama()
    path = tmp_path_factory.mktemp("run_ahead")
    torch_meganeura.export_lm(model, path / "one", max_cache_len=CACHE)
    torch_meganeura.export_lm(model, path / "four", max_cache_len=CACHE, batch_size=len(LENGTHS))
    return model, load(path / "one"), load(path / "four")


def _both(lm, *args, **kwargs):
    """``lm.generate(*args, **kwargs)`` run ahead and synchronously, with the stats of each."""
    out = {}
    for ahead in (RUN_AHEAD, SYNC):
        lm.run_ahead = ahead
        out[ahead] = (lm.generate(*args, **kwargs), lm.stats)
    lm.run_ahead = RUN_AHEAD
    return out[RUN_AHEAD], out[SYNC]


def _mid_way_token(new: list[int], low: int, high: int) -> int:
    """A token that first appears in ``new`` at an index in [low, high) (so that stopping at it ends mid-way)."""
    return next(t for k, t in enumerate(new) if low <= k < high and t not in new[:k])


def test_one_prompt_gives_the_synchronous_and_hf_tokens(bundles):
    """Greedy (to the end, and up to an end-of-sequence id that greedy makes mid-way) and seeded temperature
    sampling: the tokens run ahead are the synchronous way's, greedy's are HF's; the stats count what was given."""
    model, lm, _ = bundles
    prompt = torch.randint(0, LLAMA["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(3))
    (ahead, stats), (sync, _) = _both(lm, prompt[0].numpy(), NEW, eos_token_id=[])
    assert ahead.tolist() == sync.tolist() == model.generate(prompt, max_new_tokens=NEW, do_sample=False)[0].tolist()
    assert stats.new_tokens == NEW and stats.decode_tokens == len(stats.decode_steps) == NEW - 1
    assert sum(stats.decode_steps) == pytest.approx(stats.decode_seconds)
    stop = _mid_way_token(ahead[PROMPT:].tolist(), 5, NEW - RUN_AHEAD - 1)
    (ahead, stats), (sync, _) = _both(lm, prompt[0].numpy(), NEW, eos_token_id=stop)
    assert ahead.tolist() == sync.tolist() and ahead[-1] == stop and stop not in ahead[PROMPT:-1]
    assert stats.new_tokens == len(ahead) - PROMPT and len(stats.decode_steps) == stats.new_tokens - 1
    streamed = list(lm.stream(prompt[0].numpy(), NEW, eos_token_id=stop))
    assert streamed == ahead[PROMPT:].tolist()
    (ahead, _), (sync, _) = _both(lm, prompt[0].numpy(), 24, temperature=0.9, seed=5)
    assert ahead.tolist() == sync.tolist()


def test_a_batch_of_prompts_gives_the_synchronous_tokens(bundles):
    """Four prompts of different lengths, greedy to the end, then with an end-of-sequence id one row makes mid-way
    (that row stops there, the others go on), and seeded sampling: run ahead, the synchronous way's tokens; each
    prompt's greedy tokens are HF's for it alone."""
    model, _, lm = bundles
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, LLAMA["vocab_size"], (1, n), generator=generator) for n in LENGTHS]
    ids = [p[0].numpy() for p in prompts]
    new = 20
    (ahead, stats), (sync, _) = _both(lm, ids, new, eos_token_id=[])
    for prompt, got, want in zip(prompts, ahead, sync):
        assert got.tolist() == want.tolist() == model.generate(prompt, max_new_tokens=new, do_sample=False)[0].tolist()
    assert stats.new_tokens == new * len(LENGTHS) and len(stats.decode_steps) == new - 1
    stop = _mid_way_token(ahead[0][LENGTHS[0]:].tolist(), 3, new - RUN_AHEAD - 1)
    (ahead, _), (sync, _) = _both(lm, ids, new, eos_token_id=stop)
    assert [a.tolist() for a in ahead] == [s.tolist() for s in sync]
    assert ahead[0][-1] == stop and len(ahead[0]) < LENGTHS[0] + new
    (ahead, _), (sync, _) = _both(lm, ids, 12, temperature=0.9, seed=2)
    assert [a.tolist() for a in ahead] == [s.tolist() for s in sync]


def test_the_host_waits_about_once_per_two_tokens(bundles):
    """Counted on the device: run ahead, a decode of N tokens waits for the GPU once for the prefill's token and once
    per RUN_AHEAD // 2 decode steps; synchronously, once per token. Each step still uploads a few numbers only (its
    ids stay on the device) and reads back its token and status word."""
    _, lm, _ = bundles
    counters, prompt, new = get_device().counters, np.arange(3, 3 + PROMPT), 33
    waits = {}
    for ahead in (RUN_AHEAD, SYNC):
        lm.run_ahead = ahead
        lm.generate(prompt, 4, eos_token_id=[])  # warm: the bind groups over each step's buffers
        get_device().synchronize()
        before = counters.snapshot()
        lm.generate(prompt, new, eos_token_id=[])
        waits[ahead] = counters.waits - before["waits"]
        per_step_down = (counters.bytes_downloaded - before["bytes_downloaded"]) / new
        assert per_step_down <= 64 < lm.vocab_size * 4, per_step_down
    lm.run_ahead = RUN_AHEAD
    decode_steps = new - 1
    assert waits[SYNC] == 1 + decode_steps, waits
    assert waits[RUN_AHEAD] == 1 + -(-decode_steps // (RUN_AHEAD // 2)), waits
    assert waits[RUN_AHEAD] / new < 0.6


@pytest.mark.parametrize("ahead", [RUN_AHEAD, SYNC])
def test_a_status_error_of_a_decode_step_is_raised_at_the_read_of_its_tokens(bundles, ahead):
    """An id out of the vocabulary in a decode step's input (written over the step before's token on the device)
    sets the embedding's status word: the stream raises it, naming the op and the run, after the tokens before that
    step and none after, run ahead as synchronously."""
    _, lm, _ = bundles
    lm.run_ahead = ahead
    program, bad_step = lm._phases["decode"].program, 3
    run, runs = program.run, []

    def run_with_a_bad_id(inputs, device_inputs=None, **kwargs):
        runs.append(None)
        if len(runs) == bad_step:
            ids = device_inputs[lm._phases["decode"].inputs["input_ids"]]
            lm.device.write(ids.buffer, 0, np.full(1, lm.vocab_size, np.int32), "an id out of range")
        return run(inputs, device_inputs, **kwargs)

    program.run = run_with_a_bad_id
    got = []
    try:
        with pytest.raises(KernelStatusError, match=r"index out of range in embedding: indices must lie in "
                                                    r"\[0, 128\) \(set by run \d+ of"):
            got.extend(lm.stream(np.arange(3, 3 + PROMPT), NEW, eos_token_id=[]))
    finally:
        del program.run
        lm.run_ahead = RUN_AHEAD
        get_device().synchronize()
    assert len(got) == bad_step  # the prefill's token and the decode steps' before the bad one


def test_meganeura_sync_reads_each_step_before_the_next(bundles, monkeypatch):
    """Under ``MEGANEURA_SYNC=1`` (the device's ``in_flight.sync``) a bundle loads with ``run_ahead = 1``."""
    _, lm, _ = bundles
    assert lm.run_ahead == RUN_AHEAD
    monkeypatch.setattr(get_device().in_flight, "sync", True)
    synchronous = load(lm.path)
    assert synchronous.run_ahead == SYNC
    synchronous.release()
