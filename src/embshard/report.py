"""Comparison tables and charts of algorithms over tasks."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from embshard.compare import PICK_SUFFIX, Result
from embshard.errors import InputError
from embshard.io import save_png
from embshard.stats import RatioSummary, paired_ratio_summary
from embshard.task import Task


#: The heuristics a learned planner must beat: "the best heuristic" of a task is the cheapest
#: of these that ran on it (by the compared metric).
HEURISTICS = ("random", "round_robin", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy")


def plan_file(out_dir: Path, report: dict[str, Any], task: str, algorithm: str) -> Path:
    """Where shard.py wrote a result's plan: plans/<task>/<algorithm>.json, or
    plans/<algorithm>.json in a run of one task."""
    nested = out_dir / "plans" / task / f"{algorithm}.json"
    if nested.exists() or len(report.get("tasks") or []) != 1:
        return nested
    return out_dir / "plans" / f"{algorithm}.json"


def measured_plan_devices(out_dir: Path, task_of: Callable[[str], Task], replay_traces: bool = True,
                          require_plans: bool = False) -> Iterator[tuple[dict[str, Any], Task, list, list[float]]]:
    """Every valid plan of a `shard.py evaluate=measured` out_dir whose devices' compute was
    measured: (its report row, its task, each device's pieces as the cost models see them
    (`planning_view`), each device's measured compute ms). `task_of` finds a task by name. A
    plan without its plan file beside the report is skipped, or, with `require_plans`, an
    InputError naming the file."""
    from embshard.costs.features import planning_view
    from embshard.plan import Plan, device_pieces

    report = json.loads((out_dir / "report.json").read_text())
    for r in report.get("results", []):
        measured = (r.get("measured_device_costs") or {}).get("compute_ms")
        if not r.get("valid") or not measured:
            continue
        path = plan_file(out_dir, report, r["task"], r["algorithm"])
        if not path.exists():
            if require_plans:
                raise InputError(f"{out_dir}: no plan file {path} for {r['algorithm']} on task {r['task']!r}")
            continue
        task = task_of(r["task"])
        view, _ = planning_view(task, replay_traces=replay_traces)
        yield r, task, device_pieces(view, Plan.load(path)), measured


def best_heuristic(results: Sequence[Result], metric: str) -> Result | None:
    """The cheapest heuristic result of one task's results (None when no heuristic has a cost)."""
    costed = [r for r in results if r.algorithm in HEURISTICS and getattr(r, metric) is not None]
    return min(costed, key=lambda r: getattr(r, metric)) if costed else None


def summarize_results(report: dict[str, Any], heuristics: Sequence[str] = HEURISTICS) -> dict[str, dict[str, Any]]:
    """Per algorithm over the tasks of a measured report.json (`shard.py`'s): mean measured cost,
    the ratio to the best heuristic on each task (mean, its bootstrap 95% interval over tasks
    and verdict, 25th-75th percentiles), tasks better than that heuristic and tasks worse
    beyond their own paired interval, the mean gap to the balance reference, mean search
    seconds. A task the algorithm has no measured plan for counts in `invalid`."""
    by_task = _rows_by_task(report)
    algorithms = list(dict.fromkeys(r["algorithm"] for r in report["results"]))
    out = {}
    for a in algorithms:
        costs, ratios, names, seconds, gaps, wins, invalid, worse = [], [], [], [], [], 0, 0, []
        for task, rows in by_task.items():
            best = _best_heuristic_cost(rows, heuristics)
            r = rows.get(a)
            if r is None or not r["valid"] or r["measured_cost_ms"] is None or best is None:
                invalid += 1
                continue
            costs.append(r["measured_cost_ms"])
            ratios.append(r["measured_cost_ms"] / best)
            names.append(task)
            seconds.append(r["search_seconds"] or 0.0)
            wins += r["measured_cost_ms"] < best
            gap = ((r.get("headroom") or {}).get("measured") or {}).get("gap_pct")
            if gap is not None:
                gaps.append(gap)
            iv = (r.get("vs_best_heuristic") or {}).get("interval") or {}
            if iv.get("verdict") == "worse":
                worse.append(task)
        if not costs:
            out[a] = {"tasks": 0, "invalid": invalid}
            continue
        out[a] = {
            "tasks": len(costs),
            "invalid": invalid,
            "mean_cost_ms": float(np.mean(costs)),
            "mean_ratio": float(np.mean(ratios)),
            "ratio_p25": float(np.percentile(ratios, 25)),
            "ratio_p75": float(np.percentile(ratios, 75)),
            "ratio_min": float(np.min(ratios)),
            "ratio_max": float(np.max(ratios)),
            # the mean ratio's bootstrap 95% interval over tasks and its verdict (one task: none)
            "ratio_ci": paired_ratio_summary(ratios).to_dict() if len(ratios) > 1 else None,
            # tasks whose own paired interval (repetitions) lies above 1
            "worse_beyond_interval": len(worse),
            "worse_tasks": worse,
            "mean_gap_pct": float(np.mean(gaps)) if gaps else None,
            "beats_best_heuristic": int(wins),
            "mean_search_seconds": float(np.mean(seconds)),
            "ratios": [round(x, 4) for x in ratios],
            "task_names": names,  # the task of each ratio
        }
    return out


def _rows_by_task(report: dict[str, Any]) -> dict[str, dict[str, dict]]:
    """A report.json's results as task -> algorithm -> result."""
    by_task: dict[str, dict[str, dict]] = {}
    for r in report["results"]:
        by_task.setdefault(r["task"], {})[r["algorithm"]] = r
    return by_task


def _best_heuristic_cost(rows: dict[str, dict], heuristics: Sequence[str]) -> float | None:
    """The cheapest measured cost among one task's valid heuristic results (None: no heuristic)."""
    return min((rows[h]["measured_cost_ms"] for h in heuristics if h in rows and rows[h]["valid"]), default=None)


def room_left(report: dict[str, Any], heuristics: Sequence[str] = HEURISTICS) -> list[float]:
    """Per task of a measured report.json, the lowest balance reference of its measured plans
    (mean device compute + the slowest device's comm) over the best heuristic's measured cost:
    how low a ratio to that heuristic the plans measured leave room for. A reference, not a
    bound: a plan better balanced, or with cheaper fused kernels, than every plan measured on
    the task can go below it. Tasks without a heuristic or a reference are left out."""
    ratios = []
    for rows in _rows_by_task(report).values():
        best = _best_heuristic_cost(rows, heuristics)
        refs = [((r.get("headroom") or {}).get("measured") or {}).get("balance_reference_ms")
                for r in rows.values() if r["valid"] and r.get("measured_cost_ms") is not None]
        refs = [x for x in refs if x is not None and x > 0]
        if best is not None and refs:
            ratios.append(min(refs) / best)
    return ratios


#: guarded algorithms whose guard `guard_agreement` and `guard_reversals` read, in order of preference
GUARDED = ("portfolio", "neuroshard")


def guard_agreement(report: dict[str, Any], guarded: Sequence[str] = GUARDED) -> dict[str, tuple[float, int]]:
    """Per task of a measured report.json: how far its final measurement of the plans agrees
    with the guard's first round, which measured the same plans on the same machine minutes
    before (the first guarded algorithm of `guarded` with a guard). The standard deviation, over
    the plans both measured, of log(final cost / guard's cost), and the number of plans. A
    change of speed that hits every plan alike leaves it near 0; a disturbed measurement, in
    which some plans slow more than others, raises it (and the ratios between plans it reports
    are then not those of the quiet machine). A guard candidate is matched to the result of the
    same name, NeuroShard's search pick to its `neuroshard_pick` result. Tasks without a guard, or with
    fewer than 3 plans in common, are left out."""
    out: dict[str, tuple[float, int]] = {}
    for task, rows in _rows_by_task(report).items():
        guard = _first_guard(rows, guarded, lambda g: bool(g.get("candidates")))
        if guard is None:
            continue
        logs = []
        for c in guard["candidates"]:
            r = _final_row(rows, c["label"])
            if r and c.get("measured_ms"):
                logs.append(math.log(r["measured_cost_ms"] / c["measured_ms"]))
        if len(logs) >= 3:
            out[task] = (float(np.std(logs)), len(logs))
    return out


def _first_guard(rows: dict[str, dict], guarded: Sequence[str],
                 usable: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """The guard of one task's first algorithm of `guarded` whose guard is `usable`, else None."""
    return next((rows[a]["guard"] for a in guarded if a in rows and rows[a].get("guard") and usable(rows[a]["guard"])),
                None)


def _final_row(rows: dict[str, dict], label: str) -> dict[str, Any] | None:
    """The final measurement's valid, measured result of a guard's plan `label` (NeuroShard's
    search pick is its `neuroshard_pick` result), else None."""
    r = rows.get(label + PICK_SUFFIX if label == "neuroshard" else label)
    return r if r and r["valid"] and r.get("measured_cost_ms") else None


def guard_reversals(report: dict[str, Any], guarded: Sequence[str] = GUARDED) -> dict[str, dict[str, Any]]:
    """Per task of a measured report.json: the pair of plans whose cost ratio the final
    measurement moved most from the guard's paired rounds (the plans the guard measured in every
    one of its rounds, the same guard `guard_agreement` reads). A per-pair check beside that
    function's spread: one plan moving 20% while the rest hold raises the spread little, yet it
    can reverse the ranking the guard settled over many rounds. For the pair (a, b): the guard's
    ratio of their mean costs over its rounds, the final measurement's ratio, and the shift
    log(final ratio / guard ratio) (a positive shift: a got dearer against b). Tasks without a
    guard of at least 2 rounds, or with fewer than 2 paired plans measured at the end, are left
    out."""
    out: dict[str, dict[str, Any]] = {}
    for task, rows in _rows_by_task(report).items():
        guard = _first_guard(rows, guarded, lambda g: len(g.get("rounds") or []) >= 2)
        if guard is None:
            continue
        rounds = guard["rounds"]
        paired = [label for label in rounds[0] if all(label in r for r in rounds)]
        guard_ms, final_ms = {}, {}
        for label in paired:
            r = _final_row(rows, label)
            if r:
                guard_ms[label] = float(np.mean([rd[label] for rd in rounds]))
                final_ms[label] = float(r["measured_cost_ms"])
        worst = None
        names = list(guard_ms)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                shift = math.log((final_ms[a] / final_ms[b]) / (guard_ms[a] / guard_ms[b]))
                if worst is None or abs(shift) > abs(worst["shift"]):
                    a_, b_, s_ = (a, b, shift) if shift >= 0 else (b, a, -shift)
                    worst = {"pair": (a_, b_), "guard_ratio": guard_ms[a_] / guard_ms[b_],
                             "final_ratio": final_ms[a_] / final_ms[b_], "shift": s_, "rounds": len(rounds)}
        if worst is not None:
            out[task] = worst
    return out


def setting_reports(runs: str | os.PathLike, settings: Sequence[str],
                    more: Sequence[str | os.PathLike] = ()) -> dict[str, dict[str, Any]]:
    """Every `<runs>/<setting>/report.json`: the named settings first, in their order, then any
    other folder by name. `more` runs hold other tasks of the same settings (run separately,
    e.g. a later batch): their results join the main run's, a setting only a `more` run holds
    counts too, and a task two runs hold is an error."""
    folders = [Path(runs), *(Path(r) for r in more)]
    for run in folders:
        if not run.is_dir():
            raise InputError(f"{run}: no such runs folder")
    found = {p.name for run in folders for p in run.iterdir() if p.is_dir()}
    names = list(settings) + sorted(found - set(settings))
    reports: dict[str, dict[str, Any]] = {}
    for name in names:
        report: dict[str, Any] | None = None
        for run in folders:
            g = run / name / "report.json"
            if not g.is_file():
                continue
            data = json.loads(g.read_text())
            if report is None:
                report, first = data, g
                continue
            both = {r["task"] for r in report["results"]} & {r["task"] for r in data["results"]}
            if both:
                raise InputError(f"{g}: task {sorted(both)[0]!r} is also in {first}; `more` runs must hold other tasks")
            report = dict(report, results=report["results"] + data["results"])
        if report is not None:
            reports[name] = report
    return reports


def summaries_by_setting(runs: str | os.PathLike, settings: Sequence[str],
                         extra: Sequence[str | os.PathLike] = (),
                         more: Sequence[str | os.PathLike] = ()) -> dict[str, dict[str, dict[str, Any]]]:
    """`summarize_results` of every `<runs>/<setting>/report.json`: the named settings first, in
    their order, then any other folder by name. `more` runs hold other tasks of the same settings
    (run separately, e.g. a later batch): their results join the main run's, and a task both
    hold is an error. An `extra` run of the same tasks (a later pass with other algorithms,
    judged against its own heuristics) adds the algorithms the main run lacks, each marked with
    `run`."""
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for name, report in setting_reports(runs, settings, more).items():
        summary[name] = summarize_results(report)
        for run in extra:
            g = Path(run) / name / "report.json"
            if g.is_file():
                for a, m in summarize_results(json.loads(g.read_text())).items():
                    summary[name].setdefault(a, dict(m, run=str(Path(run))))
    return summary


def settings_markdown(summary: dict[str, dict[str, dict[str, Any]]], cell: Callable[[dict[str, Any]], str],
                      headers: Sequence[str] | None = None, first: str = "algorithm") -> list[str]:
    """The lines of a markdown table over `summaries_by_setting`'s result: one row per algorithm
    (in order of first appearance), one column per setting (`headers`, else the settings'
    names), `cell(m)` of the algorithm's summary there, '-' where it has no task."""
    settings = list(summary)
    algorithms = list(dict.fromkeys(a for s in settings for a in summary[s]))
    lines = [f"| {first} | " + " | ".join(headers if headers is not None else settings) + " |",
             "|---" * (len(settings) + 1) + "|"]
    for a in algorithms:
        lines.append(f"| {a} | " + " | ".join(cell(summary[s][a]) if summary[s].get(a, {}).get("tasks") else "-"
                                             for s in settings) + " |")
    return lines


def paired_samples_ratio(a: Result, b: Result) -> RatioSummary | None:
    """a / b within one task, from the two plans' per-repetition measured costs (paired by
    repetition: measured in the same interleaved visit); None without paired samples."""
    sa = a.measured.plan_cost_samples_ms if a.measured else []
    sb = b.measured.plan_cost_samples_ms if b.measured else []
    if len(sa) < 2 or len(sa) != len(sb) or min(sa + sb) <= 0:
        return None
    return paired_ratio_summary([x / y for x, y in zip(sa, sb)])


def vs_best_heuristic(results: Sequence[Result], metric: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (task, algorithm): the cost ratio to the task's best heuristic, and, where the two
    were measured together, the bootstrap 95% interval of the mean paired per-repetition ratio
    with its verdict ("better" / "worse" / "not resolved")."""
    out = {}
    for task in dict.fromkeys(r.task for r in results):
        mine = [r for r in results if r.task == task]
        h = best_heuristic(mine, metric)
        if h is None:
            continue
        for r in mine:
            cost = getattr(r, metric)
            if cost is None:
                continue
            s = paired_samples_ratio(r, h) if r is not h and metric == "measured_cost_ms" else None
            out[(task, r.algorithm)] = {"heuristic": h.algorithm, "ratio": cost / getattr(h, metric),
                                        "interval": s.to_dict() if s is not None else None}
    return out


def summarize(results: Sequence[Result], metric: str = "measured_cost_ms") -> list[dict[str, Any]]:
    """Per algorithm: valid plans, mean cost, mean ratio to the best plan per task, the paired
    ratio to the best heuristic per task (mean over tasks, bootstrap 95% interval over tasks
    from two tasks up, its verdict), search time.

    Tasks where an algorithm found no valid plan count against it in `valid`, never silently
    drop out: the ratio is averaged over the tasks it solved, and `valid` says how many. With
    one task the interval is that task's, over paired repetitions.
    """
    vs_heur = vs_best_heuristic(results, metric)
    algorithms = list(dict.fromkeys(r.algorithm for r in results))
    tasks = list(dict.fromkeys(r.task for r in results))
    best: dict[str, float] = {}
    for task in tasks:
        costs = [getattr(r, metric) for r in results if r.task == task and getattr(r, metric) is not None]
        if costs:
            best[task] = min(costs)
    rows = []
    for alg in algorithms:
        mine = [r for r in results if r.algorithm == alg]
        costs = [getattr(r, metric) for r in mine if getattr(r, metric) is not None]
        ratios = [getattr(r, metric) / best[r.task] for r in mine if getattr(r, metric) is not None and best.get(r.task)]
        spreads = [r.measured.plan_cost_spread_ms for r in mine if r.measured and r.measured.plan_cost_spread_ms is not None]
        costed = [c for c in (_costs_of(r, metric) for r in mine) if c is not None]
        heads = [c.headroom() for c in costed]
        envs = [r.envelope for r in mine if r.envelope]
        heur = [vs_heur[(r.task, alg)] for r in mine if (r.task, alg) in vs_heur]
        rows.append(
            {
                "algorithm": alg,
                "valid": sum(r.valid for r in mine),
                "tasks": len(mine),
                f"mean_{metric}": mean(costs) if costs else None,
                "mean_ratio_to_best": mean(ratios) if ratios else None,
                "vs_best_heuristic": _over_tasks(heur),
                "mean_spread_ms": mean(spreads) if spreads else None,
                "mean_compute_imbalance": mean(h["compute_imbalance"] for h in heads) if heads else None,
                "mean_gap_pct": mean(h["gap_pct"] for h in heads) if heads else None,
                "out_of_envelope_devices": sum(e["out_of_envelope_devices"] for e in envs) if envs else None,
                "devices": sum(e["devices"] for e in envs) if envs else None,
                "mean_search_seconds": mean(r.search_seconds for r in mine if r.search_seconds is not None)
                if any(r.search_seconds is not None for r in mine)
                else None,
            }
        )
    return rows


def _over_tasks(heur: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ratio to the best heuristic over tasks: bootstrap over tasks from two tasks up; one
    task: its own (paired repetitions) interval."""
    if not heur:
        return None
    if len(heur) == 1:
        one = heur[0]
        return {"mean": one["ratio"], "tasks": 1, "basis": "repetitions" if one["interval"] else None,
                **({k: one["interval"][k] for k in ("low", "high", "verdict")} if one["interval"] else
                   {"low": None, "high": None, "verdict": "not resolved"})}
    s = paired_ratio_summary([h["ratio"] for h in heur])
    worse = sum(1 for h in heur if h["interval"] and h["interval"]["verdict"] == "worse")
    return {"mean": s.mean, "low": s.low, "high": s.high, "verdict": s.verdict, "tasks": s.n, "basis": "tasks",
            "tasks_worse_beyond_interval": worse}


def ratio_text(v: dict[str, Any] | None) -> str:
    """"0.912x [0.870, 0.951] better" (or "1.020x not resolved" without an interval)."""
    if not v:
        return "-"
    mean_, low, high = v.get("mean", v.get("ratio")), v.get("low"), v.get("high")
    if low is None:
        return f"{mean_:.3f}x" + (" not resolved" if v.get("verdict") else "")
    return f"{mean_:.3f}x [{low:.3f}, {high:.3f}] {v['verdict']}"


def _costs_of(r: Result, metric: str):
    return r.measured if metric == "measured_cost_ms" else r.estimated


#: What each metric is called in a table header.
METRIC_LABELS = {
    "measured_cost_ms": "measured (ms)",
    "estimated_cost_ms": "estimate (ms)",
    "modeled_comm_ms": "modeled comm (ms)",
    "search_seconds": "search (s)",
}


@dataclass(frozen=True)
class Column:
    """One column of a text table: its header and how a row (a dict) becomes its cell."""

    header: str
    cell: Callable[[dict[str, Any]], str]


def summary_columns(metric: str) -> list[Column]:
    """The columns of the across-tasks summary (`summarize` rows); metric "search_seconds"
    (evaluate=none): no cost columns."""
    cost = [] if metric == "search_seconds" else [
        Column(f"mean {METRIC_LABELS.get(metric, metric)}", lambda r: _fmt(r[f"mean_{metric}"], "{:.3f}")),
        Column("± spread", lambda r: _fmt(r.get("mean_spread_ms"), "{:.3f}")),
        Column("vs best", lambda r: _fmt(r["mean_ratio_to_best"], "{:.3f}x")),
        Column("vs best heuristic [95% CI]", lambda r: ratio_text(r.get("vs_best_heuristic"))),
        # beside the ratio: how far the method's own plans are from their balance reference
        Column("gap to balance", lambda r: _fmt(r.get("mean_gap_pct"), "{:+.1f}%")),
        Column("imbalance", lambda r: _fmt(r.get("mean_compute_imbalance"), "{:.2f}x")),
        Column("out of envelope",
               lambda r: "-" if r.get("devices") is None else f"{r['out_of_envelope_devices']}/{r['devices']}"),
    ]
    return [
        Column("algorithm", lambda r: r["algorithm"]),
        Column("valid", lambda r: f"{r['valid']}/{r['tasks']}"),
        *cost,
        Column("mean search (s)", lambda r: _fmt(r["mean_search_seconds"], "{:.3f}")),
    ]


def format_table(rows: Sequence[dict[str, Any]], metric: str) -> str:
    """A fixed-width text table of `summarize` rows: cost, spread, ratio to the best plan, the
    paired ratio to the best heuristic and beside it the gap to the balance reference (mean
    compute + the slowest device's comm: how much of the available gain the method leaves),
    compute imbalance (max / mean device), device shards outside the cost models' training
    envelope, and search time. Columns with nothing to show (every cell "-") are left out."""
    return render(summary_columns(metric), rows)


def result_rows(results: Sequence[Result], metric: str) -> list[dict[str, Any]]:
    """One row per result of one task: its cost, ratio to the task's best, headroom, envelope,
    pieces and memory per device, search time, and the reason when it has no valid plan."""
    costs = [getattr(r, metric) for r in results if getattr(r, metric) is not None]
    best = min(costs) if costs else None
    vs_heur = vs_best_heuristic(results, metric)
    rows = []
    for r in results:
        cost = getattr(r, metric)
        c = _costs_of(r, metric)
        head = c.headroom() if c is not None else {}
        rows.append({
            "algorithm": r.algorithm,
            "valid": r.valid,
            "error": r.error,
            metric: cost,
            "spread_ms": r.measured.plan_cost_spread_ms if r.measured and metric == "measured_cost_ms" else None,
            "ratio_to_best": cost / best if cost is not None and best else None,
            "vs_best_heuristic": vs_heur.get((r.task, r.algorithm)),
            "compute_imbalance": head.get("compute_imbalance"),
            "gap_pct": head.get("gap_pct"),
            "envelope": r.envelope,
            "pieces": r.pieces,
            "memory_bytes": r.memory_bytes,
            "search_seconds": r.search_seconds,
        })
    return rows


def result_columns(metric: str, device_memory_bytes: int) -> list[Column]:
    """The columns of one task's table (`result_rows`)."""
    unit, scale = ("GiB", 2**30) if device_memory_bytes >= 2**30 else ("MiB", 2**20)
    cost = [] if metric == "search_seconds" else [
        Column(METRIC_LABELS.get(metric, metric), lambda r: _fmt(r[metric], "{:.3f}")),
        Column("± spread", lambda r: _fmt(r["spread_ms"], "{:.3f}")),
        Column("vs best", lambda r: _fmt(r["ratio_to_best"], "{:.3f}x")),
        Column("vs best heuristic [95% CI]", lambda r: _heur_cell(r["vs_best_heuristic"])),
        Column("gap to balance", lambda r: _fmt(r["gap_pct"], "{:+.1f}%")),
        Column("imbalance", lambda r: _fmt(r["compute_imbalance"], "{:.2f}x")),
        Column("out of envelope", lambda r: "-" if not r["envelope"]
               else f"{r['envelope']['out_of_envelope_devices']}/{r['envelope']['devices']}"),
    ]
    return [
        Column("algorithm", lambda r: r["algorithm"]),
        Column("plan", lambda r: "valid" if r["valid"] else "INVALID"),
        *cost,
        Column("pieces per device", lambda r: per_device(r["pieces"], "{:d}")),
        Column(f"memory per device ({unit} of {device_memory_bytes / scale:.2f})",
               lambda r: per_device([b / scale for b in r["memory_bytes"]], "{:.2f}")),
        Column("search (s)", lambda r: _fmt(r["search_seconds"], "{:.3f}")),
    ]


def format_results(task: Task, results: Sequence[Result], metric: str) -> str:
    """One task's table: a row per algorithm; an INVALID row gives its reason in place of the
    cells it has no values for."""
    return render(result_columns(metric, task.device_memory_bytes), result_rows(results, metric),
                  reason=lambda r: None if r["valid"] else str(r["error"]))


def _heur_cell(v: dict[str, Any] | None) -> str:
    if not v:
        return "-"
    if v["interval"] is None:
        return f"{v['ratio']:.3f}x" if v["ratio"] != 1.0 else "1.000x (itself)"
    # the interval is of the mean per-repetition (paired) ratio, so it is shown with that mean,
    # which it contains; the ratio of the two medians need not lie inside it
    iv = v["interval"]
    return f"{iv['mean']:.3f}x [{iv['low']:.3f}, {iv['high']:.3f}] {iv['verdict']}"


def per_device(values: Sequence[float], pattern: str, show: int = 8) -> str:
    """Values per device, "a/b/c/d"; past `show` devices, their range."""
    if not values:
        return "-"
    if len(values) <= show:
        return "/".join(pattern.format(v) for v in values)
    return f"{pattern.format(min(values))}..{pattern.format(max(values))} over {len(values)}"


def render(columns: Sequence[Column], rows: Sequence[dict[str, Any]],
           reason: Callable[[dict[str, Any]], str | None] | None = None) -> str:
    """Fixed-width text: a header, a rule, a line per row. A row with a `reason` shows its first
    two cells and then the reason (not padded), instead of the other cells. Columns whose every
    cell is "-" are left out (a cost column when nothing was costed)."""
    cells = [[c.cell(r) for c in columns] for r in rows]
    why = [reason(r) if reason else None for r in rows]
    full = [line for line, w in zip(cells, why) if w is None]
    keep = [i for i in range(len(columns)) if i < 2 or any(line[i] != "-" for line in full)]
    header = [columns[i].header for i in keep]
    widths = [max([len(h)] + [len(line[i]) for line in full]) for i, h in zip(keep, header)]
    widths[:2] = [max([widths[j]] + [len(line[j]) for line in cells]) for j in range(2)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    for line, w in zip(cells, why):
        shown = [line[i].ljust(wd) for i, wd in zip(keep, widths)]
        out.append(("  ".join(shown[:2]) + "  " + w) if w is not None else "  ".join(shown).rstrip())
    return "\n".join(out)


def _fmt(x: float | None, pattern: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else pattern.format(x)


def plot_costs(results: Sequence[Result], path: str | os.PathLike, metric: str = "measured_cost_ms") -> bool:
    """Bar chart of mean cost per algorithm (error bar: mean spread), per-task costs as dots.

    Returns False (and writes nothing) when no result has the metric.
    """
    rows = [r for r in summarize(results, metric) if r[f"mean_{metric}"] is not None]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["algorithm"] for r in rows]
    best: dict[str, float] = {}
    for r in results:
        cost = getattr(r, metric)
        if cost is not None:
            best[r.task] = min(best.get(r.task, cost), cost)
    # what the chart shows (tests check these); the lines marked "no mutate" only style it
    means = [r[f"mean_{metric}"] for r in rows]
    spreads = [r.get("mean_spread_ms") or 0.0 for r in rows]
    ratios = [r["mean_ratio_to_best"] for r in rows]
    fig, (ax_cost, ax_ratio) = plt.subplots(1, 2, figsize=(max(9.0, 2.0 * len(names)), 4.4))  # pragma: no mutate
    bar_style = dict(capsize=4, color="#4C72B0", alpha=0.85, label="mean over tasks (± spread)")  # pragma: no mutate
    ax_cost.bar(range(len(names)), means, yerr=spreads, **bar_style)
    ax_ratio.bar(range(len(names)), ratios, color="#DD8452", alpha=0.85, label="mean")  # pragma: no mutate
    for i, name in enumerate(names):
        mine = [r for r in results if r.algorithm == name and getattr(r, metric) is not None]
        xs, task_costs = [i] * len(mine), [getattr(r, metric) for r in mine]
        task_ratios = [c / best[r.task] for r, c in zip(mine, task_costs)]
        dot = dict(color="black", s=12, zorder=3, label="one task" if i == 0 else None)  # pragma: no mutate
        ax_cost.scatter(xs, task_costs, **dot)
        ax_ratio.scatter(xs, task_ratios, **dot)
    for ax in (ax_cost, ax_ratio):
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")  # pragma: no mutate
        ax.legend(loc="best", fontsize=8)  # pragma: no mutate
    ax_cost.set_ylabel(f"{metric.replace('_ms', '').replace('_', ' ')} (ms, lower is better)")
    ax_cost.set_title("Plan cost: max over devices of compute + all-to-all", fontsize=10)  # pragma: no mutate
    ax_ratio.axhline(1.0, color="gray", lw=0.8)  # pragma: no mutate
    ax_ratio.set_ylabel("cost / best algorithm's cost on the task")  # pragma: no mutate
    ax_ratio.set_title("Relative to the best plan per task", fontsize=10)  # pragma: no mutate
    fig.tight_layout()  # pragma: no mutate
    save_png(fig, path)
    return True
