"""embshard: learned embedding-table sharding for recommendation models.

    from embshard import EmbShardPlanner          # a TorchRec ShardingPlanner (embshard.planner)
    plan = embshard.plan(task, algorithm="neuroshard")   # our Plan (embshard.api.plan)

`embshard.plan` is also the module of Plan, Shard and the validator: calling it plans
(embshard/plan.py makes the module callable, so neither name hides the other).
"""

from typing import Any

from embshard.errors import EmbshardError, InfeasibleError, InputError, PlanError
from embshard import plan  # the module, callable as embshard.plan(task, algorithm=...)
from embshard.plan import Plan, Shard, validate
from embshard.tables import Table, TraceRef
from embshard.task import Task, load_tasks

__all__ = [
    "EmbShardPlanner",
    "EmbshardError",
    "InfeasibleError",
    "InputError",
    "Plan",
    "PlanError",
    "Shard",
    "Table",
    "Task",
    "TraceRef",
    "load_tasks",
    "plan",
    "validate",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # the planner subclasses TorchRec's ShardingPlanner: imported on first use, so that
    # `import embshard` stays free of TorchRec
    if name == "EmbShardPlanner":
        from embshard.planner import EmbShardPlanner

        return EmbShardPlanner
    raise AttributeError(f"module 'embshard' has no attribute {name!r}")
