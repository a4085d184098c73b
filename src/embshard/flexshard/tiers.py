"""FlexShard's tier cuts: which rows to replicate everywhere, which once per host, under a
per-device memory cap, minimising modeled communication time.

Per sequence table, rows sorted by their access count on the fit batches (a_k accesses per
step, descending). A row can sit in one of three tiers; per step it costs (ms, averaged over
devices, bytes over each link class divided by its bandwidth; traffic.py's model):

* split over all devices: a_k * t_split; a lookup crosses to another host with probability
  (D - P) / D and stays inside the host (other device) with (P - 1) / D, moving an id
  (8 B) and an embedding and its gradient (2 x 4 x dim B);
* once per host, split inside it: a_k * t_host + s_host; lookups stay inside the host, and
  the H copies all-reduce the row's gradient between hosts;
* on every device: s_all; no lookup traffic, but a hierarchical all-reduce of the gradient.

It uses m/D, m/P or m bytes per device (m: the row's weights and optimizer state). Under a
price λ per byte each row takes the cheapest tier; since every cost is affine in a_k and a_k
is sorted, that is two cuts per table found by binary search. λ is bisected until the
per-device memory fits the cap (a Lagrangian relaxation of the knapsack: each table's cuts
are optimal for the memory they use). No per-row Python: a solve is O(tables x log rows)
per bisection step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from embshard.flexshard.layout import Tiers
from embshard.flexshard.traffic import FLOAT_BYTES, ID_BYTES
from embshard.task import BYTES_PER_GB, OPTIMIZER_STATE_BYTES_PER_ROW, Task


@dataclass(frozen=True)
class RowCosts:
    """Per-row costs of one table's tiers (ms per step; see the module docstring)."""

    t_split: float     # per access
    t_host: float      # per access
    s_host: float      # per row, sync
    s_all: float       # per row, sync
    row_bytes: int     # weights + optimizer state of one row
    use_host_tier: bool


def row_costs(task: Task, dim: int, bytes_per_element: int) -> RowCosts:
    D, P, H = task.num_devices, task.devices_per_host, task.hosts
    bw_in = task.intra_host_gbps * BYTES_PER_GB / 1e3   # bytes per ms
    bw_out = task.inter_host_gbps * BYTES_PER_GB / 1e3
    lookup = ID_BYTES + 2 * FLOAT_BYTES * dim
    t_split = lookup * ((P - 1) / D / bw_in + (D - P) / D / bw_out) / D
    t_host = lookup * ((P - 1) / P / bw_in) / D
    grad = FLOAT_BYTES * dim
    s_all = grad * (2 * (P - 1) / P / bw_in + 2 * (H - 1) / (H * P) / bw_out)
    s_host = grad * 2 * (H - 1) / D / bw_out
    row_bytes = dim * bytes_per_element + OPTIMIZER_STATE_BYTES_PER_ROW[task.optimizer](dim)
    # one host: the per-host tier is the split tier; one device per host: it is the replicated tier
    return RowCosts(t_split, t_host, s_host, s_all, row_bytes, use_host_tier=H > 1 and P > 1)


@dataclass
class TableTiers:
    """One table's inputs to the solve."""

    name: str
    rows: int
    per_step: np.ndarray   # lookups that travel per step (accesses, or distinct per device), descending
    costs: RowCosts


def cuts_at(t: TableTiers, lam: float, D: int, P: int) -> Tiers:
    """The tier cuts of one table at memory price `lam` (ms per byte)."""
    c, m = t.costs, t.costs.row_bytes
    neg = -t.per_step

    def count_above(theta: float) -> int:  # rows with a_k > theta
        return int(np.searchsorted(neg, -theta, side="left")) if math.isfinite(theta) else 0

    theta_all_split = (c.s_all + lam * m * (1 - 1 / D)) / c.t_split if c.t_split > 0 else math.inf
    if c.use_host_tier and c.t_split > c.t_host:
        theta_host_split = (c.s_host + lam * m * (1 / P - 1 / D)) / (c.t_split - c.t_host)
        theta_all_host = (c.s_all - c.s_host + lam * m * (1 - 1 / P)) / c.t_host if c.t_host > 0 else math.inf
        if theta_host_split < theta_all_host:
            g = count_above(theta_all_host)
            h = count_above(theta_host_split)
            return Tiers(g, max(0, h - g))
    return Tiers(count_above(theta_all_split), 0)


def memory_per_device(tables: list[TableTiers], cuts: list[Tiers], D: int, P: int) -> float:
    """Average bytes per device of weights + optimizer state under `cuts`."""
    return float(sum(
        t.costs.row_bytes * (c.replicated + c.per_host / P + (t.rows - c.front) / D)
        for t, c in zip(tables, cuts)
    ))


def modeled_ms(tables: list[TableTiers], cuts: list[Tiers]) -> float:
    """The search objective: per-step ms of lookups and sync, averaged over devices."""
    total = 0.0
    for t, c in zip(tables, cuts):
        a = t.per_step
        g, f = c.replicated, c.front
        total += c.replicated * t.costs.s_all + c.per_host * t.costs.s_host
        total += a[g:f].sum() * t.costs.t_host + a[f:].sum() * t.costs.t_split
    return total


def solve(task: Task, tables: list[TableTiers], budget_bytes: float, iterations: int = 100) -> tuple[list[Tiers], float]:
    """Tier cuts of every table whose per-device memory (average) is within `budget_bytes`,
    minimising `modeled_ms`; returns (cuts, λ). The caller checks the exact plan."""
    D, P = task.num_devices, task.devices_per_host
    free = [cuts_at(t, 0.0, D, P) for t in tables]
    if memory_per_device(tables, free, D, P) <= budget_bytes:
        return free, 0.0
    lo, hi = 0.0, 1e-12
    while memory_per_device(tables, [cuts_at(t, hi, D, P) for t in tables], D, P) > budget_bytes and hi < 1e30:
        lo, hi = hi, hi * 16
    for _ in range(iterations):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        if memory_per_device(tables, [cuts_at(t, mid, D, P) for t in tables], D, P) <= budget_bytes:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return [cuts_at(t, hi, D, P) for t in tables], hi
