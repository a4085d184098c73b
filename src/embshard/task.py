"""A sharding task: tables, devices, memory per device, batch size, optimizer, topology.

This module is the one place that knows the task JSON schema (docs/contracts.md).
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embshard.errors import InputError, check_keys
from embshard.io import write_json_atomic
from embshard.tables import Table, _is_int

#: Bytes of optimizer state per table row, as a function of dim, for the fused optimizers
#: FBGEMM's table-batched kernel supports. EXACT_SGD keeps no state.
OPTIMIZER_STATE_BYTES_PER_ROW = {
    "sgd": lambda dim: 0,
    "rowwise_adagrad": lambda dim: 4,
    "adagrad": lambda dim: 4 * dim,
    "adam": lambda dim: 8 * dim,
}
#: The pooled output of the kernel and its gradient are fp32 tensors of batch × width.
OUTPUT_BYTES_PER_ELEMENT = 4
#: the most a task may state (docs/contracts.md): beyond any machine, inside 64-bit sums
MAX_DEVICES = 1 << 20
MAX_DEVICE_MEMORY_BYTES = 1 << 50   # 1 PiB
MAX_BATCH_SIZE = 1 << 31
MAX_TABLE_MEMORY_BYTES = 1 << 56
#: Link bandwidths of a two-tier topology when a task names none: TorchRec's planner defaults,
#: INTRA_NODE_BANDWIDTH = 600 and CROSS_NODE_BANDWIDTH = 12.5 (GiB/s, stored in bytes/ms as
#: 600 * 1024**3 / 1000) in torchrec/distributed/planner/constants.py (torchrec 1.8.0), used per
#: device ("1 NIC per GPU" in BasicCommsBandwidths.get_bw, torchrec/distributed/planner/types.py).
INTRA_HOST_GBPS = 600.0
INTER_HOST_GBPS = 12.5
#: Every key a task JSON object may hold (docs/contracts.md).
TASK_FIELDS = ("name", "num_devices", "device_memory_bytes", "batch_size", "tables", "optimizer", "devices_per_host",
               "hosts", "intra_host_gbps", "inter_host_gbps")
#: What `_gbps` means here, as in TorchRec's constants: GiB (2**30 bytes) per second.
BYTES_PER_GB = 1 << 30


@dataclass(frozen=True)
class Task:
    """What to shard and onto what.

    Args:
        name: task identifier, echoed in plans and reports.
        num_devices: number of devices (ranks).
        device_memory_bytes: memory budget of each device for embedding work.
        batch_size: global batch size of one training step.
        tables: the tables; names are unique.
        optimizer: fused embedding optimizer; decides the optimizer state counted in memory.
        devices_per_host: devices sharing a fast interconnect (topology); equals
            num_devices for a single host.
        hosts: number of hosts; hosts × devices_per_host = num_devices (derived when absent).
        intra_host_gbps, inter_host_gbps: per-device link bandwidth inside a host and between
            hosts, GiB/s (TorchRec's planner defaults: 600 and 12.5).
    """

    name: str
    num_devices: int
    device_memory_bytes: int
    batch_size: int
    tables: tuple[Table, ...]
    optimizer: str = "sgd"
    devices_per_host: int | None = None
    hosts: int | None = None
    intra_host_gbps: float = INTRA_HOST_GBPS
    inter_host_gbps: float = INTER_HOST_GBPS

    def __post_init__(self) -> None:
        where = f"task {self.name!r}"
        for key, most, words in (("num_devices", MAX_DEVICES, "2**20"),
                                 ("device_memory_bytes", MAX_DEVICE_MEMORY_BYTES, "2**50 (1 PiB)"),
                                 ("batch_size", MAX_BATCH_SIZE, "2**31")):
            v = getattr(self, key)
            if not _is_int(v) or v <= 0:
                raise InputError(f"{where}: {key} must be a positive integer, got {v!r}")
            if v > most:
                raise InputError(f"{where}: {key} must be at most {words}, got {v!r}")
        if not isinstance(self.optimizer, str) or self.optimizer not in OPTIMIZER_STATE_BYTES_PER_ROW:
            raise InputError(
                f"{where}: optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES_PER_ROW)}, got {self.optimizer!r}"
            )
        if not self.tables:
            raise InputError(f"{where}: has no tables")
        object.__setattr__(self, "tables", tuple(self.tables))
        for t in self.tables:
            if not isinstance(t, Table):
                raise InputError(f"{where}: tables must be Table objects, got {type(t).__name__}")
            need = self.table_memory_bytes(t)
            if need > MAX_TABLE_MEMORY_BYTES:
                raise InputError(f"{where}: table {t.name!r} needs {need} bytes in training, more than any plan here "
                                 f"handles (2**56); check its rows, dim and pooling_factor and the batch_size")
        names = [t.name for t in self.tables]
        dupes = sorted(n for n, c in Counter(names).items() if c > 1)
        if dupes:
            raise InputError(f"{where}: duplicate table name(s) {dupes}")
        if self.devices_per_host is None:
            object.__setattr__(self, "devices_per_host", self.num_devices)
        elif not _is_int(self.devices_per_host) or self.devices_per_host <= 0:
            raise InputError(f"{where}: devices_per_host must be a positive integer, got {self.devices_per_host!r}")
        self._check_topology(where)

    def _check_topology(self, where: str) -> None:
        if self.hosts is not None:
            if not _is_int(self.hosts) or self.hosts <= 0:
                raise InputError(f"{where}: hosts must be a positive integer, got {self.hosts!r}")
            if self.hosts * self.devices_per_host != self.num_devices:
                raise InputError(
                    f"{where}: hosts ({self.hosts}) x devices_per_host ({self.devices_per_host}) "
                    f"must equal num_devices ({self.num_devices})"
                )
        elif self.num_devices % self.devices_per_host:
            raise InputError(
                f"{where}: devices_per_host ({self.devices_per_host}) does not divide num_devices ({self.num_devices})"
            )
        object.__setattr__(self, "hosts", self.num_devices // self.devices_per_host)
        for name in ("intra_host_gbps", "inter_host_gbps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise InputError(f"{where}: {name} must be a positive number (GiB/s), got {v!r}")
            object.__setattr__(self, name, float(v))

    def host_of(self, device: int) -> int:
        """The host a device sits on (devices are numbered host by host)."""
        return device // self.devices_per_host

    # ------------------------------------------------------------------ lookups
    def table(self, name: str) -> Table:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def table_by_name(self) -> dict[str, Table]:
        return {t.name: t for t in self.tables}

    # ------------------------------------------------------------------ memory
    def shard_memory_bytes(self, table: Table, rows: int, dim: int, copies: int = 1) -> int:
        """Bytes a device allocates for a `rows × dim` piece of `table` during training.

        Weights, the fused optimizer's state, and the output plus its gradient. A pooled piece
        computes its pooled sums for every sample of the global batch before the all-to-all.
        A sequence piece outputs one vector per id it serves: its share of the batch's
        batch × pooling_factor ids by rows (the uniform-access share TorchRec's planner also
        uses for row-wise I/O). A piece held in `copies` replicas serves 1/copies of the batch
        on each (data-parallel: every copy serves its own samples). A pooled table read by
        several features (`num_poolings`) has one output per bag.
        """
        weights = rows * dim * table.bytes_per_element
        optimizer_state = rows * OPTIMIZER_STATE_BYTES_PER_ROW[self.optimizer](dim)
        if table.is_sequence:
            lookups = math.ceil(self.batch_size * table.pooling_factor * rows / (table.rows * copies))
            io = 2 * lookups * dim * OUTPUT_BYTES_PER_ELEMENT
        else:  # every bag of the table (num_poolings per sample) has its own pooled output
            io = 2 * math.ceil(math.ceil(self.batch_size / copies) * table.num_poolings) * dim * OUTPUT_BYTES_PER_ELEMENT
        return weights + optimizer_state + io

    def table_memory_bytes(self, table: Table) -> int:
        return self.shard_memory_bytes(table, table.rows, table.dim)

    def tables_memory_bytes(self) -> int:
        """Bytes all tables need in training, each whole: what every plan needs at least over
        all devices (splitting a table never lowers its memory: every piece keeps its weights,
        optimizer state and outputs)."""
        return sum(self.table_memory_bytes(t) for t in self.tables)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "num_devices": self.num_devices,
            "device_memory_bytes": self.device_memory_bytes,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "tables": [t.to_dict() for t in self.tables],
        }
        if self.devices_per_host != self.num_devices:
            d["devices_per_host"] = self.devices_per_host
        # hosts follows from devices_per_host; bandwidths are written only where they differ from
        # the defaults, so task JSON without a topology round-trips unchanged
        for name, default in (("intra_host_gbps", INTRA_HOST_GBPS), ("inter_host_gbps", INTER_HOST_GBPS)):
            if getattr(self, name) != default:
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: Any, source: str = "task") -> "Task":
        if not isinstance(d, dict):
            raise InputError(f"{source}: a task must be a JSON object, got {type(d).__name__}")
        check_keys(d, TASK_FIELDS, f"{source}: task {d.get('name')!r}")
        missing = {"name", "num_devices", "device_memory_bytes", "batch_size", "tables"} - set(d)
        if missing:
            raise InputError(f"{source}: missing field(s) {sorted(missing)}")
        if not isinstance(d["tables"], list):
            raise InputError(f"{source}: 'tables' must be a list")
        if not isinstance(d["name"], (str, int)) or isinstance(d["name"], bool) or str(d["name"]) == "":
            raise InputError(f"{source}: 'name' must be a non-empty string, got {d['name']!r}")
        return cls(
            name=str(d["name"]),
            num_devices=d["num_devices"],
            device_memory_bytes=d["device_memory_bytes"],
            batch_size=d["batch_size"],
            tables=tuple(Table.from_dict(t) for t in d["tables"]),
            optimizer=d.get("optimizer", "sgd"),
            devices_per_host=d.get("devices_per_host"),
            hosts=d.get("hosts"),
            intra_host_gbps=d.get("intra_host_gbps", INTRA_HOST_GBPS),
            inter_host_gbps=d.get("inter_host_gbps", INTER_HOST_GBPS),
        )

    def save(self, path: str | os.PathLike) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def from_module(cls, module: Any, topology: Any, batch_size: int | None = None,
                    constraints: dict[str, Any] | None = None, **kw: Any) -> "Task":
        """The task a TorchRec model poses: every EmbeddingBagCollection and EmbeddingCollection
        in `module`, on a TorchRec `Topology`, with TorchRec's per-rank `batch_size` and
        `ParameterConstraints` by table name (`embshard.torchrec_bridge.task_from_module`,
        which also says where each collection sits)."""
        from embshard.torchrec_bridge import task_from_module

        return task_from_module(module, topology, batch_size, constraints, **kw)[0]

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Task":
        d = read_json(path)
        try:
            return cls.from_dict(d, source=str(path))
        except InputError as e:  # a table's or the task's own check: say which file it is in
            msg = str(e)
            raise InputError(msg if msg.startswith(f"{path}: ") else f"{path}: {msg}") from None


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file, turning every way it can be wrong into one InputError line."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such file")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{p}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError:
        raise InputError(f"{p}: not a text file") from None


def load_tasks(spec: str | os.PathLike) -> list[Task]:
    """Tasks from a file, a folder of `*.json` files, or a glob pattern, sorted by path."""
    spec = str(spec)
    p = Path(spec)
    if p.is_dir():
        paths = sorted(p.glob("*.json"))
    elif any(ch in spec for ch in "*?["):
        paths = sorted(Path(x) for x in glob.glob(spec))
    else:
        paths = [p]
    if not paths:
        raise InputError(f"{spec}: no task JSON files found")
    tasks = [Task.load(x) for x in paths]
    names = [t.name for t in tasks]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InputError(f"{spec}: duplicate task name(s) {dupes}")
    return tasks
