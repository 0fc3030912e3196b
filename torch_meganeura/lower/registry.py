"""The lowering registry: aten overload -> a small function that adds IR nodes for that op.

A lowering is registered with ``@lowering(aten.op.overload, ...)`` and called as ``fn(ctx, *args, **kwargs)``:
fx nodes among the arguments arrive as lowered ``Value``s (or Python ints for shape inputs), everything
else as in the aten call. It returns a Value, or a tuple/list of Values for multi-output ops.

``supports=`` names an optional predicate ``(node) -> str | None`` returning why a particular call cannot
be lowered (None when it can); the partitioner sends such calls to the eager fallback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from meganeura.lowering.builder import GraphBuilder

LOWERINGS: dict = {}
SUPPORT_CHECKS: dict = {}

TORCH_TO_LOGICAL = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                    torch.int64: "int64", torch.int32: "int32", torch.bool: "bool"}
DEVICE_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # all computed in f32 on the device
INT32_RANGE = (-(2**31), 2**31 - 1)


class LoweringError(NotImplementedError):
    """A lowering met a case it does not handle; the partition falls back to eager PyTorch."""


def lowering(*ops, supports: Callable | None = None):
    def register(fn):
        for op in ops:
            if op in LOWERINGS:
                raise ValueError(f"{op} is registered twice")
            LOWERINGS[op] = fn
            if supports is not None:
                SUPPORT_CHECKS[op] = supports
        return fn

    return register


def tensor_inputs(node: torch.fx.Node) -> list:
    """The values of ``node``'s tensor operands. A graph dynamo traced with symbolic sizes also passes SymInt
    arguments (a convolution's stride, once automatic dynamic saw two), which support checks must not read as
    tensors."""
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    return [v for v in vals if isinstance(v, torch.Tensor)]


def logical_dtype(dtype: torch.dtype) -> str:
    if dtype not in TORCH_TO_LOGICAL:
        raise LoweringError(f"dtype {dtype} is not supported on the device")
    return TORCH_TO_LOGICAL[dtype]


@dataclass
class LowerCtx:
    """What a lowering sees besides its arguments: the builder and the fx node being lowered."""

    builder: GraphBuilder
    node: torch.fx.Node

    @property
    def b(self) -> GraphBuilder:
        return self.builder

    @property
    def val(self):
        return self.node.meta.get("val")

    @property
    def out_dtype(self) -> str:
        """Logical dtype of the (first) output, from the traced metadata."""
        val = self.val
        if isinstance(val, (tuple, list)):
            val = val[0]
        return logical_dtype(val.dtype)

    def out_dtypes(self) -> list[str]:
        val = self.val
        vals = val if isinstance(val, (tuple, list)) else [val]
        return [logical_dtype(v.dtype) for v in vals]
