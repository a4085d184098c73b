"""search=flexshard: FlexShard's row-level, topology-tiered plan for sequence tables.

Rows are ranked by their access counts on the fit batches (embshard.flexshard.stats); per
table, the hottest rows are replicated on every device, the next once per host (split over
its devices), the rest split over all devices (embshard.flexshard.layout.Tiers). The cuts
minimise modeled communication time, lookups plus the gradient sync of every replica, under
the task's per-device memory cap (embshard.flexshard.tiers). Pooled tables in the task are
placed table-wise first (the lookup-greedy baseline) and their memory is reserved.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from embshard.flexshard.baselines import hugectr_threshold_per_step
from embshard.flexshard.layout import Tiers, check_fits, tier_layout
from embshard.flexshard.stats import BatchSplit, task_access_stats
from embshard.flexshard.tiers import TableTiers, memory_per_device, modeled_ms, row_costs, solve
from embshard.plan import Plan
from embshard.search.base import Capabilities
from embshard.search.baselines import GreedySharder
from embshard.task import Task

log = logging.getLogger(__name__)


class FlexShardSharder:
    """Args:
        fit_batches: training steps 0..fit_batches-1 of the traces are what it learns from.
        seed: seeds the batches of tables without a trace.
        dedup_ids: the plan's data path sends each distinct id once per device and table.
        max_rounds: memory-fit iterations (each lowers the budget by the last overshoot).
    """

    capabilities = Capabilities(("sequence",), splits_tables=True)

    def __init__(self, fit_batches: int = 4, seed: int = 0, dedup_ids: bool = False, max_rounds: int = 8,
                 name: str = "flexshard"):
        self.split = BatchSplit(fit_batches, 1, seed)
        self.dedup_ids, self.max_rounds, self.name = dedup_ids, max_rounds, name
        self.last_search_info: dict = {}

    def shard(self, task: Task) -> Plan:
        sequence = [t for t in task.tables if t.is_sequence]
        pooled = [t for t in task.tables if not t.is_sequence]
        base = Plan(task.name, self.name, [], dedup_ids=self.dedup_ids)
        if pooled:
            sub = Task(task.name, task.num_devices, task.device_memory_bytes, task.batch_size, tuple(pooled),
                       task.optimizer, task.devices_per_host)
            base.shards += GreedySharder("lookup", name=self.name).shard(sub).shards
        if not sequence:
            return check_fits(task, base)
        stats = task_access_stats(task, self.split)
        D, P = task.num_devices, task.devices_per_host
        inputs = [TableTiers(t.name, t.rows, self._messages_per_step(stats[t.name].per_step, D),
                             row_costs(task, t.dim, t.bytes_per_element)) for t in sequence]
        reserved = max(base.memory_bytes(task))
        io = sum(task.shard_memory_bytes(t, t.rows, t.dim) - t.rows * inputs[i].costs.row_bytes
                 for i, t in enumerate(sequence)) / D
        budget = task.device_memory_bytes - reserved - io
        for _ in range(self.max_rounds):
            cuts, lam = solve(task, inputs, budget)
            plan = self._build(task, base, sequence, stats, cuts)
            over = max(plan.memory_bytes(task)) - task.device_memory_bytes
            if over <= 0:
                break
            budget -= over + 1
        else:
            cuts = [Tiers(0, 0)] * len(sequence)  # everything split: row-wise, or the shortfall
            plan, lam = self._build(task, base, sequence, stats, cuts), math.inf
        self._record(task, inputs, cuts, lam, budget, stats)
        return check_fits(task, plan)

    def _messages_per_step(self, per_step: np.ndarray, num_devices: int) -> np.ndarray:
        """Lookups of each row that travel per step: all of them, or with dedup_ids the expected
        number of devices whose samples touch the row (accesses spread as Poisson over devices:
        D (1 - exp(-a / D))); monotone in a, so the rows stay sorted."""
        if not self.dedup_ids:
            return per_step
        return num_devices * -np.expm1(-per_step / num_devices)

    def _build(self, task, base, sequence, stats, cuts) -> Plan:
        plan = Plan(task.name, self.name, list(base.shards), dedup_ids=self.dedup_ids)
        for t, c in zip(sequence, cuts):
            front, shards = tier_layout(task, t, stats[t.name].ids, c)
            plan.shards += shards
            if c.front:
                plan.row_maps[t.name] = front
        return plan

    def _record(self, task, inputs, cuts, lam, budget, stats) -> None:
        threshold = hugectr_threshold_per_step(task)
        replicated = [t.per_step[: c.replicated] for t, c in zip(inputs, cuts)]
        both = np.concatenate(replicated) if replicated else np.zeros(0)
        self.last_search_info = {
            "fit_batches": self.split.fit_batches,
            "lambda_ms_per_byte": lam,
            "budget_bytes_per_device": budget,
            "replicated_rows": int(sum(c.replicated for c in cuts)),
            "per_host_rows": int(sum(c.per_host for c in cuts)),
            "objective_ms": float(modeled_ms(inputs, cuts)),
            "weights_bytes_per_device": float(memory_per_device(inputs, cuts, task.num_devices, task.devices_per_host)),
            "hugectr_threshold_per_step": threshold,
            "replicated_rows_at_or_above_hugectr_threshold": int((both >= threshold).sum()),
            "least_accesses_per_step_replicated": float(both.min()) if both.size else None,
        }
        log.debug("flexshard on %s: %s", task.name, self.last_search_info)
