"""Per-device accumulators for a greedy partitioner: each device's current shard and its
predicted cost, the cost of every candidate device with one more piece (one batched call per
placement), and the update when a device takes the piece.

Two strategies behind one small protocol (`DeviceAccumulator`):

* `KeyedDevices`: whole shards re-predicted through the simulator's cache (keyed by the
  shard's piece multiset), for any `ShardPredictor`;
* `PooledDevices`: running reductions of piece encodings, for an `EncodingPredictor` (a
  candidate costs one row of one batched head call, with no re-encoding).
"""

from __future__ import annotations

import copy
from typing import Protocol

import numpy as np

from embshard.costs.predictor import supports_incremental
from embshard.search.pieces import Piece
from embshard.search.simulator import Simulator
from embshard.tables import Table


class DeviceAccumulator(Protocol):
    """What a greedy partitioner keeps per device."""

    #: predicted compute ms of each device's current shard
    cost: np.ndarray

    def costs(self, cand: np.ndarray, p: Piece) -> np.ndarray:
        """Predicted compute ms of each candidate device's shard with `p` added."""
        ...

    def add(self, dev: int, p: Piece, j: int) -> None:
        """`dev` takes `p`; `j` is its index in the last `costs` call's candidates (-1: none)."""
        ...

    def add_fixed(self, pairs: list[tuple[int, Piece]]) -> None:
        """Each `(dev, p)`: `dev` takes `p`, outside any `costs` call (row blocks, whose device
        is part of the state): the same state as `add(dev, p, -1)` for each in turn."""
        ...

    def copy(self) -> "DeviceAccumulator":
        """An independent copy of the devices' state (the predictor and its cache shared)."""
        ...


class KeyedDevices:
    """Per-device shards for the greedy, costed through the simulator's cache: a
    candidate shard (device's pieces + the new one) is keyed by its piece multiset and
    re-predicted only when not cached; all of one placement's misses in one call."""

    def __init__(self, sim: Simulator, d: int):
        self.sim = sim
        self.keys: list[tuple[int, ...]] = [()] * d
        self.shards: list[list[Table]] = [[] for _ in range(d)]
        self.cost = np.zeros(d)
        self._ckeys: list[tuple[int, ...]] = []
        self._c = np.zeros(0)

    def costs(self, cand: np.ndarray, p: Piece) -> np.ndarray:
        key_with, keys, shards = self.sim.key_with, self.keys, self.shards
        cl = cand.tolist()
        self._ckeys = [key_with(keys[k], p.pid) for k in cl]
        self._c = self.sim.shard_costs(self._ckeys, lambda j: shards[cl[j]] + [p.ptable])
        return self._c

    def add(self, dev: int, p: Piece, j: int) -> None:
        self.shards[dev].append(p.ptable)
        if j >= 0:
            self.keys[dev] = self._ckeys[j]
            self.cost[dev] = self._c[j]
        else:
            self.keys[dev] = self.sim.key_with(self.keys[dev], p.pid)
            self.cost[dev] = self.sim.shard_costs([self.keys[dev]], lambda _: self.shards[dev])[0]

    def add_fixed(self, pairs: list[tuple[int, Piece]]) -> None:
        for dev, p in pairs:
            self.add(dev, p, -1)

    def copy(self) -> KeyedDevices:
        new = copy.copy(self)
        new.keys, new.shards, new.cost = list(self.keys), [list(s) for s in self.shards], self.cost.copy()
        new._ckeys, new._c = list(self._ckeys), self._c.copy()
        return new


class PooledDevices:
    """Per-device running reductions of piece encodings, for predictors whose shard cost is
    `head_ms(reduce(table_encodings))` with an additive reduction (sum, or sum ‖ max): a
    candidate costs one row of one batched head call, with no re-encoding."""

    def __init__(self, sim: Simulator, d: int, enc_dim: int):
        predictor = sim.predictor
        if not supports_incremental(predictor):
            raise TypeError(f"{type(predictor).__name__} is not an EncodingPredictor with an additive reduction")
        self.head = predictor.head_ms
        self.with_max = predictor.reduction == "sum_max"
        self.sum = np.zeros((d, enc_dim), dtype=np.float64)
        self.max = np.full((d, enc_dim), -np.inf) if self.with_max else None
        self.cost = np.zeros(d)
        self.stats = sim.stats
        self._c = np.zeros(0)

    def _pooled(self, rows: np.ndarray | int, enc: np.ndarray | None = None) -> np.ndarray:
        """The head's input for devices `rows` with piece encoding `enc` added (None: as they are)."""
        if enc is None:
            pooled, top = self.sum[rows], self.max[rows] if self.with_max else None
        else:
            pooled, top = self.sum[rows] + enc, np.maximum(self.max[rows], enc) if self.with_max else None
        return pooled if top is None else np.concatenate([pooled, top], axis=-1)

    def costs(self, cand: np.ndarray, p: Piece) -> np.ndarray:
        self._c = np.asarray(self.head(self._pooled(cand, p.enc)), dtype=np.float64)
        self.stats.head_calls += 1
        self.stats.head_rows += len(cand)
        return self._c

    def add(self, dev: int, p: Piece, j: int) -> None:
        if j >= 0:
            self.cost[dev] = self._c[j]
        else:
            self.cost[dev] = float(self.head(self._pooled(np.array([dev]), p.enc))[0])
        self.sum[dev] += p.enc
        if self.with_max:
            np.maximum(self.max[dev], p.enc, out=self.max[dev])

    def add_fixed(self, pairs: list[tuple[int, Piece]]) -> None:
        # every piece into the running reductions, then one head call over the devices they
        # touched: on many devices a row-split table is a block per device, and one call per
        # block was most of a greedy run's time
        if pairs:
            devs = np.fromiter((dev for dev, _ in pairs), dtype=np.int64, count=len(pairs))
            enc = np.stack([p.enc for _, p in pairs])
            np.add.at(self.sum, devs, enc)
            if self.with_max:
                np.maximum.at(self.max, devs, enc)
            touched = np.unique(devs)
            self.cost[touched] = np.asarray(self.head(self._pooled(touched)), dtype=np.float64)

    def copy(self) -> PooledDevices:
        new = copy.copy(self)
        new.sum, new.cost, new._c = self.sum.copy(), self.cost.copy(), self._c.copy()
        new.max = None if self.max is None else self.max.copy()
        return new
