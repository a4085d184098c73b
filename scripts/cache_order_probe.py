"""How much two plans' measured ratio moves with their order in one measuring call, with the
evaluator's kernels kept between visits or rebuilt (docs/measurement.md, "Kernels kept between
visits"); a benchmark, not a test.

    python scripts/portfolio_eval.py tasks --split validation --num-tasks 5 --first-task 300 --out T
    python scripts/cache_order_probe.py T/20-30x2/pv-20-30x2-0301.json T/20-30x4/pv-20-30x4-0301.json ... \\
        --caches 2147483648 0

Per task: NeuroShard's plan (no guard) and size_lookup_greedy's, their device kernels measured in
one `measure_compute` call as [A, B] and then as [B, A] (the pinned CPU protocol, each device drawing
the same batches in both), for each kernel cache size; r = the slowest device's compute of A over
B's; the order effect e = |log r_AB - log r_BA|. Prints each task's r and e, then per cache size the
mean e, and the mean of the paired difference of the first cache size's e over the second's with a
bootstrap 95% interval over tasks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def order_effect(task, plans, cache: int) -> tuple[float, float, float]:
    """(r_AB, r_BA, e) for the two plans of `plans` (name -> Plan) on `task`."""
    from embshard.hardware.backends import ShardInput
    from embshard.hardware.compute import measure_compute
    from embshard.hardware.protocol import load_protocol

    pa, pb = plans.values()
    d, tables = task.num_devices, task.table_by_name
    ratios = []
    for order in ((pa, pb), (pb, pa)):
        sets, items = [], []
        for plan in order:
            for dev, on in enumerate(plan.by_device(d)):
                sets.append([ShardInput(tables[s.table], s) for s in on])
                items.append(100 * (plan is pb) + dev)  # a device draws the same batches in both calls
        res = measure_compute(sets, task.batch_size, protocol=load_protocol("cpu"), item_seeds=items,
                              max_cached_bytes=cache)
        first, second = (max(r.median_ms for r in res[k * d:(k + 1) * d]) for k in range(2))
        ratios.append(first / second if order[0] is pa else second / first)
    return ratios[0], ratios[1], abs(float(np.log(ratios[0] / ratios[1])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tasks", nargs="+", type=Path, help="task JSON files")
    ap.add_argument("--caches", type=int, nargs=2, default=[2 << 30, 0],
                    help="two kernel cache sizes in bytes (default: 2 GiB, the evaluator's before 2026-12-04, and 0)")
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    args = ap.parse_args()
    if any(c < 0 for c in args.caches):
        ap.error("--caches must be >= 0")

    from embshard import Task, api
    from embshard.errors import EmbshardError
    from embshard.stats import bootstrap_mean_ci

    effects: dict[int, list[float]] = {c: [] for c in args.caches}
    try:
        for path in args.tasks:
            task = Task.load(path)
            plans = {"neuroshard": api.plan(task, algorithm="neuroshard", verify=0),
                     "size_lookup_greedy": api.plan(task, algorithm="size_lookup_greedy")}
            for cache in args.caches:
                r_ab, r_ba, e = order_effect(task, plans, cache)
                effects[cache].append(e)
                print(f"{task.name} cache {cache >> 20} MiB: neuroshard / size_lookup_greedy {r_ab:.3f} first, "
                      f"{r_ba:.3f} second, e {e:.3f}", flush=True)
    except EmbshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c1, c2 = args.caches
    mean, lo, hi = bootstrap_mean_ci(np.array(effects[c1]) - np.array(effects[c2]), seed=args.seed)
    print(f"{len(effects[c1])} task(s): mean e {np.mean(effects[c1]):.4f} at {c1} bytes, {np.mean(effects[c2]):.4f} "
          f"at {c2}; difference {mean:.4f} [{lo:.4f}, {hi:.4f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
