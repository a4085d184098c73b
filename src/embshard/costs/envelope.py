"""The training envelope of learned cost models: what they were trained on, and whether a
prediction falls outside it.

A search that minimises a model's estimate is drawn to wherever the model is most wrong,
which is usually where it never saw data. So every checkpoint records, from its training
samples: the range of every per-piece feature, the range of pieces per shard, of the
shard's summed work (lookups, bytes, rows touched, ...), the batch sizes, how many tables had
a measured vs an imputed reuse histogram, and for communication the device counts, batch
sizes, widths and delays. `Envelope.check_shard` / `check_comm` name every way a query lies
outside it; callers count them (report.json: `envelope` per plan).

A value is outside when it is below the smallest or above the largest trained value by more
than `tolerance` × the trained range (default 2%).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from embshard.costs.features import EXTENSIVE_NAMES, FEATURE_NAMES, NUM_INTENSIVE
from embshard.errors import InputError

DEFAULT_TOLERANCE = 0.02


@dataclass
class Range:
    lo: float
    hi: float

    @classmethod
    def of(cls, values: Any) -> "Range":
        v = np.asarray(values, dtype=np.float64)
        return cls(float(v.min()), float(v.max())) if v.size else cls(float("nan"), float("nan"))

    def outside(self, x: float, tolerance: float) -> str | None:
        """'<' or '>' when `x` lies outside (with the tolerance), else None."""
        pad = tolerance * max(self.hi - self.lo, 1e-9 * max(abs(self.hi), 1.0))
        if x < self.lo - pad:
            return "<"
        if x > self.hi + pad:
            return ">"
        return None

    def to_list(self) -> list[float]:
        return [self.lo, self.hi]


@dataclass
class Envelope:
    """Ranges of the data a checkpoint's models were trained on (see the module docstring)."""

    features: dict[str, Range]                 # per-piece features (intensive only)
    shard_pieces: Range
    shard_sums: dict[str, Range]               # per-shard sums of the extensive features
    compute_batch: Range
    compute_batch_sizes: list[int]
    histograms: dict[str, int]                 # tables with a "given" vs an "imputed" histogram
    comm_devices: list[int]
    comm_batch: Range
    comm_width: Range                          # per-device width
    comm_total_width: Range
    comm_delay_ms: Range
    tolerance: float = DEFAULT_TOLERANCE
    samples: dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ building
    @classmethod
    def fit(cls, shard_feats: Sequence[np.ndarray], batches: Sequence[int], imputed: Sequence[int],
            pieces_total: int, comm: Sequence[tuple[Sequence[int], Sequence[float], int]],
            tolerance: float = DEFAULT_TOLERANCE) -> "Envelope":
        """From the training data.

        Args:
            shard_feats: per compute sample, its [pieces, NUM_FEATURES] raw features.
            batches: per compute sample, its batch size.
            imputed: per compute sample, how many of its pieces had an imputed histogram.
            pieces_total: number of pieces over all samples.
            comm: per comm sample, (widths, delays_ms, batch size).
        """
        if not shard_feats:
            raise InputError("an envelope needs at least one compute sample")
        allf = np.concatenate(shard_feats)
        sums = np.stack([f[:, NUM_INTENSIVE:].sum(0) for f in shard_feats])
        n_imputed = int(sum(imputed))
        widths = [w for ws, _, _ in comm for w in ws]
        return cls(
            features={n: Range.of(allf[:, i]) for i, n in enumerate(FEATURE_NAMES[:NUM_INTENSIVE])},
            shard_pieces=Range.of([len(f) for f in shard_feats]),
            shard_sums={n: Range.of(sums[:, i]) for i, n in enumerate(EXTENSIVE_NAMES)},
            compute_batch=Range.of(batches),
            compute_batch_sizes=sorted({int(b) for b in batches}),
            histograms={"given": pieces_total - n_imputed, "imputed": n_imputed},
            comm_devices=sorted({len(ws) for ws, _, _ in comm}),
            comm_batch=Range.of([b for _, _, b in comm]),
            comm_width=Range.of(widths),
            comm_total_width=Range.of([sum(ws) for ws, _, _ in comm]),
            comm_delay_ms=Range.of([d for _, ds, _ in comm for d in ds]),
            tolerance=tolerance,
            samples={"compute": len(shard_feats), "comm": len(comm)},
        )

    # ------------------------------------------------------------------ checks
    def check_shard(self, feats: np.ndarray, batch_size: int) -> list[str]:
        """Why one device's shard (its pieces' raw features) is outside; [] when inside."""
        tol = self.tolerance
        out: list[str] = []
        if feats.shape[0] == 0:
            return out
        side = self.shard_pieces.outside(feats.shape[0], tol)
        if side:
            out.append(f"pieces={feats.shape[0]} {side} trained {self._fmt(self.shard_pieces)}")
        side = self.compute_batch.outside(batch_size, tol)
        if side:
            out.append(f"batch={batch_size} {side} trained {self._fmt(self.compute_batch)}")
        for i, (name, r) in enumerate(self.features.items()):
            col = feats[:, i]
            for v in (float(col.min()), float(col.max())):
                side = r.outside(v, tol)
                if side:
                    out.append(f"{name}={v:.3g} {side} trained {self._fmt(r)}")
                    break
        sums = feats[:, NUM_INTENSIVE:].sum(0)
        for i, (name, r) in enumerate(self.shard_sums.items()):
            side = r.outside(float(sums[i]), tol)
            if side:
                out.append(f"shard {name}={sums[i]:.3g} {side} trained {self._fmt(r)}")
        return out

    def check_comm(self, widths: Sequence[int], delays_ms: Sequence[float], batch_size: int) -> list[str]:
        """Why one all-to-all configuration is outside; [] when inside."""
        tol = self.tolerance
        out: list[str] = []
        d = len(widths)
        if d <= 1:
            return out
        if self.comm_devices and not (min(self.comm_devices) <= d <= max(self.comm_devices)):
            out.append(f"devices={d} outside trained {self.comm_devices[0]}..{self.comm_devices[-1]}")
        side = self.comm_batch.outside(float(batch_size), tol)
        if side:
            out.append(f"batch={batch_size} {side} trained {self._fmt(self.comm_batch)}")
        # small widths and delays (a device with little work) are always covered: only the
        # upper end can leave the envelope
        for name, r, v in (("max width", self.comm_width, float(max(widths))),
                           ("total width", self.comm_total_width, float(sum(widths))),
                           ("max delay ms", self.comm_delay_ms, float(max(delays_ms) if len(delays_ms) else 0.0))):
            if r.outside(v, tol) == ">":
                out.append(f"{name}={v:.4g} > trained {self._fmt(r)}")
        return out

    def comm_untrusted(self, num_devices: int, batch_size: int) -> str | None:
        """Why the comm models cannot be trusted at all for all-to-alls of `num_devices`
        devices at `batch_size` (None when they can): a device count outside the trained
        counts' range, or a batch outside the trained batches. Inside, a prediction is still
        checked against the analytic model (`NeuralCostModels`: `FAR_FACTOR`)."""
        if num_devices <= 1:
            return None
        if self.comm_devices and not (min(self.comm_devices) <= num_devices <= max(self.comm_devices)):
            return f"devices={num_devices} outside trained {self.comm_devices[0]}..{self.comm_devices[-1]}"
        side = self.comm_batch.outside(float(batch_size), self.tolerance)
        if side:
            return f"batch={batch_size} {side} trained {self._fmt(self.comm_batch)}"
        return None

    @staticmethod
    def _fmt(r: Range) -> str:
        return f"[{r.lo:.3g}, {r.hi:.3g}]"

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["features"] = {k: v.to_list() for k, v in self.features.items()}
        d["shard_sums"] = {k: v.to_list() for k, v in self.shard_sums.items()}
        for k in ("shard_pieces", "compute_batch", "comm_batch", "comm_width", "comm_total_width", "comm_delay_ms"):
            d[k] = getattr(self, k).to_list()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Envelope":
        r = lambda v: Range(float(v[0]), float(v[1]))  # noqa: E731
        return cls(
            features={k: r(v) for k, v in d["features"].items()},
            shard_pieces=r(d["shard_pieces"]),
            shard_sums={k: r(v) for k, v in d["shard_sums"].items()},
            compute_batch=r(d["compute_batch"]),
            compute_batch_sizes=[int(b) for b in d["compute_batch_sizes"]],
            histograms={k: int(v) for k, v in d["histograms"].items()},
            comm_devices=[int(x) for x in d["comm_devices"]],
            comm_batch=r(d["comm_batch"]),
            comm_width=r(d["comm_width"]),
            comm_total_width=r(d["comm_total_width"]),
            comm_delay_ms=r(d["comm_delay_ms"]),
            tolerance=float(d.get("tolerance", DEFAULT_TOLERANCE)),
            samples={k: int(v) for k, v in (d.get("samples") or {}).items()},
        )

