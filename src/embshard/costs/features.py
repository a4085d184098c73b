"""The per-table feature vector every learned cost model sees (one place defines it).

Raw, un-normalised features of one shard of a table (rows and dim are the shard's); models
z-score them with statistics saved in their checkpoints.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from embshard.tables import NUM_REUSE_BINS, Table

FEATURE_NAMES: tuple[str, ...] = (
    "log_rows",
    "dim",
    "pooling_factor",
    "log_pooling_factor",
    "log_size_bytes",
    "log_lookup_bytes",
    *(f"reuse_bin_{k}" for k in range(NUM_REUSE_BINS)),
)
NUM_FEATURES = len(FEATURE_NAMES)

#: Used when a table carries no reuse histogram: every row accessed once.
_FLAT_HISTOGRAM = (1.0,) + (0.0,) * (NUM_REUSE_BINS - 1)


def table_features(table: Table) -> np.ndarray:
    """Feature vector of `table` (float32, NUM_FEATURES long)."""
    hist = table.reuse_histogram or _FLAT_HISTOGRAM
    size = table.rows * table.dim * table.bytes_per_element
    lookup_bytes = table.pooling_factor * table.dim * table.bytes_per_element
    return np.array(
        [
            math.log(table.rows),
            float(table.dim),
            table.pooling_factor,
            math.log1p(table.pooling_factor),
            math.log(size),
            math.log1p(lookup_bytes),
            *hist,
        ],
        dtype=np.float32,
    )


def shard_features(tables: Sequence[Table]) -> np.ndarray:
    """[len(tables), NUM_FEATURES] features of the tables of one device's shard."""
    return np.stack([table_features(t) for t in tables]) if tables else np.zeros((0, NUM_FEATURES), np.float32)
