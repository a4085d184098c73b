"""Heuristic baselines from the research code, made memory-safe.

Greedy baselines place tables largest-first (by their cost key) onto the device with the
smallest running cost that still has room. Unlike the research code, a table that fits
nowhere raises InfeasibleError naming it and the shortfall, instead of landing silently
on the last device; `random` respects memory too. Every baseline places through
`MemoryLedger.place`, which skips a preferred device when taking it would leave the
remaining tables unpackable, so a valid table-wise plan is not missed for want of look-ahead.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Iterator

import numpy as np

from embshard.errors import InputError
from embshard.plan import MemoryLedger, Plan, Shard
from embshard.search.base import WHOLE_TABLES
from embshard.tables import Table
from embshard.task import Task

#: Per-table cost keys of the greedy baselines (NeuroShard's and DreamShard's heuristics).
COST_KEYS: dict[str, Callable[[Table], float]] = {
    "size": lambda t: float(t.size_bytes),
    "dim": lambda t: float(t.dim),
    "lookup": lambda t: t.dim * t.pooling_factor,
    "size_lookup": lambda t: t.dim * t.pooling_factor * math.log10(max(t.rows, 10)),
}


class GreedySharder:
    """Largest cost first, onto the device with the smallest running cost that has room.

    Args:
        key: one of COST_KEYS (size, dim, lookup, size_lookup).
        name: algorithm name written into plans (defaults to `<key>_greedy`).
    """

    capabilities = WHOLE_TABLES

    def __init__(self, key: str, name: str | None = None):
        if key not in COST_KEYS:
            raise InputError(f"unknown greedy key {key!r}; choose from {sorted(COST_KEYS)}")
        self.key = key
        self.name = name or f"{key}_greedy"

    def shard(self, task: Task) -> Plan:
        cost = COST_KEYS[self.key]
        ledger = MemoryLedger(task, pending=(task.table_memory_bytes(t) for t in task.tables))
        # the devices by (running cost, most free memory, index) in a heap: the ledger usually
        # takes the first, so a placement costs O(log devices), not a sort of every device
        running = [0.0] * task.num_devices
        order = DeviceOrder([(0.0, -free, d) for d, free in enumerate(ledger.free)])
        shards = []
        for table in sorted(task.tables, key=lambda t: (-cost(t), t.name)):
            device = ledger.place(table, ledger.need(table), order)
            running[device] += cost(table)
            order.settle(device, (running[device], -ledger.free[device], device))
            shards.append(Shard.whole(table, device))
        return Plan(task.name, self.name, shards)


class DeviceOrder:
    """Devices in increasing order of their keys, iterated lazily: iterating pops devices off a
    heap until the caller stops; `settle(device, key)` gives the device taken its new key and
    puts back the others popped, their keys unchanged (only the device taken changed).

    Args:
        keys: one tuple per device, the device its last element (so no two keys tie).
    """

    def __init__(self, keys: list[tuple]):
        self._heap = list(keys)
        heapq.heapify(self._heap)
        self._popped: list[tuple] = []

    def __iter__(self) -> Iterator[int]:
        while self._heap:
            key = heapq.heappop(self._heap)
            self._popped.append(key)
            yield key[-1]

    def settle(self, device: int, key: tuple) -> None:
        if all(k[-1] != device for k in self._popped):
            raise ValueError(f"device {device} was not taken from this order")
        for k in self._popped:
            if k[-1] != device:
                heapq.heappush(self._heap, k)
        self._popped.clear()
        heapq.heappush(self._heap, key)


class RandomSharder:
    """Each table on a uniformly random device among those with room."""

    capabilities = WHOLE_TABLES

    def __init__(self, seed: int = 0, name: str = "random"):
        self.seed = seed
        self.name = name

    def shard(self, task: Task) -> Plan:
        rng = np.random.default_rng(self.seed)
        ledger = MemoryLedger(task, pending=(task.table_memory_bytes(t) for t in task.tables))
        shards = []
        for table in task.tables:
            device = ledger.place(table, ledger.need(table), rng.permutation(task.num_devices).tolist())
            shards.append(Shard.whole(table, device))
        return Plan(task.name, self.name, shards)


class RoundRobinSharder:
    """Tables in task order onto devices 0, 1, 2, …, skipping devices without room."""

    capabilities = WHOLE_TABLES

    def __init__(self, name: str = "round_robin"):
        self.name = name

    def shard(self, task: Task) -> Plan:
        ledger = MemoryLedger(task, pending=(task.table_memory_bytes(t) for t in task.tables))
        shards = []
        next_device = 0
        for table in task.tables:
            order = ((next_device + k) % task.num_devices for k in range(task.num_devices))  # lazily
            device = ledger.place(table, ledger.need(table), order)
            shards.append(Shard.whole(table, device))
            next_device = (device + 1) % task.num_devices
        return Plan(task.name, self.name, shards)


class PileUpSharder:
    """A deliberately poor plan, the floor of end-to-end comparisons: the heaviest tables
    (by lookup cost, dim x pooling factor) all onto device 0 while memory allows, what does
    not fit onto device 1, and so on. Memory-safe like every baseline."""

    capabilities = WHOLE_TABLES

    def __init__(self, name: str = "pile_up"):
        self.name = name

    def shard(self, task: Task) -> Plan:
        cost = COST_KEYS["lookup"]
        ledger = MemoryLedger(task, pending=(task.table_memory_bytes(t) for t in task.tables))
        order = list(range(task.num_devices))
        shards = [
            Shard.whole(table, ledger.place(table, ledger.need(table), order))
            for table in sorted(task.tables, key=lambda t: (-cost(t), t.name))
        ]
        return Plan(task.name, self.name, shards)
