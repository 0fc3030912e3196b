"""Data parallelism for ``compile_train_step``: gradients averaged across processes through torch.distributed.

``compile_train_step(DistributedDataParallel(model), loss_fn, optimizer)`` (DDP's ``process_group``, its
``broadcast_buffers``; DDP broadcast rank 0's parameters and buffers when it wrapped the model) or
``compile_train_step(model, ..., process_group=group)`` (rank 0's parameters and buffers are broadcast here, when
the step is built) makes a step data parallel. A step then runs two plans instead of one:

1. local gradients: forward and backward on this rank's micro-batch; the loss and the gradients come back to the
   host, changed buffers stay on the device. With ``accumulation_steps=k`` the first k-1 calls accumulate on the
   device with no communication (DDP's ``no_sync``) and only the k-th reads back the accumulated gradients.
2. update: the averaged gradients (clipped by ``max_grad_norm`` after averaging, as DDP then
   ``clip_grad_norm_`` does) go back up and the optimizer update runs on the device.

Between the two, ``GradientReducer`` all-reduces the gradients on the host (gloo: Vulkan GPUs have no NCCL) in
buckets of about 25 MB, last parameters first as DDP does, each with an asynchronous handle: while one bucket is
in flight the host packs the next, and each averaged bucket is written to the device while later ones are still
in flight. ``stats`` times the phase and the time spent blocked on handles. On a 2-core CPU host shared with other
work (lavapipe, two processes), ResNet-50's 102 MB of gradients in 5 buckets took 644 ms median this way against
737 ms with each bucket waited for before the next is packed; not measured on GPUs.

BatchNorm statistics follow DDP's default ``broadcast_buffers=True``: before the first micro-batch of every step,
rank 0's copies of the buffers that the forward changes are broadcast to every rank (so ranks differ only by their
last local update, as under DDP). With a DDP wrapper built with ``broadcast_buffers=False`` each rank keeps its
own. Every call returns this rank's own loss, as DDP's forward does.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from meganeura.runtime.dtypes import host_words
from meganeura.runtime.resident import DeviceArray

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


def resolve(model: torch.nn.Module, process_group) -> tuple[torch.nn.Module, "DataParallel | None"]:
    """The module to train and its data-parallel settings (None: a single-process step)."""
    if isinstance(model, DistributedDataParallel):
        group = process_group if process_group is not None else model.process_group
        return model.module, DataParallel(group, model.broadcast_buffers, broadcast_at_start=False)
    if process_group is None:
        return model, None
    return model, DataParallel(process_group, broadcast_buffers=True, broadcast_at_start=True)


class DataParallel:
    """The process group and buffer policy of a data-parallel step."""

    def __init__(self, group, broadcast_buffers: bool, broadcast_at_start: bool):
        if not dist.is_initialized():
            raise RuntimeError("data-parallel compile_train_step needs torch.distributed.init_process_group first")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.broadcast_buffers = broadcast_buffers
        self.broadcast_at_start = broadcast_at_start
        self.reducer: GradientReducer | None = None

    def broadcast_module(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers into every rank's module (what DDP does when it wraps a model)."""
        tensors = [t.data for t in list(model.parameters()) + list(model.buffers())]
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t, _global_rank(self.group, 0), group=self.group)

    def broadcast_arrays(self, arrays: list[DeviceArray]) -> None:
        """Rank 0's contents of ``arrays`` (device arrays of any dtype) written into every rank's arrays."""
        if not arrays or not self.broadcast_buffers or self.world == 1:
            return
        sizes = [int(np.prod(a.shape)) for a in arrays]
        if self.rank == 0:
            flat = torch.from_numpy(np.concatenate([a.numpy().astype(np.float64).ravel() for a in arrays]))
        else:
            flat = torch.empty(sum(sizes), dtype=torch.float64)  # float64 holds every int32 and float32 exactly
        dist.broadcast(flat, _global_rank(self.group, 0), group=self.group)
        if self.rank != 0:
            for array, part in zip(arrays, torch.split(flat, sizes)):
                overwrite(array, part.numpy())


class GradientReducer:
    """Averages gradients across the group in buckets; writes each averaged gradient into its device array."""

    def __init__(self, device, group, world: int, names: list[str], shapes: list[tuple],
                 bucket_bytes: int = BUCKET_BYTES):
        self.group, self.world = group, world
        self.shapes = dict(zip(names, shapes))
        self.buckets: list[list[str]] = []
        size = 0
        for name in reversed(names):  # DDP's order: gradients of the last layers are ready first
            nbytes = 4 * int(np.prod(self.shapes[name]))
            if not self.buckets or size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(name)
            size += nbytes
        self.arrays = {name: DeviceArray(device.pool, tuple(shape), "float32") for name, shape in zip(names, shapes)}
        self.stats = {"buckets": len(self.buckets), "reduce_ms": 0.0, "wait_ms": 0.0}

    def reduce(self, grads: dict[str, np.ndarray]) -> dict[str, DeviceArray]:
        """Average ``grads`` (this rank's, by parameter name) across the group; returns the device arrays."""
        start = time.perf_counter()
        waited = 0.0
        pending = []
        for bucket in self.buckets:
            flat = torch.from_numpy(np.concatenate([np.asarray(grads[n], np.float32).ravel() for n in bucket]))
            pending.append((bucket, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        for bucket, flat, handle in pending:
            before = time.perf_counter()
            handle.wait()
            waited += time.perf_counter() - before
            flat /= self.world
            at = 0
            for name in bucket:
                n = int(np.prod(self.shapes[name]))
                overwrite(self.arrays[name], flat[at:at + n].numpy())
                at += n
        self.stats["reduce_ms"] = (time.perf_counter() - start) * 1e3
        self.stats["wait_ms"] = waited * 1e3
        return self.arrays

    def release(self) -> None:
        for array in self.arrays.values():
            array.release()


def overwrite(array: DeviceArray, values: np.ndarray) -> None:
    """Write ``values`` (any shape with the array's element count) into ``array``'s device buffer."""
    host = host_words(values, array.dtype)
    if host.size:
        array.device.write(array.buffer, 0, host, "data-parallel update")


def _global_rank(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None and group is not dist.group.WORLD else rank
