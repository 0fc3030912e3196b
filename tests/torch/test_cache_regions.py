"""Cache updates run over the elements they change (lowering/regions.py): an ``index_copy_``/``index_put_`` of a
random cache at random positions, stored over the cache, equals eager's, with a dispatch the size of the new values,
not of the cache (f32 and half caches, one entry and several, repeated positions); where a half cache's elements would
not come by whole 32-bit words, the update keeps its kernel over the whole cache and still equals eager's. Assignments
to a slice or a position of a cache likewise. A generation bundle's cache-write dispatch does not grow with
``max_cache_len``."""
from __future__ import annotations

import math
import re

import pytest
import torch

import torch_meganeura
from helpers.compiled_plans import record_compiled_plans
from helpers.models import LLAMA
from meganeura.kernels.pointwise import WORKGROUP
from meganeura.runtime.lm_bundle import read_lm_bundle

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
CACHE = (2, 3, 96)  # batch, heads, positions; the head size is each case's
HALVES = (torch.bfloat16, torch.float16)


def _update(cache, positions, new):
    cache.index_copy_(2, positions, new)
    return cache.sum()


def _update_by_index(cache, positions, new):
    cache[:, :, positions] = new
    return cache.sum()


def _last_wins(cache, positions, new):
    """``cache`` with each entry copied in turn (a repeated position keeps its last entry's values)."""
    out = cache.clone()
    for k, p in enumerate(positions.tolist()):
        out[:, :, p] = new[:, :, k]
    return out


def _cache_writes(plan):
    return [d for d in plan.dispatches if d.label == "index_put"]


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES], ids=["f32", "bf16", "f16"])
# One entry (a decode step), a few (a prefill run: each compared with the later ones), repeated positions, and more
# entries than are compared so (``UNROLLED_ENTRIES``: a look-up over the positions tells the last entry landing on each)
@pytest.mark.parametrize("entries, repeated", [(1, False), (5, False), (6, True), (72, True)],
                         ids=["one", "five", "repeated", "many"])
def test_a_cache_updated_at_random_positions_equals_eager_over_the_new_values_only(monkeypatch, dtype, entries,
                                                                                   repeated):
    """The new values stored at random positions of a random cache, through the backend (the cache an input the
    graph updates: stored over it), equal eager's update exactly; the write is one dispatch over the new values (a
    thread per element, or per pair of a half cache's), not over the cache."""
    plans = record_compiled_plans(monkeypatch)
    generator = torch.Generator().manual_seed(entries + 10 * repeated)
    head = 8
    cache = torch.randn(*CACHE, head, generator=generator).to(dtype)
    if repeated:  # two entries land on each of half as many positions: the later one's values stay
        positions = torch.randperm(CACHE[2], generator=generator)[:entries // 2].repeat(2)
    else:
        positions = torch.randperm(CACHE[2], generator=generator)[:entries]
    new = torch.randn(*CACHE[:2], entries, head, generator=generator).to(dtype)
    want = _last_wins(cache, positions, new)
    update = _update_by_index if repeated else _update
    eager = cache.clone()
    update(eager, positions, new)
    assert torch.equal(eager, want)  # (eager's update is the entries copied in turn)
    torch.compile(update, backend="meganeura", dynamic=False)(cache, positions, new)
    assert torch.equal(cache, want)
    (plan,) = plans
    assert plan.in_place and not plan.stats["whole_updates"], plan.stats
    lanes = 2 if dtype in HALVES else 1
    (write,) = _cache_writes(plan)
    assert math.prod(write.workgroups) == math.ceil(new.numel() / lanes / WORKGROUP) < math.ceil(
        cache.numel() / lanes / WORKGROUP)


def _assign_slice(cache, new):
    cache[:, :, 5:13:2] = new
    return cache.sum()


def _assign_position(cache, new):
    cache[:, :, 7] = new
    return cache.sum()


def _assign_odd_columns(cache, new):
    cache[..., 1:5] = new
    return cache.sum()


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("assign, positions", [(_assign_slice, 4), (_assign_position, None)], ids=["slice", "select"])
def test_an_assignment_to_a_slice_of_a_cache_runs_over_the_slice(monkeypatch, dtype, assign, positions):
    """``cache[:, :, a:b:s] = new`` and ``cache[:, :, i] = new`` (traced: a slice and a select scatter), stored over
    the cache, equal eager's and run over the new values only."""
    plans = record_compiled_plans(monkeypatch)
    generator = torch.Generator().manual_seed(5)
    cache = torch.randn(*CACHE, 8, generator=generator).to(dtype)
    new = torch.randn(*CACHE[:2], *([positions] if positions else []), 8, generator=generator).to(dtype)
    want = cache.clone()
    assign(want, new)
    torch.compile(assign, backend="meganeura", dynamic=False)(cache, new)
    assert torch.equal(cache, want)
    (plan,) = plans
    assert plan.in_place and not plan.stats["whole_updates"], plan.stats
    lanes = 2 if dtype in HALVES else 1
    (write,) = [d for d in plan.dispatches if d.label.endswith("_scatter")]
    assert math.prod(write.workgroups) == math.ceil(new.numel() / lanes / WORKGROUP)


def _odd_head(cache, generator):
    positions = torch.tensor([4, 31])
    return _update, (positions, torch.randn(*CACHE[:2], 2, 7, generator=generator).to(cache.dtype))


def _odd_columns(cache, generator):
    return _assign_odd_columns, (torch.randn(*CACHE, 4, generator=generator).to(cache.dtype),)


@pytest.mark.parametrize("dtype", HALVES, ids=["bf16", "f16"])
@pytest.mark.parametrize("case, head", [(_odd_head, 7), (_odd_columns, 8)], ids=["odd_head", "odd_columns"])
def test_a_half_update_that_would_split_words_keeps_the_whole_kernel(monkeypatch, dtype, case, head):
    """An odd head size, or columns from an odd one on, would put one element of a 32-bit word in the region and its
    neighbour out of it: the update runs over the whole cache (its reason recorded), and equals eager's."""
    plans = record_compiled_plans(monkeypatch)
    generator = torch.Generator().manual_seed(3)
    cache = torch.randn(*CACHE, head, generator=generator).to(dtype)
    update, args = case(cache, generator)
    want = cache.clone()
    update(want, *args)
    torch.compile(update, backend="meganeura", dynamic=False)(cache, *args)
    assert torch.equal(cache, want)
    (plan,) = plans
    assert "by pairs" in next(iter(plan.stats["whole_updates"].values())), plan.stats
    (write,) = [d for d in plan.dispatches if d.label in ("index_put", "slice_scatter")]
    assert math.prod(write.workgroups) == math.ceil(cache.numel() / 2 / WORKGROUP)


def _llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, "max_position_embeddings": 512})).eval().to(dtype)


def _side_store_units(plan) -> list[str]:
    """The store units of each attention pass that runs a cache write in its own dispatch (``with_side_stores``'s
    loop, ``lowering/attention_writes.py``)."""
    return [m.group(1) for d in plan.dispatches if d.label.startswith("attention")
            for m in re.finditer(r"mg_unit < ([^;]+);", plan.kernels[d.kernel])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_bundles_cache_write_does_not_grow_with_the_cache(tmp_path, dtype):
    """A prefill run's cache write (a layer's key and value, one kernel) takes the same workgroups with 32 cache
    positions as with 512: one thread per new element (per pair in bf16), over its tokens' keys and values. A decode
    step's runs inside its attention's dispatch, over the new token's keys and values alone: the same store units at
    both lengths. No per-position lookup is left in the decode plan."""
    model = _llama(dtype)
    writes, units = {}, {}
    for length in (32, 512):
        torch_meganeura.export_lm(model, tmp_path / str(length), max_cache_len=length, prefill_tokens=8)
        phases = read_lm_bundle(tmp_path / str(length)).phases
        writes[length] = {name: [d.workgroups for d in _cache_writes(phases[name].plan)] for name in phases}
        units[length] = _side_store_units(phases["decode"].plan)
        assert "index_put_rep" not in [d.label for d in phases["decode"].plan.dispatches]
    assert writes[32] == writes[512] and units[32] == units[512], (writes, units)
    layers, kv_heads = LLAMA["num_hidden_layers"], LLAMA["num_key_value_heads"]
    head = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    lanes = 2 if dtype is torch.bfloat16 else 1
    threads = math.ceil(kv_heads * 8 * head / lanes)
    assert writes[512] == {"prefill": [(math.ceil(threads / WORKGROUP), 1, 1)] * layers, "decode": []}, writes
    assert len(units[512]) == layers, units
