"""Communication of a plan, counted by replaying held-out batches (`shard.py evaluate=traffic`).

Per training step, between every pair of devices (bytes that leave a device for another one;
a device's own lookups cost nothing):

* ids: the split counts (one int64 per table and peer, exchanged first) and the ids a device
  sends to the devices that hold their rows (int64 each; each distinct id once per device and
  table when the plan sets `dedup_ids`, as TorchRec's use_index_dedup);
* embeddings_fw: a sequence table returns one fp32 vector of the piece's width per id
  (TorchRec's SequenceEmbeddingsAllToAll); a pooled table returns the piece's pooled partial
  sums for every sample of the requester (TorchRec's pooled row-wise / table-wise output);
* gradients_bw: the same sizes, back;
* replica_sync: the all-reduce of replicated rows' gradients (embshard.flexshard.routing):
  dense (every row, fp32, every step) or, for plans with `sparse_sync`, the rows some holder
  looked up in the step (int64 row + fp32 gradient each), after a count per peer and group.

Each pair's bytes are classed `intra_host` or `inter_host` by the task's topology. The
modeled time of a step adds its collective phases (ids, embeddings, gradients, the four sync
steps); a phase lasts as long as its busiest device, which moves its intra-host and inter-host
bytes at the same time over separate links: max(max(sent, received) intra / intra_host_gbps,
max(sent, received) inter / inter_host_gbps). Bandwidths are per device (one NIC per GPU, as
TorchRec's planner assumes); latency is not modeled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from embshard.errors import InputError
from embshard.flexshard.routing import (SYNC_PHASES, SparseSync, link_is_intra, plan_routes, sync_groups,
                                        sync_schedule)
from embshard.flexshard.stats import BatchSplit, step_batch
from embshard.hardware.comm import batch_split
from embshard.plan import Plan
from embshard.task import BYTES_PER_GB, Task

log = logging.getLogger(__name__)

PURPOSES = ("ids", "embeddings_fw", "gradients_bw", "replica_sync")
ALL_TO_ALL_PURPOSES = ("ids", "embeddings_fw", "gradients_bw")
LINK_CLASSES = ("intra_host", "inter_host")
ID_BYTES = 8
FLOAT_BYTES = 4
#: tables up to this many rows are routed through a per-row segment table (2 bytes a row)
LUT_MAX_ROWS = 1 << 25

Batch = Mapping[str, tuple[np.ndarray, np.ndarray]]  # table -> (ids, lengths) of the global batch


@dataclass
class StepTraffic:
    """Bytes of one step: per phase, a [src, dst] matrix (ids, embeddings_fw, gradients_bw, then
    the four replica-sync phases)."""

    phases: dict[str, np.ndarray]

    def purpose_matrix(self, purpose: str) -> np.ndarray:
        if purpose == "replica_sync":
            return sum(self.phases[p] for p in SYNC_PHASES)
        return self.phases[purpose]


def phase_ms(matrix: np.ndarray, intra: np.ndarray, intra_bytes_per_ms: float, inter_bytes_per_ms: float) -> float:
    """Modeled duration of one collective phase (module docstring)."""
    out = 0.0
    for mask, bw in ((intra, intra_bytes_per_ms), (~intra, inter_bytes_per_ms)):
        m = np.where(mask, matrix, 0.0)
        busiest = np.maximum(m.sum(axis=1), m.sum(axis=0)).max(initial=0.0)
        out = max(out, busiest / bw)
    return float(out)


class TrafficModel:
    """Counts the bytes of a (validated) plan on given batches."""

    def __init__(self, task: Task, plan: Plan):
        self.task, self.plan = task, plan
        self.D = task.num_devices
        self.routes = plan_routes(task, plan)
        self.intra = link_is_intra(self.D, task.devices_per_host)
        self.intra_bytes_per_ms = task.intra_host_gbps * BYTES_PER_GB / 1e3
        self.inter_bytes_per_ms = task.inter_host_gbps * BYTES_PER_GB / 1e3
        self.samples_per_device = np.array(batch_split(task.batch_size, self.D), dtype=np.int64)
        self.sync = {p: np.zeros((self.D, self.D)) for p in SYNC_PHASES}
        groups = sync_groups(task, plan)
        #: sparse sync: per group its rule; per (table, column) the group of each segment (-1: one holder)
        self.rules = [SparseSync.of(g, task.devices_per_host) for g in groups] if plan.sparse_sync else []
        self.segment_group: dict[tuple[str, int], np.ndarray] = {}
        if plan.sparse_sync:
            index = {(g.table, g.row_offset, g.col_offset): k for k, g in enumerate(groups)}
            for name, route in self.routes.items():
                for col in route.columns:
                    self.segment_group[(name, col.col_offset)] = np.array(
                        [index.get((name, int(r), col.col_offset), -1) for r in col.seg_starts], dtype=np.int64)
            for rule in self.rules:  # the counts: one int64 per peer and group, every step
                for k, name in enumerate(SYNC_PHASES):
                    for m in rule.group.members:
                        for peer in rule.peers(k, m):
                            self.sync[name][m, peer] += ID_BYTES
        else:
            for group in groups:
                for name, transfers in zip(SYNC_PHASES, sync_schedule(group, task.devices_per_host)):
                    for src, dst, _, length in transfers:
                        self.sync[name][src, dst] += FLOAT_BYTES * length
        self.num_columns = sum(len(r.columns) for r in self.routes.values())

    def step(self, batch: Batch) -> StepTraffic:
        D = self.D
        ids_m = np.full((D, D), float(ID_BYTES * self.num_columns))  # the split counts
        fw = np.zeros((D, D))
        sample_src = np.repeat(np.arange(D), self.samples_per_device)
        touched: list[np.ndarray] = []  # sparse sync: (group, device, group-local row) keys looked up
        for name, route in self.routes.items():
            t = route.table
            if name not in batch:
                raise InputError(f"no batch for table {name!r}")
            ids, lengths = batch[name]
            if lengths.size != self.task.batch_size:
                raise InputError(f"table {name!r}: batch of {lengths.size} samples, the task's is {self.task.batch_size}")
            src = np.repeat(sample_src, lengths)
            ids = np.asarray(ids, dtype=np.int64)
            if self.plan.dedup_ids:  # the remap is a bijection: distinct original ids = distinct rows
                key = np.unique(src * t.rows + ids)
                src, ids = key // t.rows, key % t.rows
            for col in route.columns:
                new = None
                if t.rows <= LUT_MAX_ROWS:
                    seg = col.segment_lut(route.row_map)[ids]
                    dest = col.dest[src, seg]
                else:
                    new = route.row_map.to_new(torch.from_numpy(ids)).numpy()
                    seg = np.searchsorted(col.seg_starts, new, side="right") - 1
                    dest = col.dest[src, seg]
                if self.rules:
                    touched.append(self._touched(route, col, ids, new, seg, dest))
                n = np.bincount(src * D + dest, minlength=D * D).reshape(D, D).astype(np.float64)
                ids_m += ID_BYTES * n
                if t.is_sequence:
                    fw += FLOAT_BYTES * col.dim * n.T
                else:
                    for s in range(D):
                        fw[col.dest_set(s), s] += FLOAT_BYTES * col.dim * self.samples_per_device[s]
        np.fill_diagonal(ids_m, 0.0)
        np.fill_diagonal(fw, 0.0)
        sync = self._sparse_sync(np.concatenate(touched)) if self.rules else self.sync
        return StepTraffic({"ids": ids_m, "embeddings_fw": fw, "gradients_bw": fw.T.copy(), **sync})

    def _touched(self, route, col, ids: np.ndarray, new: np.ndarray | None, seg: np.ndarray,
                 dest: np.ndarray) -> np.ndarray:
        """Keys group * (D * 2**32) + device * 2**32 + group-local row of the lookups that land
        on a copy of a synchronised rectangle (the rows each holder touched)."""
        group = self.segment_group[(route.table.name, col.col_offset)][seg]
        hit = group >= 0
        if not hit.any():
            return np.zeros(0, dtype=np.int64)
        rows = new[hit] if new is not None else route.row_map.to_new(torch.from_numpy(ids[hit])).numpy()
        local = rows - col.seg_starts[seg[hit]]
        return np.unique((group[hit] * self.D + dest[hit]) * (1 << 32) + local)

    def _sparse_sync(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The sparse sync's bytes of one step (routing.SparseSync applied to every holder)."""
        out = {name: m.copy() for name, m in self.sync.items()}  # the counts
        keys = np.unique(keys)
        group_dev, local = keys >> 32, keys & ((1 << 32) - 1)
        bounds = np.flatnonzero(np.r_[True, group_dev[1:] != group_dev[:-1], True])
        held: dict[int, dict[int, np.ndarray]] = {}
        for a, b in zip(bounds[:-1], bounds[1:]):
            g, d = divmod(int(group_dev[a]), self.D)
            held.setdefault(g, {})[d] = local[a:b]
        for g, rows_of in held.items():
            rule = self.rules[g]
            row_bytes = ID_BYTES + FLOAT_BYTES * rule.group.dim
            for k, name in enumerate(SYNC_PHASES):
                received: dict[int, list[np.ndarray]] = {}
                kept: dict[int, np.ndarray] = {}
                for d in rule.group.members:
                    rows = rows_of.get(d, np.zeros(0, dtype=np.int64))
                    sends, keep = rule.sends(k, d, rows)
                    for peer, pos in sends.items():
                        out[name][d, peer] += row_bytes * pos.size
                        received.setdefault(peer, []).append(rows[pos])
                    kept[d] = rows[keep]
                rows_of = {d: np.unique(np.concatenate([kept[d], *received.get(d, [])])) for d in rule.group.members}
        return out

    def step_ms(self, step: StepTraffic) -> dict[str, float]:
        """Modeled ms of each phase of one step."""
        return {name: phase_ms(m, self.intra, self.intra_bytes_per_ms, self.inter_bytes_per_ms)
                for name, m in step.phases.items()}


@dataclass
class TrafficReport:
    """Mean per-step communication of one plan over the replayed batches."""

    steps: int
    bytes_by_purpose: dict[str, dict[str, float]]   # purpose -> {intra_host, inter_host, total}
    device_sent_bytes: list[float]
    device_received_bytes: list[float]
    modeled_comm_ms: float
    modeled_phase_ms: dict[str, float]               # ids, embeddings_fw, gradients_bw, replica_sync
    pair_bytes: list[list[float]] = field(repr=False, default_factory=list)  # [src][dst], all purposes

    @property
    def traffic_bytes(self) -> dict[str, float]:
        return _sum_classes(self.bytes_by_purpose[p] for p in PURPOSES)

    @property
    def all_to_all_bytes(self) -> dict[str, float]:
        return _sum_classes(self.bytes_by_purpose[p] for p in ALL_TO_ALL_PURPOSES)

    @property
    def busiest_device_bytes(self) -> float:
        return max(max(s, r) for s, r in zip(self.device_sent_bytes, self.device_received_bytes))

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "traffic_bytes": self.traffic_bytes,
            "all_to_all_bytes": self.all_to_all_bytes,
            "bytes_by_purpose": self.bytes_by_purpose,
            "busiest_device_bytes": self.busiest_device_bytes,
            "device_sent_bytes": self.device_sent_bytes,
            "device_received_bytes": self.device_received_bytes,
            "modeled_comm_ms": self.modeled_comm_ms,
            "modeled_phase_ms": self.modeled_phase_ms,
        }


def _sum_classes(rows) -> dict[str, float]:
    out = {c: 0.0 for c in (*LINK_CLASSES, "total")}
    for r in rows:
        for c in out:
            out[c] += r[c]
    return out


def summarize_steps(model: TrafficModel, steps: Sequence[StepTraffic]) -> TrafficReport:
    """Average a plan's per-step traffic and modeled time over `steps`."""
    n = len(steps)
    by_purpose = {}
    for p in PURPOSES:
        m = sum(s.purpose_matrix(p) for s in steps) / n
        intra = float(m[model.intra].sum())
        by_purpose[p] = {"intra_host": intra, "inter_host": float(m.sum()) - intra, "total": float(m.sum())}
    total = sum(sum(s.purpose_matrix(p) for p in PURPOSES) for s in steps) / n
    ms = [model.step_ms(s) for s in steps]
    phase = {p: float(np.mean([m[p] for m in ms])) for p in ALL_TO_ALL_PURPOSES}
    phase["replica_sync"] = float(np.mean([sum(m[p] for p in SYNC_PHASES) for m in ms]))
    return TrafficReport(
        steps=n,
        bytes_by_purpose=by_purpose,
        device_sent_bytes=[float(x) for x in total.sum(axis=1)],
        device_received_bytes=[float(x) for x in total.sum(axis=0)],
        modeled_comm_ms=float(sum(phase.values())),
        modeled_phase_ms=phase,
        pair_bytes=total.tolist(),
    )


def global_batches(task: Task, steps: Sequence[int], seed: int = 0) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The global batch of every table in each of `steps` (traces replayed in order)."""
    return [{t.name: step_batch(t, task.batch_size, s, seed) for t in task.tables} for s in steps]


class TrafficEvaluator:
    """evaluate=traffic: replay the held-out steps of a `BatchSplit` under each plan.

    Args:
        fit_batches, eval_batches, seed: the BatchSplit; plans must have been fitted on steps
            before `fit_batches` (searchers report theirs; an overlap is an error).
    """

    def __init__(self, fit_batches: int = 4, eval_batches: int = 4, seed: int = 0):
        self.split = BatchSplit(fit_batches, eval_batches, seed)

    def check_task(self, task: Task) -> None:
        """Raise InputError unless every traced table has samples for the fit and held-out steps."""
        from embshard.data.dlrm_datasets import load_trace

        need = task.batch_size * (self.split.fit_batches + self.split.eval_batches)
        for t in task.tables:
            if t.trace is not None:
                samples = load_trace(t.trace)[1].numel() - 1
                if samples < need:
                    raise InputError(
                        f"task {task.name!r}, table {t.name!r}: its trace has {samples} samples but "
                        f"{self.split.fit_batches} fit + {self.split.eval_batches} held-out steps of batch "
                        f"{task.batch_size} need {need}"
                    )

    def evaluate(self, task: Task, plans: Sequence[Plan], fitted_on: Sequence[int | None] = ()) -> list[TrafficReport]:
        for plan, fit in zip(plans, fitted_on):
            if fit is not None and fit > self.split.fit_batches:
                raise InputError(
                    f"{plan.algorithm} was fitted on steps 0..{fit - 1}, which overlap the evaluation steps "
                    f"{self.split.eval_steps.start}..{self.split.eval_steps.stop - 1}; raise traffic.fit_batches to {fit}"
                )
        batches = global_batches(task, self.split.eval_steps, self.split.seed)
        reports = []
        for plan in plans:
            model = TrafficModel(task, plan)
            reports.append(summarize_steps(model, [model.step(b) for b in batches]))
        return reports
