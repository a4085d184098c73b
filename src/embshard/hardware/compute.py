"""Timing the embedding kernels of many devices (shard sets), interleaved, under one protocol.

`measure_compute` takes a list of shard sets (one per device of one or many plans, or the
random shards of cost-data collection) and times one training step (forward + backward with
the fused update) of each under a `MeasurementProtocol`: the measuring process pinned to one
core with a fixed thread count and a caching allocator; `visits` rounds A B C A B C ..., so
drift of the machine hits all alike; at each visit the set's weights are read once (resident),
then `warmups` untimed steps and `repetitions` timed ones, each on its own batch. The batches
of set k are drawn from the seed [seed, k, input set, j], so every visit (unless
`fresh_inputs`) and every session that uses the same seed times the same work.

Memory: kernels are kept between visits while their weights fit `max_cached_bytes`, and the
batches a set replays while they fit in half of it; beyond that a set's kernel is rebuilt (and
its batches drawn again, the same ones) at every visit: slower, but bounded memory.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from embshard.hardware.backends import DeviceKernel, ShardInput, make_kernel
from embshard.hardware.protocol import (
    MeasurementProtocol,
    Stopwatch,
    Timing,
    measuring_process,
)

#: The seed component of a visit's warm-up batch (timed batches use 0..repetitions-1).
_WARMUP_BATCH = 1 << 20


def set_rng(seed: int, item: int, inputs: int, batch: int) -> np.random.Generator:
    """The generator of batch `batch` of input set `inputs` of item `item`."""
    return np.random.default_rng([int(seed), int(item), int(inputs), int(batch)])


def _batch_bytes(batch: Any) -> int:
    return sum(int(i.numel() * i.element_size() + o.numel() * o.element_size()) for i, o in batch.per_shard)


def measure_compute(
    shard_sets: Sequence[Sequence[ShardInput]],
    batch_size: int | Sequence[int],
    backend: str = "fbgemm",
    device: str = "cpu",
    optimizer: str | Sequence[str] = "sgd",
    protocol: MeasurementProtocol | None = None,
    seed: int = 0,
    progress: bool = False,
    max_cached_bytes: int = 2 << 30,
    item_seeds: Sequence[int] | None = None,
) -> list[Timing]:
    """The protocol's statistic, spread and noise (ms) of one fw+bw step of each set's kernel.

    Args:
        shard_sets: per "device", the shards its kernel holds; an empty set costs 0.
        batch_size: bags per table per step (the global batch: a device pools its shards
            for every sample before the all-to-all); one for all sets, or one per set.
        backend, device, optimizer: see `backends.make_kernel` (optimizer: one for all sets, or
            one per set).
        protocol: how to time (default: `MeasurementProtocol()`).
        seed: seeds the index draws.
        progress: tqdm bar over visits.
        max_cached_bytes: weights kept alive between visits.
        item_seeds: per set, the item number its batches are drawn with (default: its
            position), so the same shard draws the same batches whatever it is measured beside.
    """
    protocol = protocol or MeasurementProtocol()
    batches = [int(batch_size)] * len(shard_sets) if np.isscalar(batch_size) else [int(b) for b in batch_size]
    if len(batches) != len(shard_sets):
        raise ValueError(f"{len(shard_sets)} shard sets but {len(batches)} batch sizes")
    items = list(item_seeds) if item_seeds is not None else list(range(len(shard_sets)))
    optimizers = [optimizer] * len(shard_sets) if isinstance(optimizer, str) else list(optimizer)
    visits: list[list[list[float]]] = [[] for _ in shard_sets]
    nonempty = [k for k, s in enumerate(shard_sets) if len(s) > 0]
    cache: dict[int, DeviceKernel] = {}
    cached_bytes = 0
    # the batches of a set replayed at every visit: drawn once while they fit beside the kernels
    inputs_cache: dict[int, tuple[list, list]] = {}
    input_bytes = 0
    bar = None
    if progress and nonempty:
        from tqdm import tqdm

        bar = tqdm(total=protocol.visits * len(nonempty), desc=f"{backend} kernels", leave=False)
    try:
        with measuring_process(protocol):
            clock = Stopwatch(protocol.timer_for(device), device)
            for v in range(protocol.visits):
                inputs = protocol.visit_inputs(v)
                for k in nonempty:
                    shards = shard_sets[k]
                    kernel = cache.get(k)
                    if kernel is None:
                        kernel = make_kernel(backend, shards, batches[k], device, optimizers[k])
                        size = sum(s.nbytes for s in shards)
                        if protocol.visits > 1 and cached_bytes + size <= max_cached_bytes:
                            cache[k] = kernel
                            cached_bytes += size
                    got = inputs_cache.get(k) if not protocol.fresh_inputs else None
                    if got is None:
                        got = ([kernel.make_batch(set_rng(seed, items[k], inputs, _WARMUP_BATCH + w))
                                for w in range(protocol.warmups)],
                               [kernel.make_batch(set_rng(seed, items[k], inputs, j)) for j in range(protocol.repetitions)])
                        size = sum(_batch_bytes(b) for b in got[0] + got[1])
                        if (not protocol.fresh_inputs and protocol.visits > 1
                                and input_bytes + size <= max_cached_bytes // 2):
                            inputs_cache[k] = got
                            input_bytes += size
                    warm, timed = got
                    if protocol.touch:
                        kernel.touch()
                    for b in warm:
                        kernel.step(b)
                    visits[k].append([clock.time(lambda b=b, kern=kernel: kern.step(b)) for b in timed])
                    del kernel, warm, timed, got
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        cache.clear()
        inputs_cache.clear()
    return [protocol.summarize(v, seed=k) if v else Timing(0.0, 0.0, (0.0,) * protocol.repetitions, 0.0, 0)
            for k, v in enumerate(visits)]
