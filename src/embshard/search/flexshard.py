"""search=flexshard: FlexShard's row-level, topology-tiered plan for sequence tables.

Rows are ranked by their access counts on the fit batches (embshard.flexshard.stats); per
table, the hottest rows are replicated on every device, the next once per host (split over
its devices), the rest split over all devices (embshard.flexshard.layout.Tiers). The cuts
minimise the modeled communication time of a step, lookups plus the sync of every replica,
with the slower link class of each phase counted (embshard.flexshard.tiers), under the task's
per-device memory cap. The global tier's hot rows (each carrying at least
`balance_fraction` of a device's mean global-tier load) are then placed on the least loaded
devices, all tables together, so the busiest device is close to the mean; the rest keep
TorchRec's hashed row blocks. By default the data path sends distinct ids only (TorchRec's
use_index_dedup) and syncs only the rows a step touched, and the search prices exactly that.
Pooled tables in the task are placed table-wise first (the lookup-greedy baseline) and their
memory is reserved.
"""

from __future__ import annotations

import logging

import numpy as np

from embshard.errors import InputError
from embshard.flexshard.baselines import hugectr_threshold_per_step
from embshard.flexshard.layout import Tiers, balance_placement, check_fits, tier_layout
from embshard.flexshard.stats import BatchSplit, task_access_stats
from embshard.flexshard.tiers import Solution, TierProblem, solve, split_everything
from embshard.flexshard.traffic import FLOAT_BYTES, ID_BYTES
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
        sparse_sync: replicas synchronise only the rows touched in the step (else every row).
        balance_fraction: global-tier rows whose expected load is at least this share of a
            device's mean global-tier load are placed explicitly (0: none, all hashed).
        max_rounds: memory-fit iterations (each lowers the budget by the last overshoot).
    """

    capabilities = Capabilities(("sequence",), splits_tables=True)

    def __init__(self, fit_batches: int = 4, seed: int = 0, dedup_ids: bool = True, sparse_sync: bool = True,
                 balance_fraction: float = 1e-3, max_rounds: int = 8, name: str = "flexshard"):
        if not (isinstance(balance_fraction, (int, float)) and 0 <= balance_fraction <= 1):
            raise InputError(f"flexshard: balance_fraction must be in [0, 1], got {balance_fraction!r}")
        self.split = BatchSplit(fit_batches, 1, seed)
        self.dedup_ids, self.sparse_sync, self.balance_fraction = dedup_ids, sparse_sync, float(balance_fraction)
        self.max_rounds, self.name = max_rounds, name
        self.last_search_info: dict = {}

    def shard(self, task: Task) -> Plan:
        sequence = [t for t in task.tables if t.is_sequence]
        pooled = [t for t in task.tables if not t.is_sequence]
        base = Plan(task.name, self.name, [], dedup_ids=self.dedup_ids, sparse_sync=self.sparse_sync)
        if pooled:
            sub = Task(task.name, task.num_devices, task.device_memory_bytes, task.batch_size, tuple(pooled),
                       task.optimizer, task.devices_per_host)
            base.shards += GreedySharder("lookup", name=self.name).shard(sub).shards
        if not sequence:
            return check_fits(task, base)
        stats = task_access_stats(task, self.split)
        problem = TierProblem.build(task, sequence, [stats[t.name].per_step for t in sequence], self.dedup_ids,
                                    self.sparse_sync)
        reserved = max(base.memory_bytes(task))
        io = sum(task.shard_memory_bytes(t, t.rows, t.dim) - t.rows * problem.row_bytes[i]
                 for i, t in enumerate(sequence)) / task.num_devices
        budget = task.device_memory_bytes - reserved - io
        for _ in range(self.max_rounds):
            solution = solve(problem, budget)
            cuts = self._place_global(task, sequence, stats, solution.cuts)
            plan = self._build(task, base, sequence, stats, cuts)
            over = max(plan.memory_bytes(task)) - task.device_memory_bytes
            if over <= 0:
                break
            budget -= over + 1
        else:
            solution = split_everything(problem)  # row-wise, or the shortfall
            cuts = solution.cuts
            plan = self._build(task, base, sequence, stats, cuts)
        self._record(task, problem, solution, cuts, budget, stats)
        return check_fits(task, plan)

    def _load(self, task: Task, table, per_step: np.ndarray) -> np.ndarray:
        """Expected bytes a holder receives and returns per step for rows with `per_step`
        accesses (the lookups that travel: all, or the distinct requests with dedup)."""
        D = task.num_devices
        n = D * -np.expm1(-per_step / D) if self.dedup_ids else per_step
        return n * (ID_BYTES + 2 * FLOAT_BYTES * table.dim)

    def _place_global(self, task: Task, sequence, stats, cuts: list[Tiers]) -> list[Tiers]:
        """The cuts with the global tier's hot rows placed on the least loaded devices (all
        tables together); the lighter rest stays hashed (module docstring)."""
        if self.balance_fraction <= 0 or task.num_devices == 1:
            return cuts
        loads = [self._load(task, t, stats[t.name].per_step[c.front:]) for t, c in zip(sequence, cuts)]
        mean = sum(float(w.sum()) for w in loads) / task.num_devices
        if mean <= 0:
            return cuts
        # rows are sorted by load, descending: the hot ones are a prefix of each table's global tier
        heavy = [w[: int(np.searchsorted(-w, -self.balance_fraction * mean, side="right"))] for w in loads]
        devices = balance_placement(heavy, task.num_devices)
        return [Tiers(c.replicated, c.per_host, d) for c, d in zip(cuts, devices)]

    def _build(self, task, base, sequence, stats, cuts) -> Plan:
        plan = Plan(task.name, self.name, list(base.shards), dedup_ids=self.dedup_ids, sparse_sync=self.sparse_sync)
        for t, c in zip(sequence, cuts):
            front, shards = tier_layout(task, t, stats[t.name].ids, c)
            plan.shards += shards
            if c.moved:
                plan.row_maps[t.name] = front
        return plan

    def _record(self, task, problem: TierProblem, solution: Solution, cuts: list[Tiers], budget, stats) -> None:
        threshold = hugectr_threshold_per_step(task)
        replicated = [stats[name].per_step[: c.replicated] for name, c in zip(problem.names, cuts)]
        both = np.concatenate(replicated) if replicated else np.zeros(0)
        self.last_search_info = {
            "fit_batches": self.split.fit_batches,
            "dedup_ids": self.dedup_ids,
            "sparse_sync": self.sparse_sync,
            "lambda_ms_per_byte": solution.lam,
            "theta_intra_all_to_all": solution.theta,
            "budget_bytes_per_device": budget,
            "replicated_rows": int(sum(c.replicated for c in cuts)),
            "per_host_rows": int(sum(c.per_host for c in cuts)),
            "placed_global_rows": int(sum(len(c.placed) for c in cuts)),
            "objective_ms": float(solution.objective_ms),
            "expected_ms": {"all_to_all_intra": solution.a2a_intra_ms, "all_to_all_inter": solution.a2a_inter_ms,
                            "replica_sync": solution.sync_ms},
            "weights_bytes_per_device": float(solution.memory_bytes),
            "hugectr_threshold_per_step": threshold,
            "replicated_rows_at_or_above_hugectr_threshold": int((both >= threshold).sum()),
            "least_accesses_per_step_replicated": float(both.min()) if both.size else None,
        }
        log.debug("flexshard on %s: %s", task.name, self.last_search_info)
