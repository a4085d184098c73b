"""train.py's stages: one function per stage, each named by its config, conf/stage/<name>.yaml
(`_target_`). A stage gets the composed config restricted to what its config `reads` (plus
seed, progress, out_dir, paths and stage), so `python train.py stage=X --cfg job` shows what it
takes, and a stage cannot quietly depend on more. Stages that run end-to-end DLRM training
import the repository's `dlrm/` package (train.py runs from the repository root).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from functools import partial
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from embshard.errors import InputError

log = logging.getLogger("train")
ROOT = Path(__file__).resolve().parents[2]
#: what every stage may read besides its own `reads`
COMMON = ("stage", "paths", "seed", "progress", "out_dir")


def stage_view(cfg: DictConfig) -> DictConfig:
    """`cfg` with only the keys the stage reads (its `reads` and COMMON), read-only."""
    keys = [k for k in (*COMMON, *cfg.stage.reads) if k in cfg]
    view = OmegaConf.masked_copy(cfg, keys)
    OmegaConf.set_struct(view, True)
    OmegaConf.set_readonly(view, True)
    return view


def out_dir(cfg: DictConfig, timestamped: bool = True) -> Path:
    """`out_dir` when given, else <paths.outputs>/train/<stage>[/<paths.run>] under the project root."""
    if cfg.out_dir:
        return Path(cfg.out_dir)
    root = Path(str(cfg.paths.outputs))
    root = (root if root.is_absolute() else ROOT / root) / "train" / cfg.stage.name
    return root / str(cfg.paths.run) if timestamped else root


def _finish(cfg: DictConfig, out: Path, result: float | None = None) -> float | None:
    """Write the resolved config beside the outputs (rank 0) and say where they are."""
    from embshard.costs.collect import rank_info  # the one reader of torchrun's environment
    from embshard.io import write_text_atomic

    if rank_info()[0] == 0:
        write_text_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        print(f"wrote {out}")
    return result


def dataset_path(ds: DictConfig, generate: bool = True) -> Path:
    """The dataset file; a synthetic one is generated on first use (FileNotFoundError
    instead when `generate` is false)."""
    if ds.kind == "synthetic":
        path = ROOT / ds.path if not Path(ds.path).is_absolute() else Path(ds.path)
        if not path.is_file() and not generate:
            raise FileNotFoundError(path)
        if not path.is_file():
            from embshard.data.synthetic import generate_synthetic

            log.info("generating %s", path)
            generate_synthetic(path, num_tables=ds.num_tables, batch_size=ds.batch_size, seed=ds.seed, scale=ds.scale)
        return path
    if ds.path is None or not Path(ds.path).is_file():
        raise InputError(f"dataset file {ds.path!r} not found (set dataset.path=...)")
    return Path(ds.path)


# ---------------------------------------------------------------------------- data and tasks
def synthetic(cfg: DictConfig) -> None:
    """Write a synthetic dlrm_datasets-format file (dataset.*)."""
    log.info("synthetic dataset at %s", dataset_path(cfg.dataset))
    return _finish(cfg, out_dir(cfg))


def pool(cfg: DictConfig) -> None:
    """The table features of a dataset file as a table-pool JSON."""
    from embshard.data.tasks import table_pool_from_dataset

    out = out_dir(cfg)
    tables = table_pool_from_dataset(dataset_path(cfg.dataset), out / "table_pool.json",
                                     hash_sizes=cfg.dataset.get("hash_sizes"))
    log.info("%d tables -> %s", len(tables), out / "table_pool.json")
    return _finish(cfg, out)


def tasks(cfg: DictConfig) -> None:
    """Task JSON files: NeuroShard- or DreamShard-style draws from a dataset's tables, or
    user-style tasks of generated tables (task.kind=user)."""
    from embshard.data.tasks import dreamshard_tasks, neuroshard_tasks, table_pool_from_dataset, user_tasks

    out = out_dir(cfg)
    t = cfg.task
    if t.kind == "user":  # generated tables: no dataset needed
        u = OmegaConf.to_container(t, resolve=True)
        made = user_tasks(u["num_tasks"], seed=cfg.seed, min_tables=u["min_tables"], max_tables=u["max_tables"],
                          num_devices=u["num_devices"], batch_sizes=u["batch_sizes"], memory_slack=u["memory_slack"],
                          optimizer=u["optimizer"], name_prefix=u["name_prefix"], cycle=u["cycle"], out_dir=out,
                          max_lookups_per_device=u.get("max_lookups_per_device"), **u["tables"])
        log.info("%d user-style tasks -> %s", len(made), out)
        return _finish(cfg, out)
    if t.kind not in ("neuroshard", "dreamshard"):
        raise InputError(f"unknown task kind {t.kind!r}; choose neuroshard, dreamshard or user")
    table_pool = table_pool_from_dataset(dataset_path(cfg.dataset), hash_sizes=cfg.dataset.get("hash_sizes"))
    common = dict(min_tables=t.min_tables, max_tables=t.max_tables, dims=list(t.dims), max_total_bytes=t.max_total_bytes,
                  num_devices=t.num_devices, device_memory_bytes=t.device_memory_bytes, batch_size=t.batch_size,
                  optimizer=t.optimizer)
    if t.kind == "neuroshard":
        made = neuroshard_tasks(table_pool, t.num_tasks, seed=cfg.seed, out_dir=out, **common)
        log.info("%d NeuroShard-style tasks -> %s", len(made), out)
    else:
        split = dreamshard_tasks(table_pool, out, num_train_tasks=t.num_train_tasks, num_test_tasks=t.num_test_tasks,
                                 test_fraction=t.test_fraction, seed=cfg.seed, **common)
        log.info("%d train / %d test DreamShard-style tasks -> %s", len(split["train"]), len(split["test"]), out)
    return _finish(cfg, out)


# ---------------------------------------------------------------------------- cost models
def collect(cfg: DictConfig) -> None:
    """Measure this rank's share of cost samples (resumable), then merge on rank 0."""
    from embshard.costs.collect import collect as collect_samples
    from embshard.costs.collect import merge, wait_for_ranks

    out = out_dir(cfg)
    c = OmegaConf.to_container(cfg.collect, resolve=True)
    done = collect_samples(c, out, pool=c.get("pool") or dataset_path(cfg.dataset))
    log.info("rank %d: %s new chunks, %s skipped (already on disk)", done.rank, done.new_chunks, done.skipped_chunks)
    wait_for_ranks(done)  # under torchrun: every rank has finished its chunks
    if done.rank == 0:
        log.info("merged: %s", merge(out))
    return _finish(cfg, out)


def pretrain(cfg: DictConfig) -> float:
    """Train NeuroShard's cost models on `data_dir` (what stage=collect wrote)."""
    from embshard.costs.pretrain import pretrain as pretrain_models

    if not cfg.get("data_dir"):
        raise InputError("stage=pretrain needs data_dir=<folder with compute.jsonl, comm.jsonl, profile.json>")
    out = out_dir(cfg)
    result = pretrain_models(cfg.cost_model, cfg.data_dir, out)
    log.info("objective %.4f", result)
    return _finish(cfg, out, result)


def refine(cfg: DictConfig) -> None:
    """Measure what the search proposes, re-train (embshard.costs.refine)."""
    from hydra.utils import instantiate

    from embshard.costs.refine import refine as refine_models
    from embshard.data.tasks import user_tasks

    out = out_dir(cfg)
    r = cfg.refine
    unknown = [a for a in r.algorithms if a not in cfg.searchers]
    if unknown or "neuroshard" not in r.algorithms:
        raise InputError(f"refine.algorithms must include neuroshard and name known planners; unknown: {unknown}")
    t = OmegaConf.to_container(r.tasks, resolve=True)
    if t.get("kind") != "user":
        raise InputError(f"refine.tasks must be user-style tasks (task kind 'user'), got {t.get('kind')!r}")

    def make_tasks(k: int):
        return user_tasks(t["num_tasks"], seed=int(cfg.seed) * 1000 + k, min_tables=t["min_tables"],
                          max_tables=t["max_tables"], num_devices=t["num_devices"], batch_sizes=t["batch_sizes"],
                          memory_slack=t["memory_slack"], optimizer=t["optimizer"], name_prefix=f"refine{k}",
                          cycle=t["cycle"], max_lookups_per_device=t.get("max_lookups_per_device"), **t["tables"])

    def make_sharders(checkpoint: Path):
        # NeuroShard against the round's models, without the guard: the loop scores its own pick
        return {a: instantiate(cfg.searchers[a], **({"checkpoint": str(checkpoint), "verify": 0}
                                                     if a == "neuroshard" else {})) for a in r.algorithms}

    summary = refine_models(OmegaConf.to_container(r, resolve=True), cfg.cost_model, make_tasks, make_sharders,
                            instantiate(cfg.hardware), out)
    log.info("refine: %d round(s), converged=%s, final models %s", len(summary["rounds"]), summary["converged"],
             summary["final"])
    return _finish(cfg, out)


def rl(cfg: DictConfig) -> float:
    """Train a DreamShard or AutoShard placement policy (embshard.search.rl.stage)."""
    from embshard.search.rl.stage import run_from_config

    out = out_dir(cfg)
    return _finish(cfg, out, run_from_config(cfg, partial(dataset_path, cfg.dataset), out))


# ---------------------------------------------------------------------------- end to end
def dlrm_task(cfg: DictConfig) -> None:
    """The end-to-end task JSON alone, e.g. to plan it with shard.py first."""
    from dlrm.stages import load_task

    from embshard.io import write_text_atomic

    out = out_dir(cfg, timestamped=False)
    task = load_task(cfg.dlrm, partial(dataset_path, cfg.dataset), cfg.seed, local_rank=0)
    task.save(out / "task.json")
    write_text_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    print(f"task {task.name}: {len(task.tables)} tables, {task.num_devices} devices -> {out / 'task.json'}")


def _end_to_end(cfg: DictConfig, run) -> float:
    from hydra.utils import instantiate

    return run(cfg, dataset_path=partial(dataset_path, cfg.dataset),
               make_sharder=lambda name: instantiate(cfg.searchers[name]), known_planners=list(cfg.searchers),
               default_root=out_dir(cfg, timestamped=False))


def dlrm(cfg: DictConfig) -> float:
    """Train TorchRec's DLRM under one plan (torchrun; dlrm/stages.py); writes its own config.yaml."""
    from dlrm.stages import run_dlrm

    return _end_to_end(cfg, run_dlrm)


def throughput(cfg: DictConfig) -> float:
    """The same DLRM under several plans, interleaved: samples/s (torchrun; dlrm/stages.py)."""
    from dlrm.stages import run_throughput

    return _end_to_end(cfg, run_throughput)


def sequence_task(cfg: DictConfig) -> None:
    """FlexShard: a sequence-table task (dlrm/sequence_stages.py)."""
    from dlrm.sequence_stages import run_sequence_task

    return run_sequence_task(cfg, ROOT)


def sequence_throughput(cfg: DictConfig) -> float:
    """The sequence DLRM under each plan, interleaved (torchrun; dlrm/sequence_stages.py)."""
    from hydra.utils import instantiate

    from dlrm.sequence_stages import run_sequence_throughput

    return run_sequence_throughput(cfg, lambda name: instantiate(cfg.searchers[name]), list(cfg.searchers),
                                   out_dir(cfg, timestamped=False), ROOT)


# ---------------------------------------------------------------------------- emulated cluster
def run_on_cluster(cfg: DictConfig) -> None:
    """stage=throughput / sequence_throughput with cluster=emulated: the task's two hosts as
    network namespaces joined by a tc-shaped veth pair (embshard.hardware.cluster), one torchrun
    per host inside its namespace running this same command; torn down after, also on failure
    or interrupt. Where namespaces cannot be made: one error line, then loopback (unless
    cluster.on_unavailable=error)."""
    from embshard.hardware.cluster import (ENV_CLUSTER, ClusterUnavailable, EmulatedCluster, LinkShape,
                                           auto_rate_mbit, intra_host_mbit, launch_torchrun, teardown_on_signals,
                                           timed_transfer_mbit)

    c = cfg.cluster
    if "RANK" in os.environ:
        raise InputError("cluster=emulated starts its own processes (one torchrun per emulated host): "
                         "run `python train.py ...` without torchrun")
    if c.on_unavailable not in ("loopback", "error"):
        raise InputError(f"cluster.on_unavailable must be loopback or error, got {c.on_unavailable!r}")
    if c.rate_mbit != "auto" and not isinstance(c.rate_mbit, (int, float)):
        raise InputError(f"cluster.rate_mbit must be auto or a number (Mbit/s), got {c.rate_mbit!r}")
    if cfg.stage.name == "sequence_throughput":
        from dlrm.sequence_stages import _block, build_task

        task = build_task(_block(cfg), ROOT)
    else:
        from dlrm.stages import load_task

        task = load_task(cfg.dlrm, partial(dataset_path, cfg.dataset), cfg.seed, local_rank=0)
    if task.hosts != 2:
        raise InputError(f"cluster=emulated joins two hosts; task {task.name!r} has {task.hosts} "
                         f"({task.num_devices} devices, {task.devices_per_host} per host)")
    nbytes = int(float(c.probe_megabytes) * 1e6)
    try:
        shape = LinkShape(1000.0 if c.rate_mbit == "auto" else float(c.rate_mbit), float(c.latency_us))
        with teardown_on_signals(), EmulatedCluster(shape) as cluster:
            info: dict = {"kind": "emulated", "task_intra_host_gbps": task.intra_host_gbps,
                          "task_inter_host_gbps": task.inter_host_gbps, "devices_per_host": task.devices_per_host}
            info["loopback_stream_mbit"] = timed_transfer_mbit(cluster, 0, 0, nbytes)
            if c.rate_mbit == "auto":
                if task.devices_per_host < 2:
                    raise InputError("cluster.rate_mbit=auto scales from the intra-host link, which needs 2+ devices "
                                     "per host; set cluster.rate_mbit")
                info["intra_host_mbit_per_device"] = intra_host_mbit(cluster, task.devices_per_host)
                cluster.set_rate(auto_rate_mbit(info["intra_host_mbit_per_device"], task.intra_host_gbps,
                                                task.inter_host_gbps, task.devices_per_host))
            link = timed_transfer_mbit(cluster, 0, 1, min(nbytes, int(cluster.shape.rate_mbit * 1e6 / 8 * 3)))
            info.update(cluster.describe(), measured_link_mbit=link)
            print(f"emulated cluster: 2 hosts x {task.devices_per_host} processes, link {cluster.shape.rate_mbit:.0f} "
                  f"Mbit/s set, {link:.0f} Mbit/s timed (intra-host: gloo "
                  f"{info.get('intra_host_mbit_per_device', float('nan')):.0f} Mbit/s per device, one TCP stream "
                  f"{info['loopback_stream_mbit']:.0f})")
            rc = launch_torchrun(cluster, 2, task.devices_per_host, ROOT / "train.py", sys.argv[1:],
                                 {ENV_CLUSTER: json.dumps(info)}, master_port=int(c.master_port))
    except ClusterUnavailable as e:
        if c.on_unavailable == "error":
            raise
        print(f"error: {e}; running on loopback instead (every link the same speed)", file=sys.stderr)
        rc = launch_torchrun(None, 2, task.devices_per_host, ROOT / "train.py", sys.argv[1:],
                             {ENV_CLUSTER: json.dumps({"kind": "loopback", "reason": str(e)})},
                             master_port=int(c.master_port))
    if rc:
        raise SystemExit(rc)
    return None
