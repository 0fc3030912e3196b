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
from .decompositions import before_autograd_table, decomposition_table
from .dynamo_capture import compile_quieting_logging_if_refused
from .roles import Kind, Mode, Role


def _capture(owner, batch: tuple):
    """The loss as a straight-line fx graph (dynamo, fullgraph) and what feeds each of its placeholders: a
    ``Role`` (param, frozen, buffer or batch) or, for anything else dynamo lifted, the tensor."""
    model = owner.model
    roles_by_id = {id(p): Role.param(n) if p.requires_grad else Role.frozen(n) for n, p in model.named_parameters()}
    roles_by_id.update({id(b): Role.buffer(n) for n, b in model.named_buffers()})
    roles_by_id.update({id(t): Role.batch(i) for i, t in enumerate(batch) if isinstance(t, torch.Tensor)})
    captured = {}

    def grab(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        return gm.forward

    def call(*args):
        return owner.loss_fn(model, *args)

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


def trace_step(owner, batch: tuple, mode: Mode, decompose_all: bool = False):
    """fx graph of one functional step. Placeholders: trainable params, frozen params, buffers, optimizer state,
    gradient accumulators, hyperparameters, batch tensors, lifted constants. Outputs: the loss, then what ``mode``
    says (``roles.Mode``; ``trace_update`` traces ``Mode.UPDATE``). Returns (graph, placeholder roles, output roles,
    constants by role)."""
    params = dict(owner.model.named_parameters())
    buffers = dict(owner.model.named_buffers())
    captured, sources = _capture(owner, batch)
    tensors = [i for i, t in enumerate(batch) if isinstance(t, torch.Tensor)]
    extra = [src for src in sources if isinstance(src, torch.Tensor)]
    table = decomposition_table() if decompose_all else before_autograd_table()
    loss_graph = _decomposed(captured, sources, params, buffers, batch, table)
    step = _functional_step(owner, mode, loss_graph, sources, tensors, _unused_params(owner, captured, sources))
    gm = make_fx(functionalize(step, remove="mutations"), decomposition_table=decomposition_table(),
                 tracing_mode="fake")(*_step_example(owner, batch, tensors, extra))
    roles = _step_input_roles(owner, tensors, len(extra))
    constants = {Role.constant(f"extra{k}"): t.detach() for k, t in enumerate(extra)}
    constants.update(_lift_constants(gm, roles))
    outputs = _drop_unchanged_outputs(gm, roles, [Role.loss()] + _step_output_roles(owner, mode))
    return gm, roles, outputs, constants


def _unused_params(owner, captured: fx.GraphModule, sources: list) -> frozenset:
    """Indices of the trainable parameters that the loss does not read (eager leaves their ``.grad`` None)."""
    read = {src for src, ph in zip(sources, captured.graph.find_nodes(op="placeholder")) if ph.users}
    return frozenset(i for i, n in enumerate(owner._trainable) if Role.param(n) not in read)


def _functional_step(owner, mode: Mode, loss_graph, sources: list, tensors: list, unused: frozenset):
    """The step of ``mode`` as a function of tensors (``_step_example`` gives its arguments): gradients and loss by
    ``torch.func.grad_and_value``, then accumulation, clipping and the update; returns the outputs in the order of
    ``_step_output_roles``."""
    k = owner.accumulation_steps

    def step(train, frozen, bufs, state, acc, hyper, batch_tensors, extra_tensors):
        fixed = {**{Role.frozen(n): t for n, t in zip(owner._frozen, frozen)},
                 **{Role.batch(i): t for i, t in zip(tensors, batch_tensors)}}
        loss_of = _loss_function(owner, mode, loss_graph, sources, fixed, extra_tensors)
        bufs = [b.clone() for b in bufs]
        grads, (loss, bufs) = torch.func.grad_and_value(loss_of, has_aux=True)(list(train), bufs)
        if mode is Mode.ACCUMULATE:
            return loss, [a + g for a, g in zip(acc, grads)], bufs
        if mode in (Mode.APPLY, Mode.LOCAL) and k > 1:
            grads = [a + g for a, g in zip(acc, grads)]
        if mode is Mode.LOCAL:
            return loss, list(grads), bufs, [torch.zeros_like(a) for a in acc]
        if owner.max_grad_norm is not None:
            grads = optimizers.clip_by_global_norm(grads, owner.max_grad_norm)
        if mode is Mode.GRADS:
            return loss, list(grads)
        new_params, flat_state = _update(owner, train, grads, state, hyper, unused)
        if mode is Mode.APPLY:
            return loss, new_params, bufs, flat_state, [torch.zeros_like(a) for a in acc]
        return loss, new_params, bufs, flat_state

    return step


def _loss_function(owner, mode: Mode, loss_graph, sources: list, fixed: dict, extra_tensors: list):
    """``loss_of(params, buffers) -> (loss, buffers)``: the decomposed loss graph fed by role (``fixed`` holds the
    frozen parameters and batch tensors) and, for what dynamo lifted, by ``extra_tensors`` in order. Divided by
    ``accumulation_steps`` in the modes that accumulate gradients."""
    k = owner.accumulation_steps
    accumulating = k > 1 and mode in (Mode.ACCUMULATE, Mode.APPLY, Mode.LOCAL)

    def loss_of(ps, bs):
        # buffers are an argument (not captured) because the forward mutates them (BatchNorm statistics)
        values = {**fixed, **{Role.param(n): t for n, t in zip(owner._trainable, ps)},
                  **{Role.buffer(n): t for n, t in zip(owner._buffers, bs)}}
        extras = iter(extra_tensors)
        args = [next(extras) if isinstance(src, torch.Tensor) else values.get(src, src) for src in sources]
        loss = loss_graph(*args)
        return (loss / k if accumulating else loss), list(bs)

    return loss_of


def _step_example(owner, batch: tuple, tensors: list, extra: list) -> tuple:
    """Example arguments of ``_functional_step``'s step, for make_fx."""
    params = dict(owner.model.named_parameters())
    buffers = dict(owner.model.named_buffers())
    return ([params[n].detach() for n in owner._trainable], [params[n].detach() for n in owner._frozen],
            [buffers[n].detach() for n in owner._buffers],
            [torch.zeros_like(params[n]) for _ in owner._opts["slots"] for n in owner._trainable],
            [torch.zeros_like(params[n]) for n in owner._trainable] if owner.accumulation_steps > 1 else [],
            optimizers.hyperparameters(owner.optimizer, max(owner.steps, 1)), [batch[i] for i in tensors],
            [t.detach() for t in extra])


def _state_roles(owner) -> list[Role]:
    """The optimizer state tensors' roles, slot-major as ``_update`` flattens them."""
    return [Role.state(s, n) for s in owner._opts["slots"] for n in owner._trainable]


def _step_input_roles(owner, tensors: list, n_extra: int) -> list[Role]:
    """The roles of ``trace_step``'s placeholders, in ``_step_example``'s order (lifted constants are added after)."""
    accumulators = [Role.acc(n) for n in owner._trainable] if owner.accumulation_steps > 1 else []
    return ([Role.param(n) for n in owner._trainable] + [Role.frozen(n) for n in owner._frozen]
            + [Role.buffer(n) for n in owner._buffers] + _state_roles(owner) + accumulators + [Role.hyper()]
            + [Role.batch(i) for i in tensors] + [Role.constant(f"extra{k}") for k in range(n_extra)])


def _step_output_roles(owner, mode: Mode) -> list[Role]:
    """The roles of the outputs of ``mode``'s step after the loss, in the order ``_functional_step`` returns them."""
    grads = [Role.grad(n) for n in owner._trainable]
    buffers = [Role.buffer(n) for n in owner._buffers]
    accumulators = [Role.acc(n) for n in owner._trainable]
    updated = [Role.param(n) for n in owner._trainable] + buffers + _state_roles(owner)
    return {Mode.STEP: updated, Mode.APPLY: updated + accumulators, Mode.GRADS: grads,
            Mode.LOCAL: grads + buffers + (accumulators if owner.accumulation_steps > 1 else []),
            Mode.ACCUMULATE: accumulators + buffers}[mode]


def _update(owner, train: list, grads: list, state: list, hyper: torch.Tensor, unused=frozenset()):
    """The optimizer's update of every trainable parameter of ``owner`` (see ``optimizer_update``)."""
    return optimizer_update(owner._opts, owner._groups, train, grads, state, hyper, unused)


def optimizer_update(opts: dict, rows: list[int], train: list, grads: list, state: list, hyper: torch.Tensor,
                     unused=frozenset()):
    """An optimizer's update of parameters ``train``: (new params, new state flattened slot-major). Parameter ``i``
    takes its numbers from row ``rows[i]`` of ``hyper``. Those at the indices ``unused`` (the loss does not read
    them: eager leaves their ``.grad`` None) stay as they are, as torch's optimizers leave them (no weight decay, no
    momentum step)."""
    n_train, slots = len(train), opts["slots"]
    new_params, new_state = [], []
    fields = optimizers.group_fields(opts, hyper)
    for i, (p, g) in enumerate(zip(train, grads)):
        per_param = [state[s * n_train + i] for s in range(len(slots))]
        if i not in unused:
            p, per_param = optimizers.update(opts, p, g, per_param, fields[rows[i]])
        new_params.append(p)
        new_state.append(per_param)
    return new_params, [new_state[i][s] for s in range(len(slots)) for i in range(n_train)]


def trace_update_graph(opts: dict, rows: list[int], params: list, hyper: torch.Tensor, names: list[str],
                       max_grad_norm: float | None = None):
    """fx graph of an optimizer's update: (params, optimizer state slot-major, hyperparameters, gradients) -> (new
    params, new state), the gradients clipped by their global norm first if ``max_grad_norm``. ``params`` are
    example tensors (shapes and dtypes), named by ``names`` in the roles. Returns what ``trace_step`` does."""
    def update(train, state, hyper, grads):
        if max_grad_norm is not None:
            grads = optimizers.clip_by_global_norm(grads, max_grad_norm)
        return optimizer_update(opts, rows, train, grads, state, hyper)

    example = (params, [torch.zeros_like(p) for _ in opts["slots"] for p in params], hyper,
               [torch.zeros_like(p) for p in params])
    gm = make_fx(functionalize(update, remove="mutations"), decomposition_table=decomposition_table(),
                 tracing_mode="fake")(*example)
    trained = [Role.param(n) for n in names]
    states = [Role.state(s, n) for s in opts["slots"] for n in names]
    roles = trained + states + [Role.hyper()] + [Role.grad(n) for n in names]
    constants = _lift_constants(gm, roles)
    outputs = _drop_unchanged_outputs(gm, roles, trained + states)
    return gm, roles, outputs, constants


def trace_update(owner):
    """fx graph of the update of a data-parallel or a segmented step: (params, optimizer state, hyperparameters,
    gradients) -> (new params, new state), the gradients clipped first if ``max_grad_norm``. A segmented step's
    update reads a row of hyperparameters per parameter (``per_parameter_rows``): its parameters keep step counts of
    their own. Returns what ``trace_step`` does."""
    params = dict(owner.model.named_parameters())
    if owner._segmented is not None:
        rows, hyper = list(range(len(owner._trainable))), per_parameter_rows(owner)
    else:
        rows, hyper = owner._groups, optimizers.hyperparameters(owner.optimizer, max(owner.steps, 1))
    return trace_update_graph(owner._opts, rows, [params[n].detach() for n in owner._trainable], hyper,
                              owner._trainable, owner.max_grad_norm)


def per_parameter_rows(owner, steps: dict[str, int] | None = None) -> torch.Tensor:
    """Hyperparameters with a row per trainable parameter of ``owner``, at its next update: ``steps`` (name ->
    updates so far) or its first."""
    return optimizers.hyperparameter_rows(owner.optimizer, [(g, (steps[n] if steps else 0) + 1)
                                                            for g, n in zip(owner._groups, owner._trainable)])


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
