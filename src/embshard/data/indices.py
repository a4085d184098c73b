"""Index batches for one table: replayed from its trace, or drawn to match its features.

`batch_indices` is what the hardware benchmarks and the DLRM data loader call; it returns
FBGEMM's (indices, offsets) layout for one table and one batch.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from embshard.data import synthetic as syn
from embshard.errors import InputError
from embshard.tables import Table, _is_int


def batch_indices(
    table: Table, batch_size: int, rng: np.random.Generator, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of bags for `table`: (indices int64 [N], offsets int64 [batch_size + 1]).

    Args:
        table: the table. With a trace, `batch_size` bags are sampled (uniformly, with
            replacement, fresh per call) from the trace's bags and replayed as they are.
            Without one, bag lengths follow the pooling factor (Bernoulli for one-hot
            tables with pooling factor <= 1, negative binomial otherwise) and rows follow
            the generator's popularity law (`embshard.data.synthetic`), with the Zipf
            exponent fitted so the expected reuse histogram at `batch_size` matches
            `table.reuse_histogram` (the calibrated mean exponent when it has none). Hot
            rows sit at ids fixed per table (a permutation seeded by zlib.crc32 of the name).
        batch_size: number of bags.
        rng: source of randomness; a fresh draw per call, never one warm batch replayed.
        rows: restrict indices to [0, rows) (for row-wise shards) by taking them modulo
            `rows`; defaults to table.rows.
    """
    if not _is_int(batch_size) or batch_size <= 0:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    mod = table.rows if rows is None else rows
    if not _is_int(mod) or mod <= 0:
        raise InputError(f"rows must be a positive integer, got {rows!r}")
    if table.trace is not None:
        indices, offsets = _replay(table, batch_size, rng)
    else:
        indices, offsets = _draw(table, batch_size, rng)
    if indices.size and int(indices.max()) >= mod:
        np.remainder(indices, mod, out=indices)
    return torch.from_numpy(indices), torch.from_numpy(offsets)


def _replay(table: Table, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    from embshard.data.dlrm_datasets import load_trace  # lazy: keeps torch.load out of imports

    idx_t, off_t = load_trace(table.trace)
    idx, off = idx_t.numpy(), off_t.numpy()
    bags = rng.integers(0, off.size - 1, size=batch_size)
    starts = off[bags]
    lengths = off[bags + 1] - starts
    offsets = np.zeros(batch_size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(total, dtype=np.int64)
    return idx[positions].astype(np.int64, copy=False), offsets


@lru_cache(maxsize=4096)
def _zipf_for(rows: int, pooling_factor: float, batch_size: int, hist: tuple[float, ...] | None) -> float:
    return syn.fit_zipf(rows, pooling_factor, batch_size, hist)


def _draw(table: Table, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    s = _zipf_for(table.rows, table.pooling_factor, batch_size, table.reuse_histogram)
    spec = syn.TableSpec(
        rows=table.rows,
        pooling_factor=table.pooling_factor,
        zipf=s,
        q=syn.DEFAULT_Q,
        seed=syn.table_seed(table.name),
    )
    lengths, indices = syn.table_trace(spec, batch_size, rng)
    offsets = np.zeros(batch_size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return indices, offsets
