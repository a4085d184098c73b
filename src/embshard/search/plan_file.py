"""A plan made elsewhere, read from its plan JSON, as one more row of a comparison.

`shard.py plan_files=[A.json,B.json]` measures (or estimates) plans that were not searched in
this run, side by side with the algorithms it runs, on the same footing: for example the
plans `EmbShardPlanner(out_dir=...)` and TorchRec's planner (via `plan_from_torchrec`)
made for one TorchRec module (scripts/compare_planners.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

from embshard.errors import InputError
from embshard.plan import Plan
from embshard.search.base import Capabilities
from embshard.task import Task


class PlanFileSharder:
    """Returns the plan of a plan JSON file for the task it names (read when built, so a bad
    file is a one-line error before anything runs).

    Args:
        path: the plan JSON (`Plan.load`: row-map sidecars beside it).
        name: the row's name (default: the plan's `algorithm`).
    """

    capabilities: ClassVar[Capabilities] = Capabilities(("pooled", "sequence"), splits_tables=True,
                                                         made_elsewhere=True)

    def __init__(self, path: str | os.PathLike, name: str | None = None):
        self.path = Path(path)
        self.plan = Plan.load(self.path)
        self.name = name or self.plan.algorithm

    def shard(self, task: Task) -> Plan:
        if self.plan.task != task.name:
            raise InputError(f"plan file {self.path} is for task {self.plan.task!r}, not {task.name!r}")
        return Plan(task.name, self.name, list(self.plan.shards), dict(self.plan.row_maps), self.plan.dedup_ids)
