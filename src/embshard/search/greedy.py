"""The greedy partitioner: places a set of pieces on a task's devices against any shard
predictor (the `Partitioner` role of TorchRec's planner), one run per balance cap.

Table-wise greedy (one run per balance cap s in `caps`, default 1.00, 1.05, …, 1.50):
pieces are placed in descending predicted single-piece cost; a device is allowed when the
piece fits its memory, its width sum + the piece's dim ≤ s × (total width / D), and it holds
no other piece of the same table (pieces of one table on one device would only repeat the
lookups); among the allowed devices the one whose WHOLE shard, re-predicted with the piece
added, is cheapest wins (ties: less memory used, then lower index). All candidate shards of
one placement go to the predictor in one batched call (`embshard.search.accumulators`), and
every shard prediction is cached by the multiset of its pieces; a run under a larger cap picks
up where its candidate devices first differ from a smaller cap's run (the steps before are the
same), from a copy of that run's state. When no device passes the width cap, any device with memory room
is allowed. Memory goes through the foundation's `MemoryLedger` with this preference order,
and the look-ahead (`embshard.packing.LookAhead`) skips a placement that would leave
the remaining pieces unpackable. The plan with the lowest simulated plan cost over all caps
is kept, and the partitioner remembers its `top_k` cheapest distinct plans over every run.

Nothing here knows where the pieces came from: NeuroShard's beam proposes piece sets
(`embshard.search.neuroshard`), any other proposer can.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from embshard.costs.base import DeviceCosts
from embshard.costs.predictor import supports_incremental
from embshard.errors import InfeasibleError
from embshard.plan import MemoryLedger, Plan, Shard, normalize
from embshard.search.accumulators import DeviceAccumulator, KeyedDevices, PooledDevices
from embshard.packing import LookAhead
from embshard.search.pieces import FREE, Piece, PieceBook, PieceSpec
from embshard.search.simulator import Simulator
from embshard.task import Task

DEFAULT_CAPS: tuple[float, ...] = tuple(round(1.0 + 0.05 * i, 2) for i in range(11))
#: "auto" runs the incremental accumulators from this many devices up
INCREMENTAL_MIN_DEVICES = 16
#: or above this many tables, on any device count: a shard of hundreds of tables re-predicted
#: whole at every placement is quadratic in the tables (1,340 tables on 8 devices: 26 s)
INCREMENTAL_MAX_KEYED_TABLES = 64
#: a placement re-predicts at most this many allowed devices: the ones whose current shard
#: is predicted cheapest (every device up to 128 devices)
MAX_CANDIDATE_DEVICES = 128
#: pieces × devices × caps of one grid, at most: bigger tasks run fewer caps, evenly spread
#: over the grid (every cap up to 2.2M pieces × devices, e.g. 856 tables × 128 devices × 20)
GRID_MAX_WORK = 24_000_000


@dataclass
class GreedyResult:
    """The best table-wise plan of one piece set."""

    cost_ms: float
    devices: list[int]          # device of each piece, in `pieces` order
    pieces: list[Piece]
    costs: DeviceCosts
    cap: float


@dataclass
class _Fork:
    """A greedy run's state before one of its steps, where a run under a larger cap that
    placed the same up to there picks up (`GreedyPartitioner._place`)."""

    step: int
    ledger: MemoryLedger
    free: np.ndarray
    widths: np.ndarray
    devs: DeviceAccumulator
    ahead: LookAhead
    holds: dict[str, np.ndarray]
    placed: list[int]


@dataclass
class Candidate:
    """One distinct plan the partitioner found, with its predicted cost."""

    cost_ms: float
    state: tuple[PieceSpec, ...]
    devices: list[int]
    cap: float


def cheapest(cand: np.ndarray, cost: np.ndarray, free: np.ndarray, k: int) -> np.ndarray:
    """The `k` devices of `cand` whose shard is cheapest now (ties: more free memory, then
    lower index), in device order: `np.sort(cand[np.lexsort((cand, -free[cand], cost[cand]))[:k]])`,
    but sorting only the devices no dearer than the k-th cheapest (a partition finds it), since a
    placement on a thousand devices does this every step."""
    c = cost[cand]
    kth = np.partition(c, k - 1)[k - 1]
    near = cand[c <= kth]
    if len(near) < k:  # a NaN cost (never expected): the plain sort, which puts NaN last
        near = cand
    if len(near) > k:
        near = near[np.lexsort((near, -free[near], cost[near]))[:k]]
    return np.sort(near)


class GreedyPartitioner:
    """The greedy grid over width caps for one task against one simulator (module docstring).

    Args:
        task: the planning view of the task (every table with a reuse histogram).
        simulator: the cached predictor.
        book: the task's pieces (shares the simulator).
        caps: balance caps on per-device embedding width (× the even share).
        incremental: running per-device encoding reductions (`PooledDevices`) instead of
            whole-shard re-prediction (`KeyedDevices`); "auto": from INCREMENTAL_MIN_DEVICES
            devices up, or above INCREMENTAL_MAX_KEYED_TABLES tables. Only where the predictor
            is an additive `EncodingPredictor`.
        top_k: distinct plans to remember (`plans`).
        max_candidates: per placement, only this many allowed devices are re-predicted with
            the piece: those whose current shard is predicted cheapest (ties: more free
            memory, lower index); None: all. With more devices than this, the cheapest device
            after the placement is, for an additive cost, among the cheapest before it, and a
            placement costs O(max_candidates) predictions instead of O(devices).
        grid_max_work: when pieces × devices × caps exceeds this, the grid runs only as many
            caps as fit (at least 2: the first and the last, the rest evenly between);
            None: every cap. `last_caps` says which ran.
    """

    def __init__(self, task: Task, simulator: Simulator, book: PieceBook, caps: Sequence[float] = DEFAULT_CAPS,
                 incremental: bool | str = "auto", top_k: int = 1, max_candidates: int | None = MAX_CANDIDATE_DEVICES,
                 grid_max_work: int | None = GRID_MAX_WORK):
        self.task = task
        self.sim = simulator
        self.book = book
        self.caps = tuple(float(c) for c in caps)
        self.top_k = max(1, int(top_k))
        self.max_candidates = None if max_candidates is None else max(1, int(max_candidates))
        self.grid_max_work = None if grid_max_work is None else int(grid_max_work)
        #: the caps the last grid ran (fewer than asked on a task over grid_max_work)
        self.last_caps: tuple[float, ...] = self.caps
        self.runs = 0
        #: greedy steps not repeated: runs under larger caps that picked up from a fork
        self.steps_forked = 0
        self._scores: dict[tuple, GreedyResult | InfeasibleError] = {}
        self._top: list[tuple[float, tuple, Candidate]] = []  # (cost, signature, candidate), sorted
        if incremental == "auto":  # few devices and tables: the shard cache hits more than running sums save
            incremental = task.num_devices >= INCREMENTAL_MIN_DEVICES or len(task.tables) > INCREMENTAL_MAX_KEYED_TABLES
        self.incremental = bool(incremental) and supports_incremental(simulator.predictor)
        self._enc_dim = 0
        if self.incremental:
            probe = np.asarray(simulator.predictor.table_encodings([task.tables[0]]))
            self._enc_dim = int(probe.shape[1])

    def partition(self, state: tuple[PieceSpec, ...], caps: tuple[float, ...] | None = None) -> GreedyResult:
        """Best plan over `caps` (default: all) for a piece set (cached); raises InfeasibleError."""
        caps = self.caps if caps is None else caps
        key = (state, caps)
        got = self._scores.get(key)
        if got is None:
            try:
                got = self._grid(state, caps)
            except InfeasibleError as e:
                got = e
            self._scores[key] = got
        if isinstance(got, InfeasibleError):
            raise got
        return got

    def thinned(self, caps: tuple[float, ...], num_pieces: int) -> tuple[float, ...]:
        """`caps` (sorted), thinned to what `grid_max_work` allows for `num_pieces` pieces."""
        caps = tuple(sorted(caps))
        work = num_pieces * self.task.num_devices
        if self.grid_max_work is None or len(caps) <= 2 or work * len(caps) <= self.grid_max_work:
            return caps
        k = max(2, self.grid_max_work // max(work, 1))
        return tuple(caps[i] for i in sorted({int(round(x)) for x in np.linspace(0, len(caps) - 1, k)}))

    def _grid(self, state: tuple[PieceSpec, ...], caps: tuple[float, ...]) -> GreedyResult:
        self.runs += 1
        pieces = self.book.pieces_of(state)
        caps = self.last_caps = self.thinned(caps, len(pieces))
        fixed = [i for i, p in enumerate(pieces) if p.fixed != FREE]
        free = [i for i, p in enumerate(pieces) if p.fixed == FREE]
        order = sorted(free, key=lambda i: (-pieces[i].single_ms, -pieces[i].need, pieces[i].spec))
        ordered = [pieces[i] for i in order]
        total_width = sum(p.dim for p in pieces)
        runs, first_error = self._cap_runs([pieces[i] for i in fixed], ordered, caps, total_width)
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

    def _cap_runs(self, fixed: list[Piece], ordered: list[Piece], caps: tuple[float, ...], total_width: int,
                  forked: bool = True) -> tuple[list[tuple[float, list[int], np.ndarray, np.ndarray]], InfeasibleError | None]:
        """The greedy runs under `caps` (ascending), smallest first, until one the cap never
        bound: ([(cap, device per piece of `ordered`, compute per device, width per device)],
        the first InfeasibleError). `forked`: a run picks up where the smaller caps' runs left
        it a fork (`_place`); False: every run from scratch (the same runs, slower)."""
        d = self.task.num_devices
        runs: list[tuple[float, list[int], np.ndarray, np.ndarray]] = []
        first_error: InfeasibleError | None = None
        limits = [cap * total_width / d for cap in caps]
        forks: list[_Fork | None] = [None] * len(caps)
        binds: list[int | None] = [None] * len(caps)
        for j, cap in enumerate(caps):
            if not forked:
                forks, binds = [None] * len(caps), [None] * len(caps)
            try:
                devices, compute, widths, bound = self._place(fixed, ordered, limits, j, forks, binds)
            except InfeasibleError as e:
                first_error = first_error or e
                continue
            runs.append((cap, devices, compute, widths))
            if not bound:  # the cap never changed a decision: every larger cap places the same
                break
        return runs, first_error

    def _consider(self, cost: float, state, pieces: list[Piece], devices: list[int], cap: float) -> None:
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

    def _accumulator(self) -> DeviceAccumulator:
        d = self.task.num_devices
        return PooledDevices(self.sim, d, self._enc_dim) if self.incremental else KeyedDevices(self.sim, d)

    @staticmethod
    def _place_fixed(fixed: list[Piece], ledger: MemoryLedger, free: np.ndarray, widths: np.ndarray) -> None:
        """Put each fixed piece on its device, in order: `ledger`, `free` and `widths` as
        taking them one by one leaves them; raises the InfeasibleError of the first that finds
        no room. On many devices a row-split table is a block per device: totals per device
        where every piece fits, one by one only to name the first that does not."""
        if not fixed:
            return
        dev = np.fromiter((p.fixed for p in fixed), dtype=np.int64, count=len(fixed))
        need = np.fromiter((p.need for p in fixed), dtype=np.int64, count=len(fixed))
        used = np.zeros(len(free), dtype=np.int64)
        np.add.at(used, dev, need)  # exact in int64 (bincount's weights are float)
        if (used > free).any():
            for p in fixed:
                if free[p.fixed] < p.need:
                    raise ledger.nowhere(p.table, p.need)
                ledger.take(p.fixed, p.need)
                free[p.fixed] -= p.need
                widths[p.fixed] += p.dim
            raise AssertionError("the totals overflowed a device but no piece did")
        for k in used.nonzero()[0].tolist():
            ledger.take(k, int(used[k]))
        free -= used
        np.add.at(widths, dev, np.fromiter((p.dim for p in fixed), dtype=np.int64, count=len(fixed)))

    def _place(self, fixed: list[Piece], ordered: list[Piece], limits: list[float], j: int,
               forks: list[_Fork | None], binds: list[int | None]) -> tuple[list[int], np.ndarray, np.ndarray, bool]:
        """One greedy run under width cap `limits[j]` (caps ascending): (device per piece of
        `ordered`, compute per device, width per device, whether the cap ever excluded a device
        with room).

        A run under a larger cap re-predicts the same candidates, and so places the same, up to
        the first step where its own candidates differ (its cap lets in a device that would be
        among them): this run notes that step for every larger cap it still agrees with and
        leaves that cap a copy of its state there (`forks[k]`, the step where the larger cap's
        run picks up), and the first step where the larger cap would exclude a device with
        room (`binds[k]`). Run k's plan is the one a run from scratch gives; only the steps
        before its fork are not repeated."""
        task = self.task
        d = task.num_devices
        start = forks[j]
        if start is None:
            ledger = MemoryLedger(task)
            free = np.full(d, task.device_memory_bytes, dtype=np.int64)
            widths = np.zeros(d, dtype=np.int64)
            devs = self._accumulator()
            self._place_fixed(fixed, ledger, free, widths)  # row blocks: their device is part of the state
            devs.add_fixed([(p.fixed, p) for p in fixed])
            ahead = LookAhead(free, [p.need for p in ordered], fit="worst")
            split = {n for n, k in Counter(p.table.name for p in ordered).items() if k > 1}
            holds: dict[str, np.ndarray] = {n: np.zeros(d, dtype=bool) for n in split}
            placed: list[int] = []
            first = 0
        else:
            forks[j] = None
            ledger, free, widths, devs, ahead, holds, placed, first = (
                start.ledger, start.free, start.widths, start.devs, start.ahead, start.holds, start.placed, start.step)
            self.steps_forked += first
        bound = binds[j] is not None and binds[j] < first
        # the larger caps that agree with this run up to `first` (a fork before it stands: this
        # run agrees with the one that left it up to `first`)
        track = [k for k in range(j + 1, len(limits)) if forks[k] is None or forks[k].step >= first]
        for k in track:
            forks[k] = None
            if binds[k] is not None and binds[k] >= first:
                binds[k] = None

        def fork(step: int) -> _Fork:
            return _Fork(step, ledger.copy(), free.copy(), widths.copy(), devs.copy(), ahead.copy(),
                         {n: h.copy() for n, h in holds.items()}, list(placed))

        cap_width = limits[j]
        m = self.max_candidates
        try:
            for i in range(first, len(ordered)):
                p = ordered[i]
                room = free >= p.need
                if not room.any():
                    raise ledger.nowhere(p.table, p.need)
                held = holds.get(p.table.name)
                if held is not None and (room & ~held).any():  # never two pieces of a table on a device when avoidable
                    room &= ~held
                wide = widths + p.dim
                ok = room & (wide <= cap_width)
                capped = bool(ok.any())
                if capped:
                    bound = bound or bool((ok != room).any())
                    cand = ok.nonzero()[0]
                else:
                    bound = True
                    cand = room.nonzero()[0]
                if m is not None and len(cand) > m:
                    cand = cheapest(cand, devs.cost, free, m)
                for k in list(track):  # does a larger cap still re-predict the same candidates?
                    okk = room & (wide <= limits[k])
                    any_k = bool(okk.any())
                    if binds[k] is None and (not any_k or bool((okk != room).any())):
                        binds[k] = i
                    if (capped and not (okk != ok).any()) or not any_k:  # the same devices allowed
                        continue
                    cand_k = okk.nonzero()[0]
                    if m is not None and len(cand_k) > m:
                        cand_k = cheapest(cand_k, devs.cost, free, m)
                    if not np.array_equal(cand_k, cand):
                        forks[k] = fork(i)
                        track.remove(k)
                c = devs.costs(cand, p)
                preference = cand[np.lexsort((cand, -free[cand], c))].tolist()

                def more(room=room, cand=cand) -> list[int]:
                    # not re-predicted (over the width cap, or beyond max_candidates), but usable
                    # when the look-ahead needs them: most free memory first
                    others = room.copy()
                    others[cand] = False
                    rest = others.nonzero()[0]
                    return rest[np.argsort(-free[rest], kind="stable")].tolist()

                dev = ahead.choose(i, free, preference, more)
                ledger.take(dev, p.need)
                free[dev] -= p.need
                widths[dev] += p.dim
                if held is not None:
                    held[dev] = True
                hit = (cand == dev).nonzero()[0]
                devs.add(dev, p, int(hit[0]) if hit.size else -1)
                placed.append(dev)
        except InfeasibleError:
            for k in track:  # they would stop at the same step: let them find out from scratch
                forks[k] = binds[k] = None
            raise
        for k in track:  # placed the same throughout: its run picks up at the end
            forks[k] = fork(len(ordered))
        return placed, devs.cost, widths, bound

    def plans(self, name: str) -> list[tuple[Plan, float]]:
        """The `top_k` distinct plans found (normalised), cheapest predicted first, with the
        predicted cost the partitioner saw."""
        return [(self.plan_of(self.book.pieces_of(c.state), c.devices, name), c.cost_ms) for _, _, c in self._top]

    def plan_of(self, pieces: Sequence[Piece], devices: Sequence[int], name: str) -> Plan:
        """The plan (normalised) of `pieces` on `devices` (a GreedyResult's, say)."""
        shards = [Shard(p.table.name, dev, p.spec[1], p.dim, p.shard.row_offset, p.shard.rows)
                  for p, dev in sorted(zip(pieces, devices), key=lambda x: x[0].spec)]
        return normalize(self.task, Plan(self.task.name, name, shards))

    def remembered(self) -> list[tuple[float, tuple, Candidate]]:
        """The plans remembered so far (for `restore`)."""
        return list(self._top)

    def restore(self, remembered: list[tuple[float, tuple, Candidate]]) -> None:
        """Remember only `remembered` again: a proposer turned down what it tried since."""
        self._top = list(remembered)
