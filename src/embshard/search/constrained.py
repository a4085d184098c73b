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

For an algorithm that places whole tables (its `Capabilities.splits_tables` is False: the
heuristics, DreamShard, AutoShard), a pooled table too large for one device's memory is cut
here too, as TorchRec's planner would shard it (`fit_kind`): into the widest equal column
slices that fit a device (halving the width while it is a multiple of 8 and the halves stay at
least its `min_partition`), which the search places as whole tables; where no such slices fit,
or its `sharding_types` leave out column_wise, into TorchRec's row blocks over all devices
(row_wise) or over one host (table_row_wise), as they allow. A table that fits whole is never
cut, so a task whose tables all fit plans as before. NeuroShard splits tables to fit on its
own and gets the task as it is.

The search then plans the other tables with each device's memory reduced by the most any
device holds of the fixed pieces (a device holding less keeps the difference unused: a
plan never exceeds memory), and the fixed pieces join its plan. A table allowed only
grid_shard is a one-line InputError: nothing here can honour it. The search never sees the
fixed tables, so its costs leave them out (they weigh alike on every device for row_wise and
data_parallel).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass, field

from embshard.errors import InfeasibleError, InputError
from embshard.layouts import even_row_layout
from embshard.plan import Plan, Shard, normalize, validate
from embshard.tables import DIM_ALIGNMENT, Table
from embshard.task import Task

log = logging.getLogger(__name__)

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


@dataclass
class Reduction:
    """The task a search plans once the constrained tables are shaped (`reduce_task`)."""

    task: Task | None                     # None: every table is fixed, nothing to search
    fixed: list[Shard] = field(default_factory=list)
    #: slice name -> (table, column offset)
    slices: dict[str, tuple[str, int]] = field(default_factory=dict)
    reserved_bytes: int = 0               # per device, taken from every device's memory
    fixed_tables: list[str] = field(default_factory=list)
    #: the tables cut because they fit no device whole (`fit_kind`)
    cut_to_fit: list[str] = field(default_factory=list)


def fit_kind(task: Task, table: Table, shrink: int = 0) -> tuple[str, int] | None:
    """How `reduce_task(fit=True)` cuts a pooled table too large for one device whole:
    ("column", the slice width) for the widest equal column slices that each fit in
    1 / 2**`shrink` of a device (the narrowest its constraints allow where none is that small,
    as long as they fit a device), else ("row_wise", 0) or
    ("table_row_wise", 0) where its row blocks fit (module docstring); None when the table fits
    whole, is a sequence table, or no cut here fits it (the search then names it and the
    shortfall)."""
    mem = task.device_memory_bytes
    need = lambda rows, dim: task.shard_memory_bytes(table, rows, dim)  # noqa: E731
    if table.is_sequence or need(table.rows, table.dim) <= mem:
        return None
    if table.allows("column_wise") or (task.hosts == 1 and table.allows("table_column_wise")):
        width = table.dim
        while (need(table.rows, width) > mem >> shrink and width % (2 * DIM_ALIGNMENT) == 0
               and width // 2 >= table.narrowest_column_piece()):
            width //= 2
        if need(table.rows, width) <= mem:
            return "column", width
    per_host = task.devices_per_host or task.num_devices
    options = ([("row_wise", task.num_devices)] if table.allows("row_wise") or
               (task.hosts == 1 and table.allows("table_row_wise")) else [])
    if task.hosts > 1 and table.allows("table_row_wise"):
        options.append(("table_row_wise", per_host))
    for kind, n in options:
        if need(even_row_layout(table.rows, n)[0][1], table.dim) <= mem:
            return kind, 0
    return None


def fit_kinds(task: Task, shrink: int = 0) -> dict[str, tuple[str, int]]:
    """`fit_kind` of every table `fixed_kind` leaves to the search that has one."""
    kinds = fixed_kinds(task)
    return {t.name: kind for t in task.tables
            if t.name not in kinds and (kind := fit_kind(task, t, shrink)) is not None}


def needs_reduction(task: Task, fit: bool = False) -> bool:
    """Whether `reduce_task(task, fit)` shapes any table."""
    return any(not t.allows("table_wise") for t in task.tables) or (fit and bool(fit_kinds(task)))


def reduce_task(task: Task, fit: bool = False, shrink: int = 0) -> Reduction:
    """Shape the tables whose constraints leave out table_wise and, with `fit`, the pooled
    tables too large for one device (`fit_kind` with `shrink`; module docstring)."""
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
    fits = fit_kinds(task, shrink) if fit else {}
    for t in task.tables:
        kind, width = kinds.get(t.name), column_slice_width(t)
        if t.name in fits:
            kind, width = fits[t.name]
        if kind is None:
            kept.append(t)
        elif kind == "column":
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
    cut = [t.name for t in task.tables if t.name in fits]
    fixed_by = ("the tables fixed by their sharding_types" if not any(n in fits for n in fixed_tables) else
                "the tables fixed before the search (by their sharding_types, or cut by rows to fit one device)")
    worst = max(range(d), key=lambda x: load[x])
    if reserved > task.device_memory_bytes:
        on = sorted({s.table for s in fixed if s.device == worst})
        raise InfeasibleError(
            f"table {on[0]!r}: {fixed_by} ({', '.join(on)}) need {reserved} bytes on "
            f"device {worst}, which has {task.device_memory_bytes}: short by {reserved - task.device_memory_bytes} bytes",
            table=on[0], shortfall_bytes=reserved - task.device_memory_bytes)
    sub = None
    if kept:
        if reserved >= task.device_memory_bytes:
            raise InfeasibleError(
                f"table {kept[0].name!r}: no memory left once {fixed_by} "
                f"({', '.join(fixed_tables)}) take {reserved} bytes per device", table=kept[0].name)
        sub = dataclasses.replace(task, tables=tuple(kept), device_memory_bytes=task.device_memory_bytes - reserved)
    return Reduction(sub, fixed, slices, reserved, fixed_tables, cut)


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


#: `shard_constrained` cuts a table too large for a device into slices of at most 1/2**k of a
#: device, k = 0 first, one more halving each time the search finds no plan, up to this k
MAX_FIT_SHRINK = 3


def shard_constrained(sharder, task: Task) -> Plan:
    """`sharder.shard(task)`, with the tables whose constraints leave out table_wise shaped
    first and, for a sharder that places whole tables, the pooled tables too large for one
    device cut (module docstring; where the search then finds no plan, their slices are halved
    and the search runs again, up to MAX_FIT_SHRINK times). Raises what the search raises, with
    the reserved memory named when the search ran short."""
    fit = not sharder.capabilities.splits_tables
    if sharder.capabilities.made_elsewhere or not needs_reduction(task, fit):
        return sharder.shard(task)
    name = getattr(sharder, "name", "plan")
    shrink = 0
    while True:
        reduction = reduce_task(task, fit, shrink)
        cut = reduction.cut_to_fit
        if cut:
            log.info("%s: %d table(s) too large for one device cut first (%s%s)%s", name, len(cut), ", ".join(cut[:3]),
                     f" and {len(cut) - 3} more" if len(cut) > 3 else "",
                     f", in slices within 1/{2 ** shrink} of a device: wider ones did not pack" if shrink else "")
        if reduction.task is None:
            return expand(task, reduction, None, name)
        try:
            return expand(task, reduction, sharder.shard(reduction.task), name)
        except InfeasibleError as e:
            if cut and shrink < MAX_FIT_SHRINK and fit_kinds(task, shrink + 1) != fit_kinds(task, shrink):
                shrink += 1
                continue
            also = (f"; {len(cut)} table(s) too large for one device cut first: {', '.join(cut[:3])}"
                    f"{f' and {len(cut) - 3} more' if len(cut) > 3 else ''}") if cut else ""
            fixed_how = "fixed before the search" if cut else "fixed by their sharding_types"
            raise InfeasibleError(
                f"{_slice_named(str(e).splitlines()[0], e.table, reduction)} (each device's memory less "
                f"{reduction.reserved_bytes} bytes for the tables {fixed_how}: "
                f"{', '.join(reduction.fixed_tables) or 'column slices only'}{also})",
                table=reduction.slices.get(e.table or "", (e.table,))[0], shortfall_bytes=e.shortfall_bytes) from None
