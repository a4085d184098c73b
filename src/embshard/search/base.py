"""The Sharder protocol every search algorithm and baseline implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from embshard.plan import Plan
from embshard.task import Task


@runtime_checkable
class Sharder(Protocol):
    """Turns a task into a plan. Raises InfeasibleError (naming the table and the
    shortfall in bytes) when it cannot place everything within memory; never drops a table."""

    name: str

    def shard(self, task: Task) -> Plan: ...
