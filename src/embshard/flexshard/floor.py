"""The least inter-host traffic a row placement can have on replayed steps (lower bounds).

FlexShard, the row-wise baselines and HugeCTR's hybrid all keep every copy of a row current
after every step (the data path's gradients equal the unsharded EmbeddingCollection's). Under
that rule, in one step a row held on the hosts S and looked up from the hosts T needs at least

    c(S, T) = |T \\ S| + max(#{h in T : S \\ {h} not empty}, #{h in S : T \\ {h} not empty})

fp32 vectors of its width to cross between hosts: in the forward pass every host that looks
it up without a copy must receive its value; afterwards (the gradients exist only then) every
host that looked it up must send, unless it is the only holder, and every copy must receive,
unless only its own host changed the row. Ids, counts and headers are free here, and memory is
unlimited. Two floors follow, per step:

* **oracle**: each row's holders chosen with hindsight of which hosts look it up in the
  replayed steps: min over S of the sum over steps of c(S, T_step). No plan does better on
  those steps.
* **expected**: the holders fixed before the step (as every plan is), the samples dealt to
  hosts at random (a sample's host is independent of its ids), only each row's number of
  samples per step known (with hindsight): min over S of the sum over steps of
  E[c(S, T) | n_step samples]. No plan does better in expectation over the dealing.

Every inter-host byte arrives at some device, and a collective phase lasts at least as long
as the mean device's inter-host bytes take on its link (`traffic.phase_ms` takes the busiest),
so no plan's modeled communication time (`TrafficModel`) is below

    floor ms = floor bytes / (num_devices * inter_host bytes per ms).

A target below the floor cannot be reached by any placement of rows under these semantics;
only a scheme that changes them (copies synchronised lazily, smaller payloads, samples moved
to their rows' hosts) could.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Any, Mapping, Sequence

import numpy as np

from embshard.errors import InputError
from embshard.hardware.comm import batch_split
from embshard.task import BYTES_PER_GB, Task

FLOAT_BYTES = 4
#: beyond this many hosts the 2^hosts holder sets get slow (and codes of several steps overflow)
MAX_HOSTS = 8

Batch = Mapping[str, tuple[np.ndarray, np.ndarray]]


def step_cost(holders: int, touched: int, hosts: int) -> int:
    """c(S, T) of the module docstring, S and T as bit masks over the hosts."""
    if not touched:
        return 0
    members = [h for h in range(hosts) if holders >> h & 1]
    sends = sum(1 for h in range(hosts) if touched >> h & 1 and any(m != h for m in members))
    receives = sum(1 for h in members if touched & ~(1 << h))
    return bin(touched & ~holders).count("1") + max(sends, receives)


def cost_table(hosts: int) -> np.ndarray:
    """[S, T] of step_cost for every non-empty holder set S (row 0, no holder, is excluded by a huge cost)."""
    n = 1 << hosts
    table = np.array([[step_cost(s, t, hosts) for t in range(n)] for s in range(n)], dtype=np.float64)
    table[0] = np.inf
    return table


def touched_sets(ids: np.ndarray, lengths: np.ndarray, hosts: int, devices_per_host: int,
                 samples_per_device: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of one table's global batch: (rows, bit mask of the hosts that looked it up,
    number of distinct samples that looked it up)."""
    B = int(np.sum(samples_per_device))
    sample = np.repeat(np.arange(B, dtype=np.int64), lengths)
    host_of_sample = np.repeat(np.arange(len(samples_per_device)) // devices_per_host, samples_per_device)
    key = np.unique(np.asarray(ids, dtype=np.int64) * B + sample)
    if key.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    rows, host = key // B, host_of_sample[key % B]
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    masks = np.bitwise_or.reduceat(np.left_shift(1, host), starts)
    counts = np.diff(np.r_[starts, rows.size])
    return rows[starts], masks, counts


def set_probabilities(n: np.ndarray, hosts: int) -> np.ndarray:
    """[len(n), 2^hosts]: the chance that n samples dealt uniformly at random over the hosts land
    on exactly the hosts of each mask (inclusion-exclusion; n = 0 gives the empty set)."""
    n = np.asarray(n, dtype=np.float64)[:, None]
    out = np.zeros((n.shape[0], 1 << hosts))
    for t in range(1 << hosts):
        j = bin(t).count("1")
        out[:, t] = sum((-1) ** i * comb(j, i) * ((j - i) / hosts) ** n[:, 0] for i in range(j + 1)) if j else 0.0
    out[:, 0] = (n[:, 0] == 0).astype(np.float64)
    return np.clip(out, 0.0, 1.0)


@dataclass
class Floor:
    """Both floors of one task on its replayed steps (bytes per step, means over the steps)."""

    steps: int
    oracle_bytes: float
    expected_bytes: float
    oracle_ms: float
    expected_ms: float
    expected_bytes_by_table: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def placement_floor(task: Task, batches: Sequence[Batch]) -> Floor:
    """The module docstring's floors of `task` on `batches` (one {table: (ids, lengths)} per step)."""
    H = task.hosts
    if H < 2:
        raise InputError(f"task {task.name!r} has one host: nothing crosses hosts, there is no floor")
    if H > MAX_HOSTS:
        raise InputError(f"task {task.name!r} has {H} hosts; the floor is computed for at most {MAX_HOSTS}")
    if not batches or H * len(batches) > 62:
        raise InputError(f"the floor needs 1 to {62 // H} replayed steps for {H} hosts, got {len(batches)}")
    costs = cost_table(H)
    per_device = batch_split(task.batch_size, task.num_devices)
    mask_all = (1 << H) - 1
    oracle = expected = 0.0
    by_table: dict[str, float] = {}
    for t in task.tables:
        if not t.is_sequence:
            raise InputError(f"table {t.name!r} is pooled; the floor is defined for sequence tables")
        rows, codes, counts = [], [], []
        for k, batch in enumerate(batches):
            if t.name not in batch:
                raise InputError(f"no batch for table {t.name!r}")
            r, m, n = touched_sets(*batch[t.name], H, task.devices_per_host, per_device)
            rows.append(r)
            codes.append(np.left_shift(m, H * k))
            counts.append(n)
        r = np.concatenate(rows)
        if r.size == 0:
            by_table[t.name] = 0.0
            continue
        order = np.argsort(r, kind="stable")
        r, c = r[order], np.concatenate(codes)[order]
        starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
        distinct_rows = r[starts]
        # oracle: per distinct code (a host mask per step) the best holders in hindsight
        code, how_many = np.unique(np.bitwise_or.reduceat(c, starts), return_counts=True)
        vectors = 0.0
        for value, n_rows in zip(code.tolist(), how_many.tolist()):
            masks = [(value >> (H * k)) & mask_all for k in range(len(batches))]
            vectors += n_rows * float(costs[:, masks].sum(axis=1).min())
        oracle += FLOAT_BYTES * t.dim * vectors / len(batches)
        # expected: samples per step of each distinct row, holders chosen per row before the dealing
        n_steps = np.zeros((distinct_rows.size, len(batches)), dtype=np.int64)
        for k, (rk, nk) in enumerate(zip(rows, counts)):
            n_steps[np.searchsorted(distinct_rows, rk), k] = nk
        pairs, how_many = np.unique(n_steps, axis=0, return_counts=True)
        values = np.unique(pairs)
        e = set_probabilities(values, H) @ costs[1:].T  # [value, non-empty S]: expected crossings of one step
        per_pair = sum(e[np.searchsorted(values, pairs[:, k])] for k in range(len(batches)))
        vectors = float(np.dot(per_pair.min(axis=1), how_many))
        by_table[t.name] = FLOAT_BYTES * t.dim * vectors / len(batches)
        expected += by_table[t.name]
    per_ms = task.num_devices * task.inter_host_gbps * BYTES_PER_GB / 1e3
    return Floor(steps=len(batches), oracle_bytes=oracle, expected_bytes=expected, oracle_ms=oracle / per_ms,
                 expected_ms=expected / per_ms, expected_bytes_by_table=by_table)
