"""Batched generation bundles (``export_lm(..., batch_size=4)``): four prompts of different lengths generated together
each get the greedy tokens HF eager's ``generate`` gives that prompt alone, each stopping at its own end-of-sequence
id while the others go on; fewer prompts than the batch, a single prompt and the CLI's repeated ``--ids`` and
``--prompts-file`` too; a decode step moves a few numbers a row; too many prompts, an empty one and one too long
for the cache are refused by name."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_meganeura
from helpers.bad_bundles import GENERATION, edit_manifest
from helpers.models import LLAMA, tiny_gemma, tiny_qwen2
from meganeura.runtime import BundleError, InputError, load
from meganeura.runtime.cli import main as cli
from meganeura.runtime.lm_bundle import read_lm_bundle

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
BATCH = 4
CACHE = 64
NEW = 20
# Prompt lengths: one token, a few, one past the prefill chunk of 32 (two prefill runs, the rows left-padded by up
# to 36 slots), and one between
LENGTHS = (5, 37, 1, 12)
EOS_AFTER = (2, 10)  # the end-of-sequence id is one row's new token at one of these indices (so it stops early)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, "max_position_embeddings": 128})).eval()


def _gpt2():
    """GPT-2 with LLAMA's initializer range: at GPT-2's default (0.02), random weights repeat one token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      initializer_range=LLAMA["initializer_range"], bos_token_id=0,
                                      eos_token_id=None)).eval()


GEMMA_LAYER_STD = 0.2  # below it, Gemma's scaled (and tied) embedding outweighs the layers: one token repeats


def _gemma():
    """``tiny_gemma`` with its layers' matrices drawn at GEMMA_LAYER_STD (at Gemma's default 0.02, random weights
    repeat one token)."""
    model = tiny_gemma()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2 and "embed" not in name:
                weight.normal_(0.0, GEMMA_LAYER_STD)
    return model


MODELS = {"llama": _llama, "gpt2": _gpt2, "qwen2": tiny_qwen2, "gemma": _gemma}
# Exporting and generating takes 10-20 s a model on lavapipe: Llama runs by default, the others in the slow stage
SLOW = pytest.mark.slow


@pytest.fixture(scope="module", params=["llama", pytest.param("gpt2", marks=SLOW),
                                        pytest.param("qwen2", marks=SLOW), pytest.param("gemma", marks=SLOW)])
def exported(request, tmp_path_factory):
    torch.manual_seed(0)
    model = MODELS[request.param]()
    path = tmp_path_factory.mktemp(request.param) / "lm"
    manifest = torch_meganeura.export_lm(model, path, max_cache_len=CACHE, batch_size=BATCH, tokenizer=_words())
    assert manifest["batch_size"] == BATCH
    prompts = [torch.randint(0, 128, (n,)) for n in LENGTHS]
    return model, path, prompts, [_alone(model, p, NEW) for p in prompts]


def _words():
    """A word-level fast tokenizer of the vocabulary: ``w<id>`` is token id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words)


def _alone(model, prompt: torch.Tensor, new: int, eos: int | None = None) -> list[int]:
    """HF eager's greedy ``generate`` of one prompt by itself (stopping at ``eos``; the mask given, as HF would
    otherwise take a prompt's ids equal to its pad id for padding)."""
    with torch.no_grad():
        return model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)[0].tolist()


def _stopping_id(prompts, alone) -> int:
    """An id that one row's own greedy tokens first reach within EOS_AFTER and another row never makes."""
    own = [tokens[len(p):] for p, tokens in zip(prompts, alone)]
    for index in range(*EOS_AFTER):
        for row in own:
            candidate = row[index]
            if candidate not in row[:index] and any(candidate not in other for other in own):
                return candidate
    raise AssertionError(f"no row's new tokens {own} give an id that stops it early and not all the others")


def test_each_prompt_of_a_batch_gets_its_own_greedy_tokens(exported):
    """Four prompts together, each stopping at its own end-of-sequence id: each equals HF's generate of that prompt
    alone with the same id; one stops early and another makes all NEW tokens. The stream yields None for a row that
    has ended, and the counts are each row's own."""
    model, path, prompts, alone = exported
    eos = _stopping_id(prompts, alone)
    want = [_alone(model, p, NEW, eos) for p in prompts]
    lm = load(path)
    got = lm.generate([p.numpy() for p in prompts], NEW, eos_token_id=eos)
    assert [g.tolist() for g in got] == want
    lengths = [len(w) - len(p) for w, p in zip(want, prompts)]
    early = int(np.argmin(lengths))
    assert lengths[early] <= EOS_AFTER[1] and max(lengths) == NEW, lengths
    assert lm.stats.new_tokens == sum(lengths) and lm.stats.prompt_tokens == sum(LENGTHS)
    steps = list(lm.stream([p.numpy() for p in prompts], NEW, eos_token_id=eos))
    assert [sum(step[k] is not None for step in steps) for k in range(BATCH)] == lengths
    assert all(step[early] is None for step in steps[lengths[early]:])


def test_fewer_prompts_than_the_batch_and_a_single_prompt(exported):
    """Two prompts on a batch-4 bundle (the batch filled with rows whose outputs are dropped), and one prompt given
    as an array (an array back), give HF's tokens of each alone; so does the CLI with repeated --ids."""
    _, path, prompts, alone = exported
    lm = load(path)
    got = lm.generate([prompts[3].tolist(), prompts[1].tolist()], NEW)
    assert [g.tolist() for g in got] == [alone[3], alone[1]]
    single = lm.generate(prompts[0].numpy(), NEW)
    assert isinstance(single, np.ndarray) and single.tolist() == alone[0]


def test_cli_generates_repeated_ids_together(exported, capsys):
    """(8 new tokens: the first 8 of HF's greedy NEW, which it chooses one by one alike.)"""
    _, path, prompts, alone = exported
    args = [a for p in prompts[:3] for a in ("--ids", ",".join(map(str, p.tolist())))]
    assert cli(["generate", str(path), *args, "--max-new-tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for k, prompt in enumerate(prompts[:3]):
        ids = next(line for line in lines if line.startswith(f"ids[{k}]:")).split()[1]
        assert [int(i) for i in ids.split(",")] == alone[k][:len(prompt) + 8]
    assert any("(all 3 prompts together)" in line for line in lines), lines


def test_cli_generates_a_file_of_prompts_together(exported, tmp_path, capsys):
    """--prompts-file: one prompt a line as text (blank lines skipped), each printed as ids and text; a file of more
    prompts than the batch is refused."""
    _, path, prompts, alone = exported
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(" ".join(f"w{i}" for i in p.tolist()) for p in prompts[:2]) + "\n\n")
    assert cli(["generate", str(path), "--prompts-file", str(file), "--max-new-tokens", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for k, prompt in enumerate(prompts[:2]):
        text = next(line for line in lines if line.startswith(f"text[{k}]:")).split()[1:]
        assert text == [f"w{i}" for i in alone[k][:len(prompt) + 6]]
    file.write_text("w1\n" * (BATCH + 1))
    assert cli(["generate", str(path), "--prompts-file", str(file)]) == 1
    assert "5 prompts: this bundle generates for at most 4 together" in capsys.readouterr().err


def test_a_batched_decode_step_moves_a_few_numbers_per_row(exported):
    """A decode step of the batch uploads each row's token and start and reads back each row's token (and the status
    word), not the vocabulary's scores: the per-step transfers stay small as the batch grows."""
    from meganeura.runtime.device import get_device

    _, path, prompts, _ = exported
    lm, counters = load(path), get_device().counters
    batch = [p.numpy() for p in prompts]
    lm.generate(batch, 4, eos_token_id=[])  # warm: the bind groups over both sets of cache arrays
    up, down = counters.bytes_uploaded, counters.bytes_downloaded
    lm.generate(batch, 17, eos_token_id=[])
    steps = 2 + 16  # two prefill runs (the 37-token prompt) and 16 decode steps
    prefill_ids = 2 * BATCH * lm._phases["prefill"].length * 8
    per_step_down = (counters.bytes_downloaded - down) / steps
    per_step_up = (counters.bytes_uploaded - up - prefill_ids - 16 * BATCH * 8) / steps
    assert per_step_down <= 64 + 8 * BATCH < lm.vocab_size * 4, per_step_down
    assert per_step_up <= 64 + 8 * BATCH, per_step_up


def test_bad_batches_are_refused_by_name(exported, tmp_path):
    _, path, prompts, _ = exported
    lm = load(path)
    with pytest.raises(InputError, match="5 prompts: this bundle generates for at most 4 together"):
        lm.generate([p.numpy() for p in prompts] + [prompts[0].numpy()], 4)
    with pytest.raises(InputError, match="prompt 1: prompt_ids must be a non-empty 1-D array"):
        lm.generate([prompts[0].numpy(), []], 4)
    with pytest.raises(InputError, match="a prompt of 70 tokens and 1 new ones need 71 cache positions; this bundle "
                                         "holds 64"):
        lm.generate([prompts[0].numpy(), np.zeros(70, dtype=np.int64)], 1)
    with pytest.raises(InputError, match="a prompt of 37 tokens and 40 new ones need 77 cache positions"):
        lm.generate([p.numpy() for p in prompts], 40)
    broken = Path(shutil.copytree(path, tmp_path / "broken"))
    edit_manifest(broken, GENERATION, lambda m: m.update(batch_size=2))
    with pytest.raises(BundleError, match=r"phase prefill takes input_ids of shape \[4, 32\], expected \[2, 32\]"):
        read_lm_bundle(broken)


def test_a_batch_size_that_is_not_a_positive_int_is_refused(tmp_path):
    with pytest.raises(torch_meganeura.ExportError, match="batch_size must be a positive int, got 0"):
        torch_meganeura.export_lm(_llama(), tmp_path / "lm", max_cache_len=CACHE, batch_size=0)
