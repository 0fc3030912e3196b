"""Lower one static-shape fx graph of aten ops into the torch-free IR, node by node, via the registry.

Shapes come from the inputs of the call being compiled: concrete, or ``Size``s over a dynamic graph's symbols
(``symbolic``); dtypes come from the traced metadata. Every lowered value is checked against the traced shape where that
shape is static, so a wrong lowering fails loudly instead of computing garbage.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from meganeura.kernels import sizes as S
from meganeura.lowering.builder import GraphBuilder
from meganeura.lowering import expr as E
from meganeura.lowering.ir import FLOAT_DTYPES, Graph, Value

from . import aten  # noqa: F401  (fills the registry)
from .registry import LOWERINGS, LowerCtx, LoweringError, logical_dtype
from .symbolic import SymbolicExample


# The arithmetic of sizes in a graph with symbolic shapes, on the lowered values (ints, or ``Size``s).
SIZE_ARITHMETIC = {
    torch.ops.aten.sym_size.int: lambda x, dim: x.shape[dim],
    torch.ops.aten.sym_numel.default: lambda x: x.numel,
    operator.add: operator.add, operator.sub: operator.sub, operator.mul: operator.mul, operator.neg: operator.neg,
    operator.floordiv: S.floordiv, operator.mod: S.mod, torch.sym_max: S.size_max, torch.sym_min: S.size_min,
}


@dataclass
class LoweredGraph:
    # The IR, until the plan is compiled from it (``backend.device_graph``), then None: its expressions, values and
    # nodes were the bulk of a compiled model's Python objects (ResNet-50's training graphs: 49,000 expressions), and
    # every full garbage collection of a long-lived process walks what it keeps.
    graph: Graph | None
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
        if isinstance(arg, (torch.Tensor, SymbolicExample)):
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
        if node.target in SIZE_ARITHMETIC:  # a dynamic graph's size computations (an exported program keeps them)
            env[node] = SIZE_ARITHMETIC[node.target](*args_, **kwargs_)
            continue
        fn = LOWERINGS.get(node.target)
        if fn is None:
            raise LoweringError(f"no lowering for {node.target}")
        env[node] = _checked(b, node, fn(LowerCtx(b, node), *args_, **kwargs_))
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


def _checked(b: GraphBuilder, node: fx.Node, value):
    """``value`` checked against the traced shapes and dtypes; a float value of another float dtype than torch's is
    relabelled (lowerings of norms, attention and reductions compute and label their results in float32 whatever
    the graph's float dtype: an intermediate of a half precision graph stays in f32, see ``runtime.dtypes``)."""
    val = node.meta.get("val")
    many = isinstance(value, (tuple, list)) and isinstance(val, (tuple, list))
    pairs = list(zip(value, val)) if many else [(value, val)]
    checked = [_checked_one(b, node, got, want) for got, want in pairs]
    return type(value)(checked) if many else checked[0]


def _checked_one(b: GraphBuilder, node: fx.Node, got, want):
    if not isinstance(got, Value) or not isinstance(want, torch.Tensor):
        return got
    shape = tuple(want.shape)
    if all(isinstance(s, int) for s in shape) and shape != got.shape:
        raise LoweringError(f"lowering of {node.target} produced shape {got.shape}, torch says {shape}")
    dtype = logical_dtype(want.dtype)
    if dtype == got.dtype:
        return got
    if dtype in FLOAT_DTYPES and got.dtype in FLOAT_DTYPES:
        return b.pointwise(got.shape, dtype, b.load(got, [E.coord(d) for d in range(len(got.shape))]), "relabel")
    raise LoweringError(f"lowering of {node.target} produced dtype {got.dtype}, torch says {want.dtype}")
