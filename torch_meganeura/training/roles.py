"""What the graphs of a resident training step read and write (``Role``) and which step each computes (``Mode``).

``train_trace`` names every placeholder and output of a step's graph by its role; ``train_step`` keeps the step's
device arrays by role and binds each placeholder from the array of its role. ``Role.key`` is the role as a string
(``"param:NAME"``, ``"state:SLOT:NAME"``, ``"batch:I"``, ``"hyper"``...): the name of its tensor in a checkpoint
(``TrainStep.save``), kept in this format so that checkpoints written before stay readable.
"""
from __future__ import annotations

from enum import Enum


class Kind(Enum):
    PARAM = "param"  # a trainable parameter
    FROZEN = "frozen"  # a parameter that does not require grad
    BUFFER = "buffer"  # a module buffer (BatchNorm statistics)
    STATE = "state"  # an optimizer state tensor (its ``slot``: exp_avg, momentum_buffer...) of a trainable parameter
    ACC = "acc"  # a trainable parameter's gradient accumulated over micro-batches (accumulation_steps > 1)
    GRAD = "grad"  # a trainable parameter's gradient
    BATCH = "batch"  # the batch argument at ``index``
    HYPER = "hyper"  # the optimizer's numbers of this step (``optimizers.hyperparameters``)
    CONSTANT = "constant"  # a tensor the traced graph holds, lifted to an input
    LOSS = "loss"  # the step's loss (an output)


class Role:
    """One input or output of a step's graph: a ``kind`` and what it is of (a parameter, buffer or constant's
    ``name``, an optimizer state's ``slot``, a batch argument's ``index``).

    There is one Role per set of fields (``Role(...)`` returns the existing one, copies and pickles too), so roles
    compare and hash by identity, in C. Roles key the step's dicts of device arrays, looked up thousands of times a
    step: a hash written in Python cost milliseconds a step on the H200 (bench/results/h200-issue34-ab.md)."""

    __slots__ = ("kind", "name", "slot", "index")

    def __new__(cls, kind: Kind, name: str = "", slot: str = "", index: int = -1) -> Role:
        fields = (kind, name, slot, index)
        role = _INTERNED.get(fields)
        if role is None:
            role = _INTERNED[fields] = object.__new__(cls)
            for field, value in zip(cls.__slots__, fields):
                object.__setattr__(role, field, value)
        return role

    def __setattr__(self, name, value):
        raise AttributeError("a Role is immutable: it is shared by every user of its fields")

    def __reduce__(self):
        return Role, (self.kind, self.name, self.slot, self.index)

    def __repr__(self) -> str:
        return f"Role({self.key!r})"

    @classmethod
    def param(cls, name: str) -> Role:
        return cls(Kind.PARAM, name)

    @classmethod
    def frozen(cls, name: str) -> Role:
        return cls(Kind.FROZEN, name)

    @classmethod
    def buffer(cls, name: str) -> Role:
        return cls(Kind.BUFFER, name)

    @classmethod
    def state(cls, slot: str, name: str) -> Role:
        return cls(Kind.STATE, name, slot=slot)

    @classmethod
    def acc(cls, name: str) -> Role:
        return cls(Kind.ACC, name)

    @classmethod
    def grad(cls, name: str) -> Role:
        return cls(Kind.GRAD, name)

    @classmethod
    def batch(cls, index: int) -> Role:
        return cls(Kind.BATCH, index=index)

    @classmethod
    def hyper(cls) -> Role:
        return cls(Kind.HYPER)

    @classmethod
    def constant(cls, name: str) -> Role:
        return cls(Kind.CONSTANT, name)

    @classmethod
    def loss(cls) -> Role:
        return cls(Kind.LOSS)

    @property
    def key(self) -> str:
        """The role as a string: a checkpoint's tensor name (module docstring)."""
        if self.kind is Kind.STATE:
            return f"state:{self.slot}:{self.name}"
        if self.kind is Kind.BATCH:
            return f"batch:{self.index}"
        if self.kind in (Kind.HYPER, Kind.LOSS):
            return self.kind.value
        return f"{self.kind.value}:{self.name}"

    def __str__(self) -> str:
        return self.key


_INTERNED: dict[tuple, Role] = {}  # every Role, by its fields


class Mode(Enum):
    """Which step a graph computes. What it outputs besides the loss (``train_trace``):

    STEP        new params, changed buffers, new optimizer state;
    ACCUMULATE  new accumulators (+ this micro-batch's gradients), changed buffers;
    APPLY       as STEP with the accumulated gradients, then zeroed accumulators;
    GRADS       the gradients, nothing else (buffers unchanged);
    LOCAL       gradients (+ the accumulated ones, unclipped), changed buffers, zeroed accumulators: a data-parallel
                step's first graph;
    UPDATE      no loss: new params and optimizer state from params, state, hyperparameters and the averaged
                gradients, a data-parallel step's second graph (``trace_update``)."""

    STEP = "step"
    ACCUMULATE = "accumulate"
    APPLY = "apply"
    GRADS = "grads"
    LOCAL = "local"
    UPDATE = "update"
