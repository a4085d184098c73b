"""Per-task improvement of one algorithm over the best baseline and over TorchRec, from a report.json.

Example:
    .venv/bin/python scripts/summarize_improvement.py experiments/neuroshard_cpu/runs/4dev/report.json
"""

from __future__ import annotations

import argparse
import json
from statistics import mean

BASELINES = ("random", "round_robin", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--algorithm", default="neuroshard")
    ap.add_argument("--metric", default="measured_cost_ms")
    args = ap.parse_args()
    results = json.load(open(args.report))["results"]
    by_task: dict[str, dict[str, float]] = {}
    for r in results:
        if r[args.metric] is not None:
            by_task.setdefault(r["task"], {})[r["algorithm"]] = r[args.metric]
    vs_best, vs_torchrec, wins = [], [], 0
    for task, costs in sorted(by_task.items()):
        mine = costs.get(args.algorithm)
        base = [costs[b] for b in BASELINES if b in costs]
        if mine is None or not base:
            continue
        best = min(base)
        vs_best.append(1 - mine / best)
        wins += mine < best
        if "torchrec" in costs:
            vs_torchrec.append(1 - mine / costs["torchrec"])
        print(f"{task:24s} {args.algorithm} {mine:8.3f}  best baseline {best:8.3f} ({min((b for b in BASELINES if b in costs), key=costs.get)})"
              + (f"  torchrec {costs['torchrec']:8.3f}" if "torchrec" in costs else ""))
    print(f"\n{args.algorithm}: {len(vs_best)} tasks, better than the best baseline on {wins}; "
          f"mean cost reduction vs best baseline per task {100 * mean(vs_best):.1f}%"
          + (f", vs torchrec {100 * mean(vs_torchrec):.1f}%" if vs_torchrec else ""))


if __name__ == "__main__":
    main()
