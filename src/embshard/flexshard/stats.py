"""Per-row access statistics of a task's tables, from traces: fitted on earlier batches only.

A trace (dlrm_datasets format, real or synthetic) holds, per table, a run of samples (bags;
for a sequence table each bag is one sample's id sequence). Training step i of a task with
global batch B reads samples [i*B, (i+1)*B) of every table, and device r of D takes samples
[i*B + r*B/D, i*B + (r+1)*B/D) of the step. A `BatchSplit` names the steps a planner may
learn from (the first `fit_batches`) and the later steps an evaluation replays, so a plan is
never scored on the batches it was fitted to. Tables without a trace get batches drawn from
their features (embshard.data.indices), seeded per table and step.

Counting is vectorised and streamed: a bincount over chunks of ids when the table is dense
enough, a sort-and-merge of (id, count) pairs otherwise, so tables of 10^7+ rows cost memory
in proportion to the rows actually touched.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from embshard.errors import InputError
from embshard.tables import Table, _is_int
from embshard.task import Task

#: ids counted per chunk (bounds the temporary memory of one count)
CHUNK_IDS = 1 << 24


@dataclass(frozen=True)
class BatchSplit:
    """Which training steps are for fitting a plan and which for evaluating it.

    Args:
        fit_batches: steps 0 .. fit_batches-1 are what planners see.
        eval_batches: steps fit_batches .. fit_batches+eval_batches-1 are replayed by evaluation.
        seed: seeds the batches of tables without a trace.
    """

    fit_batches: int = 4
    eval_batches: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("fit_batches", "eval_batches"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise InputError(f"{name} must be a positive integer, got {v!r}")

    @property
    def fit_steps(self) -> range:
        return range(self.fit_batches)

    @property
    def eval_steps(self) -> range:
        return range(self.fit_batches, self.fit_batches + self.eval_batches)


def step_batch(table: Table, batch_size: int, step: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64, lengths int64 [batch_size]) of one table in training step `step`.

    Traced tables replay samples [step*B, (step+1)*B) in order; ids beyond the table's rows
    wrap modulo rows (as embshard.data.indices does). Others are drawn, seeded by (seed, table, step).
    """
    if table.trace is None:
        from embshard.data.indices import batch_indices

        rng = np.random.default_rng([int(seed), zlib.crc32(table.name.encode()), int(step)])
        idx, off = batch_indices(table, batch_size, rng)
        return idx.numpy(), np.diff(off.numpy())
    ids, lengths = _trace_span(table, batch_size * step, batch_size * (step + 1))
    return ids, lengths


def _trace_span(table: Table, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """ids and bag lengths of samples [first, last) of a traced table (ids wrapped modulo rows)."""
    from embshard.data.dlrm_datasets import load_trace

    idx_t, off_t = load_trace(table.trace)
    samples = off_t.numel() - 1
    if last > samples:
        raise InputError(
            f"table {table.name!r}: its trace {table.trace.file} (table {table.trace.table_index}) has "
            f"{samples} samples, {last} are needed (fit + eval batches x batch size)"
        )
    off = off_t.numpy()
    ids = idx_t.numpy()[off[first]:off[last]]
    if ids.size and int(ids.max()) >= table.rows:
        ids = np.remainder(ids, table.rows)
    return ids.astype(np.int64, copy=False), np.diff(off[first:last + 1])


@dataclass(frozen=True)
class AccessStats:
    """Access counts of one table's rows over the fit steps.

    `ids` are the rows accessed at least once, hottest first (ties by id); `counts` their
    accesses over `steps` steps. Rows not listed were never accessed.
    """

    table: str
    rows: int
    steps: int
    ids: np.ndarray
    counts: np.ndarray

    @property
    def per_step(self) -> np.ndarray:
        """Expected accesses per training step, hottest first."""
        return self.counts / self.steps

    @property
    def total(self) -> int:
        return int(self.counts.sum())


def count_rows(chunks, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, counts) of every row seen in `chunks` (iterables of int64 id arrays), hottest first."""
    dense = None
    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    for ids in chunks:
        if ids.size == 0:
            continue
        if rows <= 8 * ids.size + (1 << 20):
            if dense is None:
                dense = np.zeros(rows, dtype=np.int64)
            dense += np.bincount(ids, minlength=rows)
        else:
            pairs.append(np.unique(ids, return_counts=True))
    if pairs:
        u = np.concatenate([p[0] for p in pairs] + ([np.flatnonzero(dense)] if dense is not None else []))
        c = np.concatenate([p[1] for p in pairs] + ([dense[dense > 0]] if dense is not None else []))
        order = np.argsort(u, kind="stable")
        u, c = u[order], c[order]
        starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
        ids, counts = u[starts], np.add.reduceat(c, starts)
    elif dense is not None:
        ids = np.flatnonzero(dense)
        counts = dense[ids]
    else:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.lexsort((ids, -counts))
    return ids[order].astype(np.int64), counts[order].astype(np.int64)


def table_access_stats(table: Table, batch_size: int, split: BatchSplit) -> AccessStats:
    """Access counts of `table` over the fit steps of `split` (streamed in chunks)."""
    return _cached_stats(table, batch_size, split)


@lru_cache(maxsize=4096)
def _cached_stats(table: Table, batch_size: int, split: BatchSplit) -> AccessStats:
    if table.trace is not None:
        ids, _ = _trace_span(table, 0, batch_size * split.fit_batches)
        chunks = (ids[i:i + CHUNK_IDS] for i in range(0, max(ids.size, 1), CHUNK_IDS))
    else:
        chunks = (step_batch(table, batch_size, s, split.seed)[0] for s in split.fit_steps)
    ids, counts = count_rows(chunks, table.rows)
    return AccessStats(table.name, table.rows, split.fit_batches, ids, counts)


def task_access_stats(task: Task, split: BatchSplit, progress: bool = False) -> dict[str, AccessStats]:
    """Access statistics of every table of the task (fit steps only)."""
    from tqdm import tqdm

    return {
        t.name: table_access_stats(t, task.batch_size, split)
        for t in tqdm(task.tables, desc="access statistics", disable=not progress, leave=False)
    }
