"""Timing the embedding kernels of many devices (shard sets), interleaved.

`measure_compute` takes a list of shard sets (one per device of one or many plans, or the
random shards of cost-data collection) and times one training step (forward + backward with
the fused update) of each, round-robin: in every round each set gets its warm-ups and its
share of the timed repetitions, A B C A B C ..., so drift of the machine hits all alike.
Each repetition runs on a fresh, pre-generated index batch.

Memory: kernels are kept between rounds while their weights fit `max_cached_bytes`;
beyond that a set's kernel is rebuilt in every round (slower, but bounded memory).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch

from embshard.hardware.backends import DeviceKernel, ShardInput, make_kernel
from embshard.hardware.timing import Timing, synchronize, time_call


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with `n` intra-op threads (None: leave the setting alone)."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def split_repetitions(repetitions: int, rounds: int) -> list[int]:
    """Timed repetitions per round: `repetitions` spread as evenly as possible."""
    rounds = max(1, min(rounds, repetitions)) if repetitions > 0 else 1
    base, extra = divmod(repetitions, rounds)
    return [base + (1 if k < extra else 0) for k in range(rounds)]


def measure_compute(
    shard_sets: Sequence[Sequence[ShardInput]],
    batch_size: int,
    backend: str = "fbgemm",
    device: str | torch.device = "cpu",
    optimizer: str = "sgd",
    warmups: int = 3,
    repetitions: int = 10,
    rounds: int | None = None,
    seed: int = 0,
    progress: bool = False,
    max_cached_bytes: int = 2 << 30,
    num_threads: int | None = None,
) -> list[Timing]:
    """Median and spread (ms) of one fw+bw step of each shard set's fused kernel.

    Args:
        shard_sets: per "device", the shards its kernel holds; an empty set costs 0.
        batch_size: bags per table per step (the global batch: a device pools its shards
            for every sample before the all-to-all).
        backend, device, optimizer: see `backends.make_kernel`.
        warmups: untimed steps each time a set is visited (every round).
        repetitions: timed steps per set in all, split over the rounds.
        rounds: interleaving rounds (default min(repetitions, 5)).
        seed: seeds the index draws.
        progress: tqdm bar over visits.
        max_cached_bytes: weights kept alive between rounds.
        num_threads: torch intra-op threads while timing (None: unchanged).
    """
    rng = np.random.default_rng(seed)
    per_round = split_repetitions(repetitions, rounds if rounds is not None else min(repetitions, 5))
    samples: list[list[float]] = [[] for _ in shard_sets]
    nonempty = [k for k, s in enumerate(shard_sets) if len(s) > 0]
    for k, s in enumerate(shard_sets):
        if not s:
            samples[k] = [0.0] * repetitions
    cache: dict[int, DeviceKernel] = {}
    cached_bytes = 0
    bar = None
    if progress and nonempty:
        from tqdm import tqdm

        bar = tqdm(total=len(per_round) * len(nonempty), desc=f"{backend} kernels", leave=False)
    try:
        with torch_threads(num_threads):
            for reps in per_round:
                for k in nonempty:
                    shards = shard_sets[k]
                    kernel = cache.get(k)
                    if kernel is None:
                        kernel = make_kernel(backend, shards, batch_size, device, optimizer)
                        size = sum(s.nbytes for s in shards)
                        if len(per_round) > 1 and cached_bytes + size <= max_cached_bytes:
                            cache[k] = kernel
                            cached_bytes += size
                    batches = [kernel.make_batch(rng) for _ in range(warmups + reps)]
                    synchronize(device)
                    for b in batches[:warmups]:
                        kernel.step(b)
                    for b in batches[warmups:]:
                        samples[k].append(time_call(lambda b=b: kernel.step(b), device))
                    del kernel, batches
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        cache.clear()
    return [Timing.of(s) for s in samples]

