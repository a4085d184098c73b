"""Tables whose constraints leave a search no choice of shape: fixed before the search runs.

A table's `sharding_types` (a TorchRec `ParameterConstraints`, or the task JSON) say how a plan
may shard it. Where table_wise is among them, every algorithm can honour them itself: the
table-wise heuristics and the RL policies place whole tables, NeuroShard splits only the
ways a table allows (`NeuroShardSearch.may_halve`, `row_groups_for`), TorchRec's planner gets
them as its own constraints. Where table_wise is not, the table is reshaped here, once, for
every algorithm (`shard_constrained`):

* column_wise (or table_column_wise on one host): the table is cut into column slices of
  TorchRec's width (the smallest multiple of 4 that divides the dim and is at least
  `min_partition`, 128 by default, TorchRec's MIN_CW_DIM; the whole width when none is), and
  the search places each slice as a whole table; slices that land on one device are merged;
* else row_wise: TorchRec's row blocks over all devices (the layout is fixed; nothing to search);
* else table_row_wise: TorchRec's row blocks over the devices of one host, the host with the
  least fixed memory so far;
* else data_parallel: the whole table on every device (replicas), each copy looking up its own
  share of the batch;
* else table_column_wise over several hosts: TorchRec's column slices, fixed in contiguous runs
  on the devices of the host with the least fixed memory so far.

The search then plans the other tables with each device's memory reduced by the most any
device holds of the fixed pieces (a device holding less keeps the difference unused: a
plan never exceeds memory), and the fixed pieces join its plan. A table allowed only
grid_shard is a one-line InputError: nothing here can honour it. The search never sees the
fixed tables, so its costs leave them out (they weigh alike on every device for row_wise and
data_parallel).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

from embshard.errors import InfeasibleError, InputError
from embshard.layouts import even_row_layout
from embshard.plan import Plan, Shard, normalize, validate
from embshard.tables import DIM_ALIGNMENT, Table
from embshard.task import Task

#: TorchRec's MIN_CW_DIM (torchrec/distributed/planner/constants.py): the column-wise slice
#: width it aims at when a table has no min_partition.
DEFAULT_MIN_PARTITION = 128
#: Slice names: `<table>__cw<k>` (made unique against the task's names).
SLICE_MARK = "__cw"


def column_slice_width(table: Table) -> int:
    """TorchRec's column-wise slice width: the smallest multiple of 4 in [min_partition, dim)
    that divides dim, else dim (torchrec/distributed/sharding_plan.py, _find_base_dim)."""
    lower = table.min_partition or DEFAULT_MIN_PARTITION
    for width in range(max(lower, DIM_ALIGNMENT), table.dim):
        if table.dim % width == 0 and width % DIM_ALIGNMENT == 0:
            return width
    return table.dim


def fixed_kind(table: Table, hosts: int) -> str | None:
    """How `shard_constrained` shapes a table before the search: "column", "row_wise",
    "table_row_wise", "data_parallel", "table_column" (several hosts), or None (the search honours
    its constraints itself).

    Raises:
        InputError: no shape here honours the table's sharding types (names the table).
    """
    if table.allows("table_wise"):
        return None
    if table.allows("column_wise") or (hosts == 1 and table.allows("table_column_wise")):
        return "column"
    for kind in ("row_wise", "table_row_wise", "data_parallel"):
        if table.allows(kind):
            return kind
    if table.allows("table_column_wise"):  # several hosts: the slices fixed on one host's devices
        return "table_column"
    raise InputError(
        f"table {table.name!r}: sharding_types {list(table.sharding_types or ())} cannot be honoured here "
        f"(embshard plans grid_shard only as NeuroShard's own split); "
        "allow table_wise, column_wise, table_column_wise, row_wise, table_row_wise or data_parallel"
    )


def fixed_kinds(task: Task) -> dict[str, str]:
    """`fixed_kind` of every table of `task` that has one (the shapes every plan gives them)."""
    return {t.name: kind for t in task.tables if (kind := fixed_kind(t, task.hosts)) is not None}


def forced_data_parallel(task: Task) -> list[str]:
    """The pooled tables every plan of `task` replicates (`fixed_kind` data_parallel: their
    sharding_types leave no other shape), in task order."""
    kinds = fixed_kinds(task)
    return [t.name for t in task.tables if not t.is_sequence and kinds.get(t.name) == "data_parallel"]


@dataclass
class Reduction:
    """The task a search plans once the constrained tables are shaped (`reduce_task`)."""

    task: Task | None                     # None: every table is fixed, nothing to search
    fixed: list[Shard] = field(default_factory=list)
    #: slice name -> (table, column offset)
    slices: dict[str, tuple[str, int]] = field(default_factory=dict)
    reserved_bytes: int = 0               # per device, taken from every device's memory
    fixed_tables: list[str] = field(default_factory=list)


def needs_reduction(task: Task) -> bool:
    return any(not t.allows("table_wise") for t in task.tables)


def reduce_task(task: Task) -> Reduction:
    """Shape the tables whose constraints leave out table_wise (module docstring)."""
    d = task.num_devices
    per_host = task.devices_per_host or d
    hosts = [list(range(h, h + per_host)) for h in range(0, d, per_host)]
    names = set(task.table_by_name)
    fixed: list[Shard] = []
    load = [0] * d
    kept: list[Table] = []
    slices: dict[str, tuple[str, int]] = {}
    fixed_tables: list[str] = []

    def least_loaded_host() -> list[int]:  # the host whose fullest device holds the least fixed memory so far
        return min(hosts, key=lambda h: (max(load[x] for x in h), h))

    kinds = fixed_kinds(task)
    for t in task.tables:
        kind = kinds.get(t.name)
        if kind is None:
            kept.append(t)
        elif kind == "column":
            width = column_slice_width(t)
            for k, off in enumerate(range(0, t.dim, width)):
                name = f"{t.name}{SLICE_MARK}{k}"
                while name in names:
                    name += "_"
                names.add(name)
                slices[name] = (t.name, off)
                kept.append(dataclasses.replace(t, name=name, dim=width, sharding_types=("table_wise",),
                                                min_partition=None))
        elif kind == "table_column":
            # TorchRec's slices, in contiguous runs over the devices of the host with the least
            # fixed memory so far, least-loaded device first (one piece per device)
            width = column_slice_width(t)
            offs = list(range(0, t.dim, width))
            host = least_loaded_host()
            devs = sorted(host, key=lambda x: (load[x], x))[:len(offs)]
            per, extra = divmod(len(offs), len(devs))
            start = 0
            for k, dev in enumerate(devs):
                n = per + (k < extra)
                piece = Shard(t.name, dev, offs[start], n * width, 0, t.rows)
                load[dev] += task.shard_memory_bytes(t, t.rows, piece.dim)
                fixed.append(piece)
                start += n
            fixed_tables.append(t.name)
        else:
            if kind == "data_parallel":
                pieces = [Shard(t.name, dev, 0, t.dim, 0, t.rows, replica=dev) for dev in range(d)]
                copies = d
            else:
                group = list(range(d)) if kind == "row_wise" else least_loaded_host()
                pieces = [Shard(t.name, dev, 0, t.dim, off, rows)
                          for (off, rows), dev in zip(even_row_layout(t.rows, len(group)), group) if rows > 0]
                copies = 1
            for s in pieces:
                load[s.device] += task.shard_memory_bytes(t, s.rows, s.dim, copies)
            fixed += pieces
            fixed_tables.append(t.name)
    reserved = max(load)
    worst = max(range(d), key=lambda x: load[x])
    if reserved > task.device_memory_bytes:
        on = sorted({s.table for s in fixed if s.device == worst})
        raise InfeasibleError(
            f"table {on[0]!r}: the tables fixed by their sharding_types ({', '.join(on)}) need {reserved} bytes on "
            f"device {worst}, which has {task.device_memory_bytes}: short by {reserved - task.device_memory_bytes} bytes",
            table=on[0], shortfall_bytes=reserved - task.device_memory_bytes)
    sub = None
    if kept:
        if reserved >= task.device_memory_bytes:
            raise InfeasibleError(
                f"table {kept[0].name!r}: no memory left once the tables fixed by their sharding_types "
                f"({', '.join(fixed_tables)}) take {reserved} bytes per device", table=kept[0].name)
        sub = dataclasses.replace(task, tables=tuple(kept), device_memory_bytes=task.device_memory_bytes - reserved)
    return Reduction(sub, fixed, slices, reserved, fixed_tables)


def expand(task: Task, reduction: Reduction, plan: Plan | None, algorithm: str) -> Plan:
    """The plan of the whole task: the search's plan with slices mapped back onto their tables
    (merged where several land on one device) and the fixed pieces added; validated."""
    shards: list[Shard] = list(reduction.fixed)
    row_maps, dedup = {}, False
    if plan is not None:
        row_maps, dedup = dict(plan.row_maps), plan.dedup_ids
        for s in plan.shards:
            if s.table in reduction.slices:
                name, off = reduction.slices[s.table]
                shards.append(dataclasses.replace(s, table=name, col_offset=off + s.col_offset))
            else:
                shards.append(s)
    by_table: dict[str, list[Shard]] = defaultdict(list)
    for s in shards:
        by_table[s.table].append(s)
    ordered = [s for t in task.tables for s in by_table[t.name]]
    out = normalize(task, Plan(task.name, algorithm, ordered, row_maps, dedup))
    validate(task, out)
    return out


def _slice_named(message: str, name: str | None, reduction: Reduction) -> str:
    """`message` with a column slice's internal name replaced by its table's name and columns
    (the user never named `<table>__cw<k>`)."""
    if name is None or name not in reduction.slices or reduction.task is None:
        return message
    table, off = reduction.slices[name]
    width = reduction.task.table_by_name[name].dim
    return message.replace(repr(name), f"{table!r} (its column slice {off}:{off + width})")


def shard_constrained(sharder, task: Task) -> Plan:
    """`sharder.shard(task)`, with the tables whose constraints leave out table_wise shaped
    first (module docstring). Raises what the search raises, with the reserved memory named
    when the search ran short."""
    if not needs_reduction(task) or sharder.capabilities.made_elsewhere:
        return sharder.shard(task)
    reduction = reduce_task(task)
    plan = None
    if reduction.task is not None:
        try:
            plan = sharder.shard(reduction.task)
        except InfeasibleError as e:
            raise InfeasibleError(
                f"{_slice_named(str(e).splitlines()[0], e.table, reduction)} (each device's memory less "
                f"{reduction.reserved_bytes} bytes for the tables "
                f"fixed by their sharding_types: {', '.join(reduction.fixed_tables) or 'column slices only'})",
                table=reduction.slices.get(e.table or "", (e.table,))[0], shortfall_bytes=e.shortfall_bytes) from None
    return expand(task, reduction, plan, getattr(sharder, "name", "plan"))
