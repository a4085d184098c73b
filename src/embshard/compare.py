"""Plan tasks with several algorithms and evaluate the plans: the work behind shard.py."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from embshard.costs.base import CostModel, DeviceCosts, EnvelopeReporting
from embshard.errors import EmbshardError, InfeasibleError
from embshard.plan import Plan, validate
from embshard.search.base import Capabilities, GuardedSharder, Sharder
from embshard.search.constrained import fit_kind, needs_reduction, shard_constrained
from embshard.task import Task

log = logging.getLogger(__name__)

EVALUATE_MODES = ("none", "estimated", "measured", "traffic")
#: the extra row of a guarded searcher: its own pick before the guard's measurement
PICK_SUFFIX = "_pick"


@dataclass
class Result:
    """One algorithm on one task: the row report.json holds (docs/contracts.md)."""

    task: str
    algorithm: str
    valid: bool
    error: str | None = None
    plan: Plan | None = None
    search_seconds: float | None = None
    memory_bytes: list[int] = field(default_factory=list)
    #: shards (pieces of tables) on each device
    pieces: list[int] = field(default_factory=list)
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
    #: evaluate=measured: the speed probe tracked inside the measurement of this plan (its
    #: kernels interleaved with the plan's), to compare estimates at the speed they ran at
    measured_probe: dict[str, Any] | None = None

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
            "pieces": self.pieces,
            "estimated_device_costs": self.estimated.to_dict() if self.estimated else None,
            "measured_device_costs": self.measured.to_dict() if self.measured else None,
            "headroom": {k: c.headroom() for k, c in (("estimated", self.estimated), ("measured", self.measured)) if c},
            "envelope": self.envelope,
            "guard": self.guard,
            "traffic_bytes": self.traffic.traffic_bytes if self.traffic is not None else None,
            "modeled_comm_ms": self.modeled_comm_ms,
            "traffic": self.traffic.to_dict() if self.traffic is not None else None,
            "search_info": self.search_info,
            "measured_probe": self.measured_probe,
        }


def refusal(name: str, capabilities: Capabilities, task: Task) -> str | None:
    """Why algorithm `name` is not meant for `task` (one line), or None when it is.

    A task needs a table of a kind the algorithm is meant for. An algorithm not meant for
    sequence tables also refuses a task holding any: its cost models, policy or TorchRec's
    EmbeddingBagCollection model pooled lookups only, so its plan would be judged by the wrong
    model. One meant for sequence tables carries pooled tables beside them (the sequence data
    path runs both)."""
    kinds = sorted({t.kind for t in task.tables})
    meant = " or ".join(capabilities.table_kinds)
    if not set(kinds) & set(capabilities.table_kinds):
        hint = (" (flexshard, row_wise and size_lookup_greedy plan sequence tables)" if kinds == ["sequence"] else
                " (neuroshard, portfolio and the table-wise heuristics plan pooled tables)" if kinds == ["pooled"] else "")
        return f"{name} is meant for {meant} tables; task {task.name!r} has only {'/'.join(kinds)} tables{hint}"
    if "sequence" not in capabilities.table_kinds and "sequence" in kinds:
        seq = [t.name for t in task.tables if t.is_sequence]
        more = f" and {len(seq) - 3} more" if len(seq) > 3 else ""
        return (f"{name} plans {meant} tables only; task {task.name!r} has sequence table(s) "
                f"{', '.join(map(repr, seq[:3]))}{more} (size_lookup_greedy and the other table-wise heuristics "
                f"plan both kinds, flexshard too)")
    return None


def infeasible_hint(name: str, task: Task, catalogue: Mapping[str, Capabilities], table: str | None = None) -> str:
    """What would help when `name` found no plan that fits memory: more memory when the tables
    cannot fit in all the devices together (no plan can); when `table` (the one that did not
    fit) fits no device whole and its sharding_types allow no cut that does, which types would;
    else the algorithms of `catalogue` that split tables themselves and are meant for the task,
    when `name` does not (it cuts a table only to fit one device, search/constrained.py)."""
    short = memory_shortfall(task)
    if short:
        return short
    t = task.table_by_name.get(table) if table else None
    if (t is not None and not t.is_sequence and task.table_memory_bytes(t) > task.device_memory_bytes
            and fit_kind(task, t) is None):
        return (f"{t.name!r} fits no device whole and no cut its sharding_types allow fits one: allow "
                "column_wise with a smaller min_partition, or row_wise / table_row_wise")
    if catalogue[name].splits_tables:
        return ""
    splitters = [n for n, c in catalogue.items() if c.splits_tables and refusal(n, c, task) is None]
    if not splitters:
        return f"{name} places whole tables"
    who = splitters[0] if len(splitters) == 1 else f"{', '.join(splitters[:-1])} and {splitters[-1]}"
    return f"{name} places whole tables; {who} split tables: try algorithms=[{','.join(splitters)}]"


def memory_shortfall(task: Task) -> str | None:
    """Why no plan of `task` can fit, when its tables need more memory than all its devices
    hold together; None otherwise."""
    need = task.tables_memory_bytes()  # no split lowers it
    room = task.num_devices * task.device_memory_bytes
    if need <= room:
        return None
    return (f"the tables need {need} bytes in all ({binary_size(need)}: weights, optimizer state, outputs) "
            f"and {task.num_devices} devices hold {room} ({binary_size(room)}): no plan fits; "
            "add devices or memory per device")


def binary_size(nbytes: float) -> str:
    """Bytes for a reader: 1.73 GiB, 512.00 MiB, 3.20 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} bytes"


def plan_task(task: Task, sharders: Mapping[str, Sharder],
              catalogue: Mapping[str, Capabilities] | None = None) -> list[Result]:
    """Run every sharder on `task`; a plan that fails or breaks a rule is recorded, never kept.

    An algorithm not meant for the task's table kinds is refused (`refusal`) without running;
    a planner of pooled tables on a task of both kinds plans the pooled tables, around the
    sequence tables (`embshard.search.mixed`, as `embshard.plan` does; `search_info.mixed`).
    `catalogue`: the capabilities of every algorithm the caller knows by name (default: those
    of `sharders`), for the hints of infeasibility errors (`infeasible_hint`)."""
    from embshard.search.mixed import guard_mixed, is_mixed, shard_mixed

    catalogue = {**(catalogue or {}), **{name: s.capabilities for name, s in sharders.items()}}
    results = []
    for name, sharder in sharders.items():
        mixed = is_mixed(sharder.capabilities, task)
        reason = None if mixed else refusal(name, sharder.capabilities, task)
        if reason is not None:
            log.warning("%s on %s: refused: %s", name, task.name, reason)
            results.append(Result(task.name, name, valid=False, error=f"refused: {reason}"))
            continue
        start = time.perf_counter()
        try:
            # tables whose sharding_types leave out table_wise are shaped first (search/constrained.py)
            mixed_info = whole_guard = None
            if mixed:
                both = shard_mixed(task, lambda pooled, sharder=sharder: shard_constrained(sharder, pooled), name)
                mixed_info = both.info()
                plan, whole_guard = guard_mixed(task, both, sharder, name)
            else:
                plan = shard_constrained(sharder, task)
            seconds = time.perf_counter() - start
            plan.algorithm = name
            validate(task, plan)
        except EmbshardError as e:
            seconds = time.perf_counter() - start
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
            hint = infeasible_hint(name, task, catalogue, e.table) if isinstance(e, InfeasibleError) else ""
            error = f"{error}; {hint}" if hint else error
            log.warning("%s on %s: no valid plan: %s", name, task.name, error)
            results.append(Result(task.name, name, valid=False, error=error, search_seconds=seconds))
            continue
        # A sharder may report its own pure search time (TorchRec's excludes model building).
        # (on a task of both kinds: the whole of it, the sequence tables and the whole-plan guard too)
        if mixed_info is None:
            seconds = getattr(sharder, "last_search_seconds", None) or seconds
        # (where the whole task fell back to the sequence planner, the planner's own records are
        # of a search that failed, or of the task before: none of them is this plan's)
        fell_back = mixed_info is not None and "fallback" in mixed_info
        guard = sharder.last_guard if isinstance(sharder, GuardedSharder) and not fell_back else None
        guard_dict = guard.to_dict() if guard is not None else None
        info = dict(getattr(sharder, "last_search_info", None) or {}) if not fell_back else {}
        if mixed_info is not None:  # the search and its guard saw the pooled tables only
            info["mixed"] = mixed_info
            if guard_dict is not None:
                info["mixed"]["pooled_guard"] = guard_dict
            guard_dict = whole_guard  # the guard of the whole plan decided what was kept
        results.append(
            Result(task.name, name, valid=True, plan=plan, search_seconds=seconds, memory_bytes=plan.memory_bytes(task),
                   pieces=pieces_per_device(task, plan), guard=guard_dict, search_info=info or None)
        )
        # its pick is of the shaped task (of the pooled tables alone on a task of both kinds: no row)
        if guard is not None and not needs_reduction(task) and mixed_info is None:
            # the search's own pick beside the guarded one, so the model's quality stays visible
            pick = Plan(task.name, f"{name}{PICK_SUFFIX}", list(sharder.last_search_pick.shards))
            results.append(Result(task.name, pick.algorithm, valid=True, plan=pick,
                                  search_seconds=seconds - guard.measure_seconds, memory_bytes=pick.memory_bytes(task),
                                  pieces=pieces_per_device(task, pick), search_info=info or None))
    return results


def pieces_per_device(task: Task, plan: Plan) -> list[int]:
    counts = [0] * task.num_devices
    for s in plan.shards:
        counts[s.device] += 1
    return counts


def sequence_caveat(task: Task, mode: str, step: str = "kernels") -> str | None:
    """What `mode` leaves out of a task with sequence tables (one line), or None.

    Under `estimated` and `measured` (the kernels, `step="kernels"`) a sequence piece's
    all-to-all is its ids' vectors at the uniform-access share of its rows
    (`Plan.device_widths`); the ids are not replayed, so a row map's hot rows count as any
    others. `measured` times the unpooled kernels (one vector per id); the cost models of
    `estimated` were trained on pooled kernels. TorchRec's DMP step (`step="dmp"`) runs an
    EmbeddingCollection and routes every id, which leaves nothing out: None."""
    seq = [t.name for t in task.tables if t.is_sequence]
    if not seq or mode not in ("estimated", "measured") or (mode == "measured" and step == "dmp"):
        return None
    more = f" and {len(seq) - 2} more" if len(seq) > 2 else ""
    what = ("their kernels are timed unpooled (one vector per id)" if mode == "measured" else
            "the cost model prices their lookups as pooled ones (it was trained on pooled kernels; "
            "evaluate=measured times them unpooled)")
    return (f"task {task.name!r} has sequence table(s) {', '.join(map(repr, seq[:2]))}{more}: {what}, and their "
            "all-to-all is counted at uniform row shares, so hot rows and row maps count as any others; "
            "evaluate=traffic replays the ids through each plan, hardware=dmp_cpu times TorchRec's step")


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
        for r in valid:
            r.estimated = cost_model.device_costs(task, r.plan)
            if isinstance(cost_model, EnvelopeReporting):
                r.envelope = cost_model.envelope_report(task, r.plan)
    if mode == "measured":
        # identical plans (a guard that chose its search pick, heuristics that agree) are
        # measured once and share the measurement
        first: dict[tuple, int] = {}
        for i, r in enumerate(valid):
            first.setdefault(r.plan.signature(), i)
        unique = sorted(set(first.values()))
        costs = dict(zip(unique, evaluator.measure_many(task, [valid[i].plan for i in unique], visits=rounds)))
        tracked = evaluator.last_tracked
        for r in valid:
            r.measured = costs[first[r.plan.signature()]]
            r.measured_probe = tracked.to_dict() if tracked is not None else None
