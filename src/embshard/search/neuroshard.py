"""NeuroShard's search: table-wise greedy grid and column-wise beam search against a
shard predictor (pre-trained neural cost models, or the analytic stand-in).

Table-wise greedy (one run per balance cap s in `caps`, default 1.00, 1.05, …, 1.50):
pieces are placed in descending predicted single-piece cost; a device is allowed when the
piece fits its memory and its width sum + the piece's dim ≤ s × (total width / D); among
the allowed devices the one whose WHOLE shard, re-predicted with the piece added, is
cheapest wins (ties: less memory used, then lower index). All candidate shards of one
placement go to the predictor in one batched call, and every shard prediction is cached
by the multiset of its pieces, so runs for different caps share their common prefix. When
no device passes the width cap, any device with memory room is allowed. Memory goes
through the foundation's `MemoryLedger.place` with this preference order (then the
width-capped-out devices, least used memory first), so a placement that would leave the
remaining pieces unpackable is skipped. The plan with the lowest simulated plan cost over
all caps is kept.

Column-wise beam search: a step halves one piece's dim (both halves keep rows, pooling
factor and histogram; a piece is halvable when its dim is a multiple of 8, so halves stay
multiples of 4). From each of the `beam_width` best states, the candidates are the top
`candidates` halvable pieces by memory ∪ the top `candidates` by predicted cost; every
candidate state is scored by the full table-wise greedy; the best plan seen anywhere
(including no split at all) wins. When the table-wise greedy cannot fit the task, the
offending table's largest piece is halved until it fits (or cannot be halved further:
InfeasibleError naming the table and the shortfall).

Scaling: the greedy is O(pieces × devices) predictions per cap, made in one batched call per
placement. The beam multiplies that by up to beam_steps × beam_width × 2·candidates, so it
only runs when pieces × devices ≤ `beam_max_work` (default 8192, e.g. 60 tables × 128
devices or 856 × 8); bigger tasks get the table-wise grid plus memory-forced splits.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from embshard.costs.base import DeviceCosts
from embshard.errors import InfeasibleError, InputError
from embshard.plan import MemoryLedger, Plan, Shard, validate
from embshard.search.simulator import AnalyticPredictor, ShardPredictor, Simulator, batch_ratio, scale_costs
from embshard.tables import DIM_ALIGNMENT, Table
from embshard.task import Task

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CAPS: tuple[float, ...] = tuple(round(1.0 + 0.05 * i, 2) for i in range(11))
INCREMENTAL_MIN_DEVICES = 16
BUILD_COMMAND = "python train.py stage=pretrain"

#: A piece spec: (table name, col_offset, dim); a search state is a sorted tuple of them.
PieceSpec = tuple[str, int, int]


@dataclass
class _Piece:
    spec: PieceSpec
    table: Table      # the task's table
    ptable: Table     # the table at the piece's dim (what the predictor sees)
    pid: int          # simulator id of ptable
    need: int         # memory bytes on a device
    single_ms: float = 0.0
    enc: np.ndarray | None = None  # the predictor's table encoding (incremental mode)

    @property
    def dim(self) -> int:
        return self.spec[2]


@dataclass
class GreedyResult:
    """The best table-wise plan of one piece set."""

    cost_ms: float
    devices: list[int]          # device of each piece, in `pieces` order
    pieces: list[_Piece]
    costs: DeviceCosts
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
    name, off, dim = spec
    half = dim // 2
    rest = list(state)
    rest.remove(spec)
    rest += [(name, off, half), (name, off + half, half)]
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
    """The search for one task against one simulator (see the module docstring)."""

    def __init__(
        self,
        task: Task,
        simulator: Simulator,
        caps: Sequence[float] = DEFAULT_CAPS,
        beam_width: int = 3,
        beam_steps: int = 10,
        candidates: int = 10,
        column_wise: bool = True,
        beam_max_work: int | None = 8192,
        incremental: bool | str = "auto",
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
        self.beam_max_work = beam_max_work
        self._tables = task.table_by_name
        self._pieces: dict[PieceSpec, _Piece] = {}
        self._scores: dict[tuple[PieceSpec, ...], GreedyResult | InfeasibleError] = {}
        self.greedy_runs = 0
        self.beam_ran = False
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
            made = []
            for spec in new:
                name, _, dim = spec
                t = self._tables[name]
                pt = t if dim == t.dim else t.with_dim(dim)
                made.append(_Piece(spec, t, pt, self.sim.piece_id(pt), self.task.shard_memory_bytes(t, t.rows, dim)))
            single = self.sim.shard_costs([(p.pid,) for p in made], lambda i: [made[i].ptable])
            encs = self.sim.predictor.table_encodings([p.ptable for p in made]) if self.incremental else None
            for i, p in enumerate(made):
                p.single_ms = float(single[i])
                if encs is not None:
                    p.enc = np.asarray(encs[i], dtype=np.float64)
                self._pieces[p.spec] = p
        return [self._pieces[spec] for spec in state]

    # ------------------------------------------------------------------ table-wise
    def greedy(self, state: tuple[PieceSpec, ...]) -> GreedyResult:
        """Best plan over all caps for a piece set (cached per state); raises InfeasibleError."""
        got = self._scores.get(state)
        if got is None:
            try:
                got = self._greedy(state)
            except InfeasibleError as e:
                got = e
            self._scores[state] = got
        if isinstance(got, InfeasibleError):
            raise got
        return got

    def _greedy(self, state: tuple[PieceSpec, ...]) -> GreedyResult:
        self.greedy_runs += 1
        pieces = self.pieces_of(state)
        order = sorted(range(len(pieces)), key=lambda i: (-pieces[i].single_ms, -pieces[i].need, pieces[i].spec))
        ordered = [pieces[i] for i in order]
        total_width = sum(p.dim for p in pieces)
        d = self.task.num_devices
        runs: list[tuple[float, list[int], np.ndarray, np.ndarray]] = []
        first_error: InfeasibleError | None = None
        for cap in self.caps:
            try:
                devices, compute, widths = self._place(ordered, cap * total_width / d)
            except InfeasibleError as e:
                first_error = first_error or e
                continue
            runs.append((cap, devices, compute, widths))
        if not runs:
            assert first_error is not None
            raise first_error
        compute = np.stack([r[2] for r in runs])
        widths = np.stack([r[3] for r in runs])
        fw, bw = self.sim.comm(widths, compute)
        totals = (compute + fw + bw).max(axis=1)
        best = int(np.argmin(totals))  # first (smallest) cap among equals
        cap, placed, _, _ = runs[best]
        devices = [0] * len(pieces)
        for i, dev in zip(order, placed):
            devices[i] = dev
        costs = DeviceCosts(compute_ms=compute[best].tolist(), forward_comm_ms=fw[best].tolist(),
                            backward_comm_ms=bw[best].tolist())
        return GreedyResult(float(totals[best]), devices, pieces, costs, cap)

    def _place(self, ordered: list[_Piece], cap_width: float) -> tuple[list[int], np.ndarray, np.ndarray]:
        task = self.task
        d = task.num_devices
        ledger = MemoryLedger(task)
        free = np.full(d, task.device_memory_bytes, dtype=np.int64)
        ahead = LookAhead(free, [p.need for p in ordered])
        widths = np.zeros(d, dtype=np.int64)
        devs = _PooledDevices(self.sim, d, self._enc_dim) if self.incremental else _KeyedDevices(self.sim, d)
        placed: list[int] = []
        for i, p in enumerate(ordered):
            room = free >= p.need
            if not room.any():
                raise ledger.nowhere(p.table, p.need)
            ok = room & (widths + p.dim <= cap_width)
            capped = bool(ok.any())
            cand = np.flatnonzero(ok if capped else room)
            c = devs.costs(cand, p)
            preference = cand[np.lexsort((cand, -free[cand], c))].tolist()
            if capped:  # over the width cap, but usable when the look-ahead needs them
                rest = np.flatnonzero(room & ~ok)
                preference += rest[np.argsort(-free[rest], kind="stable")].tolist()
            dev = ahead.choose(i, free, preference)
            ledger.take(dev, p.need)
            free[dev] -= p.need
            widths[dev] += p.dim
            hit = np.flatnonzero(cand == dev)
            devs.add(dev, p, int(hit[0]) if hit.size else -1)
            placed.append(dev)
        return placed, devs.cost, widths

    # ------------------------------------------------------------------ column-wise
    def initial_state(self) -> tuple[PieceSpec, ...]:
        return tuple(sorted((t.name, 0, t.dim) for t in self.task.tables))

    def rescue(self, state: tuple[PieceSpec, ...]) -> tuple[tuple[PieceSpec, ...], GreedyResult]:
        """The greedy on `state`, halving the offending table's largest piece while it
        does not fit; re-raises the InfeasibleError when no piece of it can be halved."""
        while True:
            try:
                return state, self.greedy(state)
            except InfeasibleError as e:
                options = [s for s in state if s[0] == e.table and halvable(s[2])]
                if not options:
                    raise
                largest = max(options, key=lambda s: (s[2], -s[1]))
                log.info("neuroshard: %s does not fit whole; halving piece %s", e.table, largest)
                state = halve(state, largest)

    def beam_allowed(self, state: tuple[PieceSpec, ...]) -> bool:
        if not self.column_wise or self.beam_steps <= 0 or self.beam_width <= 0 or self.candidates <= 0:
            return False
        return self.beam_max_work is None or len(state) * self.task.num_devices <= self.beam_max_work

    def run(self) -> tuple[tuple[PieceSpec, ...], GreedyResult]:
        state, best = self.rescue(self.initial_state())
        best_state = state
        if not self.beam_allowed(state):
            return best_state, best
        self.beam_ran = True
        beam = [(best.cost_ms, state)]
        seen = {state}
        for _ in range(self.beam_steps):
            scored: list[tuple[float, tuple[PieceSpec, ...], GreedyResult]] = []
            for _, st in beam:
                pieces = [p for p in self.pieces_of(st) if halvable(p.dim)]
                by_size = sorted(pieces, key=lambda p: (-p.need, p.spec))[: self.candidates]
                by_cost = sorted(pieces, key=lambda p: (-p.single_ms, p.spec))[: self.candidates]
                picks = {p.spec: None for p in by_size + by_cost}
                for spec in picks:
                    nxt = halve(st, spec)
                    if nxt in seen:
                        continue
                    seen.add(nxt)
                    try:
                        r = self.greedy(nxt)
                    except InfeasibleError:
                        continue
                    scored.append((r.cost_ms, nxt, r))
            if not scored:
                break
            scored.sort(key=lambda x: (x[0], len(x[1]), x[1]))
            beam = [(c, st) for c, st, _ in scored[: self.beam_width]]
            if scored[0][0] < best.cost_ms:
                best, best_state = scored[0][2], scored[0][1]
        return best_state, best

    def plan(self, name: str) -> tuple[Plan, GreedyResult]:
        _, best = self.run()
        shards = [
            Shard(p.table.name, dev, p.spec[1], p.dim, 0, p.table.rows)
            for p, dev in sorted(zip(best.pieces, best.devices), key=lambda x: x[0].spec)
        ]
        return Plan(self.task.name, name, shards), best


# ----------------------------------------------------------------------------- sharder
def resolve_path(path: str | os.PathLike) -> Path:
    """Relative inputs resolve against the project root, not the working directory."""
    p = Path(os.path.expanduser(str(path)))
    return p if p.is_absolute() else ROOT / p


class NeuroShardSharder:
    """NeuroShard (`search=neuroshard`): greedy grid + column beam against cost models.

    Args:
        checkpoint: the pre-trained cost models (`NeuralCostModels.load`); relative paths
            resolve against the project root. None: the analytic stand-in.
        beam_width, beam_steps, candidates: the column-wise beam search.
        caps: balance caps on per-device embedding width (× the even share).
        column_wise: run the beam search (memory-forced splits happen regardless).
        beam_max_work: run the beam only when pieces × devices ≤ this (None: always).
        fallback: when the checkpoint file is missing or cannot be loaded, "analytic"
            warns and uses the analytic model; "error" raises InputError.
        predictor: a ShardPredictor to use directly (tests, notebooks); overrides checkpoint.
        delay_round_ms: rounding of compute delays in the comm cache key.
        incremental: when the predictor exposes `table_encodings`/`head_ms` with an
            additive reduction (the neural bundle, the analytic adapter), keep running
            per-device reductions instead of re-predicting whole shards (same costs, far
            fewer operations); False: always go through `compute_ms` and the cache; "auto":
            incremental from INCREMENTAL_MIN_DEVICES devices up (below, the cache of whole
            shard predictions hits often enough to be cheaper).
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike | None = None,
        beam_width: int = 3,
        beam_steps: int = 10,
        candidates: int = 10,
        caps: Sequence[float] = DEFAULT_CAPS,
        column_wise: bool = True,
        beam_max_work: int | None = 8192,
        fallback: str = "analytic",
        name: str = "neuroshard",
        predictor: ShardPredictor | None = None,
        delay_round_ms: float = 0.01,
        incremental: bool | str = "auto",
    ):
        if fallback not in ("analytic", "error"):
            raise InputError(f"neuroshard: fallback must be 'analytic' or 'error', got {fallback!r}")
        for k, v in (("beam_width", beam_width), ("beam_steps", beam_steps), ("candidates", candidates)):
            if int(v) < 0:
                raise InputError(f"neuroshard: {k} must be >= 0, got {v!r}")
        caps = tuple(float(c) for c in caps)
        if not caps or any(not np.isfinite(c) or c <= 0 for c in caps):
            raise InputError(f"neuroshard: caps must be positive numbers, got {list(caps)}")
        self.checkpoint = None if checkpoint in (None, "") else str(checkpoint)
        self.beam_width = int(beam_width)
        self.beam_steps = int(beam_steps)
        self.candidates = int(candidates)
        self.caps = caps
        self.column_wise = bool(column_wise)
        self.beam_max_work = None if beam_max_work is None else int(beam_max_work)
        self.fallback = fallback
        self.name = name
        self.delay_round_ms = float(delay_round_ms)
        if incremental not in (True, False, "auto"):
            raise InputError(f"neuroshard: incremental must be true, false or auto, got {incremental!r}")
        self.incremental = incremental
        self._predictor = predictor
        self._loaded = predictor is not None
        self._simulators: dict[int, Simulator] = {}
        self.last_search_seconds: float | None = None
        self.last_predicted_cost_ms: float | None = None
        self.last_costs: DeviceCosts | None = None
        self.last_stats: dict[str, object] = {}

    # ------------------------------------------------------------------ predictor
    def load_predictor(self) -> ShardPredictor | None:
        """The neural predictor from the checkpoint (once), or None for the analytic
        stand-in. Raises InputError when fallback="error" and it cannot be had."""
        if self._loaded:
            return self._predictor
        self._loaded = True
        if self.checkpoint is None:
            log.info("neuroshard: no checkpoint configured; searching against the analytic cost model")
            return None
        path = resolve_path(self.checkpoint)
        if not path.is_file():
            msg = f"neuroshard: cost-model checkpoint {path} not found; build it with `{BUILD_COMMAND}`"
            if self.fallback == "error":
                raise InputError(msg)
            log.warning("%s (searching against the analytic cost model instead)", msg)
            return None
        try:
            from embshard.costs.neural import NeuralCostModels
        except ImportError as e:
            msg = f"neuroshard: cannot load {path}: neural cost models unavailable ({e})"
            if self.fallback == "error":
                raise InputError(msg) from None
            log.warning("%s (searching against the analytic cost model instead)", msg)
            return None
        self._predictor = NeuralCostModels.load(path)
        return self._predictor

    def simulator_for(self, task: Task) -> Simulator:
        predictor = self.load_predictor()
        if predictor is None:  # analytic stand-in at the task's batch
            key = -int(task.batch_size)
            if key not in self._simulators:
                self._simulators[key] = Simulator(AnalyticPredictor(batch_size=task.batch_size), self.delay_round_ms)
            return self._simulators[key]
        if 0 not in self._simulators:
            pb = getattr(predictor, "batch_size", None)
            if pb and pb != task.batch_size:
                log.info("neuroshard: cost models predict batch %d; task %r has batch %d (memory uses the task's)",
                         pb, task.name, task.batch_size)
            self._simulators[0] = Simulator(predictor, self.delay_round_ms)
        return self._simulators[0]

    # ------------------------------------------------------------------ Sharder
    def search(self, task: Task) -> NeuroShardSearch:
        return NeuroShardSearch(
            task, self.simulator_for(task), caps=self.caps, beam_width=self.beam_width,
            beam_steps=self.beam_steps, candidates=self.candidates, column_wise=self.column_wise,
            beam_max_work=self.beam_max_work, incremental=self.incremental,
        )

    def shard(self, task: Task) -> Plan:
        start = time.perf_counter()
        search = self.search(task)
        plan, best = search.plan(self.name)
        validate(task, plan)
        self.last_search_seconds = time.perf_counter() - start
        ratio = batch_ratio(search.sim.predictor, task)
        self.last_costs = scale_costs(best.costs, ratio)
        self.last_predicted_cost_ms = self.last_costs.plan_cost_ms
        self.last_stats = {
            "greedy_runs": search.greedy_runs,
            "incremental": search.incremental,
            "beam": search.beam_ran,
            "pieces": len(best.pieces),
            "cap": best.cap,
            **vars(search.sim.stats),
        }
        log.debug("neuroshard %s: %.1f ms predicted, %s", task.name, best.cost_ms, self.last_stats)
        return plan
