"""The plans the backend compiles while a test runs: ``backend.device_graph.compile_plan`` spied on."""
from __future__ import annotations


def record_compiled_plans(monkeypatch, keep=lambda plan: [plan]) -> list:
    """A list that receives, in compile order, ``keep(plan)``'s items of every plan compiled from now until the test
    ends (by default the plans; ``lambda plan: plan.kernels.values()``: their WGSL sources)."""
    from torch_meganeura.backend import device_graph

    found = []
    original = device_graph.compile_plan

    def spy(*args, **kwargs):
        compiled = original(*args, **kwargs)
        found.extend(keep(compiled[0]))
        return compiled

    monkeypatch.setattr(device_graph, "compile_plan", spy)
    return found
