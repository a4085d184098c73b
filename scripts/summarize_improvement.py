"""Per-task cost of one algorithm against the best heuristic and TorchRec, from shard.py reports.

Example:
    .venv/bin/python scripts/summarize_improvement.py experiments/user_eval/runs/report.json [more ...] [--markdown]

Per task: the algorithm's measured cost, its search's own pick before the guard (the
`<algorithm>_pick` row, when the guard ran), the best heuristic's (the lowest of the baselines
present), TorchRec's, the ratios, and whether the algorithm was worse than the best heuristic
by more than the measurement spread (the larger of the two plans' IQRs). Then the means.
"""

from __future__ import annotations

import argparse
import json
from statistics import mean

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
        }
        row["vs_best"] = row["mine"] / row["best"]
        row["pick_vs_best"] = row["pick"] / row["best"] if row["pick"] is not None else None
        row["vs_torchrec"] = row["mine"] / row["torchrec"] if row["torchrec"] else None
        row["worse_beyond_spread"] = row["mine"] - row["best"] > spread
        out.append(row)
    return out


def _f(x, p: str) -> str:
    return "-" if x is None else p.format(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--algorithm", default="neuroshard")
    ap.add_argument("--metric", default="measured_cost_ms")
    ap.add_argument("--markdown", action="store_true", help="print the per-task table as markdown")
    args = ap.parse_args()
    rows = []
    for path in args.reports:
        with open(path) as f:
            rows += rows_of(json.load(f), args.algorithm, args.metric)
    a = args.algorithm
    if args.markdown:
        print(f"| task | devices | {a} (ms) | search pick (ms) | best heuristic (ms) | torchrec (ms) | {a} / best heuristic | "
              f"{a} / torchrec | worse beyond spread |")
        print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if args.markdown:
            print(f"| {r['task']} | {r['devices']} | {r['mine']:.1f} | {_f(r['pick'], '{:.1f}')} | {r['best']:.1f} ({r['best_name']}) | "
                  f"{_f(r['torchrec'], '{:.1f}')} | {r['vs_best']:.3f}x | {_f(r['vs_torchrec'], '{:.3f}x')} | "
                  f"{'YES' if r['worse_beyond_spread'] else 'no'} |")
        else:
            print(f"{r['task']:24s} D={r['devices']:<3d} {a} {r['mine']:8.1f}  pick {_f(r['pick'], '{:8.1f}')}  best heuristic "
                  f"{r['best']:8.1f} ({r['best_name']})  torchrec {_f(r['torchrec'], '{:8.1f}')}  ratio {r['vs_best']:.3f}"
                  + ("  WORSE beyond the spread" if r["worse_beyond_spread"] else ""))
    if not rows:
        print("no task has both the algorithm and a baseline")
        return
    tr = [r["vs_torchrec"] for r in rows if r["vs_torchrec"] is not None]
    picks = [r["pick_vs_best"] for r in rows if r["pick_vs_best"] is not None]
    print(f"\n{a}: {len(rows)} tasks; mean cost / best heuristic's {mean(r['vs_best'] for r in rows):.3f}x "
          f"(better on {sum(r['mine'] < r['best'] for r in rows)}, worse beyond the spread on "
          f"{sum(r['worse_beyond_spread'] for r in rows)})"
          + (f"; its search's own pick {mean(picks):.3f}x" if picks else "")
          + (f"; mean cost / torchrec's {mean(tr):.3f}x" if tr else ""))


if __name__ == "__main__":
    main()
