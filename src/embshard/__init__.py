"""embshard: learned embedding-table sharding for recommendation models."""

from embshard.errors import EmbshardError, InfeasibleError, InputError, PlanError
from embshard.plan import Plan, Shard, validate
from embshard.tables import Table, TraceRef
from embshard.task import Task, load_tasks

__all__ = [
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
    "validate",
]
__version__ = "0.1.0"
