"""Tests for meganeura.kernels.matmul_tuning: the candidate variants of a problem and their passes (no device: the
timing is meganeura.runtime.matmul_tuner's, tested in tests/runtime)."""
import re

import pytest

from meganeura.kernels import matmul_tuning
from meganeura.kernels.matmul import matmul_kernel
from meganeura.kernels.matmul_plans import MatmulChoice, default_choice, plain_choice
from meganeura.kernels.matmul_tuning import candidates, partial_bytes, plain_problem, variants

LIMITS = {"max-compute-workgroups-per-dimension": 65535, "max-compute-workgroup-storage-size": 16384,
          "max-compute-invocations-per-workgroup": 256}


def test_candidates_start_with_the_default_and_are_distinct():
    found = candidates(1, 128, 576, 1536, LIMITS)
    assert found[0] == default_choice(1, 128, 576, 1536, LIMITS)
    assert len(found) == len(set(found)) > 10
    assert all(c.split == 1 or 1536 // c.split >= matmul_tuning.MIN_SLICE_K for c in found)
    assert {c.split for c in found} >= {1, 2, 4, 8}


def test_tiles_past_128x128_are_tried_only_where_they_make_enough_workgroups_alone():
    big = {**LIMITS, "max-compute-workgroup-storage-size": 49152}
    assert (128, 256) in {c.tile for c in candidates(1, 2048, 2048, 2048, big)}  # 128 workgroups
    for shape in ((1, 1500, 1536, 384), (4, 256, 196, 2304), (1, 1024, 1024, 1024)):  # 72, 8 and 32
        assert all(c.tile is None or c.tile[0] * c.tile[1] <= 128 * 128 for c in candidates(*shape, big))


def test_double_buffered_candidates_are_unsplit_f32_where_two_chunks_fit():
    """Each shape unsplit gets a double-buffered candidate where two of its chunks fit the storage limit: at 16 KiB
    the 32x64 tiles, not 64x64 (its chunk of 16 takes 8.5 KiB); at 48 KiB the 128x128 tile too."""
    found = [c for c in candidates(1, 2048, 2048, 2048, LIMITS) if c.double]
    assert found and all(c.split == 1 and not c.f16 for c in found)
    assert (32, 64) in {c.tile for c in found} and (64, 64) not in {c.tile for c in found}
    big = {**LIMITS, "max-compute-workgroup-storage-size": 49152}
    assert (128, 128) in {c.tile for c in candidates(1, 2048, 2048, 2048, big) if c.double}


def test_candidates_skip_tiles_that_are_mostly_padding():
    found = candidates(1, 20, 24, 64, LIMITS)
    assert all(c.tile is None or max(c.tile) <= 64 for c in found)


FAST = {**LIMITS, matmul_tuning.F16_PRODUCTS: 1}


def test_fast_default_uses_f16_only_for_4x4_register_blocks():
    assert default_choice(1, 128, 576, 1536, FAST).f16  # small tiles, 4x4 blocks
    assert not default_choice(1, 128, 576, 1536, LIMITS).f16  # strict
    assert not default_choice(1, 4096, 4096, 4096, FAST).f16  # 128x128 tiles of 8x8 blocks
    assert not default_choice(1, 1, 576, 1536, FAST).f16  # gemv: never f16


def test_fast_candidates_add_f16_variants_of_4x4_blocks_only():
    strict, fast = candidates(1, 128, 576, 1536, LIMITS), candidates(1, 128, 576, 1536, FAST)
    assert not any(c.f16 for c in strict)
    assert fast[0] == default_choice(1, 128, 576, 1536, FAST) and len(fast) == len(set(fast))
    added = [c for c in fast if c.f16]
    assert added and all(c.block in (None, (4, 4)) for c in added)
    assert {c for c in fast if not c.f16} >= set(strict) - {strict[0]}  # f32 variants stay candidates


def test_variants_build_each_candidate_s_passes_within_the_binding_limit():
    problem = plain_problem(1, 40, 48, 128, "p", "j")
    every = candidates(1, 40, 48, 128, LIMITS)
    limit = max(*problem.bindings, 2 * 4 * 40 * 48)  # the operands and two K slices of partial sums, not four
    choices, passes = variants(problem, LIMITS, limit)
    assert choices == [c for c in every if c.split <= 2] and {c.split for c in every} > {1, 2}
    assert len(passes) == len(choices)
    for choice, built in zip(choices, passes):
        assert len(built) == (2 if choice.split > 1 else 1)  # the split's partial sums are added up by a second pass
        assert all("fn main" in source and len(grid) == 3 for source, grid in built)
    assert partial_bytes(problem, choices) == 4 * max(c.split for c in choices) * 40 * 48


def test_a_problem_too_large_for_a_binding_keeps_its_default_untimed():
    problem = plain_problem(1, 40, 48, 128, "p", "j")
    assert variants(problem, LIMITS, max(problem.bindings) - 1) == ([default_choice(1, 40, 48, 128, LIMITS)], [])
    empty = plain_problem(1, 40, 48, 0, "p", "j")
    assert variants(empty, LIMITS, 1 << 30)[1] == []


def test_f16_problems_get_f16_candidates():
    strict, fast = plain_problem(1, 128, 576, 1536, "p", "j"), plain_problem(1, 128, 576, 1536, "p", "j", True)
    assert not any(c.f16 for c in variants(strict, LIMITS, 1 << 30)[0])
    choices, passes = variants(fast, LIMITS, 1 << 30)
    assert any(c.f16 for c in choices)
    assert all(("enable f16;" in built[0][0]) == c.f16 for c, built in zip(choices, passes))


BIG = {**LIMITS, "max-compute-workgroup-storage-size": 49152}


def test_quad_and_patch_candidates_for_tiles_of_64x64_or_more():
    """Tiles of VECTOR_MIN_TILE outputs or more get a quad-staged, patched candidate per split up to VECTOR_MAX_SPLIT
    and a double-buffered one unsplit (where two chunks fit); smaller tiles get none."""
    found = candidates(1, 1024, 1024, 1024, BIG)
    wide = [c for c in found if c.quads]
    assert all(c.patches and c.tile[0] * c.tile[1] >= matmul_tuning.VECTOR_MIN_TILE for c in wide)
    assert {c.split for c in wide} == {1, 2, 4} and any(c.double for c in wide)
    assert {(128, 128), (64, 64), (128, 256)} & {c.tile for c in wide if c.split == 1} == {(128, 128), (64, 64)}
    assert not any(c.quads for c in candidates(1, 20, 24, 64, LIMITS))  # 32x32 tiles at most: too small


def _workgroup_bytes(source: str) -> int:
    sizes = re.findall(r"var<workgroup>\s+\w+\s*:\s*array<vec4<f32>,\s*(\d+)>", source)
    return 16 * sum(int(size) for size in sizes)


@pytest.mark.parametrize("storage, invocations", [(16384, 256), (8192, 256), (16384, 128), (49152, 1024)])
def test_no_candidate_exceeds_the_adapter_s_limits(storage, invocations):
    """Every candidate's kernel fits the workgroup storage and invocation limits it is built for: a variant that
    would not (two 128x128 chunks of 8 at 16 KiB, 256 threads where 128 are allowed) is not offered, or is offered
    as the smaller plan it falls back to."""
    limits = {**LIMITS, "max-compute-workgroup-storage-size": storage,
              "max-compute-invocations-per-workgroup": invocations}
    problem = plain_problem(1, 2048, 2048, 2048, "p", "j")
    choices, passes = variants(problem, limits, 1 << 40)
    assert len(choices) > 10
    for choice, built in zip(choices, passes):
        source = built[0][0]
        assert _workgroup_bytes(source) <= storage, choice
        assert int(re.search(r"@workgroup_size\((\d+)\)", source).group(1)) <= invocations, choice
    doubled = {c.tile for c in choices if c.double}
    assert ((128, 128) in doubled) == (storage >= 2 * 8 * (128 + 128) * 4 and invocations >= 256)  # unpadded


def test_the_wide_tile_is_the_default_only_where_the_limits_and_shape_suit_it():
    """128x256 tiles of 8x16 blocks, unsplit, for outputs of whole wide tiles (at least 128 of them) where the
    adapter gives 256 invocations and 24.5 KiB of workgroup storage: double-buffered, quad staged in thread patches
    and unpadded where its two chunks of 16 fit (48 KiB), else single-buffered; elsewhere the rule's tile and split
    or QUAD_TILE's variant."""
    wide = MatmulChoice((128, 256), (8, 16), 1)
    doubled = MatmulChoice((128, 256), (8, 16), 1, double=True, quads=True, patches=True, unpadded=True)
    assert default_choice(1, 4096, 4096, 4096, BIG) == doubled
    assert default_choice(1, 2048, 2048, 2048, BIG) == doubled   # 128 tiles
    assert default_choice(4, 1024, 1024, 512, BIG) == doubled    # batched: 4 x 32 tiles
    assert default_choice(1, 4096, 4096, 4096, {**BIG, "max-compute-workgroup-storage-size": 49151}) == wide
    assert default_choice(1, 2048, 2048, 2048, {**BIG, "max-compute-workgroup-storage-size": 32768}) == wide
    assert default_choice(1, 1024, 1024, 1024, BIG).tile != wide.tile  # 32 tiles: too few
    assert default_choice(1, 2048, 2000, 2048, BIG).tile is None  # not whole tiles
    assert default_choice(1, 4096, 4096, 4096, LIMITS).tile is None  # WebGPU's default 16 KiB
    assert default_choice(1, 4096, 4096, 4096, {**BIG, "max-compute-invocations-per-workgroup": 128}).tile is None
    assert candidates(1, 4096, 4096, 4096, BIG)[0] == doubled


@pytest.mark.parametrize("storage", [16384, 32768, 49152])
@pytest.mark.parametrize("size", [4096, 2048, 1024])
def test_the_default_kernel_stays_within_the_adapter_s_limits(storage, size):
    """The default of a square f32 matmul builds a kernel within the workgroup storage and the 256 invocations it is
    built for (WebGPU's default 16 KiB, an Apple-class 32 KiB, NVIDIA's 48 KiB), with the variant's features: at
    48 KiB the wide tile's at 4096 and 2048 is double-buffered, exactly 48 KiB."""
    limits = {**LIMITS, "max-compute-workgroup-storage-size": storage}
    choice = default_choice(1, size, size, size, limits)
    source, _ = matmul_kernel("", batch=1, m=size, n=size, k=size, limits=limits, tile=choice.tile,
                              block=choice.block, split=choice.split, partial="partial" if choice.split > 1 else None,
                              double=choice.double, quads=choice.quads, patches=choice.patches,
                              chunk=choice.chunk, unpadded=choice.unpadded)
    header = re.search(r"// ---- matmul: (.*)", source).group(1)
    assert _workgroup_bytes(source) <= storage
    assert int(re.search(r"@workgroup_size\((\d+)\)", source).group(1)) <= 256
    assert ("double-buffered" in header) == choice.double and ("quad staging" in header) == choice.quads
    assert ("thread patches" in header) == choice.patches
    if storage == 49152 and size >= 2048:
        assert header.startswith("tiled 128x256, K chunk 16,") and _workgroup_bytes(source) == storage
        assert header.endswith("double-buffered, quad staging, thread patches, unpadded")


def test_quad_tile_default_only_where_the_rule_splits_a_k_no_longer_than_the_output_edges():
    """QUAD_TILE's quad-staged variant, unsplit, for outputs of whole 64x64 tiles (256 or more) whose K runs from
    1024 to the shorter edge where the rule would split K (H100: 1024^3); shapes the split rule's figures cite, and
    others without a figure (K under 1024, ragged, K past an edge, enough tiles unsplit), keep the rule's choice."""
    quad = MatmulChoice((64, 64), (8, 4), 1, quads=True, patches=True)
    for limits in (LIMITS, BIG):
        assert default_choice(1, 1024, 1024, 1024, limits) == quad
        assert default_choice(1, 2048, 1024, 1024, limits) == quad
        for shape in ((1, 1500, 1536, 384), (1, 1500, 384, 1536), (1, 50, 2048, 720), (1, 128, 1536, 576),
                      (1, 3136, 512, 128), (1, 3136, 512, 256), (1, 1024, 1024, 512), (1, 1024, 1024, 2048),
                      (1, 1024, 1000, 1024), (1, 1000, 1024, 1024), (1, 960, 960, 960), (1, 3072, 3008, 1024)):
            assert default_choice(*shape, limits) == plain_choice(*shape, limits), shape
    assert default_choice(1, 1024, 1024, 1024, LIMITS) != plain_choice(1, 1024, 1024, 1024, LIMITS)
    assert plain_choice(1, 1024, 1024, 1024, LIMITS).split == 8  # what the rule alone would take


@pytest.mark.parametrize("shape, storage", [((1, 4096, 4096, 4096), 49152), ((1, 2048, 2048, 2048), 49152),
                                            ((1, 1024, 1024, 1024), 16384), ((1, 1024, 1024, 1024), 49152)])
def test_the_plain_default_stays_a_candidate(shape, storage):
    """The tuner can still pick the default's plain form (single-buffered wide tile, the rule's split tile)."""
    limits = {**LIMITS, "max-compute-workgroup-storage-size": storage}
    found = candidates(*shape, limits)
    assert found[0] == default_choice(*shape, limits) != plain_choice(*shape, limits)
    assert found[1] == plain_choice(*shape, limits) and len(found) == len(set(found))


@pytest.mark.parametrize("storage, tile, expected", [
    (49152, (128, 256), {(16, True, False), (8, False, False), (16, True, True), (8, False, True)}),
    (32768, (128, 128), {(16, True, False), (8, False, False), (16, True, True), (8, False, True)}),
    (32768, (128, 256), {(8, False, False), (8, False, True)}),   # two unpadded chunks of 16 take 48 KiB
    (16384, (128, 128), {(8, True, False), (8, True, True)}),     # WebGPU's default: unpadded, chunk of 8
    (16384, (128, 256), set()),                                   # no two chunks of 8 in 16 KiB
])
def test_tight_double_buffered_candidates_where_the_rule_s_two_chunks_do_not_fit(storage, tile, expected):
    """Tiles of TIGHT_DOUBLE_MIN_TILE outputs whose padded chunk does not fit twice get double-buffered candidates
    that do, unsplit: the rule's chunk unpadded, and the largest smaller chunk (at least MIN_DOUBLE_CHUNK) padded,
    each element staged and quad staged; (K chunk, unpadded, quads) of each, from the plan it builds."""
    limits = {**LIMITS, "max-compute-workgroup-storage-size": storage}
    found = [c for c in candidates(1, 4096, 4096, 4096, limits) if c.double and c.tile == tile]
    if tile == (128, 128) and storage >= 2 * 16 * (128 + 128 + 8) * 4:
        expected = set()
    got = set()
    for choice in found:
        if choice.chunk or choice.unpadded:
            source, _ = matmul_kernel("", batch=1, m=4096, n=4096, k=4096, limits=limits, tile=choice.tile,
                                      block=choice.block, double=True, quads=choice.quads, chunk=choice.chunk,
                                      unpadded=choice.unpadded)
            header = re.search(r"// ---- matmul: (.*)", source).group(1)
            assert "double-buffered" in header and choice.split == 1
            got.add((int(re.search(r"K chunk (\d+)", header).group(1)), choice.unpadded, choice.quads))
    assert got == expected


def test_smaller_tiles_get_no_tight_double_buffered_candidates():
    for storage in (16384, 32768, 49152):
        limits = {**LIMITS, "max-compute-workgroup-storage-size": storage}
        found = candidates(1, 1024, 1024, 1024, limits) + candidates(1, 128, 576, 1536, limits)
        assert all(c.tile[0] * c.tile[1] >= matmul_tuning.TIGHT_DOUBLE_MIN_TILE
                   for c in found if c.chunk or c.unpadded)
