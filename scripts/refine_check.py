"""The measured refinement's validation (`verify_refine`, `embshard.search.refine`;
docs/portfolio.md, "Measured refinement"): does a per-table correction fitted on one measured
round find plans that measure cheaper, and is the measurement precise enough to tell?

    python scripts/refine_check.py measure TASK.json ... --out refine.jsonl   # refine, then refined vs start paired
    python scripts/refine_check.py loo refine.jsonl                           # leave one measured plan out
    python scripts/refine_check.py repeat refine.jsonl --tasks 3 --out repeat.jsonl   # the same plan 3x per call
    python scripts/refine_check.py repeat-stats repeat.jsonl

`measure`: per task, NeuroShard's plan (the shipped checkpoint, its guard off) and the plans of
size_lookup_greedy, lookup_greedy and dim_greedy measured in one call (the shipped CPU protocol),
the correction fitted on them, the best measured plan refined, and refined and start measured
paired over `--rounds` rounds; one JSON line per task (its plans and measured costs too, for
`loo` and `repeat`) and the mean refined / start ratio with its bootstrap interval at the end.
`loo`: fits on all but one plan and predicts that plan's device compute, per ridge.
`repeat`: the first two plans of each record, three copies each in one call, two calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def records(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.startswith("{")]


def task_of(rec: dict):
    """The record's task (as measured), or, in a record without it, its task file's."""
    from embshard.task import Task

    return Task.from_dict(rec["task_spec"] if "task_spec" in rec else json.loads(Path(rec["file"]).read_text()))


def measure(args: argparse.Namespace) -> None:
    from embshard.hardware.evaluator import HardwareEvaluator
    from embshard.plan import validate
    from embshard.search.constrained import shard_constrained
    from embshard.search.guard import heuristic_sharders
    from embshard.search.neuroshard import NeuroShardSharder
    from embshard.search.refine import Refiner, fit_correction
    from embshard.stats import paired_ratio_summary
    from embshard.task import Task

    evaluator = HardwareEvaluator()
    ns = NeuroShardSharder(verify=0)
    ratios = []
    with open(args.out, "w") as out:
        for path in args.tasks:
            task = Task.from_dict(json.loads(Path(path).read_text()), source=path)
            r = ns.refinement_for(task)  # the guard's view, models and batch ratio on this task
            view, sim, ratio = r.view, r.simulator, r.ratio
            plans = {"neuroshard": ns.shard(task)}
            makers = heuristic_sharders()
            for h in ("size_lookup_greedy", "lookup_greedy", "dim_greedy"):
                plans[h] = shard_constrained(makers[h](), task)
                validate(task, plans[h])
            labels = list(plans)
            t0 = time.perf_counter()
            costs = evaluator.measure_many(task, [plans[k] for k in labels])
            correction = fit_correction(view, sim, ratio, [plans[k] for k in labels], costs,
                                        **({"ridge": args.ridge} if args.ridge is not None else {}))
            best = min(range(len(labels)), key=lambda i: costs[i].plan_cost_ms)
            refiner = Refiner(task, view, sim, ratio, correction)
            refined = refiner.refine(plans[labels[best]], costs[best])
            rounds = []
            if refiner.info["moves"]:
                for _ in range(args.rounds):
                    a, b = evaluator.measure_many(task, [plans[labels[best]], refined])
                    rounds.append((a.plan_cost_ms, b.plan_cost_ms))
            rec = {"task": task.name, "file": str(path), "task_spec": task.to_dict(), "best": labels[best],
                   "measured": {k: c.plan_cost_ms for k, c in zip(labels, costs)},
                   "correction": correction.to_dict(), "info": refiner.info, "rounds": rounds,
                   "ratio": float(np.mean([b / a for a, b in rounds])) if rounds else None,
                   "seconds": round(time.perf_counter() - t0, 1),
                   "plans": {k: plans[k].to_dict() for k in labels}, "refined": refined.to_dict(),
                   "costs": {k: c.to_dict() for k, c in zip(labels, costs)}}
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(f"{task.name}: start {labels[best]}, {refiner.info['moves']} moves, expected "
                  f"{refiner.info['expected_ms']:.1f} of {refiner.info['start_ms']:.1f} ms; refined / start "
                  f"{rec['ratio'] if rec['ratio'] is None else round(rec['ratio'], 3)}", flush=True)
            if rec["ratio"] is not None:
                ratios.append(rec["ratio"])
    if ratios:
        s = paired_ratio_summary(ratios)
        print(f"refined / start over {len(ratios)} tasks: {s.mean:.3f} [{s.low:.3f}, {s.high:.3f}] {s.verdict}")


def loo(args: argparse.Namespace) -> None:
    from embshard.costs.base import DeviceCosts
    from embshard.plan import Plan, device_pieces
    from embshard.search.neuroshard import NeuroShardSharder
    from embshard.search.refine import fit_correction, shares

    ns = NeuroShardSharder(verify=0)
    ridges = args.ridges
    errs: dict[float, list[float]] = {r: [] for r in ridges}
    slowest: dict[float, list[float]] = {r: [] for r in ridges}
    for rec in records(args.records):
        task = task_of(rec)
        r = ns.refinement_for(task)
        view, sim, ratio = r.view, r.simulator, r.ratio
        labels = list(rec["plans"])
        plans = [Plan.from_dict(rec["plans"][k]) for k in labels]
        costs = [DeviceCosts(rec["costs"][k]["compute_ms"], rec["costs"][k]["forward_comm_ms"],
                             rec["costs"][k]["backward_comm_ms"]) for k in labels]
        for held in range(len(plans)):
            rest = [i for i in range(len(plans)) if i != held]
            per = device_pieces(view, plans[held])
            pred = sim.compute_of(per) * ratio
            m = np.asarray(costs[held].compute_ms)
            for r in ridges:
                c = fit_correction(view, sim, ratio, [plans[i] for i in rest], [costs[i] for i in rest], ridge=r)
                est = []
                for d, pieces in enumerate(per):
                    est.append(pred[d] * c.scale(shares(sim.compute_of([[p] for p in pieces])), [p.name for p in pieces]))
                est = np.asarray(est)
                errs[r].extend(np.abs(est / m - 1).tolist())
                slowest[r].append(abs(est.max() / m.max() - 1))
    for r in ridges:
        label = "the machine's speed alone" if r >= 1e6 else f"ridge {r:g}"
        print(f"{label}: device error {100 * np.mean(errs[r]):.1f}%, slowest device {100 * np.mean(slowest[r]):.1f}% "
              f"({len(errs[r])} devices)")


def repeat(args: argparse.Namespace) -> None:
    from embshard.hardware.evaluator import HardwareEvaluator
    from embshard.plan import Plan

    evaluator = HardwareEvaluator()
    with open(args.out, "w") as out:
        for rec in records(args.records)[:args.tasks]:
            task = task_of(rec)
            plans = [Plan.from_dict(rec["plans"][k]) for k in rec["plans"]][:2]
            copies = [Plan(p.task, f"{p.algorithm}@{j}", p.shards) for p in plans for j in range(3)]
            got = {"task": task.name, "calls": []}
            for _ in range(2):
                costs = evaluator.measure_many(task, copies)
                got["calls"].append({p.algorithm: {"compute": c.compute_ms, "plan": c.plan_cost_ms}
                                     for p, c in zip(copies, costs)})
            out.write(json.dumps(got) + "\n")
            out.flush()
            print(f"{task.name}: measured", flush=True)


def repeat_stats(args: argparse.Namespace) -> None:
    within, between = [], []
    for r in records(args.records):
        calls = r["calls"]
        for name in sorted({k.split("@")[0] for k in calls[0]}):
            per_call = [np.array([c[f"{name}@{j}"]["compute"] for j in range(3)]) for c in calls]
            for pc in per_call:
                within.extend((pc.std(axis=0, ddof=1) / pc.mean(axis=0)).tolist())
            means = np.array([pc.mean(axis=0) for pc in per_call])
            between.extend((np.abs(means[0] - means[1]) / means.mean(axis=0)).tolist())
    print(f"per-device compute of the same plan: coefficient of variation within a call {100 * np.median(within):.1f}% "
          f"(median of {len(within)} devices); the two calls' means apart by {100 * np.median(between):.1f}% (median)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("tasks", nargs="+")
    m.add_argument("--out", required=True)
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--ridge", type=float, default=None)
    lo = sub.add_parser("loo")
    lo.add_argument("records")
    lo.add_argument("--ridges", type=float, nargs="*", default=[1e9, 1e-2, 3e-3, 1e-3, 1e-4])
    rp = sub.add_parser("repeat")
    rp.add_argument("records")
    rp.add_argument("--tasks", type=int, default=3)
    rp.add_argument("--out", required=True)
    rs = sub.add_parser("repeat-stats")
    rs.add_argument("records")
    args = ap.parse_args()
    {"measure": measure, "loo": loo, "repeat": repeat, "repeat-stats": repeat_stats}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
