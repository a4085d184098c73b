"""Shards, plans, the one plan validator, and plan JSON (docs/contracts.md).

Row-level plans (FlexShard and its baselines) use two optional additions, both absent from
older plan JSON, which stays valid and round-trips unchanged:

* `replica` on a shard (default 0): replica 0 of a table covers it exactly once; a shard with
  replica k >= 1 is a copy of a replica-0 rectangle on another device (counted in memory,
  its gradients synchronised in training).
* `row_maps` on the plan: per table, a sidecar .npy file of row ids that are moved to the
  front of the table, in their new order (`front[new_id] = original row id`); the rows they
  displace take their places in order, every other row keeps its id (embshard.flexshard.rowmap).
  Shards then address rows of the remapped table. `dedup_ids` says the data path sends each
  distinct id once per (device, table), as TorchRec's use_index_dedup; `sparse_sync` that
  replicas synchronise only the rows looked up in the step (embshard.flexshard.routing),
  where without it every replicated row's gradient is all-reduced every step.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import os
import re
import sys
import types
import warnings
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from embshard.errors import InfeasibleError, InputError, PlanError, check_keys
from embshard.io import atomic_path, write_json_atomic
from embshard.layouts import check_min_partition, choose_layout, even_row_layout  # noqa: F401 (re-exported)
from embshard.tables import DIM_ALIGNMENT, Table, _is_int
from embshard.task import Task, read_json


#: Every key a plan JSON object may hold (docs/contracts.md).
PLAN_FIELDS = ("task", "algorithm", "shards", "row_maps", "dedup_ids", "sparse_sync")


@dataclass(frozen=True)
class Shard:
    """A rectangle of one table (rows × columns) living on one device."""

    table: str
    device: int
    col_offset: int
    dim: int
    row_offset: int
    rows: int
    #: 0: the primary copy; k >= 1: the k-th extra copy of the same rectangle (replication).
    replica: int = 0

    @classmethod
    def whole(cls, table: Table, device: int) -> "Shard":
        return cls(table.name, device, 0, table.dim, 0, table.rows)

    @property
    def rectangle(self) -> tuple[str, int, int, int, int]:
        return (self.table, self.row_offset, self.rows, self.col_offset, self.dim)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.replica:
            d.pop("replica")
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Shard":
        fields = ("table", "device", "col_offset", "dim", "row_offset", "rows")
        if not isinstance(d, dict):
            raise InputError(f"a shard must be a JSON object, got {type(d).__name__}")
        check_keys(d, fields + ("replica",), f"shard of table {d.get('table')!r}")
        missing = [f for f in fields if f not in d]
        if missing:
            raise InputError(f"shard of table {d.get('table')!r}: missing field(s) {missing}")
        if not isinstance(d["table"], str):
            raise InputError(f"a shard's table must be a table name (a string), got {d['table']!r}")
        for f in fields[1:] + (("replica",) if "replica" in d else ()):
            if not _is_int(d[f]):
                raise InputError(f"shard of table {d['table']!r}: {f} must be an integer, got {d[f]!r}")
        return cls(**{f: d[f] for f in fields}, replica=d.get("replica", 0))


@dataclass
class Plan:
    """Where every piece of every table lives.

    `row_maps` (table -> int64 array), `dedup_ids` and `sparse_sync` are for row-level plans
    (module docstring).
    """

    task: str
    algorithm: str
    shards: list[Shard] = field(default_factory=list)
    row_maps: dict[str, np.ndarray] = field(default_factory=dict)
    dedup_ids: bool = False
    sparse_sync: bool = False

    def shards_on(self, device: int) -> list[Shard]:
        return [s for s in self.shards if s.device == device]

    def by_device(self, num_devices: int) -> list[list[Shard]]:
        """`shards_on` of every device 0 .. num_devices - 1, in one pass over the shards (one
        `shards_on` per device is O(devices × shards): 5.5M visits for 5,384 tables on 1,024)."""
        out: list[list[Shard]] = [[] for _ in range(num_devices)]
        for s in self.shards:
            if not 0 <= s.device < num_devices:
                raise PlanError(f"plan {self.algorithm!r}: table {s.table!r} is on device {s.device}, "
                                f"outside 0..{num_devices - 1}")
            out[s.device].append(s)
        return out

    def device_widths(self, num_devices: int, tables: "Mapping[str, Table] | None" = None) -> list[int]:
        """Columns each device sends per sample in the forward all-to-all (its output's width).

        A pooled piece sends its pooled sum: its width (times the table's `num_poolings`, one
        output per feature, when `tables` is given). Replicated pooled tables (data-parallel)
        send nothing: each copy pools its own samples. A sequence piece (needs `tables`; without
        them it counts as pooled) sends one vector per id it serves: width × pooling_factor ×
        its rows' share of the table, over its copies (the uniform-access share its memory is
        counted with, `Task.shard_memory_bytes`); a rectangle held on every device sends
        nothing (every id is looked up where its sample is). Rounded to whole columns."""
        replicated = {s.table for s in self.shards if s.replica}
        widths = [0.0] * num_devices
        copies = Counter(s.rectangle for s in self.shards) if tables is not None else None
        for s in self.shards:
            t = tables.get(s.table) if tables is not None else None
            if t is not None and t.is_sequence:
                k = copies[s.rectangle]
                if k < num_devices:
                    widths[s.device] += s.dim * t.pooling_factor * s.rows / (t.rows * k)
            elif s.table not in replicated:
                widths[s.device] += s.dim * (t.num_poolings if t is not None else 1.0)
        return [int(round(w)) for w in widths]

    def data_parallel_floats(self, num_devices: int, tables: "Mapping[str, Table]") -> int:
        """Gradient values each rank all-reduces in a step: rows × dim of every pooled rectangle
        held on all `num_devices` devices (TorchRec's data_parallel, synchronised by DDP). A
        sequence rectangle's copies and a pooled rectangle on only some devices count nothing
        here (see `partly_replicated_pooled`)."""
        if num_devices <= 1:
            return 0
        holders: dict[tuple, set[int]] = {}
        for s in self.shards:
            t = tables.get(s.table)
            if t is not None and not t.is_sequence:
                holders.setdefault(s.rectangle, set()).add(s.device)
        return sum(r[2] * r[4] for r, devs in holders.items() if len(devs) >= num_devices)

    def partly_replicated_pooled(self, num_devices: int, tables: "Mapping[str, Table]") -> list[str]:
        """Pooled tables with a rectangle copied onto some devices but not all (no sharding type of
        TorchRec's, and no measurement here, models those copies)."""
        holders: dict[tuple, set[int]] = {}
        replicated: set[tuple] = set()
        for s in self.shards:
            t = tables.get(s.table)
            if t is not None and not t.is_sequence:
                holders.setdefault(s.rectangle, set()).add(s.device)
                if s.replica:
                    replicated.add(s.rectangle)
        return sorted({r[0] for r in replicated if len(holders[r]) < num_devices})

    def memory_bytes(self, task: Task) -> list[int]:
        """Bytes each device allocates under this plan (weights, optimizer state, I/O), every
        replica counted on its own device."""
        tables = task.table_by_name
        used = [0] * task.num_devices
        copies = Counter(s.rectangle for s in self.shards)
        for s in self.shards:
            if 0 <= s.device < task.num_devices and s.table in tables:
                used[s.device] += task.shard_memory_bytes(tables[s.table], s.rows, s.dim, copies[s.rectangle])
        return used

    def signature(self) -> tuple:
        """Where every piece lives, whatever the algorithm's name or the shard order."""
        return tuple(sorted((s.table, s.device, s.col_offset, s.dim, s.row_offset, s.rows, s.replica) for s in self.shards))

    def to_dict(self, row_map_files: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"task": self.task, "algorithm": self.algorithm, "shards": [s.to_dict() for s in self.shards]}
        if row_map_files:
            d["row_maps"] = row_map_files
        if self.dedup_ids:
            d["dedup_ids"] = True
        if self.sparse_sync:
            d["sparse_sync"] = True
        return d

    @classmethod
    def from_dict(cls, d: Any, source: str = "plan", base_dir: str | os.PathLike | None = None) -> "Plan":
        """A plan from its JSON object; sidecar row maps resolve against `base_dir` (the plan
        file's folder; the working directory when None)."""
        if not isinstance(d, dict):
            raise InputError(f"{source}: a plan must be a JSON object, got {type(d).__name__}")
        check_keys(d, PLAN_FIELDS, f"{source}: plan")
        missing = {"task", "algorithm", "shards"} - set(d)
        if missing:
            raise InputError(f"{source}: missing field(s) {sorted(missing)}")
        if not isinstance(d["shards"], list):
            raise InputError(f"{source}: 'shards' must be a list")
        for key in ("dedup_ids", "sparse_sync"):
            if not isinstance(d.get(key, False), bool):
                raise InputError(f"{source}: {key!r} must be true or false, got {d[key]!r}")
        row_maps = _load_row_maps(d.get("row_maps", {}), source, Path(base_dir) if base_dir is not None else Path("."))
        return cls(str(d["task"]), str(d["algorithm"]), [Shard.from_dict(s) for s in d["shards"]], row_maps,
                   d.get("dedup_ids", False), d.get("sparse_sync", False))

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan JSON, and each row map as a sidecar `<stem>.rowmaps/<table>.npy`
        beside it (each file written atomically, the JSON last)."""
        path = Path(path)
        files: dict[str, dict[str, Any]] = {}
        for name, ids in self.row_maps.items():
            rel = f"{path.stem}.rowmaps/{_safe_file_name(name)}.npy"
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(ids, dtype=np.int64), allow_pickle=False)
            data = buf.getvalue()
            with atomic_path(path.parent / rel) as tmp:
                tmp.write_bytes(data)
            files[name] = {"file": rel, "rows": int(len(ids)), "sha256": hashlib.sha256(data).hexdigest()}
        write_json_atomic(path, self.to_dict(files))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        d = read_json(path)
        try:
            return cls.from_dict(d, source=str(path), base_dir=Path(path).parent)
        except InputError as e:  # a shard's own check: say which file it is in
            msg = str(e)
            raise InputError(msg if msg.startswith(f"{path}: ") else f"{path}: {msg}") from None


def _safe_file_name(table: str) -> str:
    """A file name for a table's sidecar: its name where that is safe, made unique by a checksum."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', table)[:64]}-{zlib.crc32(table.encode()):08x}"


def _load_row_maps(spec: Any, source: str, base_dir: Path) -> dict[str, np.ndarray]:
    """Read and check the sidecar row maps a plan names (np.load without pickle: data only)."""
    if not isinstance(spec, dict):
        raise InputError(f"{source}: 'row_maps' must be an object {{table: {{file, rows, sha256}}}}")
    out: dict[str, np.ndarray] = {}
    for table, entry in spec.items():
        if isinstance(entry, dict):
            check_keys(entry, ("file", "rows", "sha256"), f"{source}: row map of table {table!r}")
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not _is_int(entry.get("rows")):
            raise InputError(f"{source}: row map of table {table!r} must be {{'file': str, 'rows': int, 'sha256': str}}")
        file = base_dir / entry["file"]
        try:
            data = file.read_bytes()
        except OSError:
            raise InputError(f"{source}: row map of table {table!r}: {file}: no such file") from None
        if "sha256" in entry and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise InputError(f"{source}: row map of table {table!r}: {file} does not match its sha256 (changed or truncated)")
        try:
            ids = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise InputError(f"{source}: row map of table {table!r}: {file} is not a .npy array ({e})") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) != entry["rows"]:
            raise InputError(
                f"{source}: row map of table {table!r}: {file} must be a 1-D integer array of {entry['rows']} ids, "
                f"got shape {ids.shape} {ids.dtype}"
            )
        out[str(table)] = ids.astype(np.int64, copy=False)
    return out


def piece_table(table: Table, shard: Shard, copies: int = 1) -> Table:
    """The Table a cost model sees for one shard: the piece's rows × dim; a row slice also
    gets the matching share of the pooling factor (the kernels feed it only the lookups that
    fall in its rows) and keeps the table's reuse histogram (hot rows are scattered over the
    row ids, so a slice's rows are reused like the table's). A piece held in `copies` replicas
    (data-parallel) looks up 1/copies of the batch on each: that share of the pooling factor."""
    if shard.rows == table.rows and shard.dim == table.dim and copies == 1:
        return table
    if shard.rows == table.rows and copies == 1:
        return table.with_dim(shard.dim)
    return Table(
        name=table.name,
        rows=shard.rows,
        dim=shard.dim,
        pooling_factor=table.pooling_factor * shard.rows / table.rows / copies,
        reuse_histogram=table.reuse_histogram,
        bytes_per_element=table.bytes_per_element,
        trace=table.trace,
    )


def device_pieces(task: Task, plan: Plan) -> list[list[Table]]:
    """Each device's piece Tables under `plan` (see `piece_table`)."""
    tables = task.table_by_name
    copies = Counter(s.rectangle for s in plan.shards)
    per_device: list[list[Table]] = [[] for _ in range(task.num_devices)]
    for s in plan.shards:
        per_device[s.device].append(piece_table(tables[s.table], s, copies[s.rectangle]))
    return per_device


def validate(task: Task, plan: Plan) -> None:
    """Raise PlanError unless `plan` is a valid plan for `task`.

    Rules: every shard names a table of the task and a device in range; column offsets and
    widths are multiples of 4; every table's rows × columns are covered exactly once by its
    replica-0 shards; every shard with replica k >= 1 copies a replica-0 rectangle of the same
    table onto another device, and no rectangle has two copies with the same replica index or
    on the same device; row maps hold distinct row ids of their table; a table with
    `sharding_types` is sharded in one of them (`embshard.layouts`) and one with `min_partition`
    has no narrower column piece; every device's memory (weights + optimizer state + I/O,
    replicas included) fits its budget.
    """
    if plan.task != task.name:
        raise PlanError(f"plan is for task {plan.task!r}, not {task.name!r}")
    tables = task.table_by_name
    by_table: dict[str, list[Shard]] = {name: [] for name in tables}
    for s in plan.shards:
        if s.table not in tables:
            raise PlanError(f"shard names table {s.table!r}, which task {task.name!r} does not have")
        if not 0 <= s.device < task.num_devices:
            raise PlanError(f"table {s.table!r}: device {s.device} out of range 0..{task.num_devices - 1}")
        t = tables[s.table]
        if s.dim <= 0 or s.rows <= 0 or s.col_offset < 0 or s.row_offset < 0 or s.replica < 0:
            raise PlanError(f"table {s.table!r}: shard has non-positive size or negative offset: {s}")
        if s.col_offset % DIM_ALIGNMENT or s.dim % DIM_ALIGNMENT:
            raise PlanError(
                f"table {s.table!r}: column split at offset {s.col_offset} width {s.dim} "
                f"is not a multiple of {DIM_ALIGNMENT}"
            )
        if s.col_offset + s.dim > t.dim or s.row_offset + s.rows > t.rows:
            raise PlanError(
                f"table {s.table!r}: shard [{s.row_offset}:{s.row_offset + s.rows}, "
                f"{s.col_offset}:{s.col_offset + s.dim}] exceeds the table's {t.rows} × {t.dim}"
            )
        by_table[s.table].append(s)
    for name, shards in by_table.items():
        t = tables[name]
        primary = [s for s in shards if s.replica == 0]
        if not primary:
            raise PlanError(f"table {name!r} is not placed on any device")
        if not (len(shards) == 1 and shards[0].rows == t.rows and shards[0].dim == t.dim):
            # (one replica-0 shard as large as the table, in bounds as checked above: covered
            # exactly once, nothing copied; most tables of a table-wise plan)
            _check_exact_cover(t, primary)
            _check_replicas(t, shards)
        if t.sharding_types is not None:  # the table's TorchRec constraint (embshard.layouts)
            choose_layout(t, shards, task.num_devices, task.devices_per_host or task.num_devices)
        if t.min_partition is not None:
            check_min_partition(t, primary)
    for name, ids in plan.row_maps.items():
        if name not in tables:
            raise PlanError(f"row map names table {name!r}, which task {task.name!r} does not have")
        _check_row_map(tables[name], ids)
    for name, device, n in pieces_sharing_a_device(plan):
        warnings.warn(f"plan {plan.algorithm!r}: table {name!r} has {n} pieces on device {device}; one kernel "
                      "then looks each bag up once per piece (merge them: embshard.plan.normalize)",
                      PlanWarning, stacklevel=2)
    used = plan.memory_bytes(task)
    for device, used_bytes in enumerate(used):
        if used_bytes > task.device_memory_bytes:
            names = sorted({s.table for s in plan.shards_on(device)})
            raise PlanError(
                f"device {device} needs {used_bytes} bytes but has {task.device_memory_bytes} "
                f"(over by {used_bytes - task.device_memory_bytes} bytes); tables: {', '.join(names)}"
            )


class PlanWarning(UserWarning):
    """A valid plan that wastes work (e.g. two pieces of one table on one device)."""


def pieces_sharing_a_device(plan: Plan) -> list[tuple[str, int, int]]:
    """(table, device, number of pieces) wherever one device holds several pieces of a table.

    Row-level plans (tables with replicas or a row map) are left out: their tiers are looked
    up by the sequence data path, one lookup per id, not by one pooled kernel per piece."""
    row_level = set(plan.row_maps) | {s.table for s in plan.shards if s.replica}
    counts: dict[tuple[str, int], int] = {}
    for s in plan.shards:
        if s.table not in row_level:
            counts[(s.table, s.device)] = counts.get((s.table, s.device), 0) + 1
    return [(t, d, n) for (t, d), n in counts.items() if n > 1]


def normalize(task: Task, plan: Plan) -> Plan:
    """The same placement with the pieces of one table on one device merged.

    Column pieces (each spanning all rows) are laid out again so that every device's
    columns of the table are contiguous: columns are interchangeable, so this changes no
    device's work except that its kernel looks each bag up once, not once per piece. Row or
    grid pieces on one device are merged where they are adjacent rectangles (row ids are not
    interchangeable). Shards keep the order of their first appearance."""
    sharing = {name for name, _, _ in pieces_sharing_a_device(plan)}
    if not sharing:
        return plan
    tables = task.table_by_name
    by_table: dict[str, list[Shard]] = {}
    for s in plan.shards:
        by_table.setdefault(s.table, []).append(s)
    out: list[Shard] = []
    for name, shards in by_table.items():
        t = tables[name]
        if name not in sharing:
            out += shards
        elif all(s.row_offset == 0 and s.rows == t.rows for s in shards):
            widths: dict[int, int] = {}
            for s in sorted(shards, key=lambda s: s.col_offset):
                widths[s.device] = widths.get(s.device, 0) + s.dim
            off = 0
            for dev, w in widths.items():
                out.append(Shard(name, dev, off, w, 0, t.rows))
                off += w
        else:
            out += _merge_adjacent(shards)
    return dataclasses.replace(plan, shards=out)


def _merge_adjacent(shards: Sequence[Shard]) -> list[Shard]:
    merged = list(shards)
    changed = True
    while changed:
        changed = False
        for i, a in enumerate(merged):
            for j in range(i + 1, len(merged)):
                b = merged[j]
                if a.device != b.device:
                    continue
                lo, hi = (a, b) if (a.row_offset, a.col_offset) <= (b.row_offset, b.col_offset) else (b, a)
                if lo.row_offset == hi.row_offset and lo.rows == hi.rows and lo.col_offset + lo.dim == hi.col_offset:
                    m = Shard(a.table, a.device, lo.col_offset, lo.dim + hi.dim, lo.row_offset, lo.rows)
                elif lo.col_offset == hi.col_offset and lo.dim == hi.dim and lo.row_offset + lo.rows == hi.row_offset:
                    m = Shard(a.table, a.device, lo.col_offset, lo.dim, lo.row_offset, lo.rows + hi.rows)
                else:
                    continue
                merged[i] = m
                del merged[j]
                changed = True
                break
            if changed:
                break
    return merged


def _check_replicas(table: Table, shards: Sequence[Shard]) -> None:
    """Copies (replica >= 1) must repeat a replica-0 rectangle, each on its own device."""
    holders: dict[tuple, list[Shard]] = {}
    for s in shards:
        holders.setdefault(s.rectangle, []).append(s)
    for rect, copies in holders.items():
        if all(s.replica != 0 for s in copies):
            s = copies[0]
            raise PlanError(
                f"table {table.name!r}: replica {s.replica} of rows [{s.row_offset}:{s.row_offset + s.rows}] "
                f"on device {s.device} copies no replica-0 shard"
            )
        for what, values in (("replica index", [s.replica for s in copies]), ("device", [s.device for s in copies])):
            if len(set(values)) != len(values):
                dup = sorted(v for v, n in Counter(values).items() if n > 1)[0]
                raise PlanError(
                    f"table {table.name!r}: rows [{rect[1]}:{rect[1] + rect[2]}] have two copies with {what} {dup}"
                )


def _check_row_map(table: Table, ids: np.ndarray) -> None:
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) > table.rows:
        raise PlanError(f"table {table.name!r}: row map must be a 1-D integer array of at most {table.rows} ids")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= table.rows):
        raise PlanError(f"table {table.name!r}: row map holds ids outside [0, {table.rows})")
    if np.unique(ids).size != ids.size:
        raise PlanError(f"table {table.name!r}: row map repeats a row id")


def _check_exact_cover(table: Table, shards: Sequence[Shard]) -> None:
    area = sum(s.rows * s.dim for s in shards)
    if all(s.col_offset == 0 and s.dim == table.dim for s in shards):
        # full-width row blocks (row-wise and row-level plans): sorted, only neighbours can overlap
        ordered = sorted(shards, key=lambda s: s.row_offset)
        for a, b in zip(ordered, ordered[1:]):
            if b.row_offset < a.row_offset + a.rows:
                raise PlanError(f"table {table.name!r} is covered twice: {a} overlaps {b}")
        shards = ()
    for i, a in enumerate(shards):
        for b in shards[i + 1 :]:
            rows_overlap = a.row_offset < b.row_offset + b.rows and b.row_offset < a.row_offset + a.rows
            cols_overlap = a.col_offset < b.col_offset + b.dim and b.col_offset < a.col_offset + a.dim
            if rows_overlap and cols_overlap:
                raise PlanError(f"table {table.name!r} is covered twice: {a} overlaps {b}")
    if area != table.rows * table.dim:
        missing = table.rows * table.dim - area
        raise PlanError(
            f"table {table.name!r}: shards cover {area} of {table.rows * table.dim} cells ({missing} uncovered)"
        )


class MemoryLedger:
    """Free memory per device while a sharder places pieces; the one place placement
    decides whether something fits and, when it fits nowhere, says by how much.

    Args:
        task: the task being planned.
        pending: memory needs of the pieces still to be placed. When given, `place` looks
            ahead: among the devices a sharder prefers, it takes the first after which the
            pending pieces still pack, so a greedy order does not strand a big table that a
            table-wise plan has room for. The ledger carries a packing of the pending pieces
            (worst-fit decreasing, `embshard.packing.LookAhead`) and keeps it in O(1) per
            placement while the device taken has slack under it; otherwise it mends the
            packing (moves the pending pieces it holds there to other devices) or, failing
            that, first-fit decreasing from scratch decides.
    """

    def __init__(self, task: Task, pending: Iterable[int] = ()):
        from embshard.packing import LookAhead

        self.task = task
        self.free = [task.device_memory_bytes] * task.num_devices
        needs = sorted((int(x) for x in pending), reverse=True)
        self._ahead = LookAhead(np.array(self.free, dtype=np.int64), needs, fit="worst") if needs else None
        # `free` as an array for the look-ahead's repacks (kept beside the list by `take`:
        # converting a thousand devices' list at every repack cost more than the repack's setup)
        self._free_array = np.array(self.free, dtype=np.int64) if needs else None
        # pending pieces by size; forgetting one of a size takes the last of its list
        self._by_size: dict[int, list[int]] = {}
        for i, n in enumerate(needs):
            self._by_size.setdefault(n, []).append(i)

    def copy(self) -> MemoryLedger:
        """An independent copy of the ledger (the task shared)."""
        new = copy.copy(self)
        new.free = list(self.free)
        new._ahead = None if self._ahead is None else self._ahead.copy()
        new._free_array = None if self._free_array is None else self._free_array.copy()
        new._by_size = {n: list(ids) for n, ids in self._by_size.items()}
        return new

    def need(self, table: Table, rows: int | None = None, dim: int | None = None) -> int:
        return self.task.shard_memory_bytes(table, table.rows if rows is None else rows, table.dim if dim is None else dim)

    def take(self, device: int, nbytes: int) -> None:
        if self.free[device] < nbytes:
            raise PlanError(f"device {device} has {self.free[device]} bytes free, {nbytes} requested")
        self.free[device] -= nbytes
        if self._ahead is not None:
            self._free_array[device] -= nbytes
            self._ahead.took(self._free_array, device, nbytes)

    def place(self, table: Table, nbytes: int, preference: Iterable[int]) -> int:
        """Put a piece of `nbytes` on the first preferred device with room that keeps the
        pending pieces packable (the first preferred device with room if none does); return it.

        Raises:
            InfeasibleError: no device has room; names the table and the shortfall.
        """
        self.forget_pending(nbytes)
        first = None
        device = None
        for d in preference:
            if self.free[d] < nbytes:
                continue
            if first is None:
                first = d
            if self.pending_pack_after(d, nbytes):
                device = d
                break
        if first is None:
            raise self.nowhere(table, nbytes)
        device = first if device is None else device
        self.take(device, nbytes)
        return device

    def forget_pending(self, nbytes: int) -> None:
        """A piece of `nbytes` is being placed: one pending piece of that size (if any) is no
        longer pending."""
        ids = self._by_size.get(nbytes)
        if ids:
            self._ahead.forget(ids.pop())

    def pending_pack_after(self, device: int, nbytes: int) -> bool:
        """Whether the pending pieces still pack once `nbytes` more are used on `device`."""
        return self._ahead is None or self._ahead.packs_after(self._free_array, device, nbytes)

    def nowhere(self, table: Table, nbytes: int) -> InfeasibleError:
        """The error for a piece of `nbytes` that fits on no device."""
        best = max(range(self.task.num_devices), key=lambda d: self.free[d])
        short = nbytes - self.free[best]
        return infeasible(table, nbytes, self.free[best], best, short)


def infeasible(table: Table, nbytes: int, free_bytes: int, device: int, short: int) -> InfeasibleError:
    return InfeasibleError(
        f"table {table.name!r} needs {nbytes} bytes but the most free memory on any device is "
        f"{free_bytes} bytes (device {device}): short by {short} bytes",
        table=table.name,
        shortfall_bytes=short,
    )


class _PlanModule(types.ModuleType):
    """`embshard.plan(task, algorithm=...)` plans (`embshard.api.plan`), while `embshard.plan`
    stays this module for `from embshard.plan import Plan`: one name, no shadowing."""

    def __call__(self, task: Task, algorithm: Any = "neuroshard", **kwargs: Any) -> Plan:
        from embshard.api import plan

        return plan(task, algorithm, **kwargs)


sys.modules[__name__].__class__ = _PlanModule
