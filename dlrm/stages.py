"""train.py's end-to-end stages.

* `stage=dlrm`: train the task's DLRM under one plan (`dlrm.plan`) for `dlrm.steps` steps,
  logging the loss; writes summary.json, loss.png, metrics.csv, the plan, the task and
  config.yaml.
* `stage=throughput`: train the same DLRM under several plans (`dlrm.plans`) interleaved
  in rounds after warm-up; writes throughput.json (samples/s, per-rank step ms, ratio to
  `dlrm.reference` with a confidence interval, loss per block), throughput.png, the plans,
  the task and config.yaml.

Both run under torchrun (one process per device of the task). Every check that can fail
on user input runs before the process group starts; only rank 0 writes outputs, into
one run directory all ranks agree on.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from embshard.errors import InputError
from embshard.io import save_png, write_json_atomic, write_text_atomic
from embshard.task import Task

log = logging.getLogger("dlrm")


# ----------------------------------------------------------------------------- task
def load_task(d: DictConfig, dataset_path: Callable[[], Path], seed: int, local_rank: int) -> Task:
    """The task of `dlrm.task_file`, or one built from `dlrm.task` over the dataset's pool
    (tables keep their traces, so batches replay them)."""
    if d.task_file:
        path = Path(d.task_file)
        if not path.is_file():
            raise InputError(f"task file {d.task_file} not found")
        return Task.load(path)
    from embshard.data.tasks import load_pool, neuroshard_tasks

    data = _dataset_once(dataset_path, local_rank)
    spec = d.task
    max_rows = spec.max_rows or float("inf")
    pool = [e for e in load_pool(data) if e["pooling_factor"] >= spec.min_pooling_factor and e["rows"] <= max_rows]
    if len(pool) < spec.num_tables:
        raise InputError(
            f"the dataset has {len(pool)} tables with pooling factor >= {spec.min_pooling_factor} and "
            f"rows <= {spec.max_rows}; dlrm.task.num_tables={spec.num_tables}"
        )
    (task,) = neuroshard_tasks(
        pool, 1, min_tables=spec.num_tables, max_tables=spec.num_tables, dims=list(spec.dims),
        max_total_bytes=spec.max_total_bytes, num_devices=spec.num_devices,
        device_memory_bytes=spec.device_memory_bytes, batch_size=spec.batch_size,
        optimizer=spec.optimizer, seed=seed, name_prefix=spec.name,
    )
    if spec.get("devices_per_host"):
        task = Task.from_dict({**task.to_dict(), "devices_per_host": spec.devices_per_host})
    return task


def _dataset_once(dataset_path: Callable[[], Path], local_rank: int, timeout_s: float = 1800) -> Path:
    """Local rank 0 generates a missing synthetic dataset; the other ranks of the host wait for it."""
    if local_rank == 0:
        return dataset_path()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return dataset_path(generate=False)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise InputError("timed out waiting for local rank 0 to generate the dataset") from None
            time.sleep(1.0)


# ----------------------------------------------------------------------------- shared set-up
class Run:
    """What both stages set up: task, model config, plans (all checked locally), then
    `start()`: the session (process group, shared run directory)."""

    def __init__(self, cfg: DictConfig, specs: list[str], dataset_path, make_sharder, known_planners, default_root: Path):
        from dlrm.model import ModelConfig
        from dlrm.plans import resolve_plans
        from dlrm.runner import Ranks, local_batch_size, pick_accelerator

        d = cfg.dlrm
        self.cfg, self.d = cfg, d
        self.ranks = Ranks.from_env()
        self.model_cfg = ModelConfig.from_mapping(OmegaConf.to_container(cfg.model, resolve=True))
        accelerator = pick_accelerator(d.accelerator)
        self.task = load_task(d, dataset_path, cfg.seed, self.ranks.local_rank)
        self.local_batch = local_batch_size(self.task, self.ranks.world_size)
        self.plans = resolve_plans(
            specs, self.task, self.ranks.world_size, make_sharder=make_sharder, known_planners=known_planners,
            device_type=accelerator, local_world_size=self.ranks.local_world_size,
        )
        self.dense_optimizer = _dense_optimizer(d.dense_optimizer)
        self.accelerator = accelerator
        self.default_root = default_root
        self.session = None

    def start(self) -> None:
        """Everything before this is local and checked on every rank; now the process group."""
        from dlrm.plans import fingerprint
        from dlrm.runner import Session

        d = self.d
        from embshard.hardware.protocol import MeasurementProtocol

        self.session = Session(self.ranks, self.accelerator, d.backend, d.timeout_s,
                               MeasurementProtocol.from_config(self.cfg.measure))
        self.session.check_same("the plans (planners must be deterministic)", fingerprint(self.plans))
        self.out_dir = self.session.shared_dir(self.cfg.out_dir, self.default_root)

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.ranks.world_size

    def shard(self, label: str):
        from dlrm.runner import shard_model

        return shard_model(
            self.task, self.plans[label], label, self.model_cfg, self.session,
            self.d.embedding_lr, self.dense_optimizer, seed=self.cfg.seed, pipeline=self.d.pipeline,
        )

    def batches(self):
        from dlrm.runner import make_batches

        return make_batches(self.d, self.task, self.local_batch, self.model_cfg.dense_in_features, self.ranks, self.cfg.seed)

    def write_inputs(self) -> None:
        """Rank 0: the resolved config, the task and every plan, beside the outputs."""
        if not self.session.is_rank_zero:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.out_dir / "config.yaml", OmegaConf.to_yaml(self.cfg, resolve=True))
        self.task.save(self.out_dir / "task.json")
        for label, plan in self.plans.items():
            plan.save(self.out_dir / "plans" / f"{label}.json")

    def describe(self) -> dict[str, Any]:
        return {
            "task": self.task.name,
            "tables": len(self.task.tables),
            "world_size": self.ranks.world_size,
            "accelerator": self.session.accelerator,
            "backend": self.session.backend,
            "global_batch": self.global_batch,
            "model": OmegaConf.to_container(self.cfg.model, resolve=True),
        }


def _dense_optimizer(spec: DictConfig):
    from hydra.utils import instantiate

    try:
        factory = instantiate(spec)
    except Exception as e:  # noqa: BLE001 - Hydra wraps import errors in several types
        raise InputError(f"dlrm.dense_optimizer cannot be built: {' '.join(str(e).split())}") from None
    if not callable(factory):
        raise InputError("dlrm.dense_optimizer must be a partial optimizer (_partial_: true)")
    return factory


# ----------------------------------------------------------------------------- stages
def run_dlrm(cfg: DictConfig, **kw) -> float:
    """stage=dlrm: train under one plan; returns the final rank-averaged loss."""
    from dlrm.data import Prefetcher
    from dlrm.runner import train

    d = cfg.dlrm
    if not isinstance(d.plan, str) or not d.plan:
        raise InputError("stage=dlrm trains under one plan: set dlrm.plan=<plan.json or planner name>")
    if d.steps <= 0 or d.log_every <= 0:
        raise InputError("dlrm.steps and dlrm.log_every must be positive")
    run = Run(cfg, [d.plan], **kw)
    run.start()
    with run.session as s:
        (label,) = run.plans
        run.write_inputs()
        s.open_loggers(run.out_dir, d.wandb, OmegaConf.to_container(cfg, resolve=True), name=f"dlrm-{label}")
        sharded = run.shard(label)
        batches = Prefetcher(run.batches(), depth=d.prefetch, pin_memory=s.accelerator == "cuda")
        try:
            result = train(s, sharded, batches, d.steps, d.log_every, run.global_batch, progress=cfg.get("progress", True))
        finally:
            batches.close()
        del sharded  # released before the process group goes (Session.close)
        curve = result["loss_curve"]
        k = max(1, len(curve) // 5)
        first, last = sum(v for _, v in curve[:k]) / k, sum(v for _, v in curve[-k:]) / k
        summary = {
            **run.describe(),
            "plan": label,
            "steps": d.steps,
            "samples_per_s": result["samples_per_s"],
            "seconds": result["seconds"],
            "loss_first_windows": first,
            "loss_last_windows": last,
            "loss_decreased": last < first,
            "loss_curve": [{"step": st, "loss": v} for st, v in curve],
        }
        s.log({"final/samples_per_s": result["samples_per_s"], "final/loss": last}, step=d.steps)
        if s.is_rank_zero:
            write_json_atomic(run.out_dir / "summary.json", summary)
            if d.plot:
                _plot_loss(curve, run.out_dir / "loss.png", f"{run.task.name} under {label}")
            print(
                f"\n{label}: {d.steps} steps, {result['samples_per_s']:,.0f} samples/s, "
                f"loss {first:.4f} -> {last:.4f}\nwrote {run.out_dir}"
            )
    return last


def run_throughput(cfg: DictConfig, **kw) -> float:
    """stage=throughput: interleaved rounds over several plans; returns the best samples/s."""
    from dlrm.data import materialize
    from dlrm.runner import interleaved_throughput
    from dlrm.stats import format_summary, plot_throughput, summarize_throughput
    from embshard.stats import kendall_tau_b

    d = cfg.dlrm
    specs = list(d.plans) if not isinstance(d.plans, str) else d.plans.split(",")
    for name in ("warmup_steps", "rounds", "steps_per_round", "cached_batches"):
        if d[name] < (0 if name == "warmup_steps" else 1):
            raise InputError(f"dlrm.{name} must be {'>= 0' if name == 'warmup_steps' else 'positive'}, got {d[name]}")
    run = Run(cfg, specs, **kw)
    if d.reference and d.reference not in run.plans:
        raise InputError(f"dlrm.reference={d.reference!r} is not one of the plans {list(run.plans)}")
    reference = d.reference or next(iter(run.plans))
    costs = _shard_report_costs(d.get("shard_report"), run)  # read before the process group
    run.start()
    with run.session as s:
        run.write_inputs()
        s.open_loggers(run.out_dir, d.wandb, OmegaConf.to_container(cfg, resolve=True), name="throughput")
        models = {label: run.shard(label) for label in run.plans}
        batches = [b.to(s.device) for b in materialize(run.batches(), d.cached_batches)]
        records, losses = interleaved_throughput(
            s, models, batches, d.warmup_steps, d.rounds, d.steps_per_round, run.global_batch,
            progress=cfg.get("progress", True),
        )
        del models, batches  # released before the process group goes (Session.close)
        summary = summarize_throughput(records, reference, run.global_batch, confidence=d.confidence)
        lookup_ms = _lookup_ms_per_step(records, d.steps_per_round)
        from embshard.hardware.cluster import network_info

        result = {
            **run.describe(),
            "network": network_info(),
            "warmup_steps": d.warmup_steps,
            "rounds": d.rounds,
            "steps_per_round": d.steps_per_round,
            **summary,
            "loss_per_block": losses,
            "lookup_forward_ms_per_step": lookup_ms,
            "records": records,
        }
        if costs:
            result["embedding_cost_ms"] = costs
            taus = {}
            for source, by_plan in costs.items():
                labels = [label for label in run.plans if label in by_plan]
                tau = kendall_tau_b([summary["plans"][lb]["samples_per_s"]["mean"] for lb in labels],
                                    [-by_plan[lb] for lb in labels])
                taus[source] = None if math.isnan(tau) else tau
            result["kendall_tau_throughput_vs_cost"] = taus
        s.log({f"summary/{label}/{key}": p[key]["mean"] for label, p in summary["plans"].items()
               for key in ("samples_per_s", "ratio_to_reference")}, step=len(records) + 1)
        if s.is_rank_zero:
            write_json_atomic(run.out_dir / "throughput.json", result)
            if d.plot:
                plot_throughput(summary, run.out_dir / "throughput.png",
                                title=f"{run.task.name}: {run.ranks.world_size} x {s.accelerator}, global batch {run.global_batch}")
            print("\n" + format_summary(summary))
            if lookup_ms:
                print("embedding lookup forward, ms per step per rank (the work each rank does):")
                for label in summary["order"]:
                    print(f"  {label:24s} " + " / ".join(f"{v:.1f}" for v in lookup_ms[label]))
            for source, tau in (result.get("kendall_tau_throughput_vs_cost") or {}).items():
                print(f"Kendall tau (throughput vs measured embedding cost, {source}): {tau}")
            print(f"wrote {run.out_dir}")
    return summary["plans"][summary["order"][0]]["samples_per_s"]["mean"]


def _lookup_ms_per_step(records: list[dict], steps_per_round: int) -> dict[str, list[float]]:
    """{plan: [mean ms per step in the embedding lookups' forward, per rank]}; {} off CPU."""
    sums: dict[str, list[float]] = {}
    blocks: dict[str, int] = {}
    for rec in records:
        per_rank = rec.get("rank_lookup_forward_seconds")
        if not per_rank or any(v is None for v in per_rank):
            return {}
        acc = sums.setdefault(rec["plan"], [0.0] * len(per_rank))
        for i, v in enumerate(per_rank):
            acc[i] += v
        blocks[rec["plan"]] = blocks.get(rec["plan"], 0) + 1
    return {p: [1000 * v / (blocks[p] * steps_per_round) for v in acc] for p, acc in sums.items()}


def _shard_report_costs(paths: Any, run: Run) -> dict[str, dict[str, float]]:
    """{what was measured: {plan label: measured cost ms}} from one or several shard.py
    report.json files, matched by algorithm; a report is named by what its evaluator timed
    (`kernels`, or `dmp_step`: DistributedModelParallel's embedding step)."""
    if not paths:
        return {}
    from embshard.task import read_json

    out: dict[str, dict[str, float]] = {}
    for path in [paths] if isinstance(paths, str) else list(paths):
        report = read_json(path)
        mine = [r for r in report.get("results", []) if r.get("task") == run.task.name and r.get("measured_cost_ms") is not None]
        by_algorithm = {r.get("algorithm"): r["measured_cost_ms"] for r in mine}
        source = next(((r.get("measured_device_costs") or {}).get("source", "kernels") for r in mine), "kernels")
        key, n = source, 1
        while key in out:
            n += 1
            key = f"{source}#{n}"
        out[key] = {label: float(by_algorithm[p.algorithm]) for label, p in run.plans.items() if p.algorithm in by_algorithm}
    return out


def _plot_loss(curve, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (BCE, mean over ranks)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path)
