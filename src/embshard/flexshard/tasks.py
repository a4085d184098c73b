"""Sequence-feature traces and tasks: the synthetic generator with sequence lengths, and a
task of sequence tables over a two-tier topology whose memory cap is a factor of what
TorchRec's row-wise layout needs (so every baseline and FlexShard get the same cap)."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

from embshard.data.synthetic import DEFAULT_PARAMS, generate_synthetic
from embshard.errors import InputError
from embshard.tables import Table, _is_int
from embshard.task import Task


def sequence_trace(path: str | os.PathLike, num_tables: int, samples: int, mean_length: float,
                   zipf_mean: float | None = None, seed: int = 0) -> Path:
    """Write (once) a dlrm_datasets-format trace of `num_tables` sequence features: the
    calibrated generator (embshard.data.synthetic) with every table multi-hot, sequence
    lengths negative-binomial with mean `mean_length`, and popularity either calibrated to
    Meta's dataset (`zipf_mean` None) or with the per-table Zipf exponents centred on `zipf_mean`."""
    path = Path(path)
    if not path.is_file():
        params = replace(DEFAULT_PARAMS, pooling_factor=float(mean_length), onehot_fraction=0.0, small_onehot_fraction=0.0)
        if zipf_mean is not None:
            params = replace(params, zipf_mean=float(zipf_mean))
        generate_synthetic(path, num_tables=num_tables, batch_size=samples, seed=seed, params=params)
    return path


def sequence_task(trace: str | os.PathLike, name: str, dim: int, hosts: int, devices_per_host: int, batch_size: int,
                  memory_factor: float, max_tables: int | None = None, max_rows: int | None = None,
                  optimizer: str = "sgd") -> Task:
    """The trace's tables (at most `max_tables`, each with at most `max_rows` rows) as sequence
    tables of width `dim`, each referencing its trace; memory per device = `memory_factor` x
    the fullest device of the row-wise plan."""
    from embshard.data.dlrm_datasets import DlrmDataset
    from embshard.flexshard.baselines import RowWiseSharder

    if not (isinstance(memory_factor, (int, float)) and math.isfinite(memory_factor) and memory_factor >= 1.0):
        raise InputError(f"memory_factor must be a number >= 1, got {memory_factor!r}")
    if not _is_int(hosts) or not _is_int(devices_per_host) or hosts <= 0 or devices_per_host <= 0:
        raise InputError(f"hosts and devices_per_host must be positive integers, got {hosts!r}, {devices_per_host!r}")
    entries = [e for e in DlrmDataset.open(trace).pool_entries() if max_rows is None or e["rows"] <= max_rows]
    entries = entries[:max_tables] if max_tables else entries
    if not entries:
        raise InputError(f"{trace}: no table with at most {max_rows} rows")
    tables = tuple(Table.from_dict({**e, "dim": dim, "kind": "sequence"}) for e in entries)
    probe = Task(name, hosts * devices_per_host, 1 << 62, batch_size, tables, optimizer, devices_per_host, hosts)
    need = max(RowWiseSharder().shard(probe).memory_bytes(probe))
    return Task(name, probe.num_devices, math.ceil(memory_factor * need), batch_size, tables, optimizer,
                devices_per_host, hosts)
