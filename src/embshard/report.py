"""Comparison tables and charts of algorithms over tasks."""

from __future__ import annotations

import math
import os
from statistics import mean
from typing import Any, Sequence

from embshard.compare import Result
from embshard.io import save_png


def summarize(results: Sequence[Result], metric: str = "measured_cost_ms") -> list[dict[str, Any]]:
    """Per algorithm: valid plans, mean cost, mean ratio to the best plan per task, search time.

    Tasks where an algorithm found no valid plan count against it in `valid`, never silently
    drop out: the ratio is averaged over the tasks it solved, and `valid` says how many.
    """
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
        rows.append(
            {
                "algorithm": alg,
                "valid": sum(r.valid for r in mine),
                "tasks": len(mine),
                f"mean_{metric}": mean(costs) if costs else None,
                "mean_ratio_to_best": mean(ratios) if ratios else None,
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


def _costs_of(r: Result, metric: str):
    return r.measured if metric == "measured_cost_ms" else r.estimated


def format_table(rows: Sequence[dict[str, Any]], metric: str) -> str:
    """A fixed-width text table of `summarize` rows: cost, spread, ratio to the best plan,
    compute imbalance (max / mean device), gap to the balance reference (mean compute + the
    slowest device's comm), device shards outside the cost models' training envelope, and
    search time."""
    header = ["algorithm", "valid", f"{metric.replace('_ms', '')} (ms)", "± spread", "vs best", "imbalance",
              "gap to balance", "out of envelope", "search (s)"]
    lines = []
    for r in rows:
        ood = "-" if r.get("devices") is None else f"{r['out_of_envelope_devices']}/{r['devices']}"
        lines.append(
            [
                r["algorithm"],
                f"{r['valid']}/{r['tasks']}",
                _fmt(r[f"mean_{metric}"], "{:.3f}"),
                _fmt(r.get("mean_spread_ms"), "{:.3f}"),
                _fmt(r["mean_ratio_to_best"], "{:.3f}x"),
                _fmt(r.get("mean_compute_imbalance"), "{:.2f}x"),
                _fmt(r.get("mean_gap_pct"), "{:+.1f}%"),
                ood,
                _fmt(r["mean_search_seconds"], "{:.3f}"),
            ]
        )
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(l, widths)) for l in lines]
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
    fig, (ax_cost, ax_ratio) = plt.subplots(1, 2, figsize=(max(9.0, 2.0 * len(names)), 4.4))
    ax_cost.bar(range(len(names)), [r[f"mean_{metric}"] for r in rows], yerr=[r.get("mean_spread_ms") or 0.0 for r in rows],
                capsize=4, color="#4C72B0", alpha=0.85, label="mean over tasks (± spread)")
    ax_ratio.bar(range(len(names)), [r["mean_ratio_to_best"] for r in rows], color="#DD8452", alpha=0.85, label="mean")
    for i, name in enumerate(names):
        mine = [r for r in results if r.algorithm == name and getattr(r, metric) is not None]
        ax_cost.scatter([i] * len(mine), [getattr(r, metric) for r in mine], color="black", s=12, zorder=3,
                        label="one task" if i == 0 else None)
        ax_ratio.scatter([i] * len(mine), [getattr(r, metric) / best[r.task] for r in mine], color="black", s=12,
                         zorder=3, label="one task" if i == 0 else None)
    for ax in (ax_cost, ax_ratio):
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.legend(loc="best", fontsize=8)
    ax_cost.set_ylabel(f"{metric.replace('_ms', '').replace('_', ' ')} (ms, lower is better)")
    ax_cost.set_title("Plan cost: max over devices of compute + all-to-all", fontsize=10)
    ax_ratio.axhline(1.0, color="gray", lw=0.8)
    ax_ratio.set_ylabel("cost / best algorithm's cost on the task")
    ax_ratio.set_title("Relative to the best plan per task", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)
    return True
