"""Pre-train NeuroShard's cost models on collected cost data; held-out metrics; checkpoint.

    pretrain(cfg, data_dir, out_dir) -> objective

reads ``data_dir/compute.jsonl``, ``comm.jsonl`` and ``profile.json``, and writes to ``out_dir``:

* ``cost_models.pt``: the three models, their normalisation, the training envelope
  (`embshard.costs.envelope`), the hardware profile, metrics and data summary (plain data:
  ``torch.load(weights_only=True)``);
* ``metrics.json`` and ``metrics.csv``: RMSE, MAPE, R², Kendall τ per model and split (ms);
* ``data_card.md``: the numbers for the checkpoint's data card;
* ``logs/<model>/metrics.csv`` (Lightning's CSVLogger, per epoch) and ``wandb/`` (offline).

Held-out evaluation is by TABLES for the compute model: a sample with any test table is a
test sample; the test tables are the collector's own held-out tables when its samples carry
split="test" (else a seeded test_fraction share of all names). The validation set (early
stopping, best weights, the sweep objective) by ``val_by``:

* ``split`` (conf/cost_model/neural.yaml's default): the collector's held-out pool tables
  are cut in half, validation and test tables (`embshard.data.split.TableSplit`, recorded in
  the checkpoint and in ``split.json``); validation shards hold only tables no training
  shard holds, and no training shard is spent on validation (`split_by_pool`);
* ``samples`` (this module's default, for cost data without held-out pool tables): a seeded
  share of the remaining samples, whose tables are trained on;
* ``tables``: a seeded share of the training tables, a sample with any val table a val
  sample; costs about half the training shards when shards hold up to 15 tables (a 15-table
  shard avoids 10% of the tables with probability 0.9^15 = 0.2).

Comm samples are split by sample, and every sample with ``holdout_num_devices`` devices is
kept out of training altogether, to show that one model serves device counts it never saw.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import time
import warnings
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from embshard.costs import neural as N
from embshard.costs.collect import read_profile
from embshard.costs.collect.profile import read_probes
from embshard.costs.envelope import Envelope
from embshard.errors import InputError
from embshard.io import atomic_path, write_json_atomic, write_text_atomic
from embshard.stats import kendall_tau_b

log = logging.getLogger(__name__)

#: how the validation set (early stopping, best weights, the objective) is drawn
VAL_BY = ("samples", "tables", "split")

#: defaults of every field `pretrain` reads (conf/cost_model/neural.yaml mirrors them)
DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "max_epochs": 300,
    "batch_size": 512,
    "lr": 1e-3,
    "weight_decay": 0.0,
    "patience": 40,
    "val_fraction": 0.1,
    "val_by": "samples",
    "test_fraction": 0.1,
    "comm_val_fraction": 0.1,
    "comm_test_fraction": 0.1,
    "holdout_num_devices": 6,
    "compute": {"hidden": 128, "hidden2": 64, "context_hidden": 32},
    "comm": {"hidden": 64, "embed": 32, "target": "log_ms"},
    "objective": "compute/val/kendall_tau",
    "progress": True,
    "num_threads": 1,
    "wandb": True,
    "wandb_project": "embshard",
    "wandb_offline": True,
}


# ---------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------
def per_task_kendall_taus(rows: Sequence[Mapping[str, Any]], measured: str, predicted: str) -> list[float]:
    """Kendall tau-b of predicted vs measured plan cost within each task (rows keyed by "task").

    Plans are only ever compared with plans of the same task, so tasks never mix; tasks with
    fewer than two plans, or with a tau that is undefined (all ties), give no value."""
    taus = []
    for task in sorted({r["task"] for r in rows}):
        group = [r for r in rows if r["task"] == task]
        if len(group) >= 2:
            t = kendall_tau_b(np.array([r[measured] for r in group]), np.array([r[predicted] for r in group]))
            if np.isfinite(t):
                taus.append(float(t))
    return taus


def regression_metrics(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, float]:
    """RMSE (ms), MAPE (%), R², Kendall τ-b and n of predictions against labels (ms)."""
    t = np.asarray(y_true, np.float64).ravel()
    p = np.asarray(y_pred, np.float64).ravel()
    if len(t) == 0:
        return {"n": 0}
    err = p - t
    ss_tot = float(((t - t.mean()) ** 2).sum())
    return {
        "n": int(len(t)),
        "rmse_ms": float(np.sqrt((err**2).mean())),
        "mape_pct": float(100.0 * np.mean(np.abs(err) / np.maximum(np.abs(t), N.LOG_FLOOR_MS))),
        "r2": float(1.0 - (err**2).sum() / ss_tot) if ss_tot > 0 else float("nan"),
        "kendall_tau": kendall_tau_b(t, p),
        "mean_ms": float(t.mean()),
    }


# ---------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------
def split_tables(names: Sequence[str], val_fraction: float, test_fraction: float, seed: int) -> dict[str, list[str]]:
    """Seeded split of unique table names into train/val/test (each non-empty when possible)."""
    uniq = sorted(set(names))
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise InputError(f"val_fraction {val_fraction} and test_fraction {test_fraction} must be in [0, 1) and sum < 1")
    perm = np.random.default_rng(seed).permutation(len(uniq))
    n_test = int(round(test_fraction * len(uniq)))
    n_val = int(round(val_fraction * len(uniq)))
    if test_fraction > 0 and len(uniq) >= 3:
        n_test = max(n_test, 1)
    if val_fraction > 0 and len(uniq) >= 3:
        n_val = max(n_val, 1)
    shuffled = [uniq[i] for i in perm]
    return {
        "test": sorted(shuffled[:n_test]),
        "val": sorted(shuffled[n_test : n_test + n_val]),
        "train": sorted(shuffled[n_test + n_val :]),
    }


def split_tables_honouring(samples: Sequence[N.ComputeSample], val_fraction: float, test_fraction: float,
                           seed: int) -> dict[str, list[str]]:
    """The table split of `pretrain`. When the collector held tables out (samples marked
    split="test", drawn only from its held-out tables), those tables are the test tables and
    val tables are drawn from the rest; otherwise a seeded split of all names."""
    names = [t.name for s in samples for t in s.tables]
    collector_test = {t.name for s in samples if s.split == "test" for t in s.tables}
    if not collector_test:
        return split_tables(names, val_fraction, test_fraction, seed)
    rest = [n for n in names if n not in collector_test]
    inner = split_tables(rest, val_fraction, 0.0, seed)
    return {"test": sorted(collector_test), "val": inner["val"], "train": inner["train"]}


def split_by_pool(samples: Sequence[N.ComputeSample], profile: Mapping[str, Any], seed: int
                  ) -> tuple[Any, dict[str, list[str]], dict[str, list[int]]]:
    """``val_by: split``: the collector's held-out pool tables are cut into validation and test
    tables (`embshard.data.split.TableSplit.from_held_out`, half each, the collector's holdout
    seed), so validation shards hold only tables no training shard holds, as test shards do, and
    no training shard is spent on validation.

    A sample the collector drew from its held-out side is a test sample when it holds a test
    table, else a validation sample when it holds a validation table; one of generated tables
    only (fresh per shard) goes to either by a seeded coin. Every other sample trains.

    Returns:
        (the TableSplit, pool table names per split as "train" / "val" / "test", sample indices
        per split).

    Raises:
        InputError: the collector held no tables out, or its pool file is not here (as recorded,
            or by its name under the project's data/), or is not the pool it collected from.
    """
    from embshard.data.split import TableSplit

    pool = profile.get("pool") or {}
    hold = (profile.get("collection") or {}).get("holdout") or {}
    if not pool.get("test_tables") or not hold.get("fraction"):
        raise InputError("val_by=split needs cost data whose collector held pool tables out (collect.holdout.fraction "
                         "> 0 and a table pool); use val_by=samples or val_by=tables")
    entries = _collection_pool(pool)
    by_name = {e["name"]: e for e in entries}
    f = float(hold["fraction"])
    split = TableSplit.from_held_out([by_name[n] for n in pool["train_tables"]],
                                     [by_name[n] for n in pool["test_tables"]], f / 2, f / 2, int(hold["seed"]),
                                     str(pool["source"]))
    val_pool, test_pool = set(split.tables["validation"]), set(split.tables["test"])
    coin = np.random.default_rng([int(seed), 0x5A1])
    out: dict[str, list[int]] = {"train": [], "val": [], "test": []}
    for i, s in enumerate(samples):
        names = {t.name for t in s.tables}
        if s.split != "test":
            out["train"].append(i)
        elif names & test_pool:
            out["test"].append(i)
        elif names & val_pool:
            out["val"].append(i)
        else:
            out["val" if coin.random() < 0.5 else "test"].append(i)
    tables = {"train": list(split.tables["train"]), "val": list(split.tables["validation"]),
              "test": list(split.tables["test"])}
    return split, tables, out


def _collection_pool(pool: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The pool a collection drew from (its profile's `pool` block), checked by its digest."""
    from embshard.costs.collect.profile import _pool_digest
    from embshard.data.split import pool_file
    from embshard.data.tasks import load_pool

    found = pool_file(pool.get("source"))
    if found is None:
        raise InputError(f"val_by=split: the collection's pool {pool.get('source') or '(none)'} is not here (nor under "
                         "data/); its train / validation / test split is drawn from it")
    entries = load_pool(found)
    if pool.get("digest") and _pool_digest(entries) != pool["digest"]:
        raise InputError(f"val_by=split: {found} is not the pool the cost data was collected from (its digest differs)")
    return entries


def split_compute(samples: Sequence[N.ComputeSample], tables: Mapping[str, Sequence[str]]) -> dict[str, list[int]]:
    """Sample indices per split: test if any table is a test table, else val if any is val."""
    test, val = set(tables["test"]), set(tables["val"])
    out: dict[str, list[int]] = {"train": [], "val": [], "test": []}
    for i, s in enumerate(samples):
        names = {t.name for t in s.tables}
        out["test" if names & test else "val" if names & val else "train"].append(i)
    return out


def split_comm(samples: Sequence[N.CommSample], val_fraction: float, test_fraction: float, seed: int,
               holdout_num_devices: int | None) -> dict[str, list[int]]:
    """Sample indices per split; samples with `holdout_num_devices` devices go to 'heldout_devices'."""
    out: dict[str, list[int]] = {"train": [], "val": [], "test": [], "heldout_devices": []}
    rest = []
    for i, s in enumerate(samples):
        (out["heldout_devices"] if holdout_num_devices is not None and s.num_devices == holdout_num_devices else rest).append(i)
    perm = np.random.default_rng(seed + 1).permutation(len(rest))
    n_test = int(round(test_fraction * len(rest)))
    n_val = int(round(val_fraction * len(rest)))
    if len(rest) >= 3:
        n_test, n_val = max(n_test, 1 if test_fraction > 0 else 0), max(n_val, 1)
    order = [rest[i] for i in perm]
    out["test"] = sorted(order[:n_test])
    out["val"] = sorted(order[n_test : n_test + n_val])
    out["train"] = sorted(order[n_test + n_val :])
    return out


# ---------------------------------------------------------------------------------------
# Training one model
# ---------------------------------------------------------------------------------------
def _make_keep_best(pl, monitor: str):
    class KeepBest(pl.Callback):
        """Keeps a copy of the weights at the best validation loss (no .ckpt files)."""

        def __init__(self):
            self.best = math.inf
            self.state: dict[str, torch.Tensor] | None = None
            self.epoch = -1

        def on_validation_epoch_end(self, trainer, module):
            if trainer.sanity_checking:
                return
            v = trainer.callback_metrics.get(monitor)
            if v is not None and float(v) < self.best:
                self.best = float(v)
                self.state = {k: t.detach().clone() for k, t in module.net.state_dict().items()}
                self.epoch = trainer.current_epoch

    return KeepBest()


def train_model(kind: str, net_hparams: dict[str, Any], train: Sequence[torch.Tensor], val: Sequence[torch.Tensor],
                cfg: Mapping[str, Any], loggers: list, progress: bool,
                init: Callable[[torch.nn.Module], None] | None = None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Fit one cost network with Lightning; return it at its best validation loss. `init`
    prepares the fresh network from the training data (normalisation, scales)."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import EarlyStopping
    from torch.utils.data import DataLoader, TensorDataset

    pl.seed_everything(int(cfg["seed"]), workers=True, verbose=False)
    module = N.make_module(kind, net_hparams, lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    if init is not None:
        init(module.net)
    bs = int(cfg["batch_size"])
    gen = torch.Generator().manual_seed(int(cfg["seed"]))
    train_dl = DataLoader(TensorDataset(*train), batch_size=bs, shuffle=True, generator=gen)
    val_dl = DataLoader(TensorDataset(*val), batch_size=max(bs, 1024), shuffle=False)
    monitor = f"{kind}/val_loss"
    keep = _make_keep_best(pl, monitor)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=int(cfg["max_epochs"]),
        logger=loggers or False,
        callbacks=[keep, EarlyStopping(monitor=monitor, patience=int(cfg["patience"]), mode="min")],
        enable_checkpointing=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=max(1, len(train_dl)),
        deterministic=False,
    )
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*number of training batches.*")
        trainer.fit(module, train_dl, val_dl)
    seconds = time.perf_counter() - t0
    net = module.net.eval()
    if keep.state is not None:
        net.load_state_dict(keep.state)
    info = {"best_epoch": keep.epoch, "best_val_loss": keep.best, "epochs": trainer.current_epoch,
            "train_seconds": round(seconds, 2), "train_samples": int(len(train[0]))}
    log.info("%s: %d epochs in %.1fs, best val loss %.4f at epoch %d", kind, info["epochs"], seconds, keep.best, keep.epoch)
    return net, info


@torch.no_grad()
def predict_compute_ms(net: torch.nn.Module, tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return net(tensors[0], tensors[1]).double().numpy()


@torch.no_grad()
def predict_comm_ms(net: torch.nn.Module, tensors: Sequence[torch.Tensor], norm: N.Normalization) -> np.ndarray:
    return norm.to_ms(net(tensors[0], tensors[1]).numpy())


# ---------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------
def _merge(defaults: dict[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    for k, v in cfg.items():
        if isinstance(v, Mapping) and isinstance(defaults.get(k), dict):
            out[k] = _merge(defaults[k], v)
        else:
            out[k] = v
    return out


def resolve_config(cfg: Any) -> dict[str, Any]:
    """A plain dict of pre-training settings from a Hydra node (the cost_model node or its
    `pretrain` sub-node) or a dict; unknown keys are rejected."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    cfg = dict(cfg or {})
    if "pretrain" in cfg:
        cfg = dict(cfg["pretrain"] or {})
    unknown = set(cfg) - set(DEFAULTS)
    if unknown:
        raise InputError(f"unknown cost-model pretrain setting(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    out = _merge(DEFAULTS, cfg)
    unknown = set(out["compute"]) - set(DEFAULTS["compute"])
    if unknown:
        raise InputError(f"unknown compute-model setting(s) {sorted(unknown)}; known: {sorted(DEFAULTS['compute'])}")
    for k, v in out["compute"].items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"compute.{k} must be a positive integer, got {v!r}")
    if out["comm"]["target"] not in N.TARGETS:
        raise InputError(f"comm.target must be one of {N.TARGETS}, got {out['comm']['target']!r}")
    if out["val_by"] not in VAL_BY:
        raise InputError(f"val_by must be one of {', '.join(VAL_BY)}, got {out['val_by']!r}")
    if int(out["max_epochs"]) < 1 or int(out["batch_size"]) < 1 or float(out["lr"]) <= 0:
        raise InputError("max_epochs and batch_size must be >= 1 and lr > 0")
    return out


def pretrain(cfg: Any, data_dir: str | os.PathLike, out_dir: str | os.PathLike) -> float:
    """Train the compute and both comm models, evaluate them held out, write the checkpoint.

    Returns the configured objective (default: the compute model's Kendall τ on the
    validation tables), for a sweeper to maximise.
    """
    c = resolve_config(cfg)
    threads = torch.get_num_threads()
    if c["num_threads"]:
        # tiny MLPs: one thread is fastest, and on a shared machine 2+ threads stall in
        # OpenMP barriers (5-10x slower epochs measured on the 2-core project machine)
        torch.set_num_threads(int(c["num_threads"]))
    try:
        return _pretrain(c, Path(data_dir), Path(out_dir))
    finally:
        torch.set_num_threads(threads)


def _pretrain(c: dict[str, Any], data_dir: Path, out_dir: Path) -> float:
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = read_profile(data_dir, require_hardware=False)
    compute_samples = N.load_compute_samples(data_dir / "compute.jsonl")
    comm_samples = N.load_comm_samples(data_dir / "comm.jsonl")
    # every session's labels on one machine speed (the median of the sessions' probes)
    probe_norm = N.normalize_to_probe(compute_samples, comm_samples, read_probes(data_dir))
    if probe_norm is not None:
        profile = {**profile, "probe_normalisation": probe_norm}
        log.info("labels of %d measuring session(s) put on one speed (compute x %.3f..%.3f)", probe_norm["probes"],
                 *probe_norm["compute_speed_range"])
    seed = int(c["seed"])

    # ---- splits
    by_tables = c["val_by"] == "tables"
    table_split = None
    if c["val_by"] == "split":
        table_split, tables, csplit = split_by_pool(compute_samples, profile, seed)
    else:
        tables = split_tables_honouring(compute_samples, float(c["val_fraction"]) if by_tables else 0.0,
                                        float(c["test_fraction"]), seed)
        csplit = split_compute(compute_samples, tables)
    if c["val_by"] == "samples":  # val: a seeded share of the non-test samples (their tables are train tables)
        rest = csplit["train"]
        perm = np.random.default_rng(seed + 2).permutation(len(rest))
        n_val = max(1, int(round(float(c["val_fraction"]) * len(rest)))) if len(rest) >= 3 else 0
        csplit["val"] = sorted(rest[i] for i in perm[:n_val])
        csplit["train"] = sorted(rest[i] for i in perm[n_val:])
    hold = c["holdout_num_devices"]
    msplit = split_comm(comm_samples, float(c["comm_val_fraction"]), float(c["comm_test_fraction"]), seed,
                        int(hold) if hold is not None else None)
    for what, split in (("compute", csplit), ("comm", msplit)):
        if not split["train"] or not split["val"]:
            raise InputError(f"too little {what} data to split: {', '.join(f'{k} {len(v)}' for k, v in split.items())} samples")
    log.info("compute samples: %s; comm samples: %s", {k: len(v) for k, v in csplit.items()}, {k: len(v) for k, v in msplit.items()})

    loggers_for = _loggers(c, out_dir)
    try:
        return _train_all(c, data_dir, out_dir, profile, compute_samples, comm_samples, tables, csplit, msplit, loggers_for,
                          table_split)
    except BaseException:
        loggers_for.finish(None)
        raise


def _train_all(c, data_dir, out_dir, profile, compute_samples, comm_samples, tables, csplit, msplit, loggers_for,
               table_split=None) -> float:
    hold = c["holdout_num_devices"]
    metrics: dict[str, Any] = {}
    bundle: dict[str, Any] = {"format_version": N.FORMAT_VERSION, "normalization": {}}
    t_all = time.perf_counter()

    # ---- compute model
    feats, y = N.compute_arrays(compute_samples)
    train_idx = csplit["train"]
    tens = {k: N.compute_tensors([feats[i] for i in v], y[v]) for k, v in csplit.items() if v}
    hp = dict(c["compute"])
    init = lambda net: net.init_from_data([feats[i] for i in train_idx], y[train_idx])  # noqa: E731
    net, info = train_model("compute", hp, tens["train"], tens["val"], c, loggers_for("compute"), bool(c["progress"]), init)
    m = dict(info)
    pred = {split: predict_compute_ms(net, t) for split, t in tens.items()}
    for split in tens:
        m[split] = regression_metrics(y[csplit[split]], pred[split])
    held = "test" if "test" in tens else "val"
    m["by_num_tables"] = _by_group(compute_samples, csplit[held], y, pred[held], _size_group)
    m["by_origin"] = _by_group(compute_samples, csplit[held], y, pred[held], lambda s: s.origin)
    m["by_batch"] = _by_group(compute_samples, csplit[held], y, pred[held], lambda s: str(s.batch_size))
    metrics["compute"] = m
    bundle["compute"] = {"state_dict": _plain_state(net), "hparams": hp}
    bundle["normalization"]["compute"] = {"feature_names": list(N.COMPUTE_FEATURE_NAMES)}

    # ---- comm models
    for kind, direction in (("forward_comm", "forward"), ("backward_comm", "backward")):
        feats_c, ys = N.comm_arrays(comm_samples, direction)
        tr = msplit["train"]
        norm_c = N.Normalization.fit(np.concatenate([feats_c[i] for i in tr]), np.concatenate([ys[i] for i in tr]),
                                     c["comm"]["target"])
        tens_c = {k: N.comm_tensors([feats_c[i] for i in v], [ys[i] for i in v], norm_c) for k, v in msplit.items() if v}
        hp_c = {"in_features": feats_c[0].shape[1], "hidden": c["comm"]["hidden"], "embed": c["comm"]["embed"]}
        net_c, info_c = train_model(kind, hp_c, tens_c["train"], tens_c["val"], c, loggers_for(kind), bool(c["progress"]))
        m = dict(info_c)
        for split, t in tens_c.items():
            mask = t[1].numpy() > 0
            pred = predict_comm_ms(net_c, t, norm_c)[mask]
            true = np.concatenate([ys[i] for i in msplit[split]])
            if direction == "forward":  # scored on the whole forward time: the wait added back to both
                wait = np.concatenate([N.forward_wait_ms(comm_samples[i].delays_ms) for i in msplit[split]])
                pred, true = pred + wait, true + wait
            m[split] = regression_metrics(true, pred)
        metrics[kind] = m
        bundle[kind] = {"state_dict": _plain_state(net_c), "hparams": hp_c}
        names = N.COMM_FEATURE_NAMES if direction == "forward" else N.BACKWARD_COMM_FEATURES
        bundle["normalization"][kind] = {**norm_c.to_dict(), "feature_names": list(names)}
    metrics["train_seconds_total"] = round(time.perf_counter() - t_all, 2)

    envelope = Envelope.fit(
        [feats[i] for i in csplit["train"]], [compute_samples[i].batch_size for i in csplit["train"]],
        [compute_samples[i].imputed_histograms for i in csplit["train"]],
        sum(len(compute_samples[i].tables) for i in csplit["train"]),
        [(comm_samples[i].widths, comm_samples[i].delays_ms, comm_samples[i].batch_size) for i in msplit["train"]],
    )
    batches = sorted({s.batch_size for s in compute_samples})
    data = {
        "source": str(data_dir),
        "batch_sizes": batches,
        "origins": dict(Counter(s.origin for s in compute_samples)),
        "compute_samples": {k: len(v) for k, v in csplit.items()},
        "comm_samples": {k: len(v) for k, v in msplit.items()},
        "comm_num_devices": sorted({s.num_devices for s in comm_samples}),
        "holdout_num_devices": hold,
        # the table split, by name and by identity (rows and pooling factor: names repeat across
        # pools), so an evaluation can refuse a test task holding a table trained or tuned on
        "tables": {**tables, **(_table_split_keys(table_split) if table_split is not None
                                 else _split_keys(compute_samples, tables))},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": c,
        "host": platform.node(),
    }
    if table_split is not None:  # the pool's train / validation / test tables (embshard.data.split.TableSplit)
        data["split"] = table_split.to_dict()
    bundle.update({"profile": profile, "metrics": metrics, "data": data, "envelope": envelope.to_dict()})
    norm = profile.get("probe_normalisation")
    if norm is not None:
        # the machine speed the labels are on: a session elsewhere rescales to its own probe
        bundle["probe"] = norm["reference"]
    objective = _objective(metrics, str(c["objective"]))
    metrics["objective"] = {"name": c["objective"], "value": objective}
    if not math.isfinite(objective):  # said, not left for a sweep to rank a nan silently
        why = _undefined_objective(metrics, str(c["objective"]))
        metrics["objective"]["undefined"] = why
        log.warning("objective %s is %s: %s", c["objective"], objective, why)

    ckpt = out_dir / "cost_models.pt"
    with atomic_path(ckpt) as tmp:
        torch.save(bundle, tmp)
    N.NeuralCostModels.load(ckpt)  # the written file must load (weights_only=True)
    write_json_atomic(out_dir / "metrics.json", {"metrics": metrics, "data": {k: v for k, v in data.items() if k != "tables"},
                                                 "heldout_tables": tables["test"], "val_tables": tables["val"]})
    write_text_atomic(out_dir / "metrics.csv", metrics_csv(metrics))
    if table_split is not None:
        table_split.save(out_dir / "split.json")
    write_text_atomic(out_dir / "data_card.md", data_card(metrics, data, profile, envelope))
    loggers_for.finish(metrics)
    log.info("wrote %s (objective %s = %.4f)", ckpt, c["objective"], objective)
    return objective


def _size_group(sample) -> str:
    n = len(sample.tables)
    for lo, hi in ((1, 3), (4, 7), (8, 15), (16, 40)):
        if lo <= n <= hi:
            return f"{lo}-{hi}"
    return "41+"


def _by_group(samples, idx, y, pred, key) -> dict[str, dict[str, float]]:
    """Held-out metrics per group of samples (`key(sample)`: shard size, origin, batch)."""
    groups: dict[str, list[int]] = {}
    for j, i in enumerate(idx):
        groups.setdefault(key(samples[i]), []).append(j)
    idx = np.asarray(idx)
    return {g: regression_metrics(y[idx[js]], np.asarray(pred)[js]) for g, js in sorted(groups.items()) if len(js) >= 2}


def _objective(metrics: dict[str, Any], name: str) -> float:
    node: Any = metrics
    for part in name.split("/"):
        if isinstance(node, dict) and node.get("n") == 0 and part not in node:
            return float("nan")  # a metric of an empty set (`regression_metrics` gives only n): no value
        if not isinstance(node, dict) or part not in node:
            raise InputError(f"objective {name!r} is not a metric (e.g. compute/val/kendall_tau)")
        node = node[part]
    return float(node)


def _undefined_objective(metrics: dict[str, Any], name: str) -> str:
    """Why the objective `name` has no value: the size of the set it was computed on."""
    parts = name.split("/")
    where = metrics
    for part in parts[:-1]:
        where = where.get(part, {}) if isinstance(where, dict) else {}
    n = where.get("n") if isinstance(where, dict) else None
    of = "/".join(parts[:-1]) or name
    if n is not None and n < 2:
        return (f"{of} has {n} sample(s) and {parts[-1]} needs at least 2; collect more data, or validate on a larger "
                f"share (cost_model.pretrain.val_by=samples with a larger cost_model.pretrain.val_fraction)")
    return (f"{of} ({n} samples) gives no value: its measured or predicted costs may all be equal; a sweep cannot "
            f"rank this trial")


def _plain_state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().float().contiguous().clone() for k, v in net.state_dict().items()}


class _Loggers:
    """Per-model CSV loggers and one W&B run (offline by default) shared by the three models."""

    def __init__(self, c: dict[str, Any], out_dir: Path):
        self.out_dir = out_dir
        self.wandb = None
        if c["wandb"]:
            from pytorch_lightning.loggers import WandbLogger

            if c["wandb_offline"]:
                os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = WandbLogger(project=c["wandb_project"], save_dir=str(out_dir), offline=bool(c["wandb_offline"]),
                                     name=f"pretrain-{out_dir.name}", job_type="pretrain", config=c)

    def __call__(self, kind: str) -> list:
        from pytorch_lightning.loggers import CSVLogger

        out = [CSVLogger(save_dir=str(self.out_dir), name="logs", version=kind)]
        if self.wandb is not None:
            out.append(self.wandb)
        return out

    def finish(self, metrics: dict[str, Any] | None) -> None:
        """Close the W&B run (with the held-out metrics in its summary unless None)."""
        if self.wandb is None:
            return
        if metrics is None:
            self.wandb.experiment.finish(exit_code=1)
            self.wandb = None
            return
        flat = {}
        for model in N.MODEL_KEYS:
            for split in ("val", "test", "heldout_devices"):
                for k, v in (metrics.get(model, {}).get(split) or {}).items():
                    flat[f"{model}/{split}/{k}"] = v
        flat["objective"] = metrics["objective"]["value"]
        run = self.wandb.experiment
        run.summary.update(flat)
        run.finish()
        self.wandb = None


def _loggers(c: dict[str, Any], out_dir: Path) -> _Loggers:
    return _Loggers(c, out_dir)


def metrics_csv(metrics: dict[str, Any]) -> str:
    cols = ("n", "rmse_ms", "mape_pct", "r2", "kendall_tau", "mean_ms")
    lines = ["model,split," + ",".join(cols)]
    for model in N.MODEL_KEYS:
        for split in ("train", "val", "test", "heldout_devices"):
            m = metrics.get(model, {}).get(split)
            if m and m.get("n"):
                lines.append(f"{model},{split}," + ",".join(f"{m[k]:.6g}" for k in cols))
    return "\n".join(lines) + "\n"


def _table_split_keys(split: Any) -> dict[str, list[str]]:
    """`<split>_keys` of a TableSplit, under pretrain's split names (train / val / test)."""
    return {f"{k}_keys": sorted(split.keys[s]) for k, s in (("train", "train"), ("val", "validation"), ("test", "test"))}


def _split_keys(samples: Sequence[N.ComputeSample], tables: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """`<split>_keys`: the identities (`embshard.data.split.table_key`) of each split's tables."""
    from embshard.data.split import key_of

    key = {t.name: key_of(t) for s in samples for t in s.tables}
    return {f"{k}_keys": sorted({key[n] for n in names if n in key}) for k, names in tables.items()}


def data_card(metrics: dict[str, Any], data: dict[str, Any], profile: dict[str, Any], envelope: Envelope) -> str:
    """Markdown numbers for the checkpoint's data card (the command is added by train.py's caller)."""
    cs, ms = data["compute_samples"], data["comm_samples"]
    t = data["tables"]
    val_tables = f", {len(t['val'])} validation tables" if t["val"] else ""
    rows = []
    for model, split, label in (
        ("compute", "test", "compute, held-out tables"),
        *([("compute", "val", "compute, validation tables")] if data["config"]["val_by"] != "samples" else []),
        ("forward_comm", "test", "forward comm, held-out samples"),
        ("backward_comm", "test", "backward comm, held-out samples"),
        ("forward_comm", "heldout_devices", f"forward comm, unseen D={data['holdout_num_devices']}"),
        ("backward_comm", "heldout_devices", f"backward comm, unseen D={data['holdout_num_devices']}"),
    ):
        m = metrics.get(model, {}).get(split)
        if m and m.get("n"):
            rows.append(f"| {label} | {m['n']} | {m['rmse_ms']:.3f} | {m['mape_pct']:.1f} | {m['r2']:.3f} | {m['kendall_tau']:.3f} |")
    hardware = {**{k: v for k, v in profile.items() if not isinstance(v, (dict, list))}, **(profile.get("hardware") or {})}
    pool = profile.get("pool") or {}
    if pool.get("source"):
        hardware["table pool"] = f"{pool['source']} ({len(pool.get('train_tables') or [])} train / {len(pool.get('test_tables') or [])} held-out tables)"
    prof = "\n".join(f"- {k}: {v}" for k, v in hardware.items())
    return (
        "# Cost models: data card\n\n"
        f"Created {data['created']} on host `{data['host']}` from `{data['source']}`.\n\n"
        "## Hardware profile\n\n" + (prof or "- (empty)") + "\n\n"
        "## Samples\n\n"
        f"- compute shards: {cs.get('train', 0)} train / {cs.get('val', 0)} val / {cs.get('test', 0)} test "
        f"(test by table names: {len(t['test'])} held-out tables, a shard with any of them is a test shard; "
        f"val by {data['config']['val_by']}{val_tables})\n"
        + _split_card(data.get("split")) +
        f"- comm configurations: {ms.get('train', 0)} train / {ms.get('val', 0)} val / {ms.get('test', 0)} test, "
        f"plus {ms.get('heldout_devices', 0)} with D={data['holdout_num_devices']} never trained on; "
        f"device counts in the data: {data['comm_num_devices']}\n"
        f"- where the compute shards came from: {data['origins']} (random: the collector's draws; an algorithm's "
        "name: device shards of its plans, measured by the refine stage)\n\n"
        + _probe_card(profile.get("probe_normalisation"))
        + envelope_card(envelope) +
        "## Held-out accuracy (ms)\n\n"
        "| model | n | RMSE (ms) | MAPE (%) | R² | Kendall τ |\n|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"Training took {metrics.get('train_seconds_total', float('nan')):.0f} s.\n\n"
        "## Commands\n\n"
        f"- cost data: `python train.py stage=collect ... out_dir={data['source']}` "
        "(the resolved collection config is in the data folder's profile.json and config.yaml)\n"
        f"- these models: `python train.py stage=pretrain data_dir={data['source']} out_dir=<this folder>`\n"
        "- the shipped CPU checkpoint end to end: `make checkpoint`\n"
    )


def _split_card(split: Mapping[str, Any] | None) -> str:
    if not split:
        return ""
    n = {k: len(split[k]) for k in ("train", "validation", "test")}
    return (f"- table split (`val_by: split`, `split.json` beside the checkpoint): pool {split['pool']}, seed "
            f"{split['seed']}: {n['train']} train / {n['validation']} validation / {n['test']} test tables. Validation "
            "shards (early stopping, best weights, the objective) hold validation tables and no test table; test "
            "shards a test table; shards of generated tables only that the collector held out go to either by a "
            "seeded coin\n")


def _probe_card(norm: dict[str, Any] | None) -> str:
    if not norm:
        return ("## Machine speed\n\nThe cost data names no speed probe: the checkpoint records none and is never "
                "rescaled to the machine it is used on.\n\n")
    ref = norm["reference"]
    kernels = ", ".join(f"{k} {v:.3f} ms" for k, v in ref["compute_ms"].items())
    comm = f"{ref['comm_ms']:.3f} ms" if ref.get("comm_ms") else "none"
    lo, hi = norm["compute_speed_range"]
    clo, chi = norm["comm_speed_range"]
    return ("## Machine speed\n\n"
            f"Labels of {norm['probes']} measuring session(s) are put on the speed of the median probe "
            f"(timed {ref['created']} on `{ref['host']}`, protocol {ref['protocol']}): kernels {kernels}; "
            f"all-to-all {comm}. The sessions ran {lo:.3f}-{hi:.3f}x as long as it (compute) and "
            f"{clo:.3f}-{chi:.3f}x (comm). The checkpoint records this probe; a measuring session elsewhere "
            "rescales the predictions to its own probe (report.json, `rescale`).\n\n")


def envelope_card(env: Envelope) -> str:
    """The training envelope as a markdown section (what the models never saw is outside it)."""
    f = {k: v for k, v in env.features.items()}
    exp_rng = lambda r: f"{math.exp(r.lo):.3g} .. {math.exp(r.hi):.3g}"  # noqa: E731
    rows = [
        ("batch sizes", ", ".join(str(b) for b in env.compute_batch_sizes)),
        ("pieces per shard", f"{env.shard_pieces.lo:.0f} .. {env.shard_pieces.hi:.0f}"),
        ("rows per piece", exp_rng(f["log_rows"])),
        ("dim per piece", f"{2 ** f['log2_dim'].lo:.0f} .. {2 ** f['log2_dim'].hi:.0f}"),
        ("pooling factor per piece", f"{math.expm1(f['log1p_pooling_factor'].lo):.3g} .. {math.expm1(f['log1p_pooling_factor'].hi):.3g}"),
        ("lookups per shard and step (x 1e4)", f"{env.shard_sums['lookups_1e4'].lo:.3g} .. {env.shard_sums['lookups_1e4'].hi:.3g}"),
        ("weight MB per shard", f"{env.shard_sums['weight_mb'].lo:.3g} .. {env.shard_sums['weight_mb'].hi:.3g}"),
        ("reuse histograms of the pieces", f"{env.histograms['given']} measured, {env.histograms['imputed']} imputed"),
        ("comm: device counts", ", ".join(str(d) for d in env.comm_devices)),
        ("comm: batch", f"{env.comm_batch.lo:.0f} .. {env.comm_batch.hi:.0f}"),
        ("comm: width per device (max)", f"{env.comm_width.hi:.0f}"),
        ("comm: compute delay (max ms)", f"{env.comm_delay_ms.hi:.1f}"),
    ]
    return ("## Training envelope\n\nPredictions outside these ranges (2% tolerance) are counted and reported "
            "(report.json, `envelope` per plan).\n\n| quantity | trained on |\n|---|---|\n"
            + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n\n")
