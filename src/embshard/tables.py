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
#: Every key a table JSON object may hold.
TABLE_FIELDS = ("name", "rows", "dim", "pooling_factor", "reuse_histogram", "bytes_per_element", "trace", "kind")


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
    """

    name: str
    rows: int
    dim: int
    pooling_factor: float
    reuse_histogram: tuple[float, ...] | None = None
    bytes_per_element: int = 4
    trace: TraceRef | None = None
    kind: str = "pooled"

    def __post_init__(self) -> None:
        where = f"table {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise InputError(f"table name must be a non-empty string, got {self.name!r}")
        if not _is_int(self.rows) or self.rows <= 0:
            raise InputError(f"{where}: rows must be a positive integer, got {self.rows!r}")
        if not _is_int(self.dim) or self.dim <= 0 or self.dim % DIM_ALIGNMENT:
            raise InputError(
                f"{where}: dim must be a positive multiple of {DIM_ALIGNMENT}, got {self.dim!r}"
            )
        if not isinstance(self.pooling_factor, (int, float)) or not (
            math.isfinite(self.pooling_factor) and self.pooling_factor >= 0
        ):
            raise InputError(
                f"{where}: pooling_factor must be a finite number >= 0, got {self.pooling_factor!r}"
            )
        if self.bytes_per_element not in (1, 2, 4, 8):
            raise InputError(
                f"{where}: bytes_per_element must be 1, 2, 4 or 8, got {self.bytes_per_element!r}"
            )
        if self.kind not in TABLE_KINDS:
            raise InputError(f"{where}: kind must be one of {', '.join(TABLE_KINDS)}, got {self.kind!r}")
        if self.reuse_histogram is not None:
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
        )

    @property
    def is_sequence(self) -> bool:
        return self.kind == "sequence"

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
            trace = TraceRef(str(trace["file"]), int(trace["table_index"]))
        return cls(
            name=d["name"],
            rows=d["rows"],
            dim=d["dim"],
            pooling_factor=d["pooling_factor"],
            reuse_histogram=d.get("reuse_histogram"),
            bytes_per_element=d.get("bytes_per_element", 4),
            trace=trace,
            kind=d.get("kind", "pooled"),
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
