"""How much "the best heuristic per task" flatters itself, read from the evaluation's own rounds.

Every measured evaluation divides a plan's cost by the cheapest of the six heuristics' plans in
the same measurement. That cheapest is a minimum over noisy values, so on average it is lower
than the same plan would measure again (selection: the heuristic that drew a lucky measurement
wins); the closer the heuristics, the larger the effect. Every ratio to it is pushed up, against
the planner. A planner's own choice (the measured guard's) is made on measurements of its own and
read on the evaluation's, so it has no such help.

A measurement of `rounds=2` (the evaluations' setting) holds two independent visits of every plan
(`plan_cost_samples_ms` is visit-major: the first half is round 1). Each round's median then
gives, per task and algorithm, two readings of its ratio on the other round B:

* in-sample: to the cheapest heuristic in round B, the report's rule on one round (pushed up);
* held out: to the heuristic that was cheapest in round A, read in round B: the baseline a user
  gets who measures the six heuristics once and keeps the best (pushed down a little against the
  report's pick, since one round picks less surely than two).

both averaged over the two ways round a task's rounds can be A and B. The report's ratio should
sit near the first. The best heuristic's true cost lies, on average, between the in-sample
minimum and the held-out pick's cost, so their quotient (`selection`) bounds how far the
report's baseline flatters itself: not at all where it is 1.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import numpy as np

from embshard.report import HEURISTICS


def _samples(row: dict[str, Any]) -> list[float] | None:
    if not row.get("valid") or row.get("measured_cost_ms") is None:
        return None
    s = (row.get("measured_device_costs") or {}).get("plan_cost_samples_ms") or []
    return [float(x) for x in s] if len(s) >= 2 else None


def _two_rounds(s: list[float]) -> tuple[list[float], list[float]]:
    """A plan's samples as its two rounds (round-major, an even count)."""
    n = len(s) // 2
    return s[:n], s[n:]


def heldout_ratios(report: dict[str, Any], algorithms: Sequence[str] | None = None,
                   heuristics: Sequence[str] = HEURISTICS) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows, skipped tasks) of a measured report.json (shard.py's, `rounds` >= 2). A row per
    (task, algorithm): `report`, the ratio to the best heuristic as report.json has it;
    `in_sample` and `held_out` (module docstring), each the mean over the two ways round;
    `selection`, the cheapest heuristic in round B over the one picked in round A (<= 1, the
    same for every algorithm of the task): how far the in-sample baseline sits below the held-out one.
    `algorithms`: those to read (None: every algorithm, heuristics included). A task is skipped
    (named in the second list) where its plans' samples do not split into two rounds of equal
    length (a plan measured on one round only), or fewer than two heuristics have samples."""
    by_task: dict[str, dict[str, dict[str, Any]]] = {}
    for row in report.get("results", []):
        by_task.setdefault(row["task"], {})[row["algorithm"]] = row
    out, skipped = [], []
    for task, rows in by_task.items():
        samples = {a: s for a, r in rows.items() if (s := _samples(r)) is not None}
        hs = [h for h in heuristics if h in samples]
        lengths = {len(s) for s in samples.values()}
        if len(hs) < 2 or len(lengths) != 1 or next(iter(lengths)) % 2:
            skipped.append(task)
            continue
        medians = {a: [statistics.median(part) for part in _two_rounds(s)] for a, s in samples.items()}
        rounds = [{a: m[0] for a, m in medians.items()}, {a: m[1] for a, m in medians.items()}]
        best = min(hs, key=lambda h: rows[h]["measured_cost_ms"])
        for a in (algorithms if algorithms is not None else list(samples)):
            if a not in samples:
                continue
            in_sample, held_out, selection = [], [], []
            for pick_on, read_on in ((rounds[0], rounds[1]), (rounds[1], rounds[0])):
                picked = min(hs, key=lambda h: (pick_on[h], h))
                cheapest = min(read_on[h] for h in hs)
                in_sample.append(read_on[a] / cheapest)
                held_out.append(read_on[a] / read_on[picked])
                selection.append(cheapest / read_on[picked])
            out.append({"task": task, "algorithm": a,
                        "report": rows[a]["measured_cost_ms"] / rows[best]["measured_cost_ms"],
                        "in_sample": statistics.fmean(in_sample), "held_out": statistics.fmean(held_out),
                        "selection": statistics.fmean(selection)})
    return out, skipped


def _round_medians(report: dict[str, Any]) -> dict[str, dict[str, tuple[float, float]]]:
    """{task: {algorithm: (round-1 median, round-2 median)}} of plans with an even number of samples."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for row in report.get("results", []):
        s = _samples(row)
        if s is not None and len(s) % 2 == 0:
            first, second = _two_rounds(s)
            out.setdefault(row["task"], {})[row["algorithm"]] = (statistics.median(first), statistics.median(second))
    return out


def round_noise(reports: Sequence[dict[str, Any]], heuristics: Sequence[str] = HEURISTICS) -> float:
    """The spread of one round's reading of a plan's cost, as a share (the standard deviation of
    its log), from the heuristics' two rounds in `reports`: the part of round 1 over round 2 that
    differs between the plans of a task (a shift common to a task's plans cancels in a ratio)."""
    dev, dof = 0.0, 0
    for report in reports:
        for plans in _round_medians(report).values():
            logs = [np.log(a / b) for h, (a, b) in plans.items() if h in heuristics]
            if len(logs) >= 2:
                dev += float(np.sum((np.asarray(logs) - np.mean(logs)) ** 2))
                dof += len(logs) - 1
    if dof == 0:
        raise ValueError("no task with two heuristics measured on two rounds")
    return float(np.sqrt(dev / dof / 2.0))  # a difference of two rounds has twice one round's variance


def expected_selection(report: dict[str, Any], noise: float, rounds: int = 2, draws: int = 2000, seed: int = 0,
                       heuristics: Sequence[str] = HEURISTICS) -> dict[str, float]:
    """Per task, a plug-in estimate of how far the report's baseline sits below the best heuristic's
    cost: E[min over heuristics of its cost read over `rounds` rounds] / min of the costs, taking
    each heuristic's measured cost as its true one and one round's spread `noise` (`round_noise`).
    It understates the effect where heuristics are closer than measured (their measured gaps
    carry noise too); `selection` of `heldout_ratios` bounds it from the other side."""
    rng = np.random.default_rng(seed)
    out = {}
    by_task: dict[str, list[float]] = {}
    for row in report.get("results", []):
        if row["algorithm"] in heuristics and row.get("valid") and row.get("measured_cost_ms"):
            by_task.setdefault(row["task"], []).append(float(row["measured_cost_ms"]))
    for task, costs in by_task.items():
        if len(costs) < 2:
            continue
        mu = np.asarray(costs)
        draw = mu * np.exp(rng.normal(0.0, noise / np.sqrt(rounds), size=(draws, len(mu))))
        out[task] = float(draw.min(axis=1).mean() / mu.min())
    return out


def repetition_spread(reports: Sequence[dict[str, Any]]) -> float:
    """The median distance (as a share, |log|) of a repetition from its round's median, over
    every plan's rounds in `reports` (the repetition equal to the median left out): how much a
    round's own repetitions scatter, beside `round_noise` between rounds."""
    dev, plans = [], 0
    for report in reports:
        for row in report.get("results", []):
            s = _samples(row)
            if s is None or len(s) % 2:
                continue
            plans += 1
            for part in _two_rounds(s):
                m = statistics.median(part)
                dev += [abs(float(np.log(v / m))) for v in part if v != m]
    if not plans:
        raise ValueError("no plan measured on two rounds")
    return float(statistics.median(dev)) if dev else 0.0
