"""Plan tasks with several algorithms and evaluate the plans: the work behind shard.py."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from embshard.costs.base import CostModel, DeviceCosts
from embshard.errors import EmbshardError
from embshard.plan import Plan, validate
from embshard.search.base import Sharder
from embshard.task import Task

log = logging.getLogger(__name__)

EVALUATE_MODES = ("none", "estimated", "measured", "traffic")
#: the extra row of a guarded searcher: its own pick before the guard's measurement
PICK_SUFFIX = "_pick"


@dataclass
class Result:
    """One algorithm on one task: the row report.json holds (docs/usage.md, "Contracts")."""

    task: str
    algorithm: str
    valid: bool
    error: str | None = None
    plan: Plan | None = None
    search_seconds: float | None = None
    memory_bytes: list[int] = field(default_factory=list)
    estimated: DeviceCosts | None = None
    measured: DeviceCosts | None = None
    #: the cost models' training envelope vs this plan (`NeuralCostModels.envelope_report`)
    envelope: dict[str, Any] | None = None
    #: the measured guard's candidates and choice (NeuroShard with verify > 0)
    guard: dict[str, Any] | None = None
    #: evaluate=traffic: an embshard.flexshard.traffic.TrafficReport
    traffic: Any = None
    #: what the searcher reports about its own search (e.g. the batches it was fitted on)
    search_info: dict[str, Any] | None = None

    @property
    def estimated_cost_ms(self) -> float | None:
        return self.estimated.plan_cost_ms if self.estimated else None

    @property
    def measured_cost_ms(self) -> float | None:
        return self.measured.plan_cost_ms if self.measured else None

    @property
    def modeled_comm_ms(self) -> float | None:
        return self.traffic.modeled_comm_ms if self.traffic is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "algorithm": self.algorithm,
            "valid": self.valid,
            "error": self.error,
            "search_seconds": self.search_seconds,
            "estimated_cost_ms": self.estimated_cost_ms,
            "measured_cost_ms": self.measured_cost_ms,
            "measured_spread_ms": self.measured.plan_cost_spread_ms if self.measured else None,
            "memory_bytes": self.memory_bytes,
            "estimated_device_costs": self.estimated.to_dict() if self.estimated else None,
            "measured_device_costs": self.measured.to_dict() if self.measured else None,
            "headroom": {k: c.headroom() for k, c in (("estimated", self.estimated), ("measured", self.measured)) if c},
            "envelope": self.envelope,
            "guard": self.guard,
            "traffic_bytes": self.traffic.traffic_bytes if self.traffic is not None else None,
            "modeled_comm_ms": self.modeled_comm_ms,
            "traffic": self.traffic.to_dict() if self.traffic is not None else None,
            "search_info": self.search_info,
        }


def plan_task(task: Task, sharders: Mapping[str, Sharder]) -> list[Result]:
    """Run every sharder on `task`; a plan that fails or breaks a rule is recorded, never kept."""
    results = []
    for name, sharder in sharders.items():
        start = time.perf_counter()
        try:
            plan = sharder.shard(task)
            seconds = time.perf_counter() - start
            plan.algorithm = name
            validate(task, plan)
        except EmbshardError as e:
            seconds = time.perf_counter() - start
            log.warning("%s on %s: no valid plan: %s", name, task.name, e)
            results.append(Result(task.name, name, valid=False, error=str(e), search_seconds=seconds))
            continue
        # A sharder may report its own pure search time (TorchRec's excludes model building).
        seconds = getattr(sharder, "last_search_seconds", None) or seconds
        guard = getattr(sharder, "last_guard", None)
        info = getattr(sharder, "last_search_info", None)
        results.append(
            Result(task.name, name, valid=True, plan=plan, search_seconds=seconds, memory_bytes=plan.memory_bytes(task),
                   guard=guard.to_dict() if guard is not None else None, search_info=dict(info) if info else None)
        )
        if guard is not None:
            # the search's own pick beside the guarded one, so the model's quality stays visible
            pick = Plan(task.name, f"{name}{PICK_SUFFIX}", list(sharder.last_search_pick.shards))
            results.append(Result(task.name, pick.algorithm, valid=True, plan=pick,
                                  search_seconds=seconds - guard.measure_seconds, memory_bytes=pick.memory_bytes(task)))
    return results


def evaluate_task(
    task: Task,
    results: Sequence[Result],
    mode: str,
    cost_model: CostModel | None = None,
    evaluator: Any = None,
    rounds: int | None = None,
) -> None:
    """Fill in estimated and/or measured costs of the valid results in place.

    `measured` measures all valid plans of the task together, interleaved (A B A B …),
    so machine drift hits every algorithm alike; it also fills the estimate. `traffic`
    replays held-out batches through each plan (`evaluator` is a TrafficEvaluator).
    """
    valid = [r for r in results if r.valid]
    if mode == "none" or not valid:
        return
    if mode == "traffic":
        fitted = [(r.search_info or {}).get("fit_batches") for r in valid]
        for r, report in zip(valid, evaluator.evaluate(task, [r.plan for r in valid], fitted)):
            r.traffic = report
        return
    if cost_model is not None:
        report = getattr(cost_model, "envelope_report", None)
        for r in valid:
            r.estimated = cost_model.device_costs(task, r.plan)
            if callable(report):
                r.envelope = report(task, r.plan)
    if mode == "measured":
        # identical plans (a guard that chose its search pick, heuristics that agree) are
        # measured once and share the measurement
        first: dict[tuple, int] = {}
        for i, r in enumerate(valid):
            first.setdefault(r.plan.signature(), i)
        unique = sorted(set(first.values()))
        costs = dict(zip(unique, evaluator.measure_many(task, [valid[i].plan for i in unique], visits=rounds)))
        for r in valid:
            r.measured = costs[first[r.plan.signature()]]
