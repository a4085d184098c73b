"""Do a planner's plans change for the worse between two versions of the code? Plans 16 generated
large tasks (200-2,000 tables, 160-1,024 devices, batch 2,048-65,536, dims 4-256, heavy-tailed
rows, no histograms: sizes where DreamShard and AutoShard plan with the argmax episode alone)
with one portfolio member and records each plan's analytic cost and the CPU seconds of `shard()`
(one thread), and the portfolio's ranker's (NeuroShard's cost models) estimate of it; `compare`
gives the paired ratio new / old with its bootstrap interval, and on how many tasks the plans are
identical (each record holds the plan's signature). `--tasks` plans given task files instead
(e.g. the validation tasks of `scripts/portfolio_eval.py tasks --split validation`); `--tighten F`
adds each task again with memory F x the least that holds it (max of the biggest table and an
even share), where the look-ahead works hardest; `--sampled` plans 12 generated tasks of 150-2,000
tables on 4-16 devices instead, where DreamShard and AutoShard add their sampled episodes. Any of
the portfolio's nine members.

    git worktree add /tmp/old <commit>
    PYTHONPATH=/tmp/old/src python scripts/rl_route_check.py record old.json --member dreamshard
    python scripts/rl_route_check.py record new.json --member dreamshard
    python scripts/rl_route_check.py compare old.json new.json [--key ranker_ms]

Used for the numpy planning episode (docs/portfolio.md, "DreamShard and AutoShard plan in
numpy"; records docs/portfolio/eval/numpy_route_<member>_{old,new}.json) and for the speed-ups
that must leave plans identical ("Same plans, less work"; docs/portfolio/eval/identity/).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time

import numpy as np
import torch

from embshard import Table, Task
from embshard.costs.analytic import AnalyticCostModel
from embshard.io import write_json_atomic
from embshard.search.guard import heuristic_sharders
from embshard.search.portfolio import LEARNED, PortfolioSharder, default_members
from embshard.stats import paired_ratio_summary

TASKS = 16


SAMPLED_TASKS = 12


def task(i: int) -> Task:
    rng = np.random.default_rng(1000 + i)
    n = int(rng.choice([200, 400, 800, 1200, 2000]))
    d = int(rng.choice([160, 256, 512, 1024]))
    return _generated(rng, f"q{i}", n, d)


def sampled_task(i: int) -> Task:
    """A task of 150-2,000 tables on 4-16 devices, under DreamShard's and AutoShard's
    `sample_max_work` (tables x devices x 8 <= 200,000), where they add 8 sampled episodes."""
    rng = np.random.default_rng(500 + i)
    d = int(rng.choice([4, 8, 12, 16]))
    n = int(rng.integers(150, min(2000, 25000 // d)))
    return _generated(rng, f"mid{i}", n, d)


def _generated(rng: np.random.Generator, name: str, n: int, d: int) -> Task:
    batch = int(rng.choice([2048, 8192, 16384, 65536]))
    tables = tuple(Table(f"t{j}", int(min(5e7, 1000 * rng.pareto(1.2) * 50 + 100)), int(rng.choice([4, 8, 16, 32, 64, 128, 256])),
                         float(rng.lognormal(1.5, 1.0))) for j in range(n))
    probe = Task("p", d, 1, batch, tables)
    need = [probe.table_memory_bytes(t) for t in tables]
    return Task(f"{name}-{n}x{d}", d, int(max(1.6 * sum(need) / d, 1.1 * max(need))), batch, tables)


def tightened(t: Task, factor: float) -> Task:
    """`t` with memory `factor` x the least that holds it (biggest table, or an even share)."""
    need = [t.table_memory_bytes(x) for x in t.tables]
    least = max(max(need), sum(need) / t.num_devices)
    return dataclasses.replace(t, name=f"{t.name}-tight{factor}", device_memory_bytes=int(least * factor))


def record(out: str, member: str, files: list[str], tighten: list[float], sampled: bool = False) -> None:
    torch.set_num_threads(1)
    s = default_members()[member]
    if hasattr(s, "load"):
        s.load()
    ranker, _ = PortfolioSharder().ranking_model()
    rec = {}
    if files:
        tasks = [Task.load(f) for f in files]
    else:
        tasks = [sampled_task(i) for i in range(SAMPLED_TASKS)] if sampled else [task(i) for i in range(TASKS)]
    for t in tasks + [tightened(t, f) for f in tighten for t in tasks]:
        c0 = time.process_time()
        plan = s.shard(t)
        cpu = time.process_time() - c0
        cost = AnalyticCostModel().device_costs(t, plan).plan_cost_ms
        ranked = ranker.device_costs(t, plan).plan_cost_ms
        rec[t.name] = {"cpu_seconds": cpu, "analytic_ms": cost, "ranker_ms": ranked,
                       "samples": getattr(s, "last_stats", {}).get("samples"),
                       "plan": hashlib.sha1(repr(plan.signature()).encode()).hexdigest()[:16]}
        print(f"{t.name}: {cpu:.2f} s CPU, analytic {cost:.2f} ms, ranker {ranked:.2f} ms", flush=True)
    write_json_atomic(out, {"member": member, "tasks": rec})


def compare(old: str, new: str, key: str) -> None:
    a, b = (json.load(open(p))["tasks"] for p in (old, new))
    ratios = [b[k][key] / a[k][key] for k in a]
    print(f"{key} new / old over {len(ratios)} tasks: {paired_ratio_summary(ratios).text(4)} "
          f"(worst {max(ratios):.4f}x, equal on {sum(r == 1.0 for r in ratios)})")
    print(f"CPU seconds: {sum(x['cpu_seconds'] for x in a.values()):.1f} -> {sum(x['cpu_seconds'] for x in b.values()):.1f} s")
    if all("plan" in x for x in list(a.values()) + list(b.values())):
        same = [k for k in a if a[k]["plan"] == b[k]["plan"]]
        print(f"plans identical on {len(same)} of {len(a)} tasks"
              + ("" if len(same) == len(a) else f"; differ on {', '.join(k for k in a if k not in same)}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("--member", default="dreamshard", choices=list(LEARNED) + list(heuristic_sharders()))
    r.add_argument("--tasks", nargs="*", default=[], help="task files (default: the 16 generated tasks)")
    r.add_argument("--sampled", action="store_true",
                   help="the 12 generated tasks of 150-2,000 tables on 4-16 devices instead, where DreamShard "
                        "and AutoShard sample")
    r.add_argument("--tighten", nargs="*", type=float, default=[],
                   help="also each task with memory this many times the least that holds it")
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--key", default="analytic_ms", choices=["analytic_ms", "ranker_ms", "cpu_seconds"])
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.out, args.member, args.tasks, args.tighten, args.sampled)
    else:
        compare(args.old, args.new, args.key)


if __name__ == "__main__":
    main()
