"""Embedding tables and the per-table features every cost model and search uses."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from embshard.errors import InputError, check_keys

#: Upper edges of the reuse bins (0,1], (1,2], (2,4], ..., (16384,32768]; a 17th bin holds 32768+.
REUSE_BIN_EDGES: tuple[int, ...] = tuple(2**k for k in range(16))  # 1 .. 32768
NUM_REUSE_BINS = 17
#: How far a reuse histogram's sum may be from 1 (rounding of its 17 shares, e.g. to 4 decimals).
REUSE_HISTOGRAM_SUM_TOLERANCE = 1e-3
#: Column-split granularity the FBGEMM kernel requires for fp32/fp16 weights.
DIM_ALIGNMENT = 4
MIN_ROWS = 100
#: Table kinds: "pooled" (an EmbeddingBag: one vector per bag) or "sequence" (unpooled, TorchRec's
#: EmbeddingCollection: every id yields its own vector; pooling_factor is then the mean sequence length).
TABLE_KINDS = ("pooled", "sequence")
#: the largest sizes a task may state: far beyond any hardware, small enough that no byte count
#: or lookup count overflows the 64-bit integers the planners keep them in
MAX_ROWS = 1 << 44
MAX_DIM = 1 << 16
MAX_POOLING_FACTOR = 1e6
#: TorchRec's sharding types (torchrec.distributed.types.ShardingType values): what a table's
#: `sharding_types` constraint may name.
SHARDING_TYPES = ("data_parallel", "table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise",
                  "grid_shard")
#: Every key a table JSON object may hold.
TABLE_FIELDS = ("name", "rows", "dim", "pooling_factor", "reuse_histogram", "bytes_per_element", "trace", "kind",
                "num_poolings", "sharding_types", "min_partition")


def reuse_bin(access_counts: np.ndarray) -> np.ndarray:
    """Bin index (0..16) of each access count: (0,1]→0, (1,2]→1, (2,4]→2, …, >32768→16."""
    counts = np.asarray(access_counts, dtype=np.float64)
    bins = np.ceil(np.log2(np.maximum(counts, 1.0))).astype(np.int64)
    return np.clip(bins, 0, NUM_REUSE_BINS - 1)


def reuse_histograms(access_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two histograms Meta publishes, from the access count of every unique row.

    Returns:
        (share of unique rows per reuse bin, share of all accesses per reuse bin), 17 floats each.
    """
    counts = np.asarray(access_counts)
    counts = counts[counts > 0]
    if counts.size == 0:
        return np.zeros(NUM_REUSE_BINS), np.zeros(NUM_REUSE_BINS)
    bins = reuse_bin(counts)
    rows = np.bincount(bins, minlength=NUM_REUSE_BINS).astype(np.float64)
    accesses = np.bincount(bins, weights=counts.astype(np.float64), minlength=NUM_REUSE_BINS)
    return rows / rows.sum(), accesses / accesses.sum()


@dataclass(frozen=True)
class TraceRef:
    """Where a table's real indices live: a dlrm_datasets-format file and a table index in it."""

    file: str
    table_index: int


@dataclass(frozen=True)
class Table:
    """One embedding table as the planner sees it.

    Args:
        name: unique within a task.
        rows: hash size (number of embedding rows).
        dim: embedding width; a multiple of 4 (FBGEMM's requirement).
        pooling_factor: mean number of indices per bag (float).
        reuse_histogram: 17 floats, fraction of unique rows per access-count bin (summing to 1
            up to rounding), or None.
        bytes_per_element: 4 for fp32 weights, 2 for fp16.
        trace: optional reference to real indices for this table.
        kind: "pooled" (default) or "sequence" (unpooled; `pooling_factor` = mean sequence length).
        num_poolings: pooled outputs (bags) per sample: one per feature that reads the table
            (TorchRec's `num_poolings`, summed over its features). `pooling_factor` then counts
            the lookups of all its bags per sample. Memory counts every output; the cost models
            and kernel measurements see one bag of all the lookups (docs/contracts.md).
        sharding_types: the TorchRec sharding types a plan may use for this table (a
            `ParameterConstraints.sharding_types`); None: whatever the algorithm does. The one
            validator rejects a plan that shards the table another way.
        min_partition: the narrowest column piece a plan may cut (TorchRec's `min_partition`);
            None: any multiple of 4.
    """

    name: str
    rows: int
    dim: int
    pooling_factor: float
    reuse_histogram: tuple[float, ...] | None = None
    bytes_per_element: int = 4
    trace: TraceRef | None = None
    kind: str = "pooled"
    num_poolings: float = 1.0
    sharding_types: tuple[str, ...] | None = None
    min_partition: int | None = None

    def __post_init__(self) -> None:
        where = f"table {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise InputError(f"table name must be a non-empty string, got {self.name!r}")
        if not _is_int(self.rows) or self.rows <= 0:
            raise InputError(f"{where}: rows must be a positive integer, got {self.rows!r}")
        if self.rows > MAX_ROWS:
            raise InputError(f"{where}: rows must be at most 2**44, got {self.rows!r}")
        if not _is_int(self.dim) or self.dim <= 0 or self.dim % DIM_ALIGNMENT:
            raise InputError(
                f"{where}: dim must be a positive multiple of {DIM_ALIGNMENT}, got {self.dim!r}"
            )
        if self.dim > MAX_DIM:
            raise InputError(f"{where}: dim must be at most {MAX_DIM}, got {self.dim!r}")
        if not _is_number(self.pooling_factor) or not (
            math.isfinite(self.pooling_factor) and self.pooling_factor >= 0
        ):
            raise InputError(
                f"{where}: pooling_factor must be a finite number >= 0, got {self.pooling_factor!r}"
            )
        if self.pooling_factor > MAX_POOLING_FACTOR:
            raise InputError(f"{where}: pooling_factor must be at most {MAX_POOLING_FACTOR:g}, got {self.pooling_factor!r}")
        if not _is_int(self.bytes_per_element) or self.bytes_per_element not in (1, 2, 4, 8):
            raise InputError(
                f"{where}: bytes_per_element must be 1, 2, 4 or 8, got {self.bytes_per_element!r}"
            )
        if not isinstance(self.kind, str) or self.kind not in TABLE_KINDS:
            raise InputError(f"{where}: kind must be one of {', '.join(TABLE_KINDS)}, got {self.kind!r}")
        if self.reuse_histogram is not None:
            if not _iterable(self.reuse_histogram) or not all(_is_number(x) for x in self.reuse_histogram):
                raise InputError(f"{where}: reuse_histogram must be {NUM_REUSE_BINS} non-negative floats")
            hist = tuple(float(x) for x in self.reuse_histogram)
            if len(hist) != NUM_REUSE_BINS or any(not math.isfinite(x) or x < 0 for x in hist):
                raise InputError(
                    f"{where}: reuse_histogram must be {NUM_REUSE_BINS} non-negative floats"
                )
            if abs(sum(hist) - 1.0) > REUSE_HISTOGRAM_SUM_TOLERANCE:
                raise InputError(
                    f"{where}: reuse_histogram holds shares of the table's unique rows and must sum to 1 "
                    f"(within {REUSE_HISTOGRAM_SUM_TOLERANCE}), got {sum(hist):.6g}; leave it out if unknown"
                )
            object.__setattr__(self, "reuse_histogram", hist)
        object.__setattr__(self, "pooling_factor", float(self.pooling_factor))
        if not _is_number(self.num_poolings) or not (
            math.isfinite(self.num_poolings) and 0 < self.num_poolings <= MAX_POOLING_FACTOR
        ):
            raise InputError(f"{where}: num_poolings must be a finite number > 0, got {self.num_poolings!r}")
        object.__setattr__(self, "num_poolings", float(self.num_poolings))
        if self.sharding_types is not None:
            if not isinstance(self.sharding_types, str) and not _iterable(self.sharding_types):
                raise InputError(f"{where}: sharding_types must be a non-empty list of {', '.join(SHARDING_TYPES)}; "
                                 f"got {self.sharding_types!r}")
            types = (self.sharding_types,) if isinstance(self.sharding_types, str) else tuple(self.sharding_types)
            unknown = [t for t in types if not isinstance(t, str) or t not in SHARDING_TYPES]
            if unknown or not types:
                raise InputError(f"{where}: sharding_types must be a non-empty list of {', '.join(SHARDING_TYPES)}; "
                                 f"got {list(types)}")
            object.__setattr__(self, "sharding_types", tuple(dict.fromkeys(types)))
        if self.min_partition is not None and (not _is_int(self.min_partition) or self.min_partition <= 0):
            raise InputError(f"{where}: min_partition must be a positive integer, got {self.min_partition!r}")

    @property
    def size_bytes(self) -> int:
        """Bytes of the weights alone."""
        return self.rows * self.dim * self.bytes_per_element

    def with_dim(self, dim: int, name: str | None = None) -> "Table":
        """The same table at another width (used to augment table pools and split columns)."""
        return Table(
            name=name or self.name,
            rows=self.rows,
            dim=dim,
            pooling_factor=self.pooling_factor,
            reuse_histogram=self.reuse_histogram,
            bytes_per_element=self.bytes_per_element,
            trace=self.trace,
            kind=self.kind,
            num_poolings=self.num_poolings,
        )

    @property
    def is_sequence(self) -> bool:
        return self.kind == "sequence"

    def allows(self, sharding_type: str) -> bool:
        """Whether a plan may shard this table as `sharding_type` (TorchRec's name)."""
        return self.sharding_types is None or sharding_type in self.sharding_types

    def narrowest_column_piece(self) -> int:
        """The narrowest column piece a split of this table may have (`min_partition`, at most
        the table's width; DIM_ALIGNMENT when unconstrained)."""
        return DIM_ALIGNMENT if self.min_partition is None else min(self.min_partition, self.dim)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.reuse_histogram is None:
            d.pop("reuse_histogram")
        else:
            d["reuse_histogram"] = list(self.reuse_histogram)
        if self.trace is None:
            d.pop("trace")
        if self.kind == "pooled":  # pooled tables' JSON stays exactly as before kinds existed
            d.pop("kind")
        if self.num_poolings == 1.0:
            d.pop("num_poolings")
        if self.sharding_types is None:
            d.pop("sharding_types")
        else:
            d["sharding_types"] = list(self.sharding_types)
        if self.min_partition is None:
            d.pop("min_partition")
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Table":
        if not isinstance(d, dict):
            raise InputError(f"a table must be a JSON object, got {type(d).__name__}")
        check_keys(d, TABLE_FIELDS, f"table {d.get('name')!r}")
        missing = {"name", "rows", "dim", "pooling_factor"} - set(d)
        if missing:
            raise InputError(f"table {d.get('name')!r}: missing field(s) {sorted(missing)}")
        trace = d.get("trace")
        if trace is not None:
            if isinstance(trace, dict):
                check_keys(trace, ("file", "table_index"), f"table {d['name']!r}: trace")
            if not isinstance(trace, dict) or set(trace) != {"file", "table_index"}:
                raise InputError(
                    f"table {d['name']!r}: trace must be {{'file': str, 'table_index': int}}"
                )
            index = trace["table_index"]
            if isinstance(index, str) and index.isdigit():
                index = int(index)
            if (not isinstance(trace["file"], str) and not _is_int(trace["file"])) or str(trace["file"]) == "" \
                    or not _is_int(index) or index < 0:
                raise InputError(f"table {d['name']!r}: trace must be {{'file': str, 'table_index': int}}, "
                                 f"got {trace!r}"[:300])
            trace = TraceRef(str(trace["file"]), int(index))
        return cls(
            name=d["name"],
            rows=d["rows"],
            dim=d["dim"],
            pooling_factor=d["pooling_factor"],
            reuse_histogram=d.get("reuse_histogram"),
            bytes_per_element=d.get("bytes_per_element", 4),
            trace=trace,
            kind=d.get("kind", "pooled"),
            num_poolings=d.get("num_poolings", 1.0),
            sharding_types=d.get("sharding_types"),
            min_partition=d.get("min_partition"),
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _iterable(x: Any) -> bool:
    return isinstance(x, (list, tuple))
