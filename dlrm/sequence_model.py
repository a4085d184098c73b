"""A sequence DLRM trained on a row-level sharding plan (FlexShard and its baselines).

* Sparse part: every sequence feature through `ShardedSequenceEmbedding` (one vector per id).
* Dense part (data-parallel, DDP): a bottom MLP on the dense features gives a query; each
  feature's sequence is projected to the query width and pooled by target attention
  (softmax over the sample's own ids of query · key); the query and the pooled vectors go
  through the over arch to one logit; BCE loss.
* Data: every table's ids replayed from its trace, step after step (embshard.flexshard.stats:
  held-out steps, not the ones plans were fitted on), standard-normal dense features, labels
  from a planted logistic model (dense part plus a +-1 effect per row, averaged over the
  sequence), so the loss can fall.

Embedding gradients are summed over ranks (as in TorchRec's sharded collections); the dense
part's are averaged by DDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from embshard.flexshard.stats import step_batch
from embshard.hardware.comm import batch_split
from embshard.plan import Plan
from embshard.task import Task

from dlrm.data import ROW_EFFECT, _HASH
from dlrm.sequence_embedding import ShardedSequenceEmbedding


@dataclass
class SequenceBatch:
    """One rank's batch: dense features, per table the ids (flat) and sequence lengths, labels."""

    dense: torch.Tensor
    ids: dict[str, torch.Tensor]
    lengths: dict[str, torch.Tensor]
    labels: torch.Tensor


def sequence_batches(task: Task, steps: Sequence[int], rank: int, world: int, dense_in: int, seed: int) -> list[SequenceBatch]:
    """This rank's share of the global batch of each training step in `steps` (every rank
    computes the same global labels, then keeps its samples)."""
    teacher = np.random.default_rng([seed, 2**31 - 1])
    dense_w = teacher.standard_normal(dense_in) / math.sqrt(dense_in)
    salts = teacher.integers(0, 2**31, size=len(task.tables), dtype=np.uint64)
    sizes = batch_split(task.batch_size, world)
    first, b = sum(sizes[:rank]), sizes[rank]
    out = []
    for step in steps:
        rng = np.random.default_rng([seed, 7, step])
        dense = rng.standard_normal((task.batch_size, dense_in), dtype=np.float32)
        logit = dense @ dense_w
        ids, lengths = {}, {}
        for t, salt in zip(task.tables, salts):
            idx, lens = step_batch(t, task.batch_size, step, seed)
            sign = (((idx.astype(np.uint64) ^ salt) * _HASH) >> np.uint64(15)) & np.uint64(1)
            per_sample = np.bincount(np.repeat(np.arange(task.batch_size), lens), weights=2.0 * sign - 1.0,
                                     minlength=task.batch_size)
            logit = logit + ROW_EFFECT * per_sample / np.maximum(lens, 1) / math.sqrt(len(task.tables))
            offsets = np.concatenate([[0], np.cumsum(lens)])
            ids[t.name] = torch.from_numpy(idx[offsets[first]:offsets[first + b]].copy())
            lengths[t.name] = torch.from_numpy(lens[first:first + b].copy())
        labels = (rng.random(task.batch_size) < 1.0 / (1.0 + np.exp(-2.0 * logit))).astype(np.float32)
        out.append(SequenceBatch(torch.from_numpy(dense[first:first + b].copy()), ids, lengths,
                                 torch.from_numpy(labels[first:first + b].copy())))
    return out


def _mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SequenceDenseArch(nn.Module):
    """Bottom MLP -> query; per feature: projection and target-attention pooling; over arch -> logit."""

    def __init__(self, task: Task, dense_in: int, dense_arch: Sequence[int], over_arch: Sequence[int]):
        super().__init__()
        width = dense_arch[-1]
        self.bottom = _mlp([dense_in, *dense_arch], last_relu=True)
        self.keys = nn.ModuleDict({t.name: nn.Linear(t.dim, width, bias=False) for t in task.tables})
        self.over = _mlp([width * (1 + len(task.tables)), *over_arch], last_relu=False)
        self.width = width

    def forward(self, dense: torch.Tensor, embeddings: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]) -> torch.Tensor:
        query = self.bottom(dense)
        b = query.shape[0]
        pooled = [query]
        for name, proj in self.keys.items():
            keys = proj(embeddings[name])
            sample = torch.repeat_interleave(torch.arange(b), lengths[name])
            score = (keys * query[sample]).sum(1) / math.sqrt(self.width)
            top = torch.full((b,), -torch.inf).scatter_reduce(0, sample, score, "amax", include_self=True)
            weight = torch.exp(score - top[sample])
            weight = weight / torch.zeros(b).index_add(0, sample, weight)[sample]
            pooled.append(torch.zeros(b, self.width).index_add(0, sample, weight[:, None] * keys))
        return self.over(torch.cat(pooled, dim=1)).squeeze(1)


@dataclass
class StepComm:
    """What one step sent (bytes by purpose and link class) and how long its collectives took."""

    seconds: dict[str, float]
    wait_seconds: dict[str, float]
    bytes: dict[str, dict[str, float]]


@dataclass
class ShardedSequenceDLRM:
    """The sequence DLRM under one plan: sharded embeddings, DDP dense part, their optimizers.

    `step(batches)` trains on the next batch; `comm` records every step's communication.
    Has the interface dlrm.runner.interleaved_throughput expects (label, step, lookup_timer).
    """

    label: str
    embeddings: ShardedSequenceEmbedding
    dense: nn.Module
    embedding_optimizer: torch.optim.Optimizer
    dense_optimizer: torch.optim.Optimizer
    lookup_timer: None = None
    comm: list[StepComm] = field(default_factory=list)

    @classmethod
    def build(cls, label: str, task: Task, plan: Plan, rank: int, world: int, dense_in: int,
              dense_arch: Sequence[int], over_arch: Sequence[int], embedding_lr: float, dense_lr: float,
              seed: int, barrier_first: bool = False) -> "ShardedSequenceDLRM":
        embeddings = ShardedSequenceEmbedding(task, plan, rank, world, seed=seed, barrier_first=barrier_first)
        torch.manual_seed(seed)  # the same dense weights on every rank and under every plan
        dense = SequenceDenseArch(task, dense_in, dense_arch, over_arch)
        ddp = nn.parallel.DistributedDataParallel(dense) if world > 1 else dense
        return cls(label, embeddings, ddp, torch.optim.SGD(embeddings.parameters(), lr=embedding_lr),
                   torch.optim.Adam(ddp.parameters(), lr=dense_lr))

    def step(self, batches: Iterator[SequenceBatch]) -> torch.Tensor:
        batch = next(batches)
        self.embedding_optimizer.zero_grad(set_to_none=True)
        self.dense_optimizer.zero_grad(set_to_none=True)
        self.embeddings.ledger.reset()
        emb = self.embeddings(batch.ids)
        logits = self.dense(batch.dense, emb, batch.lengths)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        loss.backward()
        self.embeddings.sync_replica_grads()
        self.embedding_optimizer.step()
        self.dense_optimizer.step()
        ledger = self.embeddings.ledger
        self.comm.append(StepComm(dict(ledger.seconds), dict(ledger.wait_seconds), {p: dict(v) for p, v in ledger.bytes.items()}))
        return loss.detach()
