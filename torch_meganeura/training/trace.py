"""Tracing a training step into one fx graph: the loss captured by dynamo (fullgraph), re-traced through the
decompositions aot_autograd applies before differentiating, then differentiated and updated functionally
(``make_fx`` over ``torch.func.grad_and_value`` and the optimizer's update from ``optimizers``), with every
placeholder and output named by its ``Role`` (``roles``). ``train_step`` compiles the graphs these return.
"""
from __future__ import annotations

import types

import torch
from torch import fx
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx

from . import optimizers
from ..lower.decompositions import before_autograd_table, decomposition_table
from .dynamo_capture import compile_quieting_logging_if_refused
from .roles import Kind, Mode, Role
from .spec import StepSpec


def _capture(spec: StepSpec, batch: tuple):
    """The loss as a straight-line fx graph (dynamo, fullgraph) and what feeds each of its placeholders: a
    ``Role`` (param, frozen, buffer or batch) or, for anything else dynamo lifted, the tensor."""
    model = spec.model
    roles_by_id = {id(p): Role.param(n) if p.requires_grad else Role.frozen(n) for n, p in model.named_parameters()}
    roles_by_id.update({id(b): Role.buffer(n) for n, b in model.named_buffers()})
    roles_by_id.update({id(t): Role.batch(i) for i, t in enumerate(batch) if isinstance(t, torch.Tensor)})
    captured = {}

    def grab(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        return gm.forward

    def call(*args):
        return spec.loss_fn(model, *args)

    # dynamo caches compiled frames per code object and refuses (under fullgraph) past its recompile limit: a fresh
    # code object per capture keeps every TrainStep's capture independent of the ones before it
    call = types.FunctionType(call.__code__.replace(), call.__globals__, closure=call.__closure__)
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}  # the capture run updates BatchNorm stats
    try:
        compile_quieting_logging_if_refused(
            lambda: torch.compile(call, backend=grab, fullgraph=True, dynamic=False)(*batch))
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(saved[n])
    sources = [roles_by_id.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in captured["inputs"]]
    return captured["gm"], sources


def trace_step(spec: StepSpec, batch: tuple, mode: Mode, decompose_all: bool = False):
    """fx graph of one functional step. Placeholders: trainable params, frozen params, buffers, optimizer state,
    gradient accumulators, hyperparameters, batch tensors, lifted constants. Outputs: the loss, then what ``mode``
    says (``roles.Mode``; ``trace_update`` traces ``Mode.UPDATE``). Returns (graph, placeholder roles, output roles,
    constants by role)."""
    params = dict(spec.model.named_parameters())
    buffers = dict(spec.model.named_buffers())
    captured, sources = _capture(spec, batch)
    tensors = [i for i, t in enumerate(batch) if isinstance(t, torch.Tensor)]
    extra = [src for src in sources if isinstance(src, torch.Tensor)]
    table = decomposition_table() if decompose_all else before_autograd_table()
    loss_graph = _decomposed(captured, sources, params, buffers, batch, table)
    step = _functional_step(spec, mode, loss_graph, sources, tensors, _unused_params(spec, captured, sources))
    gm = make_fx(functionalize(step, remove="mutations"), decomposition_table=decomposition_table(),
                 tracing_mode="fake")(*_step_example(spec, batch, tensors, extra))
    roles = _step_input_roles(spec, tensors, len(extra))
    constants = {Role.constant(f"extra{k}"): t.detach() for k, t in enumerate(extra)}
    constants.update(_lift_constants(gm, roles))
    outputs = _drop_unchanged_outputs(gm, roles, [Role.loss()] + _step_output_roles(spec, mode))
    return gm, roles, outputs, constants


def _unused_params(spec: StepSpec, captured: fx.GraphModule, sources: list) -> frozenset:
    """Indices of the trainable parameters that the loss does not read (eager leaves their ``.grad`` None)."""
    read = {src for src, ph in zip(sources, captured.graph.find_nodes(op="placeholder")) if ph.users}
    return frozenset(i for i, n in enumerate(spec.trainable) if Role.param(n) not in read)


def _functional_step(spec: StepSpec, mode: Mode, loss_graph, sources: list, tensors: list, unused: frozenset):
    """The step of ``mode`` as a function of tensors (``_step_example`` gives its arguments): gradients and loss by
    ``torch.func.grad_and_value``, then accumulation, clipping and the update; returns the outputs in the order of
    ``_step_output_roles``."""
    k = spec.accumulation_steps

    def step(train, frozen, bufs, state, acc, hyper, batch_tensors, extra_tensors):
        fixed = {**{Role.frozen(n): t for n, t in zip(spec.frozen, frozen)},
                 **{Role.batch(i): t for i, t in zip(tensors, batch_tensors)}}
        loss_of = _loss_function(spec, mode, loss_graph, sources, fixed, extra_tensors)
        bufs = [b.clone() for b in bufs]
        grads, (loss, bufs) = torch.func.grad_and_value(loss_of, has_aux=True)(list(train), bufs)
        if mode is Mode.ACCUMULATE:
            return loss, [a + g for a, g in zip(acc, grads)], bufs
        if mode in (Mode.APPLY, Mode.LOCAL) and k > 1:
            grads = [a + g for a, g in zip(acc, grads)]
        if mode is Mode.LOCAL:
            return loss, list(grads), bufs, [torch.zeros_like(a) for a in acc]
        if spec.max_grad_norm is not None:
            grads = optimizers.clip_by_global_norm(grads, spec.max_grad_norm)
        if mode is Mode.GRADS:
            return loss, list(grads)
        new_params, flat_state = optimizer_update(spec.update, spec.groups, train, grads, state, hyper, unused)
        if mode is Mode.APPLY:
            return loss, new_params, bufs, flat_state, [torch.zeros_like(a) for a in acc]
        return loss, new_params, bufs, flat_state

    return step


def _loss_function(spec: StepSpec, mode: Mode, loss_graph, sources: list, fixed: dict, extra_tensors: list):
    """``loss_of(params, buffers) -> (loss, buffers)``: the decomposed loss graph fed by role (``fixed`` holds the
    frozen parameters and batch tensors) and, for what dynamo lifted, by ``extra_tensors`` in order. Divided by
    ``accumulation_steps`` in the modes that accumulate gradients."""
    k = spec.accumulation_steps
    accumulating = k > 1 and mode in (Mode.ACCUMULATE, Mode.APPLY, Mode.LOCAL)

    def loss_of(ps, bs):
        # buffers are an argument (not captured) because the forward mutates them (BatchNorm statistics)
        values = {**fixed, **{Role.param(n): t for n, t in zip(spec.trainable, ps)},
                  **{Role.buffer(n): t for n, t in zip(spec.buffers, bs)}}
        extras = iter(extra_tensors)
        args = [next(extras) if isinstance(src, torch.Tensor) else values.get(src, src) for src in sources]
        loss = loss_graph(*args)
        return (loss / k if accumulating else loss), list(bs)

    return loss_of


def _step_example(spec: StepSpec, batch: tuple, tensors: list, extra: list) -> tuple:
    """Example arguments of ``_functional_step``'s step, for make_fx (fake tensors: only shapes and dtypes count)."""
    params = dict(spec.model.named_parameters())
    buffers = dict(spec.model.named_buffers())
    return ([params[n].detach() for n in spec.trainable], [params[n].detach() for n in spec.frozen],
            [buffers[n].detach() for n in spec.buffers],
            [torch.zeros_like(params[n]) for _ in spec.update.slots for n in spec.trainable],
            [torch.zeros_like(params[n]) for n in spec.trainable] if spec.accumulation_steps > 1 else [],
            optimizers.hyperparameters(spec.optimizer, 1), [batch[i] for i in tensors],
            [t.detach() for t in extra])


def _state_roles(spec: StepSpec) -> list[Role]:
    """The optimizer state tensors' roles, slot-major as ``optimizer_update`` flattens them."""
    return [Role.state(s, n) for s in spec.update.slots for n in spec.trainable]


def _step_input_roles(spec: StepSpec, tensors: list, n_extra: int) -> list[Role]:
    """The roles of ``trace_step``'s placeholders, in ``_step_example``'s order (lifted constants are added after)."""
    accumulators = [Role.acc(n) for n in spec.trainable] if spec.accumulation_steps > 1 else []
    return ([Role.param(n) for n in spec.trainable] + [Role.frozen(n) for n in spec.frozen]
            + [Role.buffer(n) for n in spec.buffers] + _state_roles(spec) + accumulators + [Role.hyper()]
            + [Role.batch(i) for i in tensors] + [Role.constant(f"extra{k}") for k in range(n_extra)])


def _step_output_roles(spec: StepSpec, mode: Mode) -> list[Role]:
    """The roles of the outputs of ``mode``'s step after the loss, in the order ``_functional_step`` returns them."""
    grads = [Role.grad(n) for n in spec.trainable]
    buffers = [Role.buffer(n) for n in spec.buffers]
    accumulators = [Role.acc(n) for n in spec.trainable]
    updated = [Role.param(n) for n in spec.trainable] + buffers + _state_roles(spec)
    return {Mode.STEP: updated, Mode.APPLY: updated + accumulators, Mode.GRADS: grads,
            Mode.LOCAL: grads + buffers + (accumulators if spec.accumulation_steps > 1 else []),
            Mode.ACCUMULATE: accumulators + buffers}[mode]


def optimizer_update(spec: optimizers.OptimizerSpec, rows: list[int], train: list, grads: list, state: list,
                     hyper: torch.Tensor, unused=frozenset()):
    """An optimizer's update of parameters ``train``: (new params, new state flattened slot-major). Parameter ``i``
    takes its numbers from row ``rows[i]`` of ``hyper``. Those at the indices ``unused`` (the loss does not read
    them: eager leaves their ``.grad`` None) stay as they are, as torch's optimizers leave them (no weight decay, no
    momentum step)."""
    n_train, slots = len(train), spec.slots
    new_params, new_state = [], []
    fields = optimizers.group_fields(spec, hyper)
    for i, (p, g) in enumerate(zip(train, grads)):
        per_param = [state[s * n_train + i] for s in range(len(slots))]
        if i not in unused:
            p, per_param = optimizers.update(spec, p, g, per_param, fields[rows[i]])
        new_params.append(p)
        new_state.append(per_param)
    return new_params, [new_state[i][s] for s in range(len(slots)) for i in range(n_train)]


def trace_update(spec: optimizers.OptimizerSpec, rows: list[int], params: list, hyper: torch.Tensor,
                 names: list[str], max_grad_norm: float | None = None):
    """fx graph of an optimizer's update alone: (params, optimizer state slot-major, hyperparameters, gradients) ->
    (new params, new state), the gradients clipped by their global norm first if ``max_grad_norm``. Parameter ``i``
    reads row ``rows[i]`` of ``hyper`` (a param group's, or its own where parameters keep step counts of their own:
    ``per_parameter_rows``). ``params`` are example tensors (shapes and dtypes), named by ``names`` in the roles. The
    update of a data-parallel or segmented step, and of ``keep_on_device``'s ``opt.step()``. Returns what
    ``trace_step`` does."""
    def update(train, state, hyper, grads):
        if max_grad_norm is not None:
            grads = optimizers.clip_by_global_norm(grads, max_grad_norm)
        return optimizer_update(spec, rows, train, grads, state, hyper)

    example = (params, [torch.zeros_like(p) for _ in spec.slots for p in params], hyper,
               [torch.zeros_like(p) for p in params])
    gm = make_fx(functionalize(update, remove="mutations"), decomposition_table=decomposition_table(),
                 tracing_mode="fake")(*example)
    trained = [Role.param(n) for n in names]
    states = [Role.state(s, n) for s in spec.slots for n in names]
    roles = trained + states + [Role.hyper()] + [Role.grad(n) for n in names]
    constants = _lift_constants(gm, roles)
    outputs = _drop_unchanged_outputs(gm, roles, trained + states)
    return gm, roles, outputs, constants


def per_parameter_rows(spec: StepSpec, steps: dict[str, int] | None = None) -> torch.Tensor:
    """Hyperparameters with a row per trainable parameter, at its next update: ``steps`` (name -> updates so far)
    or its first."""
    return optimizers.hyperparameter_rows(spec.optimizer, [(g, (steps[n] if steps else 0) + 1)
                                                           for g, n in zip(spec.groups, spec.trainable)])


def _decomposed(captured: fx.GraphModule, sources: list, params: dict, buffers: dict, batch: tuple, table: dict):
    """The captured loss graph re-traced through ``table`` before it is differentiated: the decompositions
    aot_autograd applies before differentiating (``before_autograd_table``; upsample's backward formula has no
    decomposition, its decomposition's does), or, where some backward formula has no lowering, all of them."""
    def value(src):
        if isinstance(src, torch.Tensor):
            return src.detach()
        if not isinstance(src, Role):
            return src
        if src.kind is Kind.PARAM:  # traced as differentiated (embedding_bag keeps what its backward needs)
            return params[src.name].detach().requires_grad_()
        if src.kind is Kind.FROZEN:
            return params[src.name].detach()
        if src.kind is Kind.BUFFER:
            return buffers[src.name].detach().clone()
        if src.kind is Kind.BATCH:
            return batch[src.index]
        return src

    def loss(*args):
        out = captured(*args)
        return out[0] if isinstance(out, (tuple, list)) else out

    return make_fx(loss, decomposition_table=table, tracing_mode="fake")(*map(value, sources))


def _lift_constants(gm: fx.GraphModule, roles: list) -> dict:
    """Turn tensor constants (get_attr) into trailing placeholders; returns their values by role."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    constants = {}
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        value = getattr(gm, node.target)
        role = Role.constant(node.target)
        with gm.graph.inserting_after(placeholders[-1]):
            ph = gm.graph.placeholder(node.target.replace(".", "_") + "_lifted")
        placeholders.append(ph)
        node.replace_all_uses_with(ph)
        gm.graph.erase_node(node)
        roles.append(role)
        constants[role] = value
    _drop_input_copies(gm)
    gm.recompile()
    return constants


def _drop_input_copies(gm: fx.GraphModule) -> None:
    """Remove the copy_ writes that functionalization leaves: into an input at the end (the step returns those
    values), or into an intermediate when nothing reads the destination afterwards (the copy's result is the
    source, cast and expanded to the destination)."""
    aten = torch.ops.aten
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy_.default:
            continue
        dst, src = node.args[0], node.args[1]
        if dst.op == "placeholder" and not node.users:
            gm.graph.erase_node(node)
            continue
        if any(order[u] > order[node] for u in dst.users if u is not node):
            raise NotImplementedError(f"compile_train_step: {dst.name} is read after an in-place copy into it")
        want, have = dst.meta["val"], src.meta["val"]
        with gm.graph.inserting_before(node):
            value = src
            if have.dtype != want.dtype:
                value = gm.graph.call_function(aten._to_copy.default, (value,), {"dtype": want.dtype})
            if tuple(have.shape) != tuple(want.shape):
                value = gm.graph.call_function(aten.expand.default, (value, list(want.shape)))
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)


def _drop_unchanged_outputs(gm: fx.GraphModule, roles: list, outputs: list) -> list:
    """Outputs that are their own input (a buffer the forward does not change) stay as they are on the device."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(out.args[0])  # make_fx returns the step's outputs flattened, in ``outputs`` order
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    role_of = {ph: roles[i] for i, ph in enumerate(placeholders)}
    kept = [(node, name) for node, name in zip(flat, outputs) if role_of.get(node) != name]
    out.args = (tuple(node for node, _ in kept),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return [name for _, name in kept]
