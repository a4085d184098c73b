"""Per-table inputs of the RL cost networks and policies.

The features are the cost models' own (`embshard.costs.features.table_features`: intensive
descriptors and extensive work at the task's batch, log2 batch among them, so one network
serves several batch sizes). A table without a reuse histogram (a user's table: rows, dim,
pooling factor) gets the histogram the calibrated synthetic law expects at that batch, the
one the measured evaluator draws its indices from, never a flat one. They are z-scored with the mean and standard deviation of the TRAIN pool's tables (at
the dims and batch of the training tasks), computed once and saved in the checkpoint: a task
is never normalised by its own statistics.

A table with a trace is measured by replaying bags drawn with replacement from its trace at
the task's batch; with `trace_histograms="replay"` (recorded in the checkpoint) the features
take the reuse histogram of that replay (`features.replayed_table`, as NeuroShard's cost
models do), with "given" (checkpoints before 2026-11-27) the trace's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from embshard.costs import features as F
from embshard.tables import Table

def feature_names() -> tuple[str, ...]:
    """Names of the raw input columns (the cost models' features)."""
    return tuple(F.FEATURE_NAMES)


TRACE_HISTOGRAMS = F.TRACE_HISTOGRAMS


def raw_features(table: Table, batch_size: int, trace_histograms: str = "given") -> np.ndarray:
    """Raw (un-normalised) inputs of one table at `batch_size` (float32); a table without a
    reuse histogram gets its imputed one (`features.with_histogram`); a traced table its
    replay's with `trace_histograms="replay"` (`features.piece_histogram`, as the cost models)."""
    if trace_histograms == "replay" and table.trace is not None:
        table = F.piece_histogram(table, batch_size)[0]
    return F.table_features(table, batch_size)  # which imputes a missing histogram itself


@dataclass
class FeatureNorm:
    """Z-scoring with statistics of the training pool (std floored at 1e-3 of scale 1, so a
    column that is constant in training, such as the batch, maps to 0, not to infinity)."""

    names: tuple[str, ...]
    mean: np.ndarray
    std: np.ndarray
    #: "replay": a traced table's histogram as replayed at the task's batch; "given": the trace's own
    trace_histograms: str = "given"

    def __post_init__(self):
        if self.trace_histograms not in TRACE_HISTOGRAMS:
            raise ValueError(f"trace_histograms must be one of {', '.join(TRACE_HISTOGRAMS)}, got {self.trace_histograms!r}")

    @classmethod
    def fit(cls, tables_at_batch: Iterable[tuple[Table, int]], trace_histograms: str = "given") -> "FeatureNorm":
        rows = {(t.name, t.rows, t.dim, t.pooling_factor, b): raw_features(t, b, trace_histograms)
                for t, b in tables_at_batch}
        x = np.stack(list(rows.values())).astype(np.float64)
        std = x.std(axis=0)
        return cls(feature_names(), x.mean(axis=0).astype(np.float32), np.where(std < 1e-3, 1.0, std).astype(np.float32),
                   trace_histograms)

    def __call__(self, tables: Sequence[Table], batch_size: int) -> np.ndarray:
        """[N, F] normalised inputs of `tables` at `batch_size`."""
        F.impute_ahead(tables, batch_size)
        x = np.stack([raw_features(t, batch_size, self.trace_histograms) for t in tables])
        return ((x - self.mean) / self.std).astype(np.float32)

    @property
    def num_features(self) -> int:
        return len(self.names)

    def to_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "mean": [float(v) for v in self.mean], "std": [float(v) for v in self.std],
                "trace_histograms": self.trace_histograms}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FeatureNorm":
        return cls(tuple(d["names"]), np.asarray(d["mean"], np.float32), np.asarray(d["std"], np.float32),
                   d.get("trace_histograms", "given"))
