"""HF ``generate`` through the backend with its default (dynamic) cache: a Llama layer's decode step takes a counted
number of dispatches, the difference between the decode plans of a 3-layer and a 2-layer model (what is not a
layer's, the embedding and the head, cancels out), and the tokens are eager's. Each layer appends its new key and
value to the cache in one kernel (lowering/sibling_updates.py: pointwise nodes of one shape whose outputs are all
graph outputs)."""
from __future__ import annotations

import torch

from helpers.models import LLAMA
from torch_meganeura.backend.entry import BackendContext

# The query, key and value projection (+ RMS norm), the key and value appended to the cache (+ the key's rotary
# embedding), attention (+ the query's), the output projection (+ residual), gate and up (+ RMS norm, SiLU, product)
# and down (+ residual): the generation bundle's count (tests/torch/test_export_lm.py). Before: 7, the key's and the
# value's cache each concatenated by a kernel of its own.
DEFAULT_CACHE_DISPATCHES_PER_LAYER = 6
DEPTHS = (2, 3)
PROMPT, NEW_TOKENS = 7, 8


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**LLAMA, "num_hidden_layers": layers, "use_cache": True, "max_position_embeddings": 128})
    return LlamaForCausalLM(config).eval()


def _decode_dispatches(layers: int) -> int:
    """The dispatches of the decode plan (the one over symbolic sizes) of a greedy generate through the backend, whose
    tokens must be eager's."""
    torch._dynamo.reset()
    model = _llama(layers)
    prompt = torch.randint(0, LLAMA["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        want = model.generate(prompt, **kwargs)
        records: list = []
        BackendContext.recorders.append(records)
        try:
            model.forward = torch.compile(model.forward, backend="meganeura")
            got = model.generate(prompt, **kwargs)
        finally:
            BackendContext.recorders.remove(records)
    assert got.tolist() == want.tolist()
    decode = [r.dispatches for r in records if not isinstance(r, dict) and r.dynamic]
    assert decode, "no plan over symbolic sizes: the decode graph was not compiled as one"
    return decode[-1]


def test_a_llama_layer_decodes_with_the_default_cache_in_a_counted_number_of_dispatches():
    shallow, deep = (_decode_dispatches(n) for n in DEPTHS)
    assert (deep - shallow) / (DEPTHS[1] - DEPTHS[0]) == DEFAULT_CACHE_DISPATCHES_PER_LAYER, (shallow, deep)
