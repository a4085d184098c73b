"""Does the measured plan cost predict end-to-end throughput? One line per repeat of `make e2e`.

    python scripts/e2e_tau.py experiments/e2e/throughput_rep1 experiments/e2e/throughput_rep2 ...

Per repeat (a throughput.json written with dlrm.shard_report=[...]): Kendall tau between the
plans' samples/s and each measured cost (kernels: the fused kernels + pooled all-to-all;
dmp_step: DistributedModelParallel's embedding step), then per plan its samples/s in every
repeat beside both costs, as markdown.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    runs = []
    for arg in argv:
        path = Path(arg) / "throughput.json" if Path(arg).is_dir() else Path(arg)
        try:
            runs.append((path.parent.name, json.loads(path.read_text())))
        except (OSError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
    sources = sorted({s for _, r in runs for s in (r.get("kendall_tau_throughput_vs_cost") or {})})
    print("| repeat | " + " | ".join(f"tau vs {s}" for s in sources) + " |")
    print("|---|" + "---|" * len(sources))
    for name, r in runs:
        taus = r.get("kendall_tau_throughput_vs_cost") or {}
        print(f"| {name} | " + " | ".join("-" if taus.get(s) is None else f"{taus[s]:.2f}" for s in sources) + " |")
    plans = runs[0][1]["order"]
    costs = runs[0][1].get("embedding_cost_ms") or {}
    print("\n| plan | " + " | ".join(f"samples/s {n}" for n, _ in runs) + " | "
          + " | ".join(f"{s} cost (ms)" for s in sources) + " |")
    print("|---|" + "---|" * (len(runs) + len(sources)))
    for p in plans:
        cells = []
        for _, r in runs:
            sp = r["plans"][p]["samples_per_s"]
            half = (sp["ci_high"] - sp["ci_low"]) / 2 if sp.get("ci_low") is not None else None
            cells.append(f"{sp['mean']:.0f}" + (f" ± {half:.0f}" if half is not None else ""))
        cells += ["-" if p not in costs.get(s, {}) else f"{costs[s][p]:.1f}" for s in sources]
        print(f"| {p} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
