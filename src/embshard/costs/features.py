"""The per-table features every learned cost model sees (one place defines them).

A table's cost in a training step depends on the batch: lookups, bags, pooled output and the
rows touched all grow with it. So features are a function of (table, batch size). They are
raw (un-normalised); models z-score what they need with statistics saved in their checkpoints.

Two groups of columns:

* **intensive** (`INTENSIVE_NAMES`): what one lookup of the table is like: sizes (log rows,
  dim, log weight bytes), pooling factor, batch, reuse (the 17-bin reuse histogram, the mean
  reuse of a touched row, the share of rows touched). A model maps them to *rates*.
* **extensive** (`EXTENSIVE_NAMES`): amounts of work that add up over the tables of a shard
  and grow with the batch: lookups, bytes those lookups read, bags, pooled output bytes, rows
  touched (and their bytes), weight bytes, and a count of 1 per piece. Units keep typical
  values near 1..100.

**No invented features.** A table without a reuse histogram gets the one the calibrated
synthetic model expects for its rows and pooling factor at the task's batch
(`imputed_histogram`), which is also the distribution the measured evaluator draws its
indices from (`embshard.data.indices`), so prediction and measurement see the same table.
`planning_view(task)` gives the task with every histogram filled in this way and the names of
the tables that were imputed (the report flags them).

**Traced tables are seen as they are replayed.** A table with a trace is measured by replaying
`batch_size` bags drawn with replacement from the trace's bags (`embshard.data.indices`), so
at a batch of λ × the trace's bags every bag comes back Poisson(λ) times: a row read c times
in the trace is read Poisson(λ·c) times, and the rows a step touches are not the trace's
(λ = 4 at batch 16384 from a 4096-bag trace: each touched row is read about four times as
often; even at λ = 1, a third of the bags are left out). The histogram the trace records is
that of all its bags once. `planning_view` and the collector's records (`piece_histogram`)
give a traced table the histogram of its replay at the task's batch (`replay_histogram`), so
features describe what the kernels run on.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from embshard.tables import NUM_REUSE_BINS, Table

#: Representative access count of a row in each reuse bin: the mean of the integers in
#: (0,1], (1,2], (2,4], ..., (16384,32768], and 65536 for the open last bin.
_BIN_COUNT = np.array(
    [1.0, 2.0] + [((2 ** (k - 1) + 1) + 2**k) / 2.0 for k in range(2, 16)] + [65536.0], dtype=np.float64
)

INTENSIVE_NAMES: tuple[str, ...] = (
    "log_rows",
    "log2_dim",
    "log_size_bytes",
    "log1p_pooling_factor",
    "log2_batch",
    "log1p_lookups",
    "log_mean_reuse",
    "touched_row_share",
    "bytes_per_element",
    *(f"reuse_bin_{k}" for k in range(NUM_REUSE_BINS)),
)
EXTENSIVE_NAMES: tuple[str, ...] = (
    "lookups_1e4",       # pooling factor x batch / 1e4
    "lookup_mb",         # bytes those lookups read: x dim x bytes per element / 1e6
    "bags_1e4",          # batch / 1e4 (one bag per sample per piece)
    "output_mb",         # pooled output (and its gradient) bytes: batch x dim x 4 / 1e6
    "touched_rows_1e4",  # expected distinct rows touched per step / 1e4
    "touched_mb",        # their bytes (what the fused update writes) / 1e6
    "weight_mb",         # the piece's weight bytes / 1e6
    "pieces",            # 1 per piece
)
FEATURE_NAMES: tuple[str, ...] = INTENSIVE_NAMES + EXTENSIVE_NAMES
NUM_INTENSIVE = len(INTENSIVE_NAMES)
NUM_EXTENSIVE = len(EXTENSIVE_NAMES)
NUM_FEATURES = len(FEATURE_NAMES)
OUTPUT_BYTES_PER_ELEMENT = 4


# ----------------------------------------------------------------------------- histograms
_IMPUTED: dict[tuple[int, float, int], tuple[float, ...]] = {}
_IMPUTED_MAX = 65536
_FLAT = (1.0,) + (0.0,) * (NUM_REUSE_BINS - 1)


def imputed_histograms(keys: Sequence[tuple[int, float, int]]) -> list[tuple[float, ...]]:
    """`imputed_histogram(*key)` for every (rows, pooling_factor, batch_size) of `keys`, the
    ones not yet known computed together (one Poisson call per many tables)."""
    from embshard.data import synthetic as syn

    keys = [(int(r), float(pf), int(b)) for r, pf, b in keys]
    todo = sorted({k for k in keys if k not in _IMPUTED and k[1] * k[2] > 0})
    if todo:
        if len(_IMPUTED) + len(todo) > _IMPUTED_MAX:
            _IMPUTED.clear()
        bins = syn.expected_row_bins_many(
            [(r, syn.expected_zipf(r), syn.DEFAULT_Q, pf * b) for r, pf, b in todo], ratio=1.15
        )
        for k, row_bins in zip(todo, bins):
            total = float(row_bins.sum())
            _IMPUTED[k] = _FLAT if total <= 0 else tuple(round(float(x) / total, 6) for x in row_bins)
    return [_IMPUTED[k] if k[1] * k[2] > 0 else _FLAT for k in keys]


def pending_imputations(tables: Sequence[Table], batch_size: int) -> list[tuple[int, float, int]]:
    """The (rows, pooling_factor, batch_size) keys of the untraced tables of `tables` without a
    reuse histogram whose imputed one is not known yet (each once)."""
    keys = {(int(t.rows), float(t.pooling_factor), int(batch_size)) for t in tables
            if t.trace is None and not _has_histogram(t)}
    return sorted(k for k in keys if k not in _IMPUTED and k[1] * k[2] > 0)


def adopt_imputed(imputed: Mapping[tuple[int, float, int], tuple[float, ...]]) -> None:
    """Take imputed histograms computed elsewhere (`imputed_histograms` in another process) as known."""
    if len(_IMPUTED) + len(imputed) > _IMPUTED_MAX:
        _IMPUTED.clear()
    _IMPUTED.update(imputed)


def impute_ahead(tables: Sequence[Table], batch_size: int) -> None:
    """Impute, together, the reuse histograms that `with_histogram` will give the untraced
    tables of `tables` without one (one Poisson call per many tables instead of one per
    table: the same values, cached for it)."""
    imputed_histograms(pending_imputations(tables, batch_size))


def imputed_histogram(rows: int, pooling_factor: float, batch_size: int) -> tuple[float, ...]:
    """The reuse histogram (share of touched rows per reuse bin) the calibrated synthetic
    model expects for a table of `rows` rows and `pooling_factor` at `batch_size`: its Zipf
    exponent is the mixture's expected exponent for that many rows
    (`synthetic.expected_zipf`), the one the measured evaluator also draws with."""
    return imputed_histograms([(rows, pooling_factor, batch_size)])[0]


# ----------------------------------------------------------------------------- traced tables
#: Upper edges of the reuse bins as access counts (bin k holds counts in (edge[k], edge[k+1]];
#: the last bin everything above 32768); `embshard.tables.reuse_bin` bins the same way.
_BIN_EDGES = np.array([0.0, 1.0] + [float(2**k) for k in range(1, 16)], dtype=np.float64)


def _poisson_bin_shares(mu: np.ndarray) -> np.ndarray:
    """[n, NUM_REUSE_BINS]: P(Poisson(mu_i) falls in reuse bin k), k = 0 .. 16 (bin 0 is a
    count of 1; a count of 0, a row not touched, is in no bin)."""
    import torch

    m = torch.as_tensor(np.asarray(mu, dtype=np.float64).reshape(-1, 1))
    edges = torch.as_tensor(_BIN_EDGES).reshape(1, -1)
    # P(X <= k) = Q(k + 1, mu), the regularised upper incomplete gamma function
    cdf = torch.special.gammaincc(edges + 1.0, m.expand(-1, edges.shape[1])).numpy()
    return np.diff(np.concatenate([cdf, np.ones((cdf.shape[0], 1))], axis=1), axis=1)


@functools.lru_cache(maxsize=64)
def _replay_matrix(ratio: float) -> np.ndarray:
    """[bins, bins] read-only: row k, where a row of reuse bin k lands when replayed at
    `ratio` (one per ratio: every table of a trace file shares its ratio, and a planning view
    of thousands of tables would otherwise evaluate the gamma function once per table)."""
    m = _poisson_bin_shares(_BIN_COUNT * ratio)
    m.setflags(write=False)
    return m


def replay_histogram(hist: Sequence[float], ratio: float) -> tuple[float, ...]:
    """The reuse histogram of a trace replayed at `ratio` × its bags (bags drawn with
    replacement, as `embshard.data.indices` replays), from the histogram of the trace itself:
    a row of reuse bin k (read about `_BIN_COUNT[k]` times) is read Poisson(ratio × that)
    times; the result is the share of the touched rows per bin."""
    h = np.asarray(hist, dtype=np.float64)
    if h.shape != (NUM_REUSE_BINS,) or h.sum() <= 0 or not ratio > 0:
        raise ValueError(f"replay_histogram needs {NUM_REUSE_BINS} shares summing above 0 and a ratio > 0")
    new = (h / h.sum()) @ _replay_matrix(float(ratio))
    return tuple([round(x, 6) for x in (new / new.sum()).tolist()])


def trace_histogram(access_counts: np.ndarray, ratio: float) -> tuple[float, ...]:
    """`replay_histogram` from the trace's own access count of every row (exact per row
    instead of per bin): for a traced table that comes without a histogram."""
    c = np.asarray(access_counts)
    c = c[c > 0]
    if c.size == 0:
        return _FLAT
    counts, rows = np.unique(c, return_counts=True)
    new = rows.astype(np.float64) @ _poisson_bin_shares(counts.astype(np.float64) * float(ratio))
    return tuple([round(x, 6) for x in (new / new.sum()).tolist()])


_WARNED_TRACES: set[str] = set()


def replayed_table(table: Table, batch_size: int, bags: dict[str, int] | None = None) -> Table:
    """`table` with the reuse histogram its replay at `batch_size` has, when it has a trace
    (the module docstring); unchanged otherwise, or when the trace file cannot be read (a
    warning says so once per file; measuring it would fail on the same file). `bags`: the
    bags of the trace files already looked up (file -> bags), filled in here: a caller that
    replays many tables of one file stats the file once, not once per table."""
    if table.trace is None:
        return table
    from embshard.data.dlrm_datasets import load_trace, trace_bags
    from embshard.errors import InputError

    try:
        n = None if bags is None else bags.get(table.trace.file)
        if n is None:
            n = trace_bags(table.trace)
            if bags is not None:
                bags[table.trace.file] = n
        ratio = int(batch_size) / n
        if _has_histogram(table):
            hist = replay_histogram(table.reuse_histogram, ratio)
        else:
            idx, _ = load_trace(table.trace)
            hist = trace_histogram(np.bincount(idx.numpy()), ratio)
    except InputError as e:
        if table.trace.file not in _WARNED_TRACES:
            _WARNED_TRACES.add(table.trace.file)
            import warnings

            warnings.warn(f"table {table.name!r}: its trace cannot be read ({str(e).splitlines()[0]}); the cost "
                          f"models see its reuse histogram as given, not as the replay at batch {batch_size}",
                          stacklevel=2)
        return table
    return replace(table, reuse_histogram=hist)


def piece_histogram(table: Table, batch_size: int) -> tuple[Table, bool]:
    """(`table` with the histogram the cost models see at `batch_size`, whether it was
    imputed): a traced table's replay (`replayed_table`), else `with_histogram`."""
    if table.trace is not None:
        t = replayed_table(table, batch_size)
        if _has_histogram(t):
            return t, False
    return with_histogram(table, batch_size)


def _has_histogram(table: Table) -> bool:
    return table.reuse_histogram is not None and sum(table.reuse_histogram) > 0


def _histogram_of(table: Table, batch_size: int) -> tuple[tuple[float, ...], bool]:
    """(the reuse histogram a cost model sees for `table` at `batch_size`, whether it was imputed)."""
    if _has_histogram(table):
        return table.reuse_histogram, False
    return imputed_histogram(table.rows, table.pooling_factor, int(batch_size)), True


def with_histogram(table: Table, batch_size: int) -> tuple[Table, bool]:
    """(`table` with a reuse histogram, whether it was imputed)."""
    hist, imputed = _histogram_of(table, batch_size)
    return (replace(table, reuse_histogram=hist) if imputed else table), imputed


#: how a traced table's reuse histogram reaches a cost model: "replay" (its replay at the task's
#: batch, `replayed_table`) or "given" (the trace's own, the behaviour before 2026-11-27)
TRACE_HISTOGRAMS = ("replay", "given")

_LAST_VIEW: list = [None, None, None]  # (task, its planning view, replay_traces): tasks are frozen, so identity is enough


def planning_view(task, replay_traces: bool = True):
    """(`task` with every table's reuse histogram present, names of the imputed tables): a
    traced table's as its replay at the task's batch (`replayed_table`; as the task gives it
    with `replay_traces=False`, the behaviour before 2026-11-27, kept for comparisons).

    Only cost models see this view; plans, memory and the measured evaluator use the task
    as given (whose trace-less tables draw indices from the same distribution)."""
    if _LAST_VIEW[0] is task and _LAST_VIEW[2] == replay_traces:
        return _LAST_VIEW[1][0], list(_LAST_VIEW[1][1])
    bags: dict[str, int] = {}
    tables = [replayed_table(t, task.batch_size, bags) if replay_traces else t for t in task.tables]
    missing = [i for i, t in enumerate(tables) if not _has_histogram(t)]
    hists = imputed_histograms([(tables[i].rows, tables[i].pooling_factor, task.batch_size) for i in missing])
    for i, hist in zip(missing, hists):
        tables[i] = replace(tables[i], reuse_histogram=hist)
    imputed = [tables[i].name for i in missing]
    changed = any(a is not b for a, b in zip(tables, task.tables))
    view = (replace(task, tables=tuple(tables)), imputed) if changed else (task, [])
    _LAST_VIEW[:] = [task, view, replay_traces]
    return view[0], list(view[1])


def mean_reuse(hist: Sequence[float]) -> float:
    """Mean accesses per touched row implied by a reuse histogram (>= 1)."""
    h = np.asarray(hist, dtype=np.float64)
    s = h.sum()
    if s <= 0:
        return 1.0
    return max(1.0, float((h / s) @ _BIN_COUNT))


# ----------------------------------------------------------------------------- features
def table_features(table: Table, batch_size: int) -> np.ndarray:
    """Raw feature vector of one table (or piece) at `batch_size` (float32, NUM_FEATURES).

    A table without a reuse histogram is given its imputed one (see the module docstring);
    callers that want the flag use `with_histogram` / `planning_view` first."""
    # the histogram `with_histogram` would give the table, without building that table (a
    # planner asks for thousands of pieces' features)
    hist, _ = _histogram_of(table, batch_size)
    b = float(batch_size)
    bpe = float(table.bytes_per_element)
    lookups = table.pooling_factor * b
    reuse = mean_reuse(hist)
    touched = min(float(table.rows), lookups / reuse) if lookups > 0 else 0.0
    size = table.rows * table.dim * bpe
    return np.array(
        [
            math.log(table.rows),
            math.log2(table.dim),
            math.log(size),
            math.log1p(table.pooling_factor),
            math.log2(b),
            math.log1p(lookups),
            math.log(reuse),
            touched / table.rows,
            bpe,
            *hist,
            lookups / 1e4,
            lookups * table.dim * bpe / 1e6,
            b / 1e4,
            b * table.dim * OUTPUT_BYTES_PER_ELEMENT / 1e6,
            touched / 1e4,
            touched * table.dim * bpe / 1e6,
            size / 1e6,
            1.0,
        ],
        dtype=np.float32,
    )


def shard_features(tables: Sequence[Table], batch_size: int) -> np.ndarray:
    """[len(tables), NUM_FEATURES] features of the tables (pieces) of one device's shard."""
    if not tables:
        return np.zeros((0, NUM_FEATURES), np.float32)
    return np.stack([table_features(t, batch_size) for t in tables])
