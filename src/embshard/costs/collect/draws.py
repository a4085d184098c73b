"""What a collection measures: the table pool, random shards of it, random all-to-all widths and delays.

Chunk c of a kind draws from the seed [seed, kind code, c], so a collection's inputs do not depend on how many
ranks ran it.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import numpy as np

from embshard.errors import InputError
from embshard.plan import Shard
from embshard.tables import DIM_ALIGNMENT, Table

log = logging.getLogger("embshard.costs.collect")

_KIND_CODE = {"compute": 0xC0, "comm": 0xC1}


def select_pool(entries: list[dict[str, Any]], tables: Sequence[str] | None = None,
                exclude_tables: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The pool entries named in `tables` (all when None), less `exclude_tables`."""
    names = {e["name"] for e in entries}
    for key, wanted in (("tables", tables or ()), ("exclude_tables", exclude_tables or ())):
        unknown = sorted(set(wanted) - names)
        if unknown:
            raise InputError(f"collect.{key}: {len(unknown)} name(s) not in the pool, e.g. {unknown[:5]}")
    keep = set(tables) if tables is not None else names
    keep -= set(exclude_tables or ())
    out = [e for e in entries if e["name"] in keep]
    if not out:
        raise InputError("collect: no pool tables left after `tables` / `exclude_tables`")
    return out


def table_dims(dims: Sequence[int], column_halves: bool = True) -> list[int]:
    """The dim set, plus d/2 for every d whose half is still a multiple of 4."""
    out = set(int(d) for d in dims)
    if column_halves:
        out |= {d // 2 for d in dims if d % 2 == 0 and (d // 2) % DIM_ALIGNMENT == 0}
    return sorted(out)


def augmented_pool(pool: Any, dims: Sequence[int] = (4, 8, 16, 32, 64, 128), column_halves: bool = True,
                   tables: Sequence[str] | None = None, exclude_tables: Sequence[str] = ()) -> list[Table]:
    """Every (selected) pool table at every dim of `table_dims(dims, column_halves)`.

    The tables keep their pool names (and trace references, so kernels replay real indices).
    """
    from embshard.data.tasks import load_pool

    entries = select_pool(load_pool(pool), tables, exclude_tables)
    ds = table_dims(dims, column_halves)
    return [_table(e, d) for e in entries for d in ds]


def _table(entry: dict[str, Any], dim: int) -> Table:
    keys = ("name", "rows", "pooling_factor", "reuse_histogram", "bytes_per_element", "trace")
    return Table.from_dict({k: entry[k] for k in keys if k in entry} | {"dim": int(dim)})


def _split(entries: list[dict[str, Any]], holdout: Mapping[str, Any]) -> tuple[list, list]:
    """(train entries, test entries): a seeded table split when holdout.fraction > 0."""
    if holdout["fraction"] <= 0:
        return entries, []
    from embshard.data.tasks import split_pool

    return split_pool(entries, holdout["fraction"], holdout["seed"])


# ----------------------------------------------------------------------------- draws
def draw_compute_shard(entries: Sequence[dict[str, Any]], dims: Sequence[int], n: int, max_bytes: int,
                       pair_prob: float, rng: np.random.Generator, *, batch_size: int = 4096,
                       generated: Mapping[str, Any] | None = None, pool_share: float = 1.0,
                       row_piece_prob: float = 0.0, row_parts: Sequence[int] = (2, 4, 8, 16),
                       max_lookups: float | None = None, prefix: str = "g") -> list[tuple[Table, "Shard"]]:
    """Up to `n` pieces of distinct tables for one kernel: (table, shard) pairs.

    Each table comes from the pool (`entries`, with probability `pool_share`) or is
    `embshard.data.tasks.generated_table` (`generated`: its distribution). A table enters whole, or with probability `pair_prob` as both column
    halves (a device holding both halves of a column split), or with probability
    `row_piece_prob` as one row block of TorchRec's even layout over k ranks (k from
    `row_parts`; the block serves only the lookups that fall in its rows). The pieces'
    weight bytes stay <= `max_bytes` and their lookups per step (pooling factor × rows share
    × batch) <= `max_lookups`. At least one piece when any fits.
    """
    from embshard.data.tasks import generated_table
    from embshard.plan import Shard, even_row_layout

    chosen: list[tuple[Table, Shard]] = []
    used = 0
    work = 0.0
    order = iter(rng.permutation(len(entries)).tolist()) if len(entries) else iter(())
    for attempt in range(4 * n + 20):
        if len(chosen) >= n:
            break
        if entries and (generated is None or rng.random() < pool_share):
            i = next(order, None)
            if i is None:
                if generated is None:
                    break
                continue
            e = entries[int(i)]
            bpe = int(e.get("bytes_per_element", 4))
            fits = [d for d in dims if used + e["rows"] * d * bpe <= max_bytes]
            if not fits:
                continue
            d = int(rng.choice(dims))
            if d not in fits:
                d = int(rng.choice(fits))
            table = _table(e, d)
        else:
            table = generated_table(f"{prefix}{attempt}", batch_size, rng, dims=dims, **(generated or {}))
        rows, row_off, share = table.rows, 0, 1.0
        halves = (len(chosen) + 2 <= n and table.dim % 2 == 0 and (table.dim // 2) % DIM_ALIGNMENT == 0
                  and rng.random() < pair_prob)
        if not halves and row_piece_prob > 0 and rng.random() < row_piece_prob:
            k = int(rng.choice(np.asarray(row_parts)))
            blocks = [(off, size) for off, size in even_row_layout(table.rows, k) if size > 0]
            row_off, rows = blocks[int(rng.integers(len(blocks)))]
            share = rows / table.rows
        nbytes = rows * table.dim * table.bytes_per_element
        lookups = table.pooling_factor * share * batch_size
        if used + nbytes > max_bytes or (max_lookups is not None and chosen and work + lookups > max_lookups):
            continue
        if halves:
            h = table.dim // 2
            chosen += [(table, Shard(table.name, 0, 0, h, 0, rows)), (table, Shard(table.name, 0, h, h, 0, rows))]
        else:
            chosen.append((table, Shard(table.name, 0, 0, table.dim, row_off, rows)))
        used += nbytes
        work += lookups
    return chosen


def draw_widths(num_devices: int, dims: Sequence[int], tables_per_device: Sequence[float],
                rng: np.random.Generator, max_width: int | None = None) -> list[int]:
    """Per-device width sums of a random table placement.

    round(U(tables_per_device) × D) tables with random dims, placed in descending dim order;
    with probability `alpha` (drawn once, uniform in [0, 1]) a table goes to the device
    with the smallest width so far (balanced), otherwise to a random device. A table that
    would take a device past `max_width` is left out.
    """
    n = max(1, int(round(rng.uniform(*tables_per_device) * num_devices)))
    ds = np.sort(rng.choice(np.asarray(dims), size=n))[::-1]
    alpha = rng.random()
    widths = np.zeros(num_devices, dtype=np.int64)
    for d in ds:
        dev = int(np.argmin(widths)) if rng.random() < alpha else int(rng.integers(num_devices))
        if max_width is not None and widths[dev] + d > max_width:
            continue
        widths[dev] += int(d)
    if not widths.any():
        widths[0] = int(min(dims))
    return [int(w) for w in widths]


def draw_delays(num_devices: int, max_delay_ms: float, rng: np.random.Generator) -> list[float]:
    """Uniform per-device delays in [0, max), shifted so the smallest is 0 (as a plan's are:
    compute time less the fastest device's), rounded to µs."""
    x = rng.uniform(0.0, max_delay_ms, size=num_devices)
    return [round(float(v), 3) for v in x - x.min()]


def _chunk_rng(seed: int, kind: str, chunk: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), _KIND_CODE[kind], int(chunk)])


def _measure_seed(seed: int, kind: str, chunk: int) -> int:
    return int(_chunk_rng(seed, kind, chunk).integers(0, 2**31 - 1)) ^ 0x5EED
