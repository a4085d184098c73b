"""Row-level plan pieces shared by FlexShard and its baselines: TorchRec's row blocks, the
tier layout (replicated / per host / split), and the memory check every builder ends with."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
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
    once per host, split over the host's devices (rank i to local device i mod P, so each
    device gets an even share of hot and less hot rows); the rest of the table is split over
    all devices in TorchRec's row blocks.
    """

    replicated: int
    per_host: int

    @property
    def front(self) -> int:
        return self.replicated + self.per_host


def host_blocks(n: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, sizes) of the per-host tier's p device blocks (local device i takes ranks i, i+p, ...)."""
    sizes = np.array([(n - i + p - 1) // p if n > i else 0 for i in range(p)], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return starts, sizes


def tier_layout(task: Task, table: Table, hot_ids: np.ndarray, tiers: Tiers) -> tuple[np.ndarray, list[Shard]]:
    """(row map front, shards) of one table cut into tiers (see `Tiers`)."""
    D, P, H = task.num_devices, task.devices_per_host, task.hosts
    g, n_h = tiers.replicated, tiers.per_host
    front = np.empty(g + n_h, dtype=np.int64)
    front[:g] = hot_ids[:g]
    starts, sizes = host_blocks(n_h, P)
    r = np.arange(n_h)
    front[g + starts[r % P] + r // P] = hot_ids[g:g + n_h]
    shards = [Shard(table.name, d, 0, table.dim, 0, g, replica=d) for d in range(D)] if g else []
    for h in range(H):
        for i in range(P):
            if sizes[i]:
                shards.append(Shard(table.name, h * P + i, 0, table.dim, g + int(starts[i]), int(sizes[i]), replica=h))
    shards += block_shards(table, g + n_h, table.rows, range(D))
    return front, shards


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
