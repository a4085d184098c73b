"""FlexShard's tier cuts: which rows to replicate everywhere, which once per host, under a
per-device memory cap, minimising the modeled communication time of a step.

Per sequence table, rows sorted by their accesses per step on the fit batches (a, descending).
A row sits in one of three tiers. Its expected cost per step, in ms averaged over the D = H x P
devices (every tier is laid out evenly over devices, so the average is the busiest device's
share; embshard.flexshard.layout), with the accesses of a step spread over the devices' samples
as Poisson: a device touches the row with q = 1 - e^(-a/D), a host with u = 1 - e^(-a/H),
anyone with g = 1 - e^(-a):

* split over all devices (the global tier): n(a) lookups travel (n = a, or with TorchRec's id
  dedup the distinct (device, row) requests D q), each moving an id and an embedding and its
  gradient, (D - P)/D of them between hosts and (P - 1)/D inside the host;
* once per host, split inside it: the lookups stay inside the host ((P - 1)/P of them leave
  the requester); the H copies synchronise the gradient between hosts;
* on every device: no lookups; the D copies synchronise it, hierarchically.

The sync is the data path's (embshard.flexshard.routing). Sparse (FlexShard's plans): only
touched rows move, an int64 row and its fp32 gradient each: a per-host row costs (H - 1)(u + g)
row messages between hosts (2u for two hosts, which exchange), a replicated one H (P - 1)(q + g)
more inside the hosts. Dense
(every row every step): 2 (H - 1)/D rows between hosts, resp. 2 (P - 1)/P inside and
2 (H - 1)/(H P) between hosts per device. The all-to-all phases last as long as their slower
link class (the traffic model's `phase_ms`): their cost is max(intra ms, inter ms), while each
sync phase runs on one class. The objective is therefore max(A_intra, A_inter) + S over the
plan's rows; it is minimised as θ A_intra + A_inter + S for a weight θ in [0, 1]: θ = 0 is
optimal whenever its solution's intra-host all-to-all is the faster one (the usual case:
600 against 12.5 GiB/s), otherwise θ is bisected.

A row uses m/D, m/P or m bytes per device (m: weights and optimizer state). Under a price λ
per byte each table's best layout is two cuts in its sorted rows; rows with equal counts have
equal costs, so the rows are run-length compressed by count and the best cuts of every table
come from prefix sums and a running minimum over its distinct counts, all tables at once (no
per-row and no per-table Python, and no assumption on the shape of the costs). λ is bisected
until the memory per device fits the cap (a Lagrangian relaxation of the knapsack).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from embshard.flexshard.layout import Tiers
from embshard.flexshard.traffic import FLOAT_BYTES, ID_BYTES
from embshard.task import BYTES_PER_GB, OPTIMIZER_STATE_BYTES_PER_ROW, Task


def tier_costs(task: Task, a: np.ndarray, dim: np.ndarray, dedup: bool, sparse_sync: bool
               ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Expected ms per step (averaged over devices) of rows with `a` accesses per step and
    width `dim` in each tier: {"split" | "host" | "all": (all-to-all intra, all-to-all inter,
    sync)} (module docstring)."""
    D, P, H = task.num_devices, task.devices_per_host, task.hosts
    bw_in = task.intra_host_gbps * BYTES_PER_GB / 1e3  # bytes per ms
    bw_out = task.inter_host_gbps * BYTES_PER_GB / 1e3
    a = np.asarray(a, dtype=np.float64)
    dim = np.asarray(dim, dtype=np.float64)
    lookup = ID_BYTES + 2 * FLOAT_BYTES * dim
    n = D * -np.expm1(-a / D) if dedup else a
    zero = np.zeros_like(a)
    split = (n * lookup * (P - 1) / D / bw_in / D, n * lookup * (D - P) / D / bw_out / D)
    host_a2a = n * lookup * (P - 1) / P / bw_in / D
    if sparse_sync:
        q, u, g = -np.expm1(-a / D), -np.expm1(-a / H), -np.expm1(-a)
        row = ID_BYTES + FLOAT_BYTES * dim
        inter = 2 * u if H == 2 else (H - 1) * (u + g)
        sync_host = row * inter / D / bw_out
        sync_all = row * H * (P - 1) * (q + g) / D / bw_in + sync_host
    else:
        grad = FLOAT_BYTES * dim
        sync_host = grad * 2 * (H - 1) / D / bw_out + zero
        sync_all = grad * (2 * (P - 1) / P / bw_in + 2 * (H - 1) / (H * P) / bw_out) + zero
    return {"split": (split[0], split[1], zero), "host": (host_a2a, zero, sync_host), "all": (zero, zero, sync_all)}


@dataclass
class TierProblem:
    """Every table's rows run-length compressed by accesses per step, descending, all tables
    concatenated: table t owns groups [starts[t], starts[t+1]) of `a` (accesses per step) and
    `count` (rows with exactly that many). Rows not accessed on the fit steps are not listed
    (they stay split: they cost nothing and use m/D each)."""

    task: Task
    names: list[str]
    rows: np.ndarray         # [T] rows of each table
    row_bytes: np.ndarray    # [T] m: weights + optimizer state of one row
    dims: np.ndarray         # [T]
    starts: np.ndarray       # [T + 1]
    a: np.ndarray            # [G]
    count: np.ndarray        # [G]
    dedup: bool
    sparse_sync: bool
    _costs: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, task: Task, tables, per_step: list[np.ndarray], dedup: bool, sparse_sync: bool) -> "TierProblem":
        """`per_step[t]`: accesses per step of table t's accessed rows, descending."""
        values, counts, starts = [], [], [0]
        for v in per_step:
            v = np.asarray(v, dtype=np.float64)
            first = np.flatnonzero(np.r_[True, v[1:] != v[:-1]]) if v.size else np.zeros(0, dtype=np.int64)
            values.append(v[first])
            counts.append(np.diff(np.r_[first, v.size]).astype(np.int64))
            starts.append(starts[-1] + first.size)
        row_bytes = np.array([t.dim * t.bytes_per_element + OPTIMIZER_STATE_BYTES_PER_ROW[task.optimizer](t.dim)
                              for t in tables], dtype=np.float64)
        return cls(task, [t.name for t in tables], np.array([t.rows for t in tables], dtype=np.int64), row_bytes,
                   np.array([t.dim for t in tables], dtype=np.float64), np.array(starts, dtype=np.int64),
                   np.concatenate(values) if values else np.zeros(0),
                   np.concatenate(counts).astype(np.int64) if counts else np.zeros(0, dtype=np.int64), dedup, sparse_sync)

    @property
    def table_of_group(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.names)), np.diff(self.starts))

    def costs(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per group, the tier costs of all its rows (count x per-row cost)."""
        if not self._costs:
            per_row = tier_costs(self.task, self.a, self.dims[self.table_of_group], self.dedup, self.sparse_sync)
            self._costs = {k: tuple(c * self.count for c in v) for k, v in per_row.items()}
        return self._costs


@dataclass(frozen=True)
class Solution:
    """Tier cuts of every table and what the model expects of them (ms per step, per device)."""

    cuts: list[Tiers]
    lam: float
    theta: float
    a2a_intra_ms: float
    a2a_inter_ms: float
    sync_ms: float
    memory_bytes: float  # weights + optimizer state per device (average)

    @property
    def objective_ms(self) -> float:
        return max(self.a2a_intra_ms, self.a2a_inter_ms) + self.sync_ms


def _segment_first_argmin(values: np.ndarray, seg_starts: np.ndarray, seg_of: np.ndarray) -> np.ndarray:
    """Position of the first minimum of `values` within each segment (segments non-empty)."""
    mins = np.minimum.reduceat(values, seg_starts)
    hit = np.flatnonzero(values <= mins[seg_of])
    first = np.r_[True, seg_of[hit][1:] != seg_of[hit][:-1]]
    return hit[first]


def _cuts(problem: TierProblem, lam: float, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """(g, f) per table: the number of distinct-count groups in the replicated tier and in the
    replicated + per-host tiers, minimising θ intra + inter + sync + λ memory."""
    task = problem.task
    D, P, H = task.num_devices, task.devices_per_host, task.hosts
    T = len(problem.names)
    k = np.diff(problem.starts)
    c = problem.costs()
    tg = problem.table_of_group
    m = problem.row_bytes[tg] * problem.count * lam
    per = {tier: theta * c[tier][0] + c[tier][1] + c[tier][2] for tier in c}
    cost_split = per["split"] + m / D
    cost_host = per["host"] + m / P
    cost_all = per["all"] + m
    if H == 1:    # the per-host tier is the split tier
        cost_host = cost_split
    elif P == 1:  # ... or the replicated one
        cost_host = cost_all
    # positions 0..k_t of table t (a cut after that many groups), laid out one table after another
    pos_start = problem.starts + np.arange(T + 1)
    n_pos = int(pos_start[-1])
    seg_of = np.repeat(np.arange(T), k + 1)
    group_pos = np.arange(problem.a.size) + tg + 1  # position just after each group

    def prefix(x: np.ndarray) -> np.ndarray:
        out = np.zeros(n_pos)
        out[group_pos] = x
        cs = np.cumsum(out)
        return cs - cs[pos_start[:-1]][seg_of]

    pa, ph, ps = prefix(cost_all), prefix(cost_host), prefix(cost_split)
    y = pa - ph
    big = 4.0 * (np.abs(y).max(initial=0.0) + 1.0)
    running = np.minimum.accumulate(y - seg_of * big) + seg_of * big  # min of y over g <= f, per table
    total = running + ph - ps
    f = _segment_first_argmin(total, pos_start[:-1], seg_of)
    local = np.arange(n_pos) - pos_start[:-1][seg_of]
    f_local = local[f]
    y_masked = np.where(local <= f_local[seg_of], y, np.inf)
    g = _segment_first_argmin(y_masked, pos_start[:-1], seg_of)
    g_local = local[g]
    if H == 1:    # fold the (equal-cost) host rows into the split tier
        f_local = g_local.copy()
    elif P == 1:  # ... or into the replicated tier
        g_local = f_local.copy()
    return g_local, f_local


def _evaluate(problem: TierProblem, g: np.ndarray, f: np.ndarray, lam: float, theta: float) -> Solution:
    task = problem.task
    D, P = task.num_devices, task.devices_per_host
    c = problem.costs()
    tg = problem.table_of_group
    local = np.arange(problem.a.size) - problem.starts[:-1][tg]
    in_all = local < g[tg]
    in_host = (local >= g[tg]) & (local < f[tg])
    in_split = ~(in_all | in_host)
    parts = [float(sum(c[tier][i][mask].sum() for tier, mask in (("all", in_all), ("host", in_host), ("split", in_split))))
             for i in range(3)]
    cum = np.zeros(problem.a.size + 1, dtype=np.int64)
    cum[1:] = np.cumsum(problem.count)
    base = cum[problem.starts[:-1]]
    rows_all = cum[problem.starts[:-1] + g] - base
    rows_front = cum[problem.starts[:-1] + f] - base
    cuts = [Tiers(int(ra), int(rf - ra)) for ra, rf in zip(rows_all, rows_front)]
    memory = float((problem.row_bytes * (rows_all + (rows_front - rows_all) / P + (problem.rows - rows_front) / D)).sum())
    return Solution(cuts, lam, theta, parts[0], parts[1], parts[2], memory)


def split_everything(problem: TierProblem) -> Solution:
    """Every row in the global tier (TorchRec's row-wise layout), priced."""
    zero = np.zeros(len(problem.names), dtype=np.int64)
    return _evaluate(problem, zero, zero, math.inf, 0.0)


def cuts_at(problem: TierProblem, lam: float, theta: float) -> Solution:
    """Every table's cheapest cuts at memory price `lam` (ms per byte) and weight `theta` on
    the intra-host all-to-all, priced."""
    return _evaluate(problem, *_cuts(problem, lam, theta), lam, theta)


def _solve_lambda(problem: TierProblem, budget_bytes: float, theta: float, iterations: int = 60) -> Solution:
    """The cheapest cuts (weight θ on intra-host all-to-all) whose memory per device is within
    `budget_bytes`, by bisection on λ."""
    free = cuts_at(problem, 0.0, theta)
    if free.memory_bytes <= budget_bytes:
        return free
    lo, hi = 0.0, 1e-12
    while cuts_at(problem, hi, theta).memory_bytes > budget_bytes and hi < 1e30:
        lo, hi = hi, hi * 16
    best = cuts_at(problem, hi, theta)
    for _ in range(iterations):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        sol = cuts_at(problem, mid, theta)
        if sol.memory_bytes <= budget_bytes:
            hi, best = mid, sol
        else:
            lo = mid
        if hi - lo <= 1e-6 * hi:
            break
    return best


def solve(problem: TierProblem, budget_bytes: float, theta_iterations: int = 6) -> Solution:
    """Tier cuts of every table within `budget_bytes` per device (average; the caller checks
    the exact plan), minimising max(all-to-all intra, inter) + sync (module docstring)."""
    best = _solve_lambda(problem, budget_bytes, 0.0)
    if best.a2a_intra_ms <= best.a2a_inter_ms:
        return best  # θ = 0 under-counts nothing here: its optimum is the true one
    lo, hi = 0.0, 1.0
    for _ in range(theta_iterations):
        mid = (lo + hi) / 2
        sol = _solve_lambda(problem, budget_bytes, mid)
        if sol.objective_ms < best.objective_ms:
            best = sol
        if sol.a2a_intra_ms > sol.a2a_inter_ms:
            lo = mid
        else:
            hi = mid
    return best
