"""The embedded default workload of `shard.py` with no task_file: a small synthetic
dlrm_datasets-format file (cached under data/) and NeuroShard-style tasks drawn from it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

from embshard.task import Task

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[3]


def build_default_tasks(cfg: Mapping[str, Any], tasks_dir: str | Path, seed: int = 0) -> list[Task]:
    """Generate (or reuse) the synthetic trace file, then write and return the tasks.

    Args:
        cfg: the `default_tasks` block of conf/shard.yaml.
        tasks_dir: where the task JSON files go (beside the run's other outputs).
        seed: seeds both the synthetic data and the task draw.
    """
    from embshard.data.synthetic import generate_synthetic
    from embshard.data.tasks import neuroshard_tasks, table_pool_from_dataset

    data = ROOT / "data" / f"synthetic_t{cfg['num_tables_in_pool']}_bs{cfg['trace_batch_size']}_s{seed}.pt"
    if not data.is_file():
        log.info("generating %s", data)
        generate_synthetic(data, num_tables=cfg["num_tables_in_pool"], batch_size=cfg["trace_batch_size"], seed=seed)
    pool = table_pool_from_dataset(data)
    return neuroshard_tasks(
        pool,
        cfg["num_tasks"],
        min_tables=cfg["min_tables"],
        max_tables=cfg["max_tables"],
        max_total_bytes=cfg["max_total_bytes"],
        num_devices=cfg["num_devices"],
        device_memory_bytes=cfg["device_memory_bytes"],
        batch_size=cfg["batch_size"],
        seed=seed,
        name_prefix="default",
        out_dir=tasks_dir,
    )
