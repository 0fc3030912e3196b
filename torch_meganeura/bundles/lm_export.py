"""``export_lm(model, path, max_cache_len=N)`` (``torch_meganeura.export_lm``): an HF causal language model as a
generation bundle.

``meganeura.runtime.load(path).generate(prompt_ids, max_new_tokens)`` then generates text with no torch. The bundle
(``meganeura.runtime.lm_bundle``) holds two plans over one static KV cache and one copy of the weights, in the
model's dtype: *prefill*, ``prefill_tokens`` prompt tokens at a time, and *decode*, one token. Each step runs one plan
and reads back one token id: the next token is chosen on the device, greedily or by sampling with a temperature
(the Gumbel-max trick over the device's random numbers); the last row's scores stay on the device for a sampler
that needs them (top-k, top-p).

The model runs through ``GenerationStep``: its cache is the one Hugging Face's ``StaticCache`` makes, whose layers
store new keys and values out of place (``index_copy``) at ``cache_position``, so that the traced graph takes the
cache as inputs and returns the new one; the plans store it over the old one (``in_place``). Traced with
``torch.export`` and compiled through the same pipeline as ``export`` (``export.compile_program``).

Batches (``batch_size=B`` > 1): both phases are traced with B rows, left-padded so that every row's prompt ends at
the same cache slot: the rows share ``cache_position`` (HF's static cache writes one slot range for all rows), and
``prompt_start`` [B] gives each row's first slot. From it the step makes the model's own ``attention_mask`` over the
whole cache (0 on the padding) and ``position_ids`` counting from each row's first token, and HF's masking
(``create_causal_mask``) adds causality: each row sees its own tokens at its own positions, and its tokens are the
ones it gets alone. Per-row positions (a cache length per row) would need a cache update and a mask of our own: HF's
take one ``cache_position`` for all rows. Batch 1 takes no ``prompt_start`` and passes neither (its plans as before).
"""
from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from meganeura.runtime.device import get_device, prepare_device
from meganeura.runtime.lm_bundle import INPUTS, OUTPUTS, cache_name, write_lm_bundle
from meganeura.runtime.requirements import compile_limits

from .export import ExportError, compile_program, trace
from ..tensors.params import host_form
from ..lower.registry import logical_dtype

PREFILL_TOKENS = 32  # prompt tokens per prefill run: a prompt of n tokens takes ceil(n / 32) runs
# Uniform noise is kept inside (0, 1) so that its Gumbel transform -log(-log(u)) stays finite: 0 * noise (greedy)
# must be 0
NOISE_MARGIN = 1e-7


class _OutOfPlaceLayer(StaticLayer):
    """A static cache layer whose update returns new tensors (``index_copy``) instead of writing its own: traced,
    the cache is an input and the new cache an output. ``positions`` is set by ``GenerationStep``."""

    positions: torch.Tensor

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys = self.keys.index_copy(2, self.positions, key_states)
        self.values = self.values.index_copy(2, self.positions, value_states)
        return self.keys, self.values


class GenerationStep(torch.nn.Module):
    """``model`` over a static cache of ``max_cache_len`` positions, as the generation bundle's phases run it
    (``meganeura.runtime.lm_bundle``: inputs, outputs), for the cache's rows (``prompt_start`` where several)."""

    def __init__(self, model, max_cache_len: int):
        super().__init__()
        self.model, self.max_cache_len = model, max_cache_len

    def forward(self, input_ids, cache_position, last, temperature, sampling, cache: list, prompt_start=None):
        past = StaticCache(max_cache_len=self.max_cache_len, config=self.model.config)
        for i, layer in enumerate(past.layers):
            layer.__class__ = _OutOfPlaceLayer
            layer.keys, layer.values = cache[2 * i], cache[2 * i + 1]
            layer.dtype, layer.device = cache[2 * i].dtype, cache[2 * i].device
            layer.positions = cache_position
            layer.cumulative_length = cache_position[0]  # where the tokens start (the causal mask reads it)
            layer.is_initialized = True
        out = self.model(input_ids=input_ids, cache_position=cache_position, use_cache=True,
                         **_left_padding(prompt_start, cache_position, self.max_cache_len),
                         **{_cache_argument(self.model): past})
        scores = out.logits.index_select(1, last)[:, 0].float() / temperature
        noise = torch.rand_like(scores).clamp(NOISE_MARGIN, 1 - NOISE_MARGIN)
        token = (scores - sampling * torch.log(-torch.log(noise))).argmax(-1)
        new = [t for layer in past.layers for t in (layer.keys, layer.values)]
        return {"token": token, "scores": scores, **{cache_name(i): t for i, t in enumerate(new)}}


def _left_padding(prompt_start, cache_position, max_cache_len: int) -> dict:
    """The model's ``attention_mask`` and ``position_ids`` for rows whose prompts start at cache slot
    ``prompt_start`` [batch] (the slots before it are padding): the mask over the whole cache lets a row see its own
    slots only (the model's masking adds causality), and a row's positions count from its first token. None (batch
    1): neither (no padding)."""
    if prompt_start is None:
        return {}
    starts = prompt_start[:, None]
    mask = (torch.arange(max_cache_len)[None, :] >= starts).long()
    return {"attention_mask": mask, "position_ids": (cache_position[None, :] - starts).clamp(min=0)}


def cache_shapes(model, max_cache_len: int, batch_size: int = 1) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each cache tensor, as the model's own static cache makes them (one token a row, eagerly)."""
    past = StaticCache(max_cache_len=max_cache_len, config=model.config)
    with torch.no_grad():
        model(input_ids=torch.zeros(batch_size, 1, dtype=torch.long), cache_position=torch.zeros(1, dtype=torch.long),
              use_cache=True, **{_cache_argument(model): past})
    return [(tuple(t.shape), t.dtype) for layer in past.layers for t in (layer.keys, layer.values)]


def _cache_argument(model) -> str:
    """The name of the forward's cache argument: ``cache`` from transformers 5.2x on, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def export_lm(model, path, *, max_cache_len: int, batch_size: int = 1, prefill_tokens: int = PREFILL_TOKENS,
              tokenizer=None, adapter: str | int | None = None, portable: bool = True, overwrite: bool = False) -> dict:
    """Export ``model`` (an HF causal LM: GPT-2, Llama, Qwen2...) as a generation bundle at ``path`` holding
    ``max_cache_len`` positions (prompt and new tokens together) for each of ``batch_size`` sequences generated
    together; return its manifest. ``tokenizer``: an HF fast tokenizer, saved beside it (``meganeura generate
    --prompt``). Kernels for WebGPU's default limits unless ``portable=False``."""
    for name, value in (("max_cache_len", max_cache_len), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExportError(f"{name} must be a positive int, got {value!r}")
    if getattr(model, "config", None) is None or not hasattr(model, "generation_config"):
        raise ExportError(f"export_lm takes a Hugging Face causal language model, got {type(model).__name__}")
    prepare_device(adapter)
    model = getattr(model, "_orig_mod", model)
    step = GenerationStep(model.eval(), max_cache_len).requires_grad_(False)
    try:
        shapes = cache_shapes(model, max_cache_len, batch_size)
    except Exception as err:  # noqa: BLE001 - a model HF's static cache does not fit is reported with its cause
        raise ExportError(f"{type(model).__name__} does not run over Hugging Face's StaticCache: "
                          f"{type(err).__name__}: {err}") from err
    device = get_device(adapter)
    limits = compile_limits(device.limits, portable)
    chunk = min(prefill_tokens, max_cache_len)
    phases, weights, dtypes = {}, {}, {}
    for phase, length in (("prefill", chunk), ("decode", 1)):
        kwargs = _example(length, shapes, batch_size)
        n = len(INPUTS)
        in_place = {len(OUTPUTS) + i: n + i for i in range(len(shapes))}  # flattened output -> user input
        with torch.no_grad():
            compiled = compile_program(trace(step, (), kwargs), (), kwargs, device, limits, model, in_place)
        phases[phase] = (compiled.plan, compiled.description)
        for source in compiled.sources.values():
            weights[source] = host_form(compiled.state[source])
            dtypes[source] = logical_dtype(compiled.state[source].dtype)
    meta = {"producer": phases["decode"][1]["producer"], "max_cache_len": max_cache_len, "batch_size": batch_size,
            "prefill_tokens": chunk,
            "vocab_size": int(model.config.get_text_config().vocab_size), "eos_token_ids": _eos_ids(model),
            "cache": [{"shape": list(shape), "dtype": logical_dtype(dtype)} for shape, dtype in shapes]}
    return write_lm_bundle(path, phases, weights, dtypes, meta, _tokenizer_file(tokenizer), overwrite)


def _example(length: int, shapes: list, batch_size: int) -> dict:
    """Example inputs of a phase of ``length`` tokens a row; ``prompt_start`` only where several rows may be padded."""
    padding = {"prompt_start": torch.zeros(batch_size, dtype=torch.long)} if batch_size > 1 else {}
    return {"input_ids": torch.zeros(batch_size, length, dtype=torch.long), "cache_position": torch.arange(length),
            "last": torch.zeros(1, dtype=torch.long), "temperature": torch.ones(1), "sampling": torch.zeros(1),
            "cache": [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes], **padding}


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _tokenizer_file(tokenizer) -> bytes | None:
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ExportError("export_lm saves fast tokenizers (tokenizer.json, the tokenizers package); "
                          f"{type(tokenizer).__name__} is not one")
    return backend.to_str().encode()
