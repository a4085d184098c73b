"""Inputs of the neural cost models: per-piece compute features, per-device comm features,
and the z-scoring of comm inputs and targets."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from embshard.costs.features import EXTENSIVE_NAMES, FEATURE_NAMES, shard_features
from embshard.errors import InputError
from embshard.tables import Table

TARGETS = ("log_ms", "ms")
#: floor of a label before taking its log (ms)
LOG_FLOOR_MS = 1e-3

# ---------------------------------------------------------------------------------------
# Compute features
# ---------------------------------------------------------------------------------------
COMPUTE_FEATURE_NAMES = FEATURE_NAMES
#: The kinds of work a piece is charged for (weight bytes only shape the context: rows that
#: are not looked up cost nothing, but a big working set makes every lookup slower).
RATE_TERMS: tuple[str, ...] = ("lookups_1e4", "lookup_mb", "bags_1e4", "output_mb", "touched_rows_1e4",
                               "touched_mb", "pieces")
_RATE_IDX = [EXTENSIVE_NAMES.index(n) for n in RATE_TERMS]
NUM_RATES = len(RATE_TERMS)


def compute_features(tables: Sequence[Table], batch_size: int) -> np.ndarray:
    """[len(tables), NUM_FEATURES] raw features of the compute model (float32)."""
    return shard_features(tables, batch_size)


# ---------------------------------------------------------------------------------------
# Communication features
# ---------------------------------------------------------------------------------------
#: Per-device features of one all-to-all (raw, before z-scoring). Bytes per rank follow
#: `hardware/comm.py`: with the global batch B split evenly, rank r sends B(D-1)/D × w_r
#: floats and receives B/D × (W - w_r): 4·B/D·((D-2)·w_r + W) bytes in all.
COMM_FEATURE_NAMES: tuple[str, ...] = (
    "width",
    "log1p_width",
    "total_width",
    "mean_width",
    "max_width",
    "min_width",
    "num_devices",
    "inv_num_devices",
    "volume_mb",
    "max_volume_mb",
    "mean_volume_mb",
    "log2_batch",
    "delay_ms",
    "max_delay_ms",
    "mean_delay_ms",
    "wait_ms",
)
_NUM_DELAY_FEATURES = 4
#: the backward model sees the same features without the delays
BACKWARD_COMM_FEATURES = COMM_FEATURE_NAMES[: len(COMM_FEATURE_NAMES) - _NUM_DELAY_FEATURES]


def comm_features(widths: np.ndarray, delays_ms: np.ndarray | None, batch_size: float, with_delays: bool = True) -> np.ndarray:
    """[n, D, F] per-device features of n all-to-alls of D devices each (float32)."""
    w = np.asarray(widths, dtype=np.float64)
    if w.ndim != 2:
        raise InputError(f"widths must be [n, D], got shape {w.shape}")
    n, d = w.shape
    total = w.sum(1, keepdims=True)
    vol = 4.0 * batch_size / d * ((d - 2) * w + total) / 1e6
    cols = [
        w,
        np.log1p(w),
        np.broadcast_to(total, w.shape),
        np.broadcast_to(total / d, w.shape),
        np.broadcast_to(w.max(1, keepdims=True), w.shape),
        np.broadcast_to(w.min(1, keepdims=True), w.shape),
        np.full(w.shape, float(d)),
        np.full(w.shape, 1.0 / d),
        vol,
        np.broadcast_to(vol.max(1, keepdims=True), w.shape),
        np.broadcast_to(vol.mean(1, keepdims=True), w.shape),
        np.full(w.shape, math.log2(batch_size)),
    ]
    if with_delays:
        dl = np.zeros_like(w) if delays_ms is None else np.asarray(delays_ms, dtype=np.float64)
        if dl.shape != w.shape:
            raise InputError(f"delays_ms shape {dl.shape} differs from widths shape {w.shape}")
        mx = dl.max(1, keepdims=True)
        cols += [dl, np.broadcast_to(mx, w.shape), np.broadcast_to(dl.mean(1, keepdims=True), w.shape), mx - dl]
    return np.stack(cols, axis=-1).astype(np.float32)


def forward_wait_ms(delays_ms: Any) -> np.ndarray:
    """How long each device waits in the forward all-to-all for the slowest one: its lead."""
    d = np.asarray(delays_ms, np.float64)
    return d.max(-1, keepdims=True) - d



# ---------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------
@dataclass
class Normalization:
    """z-scoring of inputs and of the (possibly log) target, from training data only."""

    x_mean: np.ndarray
    x_std: np.ndarray
    y_mean: float
    y_std: float
    target: str = "log_ms"

    @classmethod
    def fit(cls, x: np.ndarray, y_ms: np.ndarray, target: str) -> "Normalization":
        if target not in TARGETS:
            raise InputError(f"target must be one of {TARGETS}, got {target!r}")
        x = np.asarray(x, dtype=np.float64)
        std = x.std(0)
        yt = _transform(np.asarray(y_ms, dtype=np.float64), target)
        return cls(
            x_mean=x.mean(0).astype(np.float32),
            x_std=np.where(std > 1e-6, std, 1.0).astype(np.float32),
            y_mean=float(yt.mean()),
            y_std=float(yt.std()) if yt.std() > 1e-9 else 1.0,
            target=target,
        )

    def x(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.x_mean) / self.x_std).astype(np.float32)

    def y(self, y_ms: np.ndarray) -> np.ndarray:
        return ((_transform(np.asarray(y_ms, dtype=np.float64), self.target) - self.y_mean) / self.y_std).astype(np.float32)

    def to_ms(self, out: np.ndarray) -> np.ndarray:
        v = np.asarray(out, dtype=np.float64) * self.y_std + self.y_mean
        return np.exp(v) if self.target == "log_ms" else np.maximum(v, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"x_mean": self.x_mean.tolist(), "x_std": self.x_std.tolist(), "y_mean": self.y_mean,
                "y_std": self.y_std, "target": self.target}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Normalization":
        return cls(np.asarray(d["x_mean"], np.float32), np.asarray(d["x_std"], np.float32),
                   float(d["y_mean"]), float(d["y_std"]), str(d["target"]))


def _transform(y_ms: np.ndarray, target: str) -> np.ndarray:
    return np.log(np.maximum(y_ms, LOG_FLOOR_MS)) if target == "log_ms" else y_ms


