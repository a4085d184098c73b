"""The measured guard: a planner's candidate plans against the heuristics' plans, on the
hardware, and the candidate kept only where it is shown better.

Any planner with candidates and a hardware evaluator uses it (NeuroShard's best plans, the
portfolio's best-ranked members). Round 1 measures every distinct candidate and every
heuristic's plan, interleaved, and names the candidates' measured best (S) and the best
heuristic (H). Later rounds measure S and the heuristics within `margin` of H (`contenders`
in all), paired and interleaved; H is then the contender with the lowest mean over the rounds
(one round cannot tell heuristics a few percent apart). They go on until the 95% interval
of the mean per-round ratio S/H excludes 1 (at least `min_rounds` rounds), the rounds
reach `max_rounds`, or, once `min_rounds` rounds are done, the paired rounds pass `budget_s`
(no verdict comes before `min_rounds`, so rounds cut short of it would be measured for
nothing: on a heavy task one round can take minutes). S is returned when the
interval lies below 1; otherwise (worse, or not resolved) H's plan is: the guard never trades
a known plan for a coin toss. `GuardResult` is what report.json's `guard` holds.

With `search_contenders` > 1 (default 1: the rule above), S is not fixed by round 1: the
candidates within `margin` of the round-1 best (`search_contenders` in all) stay in the paired
rounds too, and after each round S is the one with the lowest mean over the rounds, as H is among
the heuristics (one round cannot tell a planner's plans a few percent apart either).

With `refine` (and a refiner from the owner, `embshard.search.refine`), round 1 only selects:
the refiner proposes a plan from every plan it measured, which joins the search contenders as
"refined", and the verdict is taken on the paired rounds after round 1.

The interval (`interval`): "bootstrap" (the default, the one every measured evaluation so far
ran with) or "t" (Student's t). Over 3 rounds a percentile bootstrap is about the rounds'
range: two plans of equal cost pass for "better" whenever all 3 ratios fall below 1, 1 time
in 8 rather than 1 in 40; the t interval keeps its level, and needs more rounds to switch
(`embshard.stats`; `scripts/guard_replay.py` replays recorded guards under either).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from embshard.costs.base import DeviceCosts
from embshard.errors import EmbshardError, InputError
from embshard.plan import Plan, validate
from embshard.stats import INTERVAL_METHODS, RatioSummary, paired_ratio_summary
from embshard.search.base import Sharder
from embshard.search.constrained import shard_constrained
from embshard.task import Task

log = logging.getLogger(__name__)

#: every heuristic an evaluation's "best heuristic" is taken from (conf/search names)
DEFAULT_HEURISTICS: tuple[str, ...] = ("size_lookup_greedy", "lookup_greedy", "dim_greedy", "size_greedy",
                                       "round_robin", "random")


class Refinement(Protocol):
    """Proposes a plan from the plans round 1 measured (`embshard.search.refine.MeasuredRefinement`)."""

    def propose(self, task: Task, plans: Sequence[Plan], costs: Sequence[DeviceCosts],
                labels: Sequence[str]) -> tuple[Plan | None, dict[str, Any]]: ...


class PlanMeasurer(Protocol):
    """What the guard measures on (`embshard.hardware.evaluator.HardwareEvaluator`)."""

    def measure_many(self, task: Task, plans: Sequence[Plan], visits: int | None = None) -> list[DeviceCosts]: ...


def heuristic_sharders() -> dict[str, Callable[[], Sharder]]:
    """The heuristics the guard can measure against, by their conf/search names: every greedy
    baseline, round-robin and random (seed 0, as `search=random`)."""
    from embshard.search.baselines import COST_KEYS, GreedySharder, RandomSharder, RoundRobinSharder

    out: dict[str, Callable[[], Sharder]] = {f"{k}_greedy": (lambda k=k: GreedySharder(k)) for k in COST_KEYS}
    out["round_robin"] = RoundRobinSharder
    out["random"] = lambda: RandomSharder(seed=0)
    return out


def heuristic_plans(names: Sequence[str], task: Task, owner: str) -> tuple[dict[str, Plan], dict[str, str]]:
    """({name: valid plan}, {name: the one-line reason it has none}) of the heuristics `names`
    (`heuristic_sharders`' names) on `task`, each with a table too large for a device cut first
    (`shard_constrained`), in `names`' order."""
    makers = heuristic_sharders()
    plans: dict[str, Plan] = {}
    skipped: dict[str, str] = {}
    for h in names:
        try:
            hp = shard_constrained(makers[h](), task)
            validate(task, hp)
        except EmbshardError as e:
            log.debug("%s: %s has no valid plan for %s (%s)", owner, h, task.name, e)
            skipped[h] = str(e).splitlines()[0]
            continue
        plans[h] = hp
    return plans, skipped


def decide(rounds: Sequence[Mapping[str, float]], search: str, contenders: Sequence[str], min_rounds: int,
           interval: str = "bootstrap") -> tuple[str, str, RatioSummary]:
    """The guard's rule on its measured rounds (cost in ms by label, each round holding `search`
    and every contender): H is the contender with the lowest mean over the rounds (the first
    listed on ties); the verdict is that of the paired S/H ratios' `interval`, "not resolved"
    before `min_rounds` rounds. Returns (verdict, H, the ratios' summary)."""
    means = [float(np.mean([r[h] for r in rounds])) for h in contenders]
    h = contenders[int(np.argmin(means))]
    summary = paired_ratio_summary([r[search] / r[h] for r in rounds], method=interval)
    return (summary.verdict if len(rounds) >= min_rounds else "not resolved"), h, summary


class GuardSlot:
    """What a guarded sharder (NeuroShard, the portfolio) shares: the evaluator shard.py
    attaches under evaluate=measured, and `verify` ('auto' or a count) resolved against it."""

    evaluator: Any = None
    verify: int | str = "auto"

    def attach_evaluator(self, evaluator: Any) -> None:
        """The hardware the guard measures on (`HardwareEvaluator`); None detaches it."""
        self.evaluator = evaluator

    @staticmethod
    def check_verify(verify: Any, owner: str) -> None:
        """InputError unless `verify` is "auto" or an integer >= 0."""
        if verify != "auto" and (isinstance(verify, bool) or not isinstance(verify, int) or verify < 0):
            raise InputError(f"{owner}: verify must be 'auto' or an integer >= 0, got {verify!r}")

    def guard_count(self, owner: str) -> int:
        """`verify_count`, with an InputError where it is > 0 and no evaluator is attached."""
        k = self.verify_count
        if k > 0 and self.evaluator is None:
            raise InputError(f"{owner}: verify > 0 needs a hardware evaluator (shard.py evaluate=measured "
                             f"attaches one; or set searchers.{owner}.verify=0)")
        return k

    @property
    def verify_count(self) -> int:
        """Plans of the search the guard measures: `verify`, or under 'auto' 3 with an
        evaluator attached and 0 without."""
        if self.verify == "auto":
            return 3 if self.evaluator is not None else 0
        return int(self.verify)


@dataclass
class GuardResult:
    """What the measured guard did for one task (report.json: `guard`)."""

    candidates: list[dict[str, Any]]   # label, source, predicted_ms, measured_ms, spread_ms (round 1)
    chosen: str
    search_pick: str
    measure_seconds: float
    #: the rule's outcome: verdict ("better" | "worse" | "not resolved" | "same plan" | "no
    #: heuristic plan"), the plan kept, and the ratio's interval over rounds (`interval` names it)
    decision: dict[str, Any] = field(default_factory=dict)
    #: measured plan cost (ms) per round, by label
    rounds: list[dict[str, float]] = field(default_factory=list)
    #: heuristics that were not candidates, and why (their plan was invalid for the task)
    skipped: dict[str, str] = field(default_factory=dict)
    #: the measured refinement after round 1 (`embshard.search.refine`), where it ran
    refinement: dict[str, Any] | None = None
    changed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.changed = self.chosen != self.search_pick

    def to_dict(self) -> dict[str, Any]:
        return {"candidates": self.candidates, "chosen": self.chosen, "search_pick": self.search_pick,
                "changed": self.changed, "measure_seconds": self.measure_seconds, "decision": self.decision,
                "rounds": self.rounds, "skipped": self.skipped, "refinement": self.refinement}


@dataclass
class MeasuredGuard:
    """The guard's settings and its rule (module docstring).

    Args:
        heuristics: baselines (conf/search names) whose plans the guard measures too.
        visits: interleaved visits per measuring round (None: the evaluator's protocol's).
        budget_s: seconds of paired rounds after round 1, at most, beyond the `min_rounds`
            rounds every decision needs (those always run; a round begun finishes).
        min_rounds, max_rounds: rounds before a decision / at most.
        contenders, margin: how many heuristics' plans stay in the paired rounds: the round-1
            best and the next ones within `margin` (relative) of it, `contenders` in all. One
            round cannot tell heuristics a few percent apart; the best heuristic is the one
            with the lowest mean over the rounds.
        interval: the interval of the verdict: "bootstrap" (percentile) or "t" (Student t).
        owner: the planner's name, for error messages.
        search_contenders: the candidates that stay in the paired rounds: the round-1 best and
            the next within `margin` of it (1: the round-1 best alone); S is the one with the
            lowest mean over the rounds.
        refine: the owner passes `run` a refiner (`embshard.search.refine.MeasuredRefinement`).
    """

    heuristics: Sequence[str] = DEFAULT_HEURISTICS
    visits: int | None = None
    budget_s: float = 60.0
    min_rounds: int = 3
    max_rounds: int = 10
    contenders: int = 2
    margin: float = 0.1
    owner: str = "guard"
    interval: str = "bootstrap"
    search_contenders: int = 1
    refine: bool = False

    def __post_init__(self) -> None:
        self.heuristics = tuple(self.heuristics)
        self._keys = heuristic_sharders()
        unknown = [h for h in self.heuristics if h not in self._keys]
        if unknown:
            raise InputError(f"{self.owner}: unknown verify_heuristics {unknown}; choose from {sorted(self._keys)}")
        if self.visits is not None and int(self.visits) < 1:
            raise InputError(f"{self.owner}: verify_visits must be >= 1 or null, got {self.visits!r}")
        if not float(self.budget_s) >= 0:
            raise InputError(f"{self.owner}: verify_budget_s must be >= 0, got {self.budget_s!r}")
        if not 2 <= int(self.min_rounds) <= int(self.max_rounds):
            raise InputError(f"{self.owner}: need 2 <= verify_min_rounds <= verify_max_rounds, got "
                             f"{self.min_rounds!r}, {self.max_rounds!r}")
        if int(self.contenders) < 1 or not float(self.margin) >= 0:
            raise InputError(f"{self.owner}: need verify_contenders >= 1 and verify_margin >= 0, got "
                             f"{self.contenders!r}, {self.margin!r}")
        if isinstance(self.search_contenders, bool) or int(self.search_contenders) < 1:
            raise InputError(f"{self.owner}: verify_search_contenders must be >= 1, got {self.search_contenders!r}")
        self.search_contenders = int(self.search_contenders)
        if not isinstance(self.refine, bool):
            raise InputError(f"{self.owner}: verify_refine must be true or false, got {self.refine!r}")
        if self.interval not in INTERVAL_METHODS:
            raise InputError(f"{self.owner}: verify_interval must be one of {list(INTERVAL_METHODS)}, got "
                             f"{self.interval!r}")
        self.contenders = int(self.contenders)
        self.margin = float(self.margin)
        self.visits = None if self.visits is None else int(self.visits)
        self.budget_s = float(self.budget_s)
        self.min_rounds = int(self.min_rounds)
        self.max_rounds = int(self.max_rounds)

    def run(self, task: Task, candidates: Sequence[tuple[str, Plan]], evaluator: PlanMeasurer,
            predicted_ms: Callable[[Plan], float | None], name: str,
            refiner: Refinement | None = None) -> tuple[Plan, GuardResult]:
        """Measure `candidates` (label, plan; the planner's own order, its pick first) and the
        heuristics' plans; returns the plan kept (named `name`) and what was done.

        With a `refiner` (`embshard.search.refine.MeasuredRefinement`; the owner builds it where
        `refine` is on), round 1 only selects: the refiner proposes a plan from every plan
        round 1 measured, which joins the search contenders as "refined", and the paired rounds
        the verdict is taken on begin after round 1 (every contender measured in each)."""
        labelled: list[tuple[str, str, Plan]] = [(label, "search", p) for label, p in candidates]
        plans, skipped = heuristic_plans(self.heuristics, task, f"{self.owner} guard")
        labelled += [(h, "heuristic", hp) for h, hp in plans.items()]
        unique: dict[tuple, int] = {}
        for i, (_, _, p) in enumerate(labelled):
            unique.setdefault(p.signature(), i)
        first = sorted(set(unique.values()))
        t0 = time.perf_counter()
        costs = evaluator.measure_many(task, [labelled[i][2] for i in first], visits=self.visits)
        deadline = time.perf_counter() + self.budget_s  # for the paired rounds, after round 1
        measured = {i: c for i, c in zip(first, costs)}
        rows = []
        for i, (label, source, p) in enumerate(labelled):
            c = measured[unique[p.signature()]]
            rows.append({"label": label, "source": source, "same_as": labelled[unique[p.signature()]][0],
                         "predicted_ms": predicted_ms(p), "measured_ms": c.plan_cost_ms,
                         "spread_ms": c.plan_cost_spread_ms})
        search_ids = [i for i, (_, src, _) in enumerate(labelled) if src == "search"]
        heur_ids = [i for i, (_, src, _) in enumerate(labelled) if src == "heuristic"]
        refinement: dict[str, Any] | None = None
        refined: int | None = None  # the refined plan's index in labelled
        if refiner is not None and heur_ids:
            proposal, refinement = refiner.propose(task, [labelled[i][2] for i in first],
                                                   [measured[i] for i in first], [labelled[i][0] for i in first])
            if proposal is not None and all(proposal.signature() != p.signature() for _, _, p in labelled):
                labelled.append(("refined", "search", proposal))
                refined = len(labelled) - 1
                rows.append({"label": "refined", "source": "search", "same_as": "refined",
                             "predicted_ms": predicted_ms(proposal), "measured_ms": None, "spread_ms": None})
            refinement["proposed"] = refined is not None
        paired_from = 0 if refined is None else 1  # the rounds the verdict is taken on

        def within_margin(ids: Sequence[int], count: int, taken: Sequence[int] = ()) -> list[int]:
            """Up to `count` distinct plans of `ids` (none the plan of one in `taken`) within the
            margin of the round-1 best of `ids`, cheapest on round 1 first."""
            by_cost = sorted(ids, key=lambda i: (rows[i]["measured_ms"], i))
            out: list[int] = []
            for i in by_cost:
                if len(out) == count or rows[i]["measured_ms"] > (1 + self.margin) * rows[by_cost[0]]["measured_ms"]:
                    break
                if all(labelled[i][2].signature() != labelled[j][2].signature() for j in (*taken, *out)):
                    out.append(i)
            return out

        s = min(search_ids, key=lambda i: (rows[i]["measured_ms"], i))
        searchers = within_margin(search_ids, self.search_contenders)  # the search candidates that stay
        rounds = [{labelled[i][0]: rows[i]["measured_ms"] for i in range(len(labelled)) if i != refined}]
        decision: dict[str, Any]
        if not heur_ids:
            best, decision = s, {"verdict": "no heuristic plan", "kept": labelled[s][0]}
        else:
            h = min(heur_ids, key=lambda i: (rows[i]["measured_ms"], i))
            if refined is not None:  # the refined plan stays; a search plan the same as H's does not
                searchers = [i for i in searchers if labelled[i][2].signature() != labelled[h][2].signature()]
                searchers.append(refined)
                s = searchers[0]
            if refined is None and labelled[s][2].signature() == labelled[h][2].signature():
                best, decision = s, {"verdict": "same plan", "kept": labelled[s][0], "heuristic": labelled[h][0]}
            else:
                # the heuristics that stay (none the plan of a search candidate that stays)
                stay = within_margin(heur_ids, self.contenders, searchers) or [h]

                label = {i: labelled[i][0] for i in stay}
                by_index = [label[i] for i in sorted(stay)]  # ties between contenders: the first listed

                def search_best() -> int:  # S: the search contender with the lowest mean over the rounds
                    return min(searchers, key=lambda i: (float(np.mean([r[labelled[i][0]] for r in rounds[paired_from:]])), i))

                if refined is None:
                    outcome = decide(rounds, labelled[s][0], by_index, self.min_rounds, self.interval)  # round 1 alone
                while len(rounds) - paired_from < self.max_rounds and (len(rounds) - paired_from < self.min_rounds
                                                                       or time.perf_counter() < deadline):
                    measured_now = (*searchers, *stay)
                    costs = evaluator.measure_many(task, [labelled[i][2] for i in measured_now], visits=self.visits)
                    rounds.append({labelled[i][0]: c.plan_cost_ms for i, c in zip(measured_now, costs)})
                    s = search_best()
                    outcome = decide(rounds[paired_from:], labelled[s][0], by_index, self.min_rounds, self.interval)
                    if outcome[0] != "not resolved":
                        break
                verdict, h_label, summary = outcome
                h = next(i for i in stay if label[i] == h_label)
                best = s if verdict == "better" else h
                decision = {"verdict": verdict, "kept": labelled[best][0], "search": labelled[s][0],
                            "heuristic": labelled[h][0], "contenders": [labelled[i][0] for i in stay],
                            "search_contenders": [labelled[i][0] for i in searchers],
                            "ratio": summary.to_dict(), "interval": self.interval, "rounds": len(rounds) - paired_from,
                            "budget_s": self.budget_s}
        seconds = time.perf_counter() - t0
        result = GuardResult(rows, labelled[best][0], labelled[0][0], round(seconds, 3), decision, rounds, skipped,
                             refinement)
        return Plan(task.name, name, list(labelled[best][2].shards)), result
