"""A model of pooled and sequence tables for a planner of pooled tables only.

NeuroShard, the portfolio, DreamShard, AutoShard and TorchRec's planner as wrapped here plan
pooled tables (EmbeddingBags) only: their cost models and policies price pooled lookups. A
TorchRec model often has an `EmbeddingCollection` of sequence tables beside its
`EmbeddingBagCollection`s, and TorchRec's own planner plans both. `embshard.plan` (and so
`EmbShardPlanner`) plans such a task in two parts, in one memory budget:

1. the sequence tables, alone: each is cut into TorchRec's row-wise blocks, one per device, where
   its sharding_types allow row_wise and its rows give every device a block (cutting a sequence
   table by rows does not grow its all-to-all: every id's vector is sent once, whichever device
   holds its row, where a pooled table's row blocks each send a full-width partial sum; and it
   spreads the unpooled lookups, which on CPU cost 10-20x pooled ones, over every device, as
   TorchRec's planner does: measured in docs/torchrec.md); the others by `SEQUENCE_PLANNER` (a
   table-wise heuristic that plans both kinds, with their constraints honoured as for any
   whole-table planner); the most memory any device's sequence tables take there is reserved on
   every device;
2. the pooled tables, alone, by the planner asked for, on the same devices with each device's
   memory less that reservation;
3. the sequence tables placed again, whole, largest first, onto the device with the least work
   so far that has room (work: bytes a step reads, batch x lookups x dim, of the pooled pieces
   there and the sequence tables placed), so they fill the devices the pooled plan left light;
   the row blocks of step 1 stay where they are, their work counted; where a table does not fit
   that way, or is not placed whole in step 1 (its constraints, or too large for one device), or
   its sharding_types leave out table_wise, step 1's placement of the sequence tables is kept,
   which fits (every device has the reservation free);
4. the two together, validated on the whole task;
5. where the planner has a measured guard and hardware (shard.py `evaluate=measured`, or
   `embshard.plan(..., hardware=...)`), that guard measures the whole plan against the
   heuristics' plans of the whole task, which plan both kinds (`guard_mixed`): its own guard
   saw the pooled tables only, and how the sequence tables were placed beside them is judged by
   no model. The heuristic's plan is kept unless the two-part plan is shown better.

The planner's estimate covers its pooled tables only. Where the pooled tables do not fit beside the reservation,
the whole task is planned by `SEQUENCE_PLANNER` instead, with a warning naming why, and
`MixedResult.fallback` says so; where that finds no plan either, its error is raised (naming the
table and the shortfall), with the planner's own beside it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

from embshard.errors import InfeasibleError
from embshard.layouts import even_row_layout
from embshard.plan import MemoryLedger, Plan, Shard
from embshard.search.base import Capabilities
from embshard.search.baselines import DeviceOrder, GreedySharder
from embshard.tables import Table
from embshard.task import Task

log = logging.getLogger(__name__)

#: the table-wise heuristic that plans the sequence tables (and the whole task as the fallback)
SEQUENCE_PLANNER = "size_lookup_greedy"
#: a sequence table is cut into row blocks over every device in step 1 where its work exceeds
#: this many even shares of all the tables' work: 0, every one (chosen on measurements of
#: TorchRec's step, docs/torchrec.md; 1.0, only the heaviest, was 0.81x worse over six tasks)
SPLIT_SEQUENCE_ABOVE = 0.0


def is_mixed(capabilities: Capabilities, task: Task) -> bool:
    """Whether `task` holds both kinds and the planner is meant for pooled tables only: the case
    this module plans in two parts."""
    kinds = {t.kind for t in task.tables}
    return kinds == {"pooled", "sequence"} and "pooled" in capabilities.table_kinds \
        and "sequence" not in capabilities.table_kinds


@dataclass
class MixedResult:
    """What `shard_mixed` did: the plan, the sequence tables' reservation per device, and why the
    whole task fell back to `SEQUENCE_PLANNER` (None: it did not)."""

    plan: Plan
    sequence_tables: int
    pooled_tables: int
    reserved_bytes: int
    fallback: str | None = None
    #: sequence tables cut into row blocks over every device in step 1
    row_split: tuple[str, ...] = ()

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sequence_planner": SEQUENCE_PLANNER, "sequence_tables": self.sequence_tables,
                               "pooled_tables": self.pooled_tables, "reserved_bytes": self.reserved_bytes,
                               "row_split": list(self.row_split)}
        if self.fallback is not None:
            out["fallback"] = self.fallback
        return out


def shard_mixed(task: Task, plan_pooled: Callable[[Task], Plan], name: str) -> MixedResult:
    """Plan `task` (pooled and sequence tables) in two parts (module docstring).

    Args:
        task: a task with tables of both kinds.
        plan_pooled: plans a task of pooled tables only (the planner asked for, with its
            constraint handling: `shard_constrained`).
        name: the planner's name, for the messages and the plan.
    """
    from embshard.search.constrained import shard_constrained

    sequence = tuple(t for t in task.tables if t.is_sequence)
    pooled = tuple(t for t in task.tables if not t.is_sequence)
    heuristic = GreedySharder("size_lookup", name=SEQUENCE_PLANNER)
    seq_plan, split = _plan_sequence(task, sequence, heuristic)
    reserved = max(seq_plan.memory_bytes(task))
    try:
        if reserved >= task.device_memory_bytes:  # no memory left for a pooled task at all
            raise InfeasibleError(f"the sequence tables take all {task.device_memory_bytes} bytes of a device",
                                  table=pooled[0].name, shortfall_bytes=task.table_memory_bytes(pooled[0]))
        pooled_plan = plan_pooled(dataclasses.replace(task, tables=pooled,
                                                      device_memory_bytes=task.device_memory_bytes - reserved))
    except InfeasibleError as e:
        why = (f"{name}: the pooled tables do not fit beside the sequence tables' reservation of {reserved} bytes "
               f"per device ({str(e).splitlines()[0]}); the whole task planned by {SEQUENCE_PLANNER}")
        try:
            whole = shard_constrained(heuristic, task)
        except InfeasibleError as f:
            raise InfeasibleError(f"{str(f).splitlines()[0]} ({SEQUENCE_PLANNER} on the whole task, after {name} found no "
                                  f"plan of the pooled tables beside the sequence tables' reservation of {reserved} "
                                  f"bytes per device: {str(e).splitlines()[0]})",
                                  table=f.table, shortfall_bytes=f.shortfall_bytes) from None
        log.warning("%s", why)
        whole.algorithm = name
        return MixedResult(whole, len(sequence), len(pooled), reserved, why)
    log.info("%s: %d pooled table(s) planned by %s, %d sequence table(s) by %s%s (%d bytes per device reserved)",
             task.name, len(pooled), name, len(sequence), SEQUENCE_PLANNER,
             f", {len(split)} of them cut into row blocks" if split else "", reserved)
    placed = _place_by_work(task, pooled_plan, seq_plan, set(split))
    plan = dataclasses.replace(pooled_plan, task=task.name, algorithm=name,
                               shards=list(pooled_plan.shards) + list((placed or seq_plan).shards))
    return MixedResult(plan, len(sequence), len(pooled), reserved, row_split=split)


def row_split_tables(task: Task) -> tuple[Table, ...]:
    """The sequence tables step 1 cuts into row blocks over every device: each whose work alone
    exceeds `SPLIT_SEQUENCE_ABOVE` even shares of all the tables' work, whose sharding_types
    allow row_wise (or name none), and whose rows TorchRec's row-wise layout gives every device
    a block of."""
    d = task.num_devices
    if d < 2:
        return ()
    share = sum(_work(task, t, t.rows, t.dim) for t in task.tables) / d
    return tuple(t for t in task.tables
                 if t.is_sequence and _work(task, t, t.rows, t.dim) > SPLIT_SEQUENCE_ABOVE * share
                 and (not t.sharding_types or "row_wise" in t.sharding_types)
                 and all(n > 0 for _, n in even_row_layout(t.rows, d)))


def _plan_sequence(task: Task, sequence: tuple[Table, ...], heuristic: GreedySharder) -> tuple[Plan, tuple[str, ...]]:
    """Step 1: (the sequence tables' plan, the tables cut into row blocks). Where the others do not
    fit beside the blocks, no table is cut."""
    from embshard.search.constrained import shard_constrained

    heavy = row_split_tables(task)
    names = {t.name for t in heavy}
    blocks = [Shard(t.name, d, 0, t.dim, off, n) for t in heavy
              for d, (off, n) in enumerate(even_row_layout(t.rows, task.num_devices))]
    rest = tuple(t for t in sequence if t.name not in names)
    if blocks:
        taken = max(Plan(task.name, SEQUENCE_PLANNER, blocks).memory_bytes(task))
        if taken < task.device_memory_bytes:
            try:
                others = shard_constrained(heuristic, dataclasses.replace(
                    task, tables=rest, device_memory_bytes=task.device_memory_bytes - taken)).shards if rest else []
                return Plan(task.name, SEQUENCE_PLANNER, blocks + list(others)), tuple(t.name for t in heavy)
            except InfeasibleError:
                pass
    return shard_constrained(heuristic, dataclasses.replace(task, tables=sequence)), ()


def _work(task: Task, table: Table, rows: int, dim: int) -> float:
    """Bytes a piece reads in a step: its share of the batch's lookups of `table` times its width."""
    return task.batch_size * table.pooling_factor * (rows / table.rows) * dim * table.bytes_per_element


def _place_by_work(task: Task, pooled_plan: Plan, seq_plan: Plan, split: set[str] = frozenset()) -> Plan | None:
    """Step 3 of the module docstring: the sequence tables of `seq_plan` placed again beside
    `pooled_plan` (the row blocks of the `split` tables kept where they are), or None where one
    is not whole there or does not fit."""
    tables = task.table_by_name
    fixed = [s for s in seq_plan.shards if s.table in split]
    seq = [tables[s.table] for s in seq_plan.shards if s.table not in split]
    if len(seq) != len({t.name for t in seq}) or any(
            s.rows != tables[s.table].rows or s.dim != tables[s.table].dim or s.replica
            for s in seq_plan.shards if s.table not in split) \
            or any(t.sharding_types and "table_wise" not in t.sharding_types for t in seq):
        return None
    # the greedy heuristics' own machinery: the memory ledger (with its look-ahead over the sequence
    # tables still to place) and the devices by (work so far, most free memory, index) in a heap
    ledger = MemoryLedger(task, pending=(task.table_memory_bytes(t) for t in seq))
    both = Plan(task.name, seq_plan.algorithm, list(pooled_plan.shards) + fixed)
    for d, used in enumerate(both.memory_bytes(task)):
        ledger.take(d, used)
    work = [0.0] * task.num_devices
    for s in both.shards:
        work[s.device] += _work(task, tables[s.table], s.rows, s.dim)
    order = DeviceOrder([(work[d], -ledger.free[d], d) for d in range(task.num_devices)])
    shards = []
    for t in sorted(seq, key=lambda t: (-_work(task, t, t.rows, t.dim), t.name)):
        try:
            d = ledger.place(t, ledger.need(t), order)
        except InfeasibleError:
            return None
        work[d] += _work(task, t, t.rows, t.dim)
        order.settle(d, (work[d], -ledger.free[d], d))
        shards.append(Shard.whole(t, d))
    return Plan(task.name, seq_plan.algorithm, fixed + shards)


def guard_mixed(task: Task, result: MixedResult, sharder: Any, name: str) -> tuple[Plan, dict[str, Any] | None]:
    """Step 5 of the module docstring: (the plan kept, what the whole-task guard did as
    report.json's `guard`; None where it did not run: no guard, no hardware, verify 0, or the
    whole task already fell back to `SEQUENCE_PLANNER`)."""
    from embshard.search.guard import MeasuredGuard

    guard, evaluator = getattr(sharder, "guard", None), getattr(sharder, "evaluator", None)
    if (result.fallback is not None or not isinstance(guard, MeasuredGuard) or evaluator is None
            or getattr(sharder, "verify_count", 0) <= 0):
        return result.plan, None
    plan, done = guard.run(task, [(f"{name}#1", result.plan)], evaluator, lambda p: None, name)
    plan.algorithm = name
    return plan, done.to_dict()
