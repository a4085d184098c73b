"""Calibration: one scale per model that maps the models to fresh measurements of this
machine, and optionally one scale per kind of compute work (`compute_terms`: the machine
may run lookups, updates and bags at other relative speeds than the cost data's sessions);
`scripts/calibrate_cost_models.py` writes it into a checkpoint."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from embshard.costs.neural.features import RATE_TERMS, compute_features, forward_wait_ms
from embshard.costs.neural.samples import CommSample, ComputeSample
from embshard.errors import InputError

if TYPE_CHECKING:
    from embshard.costs.neural.models import NeuralCostModels

MODEL_KEYS = ("compute", "forward_comm", "backward_comm")


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def check_calibration(cal: Any, source: str) -> dict[str, Any] | None:
    """The optional `calibration` entry: positive finite scales for the three models."""
    if cal is None:
        return None
    if not isinstance(cal, dict):
        raise InputError(f"{source}: calibration must be a mapping, got {type(cal).__name__}")
    for k in MODEL_KEYS:
        v = cal.get(k, 1.0)
        if not _positive(v):
            raise InputError(f"{source}: calibration.{k} must be a positive number, got {v!r}")
    terms = cal.get("compute_terms")
    if terms is not None:
        if not isinstance(terms, dict):
            raise InputError(f"{source}: calibration.compute_terms must map kinds of work to scales, got "
                             f"{type(terms).__name__}")
        unknown = sorted(set(terms) - set(RATE_TERMS))
        if unknown:
            raise InputError(f"{source}: calibration.compute_terms has unknown kinds of work {unknown}; "
                             f"known: {list(RATE_TERMS)}")
        for k, v in terms.items():
            if not _positive(v):
                raise InputError(f"{source}: calibration.compute_terms.{k} must be a positive number, got {v!r}")
    return dict(cal)


def term_scales(cal: dict[str, Any] | None) -> np.ndarray:
    """[NUM_RATES] the scale of each kind of work (1 where the calibration names none)."""
    terms = (cal or {}).get("compute_terms") or {}
    return np.array([float(terms.get(k, 1.0)) for k in RATE_TERMS])


def fit_term_scales(models: "NeuralCostModels", compute: Sequence["ComputeSample"], groups: Sequence[Any] | None = None,
                    ridge: float = 1e-3) -> dict[str, float]:
    """One scale per kind of work (`RATE_TERMS`) that fits `compute`'s measured ms best in log
    error, each group (a task's plans, measured in one call) with its own offset, so that only
    how the kinds of work weigh against each other on one device is fitted, not the
    machine's overall speed (the compute scale is that: `fit_calibration` after these). A
    shard's ms is linear in the scales: the sum over kinds of (the pieces' summed term x the
    context's multiplier) plus the base. The scales are normalised so that the samples' median
    prediction stays where it was (the level is the compute scale's); `ridge` pulls their logs
    towards 0 (the shipped model). Any calibration `models` carry is divided out (the raw nets
    are fitted)."""
    from embshard.costs.neural.numpy_nets import NumpyComputeNet

    if len(compute) < 2 * len(RATE_TERMS):
        raise InputError(f"{len(compute)} compute samples, need at least {2 * len(RATE_TERMS)} to fit "
                         f"{len(RATE_TERMS)} kinds of work")
    raw = NumpyComputeNet(models.raw_state("compute"))
    A, base, ms = [], [], []
    for s in compute:
        a, b = raw.head_parts(raw.encode(compute_features(s.tables, s.batch_size)).sum(0)[None])
        A.append(a[0])
        base.append(b[0])
        ms.append(s.ms)
    keys = list(groups) if groups is not None else [0] * len(compute)
    if len(keys) != len(compute):
        raise InputError(f"{len(keys)} groups for {len(compute)} compute samples")
    names, inverse = np.unique(np.array([str(k) for k in keys]), return_inverse=True)
    gi = torch.from_numpy(inverse.astype(np.int64).reshape(-1))
    counts = torch.bincount(gi, minlength=len(names)).double()
    At, bt = torch.tensor(np.array(A)), torch.tensor(np.array(base))
    lm = torch.log(torch.tensor(np.maximum(ms, 1e-6), dtype=torch.float64))
    lc = torch.zeros(len(RATE_TERMS), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([lc], max_iter=500, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        res = lm - torch.log((At * lc.exp()).sum(1) + bt)
        off = torch.zeros(len(names), dtype=torch.float64).index_add(0, gi, res) / counts
        value = ((res - off[gi]) ** 2).mean() + ridge * (lc ** 2).sum()
        value.backward()
        return value

    opt.step(loss)
    c = np.exp(lc.detach().numpy())
    a, b = np.array(A), np.array(base)
    c = c / np.median(((a * c).sum(1) + b) / (a.sum(1) + b))  # ms is nearly linear in c: one step holds the median
    return {k: float(v) for k, v in zip(RATE_TERMS, c)}


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


