"""``bench.host_breakdown`` on the null device at smoke scale: every phase of the loop's step split into torch's share,
ours and the device API's, the entry points it times put back after, the sampled split adding up to each phase, and
the resident step timed beside it."""
import pytest

import torch_meganeura.backend.entry as entry
from bench.host_breakdown import PHASES, measure
from helpers.recording_device import RecordingDevice

SAMPLED_STEPS = 40


def test_each_phase_is_split_into_torch_ours_and_the_device(null_device):
    compile_graph_module, submit = entry.compile_graph_module, RecordingDevice.submit
    row = measure("resnet50", steps=3, samples=SAMPLED_STEPS, smoke=True)
    phases = row["phases"]
    assert set(phases) == set(PHASES)
    for phase in ("forward", "backward", "step"):  # (our compiled functions and the kept update were timed)
        assert phases[phase]["ours"] > 0 and phases[phase]["device"] > 0, (phase, phases[phase])
    for phase, p in phases.items():
        assert p["torch"] + p["ours"] + p["device"] == pytest.approx(p["total"]), phase
        assert p["ours"] >= 0 and p["device"] >= 0, (phase, p)
    assert row["all"]["total"] == pytest.approx(sum(p["total"] for p in phases.values()))
    assert row["resident_step_us"] > 0 and row["loop_over_resident"] == pytest.approx(
        row["all"]["total"] / row["resident_step_us"])
    split = row["sampled"]["us_by_phase_and_category"]
    assert row["sampled"]["samples"] > 0
    for phase, where in split.items():
        assert sum(where.values()) == pytest.approx(phases[phase]["total"]), phase
    assert entry.compile_graph_module is compile_graph_module and RecordingDevice.submit is submit


def test_on_the_adapters_device_the_wall_times_come_beside():
    """``--device gpu`` (here lavapipe): the wgpu device's calls timed as the device's share, each phase's wall time
    at least its CPU time, the loop's and the resident step's wall ratio reported; the device's methods put back."""
    from meganeura.runtime.device import Device

    submit = Device.submit
    row = measure("resnet50", steps=2, samples=0, smoke=True, null=False)
    for phase in ("forward", "backward", "step"):
        assert row["phases"][phase]["device"] > 0, (phase, row["phases"][phase])
    for phase, p in row["phases"].items():
        assert p["wall"] >= p["total"] * 0.999, (phase, p)  # (a thread's CPU time cannot exceed the wall's)
    assert row["loop_over_resident_wall"] == pytest.approx(row["all"]["wall"] / row["resident_step_wall_us"])
    assert Device.submit is submit
