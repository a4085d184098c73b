"""The simulator: the plan cost a shard predictor (neural or analytic) expects, with every
prediction cached.

A search talks to a cost model through the predictor protocols of `embshard.costs.predictor`
(`ShardPredictor`: `compute_ms(shards)`, `comm_ms(widths, delays_ms)`; re-exported here with
`AnalyticPredictor`, the closed-form model behind them). The trained neural bundle
(`embshard.costs.neural.NeuralCostModels`) binds one per batch size.

`Simulator` turns per-device piece lists into `DeviceCosts` the way the hardware evaluator
defines measured costs (`hardware/evaluator.py`): compute per device (all devices in one
batched `compute_ms` call), delay = compute − min compute, backward comm from the widths,
forward comm from (widths, delays); plan cost = max over devices of compute + fw + bw.
Compute predictions are cached by the shard's multiset of piece identities (a table at a
given rows × dim; offsets do not matter), comm predictions by (widths, rounded delays).
`PredictorCostModel` wraps it as a `CostModel` (`device_costs(task, plan)`).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from embshard.costs.analytic import analytic_allreduce_ms
from embshard.costs.base import DeviceCosts
from embshard.costs.predictor import AnalyticPredictor, ShardPredictor, batch_ratio
from embshard.plan import Plan, device_pieces
from embshard.tables import Table
from embshard.task import Task

__all__ = ["AnalyticPredictor", "PredictorCostModel", "ShardPredictor", "Simulator", "SimulatorStats",
           "batch_ratio", "scale_costs"]


# ----------------------------------------------------------------------------- simulator
@dataclass
class SimulatorStats:
    compute_calls: int = 0       # compute_ms calls made to the predictor
    shards_predicted: int = 0    # shards sent to the predictor
    shard_hits: int = 0          # shard costs served from the cache
    comm_calls: int = 0
    comm_predicted: int = 0
    comm_hits: int = 0
    head_calls: int = 0          # incremental-mode head_ms calls (search only)
    head_rows: int = 0


class Simulator:
    """Cached plan-cost simulation against one `ShardPredictor`.

    Args:
        predictor: the cost predictor.
        delay_round_ms: delays are rounded to this before keying the comm cache (and
            before prediction, so a cached and a fresh answer are the same).
        max_cache_entries: the compute cache is cleared when it grows past this.
    """

    def __init__(self, predictor: ShardPredictor, delay_round_ms: float = 0.01, max_cache_entries: int = 2_000_000):
        self.predictor = predictor
        self.delay_round_ms = float(delay_round_ms)
        self.max_cache_entries = int(max_cache_entries)
        self.stats = SimulatorStats()
        self._ids: dict[Table, int] = {}
        self._compute: dict[tuple[int, ...], float] = {}
        self._comm: dict[Hashable, tuple[np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------ keys
    def piece_id(self, table: Table) -> int:
        """Interned id of a piece (a Table at the piece's rows × dim)."""
        pid = self._ids.get(table)
        if pid is None:
            pid = self._ids[table] = len(self._ids)
        return pid

    @staticmethod
    def key_with(key: tuple[int, ...], pid: int) -> tuple[int, ...]:
        """The sorted multiset `key` with one more `pid`."""
        i = bisect_left(key, pid)
        return key[:i] + (pid,) + key[i:]

    def key_of(self, tables: Sequence[Table]) -> tuple[int, ...]:
        return tuple(sorted(self.piece_id(t) for t in tables))

    # ------------------------------------------------------------------ compute
    def shard_costs(self, keys: Sequence[tuple[int, ...]], tables_of: Callable[[int], Sequence[Table]]) -> np.ndarray:
        """Predicted compute ms for each shard key; `tables_of(i)` builds the tables of
        `keys[i]`, only called for keys not cached. One predictor call for all misses."""
        out = np.empty(len(keys))
        cache = self._compute
        missing: dict[tuple[int, ...], list[int]] = {}
        for i, k in enumerate(keys):
            v = cache.get(k)
            if v is not None:
                out[i] = v
            elif not k:
                out[i] = 0.0
            else:
                missing.setdefault(k, []).append(i)
        self.stats.shard_hits += len(keys) - sum(len(v) for v in missing.values())
        if missing:
            if len(cache) + len(missing) > self.max_cache_entries:
                cache.clear()
            order = list(missing)
            pred = np.asarray(self.predictor.compute_ms([list(tables_of(missing[k][0])) for k in order]), dtype=np.float64)
            if pred.shape != (len(order),):
                raise ValueError(f"predictor.compute_ms returned shape {pred.shape} for {len(order)} shards")
            self.stats.compute_calls += 1
            self.stats.shards_predicted += len(order)
            for k, v in zip(order, pred.tolist()):
                cache[k] = v
                for i in missing[k]:
                    out[i] = v
        return out

    def compute_of(self, shards: Sequence[Sequence[Table]]) -> np.ndarray:
        """Predicted compute ms of each shard (lists of piece Tables), cached."""
        keys = [self.key_of(s) for s in shards]
        return self.shard_costs(keys, lambda i: shards[i])

    # ------------------------------------------------------------------ comm
    def comm(self, widths: np.ndarray, compute_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n, D] widths and compute ms -> ([n, D] forward, [n, D] backward) comm ms.
        Delays are compute − min compute per row, rounded; one predictor call for all misses."""
        widths = np.asarray(widths, dtype=np.int64)
        compute = np.asarray(compute_ms, dtype=np.float64)
        n, d = widths.shape
        fw = np.zeros((n, d))
        bw = np.zeros((n, d))
        if n == 0 or d <= 1:
            return fw, bw
        delays = compute - compute.min(axis=1, keepdims=True)
        if self.delay_round_ms > 0:
            delays = np.round(delays / self.delay_round_ms) * self.delay_round_ms
        keys = [(widths[i].tobytes(), delays[i].tobytes()) for i in range(n)]
        missing: dict[Hashable, list[int]] = {}
        for i, k in enumerate(keys):
            got = self._comm.get(k)
            if got is not None:
                fw[i], bw[i] = got
            else:
                missing.setdefault(k, []).append(i)
        self.stats.comm_hits += n - sum(len(v) for v in missing.values())
        if missing:
            if len(self._comm) + len(missing) > self.max_cache_entries:
                self._comm.clear()
            rows = [v[0] for v in missing.values()]
            f, b = self.predictor.comm_ms(widths[rows].astype(np.float64), delays[rows])
            f = np.asarray(f, dtype=np.float64).reshape(len(rows), d)
            b = np.asarray(b, dtype=np.float64).reshape(len(rows), d)
            self.stats.comm_calls += 1
            self.stats.comm_predicted += len(rows)
            for j, (k, idx) in enumerate(missing.items()):
                self._comm[k] = (f[j].copy(), b[j].copy())
                fw[idx] = f[j]
                bw[idx] = b[j]
        return fw, bw

    # ------------------------------------------------------------------ plans
    def device_costs(self, per_device: Sequence[Sequence[Table]]) -> DeviceCosts:
        """DeviceCosts of one plan given each device's piece Tables."""
        compute = self.compute_of(per_device)
        widths = np.array([[sum(t.dim for t in s) for s in per_device]], dtype=np.int64)
        fw, bw = self.comm(widths, compute[None, :])
        return DeviceCosts(compute_ms=compute.tolist(), forward_comm_ms=fw[0].tolist(), backward_comm_ms=bw[0].tolist())


class PredictorCostModel:
    """A CostModel (`device_costs(task, plan)`) that costs plans with a ShardPredictor
    through the cached `Simulator`."""

    def __init__(self, predictor: ShardPredictor, delay_round_ms: float = 0.01):
        self.simulator = predictor if isinstance(predictor, Simulator) else Simulator(predictor, delay_round_ms)

    @property
    def predictor(self) -> ShardPredictor:
        return self.simulator.predictor

    def device_costs(self, task: Task, plan: Plan) -> DeviceCosts:
        """Simulated costs at the task's batch (scaled linearly from the predictor's)."""
        costs = scale_costs(self.simulator.device_costs(device_pieces(task, plan)), batch_ratio(self.predictor, task))
        ar = analytic_allreduce_ms(plan.data_parallel_floats(task.num_devices, task.table_by_name), task.num_devices)
        if ar:  # data-parallel gradients: the analytic all-reduce after the backward all-to-all
            costs.backward_comm_ms = [x + ar for x in costs.backward_comm_ms]
        return costs


def scale_costs(costs: DeviceCosts, ratio: float) -> DeviceCosts:
    if ratio == 1.0:
        return costs
    return DeviceCosts(
        compute_ms=[x * ratio for x in costs.compute_ms],
        forward_comm_ms=[x * ratio for x in costs.forward_comm_ms],
        backward_comm_ms=[x * ratio for x in costs.backward_comm_ms],
    )
