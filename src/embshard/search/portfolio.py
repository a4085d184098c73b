"""The portfolio (`search=portfolio`): every learned planner and every heuristic plans the
task, the cost models rank their plans, and with hardware attached the measured guard decides.

1. Every member runs (NeuroShard, DreamShard, AutoShard and the six heuristics by default;
   each in seconds, none of them measuring: a member's own guard stays off). A member that
   refuses the task or finds no plan is recorded with its reason; the others go on. On a big
   task the members plan in forked worker processes, as many at once as the machine has
   cores (`workers`); each member plans exactly as it would alone.
2. The distinct plans are ranked by the cost models (`ranker`: the neural checkpoint's
   `device_costs`, whose all-to-alls fall back to the analytic model where the comm models
   cannot be trusted; None: the analytic model). Without hardware the cheapest is returned.
3. With an evaluator attached (`shard.py evaluate=measured`; `verify="auto"`: the 3 best),
   the `verify` best-ranked plans of the members that are not the guard's heuristics (the
   learned planners' plans) go to the measured guard (`embshard.search.guard`) with the
   heuristics' plans: the best-measured of them is kept only where its paired bootstrap
   interval against the best heuristic's plan lies below 1, else that heuristic's plan is.

`last_search_info["portfolio"]` (report.json: `search_info.portfolio`) names every member's
result and predicted cost, the member whose plan the ranking picked (`pick`), the member whose
plan was returned (`won`) and the guard's interval (`interval`, with its verdict); `guard` is
the guard's own record, and `portfolio_pick` the ranking's pick measured beside it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Mapping, Sequence

from embshard.compare import refusal
from embshard.costs.base import CostModel
from embshard.costs.features import adopt_imputed, imputed_histograms, pending_imputations, planning_view
from embshard.costs.predictor import DEFAULT_CHECKPOINT, AnalyticFamily, load_models
from embshard.errors import EmbshardError, InfeasibleError, InputError
from embshard.plan import Plan, validate
from embshard.search.base import Capabilities, Sharder
from embshard.search.constrained import shard_constrained
from embshard.search.floor import HeuristicFloor
from embshard.search.guard import DEFAULT_HEURISTICS, GuardResult, GuardSlot, MeasuredGuard, heuristic_sharders
from embshard.search.neuroshard import NeuroShardSharder
from embshard.search.refine import MeasuredRefinement
from embshard.search.rl.sharders import RLSharder
from embshard.search.simulator import Simulator, batch_ratio
from embshard.task import Task

log = logging.getLogger(__name__)

#: the learned members, by their conf/search names
LEARNED = ("neuroshard", "dreamshard", "autoshard")

#: `workers="auto"` plans the members in forked workers on tasks of at least this many tables or
#: of PARALLEL_FROM_PAIRS table x device pairs (856 x 128 is 109,568): from about 100 tables on
#: the learned members take long enough that workers save a third or more of the wall time
#: (`scripts/bench_portfolio_workers.py`); below, neither way is faster beyond the run-to-run noise
PARALLEL_FROM_TABLES = 100
PARALLEL_FROM_PAIRS = 100_000

#: (the portfolio, the task, the ranker) while its members plan in forked workers, which
#: inherit it (nothing is pickled on the way in: the members hold networks)
_FORKED: tuple[Any, Task, CostModel] | None = None


def default_members() -> dict[str, Sharder]:
    """NeuroShard (its guard off), DreamShard and AutoShard (shipped checkpoints, their conf/search
    defaults; `PortfolioSharder` turns the three's floors off) and the six heuristics."""
    from embshard.search.rl.sharders import AutoShardSharder, DreamShardSharder

    out: dict[str, Sharder] = {
        "neuroshard": NeuroShardSharder(verify=0),
        "dreamshard": DreamShardSharder("checkpoints/dreamshard_cpu/policy.pt", samples=8, split_columns=True,
                                        split_judge=DEFAULT_CHECKPOINT, judge_samples=True),
        "autoshard": AutoShardSharder("checkpoints/autoshard_cpu/policy.pt", samples=8, split_columns=True,
                                      split_judge=DEFAULT_CHECKPOINT, judge_samples=True),
    }
    out.update({name: make() for name, make in heuristic_sharders().items()})
    return out


class PortfolioSharder(GuardSlot):
    """The portfolio planner (module docstring).

    Args:
        members: the planners, by name (None: `default_members()`). shard.py passes the
            `searchers` entries of conf/search/portfolio.yaml, so a member follows the same
            overrides as when it runs alone (`searchers.neuroshard.checkpoint=...`).
        ranker: the cost models that rank the members' plans: a neural checkpoint (relative
            paths from the project root; default: the shipped one), or None for the analytic
            model.
        verify: with an evaluator attached, measure this many of the best-ranked plans of
            members that are not the guard's heuristics with the guard (which measures the
            heuristics' plans anyway); "auto": 3 when an evaluator is attached, else 0.
        verify_heuristics, verify_visits, verify_budget_s, verify_min_rounds,
            verify_max_rounds, verify_contenders, verify_margin, verify_interval,
            verify_search_contenders: the guard's settings (`MeasuredGuard`).
        verify_refine: after the guard's first round, correct the ranker's compute model on
            the measured shards and refine the best measured plan against it
            (`embshard.search.refine`); the refined plan joins the paired rounds.
        workers: how many members plan at once, each in a forked worker process (Linux; one
            thread each); 1: one after another in this process; "auto": the machine's cores
            (at most one per member) on tasks of at least PARALLEL_FROM_TABLES tables or
            PARALLEL_FROM_PAIRS table x device pairs, else 1, and 1 in a daemonic process
            (which may not start workers). The plans are the same either way (every member
            seeds its own sampling); only the wall time differs.
        name: the algorithm name of the plans.
    """

    #: ranks pooled-table planners' plans with pooled-kernel cost models; its members split tables
    capabilities = Capabilities(("pooled",), splits_tables=True)

    def __init__(
        self,
        members: Mapping[str, Sharder] | None = None,
        ranker: str | os.PathLike | None = DEFAULT_CHECKPOINT,
        verify: int | str = "auto",
        verify_heuristics: Sequence[str] = DEFAULT_HEURISTICS,
        verify_visits: int | None = None,
        verify_budget_s: float = 60.0,
        verify_min_rounds: int = 3,
        verify_max_rounds: int = 10,
        verify_contenders: int = 2,
        verify_margin: float = 0.1,
        verify_interval: str = "bootstrap",
        verify_search_contenders: int = 1,
        verify_refine: bool = False,
        workers: int | str = "auto",
        name: str = "portfolio",
    ):
        self.check_verify(verify, name)
        self.members: dict[str, Sharder] = dict(members) if members is not None else default_members()
        if not self.members:
            raise InputError(f"{name}: members must name at least one planner")
        for member, sharder in self.members.items():
            if not isinstance(sharder, Sharder):
                raise InputError(f"{name}: member {member!r} is not a planner (a Sharder), got {type(sharder).__name__}")
            if isinstance(sharder, (NeuroShardSharder, RLSharder)):
                sharder.floor = HeuristicFloor(None)  # off: the ranking prices the heuristics' plans itself
        self.ranker = None if ranker in (None, "") else str(ranker)
        if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise InputError(f"{name}: workers must be a positive integer or 'auto', got {workers!r}")
        self.workers = workers
        self.verify = verify
        self.guard = MeasuredGuard(verify_heuristics, verify_visits, verify_budget_s, verify_min_rounds,
                                   verify_max_rounds, verify_contenders, verify_margin,
                                   owner=name, interval=verify_interval,
                                   search_contenders=verify_search_contenders, refine=verify_refine)
        self.name = name
        self.evaluator: Any = None
        self._ranker: tuple[CostModel, dict[str, Any]] | None = None
        self.last_search_seconds: float | None = None
        self.last_predicted_cost_ms: float | None = None
        self.last_guard: GuardResult | None = None
        self.last_search_pick: Plan | None = None
        self.last_search_info: dict[str, Any] = {}

    # ------------------------------------------------------------------ GuardedSharder
    # attach_evaluator and verify_count: GuardSlot (the members never measure)

    def ranking_model(self) -> tuple[CostModel, dict[str, Any]]:
        """(the cost model that ranks, what report.json says about it), loaded once."""
        if self._ranker is None:
            if self.ranker is None:
                from embshard.costs.analytic import AnalyticCostModel

                self._ranker = (AnalyticCostModel(), {"cost_model": "analytic", "checkpoint": None})
            else:
                models = load_models(self.ranker, self.name)
                self._ranker = (models.neural, models.info)
        return self._ranker

    def refinement_for(self, task: Task) -> MeasuredRefinement:
        """The guard's refiner on `task`: the ranker's models (the analytic one for ranker=None)."""
        family = AnalyticFamily() if self.ranker is None else self.ranking_model()[0]  # the neural bundle is one
        simulator = Simulator(family.at_batch(int(task.batch_size)))
        view, _ = planning_view(task)
        return MeasuredRefinement(view, simulator, batch_ratio(simulator.predictor, task))

    def worker_count(self, task: Task) -> int:
        """How many members plan at once on `task` (`workers`)."""
        if sys.platform != "linux" or "fork" not in multiprocessing.get_all_start_methods():
            return 1
        if self.workers == "auto":
            if multiprocessing.current_process().daemon:  # a pool's worker: it may not have children
                return 1
            if len(task.tables) < PARALLEL_FROM_TABLES and len(task.tables) * task.num_devices < PARALLEL_FROM_PAIRS:
                return 1
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            return max(1, min(cores, len(self.members)))
        return min(int(self.workers), len(self.members))

    def plan_member(self, member: str, task: Task, ranker: CostModel) -> tuple[dict[str, Any], Plan | None, EmbshardError | None]:
        """(its report row, its validated plan or None, the error that stopped it or None) of
        one member, the plan's predicted cost (ms) by `ranker` in the row."""
        sharder = self.members[member]
        row: dict[str, Any] = {"member": member}
        why = refusal(member, sharder.capabilities, task)
        if why is not None:
            return row | {"valid": False, "error": f"refused: {why}"}, None, None
        t0 = time.perf_counter()
        try:
            plan = shard_constrained(sharder, task)  # a whole-table member gets tables too large for a device cut
            validate(task, plan)
        except EmbshardError as e:
            return (row | {"valid": False, "error": str(e).splitlines()[0] if str(e) else type(e).__name__,
                           "search_seconds": round(time.perf_counter() - t0, 4)}, None, e)
        row |= {"valid": True, "search_seconds": round(time.perf_counter() - t0, 4),
                "predicted_ms": ranker.device_costs(task, plan).plan_cost_ms}
        return row, plan, None

    def plan_members(self, task: Task, ranker: CostModel,
                     workers: int | None = None) -> list[tuple[dict[str, Any], Plan | None, EmbshardError | None]]:
        """`plan_member` of every member, in member order: one after another, or in `workers`
        forked workers (None: `worker_count`), the learned members handed out first (they take longest)."""
        names = list(self.members)
        n = self.worker_count(task) if workers is None else workers
        if n <= 1:
            return [self.plan_member(m, task, ranker) for m in names]
        global _FORKED
        order = [m for m in names if m in LEARNED] + [m for m in names if m not in LEARNED]
        _FORKED = (self, task, ranker)
        # the reuse histograms of the tables without one: imputed once, a share in each worker,
        # and handed to every member (each worker would impute them all for its members'
        # features and its ranker; at 5,384 tables that is seconds)
        keys = pending_imputations(task.tables, task.batch_size)
        try:
            # an executor, not multiprocessing.Pool: a worker that dies (killed for memory, say)
            # raises BrokenProcessPool here instead of leaving the map waiting forever
            with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"), initializer=_one_thread) as ex:
                imputed: dict = {}
                chunks = [keys[i::n] for i in range(n)] if keys else []
                for chunk, hists in zip(chunks, ex.map(imputed_histograms, chunks)):
                    imputed.update(zip(chunk, hists))
                adopt_imputed(imputed)
                got = dict(zip(order, ex.map(_plan_forked, order, [imputed] * len(order))))
        except BrokenProcessPool as e:
            raise RuntimeError(f"{self.name}: a worker process planning the members died ({e}); "
                               f"{self.name}.workers=1 plans them one after another in this process") from e
        finally:
            _FORKED = None
        return [got[m] for m in names]

    # ------------------------------------------------------------------ Sharder
    def shard(self, task: Task) -> Plan:
        start = time.perf_counter()
        ranker, ranker_info = self.ranking_model()
        members: list[dict[str, Any]] = []
        plans: list[tuple[str, Plan, float]] = []  # (member, plan, predicted ms), distinct plans
        seen: dict[tuple, str] = {}
        errors: list[EmbshardError] = []
        workers = self.worker_count(task)
        for row, plan, error in self.plan_members(task, ranker, workers):
            member = row["member"]
            if error is not None:
                errors.append(error)
                log.info("%s: member %s has no plan for %s: %s", self.name, member, task.name, error)
            if plan is None:
                members.append(row)
                continue
            sig = plan.signature()
            if sig in seen:  # the same plan as an earlier member's: ranked once
                members.append({k: v for k, v in row.items() if k != "predicted_ms"} | {"same_as": seen[sig]})
                continue
            seen[sig] = member
            members.append(row)
            plans.append((member, plan, row["predicted_ms"]))
        if not plans:
            infeasible = [e for e in errors if isinstance(e, InfeasibleError)]
            if infeasible:
                raise infeasible[0]
            raise InputError(f"{self.name}: no member planned task {task.name!r}: "
                             + "; ".join(f"{m['member']}: {m['error']}" for m in members))
        ranked = sorted(plans, key=lambda x: (x[2], [m for m in self.members].index(x[0])))
        pick_member, pick, predicted = ranked[0]
        self.last_search_pick = Plan(task.name, self.name, list(pick.shards))
        self.last_guard = None
        won, chosen, interval = pick_member, self.last_search_pick, None
        k = self.guard_count(self.name)
        if k > 0:
            by_label = {m: p for m, p, _ in plans}
            # the guard measures its heuristics' plans anyway: its `verify` candidates are the
            # best-ranked plans of the other members (the learned planners), so a learned plan
            # the ranker misjudges is still measured (a ranker that NeuroShard searched against
            # favours NeuroShard's plan)
            own = set(self.guard.heuristics)
            candidates = [(m, p) for m, p, _ in ranked if m not in own][:k]
            chosen, self.last_guard = self.guard.run(
                task, candidates, self.evaluator,
                lambda p: ranker.device_costs(task, p).plan_cost_ms, self.name,
                refiner=self.refinement_for(task) if self.guard.refine else None)
            won = self.last_guard.chosen
            interval = self.last_guard.decision.get("ratio")
            if won in by_label:
                predicted = next(x for m, _, x in plans if m == won)
            else:  # a guard heuristic's plan: the ranker's estimate of it
                predicted = ranker.device_costs(task, chosen).plan_cost_ms
        self.last_search_seconds = time.perf_counter() - start
        self.last_predicted_cost_ms = predicted
        # cost_model / checkpoint: the models the plans were ranked by (as a search's: shard.py's
        # caption says when the same models judge the estimates)
        self.last_search_info = {**ranker_info, "portfolio": {
            "workers": workers,
            "members": members,
            "ranking": [m for m, _, _ in ranked],
            "pick": pick_member,
            "won": won,
            "verdict": self.last_guard.decision.get("verdict") if self.last_guard else None,
            "interval": interval,
        }}
        return Plan(task.name, self.name, list(chosen.shards))


def _one_thread() -> None:
    """A forked worker plans with one thread (its siblings have the other cores)."""
    import torch

    torch.set_num_threads(1)


def _plan_forked(member: str, imputed: Mapping) -> tuple[dict[str, Any], Plan | None, EmbshardError | None]:
    portfolio, task, ranker = _FORKED  # inherited from the parent at fork
    adopt_imputed(imputed)  # the task's imputed histograms, computed once across the workers
    return portfolio.plan_member(member, task, ranker)
