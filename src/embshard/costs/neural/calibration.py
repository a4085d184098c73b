"""Calibration: one scale per model that maps the models to fresh measurements of this
machine (`scripts/calibrate_cost_models.py` writes it into a checkpoint)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from embshard.costs.neural.features import forward_wait_ms
from embshard.costs.neural.samples import CommSample, ComputeSample
from embshard.errors import InputError

if TYPE_CHECKING:
    from embshard.costs.neural.models import NeuralCostModels

MODEL_KEYS = ("compute", "forward_comm", "backward_comm")


def check_calibration(cal: Any, source: str) -> dict[str, Any] | None:
    """The optional `calibration` entry: positive finite scales for the three models."""
    if cal is None:
        return None
    if not isinstance(cal, dict):
        raise InputError(f"{source}: calibration must be a mapping, got {type(cal).__name__}")
    for k in MODEL_KEYS:
        v = cal.get(k, 1.0)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            raise InputError(f"{source}: calibration.{k} must be a positive number, got {v!r}")
    return dict(cal)


def fit_calibration(models: "NeuralCostModels", compute: Sequence["ComputeSample"],
                    comm: Sequence["CommSample"] = ()) -> dict[str, Any]:
    """Scales that map `models` (their uncalibrated predictions: any calibration they carry is
    divided out) to fresh measurements: per model, the median of measured / predicted (compute:
    per shard; forward comm: time beyond the wait, per device; backward comm: per device). A
    model without samples keeps 1.0."""
    sc = models.scale
    out: dict[str, Any] = {k: 1.0 for k in MODEL_KEYS}
    ratios: dict[str, list[float]] = {k: [] for k in MODEL_KEYS}
    for s in compute:
        pred = float(models.at_batch(s.batch_size).compute_ms([s.tables])[0]) / sc["compute"]
        if pred > 0 and s.ms > 0:
            ratios["compute"].append(s.ms / pred)
    for s in comm:
        if s.num_devices < 2:
            continue
        dl = np.asarray(s.delays_ms, np.float64)
        fw, bw = models.at_batch(s.batch_size).comm_ms(np.asarray(s.widths, np.float64), dl)
        wait = forward_wait_ms(dl)
        fw, bw = (fw - wait) / sc["forward_comm"] + wait, bw / sc["backward_comm"]
        for p, m, w in zip(fw, s.forward_ms, wait):
            if p - w > 0 and m - w > 0:
                ratios["forward_comm"].append((m - w) / (p - w))
        for p, m in zip(bw, s.backward_ms):
            if p > 0 and m > 0:
                ratios["backward_comm"].append(m / p)
    for k, r in ratios.items():
        if r:
            out[k] = float(np.median(r))
    out["samples"] = {k: len(r) for k, r in ratios.items()}
    return out


