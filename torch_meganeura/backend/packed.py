"""The forward->backward hand-off of a training graph as one object per device partition (``SavedPack``).

A training forward's device partitions return the activations they save as one ``SavedPack`` each, at every saved
position (``DevicePartition``'s ``pack_saved``). aot_autograd saves the forward's outputs past the user's and gives
them to the backward graph as placeholders of the same names (its partitioner extracts both graphs from the joint
one). So the forward's compiler records, by that name, which partition's pack holds each saved value and where
(``record_packs``), in the tracing context the backward's compiler shares (as ``KeptGradients``); the backward's
compiled function unpacks each pack before its graph runs (``Unpacker``): every position gets its value back, a
``DeviceArray`` where only device partitions read it (they bind it as it is), a ``ResidentTensor`` of it where eager
code does. A partition that ran in eager PyTorch returned real tensors, which stay as they are.

The parameters a forward saves as they are (its static inputs: the weights its backward multiplies by) cross the
same way, as one more ``SavedPack`` of the tensors themselves (``InputPacker``): aot_autograd's ``_is_view`` of each
kept parameter met its Python override (``DeviceParameter``), once per parameter per forward. The backward gets the
same tensors back; autograd then does not check their versions, as it does not for the partitions' values.

Not packed: graphs over symbolic sizes (their partitions compare each argument's sizes, ``signatures.fits``), what
a forward saves where saved-tensor hooks are set (they get each value), and its other inputs.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..tensors.resident import ResidentTensor
from ..tensors.saved_pack import SavedPack
from ..lower.symbolic import DynamicSizes

_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


@dataclass
class SavedPacks:
    """Where the saved values of one graph's forward are: saved node name -> (the partition's ``pack_origin``, index
    in its pack, the value's shape and dtype)."""

    where: dict[str, tuple[object, int, tuple, torch.dtype]] = field(default_factory=dict)

    @staticmethod
    def of_this_graph(create: bool) -> "SavedPacks | None":
        return of_this_graph("meganeura_saved_packs", SavedPacks, create)


def of_this_graph(attribute: str, make, create: bool):
    """What a graph's forward compiler leaves for its backward's compiler (of the same graph) in the tracing
    context they share, under ``attribute``: a new ``make()`` there where ``create``; None outside a tracing
    context."""
    ctx = torch._guards.TracingContext.try_get()
    if ctx is None:
        return None
    if create:
        setattr(ctx, attribute, make())
    return getattr(ctx, attribute, None)


def packs_saved(gm: fx.GraphModule) -> bool:
    """Whether a training forward's partitions pack what they save: where the backward's compiler can find where
    (a tracing context) and the graph's sizes are static."""
    return torch._guards.TracingContext.try_get() is not None and DynamicSizes.of(gm) is None


def output_names(gm: fx.GraphModule) -> list[str | None]:
    """The names of the nodes ``gm`` returns (None for a non-node), by position: taken before partitioning, which
    returns the same positions from other nodes."""
    output = gm.graph.find_nodes(op="output")[0]
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    return [v.name if isinstance(v, fx.Node) else None for v in values]


def record_packs(fused: fx.GraphModule, names: list[str | None], first_saved: int, packed: dict[str, tuple],
                 packs: SavedPacks) -> None:
    """Record where each value the forward ``fused`` saves (its outputs from ``first_saved``, named ``names`` before
    partitioning) is: the partition it comes from and its index in that partition's pack (``packed``: by partition
    name, its pack origin and packed output positions, in order)."""
    output = fused.graph.find_nodes(op="output")[0]
    values = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    for j in range(first_saved, len(values)):
        node, position = values[j], 0
        if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
            node, position = node.args
        value = values[j].meta.get("val") if isinstance(values[j], fx.Node) else None
        if (isinstance(node, fx.Node) and node.op == "call_module" and node.target in packed and names[j]
                and isinstance(value, torch.Tensor)):
            origin, order = packed[node.target]
            if position in order:
                packs.where[names[j]] = (origin, order.index(position), tuple(value.shape), value.dtype)


def placeholder_names(gm: fx.GraphModule) -> list[str]:
    """The names of ``gm``'s placeholders, in order (taken before partitioning)."""
    return [node.name for node in gm.graph.find_nodes(op="placeholder")]


def saved_inputs(fused: fx.GraphModule, first_saved: int, static: set[int]) -> list[int]:
    """The positions of ``fused``'s outputs from ``first_saved`` that are its static inputs (parameters) as they
    are."""
    index_of = {n: i for i, n in enumerate(fused.graph.find_nodes(op="placeholder"))}
    output = fused.graph.find_nodes(op="output")[0]
    values = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    return [j for j in range(first_saved, len(values)) if index_of.get(values[j]) in static
            and isinstance(values[j].meta.get("val"), torch.Tensor)]


class InputPacker:
    """Puts the parameters a forward saves (its outputs at ``positions``) into one ``SavedPack`` (module docstring),
    but where saved-tensor hooks are set."""

    def __init__(self, positions: list[int]):
        self.positions, self.origin = positions, object()

    def __call__(self, result):
        if _top_saved_tensors_hooks(True) is not None:
            return result
        outs = list(result)
        pack = SavedPack([outs[j] for j in self.positions], self.origin)
        for j in self.positions:
            outs[j] = pack
        return outs if isinstance(result, list) else tuple(outs)


class Unpacker:
    """Puts a backward's saved values back at their argument positions before its graph runs (the module docstring):
    per partition pack, the position of one of its values (to find the pack), and (position, index, eager) of each."""

    def __init__(self, gm: fx.GraphModule, packs: SavedPacks, device_partitions: set[str], names: list[str]):
        """``gm``: the backward, partitioned; ``names``: its placeholders' names before partitioning."""
        groups: dict[object, list[tuple[int, int, bool]]] = {}
        for i, (node, name) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), names)):
            found, value = packs.where.get(name), node.meta.get("val")
            if found is not None and isinstance(value, torch.Tensor) and found[2:] == (tuple(value.shape), value.dtype):
                eager = any(u.op != "call_module" or u.target not in device_partitions for u in node.users)
                groups.setdefault(found[0], []).append((i, found[1], eager))
        self.groups = [(origin, members[0][0], members) for origin, members in groups.items()]

    def __bool__(self) -> bool:
        return bool(self.groups)

    def __call__(self, args: list) -> None:
        for origin, first, members in self.groups:
            pack = args[first]
            if type(pack) is not SavedPack:  # (its partition ran in eager PyTorch: real tensors)
                continue
            if pack.origin is not origin:
                raise RuntimeError("meganeura: the backward got the saved values of another forward's partition")
            values = pack.values
            for i, index, eager in members:
                value = values[index]
                args[i] = ResidentTensor(value) if eager and not isinstance(value, torch.Tensor) else value


class Handoff:
    """One graph's side of the hand-off: a training forward's partitions pack what they save (``packing``) and
    ``finish`` records where; a backward's ``finish`` returns its ``Unpacker`` (None where it has nothing to unpack).
    Made before partitioning, which renames the nodes."""

    def __init__(self, gm: fx.GraphModule, mode: str):
        self.mode, self.packs = mode, SavedPacks.of_this_graph(create=mode == "forward")
        self.packing = mode == "forward" and self.packs is not None and packs_saved(gm)
        backward = mode == "backward" and self.packs is not None
        self.names = output_names(gm) if self.packing else placeholder_names(gm) if backward else []
        self.inputs: InputPacker | None = None  # a forward's, of the parameters it saves (``finish``)

    def finish(self, fused: fx.GraphModule, partitions, first_saved: int, static: set[int]) -> Unpacker | None:
        """After ``fused``'s ``partitions`` became device partitions: a forward's saved values (its outputs from
        ``first_saved``) recorded, and its ``inputs`` packer of the ``static`` inputs it saves made; a backward's
        unpacking made."""
        if self.packing:
            packed = {n: (p.pack_origin, p.packed_positions) for n in partitions
                      if (p := getattr(fused, n)).packed_positions}
            record_packs(fused, self.names, first_saved, packed, self.packs)
            self._pack_inputs(fused, first_saved, static)
        if self.mode != "backward" or self.packs is None:
            return None
        unpack = Unpacker(fused, self.packs, set(partitions), self.names)
        return unpack if unpack else None

    def _pack_inputs(self, fused: fx.GraphModule, first_saved: int, static: set[int]) -> None:
        """Make the forward's ``inputs`` packer of the static inputs it saves, and record where each is."""
        positions = [j for j in saved_inputs(fused, first_saved, static) if self.names[j]]
        if not positions:
            return
        self.inputs = InputPacker(positions)
        output = fused.graph.find_nodes(op="output")[0]
        for k, j in enumerate(positions):
            value = output.args[0][j].meta["val"]
            self.packs.where[self.names[j]] = (self.inputs.origin, k, tuple(value.shape), value.dtype)
