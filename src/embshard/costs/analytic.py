"""An analytic (roofline-style) cost model: the "estimated" path without any training.

Compute of one device (forward; backward = `backward_factor` × the same work):

    launch_ms + per_shard_ms × shards
      + Σ_shards lookups × (dim × bytes / bandwidth + miss_fraction × miss_ns)
      + batch × width × 4 / bandwidth                               (pooled output)

where lookups = batch × pooling factor × (the shard's share of the table's rows) and the
miss fraction models caches: 1 − cache_bytes / (bytes of all the device's shards), floored
at 0, so a device whose shards fit in cache pays no miss latency.

Communication (all-to-all of pooled embeddings, global batch split evenly over D ranks):
rank r moves sent_r + received_r bytes = 4 × (Σ_{p≠r} b_p × w_r + b_r × Σ_{p≠r} w_p) in the
forward and the same in the backward; time = comm_latency_ms + bytes / net_bandwidth; the
backward also all-reduces the data-parallel tables' gradients (`allreduce_ms`). The
forward comm also holds the wait for the slowest device: delay_r = compute_r + bw comm_r,
wait_r = max_p delay_p − delay_r (NeuroShard's simulator does the same).

Defaults roughly fit FBGEMM's CPU kernel on one thread and gloo on localhost measured on a
small, shared 2-core machine (see the class); `calibrate` refits them to measurements, `fit_to_hardware` measures
and refits in one call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

import numpy as np

from embshard.costs.base import DeviceCosts
from embshard.plan import Plan, Shard, piece_table
from embshard.tables import Table
from embshard.task import Task

BYTES_PER_FLOAT = 4


@dataclass
class AnalyticCostModel:
    """Roofline-style estimate of per-device compute and all-to-all times (ms)."""

    # Defaults: a fit (`calibrate`) to 30 random shard sets of 1-15 tables (dims 4-128,
    # pooling 1-40, batch 1024/4096) timed with FBGEMM's CPU kernel on one thread, and to
    # gloo all-to-alls on localhost; on that machine the per-lookup (cache-miss) cost and
    # the pooled output dominate, the bytes of the rows themselves barely matter.
    launch_ms: float = 0.4
    per_shard_ms: float = 0.02
    bandwidth_gbps: float = 30.0
    miss_ns: float = 10.0
    cache_bytes: float = 8e6
    output_bandwidth_gbps: float = 0.7
    backward_factor: float = 2.0
    net_bandwidth_gbps: float = 1.2
    comm_latency_ms: float = 0.5
    #: override the task's batch size (to compare with a HardwareEvaluator that does).
    batch_size: int | None = None

    # ------------------------------------------------------------------ compute
    def _compute_terms(self, shards: Sequence[tuple[Table, Shard]], batch: int) -> np.ndarray:
        """Features of one device's shard set: [1, shards, row bytes, misses, output bytes]."""
        if not shards:
            return np.zeros(5)
        total_bytes = sum(s.rows * s.dim * t.bytes_per_element for t, s in shards)
        miss = max(0.0, 1.0 - self.cache_bytes / total_bytes) if total_bytes > 0 else 0.0
        row_bytes = lookups = 0.0
        for t, s in shards:
            n = batch * t.pooling_factor * (s.rows / t.rows)
            row_bytes += n * s.dim * t.bytes_per_element
            lookups += n
        width = sum(s.dim for _, s in shards)
        return np.array([1.0, len(shards), row_bytes, lookups * miss, batch * width * BYTES_PER_FLOAT])

    def _coefficients(self) -> np.ndarray:
        return np.array([
            self.launch_ms,
            self.per_shard_ms,
            1e-6 / self.bandwidth_gbps,  # bytes / (GB/s) → ms: bytes × 1e-9 / bw × 1e3
            self.miss_ns * 1e-6,
            1e-6 / self.output_bandwidth_gbps,
        ])

    def forward_compute_ms(self, shards: Sequence[tuple[Table, Shard]], batch: int) -> float:
        return float(self._compute_terms(shards, batch) @ self._coefficients())

    def compute_ms(self, shards: Sequence[tuple[Table, Shard]], batch: int) -> float:
        """Forward + backward (with the fused update) of one device's kernel."""
        return (1.0 + self.backward_factor) * self.forward_compute_ms(shards, batch)

    # ------------------------------------------------------------------ comm
    def _comm_bytes(self, widths: Sequence[int], batch: int) -> list[float]:
        d = len(widths)
        base, extra = divmod(batch, d)
        b = [base + (1 if r < extra else 0) for r in range(d)]
        total_w = sum(widths)
        return [
            BYTES_PER_FLOAT * ((batch - b[r]) * widths[r] + b[r] * (total_w - widths[r])) for r in range(d)
        ]

    def transfer_ms(self, widths: Sequence[int], batch: int) -> list[float]:
        """Per-rank time of one all-to-all with no waiting (forward and backward alike)."""
        if len(widths) <= 1:
            return [0.0] * len(widths)
        return [self.comm_latency_ms + x * 1e-6 / self.net_bandwidth_gbps for x in self._comm_bytes(widths, batch)]

    def allreduce_ms(self, floats: int, num_devices: int) -> float:
        """One ring all-reduce of `floats` fp32 values over `num_devices` ranks (the data-parallel
        tables' gradients, after the backward all-to-all): each rank sends and receives
        2 (D − 1) / D of the buffer."""
        if num_devices <= 1 or floats <= 0:
            return 0.0
        nbytes = 2.0 * (num_devices - 1) / num_devices * floats * BYTES_PER_FLOAT
        return self.comm_latency_ms + nbytes * 1e-6 / self.net_bandwidth_gbps

    # ------------------------------------------------------------------ CostModel
    def device_costs(self, task: Task, plan: Plan) -> DeviceCosts:
        batch = self.batch_size or task.batch_size
        tables = task.table_by_name
        d = task.num_devices
        copies = Counter(s.rectangle for s in plan.shards)
        compute = []
        for on in plan.by_device(d):
            ops: dict[int, list[tuple[Table, Shard]]] = {}
            for s in on:
                t, k = tables[s.table], copies[s.rectangle]
                if t.is_sequence and k > 1:  # a sequence copy serves 1/k of the ids (`piece_table`)
                    ops.setdefault(1, []).append((piece_table(t, s, k), s))
                else:  # a pooled copy of k: its own op at the local batch (`hardware.backends`)
                    ops.setdefault(1 if t.is_sequence else k, []).append((t, s))
            compute.append(sum(self.compute_ms(ops[k], -(-batch // k)) for k in sorted(ops)))
        bw = self.transfer_ms(plan.device_widths(d, tables), batch)
        delay = [c + b for c, b in zip(compute, bw)]
        slowest = max(delay)
        fw = [t + (slowest - x) for t, x in zip(bw, delay)] if d > 1 else [0.0]
        ar = self.allreduce_ms(plan.data_parallel_floats(d, tables), d)
        return DeviceCosts(compute_ms=compute, forward_comm_ms=fw, backward_comm_ms=[b + ar for b in bw])

    # ------------------------------------------------------------------ fitting
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def calibrate(
        cls,
        compute_samples: Sequence[tuple[Sequence[tuple[Table, Shard]], int, float]] = (),
        comm_samples: Sequence[tuple[Sequence[int], int, Sequence[float]]] = (),
        base: "AnalyticCostModel | None" = None,
    ) -> "AnalyticCostModel":
        """Fit the parameters to measurements by non-negative least squares.

        Args:
            compute_samples: (one device's [(table, shard)], batch size, measured fw+bw ms).
            comm_samples: (per-rank widths, batch size, per-rank measured comm ms with no
                delay; forward or backward, they cost the same in this model).
            base: start from these parameters (cache size and backward factor are kept).

        Parameters without data keep their value in `base`.
        """
        m = replace(base) if base is not None else cls()
        if compute_samples:
            x = np.stack([m._compute_terms(s, b) for s, b, _ in compute_samples])
            y = np.array([ms for _, _, ms in compute_samples]) / (1.0 + m.backward_factor)
            c = _nnls(x, y, fallback=m._coefficients())
            m.launch_ms, m.per_shard_ms = float(c[0]), float(c[1])
            m.bandwidth_gbps = float(1e-6 / c[2]) if c[2] > 0 else 1e6
            m.miss_ns = float(c[3] * 1e6)
            m.output_bandwidth_gbps = float(1e-6 / c[4]) if c[4] > 0 else 1e6
        if comm_samples:
            rows, ys = [], []
            for widths, b, ms in comm_samples:
                for nbytes, t in zip(m._comm_bytes(widths, b), ms):
                    rows.append([1.0, nbytes])
                    ys.append(t)
            c = _nnls(np.array(rows), np.array(ys), fallback=np.array([m.comm_latency_ms, 1e-6 / m.net_bandwidth_gbps]))
            m.comm_latency_ms = float(c[0])
            m.net_bandwidth_gbps = float(1e-6 / c[1]) if c[1] > 0 else 1e6
        return m

    @classmethod
    def fit_to_hardware(
        cls,
        tables: Sequence[Table],
        batch_size: int,
        backend: str = "fbgemm",
        num_sets: int = 12,
        num_devices: int = 2,
        comm: bool = True,
        seed: int = 0,
        protocol: Any = None,
    ) -> "AnalyticCostModel":
        """Measure `num_sets` random shard sets (and a few all-to-alls) here and calibrate."""
        from embshard.hardware.backends import ShardInput
        from embshard.hardware.comm import measure_comm
        from embshard.hardware.compute import measure_compute

        rng = np.random.default_rng(seed)
        sets = []
        for _ in range(num_sets):
            k = int(rng.integers(1, len(tables) + 1))
            pick = rng.choice(len(tables), size=k, replace=False)
            sets.append([(tables[i], Shard.whole(tables[i], 0)) for i in pick])
        timings = measure_compute(
            [[ShardInput(t, s) for t, s in ss] for ss in sets], batch_size, backend=backend,
            protocol=protocol, seed=seed,
        )
        compute_samples = [(ss, batch_size, t.median_ms) for ss, t in zip(sets, timings)]
        comm_samples = []
        if comm and num_devices > 1:
            configs = [[int(w) for w in rng.integers(0, 8 * max(t.dim for t in tables) + 1, size=num_devices)]
                       for _ in range(4)]
            for widths, r in zip(configs, measure_comm([(w, None) for w in configs], batch_size,
                                                       protocol=protocol)):
                comm_samples.append((widths, batch_size, r.backward_ms))
        return cls.calibrate(compute_samples, comm_samples)


def _nnls(x: np.ndarray, y: np.ndarray, fallback: np.ndarray, iters: int = 50) -> np.ndarray:
    """Least squares with non-negative coefficients (active-set; numpy only).

    Columns that are all zero keep their `fallback` value (no data says anything about them).
    """
    n = x.shape[1]
    informative = np.abs(x).sum(axis=0) > 0
    active = informative.copy()
    coef = np.zeros(n)
    # Scale columns so the solve is well conditioned (bytes are ~1e9, counts ~1).
    scale = np.where(informative, np.abs(x).max(axis=0), 1.0)
    xs = x / scale
    for _ in range(iters):
        coef[:] = 0.0
        if not active.any():
            break
        sol, *_ = np.linalg.lstsq(xs[:, active], y, rcond=None)
        coef[active] = sol
        neg = active & (coef < 0)
        if not neg.any():
            break
        active[np.argmin(np.where(neg, coef, np.inf))] = False
    coef = np.maximum(coef, 0.0) / scale
    coef[~informative] = fallback[~informative]
    return coef


def analytic_allreduce_ms(floats: int, num_devices: int) -> float:
    """`AnalyticCostModel.allreduce_ms` at the default parameters: the data-parallel gradient
    all-reduce where a model was never trained on one (the neural comm models, predictors)."""
    return AnalyticCostModel().allreduce_ms(floats, num_devices)
