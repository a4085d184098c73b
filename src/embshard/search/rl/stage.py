"""`python train.py stage=rl rl=dreamshard|autoshard`: train a policy, write its checkpoint.

Training tasks come from the TRAIN tables of the pool's train / validation / test split
(`embshard.data.split.TableSplit`; its train tables are those of the two-way split
`task=dreamshard` makes with test fraction validation + test), or from `rl.task_dir`.
Validation tasks are tasks of the VALIDATION tables at the training device counts and batch
sizes: unseen in training, and every choice made on them; the test tables are never touched in
training or in choosing anything. `rl.tasks.batch_size` and `rl.tasks.num_devices` may be lists
(the tasks go round the batch sizes; each draws its device count), and
`rl.tasks.no_histogram_fraction` of the tasks get a user's tables, without reuse histograms.
Writes to `out_dir`:

* `policy.pt`: the checkpoint (`search=dreamshard|autoshard ...checkpoint=<it>`);
* `data_card.md`, `metrics.json` (per-iteration curves, validation), `curves.png`;
* `measured_plans.jsonl`: every measured plan training learned from, the replayed ones
  (`rl.replay`) first, then those measured in training (task, plan, measured device costs,
  the estimate at the time), to check the cost network's fidelity or to reuse as cost data;
* `split.json` (train / validation / test table names and keys), `logs/` (Lightning's CSVLogger) and `wandb/`
  (offline), in `rl.log_dir` instead when set (the shipped checkpoints keep logs out of git).

Returns the validation objective (a sweep minimises it): the policy's plan cost over the
best of the six heuristic baselines' on each validation task, averaged; measured on the
hardware when `rl.validate.measure`, else estimated (`rl.validate.estimator`: the policy's own
cost network, or NeuroShard's cost models, which no policy trained with).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from embshard.errors import InputError
from embshard.costs.base import DeviceCosts
from embshard.io import save_png, write_json_atomic, write_text_atomic
from embshard.plan import Plan
from embshard.search.rl.buffer import Buffer
from embshard.search.rl.checkpoint import ALGORITHMS, build_agent, data_card_markdown, save_checkpoint
from embshard.search.rl.env import MASKS, best_plan
from embshard.search.rl.features import TRACE_HISTOGRAMS, FeatureNorm
from embshard.hardware.protocol import torch_threads

if TYPE_CHECKING:
    from embshard.costs.neural import NeuralCostModels
from embshard.task import Task, load_tasks

log = logging.getLogger(__name__)

POLICY_FILE = "policy.pt"


def heuristic_baselines(seed: int = 0) -> dict[str, Any]:
    """The six heuristic baselines every evaluation compares against."""
    from embshard.search.baselines import COST_KEYS, GreedySharder, RandomSharder, RoundRobinSharder

    out: dict[str, Any] = {"random": RandomSharder(seed=seed), "round_robin": RoundRobinSharder()}
    out.update({f"{k}_greedy": GreedySharder(k) for k in COST_KEYS})
    return out


# ----------------------------------------------------------------------------- config
def _check(c: dict[str, Any]) -> None:
    if c["algorithm"] not in ALGORITHMS:
        raise InputError(f"rl.algorithm must be one of {', '.join(ALGORITHMS)}, got {c['algorithm']!r}")
    for k in ("iterations", "cost_batch_size", "episodes", "measure_plans_per_task"):
        if int(c[k]) < 1:
            raise InputError(f"rl.{k} must be >= 1, got {c[k]!r}")
    for k in ("cost_steps", "policy_steps", "measure_tasks"):
        if int(c[k]) < 0:
            raise InputError(f"rl.{k} must be >= 0, got {c[k]!r}")
    if c["mask"] not in MASKS:
        raise InputError(f"rl.mask must be one of {', '.join(MASKS)}, got {c['mask']!r}")
    if int(c["rollouts_per_task"]) < 1:
        raise InputError(f"rl.rollouts_per_task must be >= 1, got {c['rollouts_per_task']!r}")
    if c.get("trace_histograms", "given") not in TRACE_HISTOGRAMS:
        raise InputError(f"rl.trace_histograms must be one of {', '.join(TRACE_HISTOGRAMS)}, got {c['trace_histograms']!r}")
    for k in ("cost_data", "replay"):
        if c.get(k) and not Path(c[k]).is_file():
            hint = (f" (make it with `make {c[k]}`, or start without it: rl.cost_data=null)" if k == "cost_data"
                    else " (a measured_plans.jsonl of an earlier stage=rl run)")
            raise InputError(f"rl.{k}={c[k]}: no such file{hint}")


def switches_of(c: dict[str, Any]) -> dict[str, Any]:
    """The improvements over the references, as recorded in the checkpoint."""
    out = {"mask": c["mask"], "rollouts_per_task": int(c["rollouts_per_task"])}
    if c["algorithm"] == "dreamshard":
        out.update(encode_table=bool(c["encode_table"]), reward_comm=bool(c["reward_comm"]), estimate=c["estimate"])
    return out


# ----------------------------------------------------------------------------- tasks
def training_tasks(c: dict[str, Any], dataset: Path | None, seed: int) -> tuple[list[Task], list[Task], dict[str, Any]]:
    """(train tasks, validation tasks, split) from the pool's train half or from rl.task_dir."""
    from embshard.data.split import TableSplit
    from embshard.data.tasks import neuroshard_tasks, split_pool, table_pool_from_dataset

    t = c["tasks"]
    batches = _int_list("rl.tasks.batch_size", t["batch_size"])
    if len(set(batches)) < len(batches):
        raise InputError(f"rl.tasks.batch_size lists a batch size twice: {batches}")
    devices = _int_list("rl.tasks.num_devices", t["num_devices"])
    no_hist = float(t.get("no_histogram_fraction") or 0.0)
    if not 0.0 <= no_hist <= 1.0:
        raise InputError(f"rl.tasks.no_histogram_fraction must lie in [0, 1], got {no_hist!r}")
    common = dict(min_tables=int(t["min_tables"]), max_tables=int(t["max_tables"]), dims=list(t["dims"]),
                  max_total_bytes=t["max_total_bytes"], num_devices=devices,
                  device_memory_bytes=t["device_memory_bytes"], optimizer=t["optimizer"])
    if c.get("task_dir"):
        tasks = load_tasks(c["task_dir"])
        split_file = Path(c["task_dir"]).parent / "split.json"
        split = json.loads(split_file.read_text()) if split_file.is_file() else {
            "train": sorted({tb.name for task in tasks for tb in task.tables}), "test": []}
        n_val = min(int(t["num_val_tasks"]), max(0, len(tasks) - 1))
        return tasks[n_val:], tasks[:n_val], split
    if dataset is None:
        raise InputError("stage=rl needs a dataset (dataset=...) or rl.task_dir=<folder of training task JSONs>")
    pool = table_pool_from_dataset(dataset)
    split = TableSplit.of_pool(pool, float(t["validation_fraction"]), float(t["test_fraction"]), seed,
                               pool_name=str(dataset))
    held = float(t["validation_fraction"]) + float(t["test_fraction"])
    train_pool, _ = split_pool(pool, held, seed)  # = the split's train tables
    # validation tasks: of the validation tables, which neither training nor the test ever sees
    val_pool = split.entries(pool, "validation")
    val_common = dict(common, min_tables=min(common["min_tables"], len(val_pool)),
                      max_tables=min(common["max_tables"], len(val_pool)))
    train: list[Task] = []
    val: list[Task] = []
    # one batch size per group of tasks (several: the tasks go round them), the same seeds as one
    # batch size had for the first, so a single-batch config keeps its tasks
    for k, batch in enumerate(batches):
        n_train = _share(int(t["num_train_tasks"]), len(batches), k)
        n_val = _share(int(t["num_val_tasks"]), len(batches), k)
        if n_train:  # what dreamshard_tasks draws from the train half (the same half for every k)
            train += [_renamed(x, len(batches)) for x in neuroshard_tasks(
                train_pool, n_train, seed=(seed + 1000 * k) * 2 + 1, name_prefix="dreamshard-train",
                batch_size=batch, **common)]
        if n_val:
            val += [_renamed(x, len(batches)) for x in neuroshard_tasks(
                val_pool, n_val, seed=(seed + 1000 * k) * 2 + 7, name_prefix="rl-val", batch_size=batch, **val_common)]
    train, val = _interleave(train, len(batches)), _interleave(val, len(batches))
    # tables as a user brings them (rows, dim, pooling factor): a random `no_hist` share of the tasks
    if no_hist > 0:
        train, val = _without_histograms(train, no_hist, seed), _without_histograms(val, no_hist, seed + 1)
    return train, val, split.to_dict()


def _int_list(key: str, value: Any) -> list[int]:
    """A positive int, or a non-empty list of them, as a list."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise InputError(f"{key} must be a positive integer or a non-empty list of them, got {value!r}")
    return [int(v) for v in values]


def _share(n: int, parts: int, k: int) -> int:
    """Part k of n split into `parts` near-equal parts (the first ones take the remainder)."""
    return n // parts + (1 if k < n % parts else 0)


def _renamed(task: Task, parts: int) -> Task:
    from dataclasses import replace

    return task if parts == 1 else replace(task, name=f"{task.name}-b{task.batch_size}")


def _interleave(tasks: list[Task], parts: int) -> list[Task]:
    """Tasks of several batch sizes in turn (so the first few, the validation's or a short run's,
    cover every batch size)."""
    if parts == 1:
        return tasks
    groups: dict[int, list[Task]] = {}
    for x in tasks:
        groups.setdefault(x.batch_size, []).append(x)
    out, lists = [], list(groups.values())
    for i in range(max(len(g) for g in lists)):
        out += [g[i] for g in lists if i < len(g)]
    return out


def _without_histograms(tasks: list[Task], fraction: float, seed: int) -> list[Task]:
    """`round(fraction x len)` of the tasks, drawn at random, with their reuse histograms and
    traces dropped (the features and the measuring evaluator then use the calibrated law's)."""
    from embshard.data.tasks import without_histograms

    n = int(round(fraction * len(tasks)))
    drop = set(np.random.default_rng([int(seed), 0x4E0]).choice(len(tasks), size=n, replace=False).tolist())
    return [without_histograms(x) if i in drop else x for i, x in enumerate(tasks)]


# ----------------------------------------------------------------------------- loggers
class RLLoggers:
    """Lightning's CSVLogger and, unless disabled, an offline W&B run."""

    def __init__(self, c: dict[str, Any], out_dir: Path):
        from pytorch_lightning.loggers import CSVLogger

        self.loggers: list = [CSVLogger(save_dir=str(out_dir), name="logs", version=c["algorithm"])]
        self.wandb = None
        if c.get("wandb"):
            from pytorch_lightning.loggers import WandbLogger

            if c.get("wandb_offline", True):
                os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = WandbLogger(project=c.get("wandb_project", "embshard"), save_dir=str(out_dir),
                                     offline=bool(c.get("wandb_offline", True)), name=f"rl-{c['algorithm']}-{out_dir.name}",
                                     job_type="rl", config=c)
            self.loggers.append(self.wandb)

    def finish(self, summary: dict[str, float] | None) -> None:
        if self.wandb is None:
            return
        run = self.wandb.experiment
        if summary is None:
            run.finish(exit_code=1)
        else:
            run.summary.update(summary)
            run.finish()
        self.wandb = None


# ----------------------------------------------------------------------------- train
def make_agent(c: dict[str, Any], tasks: Sequence[Task]) -> Any:
    norm = FeatureNorm.fit(((tb, task.batch_size) for task in tasks for tb in task.tables),
                           c.get("trace_histograms", "given"))
    return build_agent(c["algorithm"], norm, c["nets"][c["algorithm"]], switches_of(c))


def train_agent(c: dict[str, Any], tasks: Sequence[Task], out_dir: Path, measure: Callable | None,
                cost_samples: Sequence[dict] = (), replayed: Sequence[dict] = ()) -> tuple[Any, Any, dict[str, Any]]:
    """Train an agent on `tasks` with Lightning. Returns (agent, the module, timing info).

    `cost_samples` (compute.jsonl rows) and `replayed` (measured_plans.jsonl rows of an
    earlier run) start the replay buffer."""
    import pytorch_lightning as pl

    from embshard.search.rl.modules import AutoShardModule, DreamShardModule

    pl.seed_everything(int(c["seed"]), workers=True, verbose=False)
    agent = make_agent(c, tasks)
    buffer = Buffer(agent.norm)
    if cost_samples:
        n = buffer.add_compute_samples(cost_samples)
        log.info("cost data: %d compute samples in the replay buffer", n)
    for row in replayed:
        buffer.add_plan(Task.from_dict(row["task"]), Plan.from_dict(row["plan"]), DeviceCosts(
            row["measured"]["compute_ms"], row["measured"]["forward_comm_ms"], row["measured"]["backward_comm_ms"]),
            source="replayed")
    if replayed:
        log.info("replayed %d measured plans into the replay buffer", len(replayed))
    cls = DreamShardModule if c["algorithm"] == "dreamshard" else AutoShardModule
    module = cls(agent, tasks, c, buffer, measure)
    loggers = RLLoggers(c, Path(c["log_dir"]) if c.get("log_dir") else out_dir)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=int(c["iterations"]), logger=loggers.loggers,
                         enable_checkpointing=False, enable_progress_bar=bool(c.get("progress", True)),
                         enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1)
    start = time.perf_counter()
    ok = False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*number of training batches.*")
            trainer.fit(module)
        ok = True
    finally:
        if not ok:
            loggers.finish(None)
    for m in agent.modules().values():
        m.eval()
    timing = {"train_seconds": time.perf_counter() - start, "measure_seconds": module.measure_seconds}
    module.loggers_handle = loggers
    return agent, module, timing


def validate_agent(agent: Any, tasks: Sequence[Task], measure: Callable | None, seed: int,
                   estimator: NeuralCostModels | None = None) -> dict[str, Any]:
    """Estimated (and, with `measure`, measured) cost of the argmax plan over the best
    heuristic's on each task; mean and per-task ratios. `estimator`: NeuroShard's cost models
    estimate every plan (none of the policies trained with them); None: the agent's own cost
    network (which favours the plans its policy was trained on)."""
    if not tasks:
        return {}
    heuristics = heuristic_baselines(seed)
    est_ratio, meas_ratio = [], []
    for task in tasks:
        plan, _ = best_plan(agent, task, 0)
        plans = {agent.algorithm: plan}
        for name, h in heuristics.items():
            plans[name] = h.shard(task)
        if estimator is not None:
            est = {name: estimator.device_costs(task, p).plan_cost_ms for name, p in plans.items()}
        else:
            est = {name: agent.estimate_plan(task, p) for name, p in plans.items()}
        est_ratio.append(est[agent.algorithm] / min(v for k, v in est.items() if k != agent.algorithm))
        if measure is not None:
            costs = measure(task, list(plans.values()))
            got = {name: c.plan_cost_ms for name, c in zip(plans, costs)}
            meas_ratio.append(got[agent.algorithm] / min(v for k, v in got.items() if k != agent.algorithm))
    out: dict[str, Any] = {"tasks": len(tasks), "estimated_ratio_to_best_heuristic": float(np.mean(est_ratio)),
                           "estimated_ratios": [round(x, 4) for x in est_ratio],
                           "estimated_by": "policy cost network" if estimator is None else
                           estimator.source}
    if meas_ratio:
        out["measured_ratio_to_best_heuristic"] = float(np.mean(meas_ratio))
        out["measured_ratios"] = [round(x, 4) for x in meas_ratio]
    return out


def plot_curves(history: Sequence[dict[str, float]], path: Path, algorithm: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [h["iteration"] for h in history]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    for key, label in (("measured/plan_cost_ms", "measured (policy's sampled plans)"),
                       ("measured/estimated_ms", "estimated, same plans")):
        if any(key in h for h in history):
            ax[0].plot(it, [h.get(key, np.nan) for h in history], marker="o", label=label)
    ax[0].set_title("plans measured on hardware (ms)")
    ax[0].legend(fontsize=8)
    ax[1].plot(it, [h.get("rl/estimated_cost_ms", np.nan) for h in history], marker="o")
    ax[1].set_title("estimated cost of training episodes (ms)")
    ax[2].plot(it, [h.get("cost/loss", np.nan) for h in history], marker="o")
    ax[2].set_yscale("log")
    ax[2].set_title("cost-network loss")
    for a in ax:
        a.set_xlabel("iteration")
    fig.suptitle(f"{algorithm} training")
    fig.tight_layout()
    save_png(fig, path)


def run_rl(c: dict[str, Any], dataset: Path | None, out_dir: Path, make_evaluator: Callable[[], Any] | None,
           command: str = "python train.py stage=rl") -> float:
    """Train one policy (config `c`: the `rl` group, resolved) and write its outputs."""
    _check(c)
    out_dir.mkdir(parents=True, exist_ok=True)
    seed = int(c["seed"])
    tasks, val_tasks, split = training_tasks(c, dataset, seed)
    if not tasks:
        raise InputError("stage=rl: no training tasks")
    evaluator = make_evaluator() if make_evaluator is not None else None
    comm_measured = evaluator is not None and getattr(evaluator, "comm_backend", None) is not None

    measure = None
    if evaluator is not None:
        def measure(task: Task, plans: Sequence[Plan]):
            return evaluator.measure_many(task, plans)

    cost_samples: list[dict] = []
    if c.get("cost_data"):
        from embshard.costs.collect import load_samples

        cost_samples = load_samples(c["cost_data"], "compute")
        keep = c.get("cost_data_batch_sizes")
        if keep:  # features of far larger batches sit far outside the train pool's z-scores
            cost_samples = [s for s in cost_samples if int(s["batch_size"]) in {int(b) for b in keep}]
            if not cost_samples:
                raise InputError(f"rl.cost_data: no compute sample at rl.cost_data_batch_sizes={list(keep)} in {c['cost_data']}")
    replayed = []
    if c.get("replay"):
        path = Path(c["replay"])
        try:
            replayed = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise InputError(f"rl.replay: {path}: malformed JSON Lines ({e.msg} at line {e.lineno})") from None
    estimator = None
    if (c["validate"] or {}).get("estimator"):
        from embshard.costs.neural import NeuralCostModels

        estimator = NeuralCostModels.load(c["validate"]["estimator"])
    with torch_threads(c.get("num_threads")):
        agent, module, timing = train_agent(c, tasks, out_dir, measure, cost_samples, replayed)
        validation = validate_agent(agent, val_tasks, measure if c["validate"]["measure"] else None, seed, estimator)
    objective = validation.get("measured_ratio_to_best_heuristic", validation.get("estimated_ratio_to_best_heuristic", float("nan")))
    metrics = {"objective": objective, "history": module.history, "validation": validation}

    batch_sizes = sorted({t.batch_size for t in tasks})
    card = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pool": split.get("pool"),
        "train_tables": list(split.get("train", [])),
        "validation_tables": list(split.get("validation", [])),
        "test_tables": list(split.get("test", [])),
        # the pool's train / validation / test split (embshard.data.split), names and keys
        "split": split if "keys" in split else None,
        "num_train_tasks": len(tasks),
        "min_tables": min(len(t.tables) for t in tasks),
        "max_tables": max(len(t.tables) for t in tasks),
        "dims": sorted({tb.dim for t in tasks for tb in t.tables}),
        "device_counts": sorted({t.num_devices for t in tasks}),
        "batch_sizes": batch_sizes,
        "hardware": _hardware_text(evaluator),
        "measurements": module.measurements,
        "measured_what": ("plan cost: kernels + all-to-all" if comm_measured else "per-device compute (kernels only)")
        if evaluator is not None else "none",
        "cost_data": c.get("cost_data"),
        "cost_data_samples": len(cost_samples),
        "cost_data_batch_sizes": sorted({int(x["batch_size"]) for x in cost_samples}),
        "replayed_plans": len(replayed),
        "replay": c.get("replay"),
        "switches": switches_of(c),
        "trace_histograms": c.get("trace_histograms", "given"),
        "nets": c["nets"][c["algorithm"]],
        "seed": seed,
        **{k: round(v, 1) for k, v in timing.items()},
    }
    hparams = c["nets"][c["algorithm"]]
    save_checkpoint(out_dir / POLICY_FILE, agent, hparams, switches_of(c), card, metrics)
    write_json_atomic(out_dir / "metrics.json", {"data_card": card, **metrics})
    write_json_atomic(out_dir / "split.json", {k: v for k, v in split.items()})
    # every measured plan the cost network learned from: the replayed ones (rl.replay) first
    write_text_atomic(out_dir / "measured_plans.jsonl",
                      "".join(json.dumps(r) + "\n" for r in [*replayed, *module.measured_plans]))
    write_text_atomic(out_dir / "data_card.md", data_card_markdown(card, metrics, c["algorithm"], command))
    if module.history:
        plot_curves(module.history, out_dir / "curves.png", c["algorithm"])
    module.loggers_handle.finish({"objective": objective, "measurements": module.measurements,
                                  "train_seconds": timing["train_seconds"]})
    log.info("%s: %d measurements, %.0f s; validation %s", c["algorithm"], module.measurements, timing["train_seconds"],
             {k: v for k, v in validation.items() if not isinstance(v, list)})
    return float(objective)


def _hardware_text(evaluator: Any) -> str:
    if evaluator is None:
        return "none (no measurements)"
    from embshard.costs.collect import device_name, library_versions

    v = library_versions()
    return (f"{evaluator.backend} on {evaluator.device} ({device_name(evaluator.device)}), comm {evaluator.comm_backend}, "
            f"protocol {evaluator.protocol.name} ({evaluator.protocol.threads} thread(s)); torch {v.get('torch')}, {v.get('fbgemm_gpu')}; {platform.node()}")


def run_from_config(cfg: Any, dataset: Callable[[], Path], out_dir: Path) -> float:
    """train.py's stage=rl: the `rl` config group resolved, the evaluator built from
    `rl.hardware` (null: train without measuring), the dataset generated if needed."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    if "rl" not in cfg or cfg.rl is None:
        raise InputError("stage=rl needs an rl config: rl=dreamshard or rl=autoshard")
    c = OmegaConf.to_container(cfg.rl, resolve=True)
    hw = cfg.rl.get("hardware")
    make_evaluator = (lambda: instantiate(hw)) if hw is not None else None
    data = None if c.get("task_dir") else dataset()
    command = f"python train.py stage=rl rl={c['algorithm']} ..."
    try:  # the overrides as typed, for the data card
        from hydra.core.hydra_config import HydraConfig

        command = "python train.py " + " ".join(HydraConfig.get().overrides.task)
    except ValueError:  # not under Hydra (a test calling it directly)
        pass
    return run_rl(c, data, out_dir, make_evaluator, command=command)
