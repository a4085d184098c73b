"""Streaming reader for Criteo-format TSV click logs, yielding TorchRec DLRM batches.

Format (Criteo Kaggle "Display Advertising Challenge" and Criteo 1TB/Terabyte click
logs): one sample per line, 40 tab-separated fields:

* field 0: the label, ``0`` or ``1`` (click or not);
* fields 1-13: integer dense features (counts; some files contain negative values such
  as ``-1`` or ``-2``);
* fields 14-39: 26 categorical features, each a hex string (``68fd1e64``, 32-bit
  hashes in the public files).

Any dense or categorical field may be empty, meaning missing. Lines end with ``\\n``; the
last line may lack it. Files may be plain text or gzip-compressed (``.gz``).

Choices, following the reference DLRM preprocessing:

* Dense: negatives are clamped to 0, then ``log(x + 1)``; a missing value is 0 (so it
  also maps to 0). Only the first ``dense_in_features`` dense columns are used.
* Sparse: the hex string is parsed as an integer and reduced ``% table_rows[i]``
  (hashing modulo the table's row count, so any id fits its table). One id per bag
  (length 1); a missing value is an empty bag (length 0), which TorchRec's pooled
  embedding bags turn into a zero vector. Only the first ``len(table_names)``
  categorical columns are used.
* Batches match TorchRec's own Criteo datasets: ``dense_features`` float32 ``[B, D]``,
  ``labels`` int32 ``[B]`` (as ``torchrec.datasets.criteo`` yields; ``DLRMTrain`` calls
  ``labels.float()`` before its BCE loss), ``sparse_features`` a ``KeyedJaggedTensor``
  built key-major (all of table 0's bags for the batch, then table 1's, ...) with int64
  values and int32 lengths.
* Data-parallel sharding: the files are read as one stream of lines, and rank ``r`` of
  ``world_size`` takes the lines whose global 0-based index (counted across all files
  in order) satisfies ``index % world_size == r``. Ranks therefore see disjoint samples
  that together cover every line; ``batch_size`` is the per-rank batch. Each rank only
  parses the lines it owns, so a malformed line is reported by the rank owning it.

Files are streamed line by line (never loaded whole): a rank keeps only the raw lines of
its current batch, then parses the whole batch with list comprehensions and converts it
to tensors once. A malformed line raises when its batch is parsed (before that batch is
yielded; a dropped final partial batch is still checked), naming the first bad line.
"""

from __future__ import annotations

import gzip
import itertools
import os
from typing import IO, Iterator, Sequence

import numpy as np
import torch
from torchrec.datasets.utils import Batch

from dlrm.data import make_batch
from embshard.errors import InputError

__all__ = ["CriteoTSVBatches", "NUM_DENSE", "NUM_SPARSE", "NUM_FIELDS"]

NUM_DENSE = 13
"""Integer dense columns in a Criteo line."""
NUM_SPARSE = 26
"""Categorical (hex) columns in a Criteo line."""
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
"""Tab-separated fields per line: label, dense, categorical."""


def _open_text(path: str) -> IO[str]:
    """Opens a Criteo file for streaming text reads, through gzip for ``.gz`` names.

    Only ``\\n`` ends a line (``newline="\\n"``), so a stray ``\\r`` is never taken as a
    line break; a trailing ``\\r`` is stripped by the parser.

    Args:
        path: File name.

    Returns:
        A text stream.

    Raises:
        InputError: The file is missing or cannot be opened.
    """
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "rt", encoding="utf-8", newline="\n")
        return open(path, encoding="utf-8", newline="\n")
    except OSError as e:
        raise InputError(f"{path}: cannot open Criteo file: {e.strerror or e}") from None


class CriteoTSVBatches:
    """Iterable over ``torchrec.datasets.utils.Batch`` from one or more Criteo TSV files.

    Each call to ``iter()`` re-reads the files from the start, so one object serves
    several epochs. Samples come in file order (no shuffling).

    Args:
        paths: One file or a sequence of files (plain or ``.gz``), read in order as one
            stream.
        table_names: Embedding table of categorical column ``i``; also the KJT keys, in
            this order. 1 to 26 names; fewer than 26 use the first ``k`` columns.
        table_rows: Row count of each table; ids are ``int(hex, 16) % table_rows[i]``.
        batch_size: Samples per batch on this rank.
        rank: This process's data-parallel rank.
        world_size: Number of data-parallel ranks.
        dense_in_features: The model's dense input width, 1 to 13 (first columns used).
        drop_last: Drop a final partial batch (otherwise it is yielded, smaller).

    Raises:
        InputError: A bad argument or a missing file (here), or while iterating a
            malformed line (``file:line: reason``), an unreadable file, or no batch at
            all for this rank.
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        table_names: Sequence[str],
        table_rows: Sequence[int],
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        dense_in_features: int = NUM_DENSE,
        drop_last: bool = True,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths: list[str] = [os.fspath(p) for p in paths]
        if not self.paths:
            raise InputError("Criteo reader: no input files given")
        for p in self.paths:
            if not os.path.isfile(p):
                raise InputError(f"{p}: Criteo file not found")

        names = list(table_names)
        rows = list(table_rows)
        if not 1 <= len(names) <= NUM_SPARSE:
            raise InputError(
                f"Criteo reader: got {len(names)} tables, need 1 to {NUM_SPARSE} "
                f"(one per categorical column)"
            )
        if len(set(names)) != len(names):
            raise InputError(f"Criteo reader: duplicate table names in {names}")
        if len(rows) != len(names):
            raise InputError(
                f"Criteo reader: {len(names)} table names but {len(rows)} row counts"
            )
        for name, n in zip(names, rows):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise InputError(f"Criteo reader: table {name!r} needs rows >= 1, got {n!r}")
        if not 1 <= dense_in_features <= NUM_DENSE:
            raise InputError(
                f"Criteo reader: dense_in_features must be 1 to {NUM_DENSE}, "
                f"got {dense_in_features}"
            )
        if batch_size < 1:
            raise InputError(f"Criteo reader: batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise InputError(
                f"Criteo reader: need 0 <= rank < world_size, got rank {rank}, "
                f"world_size {world_size}"
            )

        self.table_names: list[str] = names
        self.table_rows: list[int] = rows
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.dense_in_features = dense_in_features
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[Batch]:
        """Yields this rank's batches, streaming through the files in order.

        Lines are only collected here (``islice`` skips other ranks' lines without
        parsing them); each full batch is parsed at once by ``_to_batch``.

        Yields:
            ``Batch`` with dense float32 ``[B, dense_in_features]``, a key-major KJT
            over ``table_names`` and int32 labels ``[B]``.

        Raises:
            InputError: A malformed line (``file:line: reason``), an unreadable file,
                or no batch for this rank.
        """
        rank, ws, bs = self.rank, self.world_size, self.batch_size
        # This batch's (line number, line) pairs, and (first position, path) for each
        # file the batch draws from, so an error can name the right file.
        items: list[tuple[int, str]] = []
        files: list[tuple[int, str]] = []
        samples = 0
        batches = 0
        index = 0  # global index of the current file's first line, across all files

        for path in self.paths:
            f = _open_text(path)
            files.append((len(items), path))
            # zip pulls from `counter` before `f`, so once `f` is exhausted the counter
            # has gone one past the line count: lines in file = next(counter) - 2.
            counter = itertools.count(1)
            try:
                try:
                    for item in itertools.islice(zip(counter, f), (rank - index) % ws, None, ws):
                        items.append(item)
                        if len(items) == bs:
                            yield self._to_batch(items, files)
                            batches += 1
                            samples += bs
                            items = []
                            files = [(0, path)]
                except (OSError, EOFError, UnicodeDecodeError) as e:
                    raise InputError(f"{path}: cannot read Criteo file: {e}") from None
            finally:
                f.close()
            index += next(counter) - 2

        samples += len(items)
        if items:
            if self.drop_last:
                # Dropped, but a malformed line in it is still an error.
                self._raise_first_error(items, files)
            else:
                yield self._to_batch(items, files)
                batches += 1
        if batches == 0:
            names = ", ".join(self.paths)
            raise InputError(
                f"{names}: no full batch of {bs} samples for rank {rank} of {ws} "
                f"({samples} samples for this rank out of {index} lines)"
            )

    def _to_batch(self, items: list[tuple[int, str]], files: list[tuple[int, str]]) -> Batch:
        """Parses one batch of raw lines into a TorchRec ``Batch``, laid out key-major.

        The whole batch is converted with list comprehensions; only if that fails is
        each line checked in order by `_check_line`, which raises for the first bad one.

        Args:
            items: ``(line number, line)`` of each sample, in order.
            files: ``(first position in items, path)`` of each file the batch spans.

        Returns:
            The batch.

        Raises:
            InputError: A malformed line, named by file and 1-based line number.
        """
        b = len(items)
        nd = self.dense_in_features
        k = len(self.table_names)
        try:
            rows = [line.rstrip("\n").rstrip("\r").split("\t") for _, line in items]
            if any(len(r) != NUM_FIELDS for r in rows):
                raise ValueError
            cols = list(zip(*rows))  # column-major: cols[j] is field j of every sample
            labs = cols[0]
            if not set(labs) <= {"0", "1"}:
                raise ValueError
            dense = [int(s) if s else 0 for r in rows for s in r[1 : 1 + nd]]
            values: list[int] = []
            lengths: list[int] = []
            for i, n in enumerate(self.table_rows):
                col = cols[1 + NUM_DENSE + i]
                values += [int(s, 16) % n for s in col if s]
                lengths += [1 if s else 0 for s in col]
        except ValueError:
            self._raise_first_error(items, files)
            raise AssertionError("batch failed to parse but every line checks out") from None

        # numpy converts Python lists several times faster than torch.tensor does.
        try:
            raw = np.array(dense, dtype=np.float64)
        except OverflowError:
            self._raise_first_error(items, files, check_magnitude=True)
            raise
        dense_t = torch.from_numpy(raw).view(b, nd).clamp_(min=0).log1p_().to(torch.float32)
        assert len(lengths) == k * b
        return make_batch(
            dense_t.numpy(), list(self.table_names), [np.array(lengths, dtype=np.int32)],
            [np.array(values, dtype=np.int64)], np.array(labs, dtype=np.int32),
        )

    def _raise_first_error(
        self,
        items: list[tuple[int, str]],
        files: list[tuple[int, str]],
        check_magnitude: bool = False,
    ) -> None:
        """Checks a batch's lines in order and raises `InputError` for the first bad one.

        Args:
            items: ``(line number, line)`` of each sample, in order.
            files: ``(first position in items, path)`` of each file the batch spans.
            check_magnitude: Also reject dense values too large for float64.
        """
        f = 0
        for pos, (lineno, line) in enumerate(items):
            while f + 1 < len(files) and files[f + 1][0] <= pos:
                f += 1
            _check_line(line, f"{files[f][1]}:{lineno}", self.dense_in_features,
                        len(self.table_names), check_magnitude)


def _check_line(line: str, where: str, nd: int, k: int, check_magnitude: bool) -> None:
    """Raises `InputError` (prefixed ``file:line:``) if one Criteo line is malformed.

    Args:
        line: The raw line.
        where: ``file:line`` for the message.
        nd: Dense columns in use.
        k: Categorical columns in use.
        check_magnitude: Also reject dense values too large for float64.
    """
    fields = line.rstrip("\n").rstrip("\r").split("\t")
    if len(fields) != NUM_FIELDS:
        raise InputError(f"{where}: expected {NUM_FIELDS} tab-separated fields, got {len(fields)}")
    if fields[0] not in ("0", "1"):
        raise InputError(f"{where}: label must be 0 or 1, got {fields[0]!r}")
    for j in range(1, 1 + nd):
        s = fields[j]
        try:
            x = int(s) if s else 0
        except ValueError:
            raise InputError(f"{where}: dense field I{j} is not an integer: {s!r}") from None
        if check_magnitude:
            try:
                float(x)
            except OverflowError:
                raise InputError(f"{where}: dense field I{j} is too large: {s!r}") from None
    for j in range(1 + NUM_DENSE, 1 + NUM_DENSE + k):
        s = fields[j]
        try:
            if s:
                int(s, 16)
        except ValueError:
            raise InputError(
                f"{where}: categorical field C{j - NUM_DENSE} is not hex: {s!r}"
            ) from None
