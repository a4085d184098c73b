"""NeuroShard (`search=neuroshard`): a beam search over column and row splits, each state
scored by the greedy partitioner against a shard predictor (pre-trained neural cost models,
or the analytic stand-in), with an optional measured guard.

The roles live in their own modules and serve any planner: piece algebra
(`embshard.search.pieces`), the greedy partitioner over width caps
(`embshard.search.greedy`, with its memory look-ahead `embshard.packing` and per-device
accumulators `embshard.search.accumulators`), the predictor protocols and model loading
(`embshard.costs.predictor`) and the measured guard (`embshard.search.guard`). This module is
the proposer: which piece sets to try.

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

Where the beam does not run (`beam_allowed`), the costliest tables still get one cut
(`split_above`, as DreamShard's and AutoShard's `split_columns`): every whole piece whose predicted
cost alone exceeds `split_above` times an even share of the summed single-piece costs is halved
into 2, 4, ... equal column pieces (within its constraints, no more than devices) until each share
is below that, and the greedy runs once on that piece set at the best cap. Its plan is kept
where the search's models predict it cheaper; with `split_check="analytic"` (the default until
2026-12-03) only where the analytic model (`AnalyticCostModel`) does too. That check turned down
the cuts that paid most on heavy-tailed tasks (measured 0.45-0.87x the uncut plan on 9 of 10 such
tasks: docs/neuroshard.md); the analytic model's estimate is recorded either way.
report.json: `search_info.costly_split`.

Every plan comes out normalised (`embshard.plan.normalize`: a table's pieces on one device
merged) and is costed as normalised. The search keeps its `top_k` best distinct plans.

**Guard** (`verify=K`, with a hardware evaluator attached): the K best plans of the search and
the plans of the `verify_heuristics` go to the measured guard (`MeasuredGuard`); the search's
own pick stays available (`last_search_pick`) so the model's quality stays visible. The
measuring time counts in the search time.

Scaling: the greedy is O(pieces × devices) predictions per cap, made in one batched call per
placement. The beam multiplies that by up to beam_steps × beam_width × 3·candidates, so it
only runs when pieces × devices ≤ `beam_max_work` (default 8192, e.g. 60 tables × 128
devices or 856 × 8) and pieces ≤ `beam_max_pieces` (default 64); bigger tasks get the
table-wise grid plus memory-forced splits. The second bound is there because each of the beam's
~800 greedy runs costs about 0.2 ms a piece even on few devices: 200 tables on 8 devices, within
the first bound, took 28.7 s with the beam and 0.24 s without it (docs/neuroshard.md).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence

import numpy as np

from embshard.costs.base import DeviceCosts
from embshard.costs.features import TRACE_HISTOGRAMS, planning_view
from embshard.costs.neural.models import BatchCostModels
from embshard.costs.predictor import (BUILD_COMMAND, DEFAULT_CHECKPOINT, ROOT, FixedFamily, LoadedModels,
                                      PredictorFamily, ShardPredictor, batch_ratio, load_models, resolve_path,
                                      supports_incremental)
from embshard.errors import InfeasibleError, InputError
from embshard.plan import Plan, even_row_layout, validate
from embshard.search.base import Capabilities
from embshard.search.greedy import (DEFAULT_CAPS, GRID_MAX_WORK, INCREMENTAL_MIN_DEVICES, MAX_CANDIDATE_DEVICES,
                                    Candidate, GreedyPartitioner, GreedyResult)
from embshard.search.floor import FLOOR_MAX_WORK, HeuristicFloor
from embshard.search.guard import DEFAULT_HEURISTICS, GuardResult, GuardSlot, MeasuredGuard, heuristic_sharders
from embshard.search.pieces import (FREE, PieceBook, PieceSpec, halvable, halve, initial_state, row_split,
                                    row_splittable, slices_below)
from embshard.search.refine import MeasuredRefinement
from embshard.search.simulator import Simulator, scale_costs
from embshard.tables import Table
from embshard.task import Task

log = logging.getLogger(__name__)

#: the beam runs only on tasks of at most this many pieces (its ~800 greedy runs cost ~0.2 ms a piece each)
BEAM_MAX_PIECES = 64
#: without the beam, pieces predicted dearer alone than this many even shares are cut (`split_above`)
SPLIT_ABOVE = 1.0
SPLIT_CHECKS = ("analytic", None)

__all__ = ["BEAM_MAX_PIECES", "BUILD_COMMAND", "Candidate", "DEFAULT_CAPS", "DEFAULT_CHECKPOINT", "GreedyResult", "GuardResult",
           "INCREMENTAL_MIN_DEVICES", "NeuroShardSearch", "NeuroShardSharder", "ROOT", "halve", "heuristic_sharders",
           "resolve_path", "supports_incremental"]


class NeuroShardSearch:
    """The beam search for one task against one simulator (see the module docstring).

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
        max_candidates: int | None = MAX_CANDIDATE_DEVICES,
        grid_max_work: int | None = GRID_MAX_WORK,
        beam_max_pieces: int | None = BEAM_MAX_PIECES,
        split_above: float | None = SPLIT_ABOVE,
        split_check: str | None = None,
    ):
        if not caps:
            raise InputError("neuroshard: caps must not be empty")
        self.split_above = split_above
        self.split_check = split_check
        #: what the cut of the costliest tables did where the beam did not run (None: not tried)
        self.costly_split: dict[str, Any] | None = None
        self.task = task
        self.sim = simulator
        self.beam_width = int(beam_width)
        self.beam_steps = int(beam_steps)
        self.candidates = int(candidates)
        self.column_wise = bool(column_wise)
        self.row_wise = bool(row_wise)
        self.beam_max_work = beam_max_work
        self.beam_max_pieces = beam_max_pieces
        self.beam_ran = False
        self.presplit_tables = 0  # tables `run` cut before its first greedy run (`presplit`)
        d, per_host = task.num_devices, task.devices_per_host or task.num_devices
        self.row_groups: list[tuple[int, ...]] = (
            [tuple(range(d))] if per_host >= d else
            [tuple(range(h, min(h + per_host, d))) for h in range(0, d, per_host)])
        self.book = PieceBook(task, simulator)
        self.partitioner = GreedyPartitioner(task, simulator, self.book, caps, incremental, top_k, max_candidates,
                                             grid_max_work)
        self.book.encode = self.partitioner.incremental

    @property
    def incremental(self) -> bool:
        return self.partitioner.incremental

    @property
    def greedy_runs(self) -> int:
        return self.partitioner.runs

    @property
    def caps(self) -> tuple[float, ...]:
        return self.partitioner.caps

    def pieces_of(self, state: Sequence[PieceSpec]):
        return self.book.pieces_of(state)

    def greedy(self, state: tuple[PieceSpec, ...], caps: tuple[float, ...] | None = None) -> GreedyResult:
        """Best table-wise plan over `caps` (default: all) for a piece set (cached); raises InfeasibleError."""
        return self.partitioner.partition(state, caps)

    # ------------------------------------------------------------------ splits
    def may_halve(self, spec: PieceSpec) -> bool:
        """Whether a free piece may be halved: its table allows column splits (its
        `sharding_types`) and both halves stay at least its `min_partition` wide."""
        t = self.book.table(spec[0])
        if spec[3] != FREE or not halvable(spec[2]) or spec[2] // 2 < t.narrowest_column_piece():
            return False
        single_host = len(self.row_groups) == 1
        return t.allows("column_wise") or (single_host and t.allows("table_column_wise"))

    def row_groups_for(self, table: Table) -> list[tuple[int, ...]]:
        """The device groups a table may be split by rows over, as its `sharding_types` allow:
        one host's devices (table_row_wise; with one host, the same as row_wise), or, for a
        table allowed row_wise but not table_row_wise on several hosts, all devices. Only groups
        whose even row blocks are all non-empty (`row_splittable`): TorchRec's layout would leave
        a device of a larger group an empty block (114 rows over 16 devices)."""
        if not self.row_wise:
            return []
        if len(self.row_groups) == 1:
            ok = table.allows("row_wise") or table.allows("table_row_wise")
            groups = list(self.row_groups) if ok else []
        elif table.allows("table_row_wise"):
            groups = list(self.row_groups)
        else:
            groups = [tuple(range(self.task.num_devices))] if table.allows("row_wise") else []
        return [g for g in groups if row_splittable(table.rows, len(g))]

    def initial_state(self) -> tuple[PieceSpec, ...]:
        return initial_state(self.task)

    def presplit(self, state: tuple[PieceSpec, ...]) -> tuple[tuple[PieceSpec, ...], int]:
        """(`state` with every whole table too large for one device's memory cut the way
        `rescue` cuts it, how many tables were cut): halved into equal column pieces until they
        fit, or, where the narrowest pieces its constraints allow still do not, split by rows
        over the largest device group whose blocks fit. `rescue` reaches the same shapes one
        greedy run per cut (minutes for hundreds of such tables); a table that fits whole, and
        every task whose tables all fit, is left as it is."""
        mem = self.task.device_memory_bytes
        need = lambda t, rows, dim: self.task.shard_memory_bytes(t, rows, dim)  # noqa: E731
        out, cut = list(state), 0
        for spec in state:
            name, off, dim, dev, _ = spec
            t = self.book.table(name)
            if dev != FREE or off != 0 or dim != t.dim or need(t, t.rows, dim) <= mem:
                continue
            pieces = [spec]
            while need(t, t.rows, pieces[0][2]) > mem and self.may_halve(pieces[0]):
                pieces = [h for p in pieces for h in halve((p,), p)]
            if need(t, t.rows, pieces[0][2]) > mem:  # rows, as rescue does once no piece can be halved
                groups = sorted(self.row_groups_for(t), key=len, reverse=True)
                if not groups or need(t, even_row_layout(t.rows, len(groups[0]))[0][1], dim) > mem:
                    continue  # rescue says what does not fit
                pieces = list(row_split((spec,), spec, groups[0]))
                log.debug("neuroshard: %s does not fit in column pieces; splitting it by rows over %s", name, groups[0])
            else:
                log.debug("neuroshard: %s does not fit whole; halving piece %s into %d column pieces", name, spec,
                          len(pieces))
            out.remove(spec)
            out += pieces
            cut += 1
        return tuple(sorted(out)), cut

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
                t = self.book.table(e.table)
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

    def costliest_cut(self, state: tuple[PieceSpec, ...]) -> tuple[tuple[PieceSpec, ...], list[str]]:
        """(`state` with every free piece whose predicted cost alone exceeds `split_above` x an
        even share halved into equal column pieces until each share is below it, the tables cut);
        see the module docstring."""
        pieces = self.pieces_of(state)
        limit = self.split_above * sum(p.single_ms for p in pieces) / self.task.num_devices
        out, cut = state, []
        for p in sorted(pieces, key=lambda p: (-p.single_ms, p.spec)):
            if p.fixed != FREE or p.single_ms <= limit or not self.may_halve(p.spec):
                continue
            want = slices_below(p.single_ms, limit, self.task.num_devices)
            parts = [p.spec]
            while 2 * len(parts) <= want and all(self.may_halve(q) for q in parts):
                for q in parts:
                    out = halve(out, q)
                half = parts[0][2] // 2
                parts = [(q[0], q[1] + k * half, half, FREE, 0) for q in parts for k in (0, 1)]
            if len(parts) > 1:
                cut.append(p.spec[0])
        return out, cut

    def split_costliest(self, state: tuple[PieceSpec, ...],
                        best: GreedyResult) -> tuple[tuple[PieceSpec, ...], GreedyResult]:
        """`costliest_cut` of `state`, planned by one greedy run at `best`'s cap, kept where it
        is predicted cheaper (and, with split_check, the analytic model agrees); else `state`."""
        if self.split_above is None or not self.column_wise:
            return state, best
        split, cut = self.costliest_cut(state)
        if not cut:
            return state, best
        kept = self.partitioner.remembered()
        try:
            got = self.greedy(split, (best.cap,))
        except InfeasibleError:
            self.partitioner.restore(kept)
            self.costly_split = {"tables": len(cut), "kept": False, "why": "no plan fits"}
            return state, best
        info: dict[str, Any] = {"tables": len(cut), "predicted_ms": [best.cost_ms, got.cost_ms]}
        ok = got.cost_ms < best.cost_ms
        if ok:  # what the analytic model says, recorded; with split_check="analytic" it must agree
            from embshard.costs.analytic import AnalyticCostModel

            judge = AnalyticCostModel()
            whole, cuts = (judge.device_costs(self.task, self.partitioner.plan_of(r.pieces, r.devices, "check"))
                           .plan_cost_ms for r in (best, got))
            info["analytic_ms"] = [whole, cuts]
            ok = cuts < whole or self.split_check is None
        self.costly_split = {**info, "kept": ok}
        if not ok:
            self.partitioner.restore(kept)
            return state, best
        return split, got

    def beam_allowed(self, state: tuple[PieceSpec, ...]) -> bool:
        if not (self.column_wise or self.row_wise) or self.beam_steps <= 0 or self.beam_width <= 0 or self.candidates <= 0:
            return False
        if self.beam_max_pieces is not None and len(state) > self.beam_max_pieces:
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
            whole = [p for p in pieces if p.spec[0] not in split]
            for p in sorted(whole, key=lambda p: (-p.single_ms, p.spec))[: self.candidates]:
                for group in self.row_groups_for(p.table):
                    out[row_split(state, p.spec, group)] = None
        return list(out)

    def run(self) -> tuple[tuple[PieceSpec, ...], GreedyResult]:
        """Greedy grid on the unsplit tables, then the beam: every move is screened by one
        greedy run at its parent's best cap, and the `beam_width` best are scored over the
        full grid of caps (and become the next beam)."""
        need = self.task.tables_memory_bytes()
        room = self.task.num_devices * self.task.device_memory_bytes
        if need > room:  # no split lowers a table's memory: say so now, not after every split was tried
            big = max(self.task.tables, key=self.task.table_memory_bytes).name
            raise InfeasibleError(
                f"table {big!r} (the largest) and the others need {need} bytes in all and {self.task.num_devices} "
                f"devices hold {room}: short by {need - room} bytes, so no plan fits however the tables are split; "
                "add devices or memory per device", table=big, shortfall_bytes=need - room)
        state, self.presplit_tables = self.presplit(self.initial_state())
        state, best = self.rescue(state)
        best_state = state
        if not self.beam_allowed(state):
            return self.split_costliest(state, best)
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
        return self.partitioner.plans(name)

    def plan(self, name: str) -> tuple[Plan, GreedyResult]:
        """The best plan (normalised) and the greedy result it came from."""
        _, best = self.run()
        return self.candidate_plans(name)[0][0], best


# ----------------------------------------------------------------------------- sharder
class NeuroShardSharder(GuardSlot):
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
        beam_max_pieces: and only when the task has at most this many pieces (None: any).
        predictor: a ShardPredictor to use directly (tests, notebooks); overrides checkpoint.
        delay_round_ms: rounding of compute delays in the comm cache key.
        incremental: when the predictor exposes `table_encodings`/`head_ms` with an
            additive reduction (the neural bundle, the analytic adapter), keep running
            per-device reductions instead of re-predicting whole shards (same costs, far
            fewer operations); False: always go through `compute_ms` and the cache; "auto":
            incremental from INCREMENTAL_MIN_DEVICES devices up or above
            INCREMENTAL_MAX_KEYED_TABLES tables.
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
            95% interval of their mean cost ratio excludes 1, or this many seconds
            have passed.
        verify_min_rounds, verify_max_rounds: rounds before a decision / at most.
        verify_contenders, verify_margin: heuristics kept in the paired rounds: the round-1 best
            and the next within the margin of it, `verify_contenders` in all (`MeasuredGuard`).
        verify_interval: the interval of the guard's verdict: "bootstrap" (percentile; every
            measured evaluation so far) or "t" (Student t: holds its 95% over a few rounds).
        verify_search_contenders: the search's plans that stay in the guard's paired rounds
            (the round-1 best and the next within verify_margin), S the lowest mean over the
            rounds; 1: the round-1 best alone (`MeasuredGuard.search_contenders`).
        verify_refine: after the guard's first round, correct the search's compute model per
            table on the measured shards and refine the best measured plan against it
            (`embshard.search.refine`); the refined plan joins the paired rounds.
        max_candidates: per placement, re-predict at most this many allowed devices (those
            whose shard is predicted cheapest now); None: all (`GreedyPartitioner`).
        grid_max_work: thin the caps on tasks over this many pieces × devices × caps (None: never).
        trace_histograms: "replay": a traced table is searched with the reuse histogram of its
            replay at the task's batch, as the evaluator measures it (`features.replayed_table`);
            "given": with the histogram the task gives (the behaviour before 2026-11-27).
        split_above: where the beam does not run, cut the pieces predicted dearer alone than this
            many even shares into column pieces and keep that plan where it is predicted cheaper
            (module docstring); None: never (the behaviour before 2026-12-01).
        split_check: None (default since 2026-12-03): the search's models alone decide;
            "analytic": that plan is kept only where the analytic cost model also puts it below
            the uncut one (the default before).
        floor: heuristics (conf/search names, as `verify_heuristics`) whose plans the search's
            own models price after the search: its pick is returned only where predicted at or
            below (1 - `floor_margin`) x the cheapest of them, else that heuristic's plan (named
            in report.json's `search_info.floor`). A greedy under tight memory can end above a
            sorted heuristic by its own models; this keeps the pick never worse by them. ()
            or None: off (the behaviour before 2026-12-03).
        floor_margin: the predicted gain the search's pick must show over the cheapest floor
            plan, as a share (0: none; ties keep the search's).
        floor_max_work: skip the floor on tasks of more than this many tables x devices (each
            heuristic plans and is priced there; None: never skip).
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
        verify_heuristics: Sequence[str] = DEFAULT_HEURISTICS,
        verify_visits: int | None = None,
        verify_budget_s: float = 60.0,
        verify_min_rounds: int = 3,
        verify_max_rounds: int = 10,
        verify_contenders: int = 2,
        verify_margin: float = 0.1,
        verify_interval: str = "bootstrap",
        verify_search_contenders: int = 1,
        verify_refine: bool = False,
        max_candidates: int | None = MAX_CANDIDATE_DEVICES,
        grid_max_work: int | None = GRID_MAX_WORK,
        trace_histograms: str = "replay",
        beam_max_pieces: int | None = BEAM_MAX_PIECES,
        split_above: float | None = SPLIT_ABOVE,
        split_check: str | None = None,
        floor: Sequence[str] | None = DEFAULT_HEURISTICS,
        floor_margin: float = 0.0,
        floor_max_work: int | None = FLOOR_MAX_WORK,
    ):
        if split_above is not None and (isinstance(split_above, bool) or not isinstance(split_above, (int, float))
                                        or not np.isfinite(split_above) or split_above <= 0):
            raise InputError(f"neuroshard: split_above must be a positive number or null, got {split_above!r}")
        if split_check not in SPLIT_CHECKS:
            raise InputError(f"neuroshard: split_check must be analytic or null, got {split_check!r}")
        self.floor = HeuristicFloor(floor, floor_margin, floor_max_work, owner="neuroshard")
        self.last_floor: dict[str, Any] | None = None
        self.split_above = None if split_above is None else float(split_above)
        self.split_check = split_check
        if trace_histograms not in TRACE_HISTOGRAMS:
            raise InputError(f"neuroshard: trace_histograms must be replay or given, got {trace_histograms!r}")
        self.trace_histograms = trace_histograms
        for k, v in (("beam_width", beam_width), ("beam_steps", beam_steps), ("candidates", candidates)):
            if int(v) < 0:
                raise InputError(f"neuroshard: {k} must be >= 0, got {v!r}")
        caps = tuple(float(c) for c in caps)
        if not caps or any(not np.isfinite(c) or c <= 0 for c in caps):
            raise InputError(f"neuroshard: caps must be positive numbers, got {list(caps)}")
        self.check_verify(verify, "neuroshard")
        if incremental not in (True, False, "auto"):
            raise InputError(f"neuroshard: incremental must be true, false or auto, got {incremental!r}")
        #: the measured guard (its settings are checked here, before any search)
        self.guard = MeasuredGuard(verify_heuristics, verify_visits, verify_budget_s, verify_min_rounds,
                                   verify_max_rounds, verify_contenders, verify_margin,
                                   owner="neuroshard", interval=verify_interval,
                                   search_contenders=verify_search_contenders, refine=verify_refine)
        self.checkpoint = None if checkpoint in (None, "") else str(checkpoint)
        self.beam_width = int(beam_width)
        self.beam_steps = int(beam_steps)
        self.candidates = int(candidates)
        self.caps = caps
        self.column_wise = bool(column_wise)
        self.row_wise = bool(row_wise)
        self.beam_max_work = None if beam_max_work is None else int(beam_max_work)
        for k, v in (("max_candidates", max_candidates), ("grid_max_work", grid_max_work),
                     ("beam_max_pieces", beam_max_pieces)):
            if v is not None and int(v) < 1:
                raise InputError(f"neuroshard: {k} must be >= 1 or null, got {v!r}")
        self.max_candidates = None if max_candidates is None else int(max_candidates)
        self.grid_max_work = None if grid_max_work is None else int(grid_max_work)
        self.beam_max_pieces = None if beam_max_pieces is None else int(beam_max_pieces)
        self.name = name
        self.delay_round_ms = float(delay_round_ms)
        self.incremental = incremental
        self.verify = verify
        self.evaluator: Any = None
        #: the models searched against, once loaded (report.json: search_info from their `info`)
        self._models: LoadedModels | None = None if predictor is None else LoadedModels(
            FixedFamily(predictor), {"cost_model": type(predictor).__name__, "checkpoint": None})
        self._simulators: dict[int, Simulator] = {}
        self.last_search_seconds: float | None = None
        self.last_predicted_cost_ms: float | None = None
        self.last_costs: DeviceCosts | None = None
        self.last_stats: dict[str, object] = {}
        self.last_guard: GuardResult | None = None
        self.last_search_pick: Plan | None = None
        self.last_search_info: dict[str, Any] = {}

    # ------------------------------------------------------------------ predictor
    @property
    def verify_heuristics(self) -> tuple[str, ...]:
        return tuple(self.guard.heuristics)

    def models(self) -> LoadedModels:
        """The models searched against, loaded once (`embshard.costs.predictor.load_models`):
        the checkpoint's neural models, or the analytic model with checkpoint=None. Raises
        InputError when the checkpoint is missing or cannot be loaded."""
        if self._models is None:
            if self.checkpoint is None:
                log.info("%s: checkpoint=None: searching against the analytic cost model", self.name)
            self._models = load_models(self.checkpoint, self.name)
        return self._models

    def load_predictor(self) -> PredictorFamily | None:
        """The neural models (or the predictor given), or None for the analytic stand-in
        (checkpoint=None). Raises InputError when the checkpoint is missing or cannot be loaded."""
        models = self.models()
        if models.neural is not None:
            return models.neural
        return models.family.predictor if isinstance(models.family, FixedFamily) else None

    def simulator_for(self, task: Task) -> Simulator:
        """The cached simulator at the task's batch size (the family binds one per batch)."""
        b = int(task.batch_size)
        if b not in self._simulators:
            self._simulators[b] = Simulator(self.models().family.at_batch(b), self.delay_round_ms)
        return self._simulators[b]

    # ------------------------------------------------------------------ Sharder
    def search(self, task: Task) -> NeuroShardSearch:
        view, _ = planning_view(task, self.trace_histograms == "replay")
        return NeuroShardSearch(
            view, self.simulator_for(task), caps=self.caps, beam_width=self.beam_width,
            beam_steps=self.beam_steps, candidates=self.candidates, column_wise=self.column_wise,
            row_wise=self.row_wise, beam_max_work=self.beam_max_work, incremental=self.incremental,
            top_k=max(1, self.verify_count), max_candidates=self.max_candidates, grid_max_work=self.grid_max_work,
            beam_max_pieces=self.beam_max_pieces, split_above=self.split_above, split_check=self.split_check,
        )

    def predicted_costs(self, task: Task, plan: Plan) -> DeviceCosts:
        """The costs the search's models predict for any plan of `task` (at its batch)."""
        from embshard.plan import device_pieces

        sim = self.simulator_for(task)
        view, _ = planning_view(task, self.trace_histograms == "replay")
        return scale_costs(sim.device_costs(device_pieces(view, plan)), batch_ratio(sim.predictor, task))

    def shard(self, task: Task) -> Plan:
        start = time.perf_counter()
        search = self.search(task)
        search.run()
        found = search.candidate_plans(self.name)
        for plan, _ in found:
            validate(task, plan)
        plan = self._floored(task, found[0][0])
        self.last_search_pick = plan
        self.last_guard = None
        k = self.guard_count("neuroshard")
        if k > 0:
            plan = self._guard(task, found[:k], start)
        self.last_search_seconds = time.perf_counter() - start
        # beam false: the task was over beam_max_work (table-wise grid and memory-forced splits only)
        self.last_search_info = {**self.models().info, "beam": search.beam_ran}
        if self.last_floor is not None:
            self.last_search_info["floor"] = self.last_floor
        if search.costly_split is not None:  # the beam did not run and the costliest tables were cut
            self.last_search_info["costly_split"] = search.costly_split
        fallbacks = search.sim.predictor.fallbacks if isinstance(search.sim.predictor, BatchCostModels) else None
        if fallbacks:  # the search's all-to-alls the comm models could not be trusted on
            self.last_search_info["comm_fallbacks"] = dict(fallbacks)
        self.last_costs = self.predicted_costs(task, plan)
        self.last_predicted_cost_ms = self.last_costs.plan_cost_ms
        tables = task.table_by_name
        self.last_stats = {
            "greedy_runs": search.greedy_runs,
            "caps_run": len(search.partitioner.last_caps),
            "steps_forked": search.partitioner.steps_forked,
            "incremental": search.incremental,
            "beam": search.beam_ran,
            "pieces": len(plan.shards),
            "row_wise_tables": len({s.table for s in plan.shards if s.rows < tables[s.table].rows}),
            **vars(search.sim.stats),
        }
        log.debug("neuroshard %s: %.1f ms predicted, %s", task.name, self.last_predicted_cost_ms, self.last_stats)
        return plan


    def _floored(self, task: Task, plan: Plan) -> Plan:
        """`plan` (the search's pick), or the cheapest `floor` heuristic's plan where the
        search's models price `plan` above it (`embshard.search.floor`); what was done in
        `last_floor` (None: off)."""
        plan, self.last_floor = self.floor.apply(task, plan, lambda p: self.predicted_costs(task, p).plan_cost_ms,
                                                 self.name)
        return plan

    def _guard(self, task: Task, found: list[tuple[Plan, float]], start: float) -> Plan:
        """The measured guard (`MeasuredGuard`) on the search's best plans, labelled
        `<name>#1`, `<name>#2`, … in the search's order."""
        plan, self.last_guard = self.guard.run(
            task, [(f"{self.name}#{i + 1}", p) for i, (p, _) in enumerate(found)], self.evaluator,
            lambda p: self.predicted_costs(task, p).plan_cost_ms, self.name,
            refiner=self.refinement_for(task) if self.guard.refine else None)
        return plan

    def refinement_for(self, task: Task) -> MeasuredRefinement:
        """The guard's refiner on `task`: the models searched against, on the planning view."""
        sim = self.simulator_for(task)
        view, _ = planning_view(task, self.trace_histograms == "replay")
        return MeasuredRefinement(view, sim, batch_ratio(sim.predictor, task))
