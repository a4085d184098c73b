"""Training batches for the task's DLRM: every table's indices replayed from its trace.

`TraceReplayBatches` yields `torchrec.datasets.utils.Batch`es whose sparse part is one bag
per table per sample, drawn by `embshard.data.indices.batch_indices` — the same sampler
the kernel benchmarks use: bags replayed from the table's dlrm_datasets trace (real or
synthetic) when it has one, otherwise drawn to match its pooling factor and reuse
histogram. So the embedding work of a step has the skew the planner was shown.

Dense features are standard normal. Labels come from a planted logistic model fixed by
the seed (a linear function of the dense features plus a ±1 effect per embedding row,
hashed from the row id), so the model has something to learn and the loss of a real
training run falls below log(2).

`Prefetcher` produces batches on a background thread, a few ahead, so that building the
next batch overlaps the current step; `materialize` fixes a list of batches up front
(throughput runs replay the same batches for every plan, so data loading costs nothing
inside the timed steps).
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Iterable, Iterator

import numpy as np
import torch

from embshard.errors import InputError
from embshard.task import Task

#: Weight of the embedding-row effect relative to the dense part of the planted logit.
ROW_EFFECT = 1.0
#: Knuth's multiplicative hash constant: the planted ±1 effect of a row is a bit of id * this.
_HASH = np.uint64(2654435761)


def make_batch(dense: np.ndarray, keys: list[str], lengths: list[np.ndarray], values: list[np.ndarray], labels: np.ndarray):
    """A TorchRec `Batch` from numpy arrays; `lengths`/`values` hold one array per key, in
    key order (the KJT's key-major layout)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.from_numpy(np.concatenate(values)),
        lengths=torch.from_numpy(np.concatenate(lengths)),
    )
    return Batch(
        dense_features=torch.from_numpy(dense),
        sparse_features=kjt,
        labels=torch.from_numpy(labels),
    )


class TraceReplayBatches:
    """Endless (or `num_batches`-long) stream of this rank's local batches.

    Args:
        task: the tables (with or without traces).
        batch_size: samples per batch on this rank (the task's global batch / world size).
        dense_in_features: width of the dense features.
        rank: decorrelates ranks: the generator is seeded with (seed, rank).
        seed: fixes the data and the planted label model.
        num_batches: stop after this many; None: never stop.
    """

    def __init__(
        self,
        task: Task,
        batch_size: int,
        dense_in_features: int,
        *,
        rank: int = 0,
        seed: int = 0,
        num_batches: int | None = None,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise InputError(f"batch size must be a positive integer, got {batch_size!r}")
        if not isinstance(dense_in_features, int) or dense_in_features <= 0:
            raise InputError(f"dense_in_features must be a positive integer, got {dense_in_features!r}")
        self.task, self.batch_size, self.dense_in_features = task, batch_size, dense_in_features
        self.rank, self.seed, self.num_batches = rank, seed, num_batches
        teacher = np.random.default_rng([seed, 2**31 - 1])  # the same on every rank
        self.dense_weights = (teacher.standard_normal(dense_in_features) / math.sqrt(dense_in_features)).astype(np.float32)
        self.table_salt = teacher.integers(0, 2**31, size=len(task.tables), dtype=np.uint64)

    def __iter__(self) -> Iterator:
        from embshard.data.indices import batch_indices

        rng = np.random.default_rng([self.seed, self.rank])
        keys = [t.name for t in self.task.tables]
        b = self.batch_size
        sample_of = np.arange(b)
        produced = 0
        while self.num_batches is None or produced < self.num_batches:
            dense = rng.standard_normal((b, self.dense_in_features), dtype=np.float32)
            logit = dense @ self.dense_weights
            lengths, values = [], []
            row_effect = np.zeros(b)
            for table, salt in zip(self.task.tables, self.table_salt):
                idx_t, off_t = batch_indices(table, b, rng)
                idx, off = idx_t.numpy(), off_t.numpy()
                lens = np.diff(off)
                lengths.append(lens)
                values.append(idx)
                if idx.size:
                    sign = (((idx.astype(np.uint64) ^ salt) * _HASH) >> np.uint64(15)) & np.uint64(1)
                    per_sample = np.bincount(np.repeat(sample_of, lens), weights=2.0 * sign - 1.0, minlength=b)
                    row_effect += per_sample / np.maximum(lens, 1)
            logit = logit + ROW_EFFECT * row_effect / math.sqrt(len(self.task.tables))
            labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-2.0 * logit))).astype(np.float32)
            yield make_batch(dense, keys, lengths, values, labels)
            produced += 1


def materialize(batches: Iterable, n: int) -> list:
    """The first `n` batches of `batches`, as a list (to replay with itertools.cycle)."""
    out = []
    for batch in batches:
        out.append(batch)
        if len(out) == n:
            return out
    raise InputError(f"the data gave {len(out)} batch(es), {n} were needed")


class Prefetcher:
    """Iterate `source` on a background thread, `depth` batches ahead (optionally pinned).

    Exceptions in the producer are re-raised in the consumer; closing (or garbage
    collection) stops the thread.
    """

    _DONE = object()

    def __init__(self, source: Iterable, depth: int = 4, pin_memory: bool = False) -> None:
        if depth <= 0:
            raise InputError(f"prefetch depth must be positive, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(iter(source), pin_memory), daemon=True)
        self._thread.start()

    def _produce(self, it: Iterator, pin: bool) -> None:
        try:
            for item in it:
                if not self._put(item.pin_memory() if pin else item):
                    return
            self._put(self._DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)

    def _put(self, item) -> bool:
        """Queue `item`, waiting for room; False when closed meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._DONE:
            self._queue.put(item)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # absent when __init__ raised
        if stop is not None:
            stop.set()
