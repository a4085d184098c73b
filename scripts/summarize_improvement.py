"""Per-task cost of one algorithm against the best heuristic and TorchRec, from shard.py reports.

Example:
    .venv/bin/python scripts/summarize_improvement.py experiments/user_eval/runs/report.json [more ...] [--markdown]
    .venv/bin/python scripts/summarize_improvement.py experiments/user_eval/runs/report.json --by-devices

Per task: the algorithm's measured cost, its search's own pick before the guard (the
`<algorithm>_pick` row, when the guard ran), the best heuristic's (the lowest of the baselines
present), TorchRec's, the ratios, and the paired ratio's bootstrap 95% interval within the task
(repetitions measured in the same visits pair up; report.json's `vs_best_heuristic`) with its
verdict: worse beyond the interval when all of it lies above 1. Then the mean ratio over tasks
with its bootstrap 95% interval over tasks, and "not resolved" where it straddles 1.
`--by-devices`: a markdown table instead, per device count and in all: every algorithm's mean
measured cost with its ratio to the best heuristic and its gap to balance (means per task), the
ratios (mean per task) of the algorithm and of its pick to the best heuristic and to TorchRec,
and mean search seconds.
"""

from __future__ import annotations

import argparse
import json
from statistics import mean

from embshard.stats import paired_ratio_summary

BASELINES = ("random", "round_robin", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy")


def rows_of(report: dict, algorithm: str, metric: str) -> list[dict]:
    tasks: dict[str, dict[str, dict]] = {}
    for r in report["results"]:
        if r.get(metric) is not None:
            tasks.setdefault(r["task"], {})[r["algorithm"]] = r
    out = []
    for task, by in sorted(tasks.items()):
        mine = by.get(algorithm)
        base = {b: by[b] for b in BASELINES if b in by}
        if mine is None or not base:
            continue
        best_name = min(base, key=lambda b: base[b][metric])
        best = base[best_name]
        spread = max(mine.get("measured_spread_ms") or 0.0, best.get("measured_spread_ms") or 0.0)
        row = {
            "task": task,
            "devices": len(mine["memory_bytes"]),
            "mine": mine[metric],
            "pick": by.get(f"{algorithm}_pick", {}).get(metric),
            "best_name": best_name,
            "best": best[metric],
            "torchrec": by.get("torchrec", {}).get(metric),
            "spread": spread,
            "pick_spread": max(by.get(f"{algorithm}_pick", {}).get("measured_spread_ms") or 0.0,
                               best.get("measured_spread_ms") or 0.0),
        }
        row["gap_pct"] = gap_pct(mine, metric)
        row["best_gap_pct"] = gap_pct(best, metric)
        row["vs_best"] = row["mine"] / row["best"]
        row["pick_vs_best"] = row["pick"] / row["best"] if row["pick"] is not None else None
        row["vs_torchrec"] = row["mine"] / row["torchrec"] if row["torchrec"] else None
        row["interval"] = paired_interval(mine, best)
        row["worse_beyond_spread"] = (row["interval"]["verdict"] == "worse" if row["interval"] is not None
                                      else row["mine"] - row["best"] > spread)
        out.append(row)
    return out


def gap_pct(result: dict, metric: str) -> float | None:
    """A result's plan cost above its balance reference (mean device compute + the slowest
    device's comm), in %: the gain a perfectly balanced plan of the same comm would take."""
    kind = "measured" if metric == "measured_cost_ms" else "estimated"
    return ((result.get("headroom") or {}).get(kind) or {}).get("gap_pct")


def mean_gap(values: list) -> str:
    v = [x for x in values if x is not None]
    return f"{mean(v):+.1f}%" if v else "-"


def paired_interval(a: dict, b: dict) -> dict | None:
    """a / b within one task: the bootstrap interval of the mean of their per-repetition cost
    ratios (repetition i of both plans ran in the same visit); None without paired samples
    (reports written before they were recorded)."""
    sa = (a.get("measured_device_costs") or {}).get("plan_cost_samples_ms") or []
    sb = (b.get("measured_device_costs") or {}).get("plan_cost_samples_ms") or []
    if a is b or len(sa) < 2 or len(sa) != len(sb) or min(sa + sb) <= 0:
        return None
    return paired_ratio_summary([x / y for x, y in zip(sa, sb)]).to_dict()


def overall(ratios: list[float]) -> str:
    """Mean of per-task ratios with its bootstrap interval over tasks and the verdict."""
    if len(ratios) < 2:
        return f"{mean(ratios):.3f}x (one task: no interval)" if ratios else "-"
    s = paired_ratio_summary(ratios)
    return f"{s.mean:.3f}x [{s.low:.3f}, {s.high:.3f}] {s.verdict}"


def by_devices_table(reports: list[dict], algorithm: str, metric: str) -> str:
    """Markdown: per device count (and all), mean cost per algorithm and the algorithm's ratios."""
    # tasks keyed by (report, name): two reports may hold tasks of the same name (4dev/, 8dev/)
    results = [{**r, "task": (i, r["task"])} for i, rep in enumerate(reports) for r in rep["results"]]
    devices = {r["task"]: len(r["memory_bytes"]) for r in results if r.get("memory_bytes")}
    ratio_rows = [row for rep in reports for row in rows_of(rep, algorithm, metric)]
    groups = [(f"{d} devices ({sum(1 for t in set(devices) if devices[t] == d)} tasks)", d) for d in sorted(set(devices.values()))]
    groups.append((f"all ({len(devices)} tasks)", None))
    algorithms = list(dict.fromkeys(r["algorithm"] for r in results))

    def picked(d, rows):
        return [x for x in rows if d is None or x["devices"] == d]

    best = {}  # the best heuristic's cost per task
    for r in results:
        if r["algorithm"] in BASELINES and r.get(metric) is not None:
            best[r["task"]] = min(best.get(r["task"], r[metric]), r[metric])
    lines = [f"| mean measured cost (ms) (ratio to the best heuristic, mean per task; gap to balance, mean) | "
             f"{' | '.join(g for g, _ in groups)} |", "|---|" + "---|" * len(groups)]
    for a in algorithms:
        cells = []
        for _, d in groups:
            mine = [r for r in results if r["algorithm"] == a and r.get(metric) is not None
                    and (d is None or devices.get(r["task"]) == d)]
            if not mine:
                cells.append("-")
                continue
            ratios = [r[metric] / best[r["task"]] for r in mine if best.get(r["task"])]
            ratio = f"{mean(ratios):.3f}x" if ratios else "-"
            cells.append(f"{mean(r[metric] for r in mine):.1f} ({ratio}; {mean_gap([gap_pct(r, metric) for r in mine])})")
        lines.append(f"| {a} | {' | '.join(cells)} |")
    for label, key, worse in ((algorithm, "vs_best", True), (f"{algorithm}_pick", "pick_vs_best", True),
                              (algorithm, "vs_torchrec", False), (f"{algorithm}_pick", None, False)):
        cells = []
        for _, d in groups:
            rows = picked(d, ratio_rows)
            if key is None:  # pick / torchrec
                v = [x["pick"] / x["torchrec"] for x in rows if x["pick"] is not None and x["torchrec"]]
            else:
                v = [x[key] for x in rows if x[key] is not None]
            if not v:
                cells.append("-")
                continue
            cell = overall(v)
            if worse:
                mine = "mine" if key == "vs_best" else "pick"
                better = sum(x[mine] < x["best"] for x in rows if x[mine] is not None)
                spread = "spread" if key == "vs_best" else "pick_spread"
                beyond = sum(x["worse_beyond_spread"] if mine == "mine" else x[mine] - x["best"] > x[spread]
                             for x in rows if x[mine] is not None)
                cell += f" (better on {better}/{len(v)}, worse beyond the interval on {beyond}/{len(v)})"
            cells.append(cell)
        what = "best heuristic" if worse else "torchrec"
        lines.append(f"| {label} / {what}, mean per task | {' | '.join(cells)} |")
    cells = []
    for _, d in groups:
        v = {a: [r.get("search_seconds") or 0.0 for r in results if r["algorithm"] == a and (d is None or devices.get(r["task"]) == d)]
             for a in (algorithm, f"{algorithm}_pick", "torchrec")}
        cells.append(" / ".join(f"{mean(x):.1f}" if x else "-" for x in v.values()))
    lines.append(f"| mean search s ({algorithm} / {algorithm}_pick / torchrec) | {' | '.join(cells)} |")
    return "\n".join(lines)


def _iv(iv: dict | None) -> str:
    """The paired ratio beside the ratio of plan costs: its mean, interval and verdict (the
    interval is of the mean of per-repetition ratios, so it is shown with that mean, not with
    the ratio of the two plans' medians, which it need not contain)."""
    return "" if iv is None else f" (paired {iv['mean']:.3f}x [{iv['low']:.3f}, {iv['high']:.3f}] {iv['verdict']})"


def _f(x, p: str) -> str:
    return "-" if x is None else p.format(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--algorithm", default="neuroshard")
    ap.add_argument("--metric", default="measured_cost_ms")
    ap.add_argument("--markdown", action="store_true", help="print the per-task table as markdown")
    ap.add_argument("--by-devices", action="store_true", help="print the per-device-count table of means and ratios")
    args = ap.parse_args()
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    if args.by_devices:
        print(by_devices_table(reports, args.algorithm, args.metric))
        return
    rows = [row for report in reports for row in rows_of(report, args.algorithm, args.metric)]
    a = args.algorithm
    if args.markdown:
        print(f"| task | devices | {a} (ms) | search pick (ms) | best heuristic (ms) | torchrec (ms) | {a} / best heuristic "
              f"[95% CI] | {a} gap to balance | best heuristic's gap | {a} / torchrec | worse beyond the interval |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if args.markdown:
            print(f"| {r['task']} | {r['devices']} | {r['mine']:.1f} | {_f(r['pick'], '{:.1f}')} | {r['best']:.1f} ({r['best_name']}) | "
                  f"{_f(r['torchrec'], '{:.1f}')} | {r['vs_best']:.3f}x{_iv(r['interval'])} | {_f(r['gap_pct'], '{:+.1f}%')} | "
                  f"{_f(r['best_gap_pct'], '{:+.1f}%')} | {_f(r['vs_torchrec'], '{:.3f}x')} | "
                  f"{'YES' if r['worse_beyond_spread'] else 'no'} |")
        else:
            print(f"{r['task']:24s} D={r['devices']:<3d} {a} {r['mine']:8.1f}  pick {_f(r['pick'], '{:8.1f}')}  best heuristic "
                  f"{r['best']:8.1f} ({r['best_name']})  torchrec {_f(r['torchrec'], '{:8.1f}')}  ratio {r['vs_best']:.3f}"
                  + _iv(r["interval"]) + f"  gap to balance {_f(r['gap_pct'], '{:+.1f}%')} "
                  f"(best heuristic {_f(r['best_gap_pct'], '{:+.1f}%')})"
                  + ("  WORSE beyond the interval" if r["worse_beyond_spread"] else ""))
    if not rows:
        print("no task has both the algorithm and a baseline")
        return
    tr = [r["vs_torchrec"] for r in rows if r["vs_torchrec"] is not None]
    picks = [r["pick_vs_best"] for r in rows if r["pick_vs_best"] is not None]
    print(f"\n{a}: {len(rows)} tasks; mean cost / best heuristic's {overall([r['vs_best'] for r in rows])} "
          f"(better on {sum(r['mine'] < r['best'] for r in rows)}, worse beyond the interval on "
          f"{sum(r['worse_beyond_spread'] for r in rows)})"
          + (f"; its search's own pick {overall(picks)}" if picks else "")
          + (f"; mean cost / torchrec's {overall(tr)}" if tr else "")
          + f"; mean gap to balance {mean_gap([r['gap_pct'] for r in rows])} "
          f"(the best heuristics' {mean_gap([r['best_gap_pct'] for r in rows])})")


if __name__ == "__main__":
    main()
