"""Host work per decode token of HF ``generate`` through the backend, on the null device (``RecordingDevice``: it
records and moves bytes like a GPU, computes nothing): what a token costs the host must not grow with the model's
depth. A tiny Llama at two depths, with the default cache and the static cache; per token (the difference between
two generate lengths, so that the prefill cancels out): the bytes up and down, the waits, our tensor overrides
entered (interceptions) and the tensor wrappers made, counted, not timed (``bench.host``'s counts); and the argument
signatures built (``signatures.signature``), which a step that replays the entry the last step ran builds none of;
and the calls of this project's Python functions (``OUR_CALLS_PER_LAYER``)."""
import cProfile
import pstats
from pathlib import Path

import pytest
import torch

from bench.host import call_counts
from helpers.models import LLAMA

SHORT, LONG = 6, 14  # new tokens of the two generate calls
# Compiling a tiny Llama's decode graph at two depths, each cache, takes 1.5 min on lavapipe: the slow stage.
pytestmark = pytest.mark.slow
DEPTHS = (2, 4)  # decoder layers
MOVED = ("bytes_uploaded", "bytes_downloaded", "waits", "submits")
# Waits per token with the static cache, as with the default one: the logits' read-back. HF's masks read the cache's
# ``cumulative_length`` on the host before each step, which the step before updated on the device: it comes back
# along with that step's logits (``Program.read_along``), where it took a download and a second wait of its own
STATIC_CACHE_WAITS = 1
# Calls of this project's functions (the backend's, the runtime's; not the null device's) per decode token, per layer
# added: what a token's host work grows by with depth. Measured before and after the per-argument work went
# (``_note_returned`` over the static inputs' positions, one graph call for all the inputs aot_autograd updates
# rather than two per input, a static cache's update bound without ``bound_array``'s calls, the outputs' bytes
# computed once per shape, a lazy KV output not tracked once it comes back): default cache 67.5 -> 47.5, static
# cache 34.5 -> 22.5. What is left per layer: the KV cache's arrays themselves (a new output, a lazy tensor, a bind,
# a size check each; dynamo's size read of each, which enters our override), and the static cache's update of each.
# Measured again after the decode steps were recorded ahead (one submit a token, ``Program._record_ahead``) on top of
# the decode fusion of a layer's key and value cache writes: default cache 46, static cache 22. Measured again when a
# run's lazy KV outputs were made in one loop (``device_tensor.lazy_outputs``) and a steady static-cache step stopped
# setting each update's download watch again (``BoundPlan.read_along``): default cache 48 -> 42, static 12 -> 11.
# Measured again when the default cache's keys and values (inputs come back, a symbolic length each) were checked
# in loops run by C (``bound_plan.SizedSignatures``) rather than by a ``fits`` and an ``arg_kind`` each: 42 -> 36,
# static (at each length: its graph symbolic too) 11 -> 9.
OUR_CALLS_PER_LAYER = {"dynamic": 36, "static": 9}
ROOT = Path(__file__).resolve().parents[2]  # the repository: our code's files are under it


def _per_token(depth: int, cache: str, device) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()  # (each model's frames would count towards dynamo's recompile limit)
    torch.manual_seed(0)
    config = LlamaConfig(**{**LLAMA, "use_cache": True, "num_hidden_layers": depth})
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 5))
    model.forward = torch.compile(model.forward, backend="meganeura")
    extra = {"cache_implementation": "static", "disable_compile": True} if cache == "static" else {}

    def generate(n):
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, **extra)

    counts = {}
    # the third call of each length: warm (with the static cache, whose length is the prompt's and the new tokens',
    # the second length makes dynamo trace the forward again, over a symbolic length, and the first length's second
    # call then compiles a plan of that graph)
    for n in (SHORT, LONG) * 3:
        before = device.counters.snapshot()
        profile = cProfile.Profile()
        profile.enable()
        generate(n)
        profile.disable()
        after = device.counters.snapshot()
        counts[n] = {**call_counts(profile), "signatures": _signatures(profile), "our_calls": _our_calls(profile),
                     **{key: after[key] - before[key] for key in MOVED}}
    return {key: (counts[LONG][key] - counts[SHORT][key]) / (LONG - SHORT) for key in counts[LONG]}


def _signatures(profile: cProfile.Profile) -> int:
    """Calls of ``signatures.signature``: the signature of every argument of a partition, built to select its entry."""
    return sum(s[1] for (path, _, name), s in pstats.Stats(profile).stats.items()
               if name == "signature" and path.endswith("signatures.py"))


def _our_calls(profile: cProfile.Profile) -> int:
    """Calls of functions of this repository's code, not its tests' (the null device) nor installed packages'."""
    ours = {f"{ROOT}/{folder}/" for folder in ("torch_meganeura", "runtime", "lowering", "kernels")}
    return sum(s[1] for (path, _, _), s in pstats.Stats(profile).stats.items()
               if any(path.startswith(folder) for folder in ours))


_MEASURED: dict[str, tuple[dict, dict]] = {}  # cache -> the per-token counts at each depth (measured once)


def _at_depths(cache: str, device) -> tuple[dict, dict]:
    if cache not in _MEASURED:
        _MEASURED[cache] = tuple(_per_token(depth, cache, device) for depth in DEPTHS)
    return _MEASURED[cache]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_decode_tokens_transfers_do_not_grow_with_depth(null_device, cache):
    """Bytes down (the logits), the waits, no tensor wrapper: the same at both depths."""
    shallow, deep = _at_depths(cache, null_device)
    keys = ("bytes_downloaded", "waits", "wrappers")
    assert {k: shallow[k] for k in keys} == {k: deep[k] for k in keys}, (shallow, deep)
    assert deep["waits"] == (1 if cache == "dynamic" else STATIC_CACHE_WAITS), deep
    assert deep["bytes_downloaded"] <= 4 * LLAMA["vocab_size"] + 64, deep  # the logits and the status words
    assert deep["wrappers"] == 0, deep


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_decode_token_submits_the_step_recorded_ahead(null_device, cache):
    """A steady decode step is one submit: the one before recorded its dispatches ahead (``Program._record_ahead``)
    over the buffers it binds, those of the step before (a static cache, updated in place) or of two steps before
    (the default cache's new arrays, which alternate between two buffers per layer), so that the step's commands go
    to the GPU with its copies as soon as it is called. (Recorded at each step, in parts, it took 4 submits.)"""
    shallow, deep = _at_depths(cache, null_device)
    assert shallow["submits"] == deep["submits"] == 1, (shallow, deep)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_decode_step_replays_its_entry_without_building_signatures(null_device, cache):
    """A steady decode step's partition calls take the entry the last step ran (``BoundPlan.replays``): no argument
    signature is built. (The static cache's updated inputs, ``DeviceTensor``s since their first update, once failed
    the check of the arguments with symbolic sizes, and every step built the signature of every argument.)"""
    shallow, deep = _at_depths(cache, null_device)
    # (a static cache is new at each generate call: its first steps may build one more or one fewer at one length)
    assert all(abs(counts["signatures"]) * (LONG - SHORT) <= 1 for counts in (shallow, deep)), (shallow, deep)


@pytest.mark.xfail(strict=True, reason="dynamo gives each layer's cache a symbolic length of its own: it reads a size "
                                       "of each cache tensor (a DeviceTensor), which enters device_tensor's override, "
                                       "and the plan's sizes input holds each symbol's value (4 bytes up each)")
def test_a_decode_tokens_interceptions_and_uploads_do_not_grow_with_depth(null_device):
    shallow, deep = _at_depths("dynamic", null_device)
    keys = ("interceptions", "bytes_uploaded")
    assert {k: shallow[k] for k in keys} == {k: deep[k] for k in keys}, (shallow, deep)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_decode_tokens_calls_of_our_code_grow_little_with_depth(null_device, cache):
    """Our functions called per decode token, per layer added (``OUR_CALLS_PER_LAYER``): at most what is left after
    the per-argument work went, so that it cannot silently grow back."""
    shallow, deep = _at_depths(cache, null_device)
    per_layer = (deep["our_calls"] - shallow["our_calls"]) / (DEPTHS[1] - DEPTHS[0])
    assert 0 < per_layer <= OUR_CALLS_PER_LAYER[cache], (shallow, deep)
