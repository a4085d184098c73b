"""FlexShard's planning time at production scale: 856 sequence tables on 128 devices.

    python scripts/bench_flexshard_planning.py [--tables 856 --hosts 16 --devices-per-host 8]

Writes (once) a synthetic 856-table sequence trace (data/, calibrated popularity, every table
multi-hot with the calibrated mean length), builds the task (memory cap 1.25 x row_wise's
need), and times separately: the access statistics of the fit steps (streamed counts), the
tier search given them, the plan's validation, and the baselines.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from embshard.data.synthetic import TARGET_POOLING_FACTOR
from embshard.flexshard.baselines import HugeCTRHybridSharder, RowWiseSharder, TableRowWiseSharder
from embshard.flexshard.stats import BatchSplit, task_access_stats
from embshard.flexshard.tasks import sequence_task, sequence_trace
from embshard.plan import validate
from embshard.search.flexshard import FlexShardSharder

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=856)
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--devices-per-host", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--fit-batches", type=int, default=4)
    args = ap.parse_args()
    samples = args.batch_size * args.fit_batches
    trace = ROOT / "data" / f"synthetic_seq_t{args.tables}_s{samples}.pt"
    t0 = time.perf_counter()
    sequence_trace(trace, args.tables, samples, TARGET_POOLING_FACTOR)
    print(f"trace {trace.name}: {time.perf_counter() - t0:.1f} s (generated once)")
    task = sequence_task(trace, "plan856", 64, args.hosts, args.devices_per_host, args.batch_size, 1.25)
    rows = sum(t.rows for t in task.tables)
    print(f"task: {len(task.tables)} sequence tables, {rows:,} rows, {task.num_devices} devices")

    t0 = time.perf_counter()
    stats = task_access_stats(task, BatchSplit(args.fit_batches, 1), progress=True)
    ids = sum(s.total for s in stats.values())
    print(f"access statistics: {time.perf_counter() - t0:.2f} s for {ids:,} accesses "
          f"({sum(s.ids.size for s in stats.values()):,} distinct rows)")
    for name, sharder in [("flexshard", FlexShardSharder(args.fit_batches)),
                          ("hugectr_hybrid", HugeCTRHybridSharder(args.fit_batches)),
                          ("row_wise", RowWiseSharder()), ("table_row_wise", TableRowWiseSharder())]:
        t0 = time.perf_counter()
        plan = sharder.shard(task)  # statistics are cached: this is the search alone
        search = time.perf_counter() - t0
        t0 = time.perf_counter()
        validate(task, plan)
        print(f"{name:15s} search {search:6.2f} s  validate {time.perf_counter() - t0:5.2f} s  "
              f"{len(plan.shards):,} shards, {sum(len(v) for v in plan.row_maps.values()):,} rows in row maps")


if __name__ == "__main__":
    main()
