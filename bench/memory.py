"""Peak device memory of a training run, the ordinary loop kept on the device against the resident step, and what
is alive at the peak.

    python -m bench.memory --smoke                       # every workload and the two small test models
    python -m bench.memory --workloads llama_small --steps 4
    python -m bench.memory --null-device --workloads whisper_tiny   # full size, nothing computed

Each way trains a fresh copy of the model for ``--steps`` AdamW steps from the same weights and batch:
``loop`` is ``torch.compile(backend="meganeura")`` + ``loss.backward()`` + ``optimizer.step()`` with
``keep_on_device(optimizer)``, ``resident`` is ``compile_train_step``. The window starts before the model's first
upload, as the benchmark's peak-memory window does (``cells._Meter``). The device's allocation counters are exact
and the same on any adapter for the same plans, so a CPU Vulkan driver measures what a GPU would allocate.

The breakdown at the peak sorts every live buffer by what holds it (``Breakdown.kinds``): the ParamStore's
parameter copies, optimizer state, gradients, a resident step's parameters and state, other pool arrays handed out
(saved activations), pool buffers free for reuse, and each program's arena, input, output, status and staging
buffers.
"""
from __future__ import annotations

import argparse
import gc
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .workloads import WORKLOADS, Workload

WAYS = ("loop", "resident")
LR = 1e-5  # the benchmark's AdamW learning rate (``cells.Runner``)
MIB = 1 << 20


# ---- the two small models of the test suite (tests/helpers/models.py, tests/torch/test_device_optimizer.py)

def _llama_small(smoke: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        use_cache=False))


def _resnet_small(smoke: bool):
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                     layer_type="basic", num_labels=5))


SMALL = {w.name: w for w in (
    Workload("llama_small", "the tests' two-layer HF Llama, batch 2 x 9 tokens, HF's labels= loss", _llama_small,
             lambda size, gen, smoke: (torch.randint(0, 64, (2, 9), generator=gen),),
             output=lambda m, ids: m(ids).logits, loss=lambda m, ids: m(ids, labels=ids).loss),
    Workload("resnet_small", "the tests' HF ResNet (basic blocks), 2 x 3 x 32 x 32, cross-entropy", _resnet_small,
             lambda size, gen, smoke: (torch.randn(2, 3, 32, 32, generator=gen),
                                       torch.randint(0, 5, (2,), generator=gen)),
             output=lambda m, x, y: m(x).logits, loss=lambda m, x, y: F.cross_entropy(m(x).logits, y)),
)}
ALL = {**SMALL, **WORKLOADS}


# ---- what holds each live buffer

@dataclass
class Breakdown:
    """Bytes by kind of holder at one moment, and how many buffers of each kind."""

    total: int = 0
    kinds: dict = field(default_factory=dict)  # kind -> [bytes, buffers, the largest buffer's bytes]

    def add(self, kind: str, size: int) -> None:
        entry = self.kinds.setdefault(kind, [0, 0, 0])
        entry[0] += size
        entry[1] += 1
        entry[2] = max(entry[2], size)
        self.total += size

    def lines(self) -> list[str]:
        return [f"  {kind:<32} {size / MIB:9.3f} MiB  {count:5d} buffers, largest {largest / MIB:8.3f} MiB"
                for kind, (size, count, largest) in sorted(self.kinds.items(), key=lambda item: -item[1][0])]


def _program_kind(label: str) -> str:
    """The kind of a buffer a program owns, from its plan's buffer name (``meganeura.lowering.schedule``)."""
    if label.startswith("out"):
        return "program outputs"
    if label.startswith("input:"):
        return "program inputs"
    if label.startswith("param:"):
        return "program-uploaded params"
    return {"arena": "program arenas", "status": "program status", "staging": "program staging",
            "resident": "pool: saved activations, other", "parameter": "ParamStore parameters"}.get(label, label)


class Tracker:
    """Watches a device's buffer creations and destructions; at each new peak of ``bytes_allocated`` it sorts the
    live buffers by holder (``holders()``: buffer id -> kind, for the arrays it can name)."""

    def __init__(self, device, holders):
        self.device, self.holders = device, holders
        self.live: dict[int, tuple[int, str]] = {}
        self.at_peak = Breakdown()
        self.phase, self.peak_phase = "building", "building"  # what runs now, and what ran at the peak
        self.phase_peaks: dict[str, int] = {}  # the most bytes allocated in each phase
        self.start = device.counters.bytes_allocated
        device.counters.peak_bytes_allocated = self.start
        self._create, self._destroy = device.create_buffer, device.destroy_buffer
        device.create_buffer, device.destroy_buffer = self._created, self._destroyed

    def close(self) -> None:
        del self.device.create_buffer, self.device.destroy_buffer

    @property
    def peak(self) -> int:
        return self.device.counters.peak_bytes_allocated - self.start

    def _created(self, size, usage, label=""):
        buffer = self._create(size, usage, label)
        self.live[id(buffer)] = (size, label)
        now = self.device.counters.bytes_allocated - self.start
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), now)
        if now >= self.peak and size:
            self.at_peak, self.peak_phase = self._snapshot(), self.phase
        return buffer

    def _destroyed(self, buffer) -> None:
        self.live.pop(id(buffer), None)
        self._destroy(buffer)

    def _snapshot(self) -> Breakdown:
        named = self.holders()
        free = {id(b) for b in self.device.pool.free_buffers()}
        result = Breakdown()
        for key, (size, label) in self.live.items():
            result.add("pool (free for reuse)" if key in free else named.get(key) or _program_kind(label), size)
        return result


def _buffer_ids(values, kind: str) -> dict[int, str]:
    """buffer id -> ``kind`` for each live device array among ``values`` (DeviceArrays or ResidentTensors)."""
    ids = {}
    for v in values:
        array = getattr(v, "array", v)
        buffer = getattr(array, "buffer", None)
        if buffer is not None:
            ids[id(buffer)] = kind
    return ids


def _loop_holders(model, optimizer):
    def holders() -> dict[int, str]:
        ids = _buffer_ids([s for state in optimizer.state.values() for s in state.values()
                           if isinstance(s, torch.Tensor) and hasattr(s, "array")], "optimizer state")
        ids.update(_buffer_ids([p.grad for p in model.parameters() if hasattr(p.grad, "array")], "gradients"))
        return ids
    return holders


def _resident_holders(step):
    def holders() -> dict[int, str]:
        arrays = getattr(step, "_arrays", {})
        ids = {}
        for role, array in arrays.items():
            ids.update(_buffer_ids([array], f"step {role.kind.name.lower()}"))
        ids.update(_buffer_ids(getattr(step, "_spare", {}).values(), "step spare (alternating)"))
        return ids
    return holders


# ---- the two ways

def train(workload: Workload, way: str, steps: int, smoke: bool = True, seed: int = 0) -> Tracker:
    """Train a fresh copy of ``workload``'s model ``steps`` AdamW steps the ``way`` given, counting memory from
    before its first upload; returns the closed tracker (``peak``, ``at_peak``)."""
    from meganeura.runtime.device import get_device

    import torch_meganeura

    torch.manual_seed(seed)
    model = workload.build(smoke).train(workload.train_mode)
    batch = workload.batch("full", torch.Generator().manual_seed(seed + 1), smoke)
    torch._dynamo.reset()
    gc.collect()
    device = get_device()
    device.pool.clear()  # another run's free buffers and programs' arena are not this one's
    device.arena.shrink()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    holders = {"of": dict}  # none named until the way is built
    tracker = Tracker(device, lambda: holders["of"]())
    try:
        if way == "loop":
            torch_meganeura.keep_on_device(optimizer)
            compiled = torch.compile(lambda *args: workload.loss(model, *args), backend="meganeura")
            holders["of"] = _loop_holders(model, optimizer)
            for i in range(steps):
                optimizer.zero_grad(set_to_none=True)
                tracker.phase = f"step {i + 1}: forward"
                loss = compiled(*batch)
                tracker.phase = f"step {i + 1}: backward"
                loss.backward()
                tracker.phase = f"step {i + 1}: optimizer"
                optimizer.step()
        else:
            step = torch_meganeura.compile_train_step(model, workload.loss, optimizer)
            holders["of"] = _resident_holders(weakref.proxy(step))
            for i in range(steps):
                tracker.phase = f"step {i + 1}"
                step(*batch)
    finally:
        tracker.close()
    return tracker


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(ALL), help=f"comma-separated, from {', '.join(ALL)}")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, from {', '.join(WAYS)}")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps per way")
    p.add_argument("--smoke", action="store_true", help="the benchmark workloads at smoke scale")
    p.add_argument("--null-device", action="store_true",
                   help="run on a device that computes nothing (the tests' RecordingDevice) with the adapter's limits "
                        "and features: the same plans and allocations, full-size workloads in seconds on any machine")
    return p


def use_null_device() -> None:
    """Make the process-wide device one that allocates and records but computes nothing, with the limits and
    features of the adapter ``get_device`` picks (so the plans are those it would run)."""
    import meganeura.runtime.device as runtime_device

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers.recording_device import RecordingDevice

    real = runtime_device.get_device()
    null = RecordingDevice(limits=real.limits, features=real.features, name=f"null device ({real.name}'s limits)")
    for key in list(runtime_device._devices):
        runtime_device._devices[key] = null


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.null_device:
        use_null_device()
    for name in args.workloads.split(","):
        peaks = {}
        for way in args.ways.split(","):
            tracker = train(ALL[name], way, args.steps, args.smoke)
            peaks[way] = tracker.peak
            print(f"{name} {way}: peak {tracker.peak / MIB:.3f} MiB ({tracker.peak} bytes), in {tracker.peak_phase}")
            print("\n".join(tracker.at_peak.lines()))
            print("  peak by phase: " + ", ".join(f"{phase} {size / MIB:.3f}"
                                                  for phase, size in tracker.phase_peaks.items()))
        if len(peaks) == 2:
            print(f"{name}: loop / resident {peaks['loop'] / peaks['resident']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
