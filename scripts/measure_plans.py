"""Measure plans already made (plan JSON files) on this machine, interleaved, as shard.py would.

    python scripts/measure_plans.py --task experiments/e2e/task.json \\
        --plans experiments/e2e/shard/plans/*.json --step dmp --out experiments/e2e/shard_dmp

`--step kernels` times each device's fused kernel and the pooled all-to-all (shard.py's default
evaluator); `--step dmp` times TorchRec's DistributedModelParallel embedding step (the input
ids' all-to-all, row-wise bucketizing, lookups, output distribution, backward). The same plans
measured both ways show what the training step pays that the kernel measurement leaves out.
Writes OUT/report.json (shard.py's `results` rows: algorithm, measured_cost_ms, the per-device
costs, the probe) and OUT/config.json. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", required=True, type=Path)
    ap.add_argument("--plans", required=True, nargs="+", type=Path)
    ap.add_argument("--step", choices=["kernels", "dmp"], default="dmp")
    ap.add_argument("--protocol", default="cpu", help="conf/measure/<name>.yaml")
    ap.add_argument("--visits", type=int, default=None, help="override the protocol's visits")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)

    from embshard.errors import EmbshardError

    try:
        run(args)
    except EmbshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace) -> None:
    from embshard.compare import Result
    from embshard.hardware.evaluator import HardwareEvaluator
    from embshard.hardware.protocol import load_protocol
    from embshard.io import write_json_atomic
    from embshard.plan import Plan
    from embshard.report import format_results, vs_best_heuristic
    from embshard.task import Task

    task = Task.load(args.task)
    plans = [Plan.load(p) for p in args.plans]
    protocol = load_protocol(args.protocol)
    ev = HardwareEvaluator(backend="fbgemm", device="cpu", comm_backend="gloo", protocol=protocol, seed=args.seed,
                           progress=True, step=args.step)
    probe = ev.session_probe()
    costs = ev.measure_many(task, plans, visits=args.visits)
    results = []
    for plan, c in zip(plans, costs):
        r = Result(task=task.name, algorithm=plan.algorithm, valid=True, plan=plan,
                   memory_bytes=plan.memory_bytes(task),
                   pieces=[len(plan.shards_on(d)) for d in range(task.num_devices)], measured=c)
        results.append(r)
    vs = vs_best_heuristic(results, "measured_cost_ms")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / "report.json", {
        "evaluate": "measured", "metric": "measured_cost_ms", "step": args.step, "measure": protocol.to_dict(),
        "probe": probe.to_dict() if probe is not None else None, "tasks": [task.name],
        "results": [r.to_dict() | {"vs_best_heuristic": vs.get((r.task, r.algorithm))} for r in results]})
    write_json_atomic(args.out / "config.json", {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                                 if k != "plans"} | {"plans": [str(p) for p in args.plans]})
    print(format_results(task, results, "measured_cost_ms"))
    print(f"wrote {args.out}/report.json")


if __name__ == "__main__":
    sys.exit(main())
