"""Sequence-feature traces and tasks: the synthetic generator with sequence lengths, a task
of sequence tables over a two-tier topology whose memory cap is a factor of what TorchRec's
row-wise layout needs (so every baseline and FlexShard get the same cap), and a held-out
family of such tasks unlike the documented two (`HeldoutFamily`)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from embshard.data.synthetic import DEFAULT_PARAMS, DEFAULT_Q, generate_synthetic, rank_to_row, sample_ranks
from embshard.errors import InputError
from embshard.io import atomic_path
from embshard.tables import Table, TraceRef, _is_int
from embshard.task import MAX_DEVICE_MEMORY_BYTES, Task


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

    if not (isinstance(memory_factor, (int, float)) and math.isfinite(memory_factor) and memory_factor >= 1.0):
        raise InputError(f"memory_factor must be a number >= 1, got {memory_factor!r}")
    if not _is_int(hosts) or not _is_int(devices_per_host) or hosts <= 0 or devices_per_host <= 0:
        raise InputError(f"hosts and devices_per_host must be positive integers, got {hosts!r}, {devices_per_host!r}")
    entries = [e for e in DlrmDataset.open(trace).pool_entries() if max_rows is None or e["rows"] <= max_rows]
    entries = entries[:max_tables] if max_tables else entries
    if not entries:
        raise InputError(f"{trace}: no table with at most {max_rows} rows")
    tables = tuple(Table.from_dict({**e, "dim": dim, "kind": "sequence"}) for e in entries)
    return capped_task(name, tables, hosts, devices_per_host, batch_size, memory_factor, optimizer)


def capped_task(name: str, tables: tuple[Table, ...], hosts: int, devices_per_host: int, batch_size: int,
                memory_factor: float, optimizer: str = "sgd") -> Task:
    """The task whose memory per device is `memory_factor` x what row_wise needs on its fullest device."""
    from embshard.flexshard.baselines import RowWiseSharder

    probe = Task(name, hosts * devices_per_host, MAX_DEVICE_MEMORY_BYTES, batch_size, tables, optimizer, devices_per_host, hosts)
    need = max(RowWiseSharder().shard(probe).memory_bytes(probe))
    return Task(name, probe.num_devices, math.ceil(memory_factor * need), batch_size, tables, optimizer,
                devices_per_host, hosts)


@dataclass(frozen=True)
class HeldoutFamily:
    """The held-out sequence tasks: every task draws its topology, tables, popularity and
    sequence lengths from these ranges, far from the documented two (24 tables of <= 3.5 M
    rows, width 64, 2 hosts x 8, batch 16,384, sequences of about 30, Zipf 0.42 or 1.0).

    Per table: rows log-uniform in 10^log10_rows, a Zipf-Mandelbrot popularity with exponent
    uniform in `zipf` (hot ranks scattered over the row ids), sequence lengths Gamma-Poisson
    with a mean uniform in `mean_length`, a width from `dims`. Per task: hosts and devices per
    host uniform in their ranges, a batch from `batch_sizes`, halved while a step would hold
    more than `max_ids_per_step` ids (traces are written to disk: fit + eval steps of them),
    memory cap `memory_factor` x row_wise's need, TorchRec's default bandwidths.
    """

    hosts: tuple[int, int] = (2, 4)
    devices_per_host: tuple[int, int] = (4, 8)
    tables: tuple[int, int] = (6, 10)
    log10_rows: tuple[float, float] = (3.0, 8.0)
    zipf: tuple[float, float] = (0.6, 1.4)
    mean_length: tuple[float, float] = (10.0, 200.0)
    dims: tuple[int, ...] = (16, 32, 64, 128)
    batch_sizes: tuple[int, ...] = (2048, 4096, 8192)
    max_ids_per_step: int = 4_000_000
    memory_factor: float = 1.25
    steps: int = 6  # fit + held-out steps in each trace
    nb_shape: float = DEFAULT_PARAMS.nb_shape

    def to_dict(self) -> dict:
        return asdict(self)


def heldout_draw(family: HeldoutFamily, index: int, seed: int) -> dict:
    """What task `index` of the family draws (a pure function of (seed, index)): hosts, devices
    per host, batch, and per table rows, Zipf exponent, mean sequence length, width, seed."""
    rng = np.random.default_rng([int(seed), int(index), 0x4E1D])
    hosts = int(rng.integers(family.hosts[0], family.hosts[1] + 1))
    per_host = int(rng.integers(family.devices_per_host[0], family.devices_per_host[1] + 1))
    n = int(rng.integers(family.tables[0], family.tables[1] + 1))
    rows = np.round(10.0 ** rng.uniform(*family.log10_rows, size=n)).astype(np.int64)
    zipf = rng.uniform(*family.zipf, size=n)
    lengths_mean = rng.uniform(*family.mean_length, size=n)
    dims = rng.choice(np.asarray(family.dims), size=n)
    batch = int(rng.choice(np.asarray(family.batch_sizes)))
    while batch > 256 and batch * lengths_mean.sum() > family.max_ids_per_step:
        batch //= 2
    seeds = rng.integers(0, 2**31 - 1, size=n)
    return {"hosts": hosts, "devices_per_host": per_host, "batch_size": batch, "rows": rows.tolist(),
            "zipf": zipf.tolist(), "mean_length": lengths_mean.tolist(), "dims": dims.tolist(), "seeds": seeds.tolist()}


def heldout_task(family: HeldoutFamily, index: int, seed: int, out_dir: str | os.PathLike) -> Task:
    """Task `index` of the family (`heldout_draw`); its trace is written to
    `out_dir/traces/heldout_<seed>_<index>.pt` (once; atomically)."""
    d = heldout_draw(family, index, seed)
    hosts, per_host, batch = d["hosts"], d["devices_per_host"], d["batch_size"]
    rows, zipf, lengths_mean = np.array(d["rows"]), np.array(d["zipf"]), np.array(d["mean_length"])
    dims, seeds, n = np.array(d["dims"]), np.array(d["seeds"]), len(d["rows"])
    samples = batch * family.steps
    name = f"heldout_{seed}_{index}"
    path = Path(out_dir) / "traces" / f"{name}.pt"
    all_lengths = np.empty((n, samples), dtype=np.int64)
    table_rngs = [np.random.default_rng([int(seed), int(index), t]) for t in range(n)]
    for t in range(n):
        lam = table_rngs[t].gamma(family.nb_shape, lengths_mean[t] / family.nb_shape, size=samples)
        all_lengths[t] = table_rngs[t].poisson(lam)
    if not path.is_file():
        import torch

        offsets = np.zeros(n * samples + 1, dtype=np.int64)
        np.cumsum(all_lengths.reshape(-1), out=offsets[1:])
        indices = np.empty(int(offsets[-1]), dtype=np.int64)
        for t in range(n):
            a, b = offsets[t * samples], offsets[(t + 1) * samples]
            ranks = sample_ranks(int(b - a), int(rows[t]), float(zipf[t]), DEFAULT_Q, table_rngs[t])
            indices[a:b] = rank_to_row(ranks, int(rows[t]), int(seeds[t]))
        with atomic_path(path) as tmp:
            torch.save((torch.from_numpy(indices), torch.from_numpy(offsets), torch.from_numpy(all_lengths)), tmp)
    tables = tuple(
        Table(f"h{t}", int(rows[t]), int(dims[t]), round(float(all_lengths[t].mean()), 4),
              trace=TraceRef(str(path.resolve()), t), kind="sequence")
        for t in range(n)
    )
    return capped_task(name, tables, hosts, per_host, batch, family.memory_factor)
