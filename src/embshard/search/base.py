"""The Sharder protocol every search algorithm and baseline implements, and what each declares
it can do (`Capabilities`), so a caller can refuse a task an algorithm is not meant for
instead of letting it run without a word (embshard.compare.refusal)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from embshard.plan import Plan
from embshard.task import Task

if TYPE_CHECKING:
    from embshard.search.guard import GuardResult


@dataclass(frozen=True)
class Capabilities:
    """What an algorithm is meant for.

    Args:
        table_kinds: the table kinds (`embshard.tables.TABLE_KINDS`) it is meant for. A task
            with no table of these kinds is refused; an algorithm not meant for sequence
            tables also refuses a task holding any (its cost models, policy or TorchRec's
            EmbeddingBagCollection model pooled lookups only). One meant for sequence tables
            may carry pooled tables beside them: the sequence data path runs both.
        splits_tables: whether it splits tables (columns or rows) over devices itself. One that
            does not gets a pooled table too large for one device cut first, as TorchRec would
            shard it (`embshard.search.constrained.shard_constrained`); its infeasibility
            errors name the ones that do.
        made_elsewhere: its plan was made before the run (a plan file): it gets the task as it
            is, never the task with constrained tables shaped first (search/constrained.py).
    """

    table_kinds: tuple[str, ...]
    splits_tables: bool
    made_elsewhere: bool = False


#: whole tables of either kind, one device each (the table-wise heuristics)
WHOLE_TABLES = Capabilities(("pooled", "sequence"), splits_tables=False)


@runtime_checkable
class Sharder(Protocol):
    """Turns a task into a plan. Raises InfeasibleError (naming the table and the
    shortfall in bytes) when it cannot place everything within memory; never drops a table."""

    name: str
    capabilities: ClassVar[Capabilities]

    def shard(self, task: Task) -> Plan: ...


@runtime_checkable
class GuardedSharder(Sharder, Protocol):
    """A sharder with a measured guard (`embshard.search.guard`): given hardware, it measures
    its candidates against the heuristics' plans before it returns one (NeuroShard, the
    portfolio). shard.py attaches its evaluator under evaluate=measured."""

    #: what the guard did on the last task (None: it did not run)
    last_guard: GuardResult | None
    #: the plan the search itself picked on the last task, before the guard measured
    last_search_pick: Plan | None

    def attach_evaluator(self, evaluator: Any) -> None:
        """The hardware the guard measures on (`HardwareEvaluator`); None detaches it."""
        ...
