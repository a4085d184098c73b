"""Hydra entry for the offline stages: data, tasks, cost-data collection, cost-model
pre-training, and end-to-end DLRM training under sharding plans.

    python train.py stage=synthetic dataset.num_tables=856 dataset.batch_size=65536
    python train.py stage=pool dataset=dlrm_2021 dataset.path=/data/fbgemm_t856_bs65536.pt.gz
    python train.py stage=tasks task=dreamshard out_dir=tasks/dreamshard
    python train.py stage=collect collect=cpu out_dir=costdata/cpu        # resumable; torchrun for ranks
    python train.py stage=pretrain data_dir=costdata/cpu out_dir=checkpoints/cpu_fbgemm
    python train.py stage=refine refine.data_dir=costdata/cpu out_dir=experiments/refine   # close the loop
    python train.py stage=rl rl=dreamshard experiment=rl_cpu out_dir=checkpoints/dreamshard_cpu  # or rl=autoshard
    python train.py stage=dlrm_task experiment=e2e_embedding_heavy out_dir=DIR  # the end-to-end task JSON
    torchrun --nproc_per_node 2 train.py stage=dlrm dlrm.plan=neuroshard        # DLRM training under a plan
    torchrun --nproc_per_node 2 train.py stage=throughput experiment=e2e_embedding_heavy \
        dlrm.plans=[neuroshard,torchrec,pile_up]                              # samples/s per plan
    python train.py stage=sequence_task experiment=flexshard_e2e out_dir=DIR  # FlexShard: a sequence task
    torchrun --nproc_per_node 4 train.py stage=sequence_throughput experiment=flexshard_e2e  # sequence DLRM per plan
    python train.py stage=sequence_throughput experiment=flexshard_e2e cluster=emulated  # on 2 emulated hosts

Every run writes its resolved config (config.yaml) beside its outputs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime
from functools import partial
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from embshard.cli import one_line_errors
from embshard.errors import InputError

log = logging.getLogger("train")
ROOT = Path(__file__).resolve().parent
STAGES = ("synthetic", "pool", "tasks", "collect", "pretrain", "refine", "rl", "dlrm_task", "dlrm", "throughput",
          "sequence_task", "sequence_throughput")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return one_line_errors(run, cfg)


def run(cfg: DictConfig) -> float | None:
    from embshard.io import write_text_atomic

    if cfg.stage not in STAGES:
        raise InputError(f"unknown stage {cfg.stage!r}; choose from {', '.join(STAGES)}")
    if cfg.cluster.kind not in ("loopback", "emulated"):
        raise InputError(f"cluster must be loopback or emulated, got {cfg.cluster.kind!r}")
    from embshard.hardware.cluster import ENV_HOST

    if cfg.cluster.kind == "emulated" and ENV_HOST not in os.environ:
        return run_on_cluster(cfg)
    if cfg.stage in ("dlrm", "throughput"):
        return run_end_to_end(cfg)
    if cfg.stage == "sequence_task":  # FlexShard: dlrm/sequence_stages.py
        from dlrm.sequence_stages import run_sequence_task

        return run_sequence_task(cfg, ROOT)
    if cfg.stage == "sequence_throughput":
        from hydra.utils import instantiate

        from dlrm.sequence_stages import run_sequence_throughput

        return run_sequence_throughput(cfg, lambda name: instantiate(cfg.searchers[name]), list(cfg.searchers),
                                       ROOT / "outputs" / "train" / cfg.stage, ROOT)
    if cfg.stage == "dlrm_task":  # the end-to-end task alone, e.g. to plan it with shard.py first
        from dlrm.stages import load_task

        out = Path(cfg.out_dir) if cfg.out_dir else ROOT / "outputs" / "train" / "dlrm_task"
        task = load_task(cfg.dlrm, partial(dataset_path, cfg.dataset), cfg.seed, local_rank=0)
        task.save(out / "task.json")
        write_text_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        print(f"task {task.name}: {len(task.tables)} tables, {task.num_devices} devices -> {out / 'task.json'}")
        return None
    out_dir = Path(cfg.out_dir) if cfg.out_dir else ROOT / "outputs" / "train" / cfg.stage / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    result = None
    if cfg.stage == "rl":  # DreamShard / AutoShard policies (src/embshard/search/rl/stage.py)
        from embshard.search.rl.stage import run_from_config

        result = run_from_config(cfg, partial(dataset_path, cfg.dataset), out_dir)
    elif cfg.stage == "pretrain":
        from embshard.costs.pretrain import pretrain

        if not cfg.get("data_dir"):
            raise InputError("stage=pretrain needs data_dir=<folder with compute.jsonl, comm.jsonl, profile.json>")
        result = pretrain(cfg.cost_model, cfg.data_dir, out_dir)
        log.info("objective %.4f", result)
    elif cfg.stage == "refine":
        run_refine(cfg, out_dir)
    elif cfg.stage == "tasks" and cfg.task.kind == "user":  # generated tables: no dataset needed
        from embshard.data.tasks import user_tasks

        t = OmegaConf.to_container(cfg.task, resolve=True)
        tasks = user_tasks(t["num_tasks"], seed=cfg.seed, min_tables=t["min_tables"], max_tables=t["max_tables"],
                           num_devices=t["num_devices"], batch_sizes=t["batch_sizes"], memory_slack=t["memory_slack"],
                           optimizer=t["optimizer"], name_prefix=t["name_prefix"], cycle=t["cycle"], out_dir=out_dir,
                           max_lookups_per_device=t.get("max_lookups_per_device"), **t["tables"])
        log.info("%d user-style tasks -> %s", len(tasks), out_dir)
    else:
        dataset = dataset_path(cfg.dataset)
        if cfg.stage == "synthetic":
            log.info("synthetic dataset at %s", dataset)
        elif cfg.stage == "pool":
            from embshard.data.tasks import table_pool_from_dataset

            pool = table_pool_from_dataset(dataset, out_dir / "table_pool.json", hash_sizes=cfg.dataset.get("hash_sizes"))
            log.info("%d tables -> %s", len(pool), out_dir / "table_pool.json")
        elif cfg.stage == "collect":
            collect_cost_data(cfg, dataset, out_dir)
        else:
            make_tasks(cfg, dataset, out_dir)
    if _is_rank_zero():
        write_text_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        print(f"wrote {out_dir}")
    return result


def _is_rank_zero() -> bool:
    from embshard.costs.collect import rank_info  # the one reader of torchrun's environment

    return rank_info()[0] == 0


def collect_cost_data(cfg: DictConfig, dataset: Path, out_dir: Path) -> None:
    """Measure this rank's share of cost samples (resumable), then merge on rank 0."""
    from embshard.costs.collect import collect, merge

    c = OmegaConf.to_container(cfg.collect, resolve=True)
    from embshard.costs.collect import wait_for_ranks

    done = collect(c, out_dir, pool=c.get("pool") or dataset)
    log.info("rank %d: %s new chunks, %s skipped (already on disk)", done.rank, done.new_chunks, done.skipped_chunks)
    wait_for_ranks(done)  # under torchrun: every rank has finished its chunks
    if done.rank == 0:
        merged = merge(out_dir)
        log.info("merged: %s", merged)


def run_refine(cfg: DictConfig, out_dir: Path) -> None:
    """stage=refine: measure what the search proposes, re-train (embshard.costs.refine)."""
    from hydra.utils import instantiate

    from embshard.costs.refine import refine
    from embshard.data.tasks import user_tasks

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

    evaluator = instantiate(cfg.hardware)
    summary = refine(OmegaConf.to_container(r, resolve=True), cfg.cost_model, make_tasks, make_sharders, evaluator,
                     out_dir)
    log.info("refine: %d round(s), converged=%s, final models %s", len(summary["rounds"]), summary["converged"],
             summary["final"])


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
    if cfg.stage not in ("throughput", "sequence_throughput"):
        raise InputError(f"cluster=emulated runs stage=throughput or stage=sequence_throughput, not {cfg.stage}")
    if "RANK" in os.environ:
        raise InputError("cluster=emulated starts its own processes (one torchrun per emulated host): "
                         "run `python train.py ...` without torchrun")
    if c.on_unavailable not in ("loopback", "error"):
        raise InputError(f"cluster.on_unavailable must be loopback or error, got {c.on_unavailable!r}")
    if c.rate_mbit != "auto" and not isinstance(c.rate_mbit, (int, float)):
        raise InputError(f"cluster.rate_mbit must be auto or a number (Mbit/s), got {c.rate_mbit!r}")
    if cfg.stage == "sequence_throughput":
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


def run_end_to_end(cfg: DictConfig) -> float:
    """stage=dlrm / stage=throughput (dlrm/stages.py); the run writes its own config.yaml."""
    from hydra.utils import instantiate

    from dlrm.stages import run_dlrm, run_throughput

    kw = dict(
        dataset_path=partial(dataset_path, cfg.dataset),
        make_sharder=lambda name: instantiate(cfg.searchers[name]),
        known_planners=list(cfg.searchers),
        default_root=ROOT / "outputs" / "train" / cfg.stage,
    )
    return (run_dlrm if cfg.stage == "dlrm" else run_throughput)(cfg, **kw)


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


def make_tasks(cfg: DictConfig, dataset: Path, out_dir: Path) -> None:
    from embshard.data.tasks import dreamshard_tasks, neuroshard_tasks, table_pool_from_dataset

    t = cfg.task
    pool = table_pool_from_dataset(dataset, hash_sizes=cfg.dataset.get("hash_sizes"))
    common = dict(
        min_tables=t.min_tables,
        max_tables=t.max_tables,
        dims=list(t.dims),
        max_total_bytes=t.max_total_bytes,
        num_devices=t.num_devices,
        device_memory_bytes=t.device_memory_bytes,
        batch_size=t.batch_size,
        optimizer=t.optimizer,
    )
    if t.kind == "neuroshard":
        tasks = neuroshard_tasks(pool, t.num_tasks, seed=cfg.seed, out_dir=out_dir, **common)
        log.info("%d NeuroShard-style tasks -> %s", len(tasks), out_dir)
    elif t.kind == "dreamshard":
        out = dreamshard_tasks(
            pool, out_dir, num_train_tasks=t.num_train_tasks, num_test_tasks=t.num_test_tasks,
            test_fraction=t.test_fraction, seed=cfg.seed, **common,
        )
        log.info("%d train / %d test DreamShard-style tasks -> %s", len(out["train"]), len(out["test"]), out_dir)
    else:
        raise InputError(f"unknown task kind {t.kind!r}; choose neuroshard, dreamshard or user")


if __name__ == "__main__":
    main()
