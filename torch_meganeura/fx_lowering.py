"""Lower one static-shape fx graph of aten ops into the torch-free IR, node by node, via the registry.

Shapes come from the concrete inputs of the call being compiled (dynamic graphs are specialised here);
dtypes come from the traced metadata. Every lowered value is checked against the traced shape where that
shape is static, so a wrong lowering fails loudly instead of computing garbage.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from meganeura.lowering.builder import GraphBuilder
from meganeura.lowering.ir import Graph, Value

from . import aten  # noqa: F401  (fills the registry)
from .registry import LOWERINGS, LowerCtx, LoweringError, logical_dtype


@dataclass
class LoweredGraph:
    graph: Graph
    inputs: list[tuple[int, str]]  # (placeholder index, plan input name)
    params: list[tuple[int, str]]  # (placeholder index, plan param name)
    outputs: list[tuple[str, object]]  # ("plan", output name) | ("const", python value)
    ops: dict[str, int]  # aten op -> count
    returns_tuple: bool  # the fx graph returns a tuple/list (else a single value)
    rng_seed: str | None = None  # the plan input random ops draw from (two int32 per run), if any


def lower_graph(gm: fx.GraphModule, args: list, param_indices: set[int]) -> LoweredGraph:
    b = GraphBuilder()
    env: dict[fx.Node, object] = {}
    inputs, params, ops = [], [], {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, (node, arg) in enumerate(zip(placeholders, args)):
        if isinstance(arg, torch.Tensor):
            role = "param" if i in param_indices else "input"
            name = f"arg{i}"
            env[node] = b.input(name, tuple(arg.shape), logical_dtype(arg.dtype), role)
            (params if role == "param" else inputs).append((i, name))
        else:
            env[node] = arg
    result = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            result = node.args[0]
            break
        if node.op != "call_function":
            raise LoweringError(f"cannot lower fx node {node.op} {node.target}")
        args_ = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs_ = fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.target is operator.getitem:
            env[node] = args_[0][args_[1]]
            continue
        fn = LOWERINGS.get(node.target)
        if fn is None:
            raise LoweringError(f"no lowering for {node.target}")
        value = fn(LowerCtx(b, node), *args_, **kwargs_)
        _check_shapes(node, value)
        env[node] = value
        ops[str(node.target)] = ops.get(str(node.target), 0) + 1

    outputs = []
    flat = fx.node.map_arg(result, lambda n: env[n])
    flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    for item in flat:
        if isinstance(item, Value):
            b.output(item)
            index = len(b.graph.outputs) - 1
            first = next(i for i, v in enumerate(b.graph.outputs) if v.id == b.graph.outputs[index].id)
            outputs.append(("plan", f"out{first}"))
        else:
            outputs.append(("const", item))
    return LoweredGraph(b.graph, inputs, params, outputs, ops, isinstance(result, (tuple, list)), b.rng_seed)


def _check_shapes(node: fx.Node, value) -> None:
    val = node.meta.get("val")
    pairs = zip(value, val) if isinstance(value, (tuple, list)) and isinstance(val, (tuple, list)) else [(value, val)]
    for got, want in pairs:
        if not isinstance(got, Value) or not isinstance(want, torch.Tensor):
            continue
        shape = tuple(want.shape)
        if all(isinstance(s, int) for s in shape) and shape != got.shape:
            raise LoweringError(f"lowering of {node.target} produced shape {got.shape}, torch says {shape}")
        if logical_dtype(want.dtype) != got.dtype:
            raise LoweringError(f"lowering of {node.target} produced dtype {got.dtype}, torch says {want.dtype}")
