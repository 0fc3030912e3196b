"""Tests for meganeura.runtime.matmul_tuner: timing the candidate variants on the adapter (lavapipe on CPU), and the
file of choices per adapter and kernels (remembered; ignored when damaged, foreign or from other kernels)."""
import json

import pytest

from meganeura.kernels import matmul_tuning
from meganeura.kernels.matmul_plans import MatmulChoice
from meganeura.kernels.matmul_tuning import candidates, plain_problem
from meganeura.runtime import matmul_tuner
from meganeura.runtime.device import get_device
from meganeura.runtime.matmul_tuner import MatmulTuner

LIMITS = {"max-compute-workgroups-per-dimension": 65535, "max-compute-workgroup-storage-size": 16384,
          "max-compute-invocations-per-workgroup": 256}


def test_every_candidate_survives_the_file():
    """A remembered choice is read back as itself, whichever tile and register block it has."""
    found = candidates(1, 4096, 4096, 4096, {**LIMITS, "max-compute-workgroup-storage-size": 49152})
    assert (128, 256) in {c.tile for c in found} and (8, 16) in {c.block for c in found}
    assert any(c.quads and c.patches and c.double for c in found)
    assert any(c.unpadded for c in found) and any(c.chunk for c in found)
    for choice in found:
        entry = json.loads(json.dumps(matmul_tuner._entry(choice, 1e-4, 2e-4)))
        assert matmul_tuner._valid(entry) and matmul_tuner._choice(entry) == choice


@pytest.fixture
def small_family(monkeypatch):
    """Two tile shapes and two splits: few pipelines for a slow CPU driver."""
    monkeypatch.setattr(matmul_tuning, "CONFIGS", (((32, 32), (4, 4)), ((16, 32), (4, 4))))
    monkeypatch.setattr(matmul_tuning, "SPLITS", (1, 2))


def test_tuner_times_a_problem_once_and_remembers_it(tmp_path, small_family):
    device = get_device()
    tuner = MatmulTuner(device, tmp_path)
    choice = tuner.choose_all([plain_problem(1, 40, 48, 96, "p", "j")])[0]
    assert isinstance(choice, MatmulChoice) and tuner.tuned == 1
    assert choice in candidates(1, 40, 48, 96, device.limits)
    assert tuner.choose_all([plain_problem(1, 40, 48, 96, "p", "j")])[0] == choice and tuner.tuned == 1
    saved = json.loads(tuner.path.read_text())
    entry = saved["problems"][plain_problem(1, 40, 48, 96, "p", "j").key()]
    assert entry["us"] > 0 and entry["default_us"] > 0
    assert entry["us"] <= entry["default_us"]
    again = MatmulTuner(device, tmp_path)  # a new process: read from the file, not timed
    assert again.choose_all([plain_problem(1, 40, 48, 96, "p", "j")])[0] == choice and again.tuned == 0


def test_splits_whose_partial_sums_exceed_a_binding_are_left_out_not_the_problem(monkeypatch, small_family):
    """A device whose binding limit holds the operands and two K slices of partial sums, not four: the problem is
    still tuned, over the candidates that fit."""
    device = get_device()
    monkeypatch.setattr(matmul_tuning, "SPLITS", (1, 2, 4))
    problem = plain_problem(1, 40, 48, 128, "p", "j")
    slice_bytes = 4 * 40 * 48
    monkeypatch.setattr(device, "max_binding_size", max(*problem.bindings, 2 * slice_bytes))
    timed = []
    real = matmul_tuner.time_sequences

    def spy(dev, sequences, warmup_seconds):
        timed.append(len(sequences))
        return real(dev, sequences, warmup_seconds)

    monkeypatch.setattr(matmul_tuner, "time_sequences", spy)
    tuner = MatmulTuner(device, None)
    choice = tuner.choose_all([problem])[0]
    every = candidates(1, 40, 48, 128, device.limits)
    fitting = [c for c in every if c.split <= 2]
    assert {c.split for c in every} == {1, 2, 4} and timed == [len(fitting)]
    assert choice in fitting and tuner.entries[problem.key()]["us"] is not None


ENTRY = {plain_problem(1, 40, 48, 96, "p", "j").key(): {"tile": [16, 32], "block": [4, 4], "split": 2}}


@pytest.mark.parametrize("content", ["{ not json", {"adapter": "another GPU"}, {"kernels": "an older generator"}])
def test_damaged_or_foreign_file_is_ignored_and_rewritten(tmp_path, small_family, content):
    device = get_device()
    tuner = MatmulTuner(device, tmp_path)
    if isinstance(content, dict):  # a well-formed file but for another adapter or other kernels
        content = json.dumps({"version": matmul_tuner.FILE_VERSION, "adapter": tuner.adapter,
                              "kernels": tuner.kernels, "problems": ENTRY, **content})
    tuner.path.write_text(content)
    fresh = MatmulTuner(device, tmp_path)
    assert fresh.entries == {}
    fresh.choose_all([plain_problem(1, 40, 48, 96, "p", "j")])
    saved = json.loads(fresh.path.read_text())
    assert fresh.tuned == 1 and (saved["adapter"], saved["kernels"]) == (fresh.adapter, fresh.kernels)


def test_a_well_formed_file_of_this_adapter_and_kernels_is_read(tmp_path, small_family):
    device = get_device()
    tuner = MatmulTuner(device, tmp_path)
    tuner.path.write_text(json.dumps({"version": matmul_tuner.FILE_VERSION, "adapter": tuner.adapter,
                                      "kernels": tuner.kernels, "problems": ENTRY}))
    assert MatmulTuner(device, tmp_path).entries == ENTRY


def test_kernels_with_runtime_checks_are_tuned_apart(monkeypatch):
    """Checked kernels run slower, so their timings go to another file, and plans tuned with them to other cache
    entries (the fingerprint is part of the plan cache key)."""
    device = get_device()
    unchecked = MatmulTuner(device, None).fingerprint
    monkeypatch.setenv("MEGANEURA_SHADER_CHECKS", "1")
    assert MatmulTuner(device, None).fingerprint != unchecked


def test_entries_naming_impossible_variants_are_dropped(tmp_path):
    device = get_device()
    tuner = MatmulTuner(device, tmp_path)
    good = {"tile": [32, 64], "block": [4, 8], "split": 4, "us": 1.0, "default_us": 2.0}
    problems = {"1x2x3x4:pp": good, "1x5x6x7:pp": {**good, "tile": [3, 5]}, "1x8x9x10:pp": {**good, "split": 0},
                "1x8x9x11:pp": {**good, "block": [4, 6]}, "1x8x9x12:pp": {**good, "chunk": 12},
                "1x8x9x13:pp": {**good, "unpadded": 1.5}}
    tuner.path.write_text(json.dumps({"version": matmul_tuner.FILE_VERSION, "adapter": tuner.adapter,
                                      "kernels": tuner.kernels, "problems": problems}))
    assert list(MatmulTuner(device, tmp_path).entries) == ["1x2x3x4:pp"]


def test_new_problems_are_compiled_in_one_batch_and_repeats_asked_once(small_family, monkeypatch):
    device = get_device()
    tuner = MatmulTuner(device, None)
    batches = []
    compile_all = device.pipelines

    def recording(kernels):
        batches.append(len(kernels))
        return compile_all(kernels)

    monkeypatch.setattr(device, "pipelines", recording)
    problems = [plain_problem(1, 40, 48, 96, "p", "p"), plain_problem(1, 24, 40, 64, "p", "j"),
                plain_problem(1, 40, 48, 96, "p", "p")]
    chosen = tuner.choose_all(problems)
    assert len(batches) == 1 and tuner.tuned == 2
    assert chosen[0] == chosen[2] and all(isinstance(c, MatmulChoice) for c in chosen)
    assert tuner.choose_all(problems[1:2]) == chosen[1:2] and len(batches) == 1


def test_without_a_directory_choices_last_for_the_process(small_family):
    tuner = MatmulTuner(get_device(), None)
    assert tuner.path is None
    tuner.choose_all([plain_problem(2, 33, 20, 64, "i", "p")])
    assert tuner.tuned == 1 and plain_problem(2, 33, 20, 64, "i", "p").key() in tuner.entries


def test_f16_problems_are_timed_and_remembered_apart(tmp_path, small_family):
    device = get_device()
    if "shader-f16" not in device.features:
        pytest.skip("the adapter has no shader-f16")
    tuner = MatmulTuner(device, tmp_path)
    strict, fast = tuner.choose_all([plain_problem(1, 40, 48, 96, "p", "j", False),
                                     plain_problem(1, 40, 48, 96, "p", "j", True)])
    assert tuner.tuned == 2 and not strict.f16
    assert fast in candidates(1, 40, 48, 96, {**device.limits, matmul_tuning.F16_PRODUCTS: 1})
    saved = json.loads(tuner.path.read_text())["problems"]
    fast_key = plain_problem(1, 40, 48, 96, "p", "j", True).key()
    assert set(saved) == {plain_problem(1, 40, 48, 96, "p", "j").key(), fast_key} and saved[fast_key]["f16"] == fast.f16


def test_pick_keeps_the_default_unless_a_candidate_beats_it_by_min_gain():
    assert matmul_tuner.pick([1.0, 0.97, 0.99]) == 0  # 3% faster: within MIN_GAIN (5%)
    assert matmul_tuner.pick([1.0, 0.97, 0.9]) == 2
    assert matmul_tuner.pick([1.0, 1.2]) == 0
