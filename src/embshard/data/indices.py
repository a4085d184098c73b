"""Index batches for one table: replayed from its trace, or drawn to match its features.

`batch_indices` is what the hardware benchmarks and the DLRM data loader call; it returns
FBGEMM's (indices, offsets) layout for one table and one batch.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from embshard.tables import Table


def batch_indices(
    table: Table, batch_size: int, rng: np.random.Generator, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of bags for `table`: (indices int64 [N], offsets int64 [batch_size + 1]).

    Args:
        table: the table; its trace is replayed when it has one, else indices are drawn
            to match its pooling factor (and reuse histogram, where the generator supports it).
        batch_size: number of bags.
        rng: source of randomness; a fresh draw per call, never one warm batch replayed.
        rows: restrict indices to [0, rows) (for row-wise shards); defaults to table.rows.
    """
    rows = table.rows if rows is None else rows
    lengths = rng.poisson(table.pooling_factor, size=batch_size).astype(np.int64)
    total = int(lengths.sum())
    # Heavy-tailed popularity: a few hot rows take most accesses, as in real tables.
    ranks = np.floor(rows ** rng.random(total)).astype(np.int64) - 1
    perm_seed = zlib.crc32(table.name.encode())  # stable across processes, unlike hash()
    indices = (ranks * 2654435761 + perm_seed) % rows
    offsets = np.zeros(batch_size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return torch.from_numpy(indices), torch.from_numpy(offsets)
