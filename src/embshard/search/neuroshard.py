"""NeuroShard's search: table-wise greedy grid and a beam search over column and row splits,
against a shard predictor (pre-trained neural cost models, or the analytic stand-in), with an
optional measured guard.

Table-wise greedy (one run per balance cap s in `caps`, default 1.00, 1.05, …, 1.50):
pieces are placed in descending predicted single-piece cost; a device is allowed when the
piece fits its memory, its width sum + the piece's dim ≤ s × (total width / D), and it holds
no other piece of the same table (pieces of one table on one device would only repeat the
lookups); among the allowed devices the one whose WHOLE shard, re-predicted with the piece
added, is cheapest wins (ties: less memory used, then lower index). All candidate shards of
one placement go to the predictor in one batched call, and every shard prediction is cached
by the multiset of its pieces, so runs for different caps share their common prefix. When no
device passes the width cap, any device with memory room is allowed. Memory goes through the
foundation's `MemoryLedger` with this preference order, so a placement that would leave the
remaining pieces unpackable is skipped. The plan with the lowest simulated plan cost over all
caps is kept.

Beam search over splits. A step either halves one piece's dim (both halves keep rows,
pooling factor and histogram; a piece is halvable when its dim is a multiple of 8, so halves
stay multiples of 4), or makes one whole table row-wise: TorchRec's layout, even blocks of
ceil(rows / n) rows on the n devices of its group (all devices; with several hosts, the
devices of one host: table-row-wise), each block serving its share of the lookups and
sending its full width in the all-to-all (TorchRec reduces the partial sums; the volume is
that of an all-to-all of the full width). From each of the `beam_width` best states, the
candidates are the top `candidates` halvable pieces by memory ∪ by predicted cost, and the
top `candidates` whole tables by predicted cost for a row split; every candidate state is
scored by the full table-wise greedy; the best plan seen anywhere (including no split)
wins. When the table-wise greedy cannot fit the task, the offending table's largest piece is
halved until it fits (or cannot be halved further: InfeasibleError naming the table and the
shortfall).

Every plan comes out normalised (`embshard.plan.normalize`: a table's pieces on one device
merged) and is costed as normalised. The search keeps its `top_k` best distinct plans.

**Guard** (`verify=K`, with a hardware evaluator attached): the K best plans of the search and
the plans of the `verify_heuristics` are measured on the hardware, interleaved, and the
measured best is returned; the search's own pick stays available (`last_search_pick`) so the
model's quality stays visible. The measuring time counts in the search time.

Scaling: the greedy is O(pieces × devices) predictions per cap, made in one batched call per
placement. The beam multiplies that by up to beam_steps × beam_width × 3·candidates, so it
only runs when pieces × devices ≤ `beam_max_work` (default 8192, e.g. 60 tables × 128
devices or 856 × 8); bigger tasks get the table-wise grid plus memory-forced splits.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from embshard.costs.base import DeviceCosts
from embshard.costs.features import planning_view
from embshard.errors import InfeasibleError, InputError
from embshard.search.base import Capabilities
from embshard.plan import MemoryLedger, Plan, Shard, even_row_layout, normalize, piece_table, validate
from embshard.search.simulator import AnalyticPredictor, ShardPredictor, Simulator, batch_ratio, scale_costs
from embshard.tables import DIM_ALIGNMENT, Table
from embshard.task import Task

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CAPS: tuple[float, ...] = tuple(round(1.0 + 0.05 * i, 2) for i in range(11))
INCREMENTAL_MIN_DEVICES = 16
BUILD_COMMAND = "python train.py stage=pretrain"
#: the shipped cost models (relative to the project root): what NeuroShardSharder() searches against
DEFAULT_CHECKPOINT = "checkpoints/cpu_fbgemm/cost_models.pt"
FREE = -1  # a piece the greedy places (all rows); >= 0: a row block fixed on that device

#: A piece spec: (table name, col_offset, dim, device of a row block or FREE, number of row
#: blocks of its table or 0); a search state is a sorted tuple of them.
PieceSpec = tuple[str, int, int, int, int]


@dataclass
class _Piece:
    spec: PieceSpec
    table: Table      # the task's table
    ptable: Table     # the piece as the predictor sees it (its rows, dim, lookups share)
    pid: int          # simulator id of ptable
    need: int         # memory bytes on a device
    shard: Shard      # where it lives when fixed (device ignored for free pieces)
    single_ms: float = 0.0
    enc: np.ndarray | None = None  # the predictor's table encoding (incremental mode)

    @property
    def dim(self) -> int:
        return self.spec[2]

    @property
    def fixed(self) -> int:
        return self.spec[3]


@dataclass
class GreedyResult:
    """The best table-wise plan of one piece set."""

    cost_ms: float
    devices: list[int]          # device of each piece, in `pieces` order
    pieces: list[_Piece]
    costs: DeviceCosts
    cap: float


@dataclass
class Candidate:
    """One distinct plan the search found, with its predicted cost."""

    cost_ms: float
    state: tuple[PieceSpec, ...]
    devices: list[int]
    cap: float


def supports_incremental(predictor: object) -> bool:
    """Whether a predictor's shard cost is `head_ms(reduce(table_encodings))` with an
    additive reduction, so the greedy can keep running per-device reductions."""
    return (
        callable(getattr(predictor, "table_encodings", None))
        and callable(getattr(predictor, "head_ms", None))
        and getattr(predictor, "reduction", None) in ("sum", "sum_max")
    )


def halvable(dim: int) -> bool:
    return dim % (2 * DIM_ALIGNMENT) == 0


def halve(state: tuple[PieceSpec, ...], spec: PieceSpec) -> tuple[PieceSpec, ...]:
    name, off, dim, dev, parts = spec
    if dev != FREE:
        raise ValueError(f"a row block cannot be halved: {spec}")
    half = dim // 2
    rest = list(state)
    rest.remove(spec)
    rest += [(name, off, half, FREE, 0), (name, off + half, half, FREE, 0)]
    return tuple(sorted(rest))


def row_split(state: tuple[PieceSpec, ...], spec: PieceSpec, group: Sequence[int]) -> tuple[PieceSpec, ...]:
    """`state` with the whole table `spec` split by rows over the devices of `group`."""
    name, off, dim, dev, _ = spec
    if dev != FREE or off != 0:
        raise ValueError(f"only a whole table can be split by rows: {spec}")
    rest = list(state)
    rest.remove(spec)
    rest += [(name, 0, dim, d, len(group)) for d in group]
    return tuple(sorted(rest))


class LookAhead:
    """Keeps the pieces still to be placed packable while a greedy places them in order.

    It carries a proof: an assignment of every pending piece to a device that fits in the
    devices' free memory (found by first-fit decreasing, like `MemoryLedger`'s look-ahead).
    Placing a piece on a device whose slack under that assignment has room keeps the proof
    valid in O(1); otherwise the pending pieces are repacked by first-fit decreasing for the
    most preferred device, then tried on the others in order (as `MemoryLedger.place`
    does). When nothing packs, the most preferred device with room is taken.

    Args:
        free: free bytes per device before the first placement.
        needs: bytes of every piece, in placement order.
    """

    def __init__(self, free: np.ndarray, needs: Sequence[int]):
        self.needs = np.asarray(needs, dtype=np.int64)
        self._needs_list = [int(x) for x in needs]
        self._desc = np.argsort(-self.needs, kind="stable")
        self.assign = np.full(len(self.needs), -1, dtype=np.int64)
        self.slack = np.asarray(free, dtype=np.int64).copy()
        self.valid = self._repack(np.asarray(free, dtype=np.int64), 0)
        self.repacks = 0

    def _repack(self, free: np.ndarray, start: int) -> bool:
        """First-fit decreasing of pieces start.. into `free`; adopt it when it fits."""
        assign = self.assign.copy()
        todo = self._desc[self._desc >= start].tolist()
        if len(free) <= 32:  # a plain scan beats numpy on a few devices
            fl = [int(x) for x in free]
            needs = self._needs_list
            for k in todo:
                need = needs[k]
                for j, room in enumerate(fl):
                    if room >= need:
                        fl[j] = room - need
                        assign[k] = j
                        break
                else:
                    return False
            self.assign, self.slack = assign, np.array(fl, dtype=np.int64)
            return True
        f = free.copy()
        for k in todo:
            need = self.needs[k]
            j = int(np.argmax(f >= need))
            if f[j] < need:
                return False
            f[j] -= need
            assign[k] = j
        self.assign, self.slack = assign, f
        return True

    def choose(self, i: int, free: np.ndarray, preference: Sequence[int]) -> int:
        """The device for piece `i` (first of `preference` with room that keeps the rest
        packable); updates the proof. The caller then takes the memory."""
        need = int(self.needs[i])
        room = [d for d in preference if free[d] >= need]
        if not room:
            raise ValueError("choose() needs a preferred device with room")
        if self.valid:
            self.slack[self.assign[i]] += need  # piece i is no longer pending
            first = room[0]
            if self.slack[first] >= need:
                self.slack[first] -= need
                return first
            self.repacks += 1
            if self._repack_after(free, first, need, i):
                return first
            for d in room[1:]:
                if self.slack[d] >= need:
                    self.slack[d] -= need
                    return d
            rest = room[1:]
        else:
            rest = room
        for d in rest:
            self.repacks += 1
            if self._repack_after(free, d, need, i):
                self.valid = True
                return d
        self.valid = False
        return room[0]

    def _repack_after(self, free: np.ndarray, device: int, need: int, i: int) -> bool:
        f = free.copy()
        f[device] -= need
        return self._repack(f, i + 1)



class _KeyedDevices:
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

    def costs(self, cand: np.ndarray, p: _Piece) -> np.ndarray:
        key_with, keys, shards = self.sim.key_with, self.keys, self.shards
        cl = cand.tolist()
        self._ckeys = [key_with(keys[k], p.pid) for k in cl]
        self._c = self.sim.shard_costs(self._ckeys, lambda j: shards[cl[j]] + [p.ptable])
        return self._c

    def add(self, dev: int, p: _Piece, j: int) -> None:
        self.shards[dev].append(p.ptable)
        if j >= 0:
            self.keys[dev] = self._ckeys[j]
            self.cost[dev] = self._c[j]
        else:
            self.keys[dev] = self.sim.key_with(self.keys[dev], p.pid)
            self.cost[dev] = self.sim.shard_costs([self.keys[dev]], lambda _: self.shards[dev])[0]


class _PooledDevices:
    """Per-device running reductions of piece encodings, for predictors whose shard cost is
    `head_ms(reduce(table_encodings))` with an additive reduction (sum, or sum ‖ max): a
    candidate costs one row of one batched head call, with no re-encoding."""

    def __init__(self, sim: Simulator, d: int, enc_dim: int):
        self.head = sim.predictor.head_ms
        self.with_max = getattr(sim.predictor, "reduction", "sum") == "sum_max"
        self.sum = np.zeros((d, enc_dim), dtype=np.float64)
        self.max = np.full((d, enc_dim), -np.inf) if self.with_max else None
        self.cost = np.zeros(d)
        self.stats = sim.stats
        self._c = np.zeros(0)

    def _pooled(self, rows: np.ndarray | int, enc: np.ndarray) -> np.ndarray:
        pooled = self.sum[rows] + enc
        if self.with_max:
            pooled = np.concatenate([pooled, np.maximum(self.max[rows], enc)], axis=-1)
        return pooled

    def costs(self, cand: np.ndarray, p: _Piece) -> np.ndarray:
        self._c = np.asarray(self.head(self._pooled(cand, p.enc)), dtype=np.float64)
        self.stats.head_calls += 1
        self.stats.head_rows += len(cand)
        return self._c

    def add(self, dev: int, p: _Piece, j: int) -> None:
        if j >= 0:
            self.cost[dev] = self._c[j]
        else:
            self.cost[dev] = float(self.head(self._pooled(np.array([dev]), p.enc))[0])
        self.sum[dev] += p.enc
        if self.with_max:
            np.maximum(self.max[dev], p.enc, out=self.max[dev])



class NeuroShardSearch:
    """The search for one task against one simulator (see the module docstring).

    `task` is the planning view (every table with a reuse histogram, imputed where missing;
    `embshard.costs.features.planning_view`); plans name the same tables."""

    def __init__(
        self,
        task: Task,
        simulator: Simulator,
        caps: Sequence[float] = DEFAULT_CAPS,
        beam_width: int = 3,
        beam_steps: int = 10,
        candidates: int = 10,
        column_wise: bool = True,
        row_wise: bool = True,
        beam_max_work: int | None = 8192,
        incremental: bool | str = "auto",
        top_k: int = 1,
    ):
        if not caps:
            raise InputError("neuroshard: caps must not be empty")
        self.task = task
        self.sim = simulator
        self.caps = tuple(float(c) for c in caps)
        self.beam_width = int(beam_width)
        self.beam_steps = int(beam_steps)
        self.candidates = int(candidates)
        self.column_wise = bool(column_wise)
        self.row_wise = bool(row_wise)
        self.beam_max_work = beam_max_work
        self.top_k = max(1, int(top_k))
        self._tables = task.table_by_name
        self._pieces: dict[PieceSpec, _Piece] = {}
        self._scores: dict[tuple, GreedyResult | InfeasibleError] = {}
        self._top: list[tuple[float, tuple, Candidate]] = []  # (cost, signature, candidate), sorted
        self.greedy_runs = 0
        self.beam_ran = False
        d, per_host = task.num_devices, task.devices_per_host or task.num_devices
        self.row_groups: list[tuple[int, ...]] = (
            [tuple(range(d))] if per_host >= d else
            [tuple(range(h, min(h + per_host, d))) for h in range(0, d, per_host)])
        if incremental == "auto":  # few devices: the shard cache hits more than running sums save
            incremental = task.num_devices >= INCREMENTAL_MIN_DEVICES
        self.incremental = bool(incremental) and supports_incremental(simulator.predictor)
        self._enc_dim = 0
        if self.incremental:
            probe = np.asarray(simulator.predictor.table_encodings([task.tables[0]]))
            self._enc_dim = int(probe.shape[1])

    # ------------------------------------------------------------------ pieces
    def pieces_of(self, state: Sequence[PieceSpec]) -> list[_Piece]:
        """The pieces of a state; new ones are predicted alone (and encoded, in
        incremental mode) in one batched call each."""
        new = [spec for spec in dict.fromkeys(state) if spec not in self._pieces]
        if new:
            made = [self._make_piece(spec) for spec in new]
            single = self.sim.shard_costs([(p.pid,) for p in made], lambda i: [made[i].ptable])
            encs = self.sim.predictor.table_encodings([p.ptable for p in made]) if self.incremental else None
            for i, p in enumerate(made):
                p.single_ms = float(single[i])
                if encs is not None:
                    p.enc = np.asarray(encs[i], dtype=np.float64)
                self._pieces[p.spec] = p
        return [self._pieces[spec] for spec in state]

    def _make_piece(self, spec: PieceSpec) -> _Piece:
        name, off, dim, dev, parts = spec
        t = self._tables[name]
        if dev == FREE:
            shard = Shard(name, 0, off, dim, 0, t.rows)
        else:
            row_off, rows = even_row_layout(t.rows, parts)[dev % parts]
            shard = Shard(name, dev, off, dim, row_off, rows)
        pt = piece_table(t, shard)
        need = self.task.shard_memory_bytes(t, shard.rows, dim)
        return _Piece(spec, t, pt, self.sim.piece_id(pt), need, shard)

    # ------------------------------------------------------------------ table-wise
    def greedy(self, state: tuple[PieceSpec, ...], caps: tuple[float, ...] | None = None) -> GreedyResult:
        """Best plan over `caps` (default: all) for a piece set (cached); raises InfeasibleError."""
        caps = self.caps if caps is None else caps
        key = (state, caps)
        got = self._scores.get(key)
        if got is None:
            try:
                got = self._greedy(state, caps)
            except InfeasibleError as e:
                got = e
            self._scores[key] = got
        if isinstance(got, InfeasibleError):
            raise got
        return got

    def _greedy(self, state: tuple[PieceSpec, ...], caps: tuple[float, ...]) -> GreedyResult:
        self.greedy_runs += 1
        pieces = self.pieces_of(state)
        fixed = [i for i, p in enumerate(pieces) if p.fixed != FREE]
        free = [i for i, p in enumerate(pieces) if p.fixed == FREE]
        order = sorted(free, key=lambda i: (-pieces[i].single_ms, -pieces[i].need, pieces[i].spec))
        ordered = [pieces[i] for i in order]
        total_width = sum(p.dim for p in pieces)
        d = self.task.num_devices
        runs: list[tuple[float, list[int], np.ndarray, np.ndarray]] = []
        first_error: InfeasibleError | None = None
        for cap in sorted(caps):
            try:
                devices, compute, widths, bound = self._place([pieces[i] for i in fixed], ordered, cap * total_width / d)
            except InfeasibleError as e:
                first_error = first_error or e
                continue
            runs.append((cap, devices, compute, widths))
            if not bound:  # the cap never changed a decision: every larger cap places the same
                break
        if not runs:
            assert first_error is not None
            raise first_error
        compute = np.stack([r[2] for r in runs])
        widths = np.stack([r[3] for r in runs])
        fw, bw = self.sim.comm(widths, compute)
        totals = (compute + fw + bw).max(axis=1)
        per_run = []
        for r, (cap, placed, _, _) in enumerate(runs):
            devices = [0] * len(pieces)
            for i in fixed:
                devices[i] = pieces[i].fixed
            for i, dev in zip(order, placed):
                devices[i] = dev
            per_run.append(devices)
            self._consider(float(totals[r]), state, pieces, devices, cap)
        best = int(np.argmin(totals))  # first (smallest) cap among equals
        costs = DeviceCosts(compute_ms=compute[best].tolist(), forward_comm_ms=fw[best].tolist(),
                            backward_comm_ms=bw[best].tolist())
        return GreedyResult(float(totals[best]), per_run[best], pieces, costs, runs[best][0])

    def _consider(self, cost: float, state, pieces: list[_Piece], devices: list[int], cap: float) -> None:
        """Keep the `top_k` cheapest distinct plans (distinct after merging a table's pieces
        on one device)."""
        if len(self._top) >= self.top_k and cost >= self._top[-1][0]:
            return
        width: dict[tuple[str, int, bool], int] = {}
        for p, dev in zip(pieces, devices):
            key = (p.spec[0], dev, p.fixed != FREE)
            width[key] = width.get(key, 0) + p.dim
        sig = tuple(sorted(width.items()))
        for i, (c, s, _) in enumerate(self._top):
            if s == sig:
                if cost < c:
                    del self._top[i]
                    break
                return
        self._top.append((cost, sig, Candidate(cost, state, list(devices), cap)))
        self._top.sort(key=lambda x: x[0])
        del self._top[self.top_k:]

    def _place(self, fixed: list[_Piece], ordered: list[_Piece],
               cap_width: float) -> tuple[list[int], np.ndarray, np.ndarray, bool]:
        """One greedy run under a width cap: (device per piece of `ordered`, compute per
        device, width per device, whether the cap ever excluded a device with room)."""
        task = self.task
        d = task.num_devices
        ledger = MemoryLedger(task)
        free = np.full(d, task.device_memory_bytes, dtype=np.int64)
        widths = np.zeros(d, dtype=np.int64)
        devs = _PooledDevices(self.sim, d, self._enc_dim) if self.incremental else _KeyedDevices(self.sim, d)
        for p in fixed:  # row blocks: their device is part of the state
            if free[p.fixed] < p.need:
                raise ledger.nowhere(p.table, p.need)
            ledger.take(p.fixed, p.need)
            free[p.fixed] -= p.need
            widths[p.fixed] += p.dim
            devs.add(p.fixed, p, -1)
        ahead = LookAhead(free, [p.need for p in ordered])
        names = [p.table.name for p in ordered]
        split = {n for n in names if names.count(n) > 1}
        holds: dict[str, np.ndarray] = {n: np.zeros(d, dtype=bool) for n in split}
        placed: list[int] = []
        bound = False
        for i, p in enumerate(ordered):
            room = free >= p.need
            if not room.any():
                raise ledger.nowhere(p.table, p.need)
            held = holds.get(p.table.name)
            if held is not None and (room & ~held).any():  # never two pieces of a table on a device when avoidable
                room &= ~held
            ok = room & (widths + p.dim <= cap_width)
            capped = bool(ok.any())
            if capped:
                bound = bound or bool((ok != room).any())
                cand = ok.nonzero()[0]
            else:
                bound = True
                cand = room.nonzero()[0]
            c = devs.costs(cand, p)
            preference = cand[np.lexsort((cand, -free[cand], c))].tolist()
            if capped:  # over the width cap, but usable when the look-ahead needs them
                rest = (room & ~ok).nonzero()[0]
                preference += rest[np.argsort(-free[rest], kind="stable")].tolist()
            dev = ahead.choose(i, free, preference)
            ledger.take(dev, p.need)
            free[dev] -= p.need
            widths[dev] += p.dim
            if held is not None:
                held[dev] = True
            hit = (cand == dev).nonzero()[0]
            devs.add(dev, p, int(hit[0]) if hit.size else -1)
            placed.append(dev)
        return placed, devs.cost, widths, bound

    # ------------------------------------------------------------------ splits
    def may_halve(self, spec: PieceSpec) -> bool:
        """Whether a free piece may be halved: its table allows column splits (its
        `sharding_types`) and both halves stay at least its `min_partition` wide."""
        t = self._tables[spec[0]]
        if spec[3] != FREE or not halvable(spec[2]) or spec[2] // 2 < t.narrowest_column_piece():
            return False
        single_host = len(self.row_groups) == 1
        return t.allows("column_wise") or (single_host and t.allows("table_column_wise"))

    def row_groups_for(self, table: Table) -> list[tuple[int, ...]]:
        """The device groups a table may be split by rows over, as its `sharding_types` allow:
        one host's devices (table_row_wise; with one host, the same as row_wise), or, for a
        table allowed row_wise but not table_row_wise on several hosts, all devices."""
        if not self.row_wise:
            return []
        if len(self.row_groups) == 1:
            ok = table.allows("row_wise") or table.allows("table_row_wise")
            return list(self.row_groups) if ok else []
        if table.allows("table_row_wise"):
            return list(self.row_groups)
        return [tuple(range(self.task.num_devices))] if table.allows("row_wise") else []

    def initial_state(self) -> tuple[PieceSpec, ...]:
        return tuple(sorted((t.name, 0, t.dim, FREE, 0) for t in self.task.tables))

    def rescue(self, state: tuple[PieceSpec, ...]) -> tuple[tuple[PieceSpec, ...], GreedyResult]:
        """The greedy on `state`; while a table does not fit, halve its largest piece, and
        when no piece of it can be halved any more, split it by rows over a device group
        (TorchRec row-wise or table-row-wise). Re-raises the InfeasibleError when nothing
        fits."""
        while True:
            try:
                return state, self.greedy(state)
            except InfeasibleError as e:
                options = [s for s in state if s[0] == e.table and self.may_halve(s)]
                if options:
                    largest = max(options, key=lambda s: (s[2], -s[1]))
                    log.debug("neuroshard: %s does not fit whole; halving piece %s", e.table, largest)
                    state = halve(state, largest)
                    continue
                t = self._tables[e.table]
                if not self.row_groups_for(t) or any(s[0] == e.table and s[3] != FREE for s in state):
                    raise
                whole = tuple(sorted([s for s in state if s[0] != e.table] + [(t.name, 0, t.dim, FREE, 0)]))
                for group in sorted(self.row_groups_for(t), key=len, reverse=True):
                    try:
                        nxt = row_split(whole, (t.name, 0, t.dim, FREE, 0), group)
                        log.debug("neuroshard: %s does not fit in column pieces; splitting it by rows over %s",
                                  e.table, group)
                        return self.rescue(nxt)
                    except InfeasibleError as again:
                        if again.table != e.table:
                            raise
                raise

    def beam_allowed(self, state: tuple[PieceSpec, ...]) -> bool:
        if not (self.column_wise or self.row_wise) or self.beam_steps <= 0 or self.beam_width <= 0 or self.candidates <= 0:
            return False
        return self.beam_max_work is None or len(state) * self.task.num_devices <= self.beam_max_work

    def moves(self, state: tuple[PieceSpec, ...]) -> list[tuple[PieceSpec, ...]]:
        """The states one split away that the beam scores (see the module docstring)."""
        pieces = [p for p in self.pieces_of(state) if p.fixed == FREE]
        out: dict[tuple[PieceSpec, ...], None] = {}
        if self.column_wise:
            halv = [p for p in pieces if self.may_halve(p.spec)]
            by_size = sorted(halv, key=lambda p: (-p.need, p.spec))[: self.candidates]
            by_cost = sorted(halv, key=lambda p: (-p.single_ms, p.spec))[: self.candidates]
            for p in by_size + by_cost:
                out[halve(state, p.spec)] = None
        if self.row_wise and self.task.num_devices > 1:
            split = {p.spec[0] for p in pieces if p.dim != p.table.dim}
            whole = [p for p in pieces if p.spec[0] not in split and p.table.rows >= len(self.row_groups[0])]
            for p in sorted(whole, key=lambda p: (-p.single_ms, p.spec))[: self.candidates]:
                for group in self.row_groups_for(p.table):
                    out[row_split(state, p.spec, group)] = None
        return list(out)

    def run(self) -> tuple[tuple[PieceSpec, ...], GreedyResult]:
        """Greedy grid on the unsplit tables, then the beam: every move is screened by one
        greedy run at its parent's best cap, and the `beam_width` best are scored over the
        full grid of caps (and become the next beam)."""
        state, best = self.rescue(self.initial_state())
        best_state = state
        if not self.beam_allowed(state):
            return best_state, best
        self.beam_ran = True
        beam = [(best.cost_ms, state, best.cap)]
        seen = {state}
        for _ in range(self.beam_steps):
            screened: list[tuple[float, tuple[PieceSpec, ...]]] = []
            for _, st, cap in beam:
                for nxt in self.moves(st):
                    if nxt in seen:
                        continue
                    seen.add(nxt)
                    try:
                        screened.append((self.greedy(nxt, (cap,)).cost_ms, nxt))
                    except InfeasibleError:
                        continue
            if not screened:
                break
            screened.sort(key=lambda x: (x[0], len(x[1]), x[1]))
            scored = []
            for _, st in screened[: self.beam_width]:
                r = self.greedy(st)
                scored.append((r.cost_ms, st, r))
            scored.sort(key=lambda x: (x[0], len(x[1]), x[1]))
            beam = [(c, st, r.cap) for c, st, r in scored]
            if scored[0][0] < best.cost_ms:
                best, best_state = scored[0][2], scored[0][1]
        return best_state, best

    def candidate_plans(self, name: str) -> list[tuple[Plan, float]]:
        """The `top_k` distinct plans found (normalised), cheapest predicted first, with the
        predicted cost the search saw. Call after `run`."""
        out = []
        for _, _, c in self._top:
            pieces = self.pieces_of(c.state)
            shards = [Shard(p.table.name, dev, p.spec[1], p.dim, p.shard.row_offset, p.shard.rows)
                      for p, dev in sorted(zip(pieces, c.devices), key=lambda x: x[0].spec)]
            out.append((normalize(self.task, Plan(self.task.name, name, shards)), c.cost_ms))
        return out

    def plan(self, name: str) -> tuple[Plan, GreedyResult]:
        """The best plan (normalised) and the greedy result it came from."""
        _, best = self.run()
        return self.candidate_plans(name)[0][0], best


# ----------------------------------------------------------------------------- sharder
def resolve_path(path: str | os.PathLike) -> Path:
    """Relative inputs resolve against the project root, not the working directory."""
    p = Path(os.path.expanduser(str(path)))
    return p if p.is_absolute() else ROOT / p


@dataclass
class GuardResult:
    """What the measured guard did for one task (report.json: `guard`)."""

    candidates: list[dict[str, Any]]   # label, source, predicted_ms, measured_ms, spread_ms (round 1)
    chosen: str
    search_pick: str
    measure_seconds: float
    #: the rule's outcome: verdict ("better" | "worse" | "not resolved" | "same plan" | "no
    #: heuristic plan"), the plan kept, and the ratio's bootstrap interval over rounds
    decision: dict[str, Any] = field(default_factory=dict)
    #: measured plan cost (ms) per round, by label
    rounds: list[dict[str, float]] = field(default_factory=list)
    changed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.changed = self.chosen != self.search_pick

    def to_dict(self) -> dict[str, Any]:
        return {"candidates": self.candidates, "chosen": self.chosen, "search_pick": self.search_pick,
                "changed": self.changed, "measure_seconds": self.measure_seconds, "decision": self.decision,
                "rounds": self.rounds}


def heuristic_sharders() -> dict[str, Any]:
    """The heuristics the guard can measure against, by their conf/search names: every greedy
    baseline, round-robin and random (seed 0, as `search=random`)."""
    from embshard.search.baselines import COST_KEYS, GreedySharder, RandomSharder, RoundRobinSharder

    out: dict[str, Any] = {f"{k}_greedy": (lambda k=k: GreedySharder(k)) for k in COST_KEYS}
    out["round_robin"] = RoundRobinSharder
    out["random"] = lambda: RandomSharder(seed=0)
    return out


class NeuroShardSharder:
    """NeuroShard (`search=neuroshard`): greedy grid + split beam against cost models.

    Args:
        checkpoint: the pre-trained cost models (`NeuralCostModels.load`); relative paths
            resolve against the project root. Default: the shipped ones (DEFAULT_CHECKPOINT).
            A checkpoint that is missing or cannot be loaded is an InputError when the search
            runs (shard.py: that algorithm's row is INVALID), never a quiet change of model.
            None: search against the analytic stand-in instead, on purpose; either way
            `last_search_info` (report.json: `search_info`) names the model searched against.
        beam_width, beam_steps, candidates: the beam search over splits.
        caps: balance caps on per-device embedding width (× the even share).
        column_wise: column halvings in the beam (memory-forced splits happen regardless).
        row_wise: row splits (TorchRec row-wise, or table-row-wise per host) in the beam.
        beam_max_work: run the beam only when pieces × devices ≤ this (None: always).
        predictor: a ShardPredictor to use directly (tests, notebooks); overrides checkpoint.
        delay_round_ms: rounding of compute delays in the comm cache key.
        incremental: when the predictor exposes `table_encodings`/`head_ms` with an
            additive reduction (the neural bundle, the analytic adapter), keep running
            per-device reductions instead of re-predicting whole shards (same costs, far
            fewer operations); False: always go through `compute_ms` and the cache; "auto":
            incremental from INCREMENTAL_MIN_DEVICES devices up.
        verify: the measured guard: measure this many of the search's best plans, plus the
            `verify_heuristics`' plans, on the attached evaluator and return the measured
            best. "auto": 3 when an evaluator is attached (shard.py attaches one with
            evaluate=measured), else off. 0: off.
        verify_heuristics: baselines (conf/search names: size_greedy, dim_greedy, lookup_greedy,
            size_lookup_greedy, round_robin, random with seed 0) whose plans the guard measures
            too: by default all six, the set "the best heuristic" of an evaluation is taken from.
        verify_visits: interleaved visits per measuring round of the guard (None: the
            evaluator's protocol's).
        verify_budget_s: after round 1 (every candidate once), the guard keeps measuring (rounds
            of the search's best and the best heuristic, paired and interleaved) until the
            bootstrap 95% interval of their mean cost ratio excludes 1, or this many seconds
            have passed.
        verify_min_rounds, verify_max_rounds: rounds before a decision / at most.
    """

    #: cost models of pooled kernels; splits columns and rows
    capabilities = Capabilities(("pooled",), splits_tables=True)

    def __init__(
        self,
        checkpoint: str | os.PathLike | None = DEFAULT_CHECKPOINT,
        beam_width: int = 3,
        beam_steps: int = 10,
        candidates: int = 10,
        caps: Sequence[float] = DEFAULT_CAPS,
        column_wise: bool = True,
        row_wise: bool = True,
        beam_max_work: int | None = 8192,
        name: str = "neuroshard",
        predictor: ShardPredictor | None = None,
        delay_round_ms: float = 0.01,
        incremental: bool | str = "auto",
        verify: int | str = "auto",
        verify_heuristics: Sequence[str] = ("size_lookup_greedy", "lookup_greedy", "dim_greedy", "size_greedy",
                                            "round_robin", "random"),
        verify_visits: int | None = None,
        verify_budget_s: float = 60.0,
        verify_min_rounds: int = 3,
        verify_max_rounds: int = 10,
    ):
        for k, v in (("beam_width", beam_width), ("beam_steps", beam_steps), ("candidates", candidates)):
            if int(v) < 0:
                raise InputError(f"neuroshard: {k} must be >= 0, got {v!r}")
        caps = tuple(float(c) for c in caps)
        if not caps or any(not np.isfinite(c) or c <= 0 for c in caps):
            raise InputError(f"neuroshard: caps must be positive numbers, got {list(caps)}")
        if verify != "auto" and (isinstance(verify, bool) or not isinstance(verify, int) or verify < 0):
            raise InputError(f"neuroshard: verify must be 'auto' or an integer >= 0, got {verify!r}")
        keys = heuristic_sharders()
        unknown = [h for h in verify_heuristics if h not in keys]
        if unknown:
            raise InputError(f"neuroshard: unknown verify_heuristics {unknown}; choose from {sorted(keys)}")
        if verify_visits is not None and int(verify_visits) < 1:
            raise InputError(f"neuroshard: verify_visits must be >= 1 or null, got {verify_visits!r}")
        if not float(verify_budget_s) >= 0:
            raise InputError(f"neuroshard: verify_budget_s must be >= 0, got {verify_budget_s!r}")
        if not 2 <= int(verify_min_rounds) <= int(verify_max_rounds):
            raise InputError(f"neuroshard: need 2 <= verify_min_rounds <= verify_max_rounds, got "
                             f"{verify_min_rounds!r}, {verify_max_rounds!r}")
        self.checkpoint = None if checkpoint in (None, "") else str(checkpoint)
        self.beam_width = int(beam_width)
        self.beam_steps = int(beam_steps)
        self.candidates = int(candidates)
        self.caps = caps
        self.column_wise = bool(column_wise)
        self.row_wise = bool(row_wise)
        self.beam_max_work = None if beam_max_work is None else int(beam_max_work)
        self.name = name
        self.delay_round_ms = float(delay_round_ms)
        if incremental not in (True, False, "auto"):
            raise InputError(f"neuroshard: incremental must be true, false or auto, got {incremental!r}")
        self.incremental = incremental
        self.verify = verify
        self.verify_heuristics = tuple(verify_heuristics)
        self._heuristic_keys = keys
        self.verify_visits = None if verify_visits is None else int(verify_visits)
        self.verify_budget_s = float(verify_budget_s)
        self.verify_min_rounds = int(verify_min_rounds)
        self.verify_max_rounds = int(verify_max_rounds)
        self.evaluator: Any = None
        self._predictor = predictor
        self._loaded = predictor is not None
        #: the model searched against, once known (report.json: search_info)
        self._model_info: dict[str, Any] = (
            {"cost_model": type(predictor).__name__, "checkpoint": None} if predictor is not None else {}
        )
        self._simulators: dict[int, Simulator] = {}
        self.last_search_seconds: float | None = None
        self.last_predicted_cost_ms: float | None = None
        self.last_costs: DeviceCosts | None = None
        self.last_stats: dict[str, object] = {}
        self.last_guard: GuardResult | None = None
        self.last_search_pick: Plan | None = None
        self.last_search_info: dict[str, Any] = {}

    # ------------------------------------------------------------------ predictor
    def load_predictor(self) -> ShardPredictor | None:
        """The neural models from the checkpoint (once), or None for the analytic stand-in
        (checkpoint=None). Raises InputError when the checkpoint is missing or cannot be loaded."""
        if self._loaded:
            return self._predictor
        if self.checkpoint is None:
            log.info("%s: checkpoint=None: searching against the analytic cost model", self.name)
            self._loaded = True
            self._model_info = {"cost_model": "analytic", "checkpoint": None}
            return None
        path = resolve_path(self.checkpoint)
        if not path.is_file():
            raise InputError(f"{self.name}: cost-model checkpoint {path} not found; build it with `{BUILD_COMMAND}`, "
                             "or set checkpoint=null to search against the analytic cost model")
        from embshard.costs.neural import NeuralCostModels

        try:
            self._predictor = NeuralCostModels.load(path)
        except InputError as e:
            raise InputError(f"{self.name}: {str(e).splitlines()[0]}") from None
        self._loaded = True
        self._model_info = {"cost_model": "neural", "checkpoint": str(path), "rescale": self._predictor.rescale}
        return self._predictor

    def simulator_for(self, task: Task) -> Simulator:
        """The cached simulator at the task's batch size (neural models bind one per batch)."""
        predictor = self.load_predictor()
        b = int(task.batch_size)
        if b not in self._simulators:
            if predictor is None:
                p: ShardPredictor = AnalyticPredictor(batch_size=b)
            elif callable(getattr(predictor, "at_batch", None)):
                p = predictor.at_batch(b)
            else:
                p = predictor
            self._simulators[b] = Simulator(p, self.delay_round_ms)
        return self._simulators[b]

    def attach_evaluator(self, evaluator: Any) -> None:
        """The hardware the guard measures on (`HardwareEvaluator`); None detaches it."""
        self.evaluator = evaluator

    @property
    def verify_count(self) -> int:
        if self.verify == "auto":
            return 3 if self.evaluator is not None else 0
        return int(self.verify)

    # ------------------------------------------------------------------ Sharder
    def search(self, task: Task) -> NeuroShardSearch:
        view, _ = planning_view(task)
        return NeuroShardSearch(
            view, self.simulator_for(task), caps=self.caps, beam_width=self.beam_width,
            beam_steps=self.beam_steps, candidates=self.candidates, column_wise=self.column_wise,
            row_wise=self.row_wise, beam_max_work=self.beam_max_work, incremental=self.incremental,
            top_k=max(1, self.verify_count),
        )

    def predicted_costs(self, task: Task, plan: Plan) -> DeviceCosts:
        """The costs the search's models predict for any plan of `task` (at its batch)."""
        from embshard.plan import device_pieces

        sim = self.simulator_for(task)
        view, _ = planning_view(task)
        return scale_costs(sim.device_costs(device_pieces(view, plan)), batch_ratio(sim.predictor, task))

    def shard(self, task: Task) -> Plan:
        start = time.perf_counter()
        search = self.search(task)
        search.run()
        found = search.candidate_plans(self.name)
        for plan, _ in found:
            validate(task, plan)
        plan = found[0][0]
        self.last_search_pick = plan
        self.last_guard = None
        k = self.verify_count
        if k > 0:
            if self.evaluator is None:
                raise InputError("neuroshard: verify > 0 needs a hardware evaluator (shard.py evaluate=measured attaches "
                                 "one; or set searchers.neuroshard.verify=0)")
            plan = self._guard(task, found[:k], start)
        self.last_search_seconds = time.perf_counter() - start
        # beam false: the task was over beam_max_work (table-wise grid and memory-forced splits only)
        self.last_search_info = {**self._model_info, "beam": search.beam_ran}
        self.last_costs = self.predicted_costs(task, plan)
        self.last_predicted_cost_ms = self.last_costs.plan_cost_ms
        self.last_stats = {
            "greedy_runs": search.greedy_runs,
            "incremental": search.incremental,
            "beam": search.beam_ran,
            "pieces": len(plan.shards),
            "row_wise_tables": len({s.table for s in plan.shards if s.rows < task.table_by_name[s.table].rows}),
            **vars(search.sim.stats),
        }
        log.debug("neuroshard %s: %.1f ms predicted, %s", task.name, self.last_predicted_cost_ms, self.last_stats)
        return plan

    def _guard(self, task: Task, found: list[tuple[Plan, float]], start: float) -> Plan:
        """Measure the search's best plans and the heuristics' plans; return the search's
        measured best only where it is shown better than the best heuristic's plan.

        Round 1 measures every distinct candidate, interleaved, and names the search's best
        (S) and the best heuristic (H). Later rounds measure S and H only, paired and
        interleaved, until the bootstrap 95% interval of the mean per-round ratio S/H excludes
        1 (at least `verify_min_rounds` rounds), the rounds reach `verify_max_rounds`, or the
        time passes `verify_budget_s`. S is returned when the interval lies below 1; otherwise
        (worse, or not resolved) H's plan is: the guard never trades a known plan for a coin
        toss."""
        from embshard.errors import EmbshardError
        from embshard.stats import paired_ratio_summary

        labelled: list[tuple[str, str, Plan]] = [(f"{self.name}#{i + 1}", "search", p) for i, (p, _) in enumerate(found)]
        for h in self.verify_heuristics:
            try:
                hp = self._heuristic_keys[h]().shard(task)
                validate(task, hp)
            except EmbshardError as e:
                log.debug("neuroshard guard: %s has no valid plan for %s (%s)", h, task.name, e)
                continue
            labelled.append((h, "heuristic", hp))
        unique: dict[tuple, int] = {}
        for i, (_, _, p) in enumerate(labelled):
            unique.setdefault(p.signature(), i)
        first = sorted(set(unique.values()))
        t0 = time.perf_counter()
        costs = self.evaluator.measure_many(task, [labelled[i][2] for i in first], visits=self.verify_visits)
        deadline = time.perf_counter() + self.verify_budget_s  # for the paired rounds, after round 1
        measured = {i: c for i, c in zip(first, costs)}
        rows = []
        for i, (label, source, p) in enumerate(labelled):
            c = measured[unique[p.signature()]]
            rows.append({"label": label, "source": source, "same_as": labelled[unique[p.signature()]][0],
                         "predicted_ms": self.predicted_costs(task, p).plan_cost_ms,
                         "measured_ms": c.plan_cost_ms, "spread_ms": c.plan_cost_spread_ms})
        search_ids = [i for i, (_, src, _) in enumerate(labelled) if src == "search"]
        heur_ids = [i for i, (_, src, _) in enumerate(labelled) if src == "heuristic"]
        s = min(search_ids, key=lambda i: (rows[i]["measured_ms"], i))
        rounds = [{labelled[i][0]: rows[i]["measured_ms"] for i in first}]
        decision: dict[str, Any]
        if not heur_ids:
            best, decision = s, {"verdict": "no heuristic plan", "kept": labelled[s][0]}
        else:
            h = min(heur_ids, key=lambda i: (rows[i]["measured_ms"], i))
            if labelled[s][2].signature() == labelled[h][2].signature():
                best, decision = s, {"verdict": "same plan", "kept": labelled[s][0], "heuristic": labelled[h][0]}
            else:
                ratios = [rows[s]["measured_ms"] / rows[h]["measured_ms"]]
                summary = None
                while len(ratios) < self.verify_max_rounds and time.perf_counter() < deadline:
                    cs, ch = self.evaluator.measure_many(task, [labelled[s][2], labelled[h][2]], visits=self.verify_visits)
                    ratios.append(cs.plan_cost_ms / ch.plan_cost_ms)
                    rounds.append({labelled[s][0]: cs.plan_cost_ms, labelled[h][0]: ch.plan_cost_ms})
                    summary = paired_ratio_summary(ratios)
                    if len(ratios) >= self.verify_min_rounds and summary.resolved:
                        break
                if summary is None:
                    summary = paired_ratio_summary(ratios)
                if len(ratios) < self.verify_min_rounds:  # out of time before a decision could be made
                    verdict = "not resolved"
                else:
                    verdict = summary.verdict
                best = s if verdict == "better" else h
                decision = {"verdict": verdict, "kept": labelled[best][0], "search": labelled[s][0],
                            "heuristic": labelled[h][0], "ratio": summary.to_dict(), "rounds": len(ratios),
                            "budget_s": self.verify_budget_s}
        seconds = time.perf_counter() - t0
        self.last_guard = GuardResult(rows, labelled[best][0], labelled[0][0], round(seconds, 3), decision, rounds)
        chosen = labelled[best][2]
        return Plan(task.name, self.name, list(chosen.shards))

