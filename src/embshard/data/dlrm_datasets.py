"""Reader for Meta's dlrm_datasets embedding-bag files (and the synthetic ones we write).

File format (github.com/facebookresearch/dlrm_datasets): `torch.load` of the file, plain
or through `gzip.open`, returns a tuple `(indices, offsets, lengths)`:

* `lengths`: shape `[T, B]`, the bag length of every (table, sample);
* `offsets`: flat, `T*B + 1` entries, global into `indices`; table `t` owns
  `offsets[t*B : (t+1)*B + 1]`;
* `indices`: flat int64 row ids.

The real `fbgemm_t856_bs65536.pt.gz` is 4.2 GB unpacked, so nothing here copies the
whole index array: plain (zip-format) files are memory-mapped, per-table work slices views
and computes one table at a time.

Per-table features follow the research code: rows = max(index) + 1 floored at 100 (or a
declared hash size), pooling factor = mean bag length, reuse histogram = share of the
table's unique rows per access-count bin (`embshard.tables.reuse_histograms`).
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from embshard.data.synthetic import AggregateStats
from embshard.errors import InputError
from embshard.io import write_json_atomic
from embshard.tables import MIN_ROWS, NUM_REUSE_BINS, Table, TraceRef, reuse_bin
from embshard.task import read_json

_GZIP_MAGIC = b"\x1f\x8b"
#: Everything torch.load / gzip / zipfile raise on a damaged or foreign file.
_LOAD_ERRORS = (
    EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, ValueError,
    struct.error, AttributeError, ImportError, IndexError, KeyError, TypeError,
    UnicodeDecodeError,
)


# ----------------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class TableStats:
    """Features and reuse statistics of one table of one batch."""

    rows: int
    pooling_factor: float
    reuse_histogram: tuple[float, ...]   # share of unique rows per reuse bin (17)
    access_histogram: tuple[float, ...]  # share of accesses per reuse bin (17)
    num_indices: int
    num_unique: int
    max_index: int
    row_bins: np.ndarray = field(repr=False)     # unique rows per reuse bin (counts)
    access_bins: np.ndarray = field(repr=False)  # accesses per reuse bin (counts)


def access_counts(indices: np.ndarray | torch.Tensor) -> np.ndarray:
    """Access count of every distinct index (order unspecified), without copying the input
    more than once: a bincount when ids are dense enough, a sort otherwise."""
    idx = indices.numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
    if idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    mx = int(idx.max())
    if mx < 8 * idx.size + (1 << 20):
        c = np.bincount(idx, minlength=mx + 1)
        return c[c > 0]
    return np.unique(idx, return_counts=True)[1]


def trace_stats(
    indices: np.ndarray | torch.Tensor,
    batch_size: int,
    hash_size: int | None = None,
    where: str = "table",
) -> TableStats:
    """Features of one table from its flat indices over a batch of `batch_size` bags.

    This is the single place where statistics are computed: the reader, the synthetic
    generator's calibration and the tests all call it.
    """
    idx = indices.numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
    if idx.size and idx.dtype != np.int64:
        idx = idx.astype(np.int64)
    counts = access_counts(idx)
    max_index = int(idx.max()) if idx.size else -1
    if idx.size and int(idx.min()) < 0:
        raise InputError(f"{where}: negative indices")
    if hash_size is not None:
        if max_index >= hash_size:
            raise InputError(
                f"{where}: index {max_index} is out of range for the declared hash size {hash_size}"
            )
        rows = int(hash_size)
    else:
        rows = max(max_index + 1, MIN_ROWS)
    if counts.size:
        bins = reuse_bin(counts)
        row_bins = np.bincount(bins, minlength=NUM_REUSE_BINS).astype(np.float64)
        access_bins = np.bincount(bins, weights=counts.astype(np.float64), minlength=NUM_REUSE_BINS)
        rh = tuple(float(x) for x in row_bins / row_bins.sum())
        ah = tuple(float(x) for x in access_bins / access_bins.sum())
    else:
        row_bins = np.zeros(NUM_REUSE_BINS)
        access_bins = np.zeros(NUM_REUSE_BINS)
        rh = ah = (0.0,) * NUM_REUSE_BINS
    return TableStats(
        rows=rows,
        pooling_factor=float(idx.size) / batch_size,
        reuse_histogram=rh,
        access_histogram=ah,
        num_indices=int(idx.size),
        num_unique=int(counts.size),
        max_index=max_index,
        row_bins=row_bins,
        access_bins=access_bins,
    )


def aggregate(stats: Iterable[TableStats], batch_size: int) -> AggregateStats:
    """Sum per-table statistics into the dataset's published aggregate quantities.

    Row ids of different tables are different rows, so unique rows add up and the
    aggregate histograms are the per-table bin counts summed.
    """
    n = u = t = 0
    rb = np.zeros(NUM_REUSE_BINS)
    ab = np.zeros(NUM_REUSE_BINS)
    for s in stats:
        n += s.num_indices
        u += s.num_unique
        rb += s.row_bins
        ab += s.access_bins
        t += 1
    return AggregateStats(t, batch_size, float(n), float(u), rb, ab)


# ----------------------------------------------------------------------------- the file
def _load_tuple(path: Path) -> Any:
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic == _GZIP_MAGIC:
            with gzip.open(path, "rb") as f:
                return torch.load(f, map_location="cpu", weights_only=True)
        # Zip-format files (torch.save's default) are memory-mapped: no copy in RAM.
        mmap = zipfile.is_zipfile(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except _LOAD_ERRORS as e:
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else "no detail"
        kind = "truncated or damaged" if isinstance(e, (EOFError, zipfile.BadZipFile)) else "unreadable"
        raise InputError(
            f"{path}: {kind} dlrm_datasets file ({type(e).__name__}: {msg})"
        ) from None


#: `_validate` checks the offsets of this many bags at a time (its temporaries' size)
VALIDATE_BAGS = 1 << 22


def _validate(path: Path, obj: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    where = str(path)
    if not isinstance(obj, (tuple, list)):
        raise InputError(f"{where}: expected a tuple (indices, offsets, lengths), got {type(obj).__name__}")
    if len(obj) != 3:
        raise InputError(f"{where}: expected a tuple (indices, offsets, lengths), got {len(obj)} items")
    names = ("indices", "offsets", "lengths")
    for name, x in zip(names, obj):
        if not isinstance(x, torch.Tensor):
            raise InputError(f"{where}: {name} must be a tensor, got {type(x).__name__}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise InputError(f"{where}: {name} must be an integer tensor, got {x.dtype}")
    indices, offsets, lengths = obj
    for name, x, rank in (("indices", indices, 1), ("offsets", offsets, 1), ("lengths", lengths, 2)):
        if x.dim() != rank:
            raise InputError(f"{where}: {name} must have rank {rank}, got shape {tuple(x.shape)}")
    T, B = lengths.shape
    if T == 0 or B == 0:
        raise InputError(f"{where}: lengths has shape {(T, B)}: no tables or an empty batch")
    if offsets.numel() != T * B + 1:
        raise InputError(
            f"{where}: offsets has {offsets.numel()} entries, expected T*B+1 = {T * B + 1} "
            f"for lengths of shape {(T, B)}"
        )
    if int(offsets[0]) != 0:
        raise InputError(f"{where}: offsets[0] is {int(offsets[0])}, expected 0")
    if int(offsets[-1]) != indices.numel():
        raise InputError(
            f"{where}: offsets[-1] is {int(offsets[-1])} but there are {indices.numel()} indices"
        )
    # a chunk of tables at a time (temporaries of a few million bags, whatever the file's size);
    # the first table with a fault is reported, a decreasing offset before a wrong length
    step = max(1, VALIDATE_BAGS // B)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        o = offsets[t0 * B : t1 * B + 1]
        d = o[1:] - o[:-1]
        want = lengths[t0:t1].reshape(-1).to(d.dtype)
        neg, off = d < 0, d != want
        if not bool(neg.any()) and not bool(off.any()):
            continue
        t = t0 + int(torch.nonzero(neg | off)[0]) // B  # the first table with a fault
        dt, lt = d[(t - t0) * B : (t - t0 + 1) * B], lengths[t].to(d.dtype)
        if bool((dt < 0).any()):
            bag = int(torch.nonzero(dt < 0)[0])
            raise InputError(f"{where}: offsets decrease at table {t}, bag {bag} (not monotone)")
        bag = int(torch.nonzero(dt != lt)[0])
        raise InputError(
            f"{where}: lengths[{t}, {bag}] = {int(lengths[t, bag])} disagrees with the offsets ({int(dt[bag])})"
        )
    if indices.numel() and int(indices.min()) < 0:
        raise InputError(f"{where}: negative indices (min {int(indices.min())})")
    return indices, offsets, lengths


class DlrmDataset:
    """One dlrm_datasets file: T tables × one batch of B bags.

    Args:
        path: the file (plain, zip-format; or gzip-compressed).
        hash_sizes: optional declared hash size per table (rows); otherwise rows are
            derived as max(index) + 1 floored at 100.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        lengths: torch.Tensor,
        hash_sizes: Sequence[int] | None = None,
    ) -> None:
        self.path = Path(path)
        self.indices = indices
        self.offsets = offsets
        self.lengths = lengths
        T = self.num_tables
        if hash_sizes is not None:
            hs = list(hash_sizes)
            if len(hs) != T:
                raise InputError(f"{self.path}: {len(hs)} hash sizes given for {T} tables")
            for t, h in enumerate(hs):
                if not isinstance(h, (int, np.integer)) or isinstance(h, bool) or h <= 0:
                    raise InputError(f"{self.path}: hash size of table {t} must be a positive integer, got {h!r}")
            self.hash_sizes: list[int] | None = [int(h) for h in hs]
        else:
            self.hash_sizes = None
        self._stats: dict[int, TableStats] = {}

    @classmethod
    def open(cls, path: str | os.PathLike, hash_sizes: Sequence[int] | None = None) -> "DlrmDataset":
        p = Path(path)
        indices, offsets, lengths = _validate(p, _load_tuple(p))
        return cls(p, indices, offsets, lengths, hash_sizes)

    # -------------------------------------------------------------- shape
    @property
    def num_tables(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[1])

    @property
    def num_indices(self) -> int:
        return int(self.indices.numel())

    def _check_table(self, t: int) -> int:
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < self.num_tables:
            raise InputError(f"{self.path}: no table {t!r} (the file has {self.num_tables})")
        return int(t)

    def _span(self, t: int) -> tuple[int, int]:
        B = self.batch_size
        return int(self.offsets[t * B]), int(self.offsets[(t + 1) * B])

    # -------------------------------------------------------------- per table
    def trace(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices int64, offsets int64 [B + 1] starting at 0) of table `t`.

        The indices are a view into the file's tensor where it is int64 already.
        """
        t = self._check_table(t)
        B = self.batch_size
        a, b = self._span(t)
        idx = self.indices[a:b]
        if idx.dtype != torch.int64:
            idx = idx.to(torch.int64)
        off = self.offsets[t * B : (t + 1) * B + 1].to(torch.int64) - a
        return idx, off

    def table_stats(self, t: int) -> TableStats:
        """rows, pooling factor, reuse histograms of table `t` (cached)."""
        t = self._check_table(t)
        if t not in self._stats:
            a, b = self._span(t)
            hs = self.hash_sizes[t] if self.hash_sizes is not None else None
            self._stats[t] = trace_stats(
                self.indices[a:b], self.batch_size, hs, where=f"{self.path}: table {t}"
            )
        return self._stats[t]

    def aggregate_stats(self) -> AggregateStats:
        """The published aggregate quantities: indices, unique rows, both histograms."""
        return aggregate((self.table_stats(t) for t in range(self.num_tables)), self.batch_size)

    # -------------------------------------------------------------- tables
    def trace_ref(self, t: int) -> TraceRef:
        return TraceRef(str(self.path.resolve()), self._check_table(t))

    def pool_entries(self, prefix: str = "t", bytes_per_element: int = 4) -> list[dict[str, Any]]:
        """Table-pool entries: every Table field but `dim` (assigned per task)."""
        out = []
        for t in range(self.num_tables):
            s = self.table_stats(t)
            ref = self.trace_ref(t)
            out.append({
                "name": f"{prefix}{t}",
                "rows": s.rows,
                "pooling_factor": s.pooling_factor,
                # a table without accesses has no histogram (its shares would not sum to 1)
                "reuse_histogram": list(s.reuse_histogram) if s.num_unique else None,
                "bytes_per_element": bytes_per_element,
                "trace": {"file": ref.file, "table_index": ref.table_index},
            })
        return out

    def tables(self, dim: int = 64, prefix: str = "t", bytes_per_element: int = 4) -> list[Table]:
        """Every table of the file as a `Table` of width `dim` with a trace reference."""
        return [
            Table.from_dict({**e, "dim": dim})
            for e in self.pool_entries(prefix=prefix, bytes_per_element=bytes_per_element)
        ]


# ----------------------------------------------------------------------------- table pools
def write_table_pool(
    path: str | os.PathLike,
    dataset: DlrmDataset | str | os.PathLike,
    prefix: str = "t",
    hash_sizes: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Write the table pool of a dataset file as a JSON list of table dicts (atomically)."""
    ds = dataset if isinstance(dataset, DlrmDataset) else DlrmDataset.open(dataset, hash_sizes)
    entries = ds.pool_entries(prefix=prefix)
    write_json_atomic(path, entries)
    return entries


_POOL_FIELDS = {"name", "rows", "pooling_factor", "reuse_histogram", "bytes_per_element", "trace", "dim"}


def read_table_pool(path: str | os.PathLike) -> list[dict[str, Any]]:
    """A table pool written by `write_table_pool`, validated (each entry must make a Table)."""
    data = read_json(path)
    if isinstance(data, dict) and "tables" in data:
        data = data["tables"]
    if not isinstance(data, list) or not data:
        raise InputError(f"{path}: a table pool must be a non-empty JSON list of tables")
    names = set()
    for i, e in enumerate(data):
        if not isinstance(e, dict):
            raise InputError(f"{path}: pool entry {i} is not an object")
        unknown = set(e) - _POOL_FIELDS
        if unknown:
            raise InputError(f"{path}: pool entry {i}: unknown field(s) {sorted(unknown)}")
        try:
            Table.from_dict({"dim": 4, **e})
        except InputError as err:
            raise InputError(f"{path}: pool entry {i}: {err}") from None
        if e["name"] in names:
            raise InputError(f"{path}: duplicate table name {e['name']!r} in the pool")
        names.add(e["name"])
    return data


# ----------------------------------------------------------------------------- trace replay
_CACHE: "OrderedDict[tuple[str, int, int], DlrmDataset]" = OrderedDict()
_CACHE_FILES = 2


def _file_key(file: str | os.PathLike) -> tuple[str, int, int]:
    """(resolved path, mtime, size) of a trace file: the caches' key (a rewritten file is new)."""
    p = Path(file).resolve()
    try:
        st = p.stat()
    except OSError:
        raise InputError(f"{file}: trace file not found") from None
    return (str(p), st.st_mtime_ns, st.st_size)


def open_cached(file: str | os.PathLike) -> DlrmDataset:
    """The dataset of `file`, loaded once per process (a small LRU keyed by file)."""
    key = _file_key(file)
    ds = _CACHE.get(key)
    if ds is None:
        ds = DlrmDataset.open(key[0])
        _CACHE[key] = ds
        while len(_CACHE) > _CACHE_FILES:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return ds


_BAGS: dict[tuple[str, int, int], int] = {}


def trace_bags(ref: TraceRef) -> int:
    """How many bags the trace of `ref` holds (its file's batch size); read once per file
    (kept apart from `open_cached`'s two-file LRU, so planning never re-loads a file for it)."""
    key = _file_key(ref.file)
    if key not in _BAGS:
        _BAGS[key] = open_cached(key[0]).batch_size
    return _BAGS[key]


def load_trace(ref: TraceRef) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, offsets from 0) of the table a trace reference names; cached per file."""
    return open_cached(ref.file).trace(ref.table_index)


def clear_trace_cache() -> None:
    _CACHE.clear()
