"""Plan one or many tasks with one or many algorithms, evaluate the plans, report.

    python shard.py task_file=PATH algorithms=[size_greedy,torchrec] evaluate=measured out_dir=DIR

Writes DIR/report.json, DIR/plans/<algorithm>.json (DIR/plans/<task>/<algorithm>.json when
there are several tasks), DIR/measured_cost.png and DIR/config.yaml (the resolved config).
With no arguments it runs an embedded default: a small synthetic dataset, a few tasks,
every baseline and TorchRec's planner, measured on real kernels.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from datetime import datetime
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from embshard.cli import one_line_errors
from embshard.errors import InputError

log = logging.getLogger("shard")
ROOT = Path(__file__).resolve().parent


@hydra.main(version_base="1.3", config_path="conf", config_name="shard")
def main(cfg: DictConfig) -> float | None:
    return one_line_errors(run, cfg)


def run(cfg: DictConfig) -> float | None:
    from hydra.utils import instantiate

    from embshard.compare import EVALUATE_MODES, evaluate_task, plan_task
    from embshard.report import format_table, plot_costs, summarize
    from embshard.task import load_tasks

    # Everything a user can get wrong is checked before anything is written.
    algorithms = list(cfg.algorithms) if not isinstance(cfg.algorithms, str) else cfg.algorithms.split(",")
    unknown = [a for a in algorithms if a not in cfg.searchers]
    if unknown or not algorithms:
        raise InputError(f"unknown algorithm(s) {unknown or algorithms}; known: {', '.join(cfg.searchers)}")
    if cfg.evaluate not in EVALUATE_MODES:
        raise InputError(f"evaluate must be one of {', '.join(EVALUATE_MODES)}, got {cfg.evaluate!r}")
    out_dir = Path(cfg.out_dir) if cfg.out_dir else ROOT / "outputs" / "shard" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"out_dir {out_dir} exists and is not a folder")

    staging = Path(tempfile.mkdtemp(prefix=".shard-", dir=_existing_parent(out_dir)))
    try:
        if cfg.task_file:
            tasks = load_tasks(cfg.task_file)
        else:
            from embshard.data.default import build_default_tasks

            tasks = build_default_tasks(cfg.default_tasks, staging / "default_tasks", seed=cfg.seed)
        sharders = {name: instantiate(cfg.searchers[name]) for name in algorithms}
        cost_model = instantiate(cfg.cost_model) if cfg.evaluate in ("estimated", "measured") else None
        evaluator = instantiate(cfg.hardware) if cfg.evaluate == "measured" else None
        for sharder in sharders.values():  # NeuroShard's measured guard (verify=auto: on when measuring)
            if callable(getattr(sharder, "attach_evaluator", None)):
                sharder.attach_evaluator(evaluator)
        if cfg.evaluate == "traffic":
            evaluator = instantiate(cfg.traffic)
            for task in tasks:  # traces long enough for the fit and held-out steps, before any planning
                evaluator.check_task(task)

        results = []
        for task in tasks:
            log.info("task %s: %d tables on %d devices", task.name, len(task.tables), task.num_devices)
            task_results = plan_task(task, sharders)
            evaluate_task(task, task_results, cfg.evaluate, cost_model, evaluator, rounds=cfg.rounds)
            results += task_results

        metric = {"measured": "measured_cost_ms", "traffic": "modeled_comm_ms"}.get(cfg.evaluate, "estimated_cost_ms")
        summary = summarize(results, metric) if cfg.evaluate != "none" else summarize(results, "search_seconds")
        _write_outputs(staging, cfg, tasks, results, summary, metric)
        _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    print(f"\n{len(tasks)} task(s), evaluate={cfg.evaluate}:")
    if cfg.evaluate == "traffic":
        from embshard.flexshard.report import format_traffic

        print(format_traffic(results))
    if cfg.evaluate != "none":
        print(format_table(summary, metric))
    else:
        for r in results:
            print(f"  {r.task:24s} {r.algorithm:20s} {'valid' if r.valid else 'INVALID: ' + str(r.error)}")
    charts = [c for c in ("measured_cost.png", "traffic.png") if (out_dir / c).exists()]
    print(f"\nwrote {out_dir}/report.json, plans/, config.yaml" + "".join(f", {c}" for c in charts))
    first = summary[0].get(f"mean_{metric}") if cfg.evaluate != "none" else None
    return first


def _write_outputs(staging: Path, cfg: DictConfig, tasks, results, summary, metric: str) -> None:
    from embshard.io import write_json_atomic, write_text_atomic
    from embshard.report import plot_costs

    (staging / "plans").mkdir(exist_ok=True)
    for r in results:
        if r.plan is None:
            continue
        where = staging / "plans" / (f"{r.algorithm}.json" if len(tasks) == 1 else f"{r.task}/{r.algorithm}.json")
        r.plan.save(where)
    report = {
        "evaluate": cfg.evaluate,
        "metric": metric,
        "tasks": [t.name for t in tasks],
        "results": [r.to_dict() for r in results],
        "summary": summary,
    }
    write_json_atomic(staging / "report.json", report)
    write_text_atomic(staging / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if cfg.plot and cfg.evaluate == "measured":
        plot_costs(results, staging / "measured_cost.png", metric)
    if cfg.plot and cfg.evaluate == "traffic":
        from embshard.flexshard.report import plot_traffic

        plot_traffic(results, staging / "traffic.png")


def _existing_parent(path: Path) -> Path:
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return p


def _publish(staging: Path, out_dir: Path) -> None:
    """Move finished outputs into out_dir, file by file (each a rename)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in sorted(staging.rglob("*")):
        if src.is_file():
            dst = out_dir / src.relative_to(staging)
            dst.parent.mkdir(parents=True, exist_ok=True)
            src.replace(dst)


if __name__ == "__main__":
    main()
