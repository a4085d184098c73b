"""Measured refinement: the plans the guard measured in its first round correct the cost
model on this task, and the best measured plan is improved against the corrected model.

A cost model trained on other tables is off by a few percent to tens of percent on any one
device shard of a task it never saw (compute MAPE about 10% on held-out shards); the
planners balance devices to the model, so the measured plan is unbalanced by about that much.
Round 1 of the measured guard (`embshard.search.guard`) has just measured every device of
every candidate and heuristic plan: tens of shards of the task's own tables. From them:

1. **Correction** (`fit_correction`): per table a term g_t on the compute model, fitted by
   ridge least squares on the measured shards, measured / predicted = b + sum_t w_t g_t, where
   w_t is table t's share of the shard's predicted cost alone (a table the model underprices
   raises every shard it is in, by its share: a table at a quarter of a shard that truly costs
   3x what the model says makes the shard 1.5x). b is one factor for the whole task (the
   machine's speed against the model's); the g_t are penalised towards 0.
2. **Refinement** (`Refiner.refine`): a hill climb from the best measured plan. Each device's
   cost is anchored on its own measurement: a device whose pieces change costs its measured
   compute times the corrected model's ratio of its new shard to its measured one; the
   critical path's comm is the measured plan's, moved by the model's change. Each step takes
   the best move of one piece off the slowest device, or swap of one of its pieces with a
   piece of another device (whole-row pieces only: table-wise tables and column slices;
   memory and table constraints kept), while it gains at least `min_gain` of the plan cost,
   `max_moves` steps at most.

The refined plan is a new candidate: the guard measures it in paired rounds against the best
heuristic like any other and keeps it only where it is shown better (a correction fitted on
noise only costs measuring time).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from embshard.costs.base import DeviceCosts
from embshard.errors import PlanError
from embshard.plan import Plan, Shard, device_pieces, piece_table, validate
from embshard.search.simulator import Simulator
from embshard.task import Task

#: the ridge penalty per measured shard on each table's term (the bias is not penalised)
RIDGE = 0.001


@dataclass
class Correction:
    """Per-table terms on a compute model for one task (module docstring, step 1): a shard
    costs its prediction times `bias` + the sum over its tables of share x `factors`."""

    bias: float
    factors: dict[str, float]
    shards: int
    #: root mean square of measured / predicted - 1 over the shards, before (with the bias
    #: alone: the machine's speed) and after
    rms_before: float
    rms_after: float

    def factor(self, table: str) -> float:
        return self.factors.get(table, 0.0)

    def scale(self, shares: Sequence[float], tables: Sequence[str]) -> float:
        """What a shard's prediction is multiplied by: `bias` + the sum of its tables' terms
        weighted by their `shares` of its predicted cost alone; at least a tenth of `bias` (a
        table the fit drives negative still costs something)."""
        return max(0.1 * self.bias, self.bias + sum(w * self.factor(t) for w, t in zip(shares, tables)))

    def to_dict(self) -> dict[str, Any]:
        return {"bias": round(self.bias, 4), "shards": self.shards, "rms_before": round(self.rms_before, 4),
                "rms_after": round(self.rms_after, 4),
                "largest": dict(sorted(((k, round(v, 3)) for k, v in self.factors.items()),
                                       key=lambda kv: -abs(kv[1]))[:5])}


def shares(alone: np.ndarray) -> np.ndarray:
    """Each table's share of a shard: its predicted cost alone over the shard's tables' sum
    (equal shares where the model prices them all at 0)."""
    total = float(alone.sum())
    return alone / total if total > 0 else np.full(len(alone), 1.0 / len(alone))


def fit_correction(view: Task, simulator: Simulator, ratio: float, plans: Sequence[Plan],
                   costs: Sequence[DeviceCosts], ridge: float = RIDGE) -> Correction | None:
    """The correction the measured `costs` of `plans` give (`view`: the task as the model sees
    it; `ratio`: predicted ms times it are the task's batch). None when nothing was measured."""
    names = [t.name for t in view.tables]
    col = {n: i for i, n in enumerate(names)}
    rows: list[np.ndarray] = []
    ys: list[float] = []
    seen: set[tuple] = set()
    for plan, c in zip(plans, costs):
        per = device_pieces(view, plan)
        pred = simulator.compute_of(per) * ratio
        alone = [simulator.compute_of([[p] for p in pieces]) if pieces else np.zeros(0) for pieces in per]
        for d, pieces in enumerate(per):
            key = tuple(sorted((p.name, p.rows, p.dim) for p in pieces))
            if not pieces or key in seen or not (c.compute_ms[d] > 0 and pred[d] > 0):
                continue
            seen.add(key)  # the same shard in two plans: one equation (its measurements agree)
            w = np.zeros(len(names) + 1)
            w[-1] = 1.0
            for p, share in zip(pieces, shares(alone[d])):
                w[col[p.name]] += share
            rows.append(w)
            ys.append(float(c.compute_ms[d] / pred[d]))
    if not rows:
        return None
    a = np.asarray(rows)
    y = np.asarray(ys)
    scale = float(np.median(y))  # the penalty is relative to the machine's speed
    penalty = ridge * len(y) * np.eye(a.shape[1])
    penalty[-1, -1] = 1e-9
    f = scale * np.linalg.solve(a.T @ a + penalty, a.T @ (y / scale))
    used = a[:, :-1].any(axis=0)
    return Correction(bias=float(f[-1]), factors={n: float(f[i]) for i, n in enumerate(names) if used[i]},
                      shards=len(y), rms_before=float(np.sqrt(np.mean((y / np.mean(y) - 1) ** 2))),
                      rms_after=float(np.sqrt(np.mean((y / (a @ f) - 1) ** 2))))


@dataclass
class Refiner:
    """The hill climb of step 2 (module docstring) on one task.

    Args:
        task: the task as given (memory, constraints, the plan's validity).
        view: the task as the cost model sees it (`planning_view`: every table with a histogram).
        simulator: the compute and comm predictor, cached.
        ratio: predicted ms times `ratio` are the task's batch (`batch_ratio`).
        correction: from `fit_correction`.
        max_moves: steps at most. min_gain: the least predicted gain of a step, relative.
    """

    task: Task
    view: Task
    simulator: Simulator
    ratio: float
    correction: Correction
    max_moves: int = 32
    min_gain: float = 0.005
    info: dict[str, Any] = field(default_factory=dict)

    def refine(self, plan: Plan, measured: DeviceCosts) -> Plan:
        """A plan the corrected model expects cheaper than `plan` (whose measured costs are
        `measured`), or `plan` itself; `info` says what was done."""
        task, sim, d_count = self.task, self.simulator, self.task.num_devices
        shards = list(plan.shards)
        copies = Counter(s.rectangle for s in shards)
        self.info = {"moves": 0, "start": plan.algorithm}
        if plan.row_maps or any(s.replica or copies[s.rectangle] > 1 for s in shards):
            self.info["skipped"] = "replicated pieces"
            return plan
        tables = self.view.table_by_name
        real = task.table_by_name
        pieces = [piece_table(tables[s.table], s) for s in shards]
        movable = [s.rows == real[s.table].rows for s in shards]
        mem = [task.shard_memory_bytes(real[s.table], s.rows, s.dim) for s in shards]
        alone = sim.compute_of([[p] for p in pieces])
        dims = np.array([s.dim for s in shards])
        device = np.array([s.device for s in shards])
        budget = task.device_memory_bytes

        def corrected(sets: Sequence[Sequence[int]]) -> np.ndarray:
            """The corrected model's compute ms of each set of shard indices."""
            pred = sim.compute_of([[pieces[i] for i in s] for s in sets]) * self.ratio
            out = np.zeros(len(sets))
            for k, s in enumerate(sets):
                if s:
                    out[k] = pred[k] * self.correction.scale(shares(alone[list(s)]), [shards[i].table for i in s])
            return out

        orig_sets = [tuple(np.flatnonzero(device == d).tolist()) for d in range(d_count)]
        orig_model = corrected(orig_sets)
        m = np.asarray(measured.compute_ms, dtype=np.float64)

        def anchored(sets: Sequence[Sequence[int]], devices: Sequence[int]) -> np.ndarray:
            model = corrected(sets)
            out = np.empty(len(sets))
            for k, d in enumerate(devices):
                if orig_sets[d] and orig_model[d] > 0 and m[d] > 0:
                    out[k] = m[d] * model[k] / orig_model[d]
                else:  # nothing measured on this device: the corrected model alone
                    out[k] = model[k]
            return out

        def comm_path(widths: np.ndarray, compute: np.ndarray) -> np.ndarray:
            """[n, D] widths and compute ms -> the model's comm on each row's critical path."""
            fw, bw = sim.comm(widths, compute / self.ratio)
            total = compute + self.ratio * (fw + bw)
            return total.max(axis=1) - compute.max(axis=1)

        sets = [list(s) for s in orig_sets]
        compute = m.copy()
        used = np.array([sum(mem[i] for i in s) for s in sets], dtype=np.int64)
        widths = np.array([[int(dims[s].sum()) if s else 0 for s in sets]])
        path0 = comm_path(widths, compute[None, :])[0]
        measured_path = measured.plan_cost_ms - float(m.max())
        cost = float(compute.max()) + measured_path
        start_cost = cost
        names_on = [Counter(shards[i].table for i in s) for s in sets]
        tried_invalid: set[tuple] = set()
        for _ in range(self.max_moves):
            b = int(np.argmax(compute))
            cands: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []  # (b's set, e's set, e)
            for i in sets[b]:
                if not movable[i]:
                    continue
                for e in range(d_count):
                    if e == b:
                        continue
                    if names_on[e][shards[i].table] == 0 and used[e] + mem[i] <= budget:
                        cands.append((tuple(j for j in sets[b] if j != i), tuple(sets[e]) + (i,), e))
                    for j in sets[e]:
                        if not movable[j] or shards[j].table == shards[i].table:
                            continue
                        if names_on[e][shards[i].table] or names_on[b][shards[j].table]:
                            continue
                        if used[e] - mem[j] + mem[i] > budget or used[b] - mem[i] + mem[j] > budget:
                            continue
                        cands.append((tuple(k for k in sets[b] if k != i) + (j,),
                                      tuple(k for k in sets[e] if k != j) + (i,), e))
            cands = [c for c in cands if (c[0], c[1]) not in tried_invalid]
            if not cands:
                break
            new_b = anchored([c[0] for c in cands], [b] * len(cands))
            new_e = anchored([c[1] for c in cands], [c[2] for c in cands])
            comp = np.repeat(compute[None, :], len(cands), axis=0)
            wid = np.repeat(widths, len(cands), axis=0)
            for k, c in enumerate(cands):
                comp[k, b], comp[k, c[2]] = new_b[k], new_e[k]
                wid[k, b], wid[k, c[2]] = int(dims[list(c[0])].sum()) if c[0] else 0, int(dims[list(c[1])].sum())
            totals = comp.max(axis=1) + measured_path + (comm_path(wid, comp) - path0)
            accepted = False
            for k in np.argsort(totals, kind="stable"):
                if totals[k] > cost * (1 - self.min_gain):
                    break
                c = cands[k]
                trial_sets = [list(s) for s in sets]
                trial_sets[b], trial_sets[c[2]] = list(c[0]), list(c[1])
                trial = self._plan(plan, shards, trial_sets)
                try:
                    validate(task, trial)
                except PlanError:
                    tried_invalid.add((c[0], c[1]))
                    continue
                sets = trial_sets
                compute, widths, cost = comp[k], wid[k:k + 1], float(totals[k])
                used = np.array([sum(mem[i] for i in s) for s in sets], dtype=np.int64)
                names_on = [Counter(shards[i].table for i in s) for s in sets]
                self.info["moves"] += 1
                accepted = True
                break
            if not accepted:
                break
        self.info |= {"expected_ms": round(cost, 3), "start_ms": round(start_cost, 3)}
        if not self.info["moves"]:
            return plan
        return self._plan(plan, shards, sets)

    def _plan(self, plan: Plan, shards: Sequence[Shard], sets: Sequence[Sequence[int]]) -> Plan:
        out = []
        for d, s in enumerate(sets):
            for i in s:
                out.append(Shard(shards[i].table, d, shards[i].col_offset, shards[i].dim, shards[i].row_offset,
                                 shards[i].rows, shards[i].replica))
        return Plan(plan.task, "refined", sorted(out, key=lambda x: (x.table, x.col_offset, x.row_offset)))


@dataclass
class MeasuredRefinement:
    """What the guard calls after its first round (`MeasuredGuard.run(refiner=...)`): fits the
    correction on every plan measured and refines the best measured one.

    Args:
        view, simulator, ratio: as `Refiner`'s (the task as the model sees it, the cached
            predictor, the batch ratio).
        max_moves, min_gain: the hill climb's (`Refiner`).
    """

    view: Task
    simulator: Simulator
    ratio: float
    max_moves: int = 32
    min_gain: float = 0.005

    def propose(self, task: Task, plans: Sequence[Plan], costs: Sequence[DeviceCosts],
                labels: Sequence[str]) -> tuple[Plan | None, dict[str, Any]]:
        """(the refined plan, or None where no step gained; what was done, for report.json)."""
        correction = fit_correction(self.view, self.simulator, self.ratio, plans, costs)
        if correction is None:
            return None, {"skipped": "no measured shard"}
        best = min(range(len(plans)), key=lambda i: (costs[i].plan_cost_ms, i))
        refiner = Refiner(task, self.view, self.simulator, self.ratio, correction, self.max_moves, self.min_gain)
        start = Plan(plans[best].task, labels[best], list(plans[best].shards))
        plan = refiner.refine(start, costs[best])
        info = {"from": labels[best], **{k: v for k, v in refiner.info.items() if k != "start"},
                "correction": correction.to_dict()}
        return (plan if refiner.info["moves"] else None), info
