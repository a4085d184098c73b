"""train.py's sequence stages (FlexShard end to end; settings in the `sequence` block of
conf/experiment/flexshard_e2e.yaml).

* `stage=sequence_task`: the synthetic sequence trace (generated once) and the task JSON
  (sequence tables, hosts x devices, memory cap = a factor of the row-wise layout's need).
* `stage=sequence_throughput` (under torchrun, one process per device): the sequence DLRM
  (dlrm/sequence_model.py) trained under several row-level plans, interleaved in rounds on
  the same held-out batches; per plan samples/s (with a confidence interval, ratio to the
  reference), the measured communication time per step and the bytes the data path sent by
  purpose and link class, beside embshard.flexshard.traffic's model of the same steps.
  Writes throughput.json, throughput.png, the plans, the task and config.yaml.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from omegaconf import DictConfig, OmegaConf

from embshard.errors import InputError, PlanError
from embshard.io import write_json_atomic, write_text_atomic
from embshard.plan import Plan, validate
from embshard.task import Task

log = logging.getLogger("dlrm")


def _block(cfg: DictConfig) -> DictConfig:
    if "sequence" not in cfg:
        raise InputError("the sequence stages need a `sequence` block: add experiment=flexshard_e2e (or flexshard_tiny)")
    return cfg.sequence


def build_task(s: DictConfig, root: Path, local_rank: int = 0) -> Task:
    """The task of `sequence.task_file`, or one built from `sequence.trace` and `sequence.task`."""
    from embshard.flexshard.tasks import sequence_task, sequence_trace

    if s.task_file:
        path = Path(s.task_file)
        if not path.is_file():
            raise InputError(f"task file {s.task_file} not found")
        return Task.load(path)
    tr = s.trace
    path = Path(tr.path) if Path(tr.path).is_absolute() else root / tr.path
    if local_rank == 0:
        sequence_trace(path, tr.num_tables, tr.samples, tr.mean_length, tr.zipf_mean, tr.seed)
    else:  # local rank 0 writes the trace (atomically); the others wait for it
        deadline = time.monotonic() + 1800
        while not path.is_file():
            if time.monotonic() > deadline:
                raise InputError(f"timed out waiting for local rank 0 to write {path}")
            time.sleep(1.0)
    t = s.task
    return sequence_task(path, t.name, t.dim, t.hosts, t.devices_per_host, t.batch_size, t.memory_factor,
                         t.max_tables, t.max_rows, t.optimizer)


def run_sequence_task(cfg: DictConfig, root: Path) -> None:
    s = _block(cfg)
    out = Path(cfg.out_dir) if cfg.out_dir else root / "outputs" / "train" / "sequence_task"
    task = build_task(s, root)
    task.save(out / "task.json")
    write_text_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    print(f"task {task.name}: {len(task.tables)} sequence tables, {task.hosts} hosts x {task.devices_per_host} devices, "
          f"{task.device_memory_bytes} bytes per device -> {out / 'task.json'}")


def resolve_sequence_plans(specs: Sequence[str], task: Task, world_size: int, make_sharder: Callable[[str], Any],
                           known_planners: Sequence[str], fit_batches: int) -> tuple[dict[str, Plan], dict[str, int | None]]:
    """{label: plan} from plan files or planner names, each validated for the task and the world size.

    Also returns the steps each plan was fitted on (from its planner), which must precede the
    replayed steps.
    """
    if not specs:
        raise InputError("no plans given: set sequence.plans=[<plan.json or planner name>, ...]")
    if world_size != task.num_devices:
        raise PlanError(f"task {task.name!r} has {task.num_devices} devices but the run has {world_size} process(es); "
                        f"start torchrun with --nproc_per_node {task.num_devices}")
    plans, fitted = {}, {}
    for spec in map(str, specs):
        if spec.endswith(".json") or "/" in spec:
            if not Path(spec).is_file():
                raise InputError(f"plan file {spec} not found")
            plan, label, fit = Plan.load(spec), Path(spec).stem, None
        elif spec in known_planners:
            sharder = make_sharder(spec)
            plan, label = sharder.shard(task), spec
            fit = (getattr(sharder, "last_search_info", None) or {}).get("fit_batches")
        else:
            raise InputError(f"unknown planner {spec!r}: give a plan JSON path or one of {', '.join(known_planners)}")
        validate(task, plan)
        if fit is not None and fit > fit_batches:
            raise InputError(f"{label} was fitted on steps 0..{fit - 1}; the run replays steps from {fit_batches}")
        while label in plans:
            label += "+"
        plans[label], fitted[label] = plan, fit
    return plans, fitted


def fingerprint(plans: dict[str, Plan]) -> str:
    """A hash of the plans, row maps included, compared across ranks."""
    from embshard.flexshard.layout import plan_fingerprint

    return hashlib.sha256("".join(f"{k}:{plan_fingerprint(p)};" for k, p in plans.items()).encode()).hexdigest()[:16]


def run_sequence_throughput(cfg: DictConfig, make_sharder, known_planners, default_root: Path, root: Path) -> float:
    """stage=sequence_throughput; returns the best plan's samples/s."""
    from dlrm.runner import Ranks, Session, interleaved_throughput
    from dlrm.sequence_model import ShardedSequenceDLRM, sequence_batches
    from dlrm.stats import format_summary, plot_throughput, summarize_throughput
    from embshard.flexshard.stats import BatchSplit

    s = _block(cfg)
    for name in ("rounds", "steps_per_round", "eval_batches", "fit_batches"):
        if s[name] < 1:
            raise InputError(f"sequence.{name} must be positive, got {s[name]}")
    ranks = Ranks.from_env()
    task = build_task(s, root, ranks.local_rank)
    split = BatchSplit(s.fit_batches, s.eval_batches, cfg.seed)
    specs = list(s.plans) if not isinstance(s.plans, str) else s.plans.split(",")
    plans, fitted = resolve_sequence_plans(specs, task, ranks.world_size, make_sharder, known_planners, s.fit_batches)
    reference = s.reference or next(iter(plans))
    if reference not in plans:
        raise InputError(f"sequence.reference={reference!r} is not one of the plans {list(plans)}")
    session = Session(ranks, "cpu", "gloo", s.timeout_s, None)
    with session:
        session.check_same("the plans (planners must be deterministic)", fingerprint(plans))
        out_dir = session.shared_dir(cfg.out_dir, default_root)
        m = s.model
        steps = list(split.eval_steps)
        batches = sequence_batches(task, steps, ranks.rank, ranks.world_size, m.dense_in_features, cfg.seed)
        models = {label: ShardedSequenceDLRM.build(label, task, plan, ranks.rank, ranks.world_size, m.dense_in_features,
                                                   list(m.dense_arch), list(m.over_arch), s.embedding_lr, s.dense_lr, cfg.seed,
                                                   barrier_first=s.separate_wait)
                  for label, plan in plans.items()}
        global_batch = task.batch_size
        records, losses = interleaved_throughput(session, models, batches, s.warmup_steps, s.rounds, s.steps_per_round,
                                                 global_batch, progress=cfg.get("progress", True))
        comm = {label: session.all_gather_object(model.comm[s.warmup_steps:]) for label, model in models.items()}
        replay = replay_comm(session, models, batches[0], s.replay_repetitions)
        del models, batches  # released before the process group goes (Session.close)
        if session.is_rank_zero:
            summary = summarize_throughput(records, reference, global_batch, confidence=s.confidence)
            timed = [steps[k % len(steps)] for k in range(s.warmup_steps, s.warmup_steps + s.rounds * s.steps_per_round)]
            comparison = compare_with_model(task, plans, comm, timed)
            for label, seconds in replay.items():
                comparison[label]["replayed_comm_ms"] = seconds
            focus = s.get("focus") or next(iter(plans))
            if focus not in plans:
                raise InputError(f"sequence.focus={focus!r} is not one of the plans {list(plans)}")
            claims = compare_plans(summary, comparison, focus, s.confidence)
            from embshard.hardware.cluster import network_info

            result = {
                "task": task.name, "tables": len(task.tables), "world_size": ranks.world_size, "backend": session.backend,
                "network": network_info(),
                "hosts": task.hosts, "devices_per_host": task.devices_per_host, "global_batch": global_batch,
                "replayed_steps": steps, "fitted_on_steps": {k: v for k, v in fitted.items()},
                "warmup_steps": s.warmup_steps, "rounds": s.rounds, "steps_per_round": s.steps_per_round,
                **summary, "communication": comparison, "claims": claims, "loss_per_block": losses,
                "records": records,
            }
            out_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
            task.save(out_dir / "task.json")
            for label, plan in plans.items():
                plan.save(out_dir / "plans" / f"{label}.json")
            write_json_atomic(out_dir / "throughput.json", result)
            plot_throughput(summary, out_dir / "throughput.png",
                            title=f"{task.name}: sequence DLRM, {task.hosts} hosts x {task.devices_per_host} gloo processes")
            print("\n" + format_summary(summary))
            print(format_comm(comparison))
            print(format_claims(claims))
            print(f"wrote {out_dir}")
            best = summary["plans"][summary["order"][0]]["samples_per_s"]["mean"]
        else:
            best = 0.0
    return best


def replay_comm(session, models: dict, batch, repetitions: int) -> dict[str, dict[str, float]]:
    """Record one step's collectives per plan (on `batch`), then replay them, plans interleaved
    (order rotated each repetition): per plan the median and IQR over repetitions of the slowest
    rank's transfer ms. Communication alone, so the CPU's compute does not muddle it. Each
    repetition also replays the same collectives empty: their fixed cost (`floor_ms`), which
    the bandwidth model leaves out."""
    import itertools

    from dlrm.sequence_embedding import replay_collectives
    from embshard.flexshard.traffic import PURPOSES

    recorded = {}
    for label, model in models.items():
        model.embeddings.ledger.record = []
        model.step(itertools.repeat(batch))
        recorded[label] = model.embeddings.ledger.record
        model.embeddings.ledger.record = None
    labels = list(models)
    times: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    floor: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    for r in range(repetitions):
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            for empty, acc in ((False, times), (True, floor)):
                ranks = session.all_gather_object(replay_collectives(recorded[label], empty=empty))
                acc[label].append({p: 1e3 * max(x[p] for x in ranks) for p in ranks[0]})
    out = {}
    for label in labels:
        total = [sum(x.values()) for x in times[label]]
        q1, med, q3 = np.percentile(total, [25, 50, 75]) if total else (0.0, 0.0, 0.0)
        out[label] = {"median_ms": float(med), "iqr_ms": float(q3 - q1), "repetitions": len(total),
                      "per_repetition_ms": [float(x) for x in total],
                      "collectives": len(recorded[label]),
                      "median_ms_by_purpose": {p: float(np.median([x[p] for x in times[label]])) for p in PURPOSES},
                      "floor_ms": float(np.median([sum(x.values()) for x in floor[label]])) if floor[label] else 0.0}
    return out


def compare_plans(summary: dict, comparison: dict, focus: str, confidence: float) -> dict:
    """`focus` against every other plan, paired: its replayed communication time / theirs per
    repetition (plans interleaved in each), its samples/s / theirs per round, each mean with its
    bootstrap interval (embshard.stats); and Kendall's tau between each plan's measured
    communication (replayed median) and the traffic model's modeled ms (1: the same order)."""
    from embshard.stats import kendall_tau_b, paired_ratio_summary

    labels = list(comparison)
    out: dict[str, Any] = {"focus": focus, "comm_ratio": {}, "samples_per_s_ratio": {}}
    mine = comparison[focus].get("replayed_comm_ms", {}).get("per_repetition_ms", [])
    rounds = summary["plans"][focus]["samples_per_s"]["per_round"]
    for other in labels:
        if other == focus:
            continue
        theirs = comparison[other].get("replayed_comm_ms", {}).get("per_repetition_ms", [])
        if mine and theirs and min(mine + theirs) > 0:
            out["comm_ratio"][other] = paired_ratio_summary(
                [a / b for a, b in zip(mine, theirs)], confidence).to_dict()
        per_round = summary["plans"][other]["samples_per_s"]["per_round"]
        ratio = paired_ratio_summary([a / b for a, b in zip(rounds, per_round)], confidence).to_dict()
        ratio.pop("verdict")  # (its sense is "costs less"; for samples/s the question is "above 1")
        ratio["above"] = ratio["n"] >= 2 and ratio["low"] > 1.0
        out["samples_per_s_ratio"][other] = ratio
    measured = [comparison[p].get("replayed_comm_ms", {}).get("median_ms", float("nan")) for p in labels]
    modeled = [comparison[p]["modeled_comm_ms"] for p in labels]
    training = [comparison[p]["measured_comm_ms_per_step"] for p in labels]
    tau = kendall_tau_b(measured, modeled)
    out["kendall_tau_replayed_comm_vs_modeled"] = None if math.isnan(tau) else tau
    tau = kendall_tau_b(training, modeled)
    out["kendall_tau_training_comm_vs_modeled"] = None if math.isnan(tau) else tau
    out["order_modeled"] = [labels[i] for i in np.argsort(modeled, kind="stable")]
    out["order_replayed_comm"] = [labels[i] for i in np.argsort(measured, kind="stable")]
    return out


def format_claims(claims: dict) -> str:
    f = claims["focus"]
    lines = [f"{f} against each plan (paired; mean [95% bootstrap]):"]
    for other, r in claims["comm_ratio"].items():
        t = claims["samples_per_s_ratio"][other]
        lines.append(f"  vs {other:16s} replayed comm {r['mean']:.3f}x [{r['low']:.3f}, {r['high']:.3f}] {r['verdict']:13s}"
                     f"  samples/s {t['mean']:.3f}x [{t['low']:.3f}, {t['high']:.3f}]")
    lines.append(f"Kendall tau, measured vs modeled comm: replayed {claims['kendall_tau_replayed_comm_vs_modeled']}, "
                 f"in training {claims['kendall_tau_training_comm_vs_modeled']}")
    lines.append(f"order modeled: {' < '.join(claims['order_modeled'])}")
    lines.append(f"order replayed: {' < '.join(claims['order_replayed_comm'])}")
    return "\n".join(lines)


def compare_with_model(task: Task, plans: dict[str, Plan], comm: dict[str, list], timed_steps: Sequence[int]) -> dict:
    """Per plan: measured communication (ms per step in collectives on the slowest rank, and, with
    sequence.separate_wait, the wait for the slowest rank before them; bytes per step summed over
    ranks, by purpose and link class) beside the traffic model of the same steps."""
    from embshard.flexshard.traffic import PURPOSES, TrafficModel, global_batches, summarize_steps

    out = {}
    for label, plan in plans.items():
        per_rank = comm[label]  # [rank][step] StepComm
        n = len(per_rank[0])
        seconds = [max(sum(r[k].seconds.values()) for r in per_rank) for k in range(n)]
        by_purpose = {p: {c: sum(r[k].bytes[p][c] for r in per_rank for k in range(n)) / n
                          for c in ("intra_host", "inter_host")} for p in PURPOSES}
        model = TrafficModel(task, plan)
        batches = {s: b for s, b in zip(sorted(set(timed_steps)), global_batches(task, sorted(set(timed_steps))))}
        modeled = summarize_steps(model, [model.step(batches[s]) for s in timed_steps])
        measured_total = sum(v for p in by_purpose.values() for v in p.values())
        out[label] = {
            "measured_comm_ms_per_step": 1e3 * float(np.mean(seconds)),
            "measured_comm_ms_per_step_by_purpose": {
                p: 1e3 * float(np.mean([max(r[k].seconds[p] for r in per_rank) for k in range(n)])) for p in PURPOSES},
            "measured_wait_ms_per_step": 1e3 * float(np.mean([max(sum(r[k].wait_seconds.values()) for r in per_rank)
                                                               for k in range(n)])),
            "measured_bytes_per_step": {p: {**v, "total": v["intra_host"] + v["inter_host"]} for p, v in by_purpose.items()},
            "measured_total_bytes_per_step": measured_total,
            "modeled_total_bytes_per_step": modeled.traffic_bytes["total"],
            "modeled_bytes_per_step": modeled.bytes_by_purpose,
            "modeled_comm_ms": modeled.modeled_comm_ms,
            "bytes_match_model": all(
                abs(by_purpose[p][c] - modeled.bytes_by_purpose[p][c]) <= 1e-6 * max(1.0, modeled.bytes_by_purpose[p][c])
                for p in PURPOSES for c in ("intra_host", "inter_host")),
        }
    return out


def format_comm(comparison: dict) -> str:
    lines = ["communication per step: measured (gloo, this machine) | model (the task's two-tier topology)",
             f"  {'plan':18s} {'measured MB':>12s} {'inter-host MB':>14s} {'sync MB':>8s} {'comm ms':>8s} "
             f"{'wait ms':>8s} {'replay ms':>10s} {'floor ms':>9s} {'model MB':>9s} {'model ms':>9s}  bytes = model"]
    for label, c in comparison.items():
        mb = c["measured_bytes_per_step"]
        lines.append(
            f"  {label:18s} {c['measured_total_bytes_per_step'] / 1e6:12.2f} "
            f"{sum(v['inter_host'] for v in mb.values()) / 1e6:14.2f} {mb['replica_sync']['total'] / 1e6:8.2f} "
            f"{c['measured_comm_ms_per_step']:8.1f} {c['measured_wait_ms_per_step']:8.1f} "
            f"{c.get('replayed_comm_ms', {}).get('median_ms', float('nan')):10.1f} "
            f"{c.get('replayed_comm_ms', {}).get('floor_ms', float('nan')):9.1f} "
            f"{c['modeled_total_bytes_per_step'] / 1e6:9.2f} "
            f"{c['modeled_comm_ms']:9.3f}  {c['bytes_match_model']}")
    return "\n".join(lines)
