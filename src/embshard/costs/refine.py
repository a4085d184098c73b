"""Close the loop: measure the shards the search actually proposes, and re-train on them.

A cost model trained on random shards is trusted by a search exactly where it has seen
nothing: the search drives its plans to the model's errors. DreamShard answers by measuring
what its policy proposes; this stage does the same for NeuroShard's models.

    python train.py stage=refine refine=cpu out_dir=experiments/refine

Round r (r = 0, 1, ...):

1. the round's models: pre-trained on the cost data so far (round 0: the random-shard data
   of `data_dir`, or `checkpoint` when given);
2. a fresh set of tasks from the broad task distribution (`task=user_broad`: batch
   2048-65536, tables with and without histograms, dims 4-256, 2-16 devices), planned by
   NeuroShard against the round's models and by the best heuristics;
3. every plan measured on the hardware (`HardwareEvaluator.measure_many`: each device's
   fused kernel, the all-to-all with its compute delays), interleaved;
4. the models' predictions for those device shards and plans, made BEFORE measuring,
   scored against the measurements: this is the error on search-proposed shards, out of
   sample by construction. Compared with the same models' error on held-out random shards;
5. the measured device shards and all-to-alls appended to the cost data (origin = the
   algorithm that proposed them), for the next round's models.

It stops when the error on the search's shards is within `stop_ratio` × the error on random
shards (or after `rounds`), and pre-trains the final models on everything. Each round's
measurements are written before anything is trained on them, so a stopped run resumes.

Outputs: `round<r>/` (the round's models), `rounds/round<r>/{compute,comm}.jsonl` and
`metrics.json` (the round's measurements and scores), `data/` (all cost data so far),
`final/` (the refined models, metrics, data card), `refine.json` and `refine.md` (the
rounds side by side), `config.yaml`.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from embshard.costs.collect import PROFILE, comm_record, compute_record, piece_record, read_profile
from embshard.costs.pretrain import per_task_kendall_taus, pretrain, regression_metrics
from embshard.errors import EmbshardError, InfeasibleError, InputError
from embshard.io import atomic_path, write_json_atomic, write_text_atomic
from embshard.task import Task

log = logging.getLogger(__name__)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def measure_round(tasks: list[Task], sharders: Mapping[str, Any], models: Any, evaluator: Any, round_index: int,
                  progress: bool = True, probe_id: str | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """Plan every task with every sharder, predict, measure. Returns (compute samples, comm
    samples, plan rows); each sample carries the prediction made before measuring, and the id
    of the round's speed probe (`probe_id`) when there is one."""
    tag = {"probe": probe_id} if probe_id is not None else {}
    from embshard.plan import validate

    compute_rows, comm_rows, plan_rows = [], [], []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), desc=f"refine round {round_index}", unit="task")
    try:
        for task in tasks:
            plans, names = [], []
            for name, sharder in sharders.items():
                try:
                    plan = sharder.shard(task)
                    validate(task, plan)
                except EmbshardError as e:
                    log.warning("refine: %s has no valid plan for %s (%s)", name, task.name, e)
                    continue
                plans.append(plan)
                names.append(name)
            if not plans:
                continue
            predicted = [models.device_costs(task, p) for p in plans]
            measured = evaluator.measure_many(task, plans)
            for name, plan, pred, meas in zip(names, plans, predicted, measured):
                for dev, on in enumerate(plan.by_device(task.num_devices)):
                    if not on:
                        continue
                    rec = [piece_record(task.table_by_name[s.table], s, task.batch_size) for s in on]
                    compute_rows.append(compute_record(
                        f"refine{round_index}-{task.name}-{name}-d{dev}", "train", rec, task.batch_size,
                        meas.compute_ms[dev], meas.compute_spread_ms[dev],
                        origin=name, round=round_index, task=task.name, predicted_ms=pred.compute_ms[dev], **tag))
                if task.num_devices > 1:
                    lo = min(meas.compute_ms)
                    comm_rows.append(comm_record(
                        f"refine{round_index}-{task.name}-{name}", task.batch_size, plan.device_widths(task.num_devices, task.table_by_name),
                        [round(c - lo, 3) for c in meas.compute_ms], meas.forward_comm_ms, meas.backward_comm_ms,
                        meas.forward_comm_spread_ms, meas.backward_comm_spread_ms, origin=name, round=round_index,
                        task=task.name, predicted_forward_ms=pred.forward_comm_ms,
                        predicted_backward_ms=pred.backward_comm_ms, **tag))
                plan_rows.append({"task": task.name, "algorithm": name, "num_devices": task.num_devices,
                                  "batch_size": task.batch_size, "predicted_ms": pred.plan_cost_ms,
                                  "measured_ms": meas.plan_cost_ms, "spread_ms": meas.plan_cost_spread_ms})
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return compute_rows, comm_rows, plan_rows


def score_round(compute_rows: list[dict], comm_rows: list[dict], plan_rows: list[dict]) -> dict[str, Any]:
    """Predicted (before measuring) vs measured, per proposing algorithm and in all."""
    out: dict[str, Any] = {"compute": {}, "forward_comm": {}, "plan_cost": {}}
    groups = sorted({r["origin"] for r in compute_rows})
    for g in groups + ["all"]:
        rows = [r for r in compute_rows if g == "all" or r["origin"] == g]
        out["compute"][g] = regression_metrics([r["median_ms"] for r in rows], [r["predicted_ms"] for r in rows])
        cm = [r for r in comm_rows if g == "all" or r["origin"] == g]
        if cm:
            out["forward_comm"][g] = regression_metrics([x for r in cm for x in r["forward_ms"]],
                                                        [x for r in cm for x in r["predicted_forward_ms"]])
    taus = per_task_kendall_taus(plan_rows, "measured_ms", "predicted_ms")
    out["plan_cost"] = {"mean_task_kendall_tau": float(np.mean(taus)) if taus else None, "tasks": len(taus),
                        **regression_metrics([r["measured_ms"] for r in plan_rows], [r["predicted_ms"] for r in plan_rows])}
    return out


def _append(data_dir: Path, kind: str, rows: list[dict]) -> None:
    path = data_dir / f"{kind}.jsonl"
    old = path.read_text() if path.exists() else ""
    with atomic_path(path) as tmp:
        tmp.write_text(old + "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def refine(cfg: Mapping[str, Any], pretrain_cfg: Any, make_tasks: Callable[[int], list[Task]],
           make_sharders: Callable[[Path], dict[str, Any]], evaluator: Any, out_dir: str | Path) -> dict[str, Any]:
    """Run the loop (module docstring).

    Args:
        cfg: the `refine` config group: data_dir, checkpoint, rounds, stop_ratio.
        pretrain_cfg: the cost-model pre-training settings (cost_model.pretrain).
        make_tasks: round index -> that round's tasks.
        make_sharders: checkpoint path -> {algorithm name: sharder}.
        evaluator: a HardwareEvaluator.
    """
    from embshard.costs.collect.profile import PROBES, save_probe
    from embshard.costs.neural import NeuralCostModels, load_comm_samples, load_compute_samples
    from embshard.hardware.probe import use_probe

    out = Path(out_dir)
    rounds, stop_ratio = int(cfg["rounds"]), float(cfg["stop_ratio"])
    if rounds < 1 or stop_ratio <= 0:
        raise InputError(f"refine: rounds must be >= 1 and stop_ratio > 0, got {rounds}, {stop_ratio}")
    base = Path(cfg["data_dir"])
    read_profile(base, require_hardware=False)
    # a damaged file stops the run here, with its name (the loaders pre-training uses)
    load_compute_samples(base / "compute.jsonl")
    load_comm_samples(base / "comm.jsonl")
    data = out / "data"
    if not (data / PROFILE).exists():  # the base data, once; rounds append to it
        data.mkdir(parents=True, exist_ok=True)
        for name in ("compute.jsonl", "comm.jsonl"):
            shutil.copyfile(base / name, data / name)
        shutil.copyfile(base / PROFILE, data / PROFILE)
        if (base / PROBES).is_dir():
            shutil.copytree(base / PROBES, data / PROBES)
    history: list[dict[str, Any]] = []
    for r in range(rounds):
        ckpt = Path(cfg["checkpoint"]) if r == 0 and cfg.get("checkpoint") else out / f"round{r}" / "cost_models.pt"
        if not ckpt.exists():
            log.info("refine round %d: pre-training on %s", r, data)
            pretrain(pretrain_cfg, data, ckpt.parent)
        rd = out / "rounds" / f"round{r}"
        if (rd / "metrics.json").exists():  # measured before a restart
            with open(rd / "metrics.json") as f:
                history.append(json.load(f))
            continue
        t0 = time.perf_counter()
        # the round is a measuring session: its probe is timed first, the round's models (and
        # the sharders' copies) rescale to it, and its measurements name it
        probe = evaluator.session_probe(refresh=True) if evaluator.protocol.probe else None
        probe_id = save_probe(data, probe, 0) if probe is not None else None
        with use_probe(probe):
            models = NeuralCostModels.load(ckpt)
            compute_rows, comm_rows, plan_rows = measure_round(make_tasks(r), make_sharders(ckpt), models, evaluator, r,
                                                               probe_id=probe_id)
        random_test = models.metrics.get("compute", {}).get("test") or {}
        scores = score_round(compute_rows, comm_rows, plan_rows)
        if "neuroshard" not in scores["compute"]:  # the loop is about the search's shards: none, no round
            raise InfeasibleError(f"refine round {r}: neuroshard found no valid plan on any task (the log says why); "
                                  "nothing to score the models on")
        search = scores["compute"]["neuroshard"]
        ratio = search["mape_pct"] / random_test["mape_pct"] if random_test.get("mape_pct") else None
        entry = {"round": r, "checkpoint": str(ckpt), "random_heldout": random_test, "scores": scores,
                 "search_to_random_mape": ratio, "samples": {"compute": len(compute_rows), "comm": len(comm_rows)},
                 "measure_seconds": round(time.perf_counter() - t0, 1)}
        _write_jsonl(rd / "compute.jsonl", compute_rows)
        _write_jsonl(rd / "comm.jsonl", comm_rows)
        write_json_atomic(rd / "plans.json", plan_rows)
        _append(data, "compute", compute_rows)
        _append(data, "comm", comm_rows)
        write_json_atomic(rd / "metrics.json", entry)  # last: marks the round done
        history.append(entry)
        log.info("refine round %d: MAPE on the search's shards %.1f%% vs %.1f%% on random held-out shards",
                 r, search["mape_pct"], random_test.get("mape_pct", float("nan")))
        if ratio is not None and ratio <= stop_ratio:
            break
    final = out / "final"
    if not (final / "cost_models.pt").exists():
        pretrain(pretrain_cfg, data, final)
    summary = {"rounds": history, "final": str(final / "cost_models.pt"),
               "converged": bool(history and (history[-1]["search_to_random_mape"] or 1e9) <= stop_ratio)}
    write_json_atomic(out / "refine.json", summary)
    write_text_atomic(out / "refine.md", refine_table(history))
    return summary


def refine_table(history: list[dict[str, Any]]) -> str:
    """Markdown: per round, the models' error on the shards each algorithm proposed (before
    measuring them) beside their error on held-out random shards."""
    lines = ["| round | compute samples so far | random held-out MAPE | neuroshard shards MAPE / τ | heuristics' shards MAPE / τ "
             "| plan cost τ (per task) | search ÷ random |", "|---|---|---|---|---|---|---|"]
    for h in history:
        s = h["scores"]["compute"]
        heur = [v for k, v in s.items() if k not in ("neuroshard", "all")]
        hm = np.mean([v["mape_pct"] for v in heur]) if heur else float("nan")
        ht = np.mean([v["kendall_tau"] for v in heur]) if heur else float("nan")
        ns = s.get("neuroshard", {})
        rnd = h["random_heldout"]
        lines.append(
            f"| {h['round']} | {rnd.get('n', '-')} held out | {rnd.get('mape_pct', float('nan')):.1f}% | "
            f"{ns.get('mape_pct', float('nan')):.1f}% / {ns.get('kendall_tau', float('nan')):.3f} | {hm:.1f}% / {ht:.3f} | "
            f"{(h['scores']['plan_cost'].get('mean_task_kendall_tau') or float('nan')):.3f} | "
            f"{(h['search_to_random_mape'] or float('nan')):.2f} |")
    return "\n".join(lines) + "\n"
