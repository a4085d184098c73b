"""Sharding tasks drawn from a table pool: NeuroShard-style and DreamShard-style.

A *table pool* is a list of table dicts (every `Table` field but `dim`), usually read from
a dlrm_datasets file (`table_pool_from_dataset`), each with a trace reference so the
benchmarks replay its real indices. A task takes some pool tables, gives each a width,
and adds devices, memory and a batch size.

* NeuroShard-style (`neuroshard_tasks`): 10-60 tables per task, dims from
  {4, 8, 16, 32, 64, 128}, the tables' total weight bytes under a cap.
* DreamShard-style (`dreamshard_tasks`): the pool is first split into disjoint train and
  test halves by a seeded shuffle (`split_pool`); training tasks use only train tables,
  evaluation tasks only test tables, so evaluation is on tables never seen in training.
* User-style (`user_tasks`): no pool and no traces: tables given by rows, dim and pooling
  factor as a user would bring them (`generated_table`), with or without a reuse histogram,
  at any batch size and device count.

Table names inside a task are the pool's (`t<pool index>`): unique, and the same table
keeps its name across tasks. Everything is a function of the seed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from embshard.errors import EmbshardError, InputError
from embshard.io import write_json_atomic
from embshard.tables import DIM_ALIGNMENT, Table, _is_int
from embshard.task import Task

DIMS: tuple[int, ...] = (4, 8, 16, 32, 64, 128)
_MiB = 1 << 20
_TABLE_FIELDS = ("name", "rows", "pooling_factor", "reuse_histogram", "bytes_per_element", "trace")



# ----------------------------------------------------------------------------- pools
def table_pool_from_dataset(
    path: str | os.PathLike,
    out: str | os.PathLike | None = None,
    prefix: str = "t",
    hash_sizes: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """The table pool of a dlrm_datasets file (features + trace refs); written to `out`
    (JSON list, atomically) when given."""
    from embshard.data.dlrm_datasets import DlrmDataset, write_table_pool

    ds = DlrmDataset.open(path, hash_sizes)
    if out is not None:
        return write_table_pool(out, ds, prefix=prefix)
    return ds.pool_entries(prefix=prefix)


def load_pool(pool: Any) -> list[dict[str, Any]]:
    """A pool from a pool JSON file, a dlrm_datasets file, or a list of dicts / Tables."""
    if isinstance(pool, (str, os.PathLike)):
        p = Path(pool)
        if p.suffix == ".json":
            from embshard.data.dlrm_datasets import read_table_pool

            return read_table_pool(p)
        return table_pool_from_dataset(p)
    if not isinstance(pool, (list, tuple)) or not pool:
        raise InputError("a table pool must be a non-empty list of tables")
    out = []
    for i, e in enumerate(pool):
        if isinstance(e, Table):
            d = e.to_dict()
        elif isinstance(e, dict):
            d = dict(e)
        else:
            raise InputError(f"pool entry {i} is a {type(e).__name__}, not a table")
        d.pop("dim", None)
        Table.from_dict({**d, "dim": DIM_ALIGNMENT})  # validates
        out.append(d)
    names = [d["name"] for d in out]
    if len(set(names)) != len(names):
        raise InputError("table pool has duplicate table names")
    return out


def _make_table(entry: dict[str, Any], dim: int) -> Table:
    return Table.from_dict({k: entry[k] for k in _TABLE_FIELDS if k in entry} | {"dim": dim})


def split_pool(
    pool: Any, test_fraction: float = 0.5, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint (train, test) pools by a seeded shuffle; test gets round(fraction × size)."""
    entries = load_pool(pool)
    if not (isinstance(test_fraction, (int, float)) and 0 < test_fraction < 1):
        raise InputError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if len(entries) < 2:
        raise InputError(f"cannot split a pool of {len(entries)} table(s) into train and test")
    n_test = min(max(1, round(test_fraction * len(entries))), len(entries) - 1)
    perm = np.random.default_rng([int(seed), 0xD5]).permutation(len(entries))
    test = sorted(perm[:n_test].tolist())
    train = sorted(perm[n_test:].tolist())
    return [entries[i] for i in train], [entries[i] for i in test]


# ----------------------------------------------------------------------------- tasks
def _check_dims(dims: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(dims)
    if not dims or any(not _is_int(d) or d <= 0 or d % DIM_ALIGNMENT for d in dims):
        raise InputError(f"dims must be positive multiples of {DIM_ALIGNMENT}, got {list(dims)}")
    return tuple(sorted(set(int(d) for d in dims)))


def _pos_int(name: str, v: Any) -> int:
    if not _is_int(v) or v <= 0:
        raise InputError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def _draw_tables(
    entries: list[dict[str, Any]],
    n: int,
    dims: tuple[int, ...],
    cap: int | None,
    rng: np.random.Generator,
    attempts: int = 100,
) -> list[Table]:
    """`n` distinct pool tables with random dims, total weight bytes <= cap.

    Tables are taken in a random order, each at a random dim (a smaller one where that would
    break the cap, skipped where none fits). Where `attempts` such draws all end short of `n`
    (a tight cap and a pool of many large tables), one more draw keeps room for the rest: a
    table is taken only at a dim that leaves the cap room for the smallest of the tables not yet
    visited, so it ends with `n` whenever the `n` smallest tables fit at the smallest dim. The
    draws before it are unchanged, so tasks drawn before with the same seed stay the same."""
    def size(e: dict[str, Any], d: int) -> int:
        return int(e["rows"]) * d * int(e.get("bytes_per_element", 4))

    for _ in range(attempts):
        chosen: list[Table] = []
        used = 0
        for i in rng.permutation(len(entries)):
            e = entries[int(i)]
            d = int(rng.choice(dims))
            if cap is not None and used + size(e, d) > cap:
                smaller = [x for x in dims if x < d and used + size(e, x) <= cap]
                if not smaller:
                    continue
                d = int(rng.choice(smaller))
            chosen.append(_make_table(e, d))
            used += size(e, d)
            if len(chosen) == n:
                return chosen
    if len(entries) < n:
        raise InputError(f"cannot draw {n} tables from a pool of {len(entries)}")
    need = sum(sorted(size(e, dims[0]) for e in entries)[:n])
    if cap is not None and need > cap:
        raise InputError(
            f"cannot draw {n} tables from a pool of {len(entries)} under a total-size cap of {cap} bytes: "
            f"the {n} smallest at dim {dims[0]} take {need} bytes, {need - cap} over it")
    limit = float("inf") if cap is None else cap
    order = rng.permutation(len(entries))
    least = np.array([size(entries[int(i)], dims[0]) for i in order], dtype=np.int64)
    chosen, used = [], 0
    for pos, i in enumerate(order):
        e = entries[int(i)]
        rest = n - len(chosen) - 1          # tables still needed after this one
        after = least[pos + 1:]
        reserve = int(np.partition(after, rest - 1)[:rest].sum()) if rest > 0 else 0
        fits = [x for x in dims if used + size(e, x) + reserve <= limit]
        if not fits:
            continue
        d = int(rng.choice(dims))
        if d not in fits:
            d = int(rng.choice(fits))
        chosen.append(_make_table(e, d))
        used += size(e, d)
        if len(chosen) == n:
            return chosen
    raise AssertionError("unreachable: the reserve keeps room for the rest")  # pragma: no cover


def _device_memory(tables: list[Table], num_devices: int, batch_size: int, optimizer: str,
                   slack: float) -> int:
    """Enough memory for the tables spread over the devices with `slack`, and for the
    largest table on one device; rounded up to MiB."""
    probe = Task("probe", num_devices, 1, batch_size, tuple(tables), optimizer=optimizer)
    mem = [probe.table_memory_bytes(t) for t in tables]
    need = max(slack * sum(mem) / num_devices, 1.05 * max(mem))
    return int(math.ceil(need / _MiB) * _MiB)


def generated_table(name: str, batch_size: int, rng: np.random.Generator, *, dims: Sequence[int] = DIMS,
                    min_rows: int = 100, max_rows: int = 5_000_000, min_pooling: float = 1.0,
                    max_pooling: float = 200.0, onehot_share: float = 0.15, histogram_share: float = 0.5) -> Table:
    """A table like those users bring, given by rows, dim and pooling factor: rows
    log-uniform in [min_rows, max_rows]; a one-hot pooling factor in (0.5, 1] with probability
    `onehot_share`, else log-uniform in [min_pooling, max_pooling]; a dim from `dims`. With
    probability `histogram_share` it carries the reuse histogram the synthetic model expects at
    `batch_size` for a Zipf exponent drawn like the calibrated mixture's (its mean for the
    rows plus per-table noise); otherwise none (cost models impute one; kernels draw from the
    same law)."""
    from embshard.data import synthetic as syn

    rows = int(round(math.exp(rng.uniform(math.log(min_rows), math.log(max_rows)))))
    if rng.random() < onehot_share:
        pf = float(rng.uniform(0.5, 1.0))
    else:
        pf = float(math.exp(rng.uniform(math.log(min_pooling), math.log(max_pooling))))
    dim = int(rng.choice(np.asarray(dims)))
    hist = None
    if rng.random() < histogram_share:
        zipf = float(np.clip(syn.expected_zipf(rows) + syn.DEFAULT_PARAMS.zipf_std * rng.standard_normal(), 0.0, 3.0))
        bins, _ = syn.expected_table_bins(rows, zipf, syn.DEFAULT_Q, pf * batch_size, ratio=1.15)
        if bins.sum() > 0:
            hist = tuple(round(float(x), 6) for x in bins / bins.sum())
    return Table(name, rows, dim, round(pf, 4), hist)


def user_tasks(
    num_tasks: int,
    *,
    seed: int = 0,
    min_tables: int = 20,
    max_tables: int = 40,
    num_devices: int | Sequence[int] = (2, 4, 8),
    batch_sizes: Sequence[int] = (8192, 16384),
    memory_slack: float | Sequence[float] = 1.5,
    optimizer: str = "sgd",
    name_prefix: str = "user",
    out_dir: str | os.PathLike | None = None,
    cycle: bool = False,
    max_lookups_per_device: float | None = None,
    **table_distribution: Any,
) -> list[Task]:
    """Tasks of generated tables (`generated_table`; `table_distribution` are its keyword
    arguments): a uniform number of tables in [min_tables, max_tables], a device count and a
    batch size drawn per task (`cycle`: taken in turn instead, every combination equally often), device memory `memory_slack` × an even share of the task's
    training memory (at least 1.05 × its largest table; a [low, high] slack is drawn per task).
    Every table name is unique (`<task>-t<i>`). `max_lookups_per_device`: a task whose lookups
    per step (Σ pooling factor × batch) exceed this × its devices is drawn again (keeps the
    measuring time of a plan bounded)."""
    num_tasks = _pos_int("num_tasks", num_tasks)
    min_tables, max_tables = _pos_int("min_tables", min_tables), _pos_int("max_tables", max_tables)
    if min_tables > max_tables:
        raise InputError(f"min_tables ({min_tables}) > max_tables ({max_tables})")
    devices = [num_devices] if _is_int(num_devices) else list(num_devices)
    batches = [batch_sizes] if _is_int(batch_sizes) else list(batch_sizes)
    if not devices or not batches:
        raise InputError("num_devices and batch_sizes must be non-empty")
    devices = [_pos_int("num_devices", d) for d in devices]
    batches = [_pos_int("batch_sizes", b) for b in batches]
    slack = [memory_slack] * 2 if isinstance(memory_slack, (int, float)) else list(memory_slack)
    if len(slack) != 2 or not 0 < slack[0] <= slack[1]:
        raise InputError(f"memory_slack must be > 0 or [low, high], got {memory_slack!r}")
    if "dims" in table_distribution:
        table_distribution["dims"] = _check_dims(table_distribution["dims"])
    rng = np.random.default_rng([int(seed), 0x05E4])
    tasks = []
    for i in range(num_tasks):
        name = f"{name_prefix}-{i:04d}"
        for _ in range(100):
            n = int(rng.integers(min_tables, max_tables + 1))
            batch = int(batches[(i // len(devices)) % len(batches)] if cycle else rng.choice(batches))
            tables = [generated_table(f"{name}-t{k}", batch, rng, **table_distribution) for k in range(n)]
            d = int(devices[i % len(devices)] if cycle else rng.choice(devices))
            lookups = sum(t.pooling_factor for t in tables) * batch
            if max_lookups_per_device is None or lookups <= max_lookups_per_device * d:
                break
        else:
            raise InputError(f"user_tasks: no task within max_lookups_per_device={max_lookups_per_device} in 100 draws")
        mem = _device_memory(tables, d, batch, optimizer, float(rng.uniform(*slack)))
        tasks.append(Task(name=name, num_devices=d, device_memory_bytes=mem, batch_size=batch,
                          tables=tuple(tables), optimizer=optimizer))
    if out_dir is not None:
        write_tasks(tasks, out_dir)
    return tasks


def neuroshard_tasks(
    pool: Any,
    num_tasks: int,
    *,
    min_tables: int = 10,
    max_tables: int = 60,
    dims: Sequence[int] = DIMS,
    max_total_bytes: int | None = None,
    num_devices: int | Sequence[int] = 4,
    device_memory_bytes: int | None = None,
    batch_size: int = 65536,
    optimizer: str = "sgd",
    memory_slack: float = 1.5,
    seed: int = 0,
    name_prefix: str = "neuroshard",
    out_dir: str | os.PathLike | None = None,
) -> list[Task]:
    """NeuroShard-style tasks: per task, a uniform number of tables in
    [min_tables, max_tables] drawn without replacement from the pool, each with a dim drawn
    from `dims`, total weight bytes <= `max_total_bytes` (None: no cap).

    Args:
        num_devices: an int, or a list to draw from per task.
        device_memory_bytes: per device; None: `memory_slack` × the task's training memory
            spread evenly (and at least 1.05 × its largest table), rounded up to MiB.
        out_dir: when given, every task is written to `out_dir/<name>.json`.
    """
    entries = load_pool(pool)
    num_tasks = _pos_int("num_tasks", num_tasks)
    min_tables = _pos_int("min_tables", min_tables)
    max_tables = _pos_int("max_tables", max_tables)
    batch_size = _pos_int("batch_size", batch_size)
    if min_tables > max_tables:
        raise InputError(f"min_tables ({min_tables}) > max_tables ({max_tables})")
    if min_tables > len(entries):
        raise InputError(f"min_tables ({min_tables}) exceeds the pool's {len(entries)} tables")
    dims = _check_dims(dims)
    if max_total_bytes is not None:
        max_total_bytes = _pos_int("max_total_bytes", max_total_bytes)
    if device_memory_bytes is not None:
        device_memory_bytes = _pos_int("device_memory_bytes", device_memory_bytes)
    devices = [num_devices] if _is_int(num_devices) else list(num_devices)
    if not devices:
        raise InputError("num_devices must be a positive integer or a non-empty list of them")
    devices = [_pos_int("num_devices", d) for d in devices]
    if not (isinstance(memory_slack, (int, float)) and memory_slack > 0):
        raise InputError(f"memory_slack must be > 0, got {memory_slack!r}")

    rng = np.random.default_rng([int(seed), 0x4E5])
    tasks = []
    for i in range(num_tasks):
        n = int(rng.integers(min_tables, min(max_tables, len(entries)) + 1))
        tables = _draw_tables(entries, n, dims, max_total_bytes, rng)
        D = int(rng.choice(devices))
        mem = device_memory_bytes or _device_memory(tables, D, batch_size, optimizer, memory_slack)
        tasks.append(Task(
            name=f"{name_prefix}-{i:04d}",
            num_devices=D,
            device_memory_bytes=mem,
            batch_size=batch_size,
            tables=tuple(tables),
            optimizer=optimizer,
        ))
    if out_dir is not None:
        write_tasks(tasks, out_dir)
    return tasks


def planning_bench_tasks(num_tables: int, num_devices: int, data_dir: str | os.PathLike, *, trace_batch: int = 512,
                         seed: int = 0) -> tuple[Task, Task]:
    """The planning benchmarks' (task, warm-up task): every table of a `num_tables`-table
    synthetic pool (generated into `data_dir` once, then reused) on `num_devices` devices at
    batch 65536, and a 10-table, 2-device task of the same pool to warm a planner up."""
    from embshard.data.synthetic import generate_synthetic

    data = Path(data_dir) / f"synthetic_t{num_tables}_bs{trace_batch}_s{seed}.pt"
    if not data.is_file():
        print(f"generating {data} ...", flush=True)
        generate_synthetic(data, num_tables=num_tables, batch_size=trace_batch, seed=seed)
    pool = table_pool_from_dataset(data)
    if len(pool) < num_tables:
        raise InputError(f"pool {data} has {len(pool)} tables, need {num_tables}")
    (task,) = neuroshard_tasks(pool, 1, min_tables=num_tables, max_tables=num_tables, num_devices=num_devices,
                               batch_size=65536, seed=seed, name_prefix=f"bench{num_tables}x{num_devices}")
    (warm,) = neuroshard_tasks(pool, 1, min_tables=10, max_tables=10, num_devices=2, seed=seed, name_prefix="warm")
    return task, warm


def dreamshard_tasks(
    pool: Any,
    out_dir: str | os.PathLike | None = None,
    *,
    num_train_tasks: int = 50,
    num_test_tasks: int = 50,
    test_fraction: float = 0.5,
    seed: int = 0,
    **task_kwargs: Any,
) -> dict[str, Any]:
    """DreamShard-style tasks: train tasks from the train half of the pool, test tasks from
    the disjoint test half.

    Writes (when `out_dir` is given) `out_dir/train/*.json`, `out_dir/test/*.json` and
    `out_dir/split.json` ({"seed", "test_fraction", "train": [names], "test": [names]}).
    `task_kwargs` go to `neuroshard_tasks` (min_tables, max_tables, dims, max_total_bytes,
    num_devices, device_memory_bytes, batch_size, optimizer, memory_slack).

    Returns:
        {"train": [Task], "test": [Task], "split": {...}}
    """
    for k in ("out_dir", "name_prefix", "num_tasks", "pool"):
        if k in task_kwargs:
            raise InputError(f"dreamshard_tasks: {k!r} is set by dreamshard_tasks itself")
    train_pool, test_pool = split_pool(pool, test_fraction, seed)
    split = {
        "seed": int(seed),
        "test_fraction": float(test_fraction),
        "train": [e["name"] for e in train_pool],
        "test": [e["name"] for e in test_pool],
    }
    out = {
        "train": neuroshard_tasks(train_pool, num_train_tasks, seed=int(seed) * 2 + 1,
                                  name_prefix="dreamshard-train", **task_kwargs),
        "test": neuroshard_tasks(test_pool, num_test_tasks, seed=int(seed) * 2 + 2,
                                 name_prefix="dreamshard-test", **task_kwargs),
        "split": split,
    }
    if out_dir is not None:
        out_dir = Path(out_dir)
        write_tasks(out["train"], out_dir / "train")
        write_tasks(out["test"], out_dir / "test")
        write_json_atomic(out_dir / "split.json", split)
    return out


def without_histograms(task: Task) -> Task:
    """`task` as a user describes it: tables by rows, dim and pooling factor only, no reuse
    histogram and no trace (the evaluator then draws indices from the calibrated synthetic law)."""
    return replace(task, tables=tuple(replace(t, reuse_histogram=None, trace=None) for t in task.tables))


def write_tasks(tasks: Sequence[Task], out_dir: str | os.PathLike) -> list[Path]:
    """Each task to `out_dir/<name>.json` (atomic per file)."""
    out_dir = Path(out_dir)
    paths = []
    for t in tasks:
        p = out_dir / f"{t.name}.json"
        t.save(p)
        paths.append(p)
    return paths


# ----------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embshard.data.tasks", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("pool", help="table pool JSON from a dlrm_datasets file")
    p.add_argument("dataset")
    p.add_argument("--out", required=True)
    p.add_argument("--prefix", default="t")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--pool", required=True, help="pool JSON, or a dlrm_datasets file")
        q.add_argument("--out", required=True, help="output folder")
        q.add_argument("--min-tables", type=int, default=10)
        q.add_argument("--max-tables", type=int, default=60)
        q.add_argument("--dims", type=int, nargs="+", default=list(DIMS))
        q.add_argument("--max-total-bytes", type=int, default=None)
        q.add_argument("--num-devices", type=int, nargs="+", default=[4])
        q.add_argument("--device-memory-bytes", type=int, default=None)
        q.add_argument("--batch-size", type=int, default=65536)
        q.add_argument("--optimizer", default="sgd")
        q.add_argument("--seed", type=int, default=0)

    n = sub.add_parser("neuroshard", help="NeuroShard-style tasks")
    common(n)
    n.add_argument("--num-tasks", type=int, default=100)
    d = sub.add_parser("dreamshard", help="DreamShard-style train/test tasks on a disjoint split")
    common(d)
    d.add_argument("--num-train", type=int, default=50)
    d.add_argument("--num-test", type=int, default=50)
    d.add_argument("--test-fraction", type=float, default=0.5)
    args = ap.parse_args(argv)

    try:
        if args.cmd == "pool":
            entries = table_pool_from_dataset(args.dataset, out=args.out, prefix=args.prefix)
            print(f"wrote {args.out}: {len(entries)} tables")
            return 0
        kw = dict(
            min_tables=args.min_tables, max_tables=args.max_tables, dims=args.dims,
            max_total_bytes=args.max_total_bytes, num_devices=args.num_devices,
            device_memory_bytes=args.device_memory_bytes, batch_size=args.batch_size,
            optimizer=args.optimizer,
        )
        if args.cmd == "neuroshard":
            tasks = neuroshard_tasks(args.pool, args.num_tasks, seed=args.seed, out_dir=args.out, **kw)
            print(f"wrote {len(tasks)} tasks to {args.out}")
        else:
            out = dreamshard_tasks(args.pool, args.out, num_train_tasks=args.num_train,
                                   num_test_tasks=args.num_test, test_fraction=args.test_fraction,
                                   seed=args.seed, **kw)
            print(f"wrote {len(out['train'])} train and {len(out['test'])} test tasks to {args.out} "
                  f"({len(out['split']['train'])}/{len(out['split']['test'])} tables)")
    except EmbshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
