"""Split an aten graph into device partitions and eager fallback ops.

``unsupported_reason(node)`` says why a node cannot run on the device (no lowering, a dtype the device
does not compute, a constant outside int32, a case its lowering refuses). torch's
``CapabilityBasedPartitioner`` groups the supported nodes into submodules, which become
``DevicePartition``s; everything else stays in the parent graph and runs in eager PyTorch.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from .registry import INT32_RANGE, LOWERINGS, SUPPORT_CHECKS, TORCH_TO_LOGICAL


CLAMPED_INT_ARGS = {torch.ops.aten.slice.Tensor, torch.ops.aten.slice_scatter.default}  # int args clamped to the size


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from _tensors(item)


def is_tensor_op(node: fx.Node) -> bool:
    """Ops that compute tensors (as opposed to the symbolic shape arithmetic of dynamic graphs)."""
    return node.op == "call_function" and any(True for _ in _tensors(node.meta.get("val")))


def unsupported_reason(node: fx.Node) -> str | None:
    if node.target is operator.getitem:
        return unsupported_reason(node.args[0])
    if node.target not in LOWERINGS:
        return "no lowering"
    for t in list(_tensors(node.meta.get("val"))) + [
        a.meta.get("val") for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)
    ]:
        if t.dtype not in TORCH_TO_LOGICAL:
            return f"dtype {t.dtype} is not computed on the device"
        if t.device.type != "cpu":
            return f"tensor on {t.device} (the backend takes CPU tensors)"
    for a in [] if node.target in CLAMPED_INT_ARGS else list(node.args) + list(node.kwargs.values()):
        for x in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(x, int) and not isinstance(x, bool) and not INT32_RANGE[0] <= x <= INT32_RANGE[1]:
                return f"integer argument {x} is outside int32"
    check = SUPPORT_CHECKS.get(node.target)
    return check(node) if check is not None else None


def _is_view(node: fx.Node) -> bool:
    """An op whose result is a view of its first argument (its schema says the return aliases it, unwritten)."""
    schema = getattr(node.target, "_schema", None)
    if node.target is operator.getitem:
        return _is_view(node.args[0])
    return (node.op == "call_function" and schema is not None and bool(schema.returns)
            and schema.returns[0].alias_info is not None and not schema.returns[0].alias_info.is_write)


def views_of_inputs(gm: fx.GraphModule, outputs: int | None = None) -> set[fx.Node]:
    """The nodes of the chains of views from a graph input to one of the first ``outputs`` graph outputs (all if
    None): the outputs that aot_autograd gives the user. They stay in eager PyTorch, where they cost nothing:
    aot_autograd regenerates a user output that aliases an input from that input and the output's strides and
    offset, and a device partition returns contiguous copies (a transpose of an input came back with the strides of
    a contiguous tensor, and wrong values, in a graph with dynamic sizes)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    chains = set()
    for node in [n for n in list(returned)[:outputs] if isinstance(n, fx.Node)]:
        chain = []
        while node.op == "call_function" and _is_view(node):
            chain.append(node)
            node = node.args[0]
        if node.op == "placeholder":
            chains.update(chain)
    return chains


class _Support(OperatorSupportBase):
    def __init__(self, kept_in_eager: set[fx.Node] = frozenset()):
        super().__init__()
        self.kept_in_eager = kept_in_eager

    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return node.op == "call_function" and node not in self.kept_in_eager and unsupported_reason(node) is None


def fallback_ops(gm: fx.GraphModule) -> dict[str, str]:
    """Tensor ops of ``gm`` that will run in eager PyTorch -> the reason."""
    out = {}
    for node in gm.graph.nodes:
        if is_tensor_op(node) and node.target is not operator.getitem:
            reason = unsupported_reason(node)
            if reason is not None:
                out[str(node.target)] = reason
    return out


def partition(gm: fx.GraphModule, user_outputs: int | None = None) -> tuple[fx.GraphModule, list[str]]:
    """Return the graph with supported regions fused into submodules, and their names. The first ``user_outputs``
    outputs (all if None) are what the user gets (``views_of_inputs``).

    Where every op is supported (the common case) the whole graph is one partition, fused without the partitioner's
    proposal, whose cost grows with the square of the graph (2.0 s of SmolLM2's 2,791-node inference graph on a CI
    CPU)."""
    support = _Support(views_of_inputs(gm, user_outputs))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    if calls and all(support.is_node_supported({}, n) for n in calls):
        parts = [dict.fromkeys(calls)]
    else:
        partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
        parts = [p.nodes for p in partitioner.propose_partitions()]
    parts = [p for p in parts if any(is_tensor_op(n) for n in p)]
    if not parts:
        return gm, []
    fused = fuse_by_partitions(gm, parts)
    names = [n.target for n in fused.graph.nodes if n.op == "call_module"]
    return fused, names
