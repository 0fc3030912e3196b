"""Generation bundles (``torch_meganeura.export_lm``): HF Llama, Qwen2, Gemma and GPT-2 (small configs, random weights)
generate HF eager's greedy tokens in a process without torch; sampling repeats with its seed; too long a prompt and
bad bundles are refused by name; a Llama layer's decode step takes a counted number of dispatches."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_meganeura
from helpers.bad_bundles import GENERATION, SHARED, edit_manifest, expected
from helpers.models import LLAMA, tiny_gemma, tiny_qwen2
from helpers.torch_free import run_without_torch
from meganeura.kernels.attention import plans as attention_plans
from meganeura.runtime import BundleError, InputError, load
from meganeura.runtime.cli import main as cli
from meganeura.runtime.lm_bundle import read_lm_bundle

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
# A Llama layer's decode dispatches (portable limits: 8 storage bindings; lowering/row_prologues.py,
# paired_matmuls.py and attention_writes.py): the query, key and value projection (+ RMS norm), attention (+ the
# rotary embedding of the query and the key as a prologue, the key and value cache writes, the causal mask computed
# from the position; it reads the projection's three outputs through one binding, and the rotary embedding's cosine
# and sine through another: lowering/packed.py), the output projection (+ residual), gate and up (+ RMS norm, SiLU,
# product) and down (+ residual), with a cache long enough that attention is cut into slices of the keys
# (``SLICED_CACHE``), whose merge the output projection does as it loads its row (lowering/slice_merges.py). Before
# decode fusion: 11 (the two RMS norms and the up projection had dispatches of their own), then 9 (the rotary
# embedding of the query, each cache write and the merge of the slices apart), then 6 (the cache writes a kernel of
# their own: the merged kernel bound 12 buffers).
LLAMA_DECODE_DISPATCHES_PER_LAYER = 5
# With an adapter's own limits (``portable=False``; lavapipe's 32 bindings, as the backend compiles for): the cache
# writes run by the attention's dispatch too (lowering/attention_writes.py: 11 bindings with the scratch of slices,
# each value its own; 8 in a portable plan).
# Before decode fusion: 10, then 7 (the merge of the slices apart), then 6 (the cache writes a kernel of their own).
LLAMA_DECODE_DISPATCHES_PER_LAYER_WIDE = 5
# A GPT-2 layer's, portable: the query, key and value projection, attention (+ the cache writes), the output
# projection, the MLP's two products. Before: 6 (the cache writes a kernel of their own).
GPT2_DECODE_DISPATCHES_PER_LAYER = 5
WIDE_BINDINGS = 16  # an adapter with at least this many storage bindings per stage holds those kernels
CACHE = 96  # positions: an 8-token prompt and 64 new tokens, and a 40-token prompt (two prefill runs of 32)
# Positions enough that a decode step's attention is cut into slices of the keys (flash-decoding), merged by the output
# projection as it loads its row (lowering/slice_merges.py): 4 tiles of 32 keys over 4 heads' single query rows.
SLICED_CACHE = 128
NEW = 64

GENERATE = """
import json, sys
import numpy as np
from meganeura.runtime import load
bundle, cases = sys.argv[1], json.loads(sys.argv[2])
lm = load(bundle)
out = {}
for name, (prompt, new, kwargs) in cases.items():
    out[name] = lm.generate(np.asarray(prompt), new, **kwargs).tolist()
print(json.dumps(out))
"""


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, "max_position_embeddings": 128})).eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      bos_token_id=0, eos_token_id=None)).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma", "gpt2"])
def exported(request, tmp_path_factory):
    torch.manual_seed(0)
    model = {"llama": _llama, "qwen2": tiny_qwen2, "gemma": tiny_gemma, "gpt2": _gpt2}[request.param]()
    path = tmp_path_factory.mktemp(request.param) / "lm"
    torch_meganeura.export_lm(model, path, max_cache_len=CACHE)
    return model, path


def test_greedy_tokens_equal_hf_eager_without_torch(exported):
    """64 new tokens after an 8-token prompt, and 20 after a 40-token one (prefill in two runs, the last one
    overlapping the first), equal HF's own greedy ``generate``; seeded sampling repeats, another seed differs."""
    model, path = exported
    short, long = torch.randint(0, 128, (1, 8)), torch.randint(0, 128, (1, 40))
    cases = {"short": (short[0].tolist(), NEW, {}), "long": (long[0].tolist(), 20, {}),
             **{f"sample{k}": (short[0].tolist(), 24, {"temperature": 0.9, "seed": seed})
                for k, seed in enumerate([5, 5, 6])},
             **{f"top{k}": (short[0].tolist(), 24, {"temperature": 0.9, "top_k": 8, "top_p": 0.9, "seed": 7})
                for k in range(2)}}
    got = json.loads(run_without_torch(GENERATE, str(path), json.dumps(cases)).stdout)
    for name, prompt in (("short", short), ("long", long)):
        want = model.generate(prompt, max_new_tokens=cases[name][1], do_sample=False)[0].tolist()
        assert got[name] == want, f"{name}: {got[name]} against HF's {want}"
    assert got["sample0"] == got["sample1"] != got["sample2"]
    assert got["top0"] == got["top1"] and len(got["top0"]) == 8 + 24


def test_a_bundle_for_the_adapters_own_limits_gives_eager_tokens(tmp_path):
    """Compiled for the adapter's limits (``portable=False``: wider kernels, the two cache writes of a layer in one),
    a Llama bundle's 64 greedy tokens equal HF's."""
    torch.manual_seed(0)
    model = _llama()
    torch_meganeura.export_lm(model, tmp_path / "lm", max_cache_len=CACHE, portable=False)
    prompt = torch.randint(0, 128, (1, 8))
    got = load(tmp_path / "lm").generate(prompt[0].numpy(), NEW).tolist()
    assert got == model.generate(prompt, max_new_tokens=NEW, do_sample=False)[0].tolist()


@pytest.mark.parametrize("portable", [True, False], ids=["portable", "adapter_limits"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma", "gpt2"])
def test_attention_slices_merged_by_the_output_projection_give_eager_tokens(tmp_path, name, portable):
    """With a cache long enough that each decode attention is cut into slices, each layer's output projection merges
    them as it loads its row (no merge dispatch), and 24 greedy tokens after a 72-token prompt (the slices past it
    empty) equal HF's."""
    torch.manual_seed(0)
    model = {"llama": _llama, "qwen2": tiny_qwen2, "gemma": tiny_gemma, "gpt2": _gpt2}[name]()
    torch_meganeura.export_lm(model, tmp_path / "lm", max_cache_len=SLICED_CACHE, portable=portable)
    plan = read_lm_bundle(tmp_path / "lm").phases["decode"].plan
    labels = [d.label for d in plan.dispatches]
    assert labels.count("attention") == plan.stats["merged_by_readers"] == 2, labels
    assert not any("merge of slices" in label for label in labels), labels
    for dispatch in (d for d in plan.dispatches if d.label == "attention"):  # (no binding of an output it never writes)
        source = plan.kernels[dispatch.kernel]
        declared = re.findall(r"var<storage, [a-z_]+> (\w+):", source)
        assert len(declared) == len(dispatch.bindings) and all(source.count(name) > 1 for name in declared), declared
    prompt = torch.randint(0, 128, (1, 72))
    lm = load(tmp_path / "lm")
    got = lm.generate(prompt[0].numpy(), 24).tolist()
    lm.release()
    assert got == model.generate(prompt, max_new_tokens=24, do_sample=False)[0].tolist()


def test_a_decode_attention_walking_several_tiles_gives_eager_tokens(tmp_path, monkeypatch):
    """The per-row decode forward (head size 64: the flash forward's tiles do not fit a portable bundle's 16 KiB),
    held to one slice, walks the cache a tile of keys at a time, the row the step writes (read from the update, not
    the cache) in its second or third tile: 40 greedy tokens after a 100-token prompt equal HF's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(attention_plans, "ROW_SPLIT_MAX", 1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, "head_dim": 64, "max_position_embeddings": 192})).eval()
    torch_meganeura.export_lm(model, tmp_path / "lm", max_cache_len=192)
    plan = read_lm_bundle(tmp_path / "lm").phases["decode"].plan
    attention = plan.kernels[next(d.kernel for d in plan.dispatches if d.label == "attention")]
    assert "const SPLITS: u32 = 1u;" in attention and "fresh_keys" in attention
    prompt = torch.randint(0, 128, (1, 100))
    lm = load(tmp_path / "lm")
    got = lm.generate(prompt[0].numpy(), 40).tolist()
    lm.release()
    assert got == model.generate(prompt, max_new_tokens=40, do_sample=False)[0].tolist()


def test_bad_requests_are_refused(exported):
    _, path = exported
    lm = load(path)
    with pytest.raises(InputError, match="cache positions; this bundle holds 96"):
        lm.generate(np.zeros(90, dtype=np.int64), 10)
    with pytest.raises(InputError, match="1-D array of token ids"):
        lm.generate(np.zeros((2, 3), dtype=np.int64), 4)
    with pytest.raises(InputError, match="top_p"):
        lm.generate(np.zeros(3, dtype=np.int64), 4, temperature=1.0, top_p=1.5)


LM_BAD = {  # a generation bundle's own damage; what both kinds refuse alike: helpers.bad_bundles
    "decode plan edited": (lambda p: (p / "decode" / "plan.json").write_text("{}"),
                           "plan.json does not match its SHA-256"),
    "missing phase": (lambda p: shutil.rmtree(p / "prefill"), "missing phase prefill/"),
    "prefill longer than the cache": (
        lambda p: edit_manifest(p, GENERATION, lambda m: m.update(prefill_tokens=m["max_cache_len"] + 1)),
        "prefill_tokens 97 must lie in 1..max_cache_len"),
}


def test_bad_bundles_are_refused_by_name(exported, tmp_path):
    """Every case of ``helpers.bad_bundles.SHARED`` with the message a deploy bundle gives, then ``LM_BAD``."""
    _, path = exported
    cases = [(lambda p, damage=damage: damage(p, GENERATION), expected(case, GENERATION))
             for case, (damage, _) in SHARED.items()] + list(LM_BAD.values())
    for k, (damage, message) in enumerate(cases):
        broken = Path(shutil.copytree(path, tmp_path / f"broken{k}"))
        damage(broken)
        with pytest.raises(BundleError, match="bundle .*: ") as err:
            read_lm_bundle(broken)
        assert message in str(err.value), (message, str(err.value))
    broken = Path(shutil.copytree(path, tmp_path / "through-load"))
    (broken / "lm.json").write_text("{")
    with pytest.raises(BundleError, match="lm.json is not valid JSON"):
        load(broken)


def test_a_bundle_of_format_version_1_still_generates(exported, tmp_path):
    """A generation bundle written before batched bundles (lm.json version 1: no ``batch_size``) is read as a
    one-row bundle and gives the tokens it gave."""
    _, path = exported
    old = Path(shutil.copytree(path, tmp_path / "v1"))
    manifest = json.loads((old / "lm.json").read_text())
    del manifest["batch_size"]
    (old / "lm.json").write_text(json.dumps({**manifest, "format_version": 1}))
    prompt = np.arange(3, 11)
    assert load(old).generate(prompt, 8).tolist() == load(path).generate(prompt, 8).tolist()


def test_cli_generate_prints_ids_and_rates(exported, capsys):
    model, path = exported
    prompt = torch.randint(0, 128, (1, 6))
    assert cli(["generate", str(path), "--ids", ",".join(map(str, prompt[0].tolist())), "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    ids = next(line for line in out.splitlines() if line.startswith("ids:")).split()[1]
    assert [int(i) for i in ids.split(",")] == model.generate(prompt, max_new_tokens=8, do_sample=False)[0].tolist()
    assert "tokens/s" in out


def test_a_decode_step_moves_a_few_numbers_and_reads_back_a_token(exported):
    """Greedy and temperature sampling choose on the device: a step reads back the token (and the status word), not
    the vocabulary's scores, and uploads the token, its position and the sampler's numbers."""
    from meganeura.runtime.device import get_device

    _, path = exported
    lm, counters = load(path), get_device().counters
    for kwargs in ({}, {"temperature": 0.7, "seed": 1}):
        lm.generate(np.arange(5), 4, **kwargs)  # warm: the bind groups over both sets of cache arrays
        up, down = counters.bytes_uploaded, counters.bytes_downloaded
        lm.generate(np.arange(5), 33, **kwargs)
        steps = 1 + 32  # the prefill run and 32 decode steps
        per_step_down = (counters.bytes_downloaded - down) / steps
        per_step_up = (counters.bytes_uploaded - up - 32 * 8) / steps  # (the prefill's 32 ids)
        assert per_step_down <= 64 < lm.vocab_size * 4, per_step_down
        assert per_step_up <= 64, per_step_up


def test_a_bfloat16_checkpoint_with_its_tokenizer(tmp_path, capsys):
    """A model as transformers 5 loads it (bfloat16) keeps its dtype (weights and cache in 16 bits); with its
    tokenizer saved beside it, ``meganeura generate --prompt`` takes and prints text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = _llama().to(torch.bfloat16)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    manifest = torch_meganeura.export_lm(model, tmp_path / "lm", max_cache_len=32,
                                         tokenizer=PreTrainedTokenizerFast(tokenizer_object=words))
    assert {e["dtype"] for e in manifest["weights"]} == {"bfloat16"}
    assert {e["dtype"] for e in manifest["cache"]} == {"bfloat16"}
    prompt = torch.tensor([[5, 7, 9]])
    first = model.generate(prompt, max_new_tokens=1, do_sample=False)[0, -1].item()  # one argmax: no drift
    assert cli(["generate", str(tmp_path / "lm"), "--prompt", "w5 w7 w9", "--max-new-tokens", "4"]) == 0
    text = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("text:")).split()[1:]
    assert text[:4] == ["w5", "w7", "w9", f"w{first}"] and len(text) == 7


def test_a_bfloat16_bundles_decode_attention_reads_its_caches_by_rows(tmp_path):
    """A bf16 cache holds the new key and value rounded to bf16. The attention that writes the caches reads each of
    them plainly away from the written row (a rounding of a bf16 read is exact and left out: lowering/schedule.py
    ``_linearise``), so it branches once per key row between the cache and the new row (``load_k_if``,
    ``load_v_if``) and reads the cached keys in groups (``load_k_24``). With the rounding of the choice kept whole,
    every element read both sides and computed the new row's rotary embedding."""
    torch.manual_seed(0)
    torch_meganeura.export_lm(_llama().to(torch.bfloat16), tmp_path / "lm", max_cache_len=SLICED_CACHE)
    plan = read_lm_bundle(tmp_path / "lm").phases["decode"].plan
    kernels = {plan.kernels[d.kernel] for d in plan.dispatches if d.label == "attention"}
    assert len(kernels) == 1
    (attention,) = kernels
    assert all(f"fn {name}(" in attention for name in ("load_k_if", "load_v_if", "load_k_24", "load_v_2")), attention


def test_an_adapter_without_what_a_phase_needs_is_refused_before_anything_is_built(exported, tmp_path):
    import shutil

    from meganeura.runtime import FeatureError
    from meganeura.runtime.device import get_device

    _, path = exported
    broken = tmp_path / "lm"
    shutil.copytree(path, broken)
    manifest = json.loads((broken / "decode" / "manifest.json").read_text())
    manifest["requires"]["features"].append("a-feature-no-adapter-has")
    (broken / "decode" / "manifest.json").write_text(json.dumps(manifest))
    counters = get_device().counters
    before = counters.buffers_created
    with pytest.raises(FeatureError, match="a-feature-no-adapter-has"):
        load(broken)
    assert counters.buffers_created == before


def test_the_cache_is_held_once(exported):
    """Both phases store every cache update over the cache's own array (lowering/in_place.py; the position checks
    run first, in kernels of their own), so the cache is held once, not in two arrays that alternate."""
    _, path = exported
    lm = load(path)
    for phase in lm._phases.values():
        plan = phase.program.plan
        assert len(plan.in_place) == len(lm._cache_names) and not plan.stats["in_place_refused"], plan.stats
    cache = {name: array for name, array in lm._cache.items()}
    lm.generate(np.arange(5), 8)
    assert all(lm._cache[name] is array for name, array in cache.items())  # the same arrays, updated in place
    lm.release()


def test_a_bundle_loaded_over_buffers_another_model_left_generates_eager_tokens(exported):
    """In a long-lived process the device's pool hands a new bundle's cache the buffers that earlier models released,
    holding their values (here NaN, as another dtype's words may read): the cache starts as zeros all the same, as
    HF's StaticCache does, and the greedy tokens equal HF's (before the fix: NaN scores past the prompt)."""
    from meganeura.runtime.device import get_device
    from meganeura.runtime.lm_bundle import read_lm_bundle
    from meganeura.runtime.resident import DeviceArray, buffer_bytes

    model, path = exported
    device = get_device()
    for entry in read_lm_bundle(path).cache:
        words = buffer_bytes(tuple(entry["shape"]), entry["dtype"]) // 4
        DeviceArray.upload(device, np.full(words, np.nan, np.float32), "float32").release()
    prompt = torch.randint(0, 128, (1, 8))
    lm = load(path)
    got = lm.generate(prompt[0].numpy(), 16).tolist()
    lm.release()
    assert got == model.generate(prompt, max_new_tokens=16, do_sample=False)[0].tolist()


@pytest.mark.parametrize("portable", [True, False], ids=["portable", "adapter_limits"])
def test_a_llama_layer_decodes_in_a_counted_number_of_dispatches(tmp_path, portable):
    """From one layer's attention to the next layer's, the decode plan has LLAMA_DECODE_DISPATCHES_PER_LAYER
    dispatches (_WIDE with the adapter's own limits: a per-layer count that cannot silently grow; the steps before
    the first layer and after the last, the position checks and the sampler, are not a layer's), none of them a
    norm's reduction; the layers' attentions one kernel; within the limit's storage bindings, each dispatch's arena
    ranges the same or apart (a range of outputs side by side, lowering/packed.py, overlaps no other binding)."""
    from meganeura.runtime.device import get_device

    if not portable and get_device().limits["max-storage-buffers-per-shader-stage"] < WIDE_BINDINGS:
        pytest.skip(f"the adapter has fewer than {WIDE_BINDINGS} storage bindings per stage")
    torch.manual_seed(0)
    torch_meganeura.export_lm(_llama(), tmp_path / "lm", max_cache_len=SLICED_CACHE, portable=portable)
    plan = read_lm_bundle(tmp_path / "lm").phases["decode"].plan
    labels = [d.label for d in plan.dispatches]
    first, second = [i for i, label in enumerate(labels) if label == "attention"]
    want = LLAMA_DECODE_DISPATCHES_PER_LAYER if portable else LLAMA_DECODE_DISPATCHES_PER_LAYER_WIDE
    assert second - first == want, labels
    assert "mean" not in labels[first:second], labels
    assert plan.dispatches[first].kernel == plan.dispatches[second].kernel  # (the layers' kernels shared)
    assert not portable or max(len(d.bindings) for d in plan.dispatches) <= 8
    for d in plan.dispatches:
        ranges = sorted({(b.offset, b.offset + b.size) for b in d.bindings if b.buffer == "arena"})
        assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:])), d


def test_a_gpt2_layer_writes_its_cache_in_the_attention_within_the_portable_limits(tmp_path):
    """GPT-2's query, key and value are one tensor: the attention storing a layer's cache writes binds 7 buffers and
    its scratch, within WebGPU's default 8, so a portable bundle's layer takes GPT2_DECODE_DISPATCHES_PER_LAYER
    dispatches (lowering/attention_writes.py; its tokens equal HF's:
    test_attention_slices_merged_by_the_output_projection_give_eager_tokens)."""
    torch.manual_seed(0)
    torch_meganeura.export_lm(_gpt2(), tmp_path / "lm", max_cache_len=SLICED_CACHE)
    plan = read_lm_bundle(tmp_path / "lm").phases["decode"].plan
    labels = [d.label for d in plan.dispatches]
    first, second = [i for i, label in enumerate(labels) if label == "attention"]
    assert second - first == GPT2_DECODE_DISPATCHES_PER_LAYER and plan.stats["attention_writes"] == 2, labels
    assert "index_put" not in labels, labels
