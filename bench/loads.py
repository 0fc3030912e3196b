"""``python -m bench.loads``: the memory loads a generated matmul kernel makes per operand element, read from its WGSL.

    python -m bench.loads                                  # decode's gemv 1x576x1536 and a 128x576x1536 matmul
    python -m bench.loads --shapes 1x1536x576 --dtypes bfloat16 --show

Each shape ``MxKxN`` is ``F.linear(x, w)`` with x of (M, K) and w of (N, K) (a projection, as in a transformer),
both in the dtype, lowered and compiled as the backend compiles it (untuned), and the tiled shapes (M > 1) also with
quad staging forced (``--quads``: a variant the tuner may pick). For each operand loader the kernel's main function
calls (``load_a``, ``load_a4``, ``load_b8``...), the count is taken from the text: the storage reads of the loader
(through the loaders it calls), and the elements one call yields (1, 4 or 8: the name's suffix). The table gives, per
operand, loads per element over every call in ``main`` (the K loop's fetches) and the bytes of elements used per
load (a 32-bit read of a word of two halves, for one of them, uses 2 of its 4 bytes). Static counts
of the source, not a trace: a loop's body counts once, which suffices for the ratio (every load of an operand lies
in the K loop). Needs only the device's limits (lavapipe will do).
"""
from __future__ import annotations

import argparse
import dataclasses
import re

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FUNCTION = re.compile(r"^fn (\w+)\(", re.M)
_LOADER = re.compile(r"\b(load_[ab]\w*)\(")
_BINDING = re.compile(r"var<storage, read_write> (\w+):")


def _bodies(source: str) -> dict[str, str]:
    """Function name -> its text up to the next function (module-scope declarations between them do no reads)."""
    starts = [(m.group(1), m.start()) for m in _FUNCTION.finditer(source)]
    ends = [s for _, s in starts[1:]] + [len(source)]
    return {name: source[start:end] for (name, start), end in zip(starts, ends)}


def _elements(loader: str) -> int:
    """Elements one call of a loader yields: ``load_b8`` and ``load_b1_8`` 8, ``load_a4`` 4, ``load_a`` and a
    further product's ``load_b1`` 1."""
    if re.fullmatch(r"load_[ab](\d+_)?8", loader):
        return 8
    return 4 if re.fullmatch(r"load_[ab]4", loader) else 1


def _reads(name: str, bodies: dict[str, str], bindings: list[str], memo: dict) -> int:
    """Storage reads of one call of function ``name``: indexed reads of its bindings (not the left side of a store),
    and those of the loaders it calls."""
    if name not in memo:
        body = bodies[name].split("{", 1)[1]
        count = 0
        for b in bindings:
            for m in re.finditer(rf"\b{b}\[", body):
                tail = body[m.end():].split(";", 1)[0]
                store = re.match(r"[^\]]*\]\s*=[^=]", tail)  # `b2[...] = value` writes
                count += 0 if store else 1
        count += sum(_reads(callee, bodies, bindings, memo) for callee in _LOADER.findall(body) if callee in bodies)
        memo[name] = count
    return memo[name]


@dataclasses.dataclass
class OperandLoads:
    operand: str  # "a" (x) or "b" (the weights)
    calls: dict  # loader -> call sites in main
    loads: int  # storage reads of those calls
    elements: int  # elements they yield

    def per_element(self) -> float:
        return self.loads / self.elements


def count_loads(source: str) -> list[OperandLoads]:
    """Per operand, the loader calls in ``main`` of a matmul kernel's WGSL and the storage reads they make."""
    bodies = _bodies(source)
    bindings = _BINDING.findall(source)
    memo: dict = {}
    result = []
    main = bodies["main"]
    for operand in ("a", "b"):
        calls: dict = {}
        for loader in _LOADER.findall(main):
            if loader[len("load_")] == operand:
                calls[loader] = calls.get(loader, 0) + 1
        if calls:
            loads = sum(n * _reads(f, bodies, bindings, memo) for f, n in calls.items())
            elements = sum(n * _elements(f) for f, n in calls.items())
            result.append(OperandLoads(operand, calls, loads, elements))
    return result


def matmul_sources(m: int, k: int, n: int, dtype: str, quads: bool) -> list[tuple[str, str]]:
    """(label, WGSL) of each matmul dispatch of ``F.linear`` at (m, k) x (n, k)^T in ``dtype``, compiled as the
    backend compiles it for this device (untuned), with quad staging forced where ``quads``."""
    import torch
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    from meganeura.kernels import matmul_plans
    from meganeura.lowering import compile_graph
    from meganeura.runtime.device import get_device
    from torch_meganeura.lower.fx_lowering import lower_graph

    args = (torch.randn(m, k).to(getattr(torch, dtype)), torch.randn(n, k).to(getattr(torch, dtype)))
    lowered = lower_graph(make_fx(F.linear)(*args), list(args), {0, 1})
    chosen = matmul_plans.default_choice
    if quads:
        matmul_plans.default_choice = lambda *a, **kw: dataclasses.replace(chosen(*a, **kw), quads=True)
    try:
        plan, _ = compile_graph(lowered.graph, get_device().limits)  # (uncached: the choice differs)
    finally:
        matmul_plans.default_choice = chosen
    return [(d.label, plan.kernels[d.kernel]) for d in plan.dispatches if d.label.startswith("matmul")]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.loads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x576x1536,128x576x1536", help="comma-separated MxKxN")
    p.add_argument("--dtypes", default="float32,bfloat16,float16", help="comma-separated")
    p.add_argument("--show", action="store_true", help="print each kernel's WGSL too")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    print(f"{'kernel':34s} {'dtype':9s} {'operand':7s} {'loader calls in main':34s} {'loads/element':>13s} "
          f"{'used bytes/load':>15s}")
    for shape in filter(None, args.shapes.split(",")):
        m, k, n = (int(x) for x in shape.split("x"))
        for dtype in filter(None, args.dtypes.split(",")):
            for quads in (False, True) if m > 1 else (False,):
                for label, source in matmul_sources(m, k, n, dtype, quads):
                    if args.show:
                        print(source)
                    name = label + (" (quads)" if quads else "")
                    for op in count_loads(source):
                        calls = ", ".join(f"{f} x{c}" for f, c in op.calls.items())
                        per_load = ELEMENT_BYTES[dtype] * op.elements / op.loads
                        print(f"{name:34s} {dtype:9s} {op.operand:7s} {calls:34s} {op.per_element():13.3f} "
                              f"{per_load:15.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
