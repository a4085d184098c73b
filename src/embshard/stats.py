"""The statistics every comparison uses: rank correlation and bootstrap intervals of paired ratios.

A claim that one planner is better than another is made on *paired ratios*: per task (or
per measuring round), the candidate's cost divided by the other's cost measured beside it,
so that what the two share (the task's size, the machine's speed that minute) cancels. The
mean ratio gets a percentile bootstrap interval (tasks resampled with replacement), and a
verdict: "better" when the whole interval lies below 1, "worse" when above, otherwise
"not resolved" — the data cannot tell the two apart at this confidence.

A percentile bootstrap needs many values: over 3 values it is about their range, so when
two plans cost the same it calls one "better" whenever all 3 ratios fall on one side of 1
(1 time in 8, not 1 in 40). A decision made on a handful of measuring rounds (the measured
guard) takes `method="t"`: the Student t interval of the mean, which holds its confidence at
any count when the ratios' noise is roughly normal.

numpy only (scipy is not a dependency).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from embshard.errors import InputError

#: Bootstrap resamples: enough that the interval's ends move by well under 0.1% between seeds.
BOOTSTRAP_DRAWS = 10_000


def centred_within(values: Sequence[float] | np.ndarray, groups: Sequence[Sequence[int]]) -> np.ndarray:
    """`values` (float) less the mean of each of the disjoint groups of indices they fall in
    (indices in no group keep their value): e.g. a device's log error about its own plan's
    mean."""
    out = np.asarray(values, dtype=np.float64).copy()
    for g in groups:
        ix = np.asarray(g, dtype=np.int64)
        out[ix] -= out[ix].mean()
    return out


def kendall_tau_b(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, chunk: int = 2048) -> float:
    """Kendall's τ-b (ties corrected), numpy only, O(n²) in chunks; nan below two items."""
    x = np.asarray(x, np.float64).ravel()
    y = np.asarray(y, np.float64).ravel()
    n = len(x)
    if n < 2:
        return float("nan")
    s = tx = ty = 0.0
    for i in range(0, n, chunk):
        dx = np.sign(x[i : i + chunk, None] - x[None, :])
        dy = np.sign(y[i : i + chunk, None] - y[None, :])
        s += float((dx * dy).sum())
        tx += float((dx == 0).sum())
        ty += float((dy == 0).sum())
    # over ordered pairs i != j: the diagonal adds n ties to each count
    n0 = n * (n - 1) / 2
    n1 = (tx - n) / 2
    n2 = (ty - n) / 2
    denom = math.sqrt((n0 - n1) * (n0 - n2))
    return float(s / 2 / denom) if denom > 0 else float("nan")


def _interval_values(values: Sequence[float], confidence: float, what: str) -> np.ndarray:
    """`values` as a flat float array, checked for an interval at `confidence` (`what` names the
    interval in the errors)."""
    v = np.asarray(values, np.float64).ravel()
    if v.size == 0:
        raise InputError(f"{what} of no values")
    if not np.all(np.isfinite(v)):
        raise InputError(f"{what} values must be finite")
    if not 0 < confidence < 1:
        raise InputError(f"confidence must be in (0, 1), got {confidence!r}")
    return v


def bootstrap_mean_ci(values: Sequence[float], confidence: float = 0.95, draws: int = BOOTSTRAP_DRAWS,
                      seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` and its percentile bootstrap interval.

    One value gives a zero-width interval at the value (nothing to resample)."""
    v = _interval_values(values, confidence, "bootstrap")
    mean = float(v.mean())
    if v.size == 1:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(int(draws), v.size))].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return mean, float(lo), float(hi)


@functools.lru_cache(maxsize=256)
def student_t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (numpy only: the density
    integrated by Simpson's rule, the quantile found by bisection; within 1e-6 of tables)."""
    if not 0 < p < 1:
        raise InputError(f"quantile probability must be in (0, 1), got {p!r}")
    if int(df) != df or df < 1:
        raise InputError(f"degrees of freedom must be an integer >= 1, got {df!r}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    nu = float(df)
    log_c = math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi)

    def cdf(x: float) -> float:  # x >= 0
        grid = np.linspace(0.0, x, 4001)
        pdf = np.exp(log_c - (nu + 1) / 2 * np.log1p(grid * grid / nu))
        h = x / 4000
        return 0.5 + h / 3 * float(pdf[0] + pdf[-1] + 4 * pdf[1:-1:2].sum() + 2 * pdf[2:-1:2].sum())

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def t_mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` and its Student t interval (mean ± t · s / √n).

    One value gives a zero-width interval at the value (no spread to estimate)."""
    v = _interval_values(values, confidence, "interval")
    mean = float(v.mean())
    if v.size == 1:
        return mean, mean, mean
    half = student_t_quantile(0.5 + confidence / 2, v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return mean, mean - half, mean + half


#: interval methods of `paired_ratio_summary`
INTERVAL_METHODS = ("bootstrap", "t")


@dataclass(frozen=True)
class RatioSummary:
    """Paired ratios (candidate / reference; < 1 means the candidate costs less) summarised."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float
    verdict: str  # "better" | "worse" | "not resolved"
    worst: float
    best: float

    @property
    def resolved(self) -> bool:
        return self.verdict != "not resolved"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self, digits: int = 3) -> str:
        """"0.912× [0.870, 0.951] better" style."""
        f = f"{{:.{digits}f}}"
        return f"{f.format(self.mean)}× [{f.format(self.low)}, {f.format(self.high)}] {self.verdict}"


def paired_ratio_summary(ratios: Sequence[float], confidence: float = 0.95, seed: int = 0,
                         draws: int = BOOTSTRAP_DRAWS, method: str = "bootstrap") -> RatioSummary:
    """The mean of paired ratios, its interval (`method`: "bootstrap", percentile, over tasks;
    "t", Student t, for a few measuring rounds) and the verdict against 1."""
    if method not in INTERVAL_METHODS:
        raise InputError(f"interval method must be one of {INTERVAL_METHODS}, got {method!r}")
    r = np.asarray(ratios, np.float64).ravel()
    if r.size == 0:
        raise InputError("no paired ratios to summarise")
    if np.any(r <= 0) or not np.all(np.isfinite(r)):
        raise InputError("paired ratios must be positive and finite")
    mean, lo, hi = bootstrap_mean_ci(r, confidence, draws, seed) if method == "bootstrap" else t_mean_ci(r, confidence)
    if r.size >= 2 and hi < 1.0:
        verdict = "better"
    elif r.size >= 2 and lo > 1.0:
        verdict = "worse"
    else:
        verdict = "not resolved"
    return RatioSummary(mean, lo, hi, int(r.size), float(confidence), verdict, float(r.max()), float(r.min()))
