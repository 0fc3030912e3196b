"""The static dispatch plan: plain data that the compiler emits and the executor replays.

A plan names device buffers, the tensors that live inside them, the WGSL of every kernel and the
ordered list of dispatches. It holds no code and no references to torch, so it serialises to JSON
(``Plan.to_dict`` / ``Plan.from_dict``) for bundles and caches.

Buffer roles:
  ``input``   uploaded by the caller before every run (user inputs);
  ``param``   long-lived tensors (weights, buffers) bound from outside the plan;
  ``output``  written by the plan and read back after every run;
  ``arena``   intermediates placed at planned offsets, shared by tensors with disjoint lifetimes;
  ``status``  a few u32 words that kernels raise (atomicMax) to report bad data, e.g. an index out of range.
An output in ``Plan.in_place`` has no buffer of its own: it is stored over an input's, which the caller binds from
the device (the input's old value is gone after the run).

Every kernel binds storage buffers only, all ``read_write`` (wgpu refuses one buffer bound both read-only
and writable in a dispatch, and arena tensors share a buffer), at ``@group(0) @binding(i)`` for i in order.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .dtypes import STORAGE, storage_bytes
from meganeura.kernels.sizes import evaluator, from_json, size_json

FORMAT_VERSION = 1

DEVICE_DTYPE = STORAGE  # logical dtype -> how the device stores it (see dtypes)
BUFFER_ROLES = ("input", "param", "output", "arena", "status")


@dataclass(frozen=True)
class BufferSpec:
    name: str
    size: int  # bytes, multiple of 4
    role: str


@dataclass(frozen=True)
class TensorSpec:
    """A contiguous tensor stored at ``offset`` bytes inside ``buffer``."""

    name: str
    buffer: str
    offset: int
    shape: tuple[int, ...]
    dtype: str  # logical dtype, a key of DEVICE_DTYPE

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return storage_bytes(self.numel, self.dtype)


@dataclass(frozen=True)
class Binding:
    buffer: str
    offset: int  # bytes, aligned to the device's min-storage-buffer-offset-alignment
    size: int  # bytes, > 0


@dataclass(frozen=True)
class Dispatch:
    kernel: str  # key into Plan.kernels
    bindings: tuple[Binding, ...]
    workgroups: tuple[int, int, int]
    label: str = ""


@dataclass
class Plan:
    buffers: list[BufferSpec]
    inputs: list[TensorSpec]
    params: list[TensorSpec]
    outputs: list[TensorSpec]
    kernels: dict[str, str]  # key -> WGSL source, entry point "main"
    dispatches: list[Dispatch]
    status_messages: dict[int, str] = field(default_factory=dict)  # status code -> error text
    stats: dict = field(default_factory=dict)  # informational: planned/unplanned bytes, fused groups...
    in_place: dict[str, str] = field(default_factory=dict)  # output -> the input whose buffer it is stored over
    # A plan over symbolic sizes (a dynamic graph's, ``sizes``): input and output shapes and workgroup counts may be
    # ``Size``s of its ``symbols`` symbols, evaluated at each run from their values (``at``), which the run also
    # writes to the input named SIZES_INPUT for the kernels; buffers and bindings are sized for ``bounds``, the
    # largest values it serves.
    symbols: int = 0
    bounds: tuple = ()

    def sized(self, values) -> tuple[list[tuple], list[tuple]]:
        """(the shapes of the inputs then the outputs, the workgroup counts of each dispatch) at symbol values
        ``values``, from one compiled evaluation."""
        return _evaluator(self)(tuple(values))

    def at(self, values) -> "Plan":
        """The plan for symbol values ``values``: shapes and workgroup counts evaluated (the plan itself when it has
        no symbols)."""
        if not self.symbols:
            return self
        shapes, workgroups = self.sized(values)
        specs = iter(shapes)
        return replace(self, inputs=[replace(t, shape=next(specs)) for t in self.inputs],
                       outputs=[replace(t, shape=next(specs)) for t in self.outputs],
                       dispatches=[replace(d, workgroups=w) for d, w in zip(self.dispatches, workgroups)],
                       symbols=0, bounds=())

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"plan has no buffer named {name!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["format_version"] = FORMAT_VERSION
        d["status_messages"] = {str(k): v for k, v in self.status_messages.items()}
        for group in ("inputs", "outputs"):  # symbolic sizes in their JSON form (``Size.to_json``)
            for entry, spec in zip(d[group], getattr(self, group)):
                entry["shape"] = [size_json(s) for s in spec.shape]
        for entry, dispatch in zip(d["dispatches"], self.dispatches):
            entry["workgroups"] = [size_json(w) for w in dispatch.workgroups]
        d["bounds"] = list(self.bounds)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"plan format version {version!r} is not supported (this runtime reads {FORMAT_VERSION})")

        bounds = tuple(int(b) for b in d.get("bounds", ()))

        def sizes(items) -> tuple:
            return tuple(from_json(x, bounds) for x in items)  # (symbolic sizes hinted with the bounds)

        def tensors(items):
            return [TensorSpec(t["name"], t["buffer"], int(t["offset"]), sizes(t["shape"]), t["dtype"]) for t in items]

        plan = cls(
            buffers=[BufferSpec(b["name"], int(b["size"]), b["role"]) for b in d["buffers"]],
            inputs=tensors(d["inputs"]),
            params=tensors(d["params"]),
            outputs=tensors(d["outputs"]),
            kernels=dict(d["kernels"]),
            dispatches=[
                Dispatch(
                    x["kernel"],
                    tuple(Binding(b["buffer"], int(b["offset"]), int(b["size"])) for b in x["bindings"]),
                    sizes(x["workgroups"]),
                    x.get("label", ""),
                )
                for x in d["dispatches"]
            ],
            status_messages={int(k): v for k, v in d.get("status_messages", {}).items()},
            in_place=dict(d.get("in_place", {})),
            stats=dict(d.get("stats", {})),
            symbols=int(d.get("symbols", 0)),
            bounds=bounds,
        )
        plan.validate()
        return plan

    def validate(self) -> None:
        """Check internal consistency; raise ValueError naming the first problem. A plan over symbolic sizes is
        checked at its bounds."""
        if self.symbols:
            if len(self.bounds) != self.symbols:
                raise ValueError(f"plan over {self.symbols} symbols has {len(self.bounds)} bounds")
            self.at(self.bounds).validate()
            return
        names = {}
        for b in self.buffers:
            if b.role not in BUFFER_ROLES:
                raise ValueError(f"buffer {b.name!r} has unknown role {b.role!r}")
            if b.size <= 0 or b.size % 4:
                raise ValueError(f"buffer {b.name!r} has invalid size {b.size}")
            names[b.name] = b
        for group in (self.inputs, self.params, self.outputs):
            for t in group:
                if t.buffer not in names:
                    raise ValueError(f"tensor {t.name!r} lives in unknown buffer {t.buffer!r}")
                if t.dtype not in DEVICE_DTYPE:
                    raise ValueError(f"tensor {t.name!r} has unsupported dtype {t.dtype!r}")
                if t.offset + t.nbytes > names[t.buffer].size:
                    raise ValueError(f"tensor {t.name!r} does not fit in buffer {t.buffer!r}")
        inputs, outputs = {t.name: t for t in self.inputs}, {t.name: t for t in self.outputs}
        for out, name in self.in_place.items():
            if out not in outputs or name not in inputs or outputs[out].buffer != inputs[name].buffer:
                raise ValueError(f"in-place output {out!r} is not an output stored in input {name!r}'s buffer")
        for i, disp in enumerate(self.dispatches):
            if disp.kernel not in self.kernels:
                raise ValueError(f"dispatch {i} ({disp.label}) uses missing kernel {disp.kernel!r}")
            for b in disp.bindings:
                if b.buffer not in names:
                    raise ValueError(f"dispatch {i} ({disp.label}) binds unknown buffer {b.buffer!r}")
                if b.offset < 0 or b.size <= 0 or b.offset + b.size > names[b.buffer].size:
                    raise ValueError(f"dispatch {i} ({disp.label}) binds outside buffer {b.buffer!r}")
            if len(disp.workgroups) != 3 or min(disp.workgroups) < 1:
                raise ValueError(f"dispatch {i} ({disp.label}) has invalid workgroup count {disp.workgroups}")


SIZES_INPUT = "sizes"  # the int32 input of a plan over symbolic sizes holding the symbols' values, in order


def _evaluator(plan: Plan):
    """A function of the symbols' values giving (input and output shapes, workgroup counts) of ``plan``, built once."""
    cached = plan.__dict__.get("_evaluate")
    if cached is None:
        shapes = [t.shape for t in plan.inputs + plan.outputs]
        flat = [s for shape in shapes for s in shape] + [w for d in plan.dispatches for w in d.workgroups]
        evaluate_flat = evaluator(flat)
        ranks = [len(shape) for shape in shapes]

        def cached(values):
            out = evaluate_flat(values)
            at, result = 0, []
            for rank in ranks:
                result.append(tuple(out[at:at + rank]))
                at += rank
            groups = [tuple(out[at + 3 * i: at + 3 * i + 3]) for i in range(len(plan.dispatches))]
            return result, groups

        plan.__dict__["_evaluate"] = cached
    return cached
