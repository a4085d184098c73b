"""Planning time of DreamShard and AutoShard for 856 tables over 128 devices (a benchmark, not a test).

Example:
    .venv/bin/python scripts/bench_rl_planning.py
    .venv/bin/python scripts/bench_rl_planning.py --repeats 3 --samples 0,8
    .venv/bin/python scripts/bench_rl_planning.py --tables 5384 --devices 1024 --repeats 1 --samples 0

The task is the same NeuroShard-style draw of all 856 tables of a synthetic pool that
scripts/bench_neuroshard_planning.py plans (dims {4..128}, batch 65536, device memory 1.5x an
even share, at least 1.05x the largest table). Each searcher loads its shipped checkpoint
(search=dreamshard / search=autoshard's defaults), plans one untimed warm-up task, then the
big task `--repeats` times; the plan is validated every time. Prints seconds per plan (min
and median), at each `--samples` setting (the searchers skip sampling above
sample_max_work, so 856 x 128 plans by argmax whatever the setting; the line says which ran),
wall and CPU seconds (on a machine shared with other jobs the wall time is longer), and the
planner's estimate (search_info.estimate: its cost network's, or the analytic model's where
the network's is over 10x off it) beside the analytic model's estimate of the same plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time
from pathlib import Path

from embshard.costs.analytic import AnalyticCostModel
from embshard.data.tasks import planning_bench_tasks, without_histograms
from embshard.plan import validate
from embshard.search.rl.sharders import AutoShardSharder, DreamShardSharder

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = {"dreamshard": "checkpoints/dreamshard_cpu/policy.pt", "autoshard": "checkpoints/autoshard_cpu/policy.pt"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=856)
    ap.add_argument("--devices", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", default="8", help="best-of-K settings to time, e.g. 0,8 (the config's default is 8)")
    ap.add_argument("--dreamshard", default=CHECKPOINTS["dreamshard"])
    ap.add_argument("--autoshard", default=CHECKPOINTS["autoshard"])
    ap.add_argument("--trace-batch", type=int, default=512, help="batch of the synthetic trace file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split-columns", choices=("on", "off"), default="on",
                    help="the column-split plan beside the whole-table one (conf/search's default: on)")
    ap.add_argument("--split-judge", default=str(ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt"),
                    help="cost-model checkpoint that picks split or whole (conf/search's default); 'none': the policy's network")
    ap.add_argument("--no-histograms", action="store_true",
                    help="drop the tables' reuse histograms (a user's tables: the searchers impute them)")
    ap.add_argument("--batch", type=int, default=None, help="the task's batch instead of the bench's")
    ap.add_argument("--memory-share", type=float, default=None, metavar="F",
                    help="each device's memory F x an even share of the tables' memory (1.5: the harsh "
                         "variant of docs/portfolio.md, where some tables fit no single device)")
    ap.add_argument("--save-task", default=None, metavar="PATH",
                    help="write the task JSON (after --no-histograms) to PATH and stop (for shard.py)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    task, warm = planning_bench_tasks(args.tables, args.devices, ROOT / "data", trace_batch=args.trace_batch, seed=args.seed)
    if args.no_histograms:
        task = without_histograms(task)
    if args.batch is not None:
        task = dataclasses.replace(task, batch_size=args.batch)
    if args.memory_share is not None:
        if args.memory_share <= 0:
            ap.error(f"--memory-share must be positive, got {args.memory_share}")
        task = dataclasses.replace(task, device_memory_bytes=int(args.memory_share * task.tables_memory_bytes() / task.num_devices))
    if args.save_task:
        task.save(args.save_task)
        print(f"wrote {args.save_task}")
        return
    print(f"task {task.name}: {len(task.tables)} tables, {task.num_devices} devices, "
          f"{task.device_memory_bytes / 2**30:.2f} GiB per device" + (", no histograms" if args.no_histograms else ""))
    analytic = AnalyticCostModel()
    for samples in [int(s) for s in args.samples.split(",")]:
        for name, cls in (("dreamshard", DreamShardSharder), ("autoshard", AutoShardSharder)):
            sharder = cls(checkpoint=getattr(args, name), samples=samples, split_columns=args.split_columns == "on",
                          split_judge=None if args.split_judge == "none" else args.split_judge)
            sharder.shard(warm)
            times, cpu = [], []
            for _ in range(args.repeats):
                start, c0 = time.perf_counter(), time.process_time()
                plan = sharder.shard(task)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - c0)
                validate(task, plan)
            ran = sharder.last_stats["samples"]
            est = sharder.last_search_info["estimate"]
            costs = analytic.device_costs(task, plan)
            ref = costs.plan_cost_ms if est["of"] == "plan cost" else max(costs.compute_ms)
            print(f"{name:>10} samples={samples} (ran {ran}): min {min(times):.2f} s wall ({min(cpu):.2f} s CPU), "
                  f"median {statistics.median(times):.2f} s over {len(times)}; valid plan, "
                  f"{len({s.device for s in plan.shards})} devices used, estimated {est['ms']:.1f} ms ({est['of']}, "
                  f"{est['source']}; analytic model: {ref:.1f} ms, {est['ms'] / ref:.2f}x)"
                  + (f"; {est['reason']}" if "reason" in est else "") + split_note(sharder), flush=True)


def split_note(sharder) -> str:
    """What the column split did on the last plan (nothing when it is off)."""
    info = sharder.last_search_info.get("column_split")
    if info is None:
        return ""
    if "skipped" in info:
        return f"; column split skipped ({info['skipped']})"
    return (f"; column split: {len(info['tables'])} tables cut into {info.get('slices', 0)} slices, "
            f"{'kept' if info['chosen'] else 'not kept'}")


if __name__ == "__main__":
    main()
