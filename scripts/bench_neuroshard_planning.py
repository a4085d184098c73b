"""Planning time of NeuroShard's search for 856 tables over 128 devices (a benchmark, not a test).

Example:
    .venv/bin/python scripts/bench_neuroshard_planning.py
    .venv/bin/python scripts/bench_neuroshard_planning.py --checkpoint checkpoints/cpu_fbgemm/cost_models.pt --torchrec
    .venv/bin/python scripts/bench_neuroshard_planning.py --tables 5384 --devices 1024 --checkpoint checkpoints/cpu_fbgemm/cost_models.pt

The task is a NeuroShard-style draw of all 856 tables of a synthetic pool (dims {4..128},
batch 65536, device memory 1.5x an even share, at least 1.05x the largest table). The pool
comes from a synthetic dlrm_datasets file cached under data/ (generated on first use at a
small trace batch: only the table features matter here). Prints the search seconds with the
analytic cost model behind the predictor interface, with the neural checkpoint when given,
and with TorchRec's planner when asked; one untimed warm-up plan per planner runs first.
Per planner: wall seconds (what a user waits) and the process's CPU seconds (what the search
costs: on a machine shared with other jobs the wall time is longer), the search's own estimate
of its plan, the analytic model's estimate of the same plan and their ratio, and which
all-to-alls the neural models left to the analytic model (search_info.comm_fallbacks).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from embshard.costs.analytic import AnalyticCostModel
from embshard.data.tasks import planning_bench_tasks
from embshard.search.neuroshard import NeuroShardSharder

ROOT = Path(__file__).resolve().parents[1]


def _pieces(value: str) -> int | None:
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a piece count or 'none', got {value!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=856)
    ap.add_argument("--devices", type=int, default=128)
    ap.add_argument("--checkpoint", default=None, help="neural cost models (cost_models.pt)")
    ap.add_argument("--torchrec", action="store_true", help="also time TorchRec's planner on the same task")
    ap.add_argument("--repeats", type=int, default=1, help="timed plans per planner (fresh sharder each)")
    ap.add_argument("--trace-batch", type=int, default=512, help="batch of the synthetic trace file")
    ap.add_argument("--seed", type=int, default=0)
    # absent unless given (argparse.SUPPRESS), so the sharder keeps its own defaults
    ap.add_argument("--beam-steps", type=int, default=argparse.SUPPRESS,
                    help="NeuroShard's beam_steps (default: the sharder's)")
    ap.add_argument("--beam-max-pieces", type=_pieces, default=argparse.SUPPRESS,
                    help="NeuroShard's beam_max_pieces ('none': the beam at any piece count; default: the sharder's)")
    args = ap.parse_args()
    beam = {k: getattr(args, k) for k in ("beam_steps", "beam_max_pieces") if hasattr(args, k)}
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    task, warm = planning_bench_tasks(args.tables, args.devices, ROOT / "data", trace_batch=args.trace_batch, seed=args.seed)
    print(f"task {task.name}: {len(task.tables)} tables, {task.num_devices} devices, "
          f"{task.device_memory_bytes / 2**30:.2f} GiB per device")

    planners = {"neuroshard (analytic)": lambda: NeuroShardSharder(checkpoint=None, verify=0, **beam)}
    if args.checkpoint:
        planners["neuroshard (neural)"] = lambda: NeuroShardSharder(checkpoint=args.checkpoint, verify=0, **beam)
    if args.torchrec:
        from embshard.search.torchrec_planner import TorchRecPlanner

        planners["torchrec"] = TorchRecPlanner
    analytic = AnalyticCostModel()
    for label, make in planners.items():
        make().shard(warm)
        times, cpu = [], []
        for _ in range(args.repeats):
            s = make()
            start, c0 = time.perf_counter(), time.process_time()
            plan = s.shard(task)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - c0)
        extra = ""
        if isinstance(s, NeuroShardSharder):
            st = s.last_stats
            ref = analytic.device_costs(task, plan).plan_cost_ms
            extra = (f"  predicted {s.last_predicted_cost_ms:.1f} ms (analytic model: {ref:.1f} ms, "
                     f"{s.last_predicted_cost_ms / ref:.2f}x), {st['pieces']} pieces, {st['greedy_runs']} greedy runs, "
                     f"{st['caps_run']} caps, beam {'on' if st['beam'] else 'off'}, incremental {st['incremental']}")
            if s.last_search_info.get("comm_fallbacks"):
                extra += f", comm fallbacks {s.last_search_info['comm_fallbacks']}"
        best = min(range(len(times)), key=times.__getitem__)
        print(f"{label:>24}: {times[best]:8.2f} s wall, {cpu[best]:.2f} s CPU"
              + (f" (best of {len(times)})" if len(times) > 1 else "") + extra, flush=True)


if __name__ == "__main__":
    main()
