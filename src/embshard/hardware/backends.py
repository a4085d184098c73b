"""Embedding kernels one device runs in a training step, built from the shards it holds.

Two backends:

* ``fbgemm``: ONE fused FBGEMM table-batched embedding-bag op
  (``SplitTableBatchedEmbeddingBagsCodegen``) holding all of the device's shards, with the
  optimizer fused into backward (EXACT_SGD for ``sgd``). CPU build: ``EmbeddingLocation.HOST``
  / ``ComputeDevice.CPU``; CUDA build: ``DEVICE`` / ``CUDA``. This is what training runs.
* ``torch``: ``torch.nn.functional.embedding_bag`` (mode sum) over one concatenated weight
  per distinct shard width (per-shard row offsets added to the indices), then a sparse SGD
  update. Works on CPU or CUDA wherever torch does; FBGEMM is imported lazily so this
  backend works without it.

Sequence shards (`"kind": "sequence"`) are not pooled: one vector per id, as TorchRec's
EmbeddingCollection computes them. Their kernel is a second op of the same backend, one per
distinct width (FBGEMM's ``PoolingMode.NONE`` takes tables of one width only; torch's
``F.embedding``), run after the pooled op in the same step (`make_kernel`). A sequence piece
held in k copies serves 1/k of the samples on each (as in its memory, `Task.shard_memory_bytes`):
copy r keeps the ids of the samples s with s % k == r. A pooled piece held in k copies (TorchRec's
data_parallel: a copy on every device) is its own pooled op at the local batch, ceil(batch / k)
bags: TorchRec runs data-parallel tables as a separate module on each rank's own samples, whose
outputs never enter the all-to-all.

A step is forward + backward (with the update). Its input is a `DeviceBatch`, pre-generated
before timing so index generation is not timed, and drawn fresh for every repetition:
for a column shard the table's indices (the shard has its own width); for a row shard the
table's indices that fall in the shard's row range, shifted to start at 0 (so a row shard
sees only its share of the lookups, as under row-wise sharding).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from embshard.data.indices import batch_indices
from embshard.errors import InputError
from embshard.plan import Shard
from embshard.tables import Table

BACKENDS = ("fbgemm", "torch")

#: task.optimizer -> FBGEMM fused optimizer name (EmbOptimType member).
FBGEMM_OPTIMIZERS = {
    "sgd": "EXACT_SGD",
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adagrad": "EXACT_ADAGRAD",
    "adam": "ADAM",
}
#: the fused updates FBGEMM's CPU kernel has (its CPU mode refuses ADAM)
FBGEMM_CPU_OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")
LEARNING_RATE = 0.01


def available_backends() -> list[str]:
    """Backends that can be imported here: always ``torch``; ``fbgemm`` when fbgemm_gpu loads."""
    out = []
    try:
        import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401

        out.append("fbgemm")
    except Exception:  # ImportError, or an OSError from a mismatched native build
        pass
    out.append("torch")
    return out


@dataclass(frozen=True)
class ShardInput:
    """A shard together with its table: what a kernel needs to allocate and feed it."""

    table: Table
    shard: Shard
    #: copies of this rectangle in the plan (replica 0 and its replicas): a sequence copy serves
    #: 1/copies of the samples
    copies: int = 1

    @property
    def rows(self) -> int:
        return self.shard.rows

    @property
    def dim(self) -> int:
        return self.shard.dim

    @property
    def nbytes(self) -> int:
        return self.shard.rows * self.shard.dim * self.table.bytes_per_element


@dataclass
class DeviceBatch:
    """One step's input for one device: per shard (indices into the shard, offsets [B+1])."""

    per_shard: list[tuple[torch.Tensor, torch.Tensor]]
    batch_size: int

    def to(self, device: str | torch.device) -> "DeviceBatch":
        return DeviceBatch([(i.to(device), o.to(device)) for i, o in self.per_shard], self.batch_size)

    @property
    def num_lookups(self) -> int:
        return sum(int(i.numel()) for i, _ in self.per_shard)


def shard_batch(shards: Sequence[ShardInput], batch_size: int, rng: np.random.Generator) -> DeviceBatch:
    """A fresh batch of bags for every shard of one device.

    Indices are drawn once per table (column shards of the same table on this device see
    the same lookups); a row shard keeps the lookups in its row range, shifted to 0.
    """
    by_table: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for s in shards:
        t = s.table
        if t.name not in by_table:
            by_table[t.name] = batch_indices(t, batch_size, rng)
        idx, off = by_table[t.name]
        lo, n = s.shard.row_offset, s.shard.rows
        k = max(int(s.copies), 1) if t.is_sequence else 1
        if lo == 0 and n >= t.rows and k == 1:
            out.append((idx, off))
            continue
        bag = torch.repeat_interleave(torch.arange(batch_size), off[1:] - off[:-1])
        keep = (idx >= lo) & (idx < lo + n)
        if k > 1:  # this copy serves the samples s with s % k == its replica number
            keep &= bag % k == s.shard.replica % k
        counts = torch.bincount(bag[keep], minlength=batch_size)
        new_off = torch.zeros(batch_size + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=new_off[1:])
        out.append(((idx[keep] - lo).contiguous(), new_off))
    return DeviceBatch(out, batch_size)


class DeviceKernel(ABC):
    """The embedding work of one device: all its shards, forward + backward + update."""

    def __init__(self, shards: Sequence[ShardInput], batch_size: int, device: str | torch.device):
        if not shards:
            raise InputError("a device kernel needs at least one shard")
        self.shards = list(shards)
        self.batch_size = int(batch_size)
        self.device = torch.device(device)

    @property
    def width(self) -> int:
        return sum(s.dim for s in self.shards)

    @property
    def num_inputs(self) -> int:
        """Entries of `DeviceBatch.per_shard` in this kernel's batches (here: one per shard)."""
        return len(self.shards)

    def make_batch(self, rng: np.random.Generator) -> DeviceBatch:
        """A fresh input, already on the kernel's device (generate these before timing)."""
        return shard_batch(self.shards, self.batch_size, rng).to(self.device)

    @abstractmethod
    def forward(self, batch: DeviceBatch) -> list[torch.Tensor]:
        """The outputs of one batch (per op or weight group): pooled ``[batch, width]``,
        unpooled ``[ids, width]``."""

    @abstractmethod
    def step(self, batch: DeviceBatch) -> None:
        """Forward, backward and the fused optimizer update on one batch."""

    @abstractmethod
    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor a step reads or updates besides its input (weights, optimizer state)."""

    def touch(self) -> None:
        """Read every page of the kernel's state once, so a step that follows finds it resident
        (the state a GPU kernel meets in device memory), whatever the OS or hypervisor did
        with pages left cold while other kernels were timed."""
        with torch.no_grad():
            for t in self.state_tensors():
                if t.numel():
                    t.sum()


class FbgemmKernel(DeviceKernel):
    """One ``SplitTableBatchedEmbeddingBagsCodegen`` op over the given shards: pooled sums
    (``pooling="sum"``), or one vector per id (``"none"``: sequence shards, all of one width)."""

    def __init__(
        self,
        shards: Sequence[ShardInput],
        batch_size: int,
        device: str | torch.device = "cpu",
        optimizer: str = "sgd",
        pooling: str = "sum",
    ):
        super().__init__(shards, batch_size, device)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            ComputeDevice,
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        if optimizer not in FBGEMM_OPTIMIZERS:
            raise InputError(f"fbgemm backend: unknown optimizer {optimizer!r}; one of {sorted(FBGEMM_OPTIMIZERS)}")
        check_fbgemm_optimizer(optimizer, self.device)
        _check_pooling(pooling, self.shards)
        cuda = self.device.type == "cuda"
        loc = EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST
        comp = ComputeDevice.CUDA if cuda else ComputeDevice.CPU
        # One precision per op: fp16 only when every shard is fp16.
        fp16 = all(s.table.bytes_per_element == 2 for s in self.shards)
        self.op = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(s.rows, s.dim, loc, comp) for s in self.shards],
            optimizer=getattr(EmbOptimType, FBGEMM_OPTIMIZERS[optimizer]),
            learning_rate=LEARNING_RATE,
            weights_precision=SparseType.FP16 if fp16 else SparseType.FP32,
            device=self.device,
            pooling_mode=PoolingMode.SUM if pooling == "sum" else PoolingMode.NONE,
        )
        # FBGEMM allocates weights and state with torch.zeros, whose pages the OS maps lazily:
        # touch them now, or page faults would be timed in the first steps.
        with torch.no_grad():
            for w in self.op.split_embedding_weights():
                w.fill_(0.01)
            for buf in self.op.buffers():
                if buf.is_floating_point() and buf.numel() > 0:
                    buf.mul_(1)
        self._grad: torch.Tensor | None = None

    @property
    def num_inputs(self) -> int:
        return 1  # one (indices, offsets) pair for the one op

    def make_batch(self, rng: np.random.Generator) -> DeviceBatch:
        b = shard_batch(self.shards, self.batch_size, rng)
        # FBGEMM's layout: indices concatenated table-major, offsets over T*B bags.
        indices = torch.cat([i for i, _ in b.per_shard])
        lengths = torch.cat([o[1:] - o[:-1] for _, o in b.per_shard])
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return DeviceBatch([(indices.to(self.device), offsets.to(self.device))], b.batch_size)

    def state_tensors(self) -> list[torch.Tensor]:
        return [b for b in self.op.buffers() if b.is_floating_point()] + list(self.op.parameters())

    def forward(self, batch: DeviceBatch) -> list[torch.Tensor]:
        indices, offsets = batch.per_shard[0]
        return [self.op(indices, offsets)]

    def step(self, batch: DeviceBatch) -> None:
        (out,) = self.forward(batch)
        if self._grad is None or self._grad.shape != out.shape:
            self._grad = torch.full_like(out, 1e-3)
        out.backward(self._grad)


class TorchKernel(DeviceKernel):
    """``F.embedding_bag`` (sum) over one concatenated weight per distinct width + sparse SGD;
    ``pooling="none"`` (sequence shards): ``F.embedding``, one vector per id."""

    def __init__(
        self,
        shards: Sequence[ShardInput],
        batch_size: int,
        device: str | torch.device = "cpu",
        optimizer: str = "sgd",
        pooling: str = "sum",
    ):
        super().__init__(shards, batch_size, device)
        _check_pooling(pooling, self.shards)
        self.pooling = pooling
        # Only SGD here: the torch backend is the portable fallback, not an optimizer zoo; timing
        # SGD for another optimizer's task would label the wrong update with that task's cost.
        check_torch_optimizer(optimizer)
        self.optimizer = optimizer
        fp16 = self.device.type == "cuda" and all(s.table.bytes_per_element == 2 for s in self.shards)
        dtype = torch.float16 if fp16 else torch.float32
        self.groups: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # shard ids, row offsets, weight
        dims = sorted({s.dim for s in self.shards})
        for d in dims:
            ids = [k for k, s in enumerate(self.shards) if s.dim == d]
            rows = [self.shards[k].rows for k in ids]
            row_off = torch.tensor([0] + list(np.cumsum(rows)[:-1]), dtype=torch.int64, device=self.device)
            w = torch.full((int(sum(rows)), d), 0.01, dtype=dtype, device=self.device)
            self.groups.append((ids, row_off, w.requires_grad_()))

    @property
    def num_inputs(self) -> int:
        return len(self.groups)  # one (indices, offsets) pair per weight group

    def make_batch(self, rng: np.random.Generator) -> DeviceBatch:
        b = shard_batch(self.shards, self.batch_size, rng)
        per_group = []
        for ids, row_off, _ in self.groups:
            idx = torch.cat([b.per_shard[k][0] + int(row_off[j]) for j, k in enumerate(ids)])
            lengths = torch.cat([b.per_shard[k][1][1:] - b.per_shard[k][1][:-1] for k in ids])
            off = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=off[1:])
            per_group.append((idx.to(self.device), off.to(self.device)))
        return DeviceBatch(per_group, b.batch_size)

    def state_tensors(self) -> list[torch.Tensor]:
        return [w for _, _, w in self.groups]

    def _group_forward(self, w: torch.Tensor, idx: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        if self.pooling == "none":
            return torch.nn.functional.embedding(idx, w, sparse=True)
        # include_last_offset: offsets has one entry per bag plus the end.
        return torch.nn.functional.embedding_bag(idx, w, off, mode="sum", sparse=True, include_last_offset=True)

    def forward(self, batch: DeviceBatch) -> list[torch.Tensor]:
        return [self._group_forward(w, idx, off) for (_, _, w), (idx, off) in zip(self.groups, batch.per_shard)]

    def step(self, batch: DeviceBatch) -> None:
        for (_, _, w), (idx, off) in zip(self.groups, batch.per_shard):
            out = self._group_forward(w, idx, off)  # one group at a time: its output freed before the next
            out.backward(torch.full_like(out, 1e-3))
            with torch.no_grad():
                w.add_(w.grad, alpha=-LEARNING_RATE)
            w.grad = None


def check_torch_optimizer(optimizer: str, task: str | None = None) -> None:
    """The torch backend times an SGD update only: any other optimizer is an InputError."""
    if optimizer != "sgd":
        whose = f"task {task!r} uses" if task is not None else "the task uses"
        raise InputError(f"the torch backend times an SGD update only and {whose} optimizer {optimizer!r}: "
                         "measure it with backend fbgemm (hardware=fbgemm_cpu or fbgemm_cuda)")


def check_fbgemm_optimizer(optimizer: str, device: str | torch.device, task: str | None = None) -> None:
    """FBGEMM's CPU kernel has no fused Adam: an InputError before anything is measured."""
    if torch.device(device).type == "cpu" and optimizer in FBGEMM_OPTIMIZERS and optimizer not in FBGEMM_CPU_OPTIMIZERS:
        whose = f"task {task!r} uses" if task is not None else "the task uses"
        raise InputError(f"FBGEMM's CPU kernel has no fused {optimizer!r} update and {whose} it: measure it on a GPU "
                         f"(hardware=fbgemm_cuda) or plan it without measuring (evaluate=estimated); on CPU it "
                         f"times {', '.join(FBGEMM_CPU_OPTIMIZERS)}")


def _check_pooling(pooling: str, shards: Sequence[ShardInput]) -> None:
    """A pooled op holds pooled shards; an unpooled one sequence shards of one width."""
    if pooling not in ("sum", "none"):
        raise InputError(f"pooling must be 'sum' or 'none', got {pooling!r}")
    sequence = pooling == "none"
    wrong = [s.table.name for s in shards if s.table.is_sequence != sequence]
    if wrong:
        raise InputError(f"a pooling={pooling!r} kernel holds {'sequence' if sequence else 'pooled'} shards only; "
                         f"got table(s) {wrong[:3]}")
    if sequence and len({s.dim for s in shards}) > 1:
        raise InputError(f"a pooling='none' kernel holds shards of one width; got {sorted({s.dim for s in shards})}")


class GroupKernel(DeviceKernel):
    """A device's pooled op and its unpooled ops (one per sequence width), stepped one after
    another: the device's whole embedding step. Its batch holds the parts' inputs in order."""

    def __init__(self, parts: Sequence[DeviceKernel]):
        super().__init__([s for p in parts for s in p.shards], max(p.batch_size for p in parts), parts[0].device)
        self.parts = list(parts)
        # fixed by the parts, so a batch made by another kernel of the same shards steps here too
        self._counts = [p.num_inputs for p in self.parts]

    @property
    def num_inputs(self) -> int:
        return sum(self._counts)

    def make_batch(self, rng: np.random.Generator) -> DeviceBatch:
        got = [p.make_batch(rng) for p in self.parts]
        return DeviceBatch([x for b in got for x in b.per_shard], self.batch_size)

    def _split(self, batch: DeviceBatch) -> list[DeviceBatch]:
        out, at = [], 0
        for p, n in zip(self.parts, self._counts):
            out.append(DeviceBatch(batch.per_shard[at:at + n], p.batch_size))
            at += n
        return out

    def forward(self, batch: DeviceBatch) -> list[torch.Tensor]:
        return [x for part, b in zip(self.parts, self._split(batch)) for x in part.forward(b)]

    def step(self, batch: DeviceBatch) -> None:
        for part, b in zip(self.parts, self._split(batch)):
            part.step(b)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.state_tensors()]


def make_kernel(
    backend: str,
    shards: Sequence[ShardInput],
    batch_size: int,
    device: str | torch.device = "cpu",
    optimizer: str = "sgd",
) -> DeviceKernel:
    """The kernel `backend` builds for one device's shards: one pooled op, one pooled op at the
    local batch ceil(batch_size / k) per number k of copies of its data-parallel pooled shards,
    and one unpooled op per width of its sequence shards (a `GroupKernel` when there are several)."""
    if backend == "fbgemm":
        if "fbgemm" not in available_backends():
            raise InputError("backend 'fbgemm' requested but fbgemm_gpu cannot be imported; use backend='torch'")
        cls: type = FbgemmKernel
    elif backend == "torch":
        cls = TorchKernel
    else:
        raise InputError(f"unknown hardware backend {backend!r}; one of {list(BACKENDS)}")
    pooled = [s for s in shards if not s.table.is_sequence and s.copies <= 1]
    by_copies: dict[int, list[ShardInput]] = {}
    by_width: dict[int, list[ShardInput]] = {}
    for s in shards:
        if s.table.is_sequence:
            by_width.setdefault(s.dim, []).append(s)
        elif s.copies > 1:  # each copy pools its own rank's samples: all of a smaller batch
            by_copies.setdefault(int(s.copies), []).append(replace(s, copies=1))
    parts = ([cls(pooled, batch_size, device, optimizer)] if pooled or not shards else [])
    parts += [cls(by_copies[k], -(-batch_size // k), device, optimizer) for k in sorted(by_copies)]
    parts += [cls(by_width[w], batch_size, device, optimizer, pooling="none") for w in sorted(by_width)]
    return parts[0] if len(parts) == 1 else GroupKernel(parts)
