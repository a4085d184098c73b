"""Planning time of each algorithm for tasks of growing size (a benchmark, not a test).

Example:
    .venv/bin/python scripts/bench_planning.py --sizes 10x2,20x4,40x4,80x8 --algorithms size_lookup_greedy,torchrec

Tasks are NeuroShard-style draws from a synthetic 856-table pool (dims {4..128}, batch 65536,
device memory 1.5x an even share of the task, at least 1.05x its largest table); prints
seconds per algorithm and task size. One untimed warm-up plan per algorithm runs first
(imports, TorchRec's first-call set-up).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from embshard.data.synthetic import generate_synthetic
from embshard.data.tasks import neuroshard_tasks, table_pool_from_dataset
from embshard.errors import EmbshardError
from embshard.search.baselines import COST_KEYS, GreedySharder, RandomSharder, RoundRobinSharder

ROOT = Path(__file__).resolve().parents[1]


def sharder(name: str):
    if name == "torchrec":
        from embshard.search.torchrec_planner import TorchRecPlanner

        return TorchRecPlanner()
    if name == "random":
        return RandomSharder()
    if name == "round_robin":
        return RoundRobinSharder()
    return GreedySharder(name.removesuffix("_greedy"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10x2,20x4,40x4,80x8", help="TABLESxDEVICES,...")
    ap.add_argument("--algorithms", default="size_lookup_greedy,torchrec")
    ap.add_argument("--pool-tables", type=int, default=856)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    data = ROOT / "data" / f"synthetic_t{args.pool_tables}_bs512_s{args.seed}.pt"
    if not data.is_file():
        generate_synthetic(data, num_tables=args.pool_tables, batch_size=512, seed=args.seed)
    pool = table_pool_from_dataset(data)
    names = args.algorithms.split(",")
    (warm,) = neuroshard_tasks(pool, 1, min_tables=5, max_tables=5, num_devices=2, seed=args.seed, name_prefix="warm")
    for name in names:
        sharder(name).shard(warm)
    print(f"{'tables x devices':>16}  " + "  ".join(f"{n:>20}" for n in names))
    for size in args.sizes.split(","):
        tables, devices = (int(x) for x in size.split("x"))
        (task,) = neuroshard_tasks(pool, 1, min_tables=tables, max_tables=tables, num_devices=devices,
                                   batch_size=65536, seed=args.seed, name_prefix=f"bench{size}")
        cells = []
        for name in names:
            s = sharder(name)
            start = time.perf_counter()
            try:
                s.shard(task)
                seconds = getattr(s, "last_search_seconds", None) or time.perf_counter() - start
                cells.append(f"{seconds:19.3f}s")
            except EmbshardError as e:
                cells.append(f"{'infeasible':>20}")
                print(f"  {name} on {size}: {e}", file=sys.stderr)
        print(f"{size:>16}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
