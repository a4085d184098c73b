"""Traffic and modeled communication time against the per-device memory cap (FlexShard's curve).

    python scripts/flexshard_curve.py experiments/flexshard/calibrated/task.json \
        --factors 1.0,1.05,1.1,1.25,1.5,2,3 --eval-batches 2 --out experiments/flexshard/calibrated/curve

For each factor f the task's cap becomes f x what TorchRec's row-wise layout needs on its
fullest device; every algorithm is planned under that same cap (fitted on steps
0..fit_batches-1) and its held-out steps replayed (embshard.flexshard.traffic). Writes
curve.json and curve.png (modeled comm ms, all-to-all MB and inter-host MB per step).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tqdm import tqdm

from embshard.errors import EmbshardError
from embshard.flexshard.baselines import HugeCTRHybridSharder, RowWiseSharder, TableRowWiseSharder
from embshard.flexshard.layout import plan_fingerprint
from embshard.flexshard.traffic import TrafficEvaluator
from embshard.io import save_png, write_json_atomic
from embshard.search.flexshard import FlexShardSharder
from embshard.task import Task

MB = 1e6


def sharders(fit_batches: int) -> dict:
    return {
        "row_wise": RowWiseSharder(),
        "row_wise_dedup": RowWiseSharder(dedup_ids=True, name="row_wise_dedup"),
        "table_row_wise": TableRowWiseSharder(),
        "hugectr_hybrid": HugeCTRHybridSharder(fit_batches=fit_batches),
        "flexshard": FlexShardSharder(fit_batches=fit_batches),
        # ablations of what FlexShard ships: without TorchRec's id dedup, with the dense replica sync
        "flexshard_no_dedup": FlexShardSharder(fit_batches=fit_batches, dedup_ids=False, name="flexshard_no_dedup"),
        "flexshard_dense_sync": FlexShardSharder(fit_batches=fit_batches, sparse_sync=False, name="flexshard_dense_sync"),
    }


def curve(task: Task, factors: list[float], fit_batches: int, eval_batches: int, algorithms: list[str]) -> dict:
    need = max(RowWiseSharder().shard(Task.from_dict({**task.to_dict(), "device_memory_bytes": 1 << 50})).memory_bytes(task))
    evaluator = TrafficEvaluator(fit_batches, eval_batches)
    evaluator.check_task(task)
    points: dict[str, list] = {a: [] for a in algorithms}
    cache: dict[tuple, dict] = {}  # plans that do not depend on the cap are replayed once
    for f in tqdm(factors, desc="memory caps"):
        capped = Task.from_dict({**task.to_dict(), "device_memory_bytes": math.ceil(f * need)})
        todo = {}
        for name, sharder in sharders(fit_batches).items():
            if name not in algorithms:
                continue
            try:
                plan = sharder.shard(capped)
            except EmbshardError as e:
                points[name].append({"factor": f, "valid": False, "error": str(e)})
                continue
            todo[name] = plan
        fresh = [n for n, p in todo.items() if plan_fingerprint(p) not in cache]
        for name, report in zip(fresh, evaluator.evaluate(capped, [todo[n] for n in fresh])):
            cache[plan_fingerprint(todo[name])] = report.to_dict()
        for name, plan in todo.items():
            d = cache[plan_fingerprint(plan)]
            points[name].append({
                "factor": f, "valid": True, "memory_max_bytes": max(plan.memory_bytes(capped)),
                "modeled_comm_ms": d["modeled_comm_ms"], "all_to_all_bytes": d["all_to_all_bytes"],
                "traffic_bytes": d["traffic_bytes"], "replica_sync_bytes": d["bytes_by_purpose"]["replica_sync"]["total"],
            })
    return {"task": task.name, "row_wise_need_bytes": need, "fit_batches": fit_batches, "eval_batches": eval_batches,
            "points": points}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for name, pts in data["points"].items():
        ok = [p for p in pts if p["valid"]]
        if not ok:
            continue
        x = [p["factor"] for p in ok]
        style = dict(marker="o", lw=2.2 if name.startswith("flexshard") else 1.2)
        axes[0].plot(x, [p["modeled_comm_ms"] for p in ok], label=name, **style)
        axes[1].plot(x, [p["all_to_all_bytes"]["total"] / MB for p in ok], label=name, **style)
        axes[2].plot(x, [p["all_to_all_bytes"]["inter_host"] / MB for p in ok], label=name, **style)
    titles = ("modeled communication ms per step", "all-to-all MB per step (intra + inter host)",
              "all-to-all MB per step between hosts")
    for ax, title in zip(axes, titles):
        ax.set_xlabel("memory cap per device / row_wise's need")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{data['task']}: same per-device memory cap for every algorithm (held-out steps)", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task")
    ap.add_argument("--factors", default="1.0,1.05,1.1,1.25,1.5,2,3")
    ap.add_argument("--algorithms", default="row_wise,row_wise_dedup,table_row_wise,hugectr_hybrid,flexshard,"
                                            "flexshard_no_dedup,flexshard_dense_sync")
    ap.add_argument("--fit-batches", type=int, default=4)
    ap.add_argument("--eval-batches", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        factors = [float(x) for x in args.factors.split(",")]
        if any(not math.isfinite(f) or f < 1 for f in factors):
            raise ValueError
    except ValueError:
        print(f"error: --factors must be numbers >= 1, got {args.factors!r}", file=sys.stderr)
        return 2
    unknown = sorted(set(args.algorithms.split(",")) - set(sharders(args.fit_batches)))
    if unknown:
        print(f"error: unknown algorithm(s) {unknown}; known: {', '.join(sharders(args.fit_batches))}", file=sys.stderr)
        return 2
    try:
        data = curve(Task.load(args.task), factors, args.fit_batches, args.eval_batches, args.algorithms.split(","))
    except EmbshardError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    out = Path(args.out)
    write_json_atomic(out / "curve.json", data)
    plot(data, out / "curve.png")
    for name, pts in data["points"].items():
        print(name.ljust(16), "  ".join(f"{p['factor']:.2f}x:{p['modeled_comm_ms']:.2f}ms" if p["valid"] else f"{p['factor']:.2f}x:-"
                                        for p in pts))
    print(f"wrote {out / 'curve.json'}, {out / 'curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
