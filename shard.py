"""Plan one or many tasks with one or many algorithms, evaluate the plans, report.

    python shard.py task_file=PATH algorithms=[size_greedy,torchrec] evaluate=measured out_dir=DIR
    python shard.py task_file=PATH plan_files=[A.json,B.json] algorithms=[] evaluate=measured   # plans made elsewhere

Writes DIR/report.json, DIR/plans/<algorithm>.json (DIR/plans/<task>/<algorithm>.json when
there are several tasks), DIR/measured_cost.png and DIR/config.yaml (the resolved config).
With no arguments it runs an embedded default: a small synthetic dataset, a few tasks,
every baseline and TorchRec's planner, measured on real kernels. `python shard.py --help`
lists the keys. Exit status: 0 when every task got a valid plan, 1 when some task got none
(report.json says why), 2 for bad input (one error line, nothing written).
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from embshard.cli import one_line_errors, refuse_additions, refuse_unknown_keys
from embshard.errors import InputError, nearest_name

log = logging.getLogger("shard")
ROOT = Path(__file__).resolve().parent


def as_override(value: object) -> str:
    """A config value as a user types it on the command line (null, true, [a,b])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)) or OmegaConf.is_list(value):
        return f"[{','.join(as_override(v) for v in value)}]"
    return str(value)


# `--help` (conf/hydra/help/shard.yaml) shows the current values with it
OmegaConf.register_new_resolver("as_override", as_override, replace=True)


@hydra.main(version_base="1.3", config_path="conf", config_name="shard")
def main(cfg: DictConfig) -> float | None:
    return one_line_errors(run, cfg)


def run(cfg: DictConfig) -> float | None:
    from hydra.utils import get_class, instantiate

    from embshard.compare import EVALUATE_MODES, evaluate_task, memory_shortfall, plan_task
    from embshard.hardware.probe import use_probe
    from embshard.report import format_results, format_table, summarize
    from embshard.search.base import GuardedSharder
    from embshard.task import load_tasks

    # Everything a user can get wrong is checked before anything is written.
    file_sharders = _plan_files(cfg)
    algorithms = _algorithms(cfg, allow_none=bool(file_sharders))
    taken = [n for n in file_sharders if n in algorithms]
    if taken:
        raise InputError(f"plan file(s) named {taken} clash with algorithms of the same name; rename their "
                         "'algorithm' field or drop the algorithm")
    if cfg.evaluate not in EVALUATE_MODES:
        raise InputError(f"evaluate must be one of {', '.join(EVALUATE_MODES)}, got {cfg.evaluate!r}")
    outputs = Path(str(cfg.paths.outputs))
    out_dir = Path(cfg.out_dir) if cfg.out_dir else (outputs if outputs.is_absolute() else ROOT / outputs) / "shard" / str(cfg.paths.run)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"out_dir {out_dir} exists and is not a folder")
    estimating = cfg.evaluate in ("estimated", "measured")
    judge = _cost_model_info(cfg) if estimating else None

    staging = Path(tempfile.mkdtemp(prefix=".shard-", dir=_existing_parent(out_dir)))
    try:
        if cfg.task_file:
            tasks = load_tasks(cfg.task_file)
        else:
            from embshard.data.default import build_default_tasks

            tasks = build_default_tasks(cfg.default_tasks, staging / "default_tasks", seed=cfg.seed)
        evaluator = instantiate(cfg.hardware) if cfg.evaluate == "measured" else None
        for task in tasks if evaluator is not None else ():  # what it cannot measure, before the probe
            evaluator.check_task(task)
        # a measuring session times the machine's speed probe first; learned cost models loaded
        # from here on rescale themselves to it (report.json: probe, rescale)
        probe = evaluator.session_probe() if evaluator is not None else None
        with use_probe(probe):
            sharders = {name: instantiate(cfg.searchers[name]) for name in algorithms}
            sharders.update(file_sharders)  # plans made elsewhere, compared on the same footing
            # what every known algorithm is meant for, read off its class: infeasibility hints name them
            catalogue = {name: get_class(cfg.searchers[name]._target_).capabilities for name in cfg.searchers}
            cost_model = instantiate(cfg.cost_model) if estimating else None
            for sharder in sharders.values():  # the measured guards (verify=auto: on when measuring)
                if isinstance(sharder, GuardedSharder):
                    sharder.attach_evaluator(evaluator)
            if cfg.evaluate == "traffic":
                evaluator = instantiate(cfg.traffic)
                for task in tasks:  # traces long enough for the fit and held-out steps, before any planning
                    evaluator.check_task(task)

            results = []
            for task in tasks:
                log.info("task %s: %d tables on %d devices", task.name, len(task.tables), task.num_devices)
                task_results = plan_task(task, sharders, catalogue)
                evaluate_task(task, task_results, cfg.evaluate, cost_model, evaluator, rounds=cfg.rounds)
                results += task_results
        if judge is not None:
            judge = {**judge, "rescale": getattr(cost_model, "rescale", None)}

        metric = {"measured": "measured_cost_ms", "traffic": "modeled_comm_ms"}.get(cfg.evaluate, "estimated_cost_ms")
        shown = metric if cfg.evaluate != "none" else "search_seconds"  # what the tables compare
        summary = summarize(results, shown)
        from embshard.hardware.evaluator import HardwareEvaluator

        network = evaluator.network if isinstance(evaluator, HardwareEvaluator) else None
        written = _write_outputs(staging, cfg, tasks, results, summary, metric, judge, probe, network)
        if not cfg.task_file:
            written.insert(0, "default_tasks/")
        _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    print(f"\n{len(tasks)} task(s), evaluate={cfg.evaluate}")
    if cfg.evaluate == "estimated":
        print(_estimate_caption(judge, results))
    for caveat in _caveats(tasks, cfg).values():
        print(caveat)
    if cfg.evaluate == "traffic":
        from embshard.flexshard.report import format_traffic

        print(format_traffic(results))
    for task in tasks:
        mine = [r for r in results if r.task == task.name]
        print(f"\ntask {task.name}: {len(task.tables)} tables on {task.num_devices} devices")
        print(format_results(task, mine, shown))
    if len(tasks) > 1:
        print(f"\nover the {len(tasks)} tasks:")
        print(format_table(summary, shown))
    print(f"\nwrote {out_dir}/: {', '.join(written)}")
    failed = [t for t in tasks if not any(r.valid for r in results if r.task == t.name)]
    if failed:  # the run did nothing for these tasks: say so, and exit non-zero (docs/usage.md)
        causes = {memory_shortfall(t) for t in failed} - {None}
        cause = f": {causes.pop()}" if len(failed) == 1 and causes else ""
        print(f"error: no valid plan for task(s) {', '.join(repr(t.name) for t in failed)}: every algorithm "
              f"failed{cause}; reasons in the table above and in report.json", file=sys.stderr)
        sys.exit(1)
    return summary[0].get(f"mean_{metric}") if cfg.evaluate != "none" else None


def _plan_files(cfg: DictConfig) -> dict:
    """`plan_files=[A.json,B.json]`: plans made elsewhere, each a row named by its `algorithm`
    (or, when two share one, by its file name)."""
    from embshard.search.plan_file import PlanFileSharder

    out: dict = {}
    for path in cfg.get("plan_files") or []:
        sharder = PlanFileSharder(str(path))
        name = sharder.name if sharder.name not in out else Path(str(path)).stem
        if name in out:
            raise InputError(f"plan_files: two files are both named {name!r}")
        sharder.name = name
        out[name] = sharder
    return out


def _algorithms(cfg: DictConfig, allow_none: bool = False) -> list[str]:
    """The algorithms to run: `algorithm=X` (one) or `algorithms=[X,Y]`, each known by name
    (none at all only beside plan_files)."""
    if cfg.algorithm is not None:
        if cfg.algorithms != OmegaConf.load(ROOT / "conf" / "shard.yaml").algorithms:
            raise InputError("set algorithm=X (one) or algorithms=[X,Y] (several), not both")
        algorithms = [str(cfg.algorithm)]
    elif isinstance(cfg.algorithms, str):
        algorithms = cfg.algorithms.split(",")
    else:
        algorithms = list(cfg.algorithms)
    unknown = [a for a in algorithms if a not in cfg.searchers]
    if unknown or not (algorithms or allow_none):
        near = [m for m in (nearest_name(a, cfg.searchers) for a in unknown) if m]
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise InputError(f"unknown algorithm(s) {unknown or algorithms}{hint}; known: {', '.join(cfg.searchers)}")
    return algorithms


def _cost_model_info(cfg: DictConfig) -> dict[str, str | None]:
    """Which model judges estimated costs (report.json: `cost_model`): neural (with its
    checkpoint), analytic, or the `_target_` of any other."""
    target = str(cfg.cost_model._target_)
    name = {"embshard.costs.neural.NeuralCostModels.load": "neural",
            "embshard.costs.analytic.AnalyticCostModel": "analytic"}.get(target, target)
    path = cfg.cost_model.get("path")
    if path is not None:  # as NeuralCostModels.load resolves it: the working directory, then the project root
        p = Path(str(path))
        path = str(p.resolve() if p.is_absolute() or p.exists() or not (ROOT / p).exists() else ROOT / p)
    return {"name": name, "target": target, "checkpoint": path}


def _estimate_caption(judge: dict[str, str | None], results) -> str:
    """Whose estimates the table shows, and what that means for "vs best"."""
    model = f"the {judge['name']} cost model" + (f" ({judge['checkpoint']})" if judge["checkpoint"] else "")
    lines = [f"costs are ESTIMATES by {model}, not measurements; \"vs best\" compares these estimates "
             "(how far they are from measured costs: 'Fidelity' in docs/neuroshard.md; measure with evaluate=measured)"]
    fallback = [r for r in results if r.envelope and r.envelope.get("comm_estimate") == "analytic"]
    if fallback:
        lines.append(f"the all-to-alls of {len(fallback)} plan(s) are the analytic model's, not the comm models' "
                     f"({fallback[0].envelope['comm_fallback_reason']}; report.json: envelope.comm_estimate)")
    same = sorted({r.algorithm for r in results if r.search_info and judge["checkpoint"] is not None
                   and r.search_info.get("checkpoint") == judge["checkpoint"]})
    if same:
        lines.append(f"{', '.join(same)} searched against this same model, so its estimate favours "
                     f"{'it' if len(same) == 1 else 'them'}")
    return "\n".join(lines)


def _caveats(tasks, cfg: DictConfig) -> dict[str, str]:
    """Per task, what the evaluation leaves out (report.json: `caveats`)."""
    from embshard.compare import sequence_caveat

    step = str(cfg.hardware.get("step", "kernels"))
    return {t.name: c for t in tasks if (c := sequence_caveat(t, cfg.evaluate, step))}


def _write_outputs(staging: Path, cfg: DictConfig, tasks, results, summary, metric: str,
                   judge: dict[str, str | None] | None, probe=None, network: list[dict] | None = None) -> list[str]:
    """Write everything into `staging`; returns the names written (what the run may claim)."""
    from embshard.io import write_json_atomic, write_text_atomic
    from embshard.report import plot_costs, vs_best_heuristic

    vs_heur = vs_best_heuristic(results, metric)

    written = ["report.json"]
    for r in results:
        if r.plan is None:
            continue
        where = staging / "plans" / (f"{r.algorithm}.json" if len(tasks) == 1 else f"{r.task}/{r.algorithm}.json")
        r.plan.save(where)
        if "plans/" not in written:
            written.append("plans/")
    report = {
        "evaluate": cfg.evaluate,
        "metric": metric,
        # the model that estimated `estimated_cost_ms` (null: nothing was estimated), and how
        # it was rescaled to this session's probe
        "cost_model": judge,
        # the measurement protocol and the speed probe of this measuring session (null: none)
        "measure": OmegaConf.to_container(cfg.measure, resolve=True) if cfg.evaluate == "measured" else None,
        "probe": probe.to_dict() if probe is not None else None,
        # evaluate=measured: the network each measuring call's all-to-alls ran on (conf/cluster/)
        "network": network,
        "tasks": [t.name for t in tasks],
        # per task, what this evaluation leaves out (sequence tables under estimated / measured)
        "caveats": _caveats(tasks, cfg),
        # per result: the ratio to its task's best heuristic, with the paired interval
        "results": [r.to_dict() | {"vs_best_heuristic": vs_heur.get((r.task, r.algorithm))} for r in results],
        "summary": summary,
    }
    write_json_atomic(staging / "report.json", report)
    write_text_atomic(staging / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    written.append("config.yaml")
    if cfg.plot and cfg.evaluate == "measured" and plot_costs(results, staging / "measured_cost.png", metric):
        written.append("measured_cost.png")
    if cfg.plot and cfg.evaluate == "traffic":
        from embshard.flexshard.report import plot_traffic

        if plot_traffic(results, staging / "traffic.png"):
            written.append("traffic.png")
    return written


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
    refuse_additions(sys.argv[1:], ROOT / "conf", "shard", "shard.py")
    refuse_unknown_keys(sys.argv[1:], ROOT / "conf", "shard", "shard.py")
    main()
