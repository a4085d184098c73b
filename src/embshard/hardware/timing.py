"""The one timing helper every hardware measurement uses: warm-ups, repetitions, median, IQR.

A measurement is a list of samples in milliseconds; `Timing` summarises it as the median and
the spread (interquartile range). `time_call` times one call, synchronising CUDA when the
work runs there, so asynchronous kernels are not under-counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Timing:
    """Median and spread (interquartile range) of timed samples, in milliseconds."""

    median_ms: float
    spread_ms: float
    samples_ms: tuple[float, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> "Timing":
        if len(samples_ms) == 0:
            return cls(0.0, 0.0, ())
        a = np.asarray(samples_ms, dtype=np.float64)
        q1, med, q3 = np.percentile(a, [25, 50, 75])
        return cls(float(med), float(q3 - q1), tuple(float(x) for x in a))


def synchronize(device: str | torch.device) -> None:
    """Wait for queued work on `device` (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: str | torch.device = "cpu") -> float:
    """Milliseconds one call of `fn` takes, including any queued CUDA work it launched."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def measure(
    fn: Callable[[int], object],
    warmups: int,
    repetitions: int,
    device: str | torch.device = "cpu",
) -> Timing:
    """Time `fn(i)` for `repetitions` values of i after `warmups` untimed calls.

    `fn` receives the repetition number (warm-ups get negative numbers -warmups..-1), so a
    caller can feed it a fresh, pre-generated input each time rather than one warm batch.
    """
    for w in range(warmups):
        fn(-warmups + w)
    return Timing.of([time_call(lambda i=i: fn(i), device) for i in range(repetitions)])
