"""FlexShard against every baseline on held-out sequence tasks, and the claims checked per task.

    python scripts/flexshard_heldout.py tasks --out experiments/flexshard/heldout --num-tasks 10 --seed 1
    python shard.py task_file=experiments/flexshard/heldout/tasks evaluate=traffic traffic.eval_batches=2 \
        algorithms=[table_wise,row_wise,row_wise_dedup,table_row_wise,data_parallel,hugectr_hybrid,flexshard] \
        out_dir=experiments/flexshard/heldout/shard
    python scripts/flexshard_heldout.py claims experiments/flexshard/calibrated/shard/report.json \
        experiments/flexshard/zipf1/shard/report.json experiments/flexshard/heldout/shard/report.json \
        --out docs/flexshard/claims

(`make flexshard-heldout` runs all three.) `tasks` draws the tasks of
`embshard.flexshard.tasks.HeldoutFamily` (2-4 hosts of 4-8 devices, Zipf exponents 0.6-1.4,
mean sequence lengths 10-200, tables of 10^3-10^8 rows, widths 16-128), each with its trace
of 4 fit + 2 held-out steps. `claims` reads shard.py reports (evaluate=traffic) and writes,
per task, FlexShard's modeled inter-host all-to-all and modeled communication time against
the better of row_wise / table_row_wise and the better of row_wise_dedup / hugectr_hybrid,
the mean over tasks with its bootstrap interval, the worst task, and which targets are met
(claims.md, claims.json). Beside them, per task, the placement floor
(`embshard.flexshard.floor`): the least modeled communication any placement of rows can have
on the same replayed steps when every copy is current after every step (expected over the
dealing of samples to hosts), read from the task and the replay steps each report's
config.yaml names; a target below the floor is out of reach of every plan, not only FlexShard's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from embshard.io import write_json_atomic, write_text_atomic
from embshard.stats import paired_ratio_summary

#: the issue's targets: (FlexShard / reference ratio must be <=, reference pair)
TARGETS = {
    "inter_host_a2a_vs_row_wise": (0.15, ("row_wise", "table_row_wise")),
    "comm_ms_vs_row_wise": (1 / 5, ("row_wise", "table_row_wise")),
    "comm_ms_vs_dedup_baselines": (1 / 1.5, ("row_wise_dedup", "hugectr_hybrid")),
}


def make_tasks(out: Path, num_tasks: int, seed: int) -> None:
    from embshard.flexshard.tasks import HeldoutFamily, heldout_draw, heldout_task

    family = HeldoutFamily()
    rows, draws = [], {}
    for i in range(num_tasks):
        task = heldout_task(family, i, seed, out)
        draws[task.name] = heldout_draw(family, i, seed)
        task.save(out / "tasks" / f"{task.name}.json")
        rows.append(f"{task.name}: {len(task.tables)} tables ({min(t.rows for t in task.tables):,}.."
                    f"{max(t.rows for t in task.tables):,} rows), {task.hosts} hosts x {task.devices_per_host}, "
                    f"batch {task.batch_size}, mean lengths {min(t.pooling_factor for t in task.tables):.0f}.."
                    f"{max(t.pooling_factor for t in task.tables):.0f}, Zipf {min(draws[task.name]['zipf']):.2f}.."
                    f"{max(draws[task.name]['zipf']):.2f}")
        print(rows[-1])
    write_json_atomic(out / "family.json", {"seed": seed, "num_tasks": num_tasks, "family": family.to_dict(),
                                            "tasks": draws})


def _value(result: dict, key: str) -> float | None:
    if not result.get("valid") or result.get("traffic") is None:
        return None
    if key == "inter":
        return float(result["traffic"]["all_to_all_bytes"]["inter_host"])
    return float(result["modeled_comm_ms"])


def report_floors(report_path: Path) -> dict[str, dict]:
    """The placement floor of every task of one evaluate=traffic report, on the steps it replayed
    (task_file and traffic.* of the config.yaml shard.py wrote beside it)."""
    from omegaconf import OmegaConf

    from embshard.flexshard.floor import placement_floor
    from embshard.flexshard.stats import BatchSplit
    from embshard.flexshard.traffic import global_batches
    from embshard.task import load_tasks

    config = report_path.parent / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"error: {report_path}: no config.yaml beside it to name its tasks and replayed steps")
    cfg = OmegaConf.load(config)
    split = BatchSplit(cfg.traffic.fit_batches, cfg.traffic.eval_batches, cfg.traffic.seed)
    out = {}
    for task in load_tasks(cfg.task_file):
        out[task.name] = placement_floor(task, global_batches(task, split.eval_steps, split.seed)).to_dict()
    return out


def claims(reports: list[Path], floors: bool = True) -> dict:
    """Per task, FlexShard's ratios to the better reference of each pair (TARGETS), and where
    `floors`, the placement floor's ratio to the same reference."""
    tasks = []
    for path in reports:
        report = json.loads(path.read_text())
        floor_of = report_floors(path) if floors else {}
        by_task: dict[str, dict[str, dict]] = {}
        for r in report["results"]:
            by_task.setdefault(r["task"], {})[r["algorithm"]] = r
        for name, results in by_task.items():
            if "flexshard" not in results or not results["flexshard"].get("valid"):
                raise SystemExit(f"error: {path}: task {name!r} has no valid flexshard result")
            row = {"task": name, "report": str(path), "modeled_comm_ms": {}, "inter_host_a2a_mb": {}}
            for algo, r in results.items():
                if _value(r, "ms") is not None:
                    row["modeled_comm_ms"][algo] = _value(r, "ms")
                    row["inter_host_a2a_mb"][algo] = _value(r, "inter") / 1e6
            for key, (_, pair) in TARGETS.items():
                metric = "inter_host_a2a_mb" if key.startswith("inter") else "modeled_comm_ms"
                refs = {a: row[metric][a] for a in pair if a in row[metric]}
                if not refs:
                    raise SystemExit(f"error: {path}: task {name!r} has no valid plan of {' or '.join(pair)}")
                best = min(refs, key=refs.get)
                row[key] = {"reference": best, "ratio": row[metric]["flexshard"] / refs[best]}
                if name in floor_of and metric == "modeled_comm_ms":
                    row[key]["floor_ratio"] = floor_of[name]["expected_ms"] / refs[best]
            if name in floor_of:
                row["floor"] = floor_of[name]
                row["flexshard_over_floor"] = row["modeled_comm_ms"]["flexshard"] / floor_of[name]["expected_ms"]
            tasks.append(row)
    summary = {}
    for key, (target, _) in TARGETS.items():
        ratios = [t[key]["ratio"] for t in tasks]
        s = paired_ratio_summary(ratios)
        worst = max(tasks, key=lambda t: t[key]["ratio"])
        summary[key] = {"target_ratio_at_most": target, "mean": s.mean, "low": s.low, "high": s.high,
                        "worst": worst[key]["ratio"], "worst_task": worst["task"],
                        "tasks_meeting": sum(r <= target for r in ratios), "tasks": len(ratios),
                        "mean_met": s.mean <= target, "worst_met": worst[key]["ratio"] <= target}
        floor_ratios = [t[key]["floor_ratio"] for t in tasks if "floor_ratio" in t[key]]
        if floor_ratios and len(floor_ratios) == len(tasks):
            summary[key].update(floor_mean=float(np.mean(floor_ratios)),
                                tasks_within_reach=sum(r <= target for r in floor_ratios))
    over = [t["flexshard_over_floor"] for t in tasks if "flexshard_over_floor" in t]
    if over and len(over) == len(tasks):
        s = paired_ratio_summary(over)
        summary["flexshard_over_floor"] = {"mean": s.mean, "low": s.low, "high": s.high, "worst": max(over),
                                           "tasks": len(over)}
    return {"tasks": tasks, "summary": summary}


def markdown(result: dict) -> str:
    floors = all("floor" in row for row in result["tasks"])
    head = ("| task | FlexShard modeled comm ms | row_wise | table_row_wise | row_wise_dedup | hugectr_hybrid | "
            "inter-host a2a vs better of rw/twrw | comm vs better of rw/twrw | comm vs better of rw_dedup/hugectr |")
    if floors:
        head += " floor ms | FlexShard / floor | floor vs better of rw/twrw | floor vs better of rw_dedup/hugectr |"
    lines = [head, "|" + "---|" * (13 if floors else 9)]

    def ms(row: dict, algo: str) -> str:
        v = row["modeled_comm_ms"].get(algo)
        return f"{v:.3f}" if v is not None else "no valid plan"

    for row in result["tasks"]:
        cells = [row["task"], ms(row, "flexshard"), ms(row, "row_wise"), ms(row, "table_row_wise"),
                 ms(row, "row_wise_dedup"), ms(row, "hugectr_hybrid")]
        for key in TARGETS:
            c = row[key]
            cells.append(f"{c['ratio']:.3f}x ({c['reference']})")
        if floors:
            cells += [f"{row['floor']['expected_ms']:.3f}", f"{row['flexshard_over_floor']:.3f}x",
                      f"{row['comm_ms_vs_row_wise']['floor_ratio']:.3f}x",
                      f"{row['comm_ms_vs_dedup_baselines']['floor_ratio']:.3f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| claim | target (FlexShard / reference) | mean over tasks [95% bootstrap] | worst task | "
              "tasks meeting it |", "|---|---|---|---|---|"]
    names = {"inter_host_a2a_vs_row_wise": "inter-host all-to-all vs the better of row_wise / table_row_wise",
             "comm_ms_vs_row_wise": "modeled comm vs the better of row_wise / table_row_wise",
             "comm_ms_vs_dedup_baselines": "modeled comm vs the better of row_wise_dedup / hugectr_hybrid"}
    for key in TARGETS:
        s = result["summary"][key]
        verdict = lambda ok: "met" if ok else "**not met**"  # noqa: E731
        lines.append(f"| {names[key]} | <= {s['target_ratio_at_most']:.3f}x | {s['mean']:.3f}x [{s['low']:.3f}, "
                     f"{s['high']:.3f}]: {verdict(s['mean_met'])} | {s['worst']:.3f}x ({s['worst_task']}): "
                     f"{verdict(s['worst_met'])} | {s['tasks_meeting']} of {s['tasks']} |")
    if floors:
        lines += ["", "The floor (no placement of rows goes below it; `embshard.flexshard.floor`) against the same "
                  "references:", "", "| claim | target | floor's ratio, mean over tasks | tasks where the target "
                  "is above the floor (reachable at all) |", "|---|---|---|---|"]
        for key in ("comm_ms_vs_row_wise", "comm_ms_vs_dedup_baselines"):
            s = result["summary"][key]
            lines.append(f"| {names[key]} | <= {s['target_ratio_at_most']:.3f}x | {s['floor_mean']:.3f}x | "
                         f"{s['tasks_within_reach']} of {s['tasks']} |")
        o = result["summary"]["flexshard_over_floor"]
        lines += ["", f"FlexShard's modeled comm over the floor: mean {o['mean']:.3f}x [{o['low']:.3f}, {o['high']:.3f}] "
                  f"over {o['tasks']} tasks, worst {o['worst']:.3f}x."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tasks", help="write the held-out tasks and their traces")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--num-tasks", type=int, default=10)
    t.add_argument("--seed", type=int, default=1)
    c = sub.add_parser("claims", help="FlexShard's ratios per task from shard.py reports")
    c.add_argument("reports", type=Path, nargs="+")
    c.add_argument("--out", type=Path, required=True, help="writes OUT.md and OUT.json")
    c.add_argument("--no-floor", action="store_true", help="skip the placement floor (needs the tasks' traces)")
    args = ap.parse_args(argv)
    if args.command == "tasks":
        if args.num_tasks < 1:
            print("error: --num-tasks must be positive", file=sys.stderr)
            return 2
        make_tasks(args.out, args.num_tasks, args.seed)
        return 0
    missing = [str(p) for p in args.reports if not p.is_file()]
    if missing:
        print(f"error: no such report(s): {', '.join(missing)}", file=sys.stderr)
        return 2
    result = claims(args.reports, floors=not args.no_floor)
    write_json_atomic(args.out.with_suffix(".json"), result)
    write_text_atomic(args.out.with_suffix(".md"), markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
