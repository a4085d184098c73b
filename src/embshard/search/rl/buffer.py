"""The replay buffer of measured plans and shards the cost networks learn from.

A record is one measured plan (or one measured shard: a plan of one device): its tables'
normalised inputs, the device of each table, and per-device labels in ms (compute = the
fused forward+backward kernel; forward comm including the wait for the slowest device;
backward comm; NaN where not measured) plus two plan-level labels: the full measured plan
cost, and max over devices of compute + backward comm (DreamShard's reference cost, with no
forward comm). Compute samples of the cost-data collection (`train.py stage=collect`,
compute.jsonl) enter as one-device records with only the compute label.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from embshard.costs.base import DeviceCosts
from embshard.plan import Plan
from embshard.search.rl.features import FeatureNorm
from embshard.search.rl.nets import AutoShardNet, DreamShardCostNet
from embshard.tables import Table
from embshard.task import Task

_TABLE_KEYS = ("name", "rows", "dim", "pooling_factor", "reuse_histogram", "bytes_per_element")


@dataclass
class Record:
    x: torch.Tensor           # [n, F]
    device_of: torch.Tensor   # [n] long
    num_devices: int
    labels_ms: torch.Tensor   # [D, 3], NaN where not measured
    plan_ms: float
    plan_no_forward_ms: float
    source: str


@dataclass
class Batch:
    x: torch.Tensor            # [sum n, F]
    slot: torch.Tensor         # [sum n] index of (record, device) in the padded [B, D] grid
    shape: tuple[int, int]     # (B, Dmax)
    device_mask: torch.Tensor  # [B, Dmax]
    labels_ms: torch.Tensor    # [B, Dmax, 3]
    plan_ms: torch.Tensor      # [B]
    plan_no_forward_ms: torch.Tensor

    def sums(self, encoder: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-device encoding sums [B, Dmax, E] and table counts [B, Dmax]."""
        b, d = self.shape
        enc = encoder(self.x)
        sums = torch.zeros(b * d, enc.shape[1]).index_add(0, self.slot, enc)
        counts = torch.zeros(b * d).index_add(0, self.slot, torch.ones(len(self.slot)))
        return sums.view(b, d, -1), counts.view(b, d)


class Buffer:
    """Measured plans and shards, with the batching the cost losses need."""

    def __init__(self, norm: FeatureNorm):
        self.norm = norm
        self.records: list[Record] = []

    def __len__(self) -> int:
        return len(self.records)

    def count(self, source: str) -> int:
        return sum(r.source == source for r in self.records)

    def add_plan(self, task: Task, plan: Plan, costs: DeviceCosts, source: str = "policy") -> None:
        """A measured plan, labels as measured (an evaluator without communication reports
        0 ms of comm: the networks then learn the compute-only cost it measured)."""
        tables = task.table_by_name
        x = torch.from_numpy(self.norm([tables[s.table] for s in plan.shards], task.batch_size))
        labels = torch.tensor([costs.compute_ms, costs.forward_comm_ms, costs.backward_comm_ms], dtype=torch.float32).T
        no_fw = max(c + b for c, b in zip(costs.compute_ms, costs.backward_comm_ms))
        self.records.append(Record(x, torch.tensor([s.device for s in plan.shards]), task.num_devices, labels,
                                   costs.plan_cost_ms, no_fw, source))

    def add_compute_samples(self, samples: Sequence[dict[str, Any]], source: str = "cost_data") -> int:
        """One-device records from cost-data compute samples (extra keys are ignored)."""
        n = 0
        for s in samples:
            tables = [Table.from_dict({k: t[k] for k in _TABLE_KEYS if k in t}) for t in s["tables"]]
            x = torch.from_numpy(self.norm(tables, int(s["batch_size"])))
            ms = float(s["median_ms"])
            labels = torch.tensor([[ms, math.nan, math.nan]], dtype=torch.float32)
            # one device: no all-to-all, so the plan cost is its compute
            self.records.append(Record(x, torch.zeros(len(tables), dtype=torch.long), 1, labels, ms, ms, source))
            n += 1
        return n

    def sample(self, size: int, rng: np.random.Generator) -> Batch:
        idx = rng.integers(0, len(self.records), size=min(size, len(self.records)) if size > 0 else len(self.records))
        return self.batch([self.records[i] for i in idx])

    @staticmethod
    def batch(records: Sequence[Record]) -> Batch:
        d = max(r.num_devices for r in records)
        b = len(records)
        labels = torch.full((b, d, 3), math.nan)
        mask = torch.zeros(b, d, dtype=torch.bool)
        for i, r in enumerate(records):
            labels[i, : r.num_devices] = r.labels_ms
            mask[i, : r.num_devices] = True
        return Batch(
            x=torch.cat([r.x for r in records]),
            slot=torch.cat([i * d + r.device_of for i, r in enumerate(records)]),
            shape=(b, d),
            device_mask=mask,
            labels_ms=labels,
            plan_ms=torch.tensor([r.plan_ms for r in records]),
            plan_no_forward_ms=torch.tensor([r.plan_no_forward_ms for r in records]),
        )


def _log_mse(pred_log: torch.Tensor, label_ms: torch.Tensor) -> torch.Tensor:
    ok = ~torch.isnan(label_ms)
    if not ok.any():
        return pred_log.sum() * 0.0
    return ((pred_log[ok] - torch.log1p(label_ms[ok])) ** 2).mean()


def dreamshard_cost_loss(net: DreamShardCostNet, batch: Batch, reward_comm: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """MSE in log(1 + ms) of the per-device heads and of the overall head (whose label is
    the full plan cost with `reward_comm`, else max of compute + backward comm)."""
    sums, counts = batch.sums(net.encoder)
    dev = net.device_log(sums, counts, batch.device_mask)
    labels = batch.labels_ms.masked_fill(~batch.device_mask.unsqueeze(-1), math.nan)
    parts = {name: _log_mse(dev[..., i], labels[..., i]) for i, name in enumerate(("compute", "forward_comm", "backward_comm"))}
    parts["overall"] = _log_mse(net.plan_log(sums, batch.device_mask), batch.plan_ms if reward_comm else batch.plan_no_forward_ms)
    loss = sum(parts.values())
    return loss, {k: float(v.detach()) for k, v in parts.items()}


def autoshard_cost_loss(net: AutoShardNet, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """MSE in log(1 + ms) of every measured shard's compute."""
    sums, counts = batch.sums(net.encoder)
    labels = batch.labels_ms[..., 0].masked_fill(~batch.device_mask, math.nan)
    loss = _log_mse(net.shard_log(sums, counts), labels)
    return loss, {"compute": float(loss.detach())}
