"""The heuristic floor: a planner's pick against the heuristics' plans, priced by its own models.

A search optimises against a cost model, but it can still end above a plain heuristic's plan by
that very model (NeuroShard's greedy under tight memory; a policy's pick on tables unlike its
training tables). After the search, the floor prices the heuristics' plans (`heuristic_plans`,
each with a table too large for one device cut first) with the planner's models and returns the
pick only where it is predicted at or below (1 - `margin`) x the cheapest of them; else that
heuristic's plan, renamed the planner's. Nothing is measured: it is a guarantee about the
planner's own models (the measured guard, `embshard.search.guard`, is the one about the hardware).

What was done goes to report.json's `search_info.floor`: the pick's and every heuristic's
predicted ms, the margin, `kept` ("search" or the heuristic whose plan was returned),
`no_plan` (heuristics without a valid plan and why), or `skipped` (the task was over
`max_work` tables x devices, or the planner had no model to price with).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from embshard.errors import InputError
from embshard.plan import Plan
from embshard.search.guard import DEFAULT_HEURISTICS, heuristic_plans, heuristic_sharders
from embshard.task import Task

log = logging.getLogger(__name__)

#: the floor runs on tasks of at most this many tables x devices: 856 x 128 is 109,568 (each
#: heuristic plans and is priced in well under a second there); 5,384 x 1,024 is 5.5 million
FLOOR_MAX_WORK = 2_000_000


class HeuristicFloor:
    """The floor's settings (`floor`, `floor_margin`, `floor_max_work` of a planner's conf),
    checked once; `apply` runs it on one pick.

    Args:
        heuristics: conf/search names of the heuristics whose plans are priced (as
            `verify_heuristics`); () or None: off.
        margin: the predicted gain the pick must show over the cheapest heuristic's plan, as a
            share in [0, 1) (0: none; ties keep the pick).
        max_work: skip on tasks of more than this many tables x devices (None: never skip).
        owner: the planner's name, for error messages.
    """

    def __init__(self, heuristics: Sequence[str] | None = DEFAULT_HEURISTICS, margin: float = 0.0,
                 max_work: int | None = FLOOR_MAX_WORK, owner: str = "neuroshard"):
        names = tuple(heuristics or ())
        known = heuristic_sharders()
        if isinstance(heuristics, str) or [h for h in names if h not in known]:
            raise InputError(f"{owner}: floor must list heuristics of {sorted(known)}, got {heuristics!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise InputError(f"{owner}: floor_margin must be a number in [0, 1), got {margin!r}")
        if max_work is not None and (isinstance(max_work, bool) or not isinstance(max_work, int) or max_work < 1):
            raise InputError(f"{owner}: floor_max_work must be an integer >= 1 or null, got {max_work!r}")
        self.heuristics = names
        self.margin = float(margin)
        self.max_work = None if max_work is None else int(max_work)

    def __bool__(self) -> bool:
        return bool(self.heuristics)

    def apply(self, task: Task, plan: Plan, price: Callable[[Plan], float], name: str
              ) -> tuple[Plan, dict[str, Any] | None]:
        """(`plan` or the cheapest heuristic's plan named `name`'s, what was done) where `price`
        gives a plan's predicted ms; (plan, None) when the floor is off."""
        if not self.heuristics:
            return plan, None
        pairs = len(task.tables) * task.num_devices
        if self.max_work is not None and pairs > self.max_work:
            return plan, {"skipped": f"{len(task.tables)} tables x {task.num_devices} devices = {pairs} "
                                     f"> floor_max_work {self.max_work}"}
        own = float(price(plan))
        plans, no_plan = heuristic_plans(self.heuristics, task, name)
        priced = {h: float(price(hp)) for h, hp in plans.items()}
        info: dict[str, Any] = {"search_ms": round(own, 4), "heuristics_ms": {h: round(v, 4) for h, v in priced.items()},
                                "margin": self.margin, "kept": "search"}
        if no_plan:
            info["no_plan"] = no_plan
        if not priced:
            return plan, info
        best = min(priced, key=priced.get)  # the first listed among equals
        if own <= (1 - self.margin) * priced[best]:
            return plan, info
        info["kept"] = best
        log.info("%s %s: the search's pick is predicted %.4g ms, %s's plan %.4g ms: returning %s's", name,
                 task.name, own, best, priced[best], best)
        return Plan(task.name, name, list(plans[best].shards)), info
