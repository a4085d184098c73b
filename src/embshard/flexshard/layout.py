"""Row-level plan pieces shared by FlexShard and its baselines: TorchRec's row blocks, the
tier layout (replicated / per host / split), and the memory check every builder ends with."""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from embshard.errors import InfeasibleError
from embshard.plan import Plan, Shard
from embshard.tables import Table
from embshard.task import Task


def block_shards(table: Table, start: int, end: int, devices: Sequence[int], replica: int = 0) -> list[Shard]:
    """Rows [start, end) in TorchRec's row-wise blocks over `devices`: device k of the list
    holds block k of ceil(n / len(devices)) rows (trailing devices may get none)."""
    n = end - start
    if n <= 0:
        return []
    block = math.ceil(n / len(devices))
    out = []
    for k, d in enumerate(devices):
        lo = start + k * block
        hi = min(end, lo + block)
        if hi > lo:
            out.append(Shard(table.name, int(d), 0, table.dim, lo, hi - lo, replica))
    return out


def host_devices(task: Task, host: int) -> list[int]:
    p = task.devices_per_host
    return list(range(host * p, (host + 1) * p))


@dataclass(frozen=True)
class Tiers:
    """One table's tier cuts over its rows in descending access order (`hot_ids`).

    Ranks [0, replicated) are held by every device; ranks [replicated, replicated + per_host)
    once per host, split over the host's devices (rank i to the host's slot i mod P, slot s on
    local device (s + rotation) mod P with the rotation a hash of the table's name, so each
    device gets an even share of hot and less hot rows and no device gets every table's
    hottest); the next len(placed) ranks, hot rows of the global tier, on the devices
    `placed` names (balanced over all tables by the search); the rest of the table is split
    over all devices in TorchRec's row blocks.
    """

    replicated: int
    per_host: int
    placed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), compare=False)

    @property
    def front(self) -> int:
        """Ranks in the per-host and replicated tiers."""
        return self.replicated + self.per_host

    @property
    def moved(self) -> int:
        """Ranks the row map moves to the front: the tiers and the placed global rows."""
        return self.front + int(len(self.placed))


def host_blocks(n: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, sizes) of the per-host tier's p slot blocks (slot i takes ranks i, i+p, ...)."""
    sizes = np.array([(n - i + p - 1) // p if n > i else 0 for i in range(p)], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return starts, sizes


def host_rotation(table: Table, devices_per_host: int) -> int:
    """The local device of a table's per-host slot 0 (a stable hash of its name)."""
    return zlib.crc32(table.name.encode()) % devices_per_host


def tier_layout(task: Task, table: Table, hot_ids: np.ndarray, tiers: Tiers) -> tuple[np.ndarray, list[Shard]]:
    """(row map front, shards) of one table cut into tiers (see `Tiers`)."""
    D, P, H = task.num_devices, task.devices_per_host, task.hosts
    g, n_h = tiers.replicated, tiers.per_host
    placed = np.asarray(tiers.placed, dtype=np.int64)
    front = np.empty(tiers.moved, dtype=np.int64)
    front[:g] = hot_ids[:g]
    starts, sizes = host_blocks(n_h, P)
    r = np.arange(n_h)
    front[g + starts[r % P] + r // P] = hot_ids[g:g + n_h]
    shards = [Shard(table.name, d, 0, table.dim, 0, g, replica=d) for d in range(D)] if g else []
    rot = host_rotation(table, P)
    for h in range(H):
        for i in range(P):
            if sizes[i]:
                shards.append(Shard(table.name, h * P + (i + rot) % P, 0, table.dim, g + int(starts[i]), int(sizes[i]),
                                    replica=h))
    if placed.size:
        order = np.argsort(placed, kind="stable")  # device by device, hottest first within each
        front[tiers.front:] = hot_ids[tiers.front:tiers.moved][order]
        devices, counts = np.unique(placed, return_counts=True)
        offset = tiers.front
        for d, n in zip(devices, counts):
            shards.append(Shard(table.name, int(d), 0, table.dim, offset, int(n)))
            offset += int(n)
    shards += block_shards(table, tiers.moved, table.rows, range(D))
    return front, shards


def balance_placement(weights: list[np.ndarray], num_devices: int) -> list[np.ndarray]:
    """Devices for rows of several tables with the given loads, least-loaded first (LPT in
    rounds: the next `num_devices` heaviest rows go to the devices in ascending load, the
    heaviest to the least loaded), so the busiest device carries little more than the mean.
    Returns, per table, the device of each of its rows."""
    sizes = [len(w) for w in weights]
    if not sum(sizes):
        return [np.zeros(0, dtype=np.int64) for _ in weights]
    w = np.concatenate(weights).astype(np.float64)
    order = np.argsort(-w, kind="stable")
    device = np.empty(w.size, dtype=np.int64)
    load = np.zeros(num_devices)
    for start in range(0, w.size, num_devices):
        chunk = order[start:start + num_devices]
        targets = np.argsort(load, kind="stable")[:chunk.size]
        device[chunk] = targets
        load[targets] += w[chunk]
    return np.split(device, np.cumsum(sizes)[:-1])


def check_fits(task: Task, plan: Plan) -> Plan:
    """Return `plan`, or raise InfeasibleError naming the fullest device, its largest table and the shortfall."""
    used = plan.memory_bytes(task)
    worst = int(np.argmax(used))
    over = used[worst] - task.device_memory_bytes
    if over > 0:
        tables = task.table_by_name
        on = [s for s in plan.shards if s.device == worst]
        big = max(on, key=lambda s: task.shard_memory_bytes(tables[s.table], s.rows, s.dim))
        raise InfeasibleError(
            f"{plan.algorithm}: device {worst} needs {used[worst]} bytes but has {task.device_memory_bytes}: "
            f"short by {over} bytes (largest piece there: table {big.table!r})",
            table=big.table,
            shortfall_bytes=over,
        )
    return plan


def plan_fingerprint(plan: Plan) -> str:
    """A hash of everything a plan says, its row maps' contents included."""
    h = hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode())
    for name in sorted(plan.row_maps):
        h.update(name.encode())
        h.update(np.ascontiguousarray(plan.row_maps[name], dtype=np.int64).tobytes())
    return h.hexdigest()[:16]
