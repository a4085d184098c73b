"""`search=dreamshard` and `search=autoshard`: plan with a trained policy, no hardware.

Inference is one policy forward per table (all devices scored at once) through the shared
rollout loop, placing through `MemoryLedger.place`, so every plan is valid. `samples=0` is
the references' argmax; `samples=K` also samples K episodes (batched together, in numpy for
the shipped networks: `numpy_episode`) and keeps the one the agent's cost network estimates
cheapest (best-of-K). Sampling is
skipped on tasks with more than `sample_max_work` tables x devices x samples, where its
extra ledger look-ahead work would dominate (856 tables x 128 devices x 8 samples is 877k:
argmax only, about 4 s here, where best-of-8 took 23-29 s).

With `split_columns` (not in the references, which place whole tables), a table whose
predicted cost alone exceeds `split_above` times an even share of the task's predicted compute
(so whichever device holds it is the bottleneck) is cut into 2, 4, ... equal column slices
(widths multiples of 4, at least its `min_partition`, no more slices than devices, only where
its `sharding_types` allow column_wise) until each slice's share is below that; the policy
places the slices as tables, slices that land on one device are merged, and the plan estimated
lower, split or whole, is kept: by `split_judge`, a neural cost-model checkpoint (NeuroShard's,
as conf/search sets it), or by the agent's own cost network when that is None. report.json's
search info says which and by how much.

With `judge_samples` (and a `split_judge` checkpoint), the judge also picks among the argmax
and sampled plans (best-of-K by the judge's estimate, not the policy's own cost network),
for the whole-table plan and the split one alike.

**Guard** (`verify`, with a hardware evaluator attached: `shard.py evaluate=measured`; "auto"
is 3 then, 0 without): the planner's `verify` best distinct plans (its pick first, then the
other whole-table and split plans it weighed, the judge's lowest estimates first) go to the
measured guard (`embshard.search.guard`) with the heuristics' plans, as NeuroShard's do; its
plan is kept only where measured better than the best heuristic's. report.json: `guard`, and the
policy's own pick as `<name>_pick`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any, Sequence

import torch

from embshard.errors import InfeasibleError, InputError
from embshard.hardware.protocol import torch_threads
from embshard.plan import Plan, validate
from embshard.search.base import Capabilities
from embshard.search.constrained import SLICE_MARK, Reduction, expand
from embshard.search.floor import FLOOR_MAX_WORK, HeuristicFloor
from embshard.search.guard import DEFAULT_HEURISTICS, GuardResult, GuardSlot, MeasuredGuard
from embshard.search.pieces import slices_below
from embshard.search.rl.checkpoint import load_checkpoint, resolve_path
from embshard.search.rl.env import best_plan, plan_candidates
from embshard.tables import DIM_ALIGNMENT
from embshard.task import Task

log = logging.getLogger(__name__)

#: a plan the search weighed: (plan, the agent's estimate of it, the judge's or None)
Weighed = tuple[Plan, float, float | None]


class RLSharder(GuardSlot):
    """A trained policy as a Sharder.

    Args:
        checkpoint: the policy file (`train.py stage=rl`); relative paths resolve against the
            working directory, then the project root. Loaded on first use.
        samples: sampled episodes besides the argmax one (0: argmax only).
        sample_max_work: sample only when tables x devices x samples <= this (None: always).
        seed: seeds the sampling.
        num_threads: torch threads while planning (None: unchanged).
        max_candidates: on a task of more devices than this, each placement scores only this
            many devices with room, those whose predicted cost is lowest now (`env.rollout`);
            None: every device.
        split_columns: also plan with the costliest tables cut into column slices (module
            doc) and keep the plan estimated lower (see split_judge).
        split_above: a table is cut when its predicted cost alone exceeds this many even
            shares of the task's predicted compute.
        split_max_work: skip the split plan when its slices x devices exceed this (its
            second rollout would double the planning time of a task that large; None: never skip).
        split_judge: what decides between the split and the whole-table plan: None, the agent's
            own cost network; or a neural cost-model checkpoint (NeuroShard's, the portfolio's
            ranker), whose plan cost estimate decides instead.
        judge_samples: the split_judge (when set) also picks among the argmax and sampled
            plans instead of the agent's own cost network (module doc).
        verify: the measured guard (module doc): measure this many of the planner's best
            distinct plans with the heuristics' plans on the attached evaluator; "auto": 3
            when an evaluator is attached, else 0.
        verify_heuristics, verify_visits, verify_budget_s, verify_min_rounds,
            verify_max_rounds, verify_contenders, verify_margin, verify_interval,
            verify_search_contenders: the guard's settings, as NeuroShard's (`MeasuredGuard`).
        floor, floor_margin, floor_max_work: the heuristic floor (`embshard.search.floor`), as
            NeuroShard's: the split_judge prices the pick and the heuristics' plans, and the pick
            is returned only where predicted at or below (1 - floor_margin) x the cheapest, else
            that plan; without a split_judge it is skipped (report.json: `search_info.floor`).
            The guard, when it runs, measures the policy's own plans as before.
    """

    algorithm = "rl"
    #: policies trained on pooled tasks. splits_tables stays False with split_columns: the split
    #: is tried for cost, never to fit memory, so an infeasible task still points to the planners
    #: that split tables to fit
    capabilities = Capabilities(("pooled",), splits_tables=False)

    def __init__(self, checkpoint: str | os.PathLike, samples: int = 0, sample_max_work: int | None = 200_000,
                 seed: int = 0, num_threads: int | None = 1, name: str | None = None,
                 max_candidates: int | None = 128, split_columns: bool = False, split_above: float = 1.0,
                 split_max_work: int | None = 2_000_000, split_judge: str | os.PathLike | None = None,
                 judge_samples: bool = False, verify: int | str = 0,
                 verify_heuristics: Sequence[str] = DEFAULT_HEURISTICS, verify_visits: int | None = None,
                 verify_budget_s: float = 60.0, verify_min_rounds: int = 3, verify_max_rounds: int = 10,
                 verify_contenders: int = 2, verify_margin: float = 0.1, verify_interval: str = "bootstrap",
                 verify_search_contenders: int = 1, floor: Sequence[str] | None = None,
                 floor_margin: float = 0.0, floor_max_work: int | None = FLOOR_MAX_WORK):
        if int(samples) < 0:
            raise InputError(f"{self.algorithm}: samples must be >= 0, got {samples!r}")
        self.check_verify(verify, self.algorithm)
        self.verify = verify
        self.guard = MeasuredGuard(verify_heuristics, verify_visits, verify_budget_s, verify_min_rounds,
                                   verify_max_rounds, verify_contenders, verify_margin,
                                   owner=name or self.algorithm, interval=verify_interval,
                                   search_contenders=verify_search_contenders)
        self.floor = HeuristicFloor(floor, floor_margin, floor_max_work, owner=name or self.algorithm)
        self.last_floor: dict[str, Any] | None = None
        self.evaluator: Any = None
        self.last_guard: GuardResult | None = None
        self.last_search_pick: Plan | None = None
        #: every plan the last `shard` weighed: (plan, the agent's estimate, the judge's or None)
        self.last_weighed: list[Weighed] = []
        if not float(split_above) > 0:
            raise InputError(f"{self.algorithm}: split_above must be > 0, got {split_above!r}")
        self.split_columns = bool(split_columns)
        self.split_above = float(split_above)
        self.split_max_work = None if split_max_work is None else int(split_max_work)
        self.split_judge = None if split_judge in (None, "") else str(split_judge)
        self.judge_samples = bool(judge_samples)
        self._judge: Any = None
        self.checkpoint = str(checkpoint)
        self.samples = int(samples)
        self.sample_max_work = None if sample_max_work is None else int(sample_max_work)
        self.seed = int(seed)
        self.num_threads = num_threads
        if max_candidates is not None and int(max_candidates) < 1:
            raise InputError(f"{self.algorithm}: max_candidates must be >= 1 or null, got {max_candidates!r}")
        self.max_candidates = None if max_candidates is None else int(max_candidates)
        self.name = name or self.algorithm
        self._agent: Any = None
        self.bundle: dict[str, Any] | None = None
        self.last_search_seconds: float | None = None
        self.last_predicted_cost_ms: float | None = None
        self.last_stats: dict[str, Any] = {}
        self.last_search_info: dict[str, Any] = {}

    def load(self) -> Any:
        if self._agent is None:
            self._agent, self.bundle = load_checkpoint(self.checkpoint, self.algorithm)
        return self._agent

    def samples_for(self, task: Task) -> int:
        work = len(task.tables) * task.num_devices * self.samples
        if self.sample_max_work is not None and work > self.sample_max_work:
            return 0
        return self.samples

    def shard(self, task: Task) -> Plan:
        agent = self.load()
        start = time.perf_counter()
        samples = self.samples_for(task)
        split: dict[str, Any] | None = None
        k = self.guard_count(self.name)
        weighed: list[Weighed] = []  # every plan weighed, filled by _best
        with torch_threads(self.num_threads), torch.inference_mode():  # no autograd bookkeeping per op
            plan, estimate_ms, judged = self._best(agent, task, samples, weighed)
            if self.split_columns:
                plan, estimate_ms, split = self._split_plan(agent, task, samples, weighed, plan, estimate_ms, judged)
        validate(task, plan)
        pick, pick_ms = plan, estimate_ms
        plan, estimate_ms = self._floored(agent, task, pick, pick_ms, weighed)
        self.last_search_pick = plan
        self.last_guard = None
        self.last_weighed = weighed
        if k > 0:  # the guard measures the policy's own plans (its pick before the floor first)
            plan, estimate_ms = self._guard(agent, task, pick, pick_ms, weighed, k)
        self.last_search_seconds = time.perf_counter() - start
        estimate = self.trusted_estimate(task, plan, estimate_ms)
        self.last_predicted_cost_ms = estimate["ms"]
        self.last_stats = {"samples": samples, "estimated_ms": estimate["ms"]}
        # samples below samples_requested: the task was over sample_max_work (argmax only)
        self.last_search_info = {"checkpoint": str(resolve_path(self.checkpoint)), "samples": samples,
                                 "samples_requested": self.samples, "estimate": estimate}
        if judged is not None:
            self.last_search_info["judged_samples"] = judged
        if self.last_floor is not None:
            self.last_search_info["floor"] = self.last_floor
        if split is not None:
            self.last_search_info["column_split"] = split
        if samples < self.samples:
            log.info("%s: %s has %d tables x %d devices; argmax only (sample_max_work=%s)", self.name, task.name,
                     len(task.tables), task.num_devices, self.sample_max_work)
        return plan

    @staticmethod
    def guard_candidates(pick: Plan, weighed: Sequence[Weighed], k: int) -> list[Plan]:
        """The guard's candidates: the pick, then the other distinct plans weighed (whole-table
        and split, argmax and sampled), the judge's lowest estimates first (the agent's where no
        judge saw them), at most `k`."""
        order = sorted(range(len(weighed)),
                       key=lambda i: (weighed[i][2] is None, weighed[i][1] if weighed[i][2] is None else weighed[i][2], i))
        out, seen = [pick], {pick.signature()}
        for i in order:
            p = weighed[i][0]
            if len(out) >= k:
                break
            if p.signature() not in seen:
                seen.add(p.signature())
                out.append(p)
        return out

    def _guard(self, agent: Any, task: Task, pick: Plan, estimate_ms: float, weighed: Sequence[Weighed],
               k: int) -> tuple[Plan, float]:
        """The measured guard (module doc) on `guard_candidates`, labelled `<name>#1`, `<name>#2`,
        ...; returns the plan kept and the agent's estimate of it."""
        cands = self.guard_candidates(pick, weighed, k)
        plan, self.last_guard = self.guard.run(
            task, [(f"{self.name}#{i + 1}", p) for i, p in enumerate(cands)], self.evaluator,
            (lambda p: self._judged_ms(task, p)) if self.split_judge is not None else (lambda p: None), self.name)
        validate(task, plan)
        return plan, self._agent_estimate(agent, task, plan, [(pick, estimate_ms, None), *weighed])

    def _agent_estimate(self, agent: Any, task: Task, plan: Plan, weighed: Sequence[Weighed]) -> float:
        """The agent's estimate of `plan`: the one recorded where `weighed` holds it; a
        heuristic's whole-table plan replayed as an episode; NaN for any other plan."""
        sig = plan.signature()
        known = [est for p, est, _ in weighed if p.signature() == sig]
        if known:
            return known[0]
        if len({s.table for s in plan.shards}) == len(plan.shards):
            with torch_threads(self.num_threads):
                return agent.estimate_plan(task, plan)
        return float("nan")

    def _floored(self, agent: Any, task: Task, pick: Plan, estimate_ms: float,
                 weighed: Sequence[Weighed]) -> tuple[Plan, float]:
        """The heuristic floor (`embshard.search.floor`) on the pick, priced by the split_judge;
        (plan, the agent's estimate of it); what was done in `last_floor` (None: off)."""
        self.last_floor = None
        if not self.floor:
            return pick, estimate_ms
        if self.split_judge is None:
            self.last_floor = {"skipped": "no split_judge to price the plans with"}
            return pick, estimate_ms
        plan, self.last_floor = self.floor.apply(task, pick, lambda p: self._judged_ms(task, p), self.name)
        if plan is pick:
            return pick, estimate_ms
        validate(task, plan)
        return plan, self._agent_estimate(agent, task, plan, weighed)

    def _judges_samples(self, samples: int) -> bool:
        return self.judge_samples and self.split_judge is not None and samples > 0

    def _best(self, agent: Any, task: Task, samples: int, weighed: list[Weighed], reduction: Reduction | None = None,
              original: Task | None = None) -> tuple[Plan, float, dict[str, Any] | None]:
        """(plan, the agent's estimate of it, what the judge saw or None): best-of-K by the
        agent's network, or by the judge (`judge_samples`). With a `reduction`, `task` is its
        sliced task and the plan returned is expanded back to `original`. Every plan weighed
        is appended to `weighed`."""
        gen = torch.Generator().manual_seed(self.seed)
        if not self._judges_samples(samples):
            plan, est = best_plan(agent, task, samples, generator=gen, algorithm=self.name,
                                  max_candidates=self.max_candidates)
            plan = plan if reduction is None else expand(original, reduction, plan, self.name)
            weighed.append((plan, float(est), None))
            return plan, est, None
        cands = plan_candidates(agent, task, samples, generator=gen, algorithm=self.name,
                                max_candidates=self.max_candidates)
        if reduction is not None:
            cands = [(expand(original, reduction, p, self.name), e) for p, e in cands]
        judged = [self._judged_ms(original or task, p) for p, _ in cands]
        weighed += [(p, float(e), j) for (p, e), j in zip(cands, judged)]
        i = min(range(len(cands)), key=judged.__getitem__)
        info = {"plans": len(cands), "pick": i, "judged_ms": judged[i], "network_pick_judged_ms": judged[0]}
        return cands[i][0], cands[i][1], info

    def column_slices(self, agent: Any, task: Task) -> Reduction | None:
        """The task with its costliest tables cut into column slices (module doc), as a
        `Reduction` that `constrained.expand` maps back; None when no table qualifies."""
        view = agent.prepare(task)
        single = dict(zip((t.name for t in view.tables), view.cache["single_ms"].tolist()))
        limit = self.split_above * view.even_ms
        single_host = (task.devices_per_host or task.num_devices) == task.num_devices
        names = set(task.table_by_name)
        kept, slices = [], {}
        for t in task.tables:
            k = 1
            if single[t.name] > limit and (t.allows("column_wise") or (single_host and t.allows("table_column_wise"))):
                k = slices_below(single[t.name], limit, task.num_devices)
                while k > 1 and (t.dim % k or (t.dim // k) % DIM_ALIGNMENT or t.dim // k < t.narrowest_column_piece()):
                    k //= 2
            if k == 1:
                kept.append(t)
                continue
            width = t.dim // k
            for i in range(k):
                name = f"{t.name}{SLICE_MARK}{i}"
                while name in names:
                    name += "_"
                names.add(name)
                slices[name] = (t.name, i * width)
                kept.append(dataclasses.replace(t, name=name, dim=width, sharding_types=("table_wise",),
                                                min_partition=None))
        if not slices:
            return None
        return Reduction(dataclasses.replace(task, tables=tuple(kept)), slices=slices)

    def _split_plan(self, agent: Any, task: Task, samples: int, weighed: list[Weighed], plan: Plan, estimate_ms: float,
                    whole_judged: dict[str, Any] | None = None) -> tuple[Plan, float, dict[str, Any]]:
        """(plan, the agent's estimate of it, what was tried): the whole-table plan, or the
        column-split one where the judge (`split_judge`, else the agent's network) estimates it lower.
        `whole_judged`: what the judge saw when it picked the whole-table plan (`_best`), whose
        judged cost is then not computed again."""
        too_big = self._over_split_work(len(task.tables), task.num_devices)  # slices only add tables
        if too_big:
            return plan, estimate_ms, {"tables": [], "chosen": False, "skipped": too_big}
        reduction = self.column_slices(agent, task)
        if reduction is None:
            return plan, estimate_ms, {"tables": [], "chosen": False}
        cut = sorted({name for name, _ in reduction.slices.values()})
        info: dict[str, Any] = {"tables": cut, "slices": len(reduction.slices), "whole_estimate_ms": float(estimate_ms)}
        too_big = self._over_split_work(len(reduction.task.tables), task.num_devices)
        if too_big:
            info.update(chosen=False, skipped=too_big)
            return plan, estimate_ms, info
        try:
            split_plan, sliced_ms, judged = self._best(agent, reduction.task, samples, weighed, reduction, task)
        except InfeasibleError as e:  # slices pack no worse than whole tables; kept whole if not
            info.update(chosen=False, error=str(e).splitlines()[0])
            return plan, estimate_ms, info
        info["split_estimate_ms"] = float(sliced_ms)
        if judged is not None:
            info["judged_samples"] = judged
        if self.split_judge is None:
            info["chosen"] = bool(sliced_ms < estimate_ms)
        else:
            whole_j, split_j = (self._judged_ms(task, p) if seen is None else seen["judged_ms"]
                                for p, seen in ((plan, whole_judged), (split_plan, judged)))
            info.update(judge=self.split_judge, whole_judged_ms=whole_j, split_judged_ms=split_j,
                        chosen=bool(split_j < whole_j))
        if not info["chosen"]:
            return plan, estimate_ms, info
        return split_plan, float(sliced_ms), info

    def _judge_model(self) -> Any:
        if self._judge is None:
            from embshard.costs.predictor import load_models

            self._judge = load_models(self.split_judge, self.name).neural
        return self._judge

    def _judged_ms(self, task: Task, plan: Plan) -> float:
        """The split_judge's plan cost of `plan` on `task` (ms)."""
        return float(self._judge_model().device_costs(task, plan).plan_cost_ms)

    def _over_split_work(self, tables: int, devices: int) -> str | None:
        """Why the split plan is not tried at this size (None: it is)."""
        if self.split_max_work is None or tables * devices <= self.split_max_work:
            return None
        return f"{tables} tables x {devices} devices > split_max_work={self.split_max_work}"

    def trusted_estimate(self, task: Task, plan: Plan, network_ms: float) -> dict[str, Any]:
        """What this planner reports as its plan's estimate: its cost network's, unless the task
        lies outside the device counts and batches the network was trained on (as NeuroShard's
        comm models answer only inside theirs) or the network's answer is more than FAR_FACTOR
        times off the analytic model's estimate of the same quantity; then the analytic model's,
        with the reason. The plan is the policy's either way. `of` names the quantity:
        DreamShard estimates the plan cost, AutoShard the slowest device's compute."""
        from embshard.costs.analytic import AnalyticCostModel
        from embshard.costs.neural.models import FAR_FACTOR

        costs = AnalyticCostModel().device_costs(task, plan)
        of = "plan cost" if self.algorithm == "dreamshard" else "slowest device's compute"
        ref = costs.plan_cost_ms if self.algorithm == "dreamshard" else max(costs.compute_ms)
        where = (f"{len(task.tables)} tables, {task.num_devices} devices, batch {task.batch_size}; "
                 f"trained on {self._trained()}")
        if not math.isfinite(network_ms):
            return {"ms": float(ref), "of": of, "source": "analytic",
                    "reason": "the plan returned (the guard's or the floor's) is one the policy did not place and its "
                    "cost network cannot replay"}
        outside = self._outside_training(task)
        if outside:
            return {"ms": float(ref), "of": of, "source": "analytic",
                    "reason": f"the task's {outside} lies outside what the cost network was trained on ({where})"}
        if ref > 0 and 1.0 / FAR_FACTOR <= network_ms / ref <= FAR_FACTOR:
            return {"ms": float(network_ms), "of": of, "source": "cost network"}
        return {"ms": float(ref), "of": of, "source": "analytic",
                "reason": f"the cost network's estimate is over {FAR_FACTOR:g}x off the analytic model's ({where})"}

    def _outside_training(self, task: Task) -> str | None:
        """'device count' or 'batch' where the task is outside the checkpoint's training range
        (checked as the cost models' envelope checks theirs: `Range.outside` with its default
        tolerance); None inside, or when the checkpoint does not record its range."""
        from embshard.costs.envelope import DEFAULT_TOLERANCE, Range

        card = (self.bundle or {}).get("data_card") or {}
        devices, batches = card.get("device_counts"), card.get("batch_sizes")
        if devices and Range.of(devices).outside(task.num_devices, 0.0):
            return "device count"
        if batches and Range.of(batches).outside(task.batch_size, DEFAULT_TOLERANCE):
            return "batch"
        return None

    def _trained(self) -> str:
        card = (self.bundle or {}).get("data_card") or {}
        return (f"{card.get('min_tables')}-{card.get('max_tables')} tables, devices {card.get('device_counts')}, "
                f"batch {card.get('batch_sizes')}")


class DreamShardSharder(RLSharder):
    """DreamShard (`search=dreamshard`)."""

    algorithm = "dreamshard"


class AutoShardSharder(RLSharder):
    """AutoShard (`search=autoshard`)."""

    algorithm = "autoshard"
