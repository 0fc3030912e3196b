"""A device partition: an fx graph of supported aten ops that runs as one plan per input signature.

At a call with a signature (input shapes, dtypes, kinds and Python scalars) not seen before, the graph is
lowered with those concrete shapes, fused, planned and instantiated on the device; later calls with the same
signature only upload inputs (and changed parameters), replay the plan and read outputs back, except an inference
call's outputs at positions that eager code did not read after the call before, which stay on the device
(``DevicePartition``). A call first checks the entry the last call ran (its parameters by identity, version and
storage, the other arguments by signature), which spares building the signature of hundreds of parameters at every
call.

Parameters (the forward's static inputs, and ``nn.Parameter`` arguments in any graph) are bound from the
``ParamStore``. Outputs at the positions in ``resident_outputs`` (activations saved for the backward) stay on
the device, as ``ResidentTensor``s or, in a training forward, one ``SavedPack`` of their arrays (``backend.packed``),
and ResidentTensor and ``DeviceArray`` arguments are bound without an upload. A backward's
gradients of parameters that an optimizer keeps on the device (``device_optimizer``) stay there too.

An entry, and the check that a call replays it as bound, is a ``bound_plan.BoundPlan``; this module selects, builds
and runs entries and puts a run's outputs together.
"""
from __future__ import annotations

import logging
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meganeura.runtime.resident import DeviceArray

from .bound_plan import BoundPlan, SteadyUpdates
from .signatures import SHARED_GRAPHS, arg_kind, graph_key, signature
from .device_graph import DeviceGraph, compile_device_graph, feed, program_for, rescheduled
from ..tensors.device_tensor import (DeviceParameter, DeviceTensor, adopt, device_input, host_alias, lazy_output,
                                     lazy_outputs, read_back_output, read_now, spare_array)
from ..lower.fx_lowering import LoweredGraph
from ..tensors.params import tensor_from_host
from ..tensors.read_ahead import ReadAhead
from ..tensors.resident import ResidentTensor
from ..tensors.saved_pack import SavedPack
from ..lower.symbolic import DynamicSizes, output_dims_that_vary
from ..lower.tuning import tuning_enabled

log = logging.getLogger("torch_meganeura")

@dataclass
class PlanRecord:
    """What explain() reports about one compiled signature."""

    signature: tuple
    ops: dict
    dispatches: int
    kernels: int
    fused_producers: int
    arena_bytes: int
    unplanned_bytes: int
    compile_seconds: float
    fusion_refusals: list = field(default_factory=list)
    from_cache: bool = False  # the plan came from the persistent plan cache (meganeura.lowering.plan_cache)
    dynamic: tuple = ()  # a dynamic graph's symbolic sizes, each as "placeholder[dim] <= bound"
    guards: int = 0  # the decisions its plan took from the sizes it was compiled at


_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


class DevicePartition(torch.nn.Module):
    """Runs ``gm`` on the device; stands in for the fused submodule the partitioner made."""

    def __init__(self, gm: fx.GraphModule, param_indices: set[int], context, resident_outputs=frozenset(),
                 fast: bool = False, kept_gradients=frozenset(), kept=None, lazy_outputs=frozenset(),
                 mutated=None, lazy_from_first: bool = False, pack_saved: bool = False):
        super().__init__()
        self.fast = fast  # precision "fast" in a forward graph: matmuls may form products in f16
        self.gm = gm
        self.param_indices = set(param_indices)
        self.resident_outputs = frozenset(resident_outputs)
        # A training forward's saved activations cross autograd as one ``SavedPack`` at all their positions, which
        # the backward unpacks (``backend.packed``): here their positions, in the pack's order
        self.packed_positions = sorted(self.resident_outputs) if pack_saved else []
        self.pack_origin = object()  # what its packs carry (``SavedPack.origin``)
        # A backward's outputs that are gradients of parameters: resident too while ``kept.kept`` says that the
        # forward's parameters are kept on the device (``device_optimizer``)
        self.kept_gradients, self._kept = frozenset(kept_gradients), kept
        # An inference graph's outputs that it returns as they are (``lazy_outputs``) are read back by the run at the
        # first call and after a call whose output at that position eager code read (``_read``, since the last call),
        # each into a tensor that reports its first read. After a call whose output nobody read, that position stays
        # on the device until eager code reads it (``device_tensor``): a call that reads nothing returns once its run
        # is submitted. Outputs that came back as an input of a compiled call (``_returned``: a KV cache that Python
        # only hands back) are consumed; the others are watched (``_unread``): one still unread and alive two calls
        # later (outputs kept in a list) is read back then, so that the device memory unread outputs hold is bounded.
        self.lazy_outputs, self._returned = frozenset(lazy_outputs), frozenset()
        self._read = frozenset() if lazy_from_first else self.lazy_outputs
        self._unread: dict[int, tuple] = {}  # position -> weak references to its last two lazy outputs
        # A training forward's user outputs (the loss, the logits) stay on the device at every call, until eager code
        # reads them: a step that reads nothing (no ``loss.item()``) waits for nothing, one that reads the loss once.
        self.lazy_from_first = lazy_from_first
        # Outputs that are new values of the graph's arguments (output position -> argument index: a static KV
        # cache's update, BatchNorm's statistics in training): kept on the device, which the argument then stands for
        # (``device_tensor.adopt``); aot_autograd's copy of the new value into the argument is then a no-op.
        self.mutated = dict(mutated or {})
        self.context = context  # the backend's shared state: device, parameter store, records
        self.dynamic = DynamicSizes.of(gm)  # a graph dynamo traced with symbolic sizes: its symbols, else None
        self._plans: dict[tuple, list[BoundPlan] | None] = {}  # by variant and signature; None: falls back
        self._code = gm.code  # with the signature, what selects a compiled graph (``SharedGraphs``)
        self._last: BoundPlan | None = None  # the entry the last call ran: the next call checks it first
        self._readers: dict[int, object] = {}  # by output position (``_reader``)
        self._unfixed: dict[int, list[int]] = {}  # by argument count (``_unfixed_positions``)
        self._varying: list[tuple[int, ...]] | None = None  # by output position (``varying_dims``)

    def forward(self, *args):
        entry = self._last
        _note_returned(args, self._unfixed_positions(len(args)))
        read = self._read
        lazy = self.lazy_outputs if self.lazy_from_first else self.lazy_outputs - read
        variant = (self._keeps_gradients(), lazy)
        sizes = self.dynamic.values(args) if self.dynamic is not None else ()
        if entry is None or entry.variant != variant or not entry.replays(args, sizes):
            entry = self._entry_for(args, variant)
            if entry is None:
                return self.gm(*map(_eager_value, args))
        self._read = frozenset()  # (what eager code reads of this call's outputs; a call that raises resets nothing)
        try:
            return self._run(entry, args, sizes, read)
        except BaseException:
            self._read |= read
            raise

    def _unfixed_positions(self, count: int) -> list[int]:
        """The argument positions that are not the graph's parameters and buffers (its static inputs) nor the
        arguments it updates (checked before a run that adopts them one by one: ``_run``): where an output of a
        call may come back (``_note_returned``). Classified once per argument count, not per call: a decode step's
        graph takes every parameter (272 in SmolLM2-135M) at every call, a ResNet-50 training forward 159 BatchNorm
        statistics."""
        found = self._unfixed.get(count)
        if found is None:
            fixed = self.param_indices | set(self.mutated.values())
            found = self._unfixed[count] = [i for i in range(count) if i not in fixed]
        return found

    def _signature(self, args) -> tuple:
        """``signature(args)``, an argument updated in place seen as the tensor it was before its first update (a
        ``DeviceTensor`` since): the program binds it from the device either way."""
        key = signature(args)
        if not self.mutated:
            return key
        updated = set(self.mutated.values())
        return tuple((*item[:-1], "tensor") if i in updated and item[-1:] == ("resident",) else item
                     for i, item in enumerate(key))

    def _keeps_gradients(self) -> bool:
        return bool(self.kept_gradients) and self._kept.kept

    def _entry_for(self, args, variant: tuple) -> BoundPlan | None:
        """The compiled entry for the signature of ``args`` and ``variant`` (compiled now if new, or its device was
        lost), with its parameters bound; None where the partition falls back to eager PyTorch. A dynamic graph's
        signature leaves its symbolic sizes out, and the entry is the first whose guards its sizes meet."""
        key = self._signature(args)
        values = None
        if self.dynamic is not None:
            key, values = self.dynamic.abstract(key), self.dynamic.values(args)
        entries = self._plans.setdefault((variant, key), [])
        if entries is None:
            return None
        entry = next((e for e in entries if e.graph.holds(values) and not e.program.device.lost), None)
        if entry is None:
            entry = self._compile_or_fall_back(key, args, variant, values)  # (again after a loss)
            if entry is None:
                self._plans[variant, key] = None
                return None
            entries[:] = [e for e in entries if not e.program.device.lost] + [entry]
        self._last = entry
        entry.select(args)
        if not entry.params_current(args):
            entry.bind(args, self.context.params())
        return entry

    def _compile_or_fall_back(self, key, args, variant: tuple, values) -> BoundPlan | None:
        """Compile for this signature; if that fails, run the partition in eager PyTorch (visibly)."""
        try:
            return self._compile(key, args, variant, values)
        except Exception as err:  # noqa: BLE001 - any compile failure must fall back, never compute garbage
            if self.context.options.fallback == "error":
                raise
            message = f"meganeura: a device partition runs in eager PyTorch because compiling it failed: {err}"
            warnings.warn(message, stacklevel=3)
            log.warning("%s", message)
            self.context.record({"kind": "failed", "error": str(err)})
            return None

    def _compile(self, key, args, variant: tuple, values) -> BoundPlan:
        start = time.perf_counter()
        device = self.context.device()
        params = self.param_indices | {i for i, a in enumerate(args) if arg_kind(a) == "param"}
        f16 = self.fast and self.context.f16_products(device)
        tune = tuning_enabled(self.context.options.tune)
        shared = (self._code, graph_key(key), frozenset(params), f16, tune, tuple(sorted(self.mutated.items())),
                  self.dynamic.sources if self.dynamic is not None else None)
        graph = SHARED_GRAPHS.find(shared, device, values)
        new = graph is None
        if new:
            example = [_as_tensor(a) for a in args]
            graph = (self._rescheduled(shared, example, device, tune, f16)
                     or compile_device_graph(self.gm, example, params, device, tune=tune, f16_products=f16,
                                             dynamic=self.dynamic, in_place=self.mutated))
            SHARED_GRAPHS.add(shared, graph)
        lowered, plan, report = graph.lowered, graph.plan, graph.report
        updated = self._updates(lowered)
        resident = {item for k, (kind, item) in enumerate(lowered.outputs)
                    if kind == "plan" and (k in self._resident_positions(lowered, variant) or k in updated.values())}
        on_device = [name for i, name in lowered.inputs  # (saved activations, kept tensors): no buffer of ours
                     if i in updated or arg_kind(args[i]) == "resident" and _array_of(args[i]).device is device]
        together = set(self.packed_positions) | (self.kept_gradients if variant[0] else set())
        packed = {item for k, (kind, item) in enumerate(lowered.outputs)  # (die together: ``SavedPack``, and kept
                  if kind == "plan" and k in together and k not in updated.values()}  # gradients, at zero_grad)
        program = program_for(graph, device, resident, on_device, packed)
        entry = BoundPlan(lowered, program, key, variant, graph, self.dynamic, updated=updated)
        entry.bind(args, self.context.params())  # uploads the parameters while the kernels compile
        program.wait_pipelines()  # a kernel that does not compile falls back here, as any other compile failure
        seconds = time.perf_counter() - start
        if new:
            record = PlanRecord(key, lowered.ops, len(plan.dispatches), len(plan.kernels), len(report.fused),
                                plan.stats["arena_bytes"], plan.stats["unplanned_bytes"], seconds, report.refused,
                                graph.from_cache, self._dynamic_dims(plan),
                                len(graph.guards.items) if graph.guards else 0)
            self.context.record(record)
            log.info("compiled a plan: %d dispatches, %d kernels in %.3f s", record.dispatches, record.kernels,
                     seconds)
        return entry

    def _rescheduled(self, shared: tuple, example: list, device, tune: bool, f16: bool) -> DeviceGraph | None:
        """A dynamic graph's plan for sizes past the bounds of those compiled, scheduled from one's fused IR where
        its lowering's and fusion's decisions hold (``device_graph.rescheduled``); None where none can be."""
        if self.dynamic is None:
            return None
        return next(filter(None, (rescheduled(graph, example, self.dynamic, device, tune=tune, f16_products=f16)
                                  for graph in reversed(SHARED_GRAPHS.graphs(shared)))), None)

    def _dynamic_dims(self, plan) -> tuple[str, ...]:
        """Each symbolic size of a dynamic graph, where it is read and the bound the plan is sized for."""
        if self.dynamic is None:
            return ()
        names = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        return tuple(f"{names[i]}{'' if d is None else f'[{d}]'} <= {bound}"
                     for (i, d), bound in zip(self.dynamic.sources, plan.bounds or (None,) * len(self.dynamic.sources)))

    def _updates(self, lowered: LoweredGraph) -> dict[int, int]:
        """Argument index -> output position of the updates (``mutated``) that stay on the device: the plan stores
        each over the argument's array where it found that safe (``Plan.in_place``), else in another array (a
        BatchNorm statistic updated in a reduction's epilogue: two arrays alternate, ``device_tensor.adopt``).
        The argument then stands for that array (``device_tensor.adopt``), and aot_autograd's copy of the new value
        into it changes nothing."""
        names = dict(lowered.inputs)
        return {i: k for k, i in self.mutated.items() if i in names and lowered.outputs[k][0] == "plan"}

    def _resident_positions(self, lowered: LoweredGraph, variant: tuple) -> set[int]:
        """The output positions that stay on the device in ``variant``: saved activations, kept gradients, and an
        inference graph's outputs that come back as inputs and were not read."""
        keep, lazy = variant
        positions = set(self.resident_outputs) | (self.kept_gradients if keep else set())
        return positions | {k for k, (kind, _) in enumerate(lowered.outputs) if kind == "plan" and k in lazy}

    def _reader(self, position: int):
        """What an inference graph's output calls when eager code first reads it: the next call reads that position
        back (one function per position)."""
        found = self._readers.get(position)
        if found is None:
            found = self._readers[position] = self._new_reader(position)
        return found

    def _new_reader(self, position: int):
        ref = weakref.ref(self)

        def read() -> None:
            partition = ref()
            if partition is not None and position not in partition._read:
                partition._read = partition._read | {position}

        return read

    def _returns(self, entry: BoundPlan, read: frozenset) -> tuple:
        """How each output of ``entry``'s runs returns, by position: ``ADOPTED`` (an argument updated in place),
        ``CONST``, ``SAVED`` (a ``ResidentTensor``), ``LAZY`` (a ``DeviceTensor`` until eager code reads it) or
        ``READ`` (read back), each with whether it is an inference graph's user output to track (``_track``). Decided
        once per entry, set of positions ``read`` and set of positions that came back (``_returned``), not per
        call."""
        key = (read, self._returned)
        returns = entry.returns.get(key)
        if returns is not None:
            return returns
        keep, _ = entry.variant
        saved = self.resident_outputs | (self.kept_gradients if keep else frozenset())
        lazy = self._resident_positions(entry.lowered, entry.variant) - saved
        returns = []
        for k, (kind, _) in enumerate(entry.lowered.outputs):
            how = (ADOPTED if k in entry.updated.values() else CONST if kind == "const" else SAVED if k in saved
                   else LAZY if k in lazy else READ)
            # (a lazy output at a position that comes back, a KV cache, is left as it is made: ``_track``)
            tracked = k in self.lazy_outputs and not self.lazy_from_first and not (how == LAZY and k in self._returned)
            returns.append((how, tracked))
        returns = entry.returns[key] = tuple(returns)
        return returns

    def _run(self, entry: BoundPlan, args, sizes: tuple, read: frozenset):
        lowered, program = entry.lowered, entry.program
        host, on_device = feed(lowered, args, program.device, entry.fed)
        steady = entry.steady if entry.steady is not None and entry.steady.holds(args) else None
        if steady is None and entry.update_inputs:  # (left out of ``_unfixed_positions``)
            _note_returned(args, [i for i, *_ in entry.update_inputs])
        returns = self._returns(entry, read)
        layout = entry.layouts.get(returns)
        if layout is None:
            layout = entry.layouts[returns] = _Layout.of(self, entry, returns)
        # the untracked lazy outputs (a KV cache) are made while the GPU runs the step (``Program.run``)
        early = [] if layout.lazy_names and layout.applies() else None
        while_running = None if early is None else lambda kept: early.append(layout.lazy_of(kept))
        if steady is not None:  # (the arguments it updates in place, as its last run left them)
            on_device.update(steady.bound)
            results = program.run(host, on_device, sizes=sizes, read_along=entry.along, while_running=while_running)
            entry.read_ahead.restart()
            adopted = steady.readopt(args)
        else:
            results, adopted = _run_updating(entry, args, host, on_device, sizes, while_running)
        entry.read_along(args, steady is not None)
        outs, made = layout.outputs(results, adopted, self.pack_origin, early[0] if early else None) \
            if layout.applies() else (None, None)
        if outs is None:
            outs = self._outputs_one_by_one(entry, returns, results, adopted)
        else:
            for k in layout.others:
                outs[k] = self._output(entry, k, returns[k], results, adopted, made)
        return tuple(outs) if lowered.returns_tuple else outs[0]

    def _outputs_one_by_one(self, entry: BoundPlan, returns: tuple, results: dict, adopted: dict) -> list:
        """The outputs of a run, position by position (``_output``), the saved ones packed (``_pack``)."""
        made = {}
        outs = [self._output(entry, k, how, results, adopted, made) for k, how in enumerate(returns)]
        if self.packed_positions:
            _pack(outs, self.packed_positions, self.pack_origin)
        return outs

    def _output(self, entry: BoundPlan, k: int, returned: tuple, results: dict, adopted: dict, made: dict):
        """The output at position ``k`` as it returns (``returned``: how, and whether to track it: ``_returns``);
        ``made``: the lazy outputs made so far, by value (positions that return the same value share one)."""
        (kind, item), (how, tracked) = entry.lowered.outputs[k], returned
        value = item if kind == "const" else results[item]
        if how == ADOPTED:
            out = adopted[k]
        elif how == CONST:
            out = value
        elif not isinstance(value, DeviceArray):  # a numpy array, or a numpy scalar for a 0-d bool
            out = tensor_from_host(value)
        elif how == SAVED:  # (packed, or a kept gradient, which the backward parks: ``parked_grads``)
            out = value if k in self.packed_positions or k in self.kept_gradients else ResidentTensor(value)
        elif how == LAZY:
            out = made[item] if item in made else made.setdefault(item, lazy_output(value, self._reader(k)))
        else:  # read at a position that shares its value with one kept on the device
            out = tensor_from_host(value.numpy())
        return self._track(out, k, how) if tracked else out

    def _track(self, t: torch.Tensor, position: int, how: str) -> DeviceTensor:
        """An inference graph's user output as a ``DeviceTensor`` that reports eager code's first read (``_reader``):
        lazy, or read back already. Until it comes back as an input, it is marked as one that may (``_may_come_back``)
        and, lazy, watched (``_watch_unread``)."""
        if type(t) is torch.Tensor:
            t = read_back_output(t, self._reader(position))
        if position not in self._returned:  # (a position that came back: its graph was traced for it already)
            _may_come_back(t, self, position)
            if how == LAZY:
                self._watch_unread(position, t)
        return t

    def varying_dims(self, position: int) -> tuple[int, ...]:
        """The dimensions of the output at ``position`` whose size may vary (``symbolic.output_dims_that_vary``),
        found once, at the first output that may come back."""
        if self._varying is None:
            self._varying = output_dims_that_vary(self.gm, self.param_indices)
        return self._varying[position]

    def _watch_unread(self, position: int, t: DeviceTensor) -> None:
        """Watch ``t``, the lazy output at ``position``; the one of two calls before, if still alive and unread, is read
        back now (which marks the position read: the next call reads it back, ``_reader``)."""
        last, before = self._unread.get(position, (None, None))
        older = before() if before is not None else None
        if older is not None and type(older) is DeviceTensor:
            read_now(older)
        self._unread[position] = (weakref.ref(t), last)


def _run_updating(entry: BoundPlan, args, host: dict, on_device: dict, sizes: tuple,
                  while_running=None) -> tuple[dict, dict]:
    """(the run's results, {output position: argument adopted}) of a run of ``entry`` that binds and adopts the
    arguments it updates one by one (``device_tensor.adopt``): the first, and any after eager code changed one, or
    where some alternate between two arrays. Where all are updated in place, it leaves ``entry.steady``.
    ``while_running``: ``Program.run``'s."""
    device = entry.program.device
    into = {}
    for i, _, name, _, alternating in entry.update_inputs:  # a new array the first time, the argument's own later
        on_device[name] = device_input(args[i], device)
        spare = spare_array(args[i], device) if alternating is not None else None
        if spare is not None:
            into[alternating] = spare
    results = entry.program.run(host, on_device, into, sizes=sizes, read_along=entry.along,
                                while_running=while_running)
    if entry.read_ahead is None:
        entry.read_ahead = ReadAhead([args[i] for i, *_ in entry.update_inputs])
    entry.read_ahead.restart()
    adopted = {k: adopt(args[i], results[out], on_device[name], (entry.read_ahead, position))
               for position, (i, k, name, out, _) in enumerate(entry.update_inputs)}
    entry.steady = SteadyUpdates.after(entry, args, on_device, adopted) if not entry.alternating else None
    return results, adopted


@dataclass(eq=False)
class _Layout:
    """How a run's outputs are put together where most of them are device arrays or arguments returned as they are
    (a training forward's saved activations, one ``SavedPack`` at each of their positions, and its updated
    statistics; a backward's kept gradients): in loops run by C, from a pool of the values (the pack, the other
    arrays, the adopted arguments, the constants) indexed per position; only the ``others`` one by one. Decided
    once per entry and way its outputs return (``DevicePartition._returns``)."""

    packed_names: list  # the plan outputs the pack holds, in its order (none: no pack)
    names: list  # the other plan outputs returned as the arrays they are
    consts: tuple
    index: list  # position -> index in the pool
    others: list  # positions made one by one (``DevicePartition._output``)
    # the lazy outputs left untracked (``_track``: a KV cache), made in one loop (``lazy_outputs``): their values
    # (output names, each once), what each calls when read (``_reader`` of the first of those positions that
    # returns it), and (position, index in those) of each
    lazy_names: list = field(default_factory=list)
    readers: list = field(default_factory=list)
    lazy_at: list = field(default_factory=list)

    @staticmethod
    def of(partition: DevicePartition, entry: BoundPlan, returns: tuple) -> "_Layout":
        outputs, packed = entry.lowered.outputs, partition.packed_positions
        if any(returns[k] != (SAVED, False) for k in packed):  # (a constant or a tracked value saved: one by one)
            return _Layout([], [], (), [], list(range(len(returns))))
        arrays = [k for k, how in enumerate(returns)
                  if how == (SAVED, False) and k not in packed and k in partition.kept_gradients]
        updated = [k for _, k, *_ in entry.update_inputs]  # (the order of ``adopted``: all of them in the pool)
        consts = [k for k, how in enumerate(returns) if how == (CONST, False)]
        slots = dict.fromkeys(packed, 0)  # position -> index in the pool: (the pack,) + arrays + adopted + consts
        start = 1 if packed else 0
        for group in (arrays, updated, consts):
            slots.update((k, start + i) for i, k in enumerate(group) if returns[k][1] is False)
            start += len(group)
        lazy = [k for k, how in enumerate(returns) if how == (LAZY, False)]
        others = [k for k in range(len(returns)) if k not in slots and k not in lazy]
        index = [slots.get(k, -1) for k in range(len(returns))]  # (-1: the pool's last, None, made apart)
        first = {}  # output name -> the first lazy position returning it
        for k in lazy:
            first.setdefault(outputs[k][1], k)
        names = list(first)
        return _Layout([outputs[k][1] for k in packed], [outputs[k][1] for k in arrays],
                       tuple(outputs[k][1] for k in consts), index, others, names,
                       [partition._reader(k) for k in first.values()],
                       [(k, names.index(outputs[k][1])) for k in lazy])

    def applies(self) -> bool:
        """Whether the pool serves: some outputs come from it, and where there is a pack, no saved-tensor hooks are
        set (``_pack``: they get each saved value as a tensor of its own)."""
        return bool(self.index) and not (self.packed_names and _top_saved_tensors_hooks(True) is not None)

    def lazy_of(self, kept: dict) -> list | None:
        """The untracked lazy outputs (``lazy_names``), made from a run's resident outputs ``kept`` (by name) while
        the GPU runs it (``Program.run``'s ``while_running``); None where one is not a device array."""
        lazy = tuple(map(kept.get, self.lazy_names))
        if not set(map(type, lazy)) <= {DeviceArray}:
            return None
        return lazy_outputs(lazy, self.readers)

    def outputs(self, results: dict, adopted: dict, origin: object,
                early: list | None = None) -> tuple[list | None, dict | None]:
        """The outputs from the pool and the untracked lazy ones (those made ``early``, by ``lazy_of``, if any), the
        ``others`` left None, and those lazy ones by output name (``DevicePartition._output``'s ``made``: a position
        made apart that shares a value shares its tensor); (None, None) where a value meant to be a device array is
        not."""
        values = tuple(map(results.__getitem__, self.names))
        packed = list(map(results.__getitem__, self.packed_names))
        lazy = tuple(map(results.__getitem__, self.lazy_names))
        if not {*map(type, values), *map(type, packed), *map(type, lazy)} <= {DeviceArray}:
            return None, None
        head = (SavedPack(packed, origin),) if self.packed_names else ()
        pool = (*head, *values, *adopted.values(), *self.consts, None)
        outs = list(map(pool.__getitem__, self.index))
        if not lazy:
            return outs, {}
        made = early if early is not None else lazy_outputs(lazy, self.readers)
        for k, j in self.lazy_at:
            outs[k] = made[j]
        return outs, dict(zip(self.lazy_names, made))


_RETURNABLE = frozenset({torch.Tensor, DeviceTensor})  # the classes of outputs that may come back (``_may_come_back``)

# How an output of a run returns (``DevicePartition._returns``)
ADOPTED, CONST, SAVED, LAZY, READ = "adopted", "const", "saved", "lazy", "read"


def _may_come_back(t: DeviceTensor, partition: DevicePartition, position: int) -> None:
    """Mark ``t``, an output that may come back as an input of a compiled call (a ``DeviceTensor``: the class it
    keeps while it stays on the device, as dynamo traces a graph again when an input's class changes). Tagged (seen
    again as an input: consumed, not watched), and marked for dynamo to trace the graph it comes back to with its
    sizes that may vary symbolic (``symbolic.output_dims_that_vary``): a KV cache, new at the first decode step,
    would otherwise make that graph static, and the next step, one position longer, another. Only those: each
    symbolic size of an input costs guards that dynamo runs as Python at every call (a static cache's 90 tensors
    marked in all their dimensions took 90 of the decode step's 136)."""
    with torch._C.DisableTorchFunctionSubclass():  # (marking it is not eager code reading it)
        t._meganeura_returned = (weakref.ref(partition), position)
        dims = [d for d in partition.varying_dims(position) if t.shape[d] > 1]
        if dims:
            torch._dynamo.maybe_mark_dynamic(t, dims)


def _note_returned(args, positions: list[int]) -> None:
    """Tell the partitions whose read-back outputs are among ``args`` (at ``positions``: not the static inputs) that
    those positions come back as inputs. The arguments' classes are read in loops run by C first: a backward's
    hundreds of saved activations are device arrays, none of them an output read back."""
    if _RETURNABLE.isdisjoint(map(type, map(args.__getitem__, positions))):
        return
    for i in positions:
        a = args[i]
        source = getattr(a, "_meganeura_returned", None) if type(a) in _RETURNABLE else None
        if source is not None:
            partition, position = source[0](), source[1]
            if partition is not None:
                partition._returned = partition._returned | {position}
            del a._meganeura_returned


def _array_of(value) -> DeviceArray:
    if type(value) is DeviceArray:
        return value
    return value.array if isinstance(value, ResidentTensor) else value._meganeura_kept.array


def _pack(outs: list, positions: list[int], origin: object) -> None:
    """The values at ``positions`` of a run's outputs (what a training forward saves) as one ``SavedPack`` at each;
    each a ``ResidentTensor`` of its own where saved-tensor hooks are set (``torch.autograd.graph.saved_tensors_hooks``:
    they get every saved value as a tensor, ``save_on_cpu`` downloads them)."""
    if _top_saved_tensors_hooks(True) is not None:
        for k in positions:
            outs[k] = _as_tensor(outs[k])
        return
    pack = SavedPack([outs[k] for k in positions], origin)
    for k in positions:
        outs[k] = pack


def _as_tensor(value):
    """An argument as a tensor: a ``DeviceArray`` (an unpacked saved activation) as a ``ResidentTensor`` of it."""
    return ResidentTensor(value) if type(value) is DeviceArray else value


def _eager_value(value):
    """An argument as eager PyTorch takes it (a partition that falls back): device values downloaded, and a tensor
    kept on the device as a plain alias of its host copy (a write through it bumps the version the next call checks):
    aot_autograd's first call runs the graph under a dispatch mode that refuses tensor subclasses (``host_alias``)."""
    if type(value) is DeviceArray:
        return tensor_from_host(value.numpy())
    if type(value) is DeviceTensor or type(value) is DeviceParameter:
        with torch._C.DisableTorchFunctionSubclass():
            return host_alias(value)
    return value.materialize() if isinstance(value, ResidentTensor) else value
