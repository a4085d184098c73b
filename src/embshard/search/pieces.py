"""Piece algebra: the pieces a table can be cut into, and the book that makes and prices them.

A *piece* is a whole table, a column slice of one (its dim halved, possibly more than once:
both halves keep the rows, pooling factor and histogram; dims stay multiples of
`DIM_ALIGNMENT`), or one row block of a table split by rows over a group of devices
(TorchRec's layout: even blocks of ceil(rows / n) rows, each block serving its share of the
lookups and sending its full width in the all-to-all). A search state is a sorted tuple of
`PieceSpec`s; a row block's device is part of its spec, a column piece's is chosen by a
partitioner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from embshard.plan import Shard, even_row_layout, piece_table
from embshard.search.simulator import Simulator
from embshard.tables import DIM_ALIGNMENT, Table
from embshard.task import Task

FREE = -1  # a piece a partitioner places (all rows); >= 0: a row block fixed on that device

#: A piece spec: (table name, col_offset, dim, device of a row block or FREE, number of row
#: blocks of its table or 0); a search state is a sorted tuple of them.
PieceSpec = tuple[str, int, int, int, int]


def slices_below(cost_ms: float, limit_ms: float, num_devices: int) -> int:
    """How many equal column slices bring a piece that costs `cost_ms` alone (> `limit_ms`)
    below `limit_ms` each, as a power of two (each halving halves the cost), at most one per
    device: the cut of a costliest table (NeuroShard's `costliest_cut`, the RL planners'
    `column_slices`), before the table's own width rules (alignment, min_partition) cap it."""
    return min(2 ** math.ceil(math.log2(cost_ms / limit_ms)), num_devices)


@dataclass
class Piece:
    """One piece with what a partitioner needs to place it."""

    spec: PieceSpec
    table: Table      # the task's table
    ptable: Table     # the piece as the predictor sees it (its rows, dim, lookups share)
    pid: int          # simulator id of ptable
    need: int         # memory bytes on a device
    shard: Shard      # where it lives when fixed (device ignored for free pieces)
    single_ms: float = 0.0
    enc: np.ndarray | None = None  # the predictor's table encoding (incremental mode)

    @property
    def dim(self) -> int:
        return self.spec[2]

    @property
    def fixed(self) -> int:
        return self.spec[3]


def halvable(dim: int) -> bool:
    return dim % (2 * DIM_ALIGNMENT) == 0


def halve(state: tuple[PieceSpec, ...], spec: PieceSpec) -> tuple[PieceSpec, ...]:
    """`state` with the column piece `spec` replaced by its two halves."""
    name, off, dim, dev, parts = spec
    if dev != FREE:
        raise ValueError(f"a row block cannot be halved: {spec}")
    half = dim // 2
    rest = list(state)
    rest.remove(spec)
    rest += [(name, off, half, FREE, 0), (name, off + half, half, FREE, 0)]
    return tuple(sorted(rest))


def row_splittable(rows: int, parts: int) -> bool:
    """Whether TorchRec's even row layout of `rows` over `parts` devices leaves no device an
    empty block (114 rows over 16 devices: blocks of 8, the last two 2 and 0 rows)."""
    return parts >= 1 and all(n > 0 for _, n in even_row_layout(rows, parts))


def row_split(state: tuple[PieceSpec, ...], spec: PieceSpec, group: Sequence[int]) -> tuple[PieceSpec, ...]:
    """`state` with the whole table `spec` split by rows over the devices of `group` (every
    block non-empty: `row_splittable`)."""
    name, off, dim, dev, _ = spec
    if dev != FREE or off != 0:
        raise ValueError(f"only a whole table can be split by rows: {spec}")
    rest = list(state)
    rest.remove(spec)
    rest += [(name, 0, dim, d, len(group)) for d in group]
    return tuple(sorted(rest))


def initial_state(task: Task) -> tuple[PieceSpec, ...]:
    """Every table whole."""
    return tuple(sorted((t.name, 0, t.dim, FREE, 0) for t in task.tables))


class PieceBook:
    """Makes each piece of a task once: its memory, the Table its cost model sees, its cost
    alone and (with `encode`) its encoding, each batch of new pieces predicted in one call.

    Args:
        task: the task (its planning view: every table with a reuse histogram).
        simulator: prices the pieces (its cache is shared with the partitioner's).
        encode: also keep each piece's table encoding (the predictor must be an
            `EncodingPredictor`).
    """

    def __init__(self, task: Task, simulator: Simulator, encode: bool = False):
        self.task = task
        self.sim = simulator
        self.encode = bool(encode)
        self._tables = task.table_by_name
        self._pieces: dict[PieceSpec, Piece] = {}

    def table(self, name: str) -> Table:
        return self._tables[name]

    def pieces_of(self, state: Sequence[PieceSpec]) -> list[Piece]:
        """The pieces of a state; new ones are predicted alone (and encoded) in one batched
        call each."""
        new = [spec for spec in dict.fromkeys(state) if spec not in self._pieces]
        if new:
            made = [self._make_piece(spec) for spec in new]
            single = self.sim.shard_costs([(p.pid,) for p in made], lambda i: [made[i].ptable])
            encs = self.sim.predictor.table_encodings([p.ptable for p in made]) if self.encode else None
            for i, p in enumerate(made):
                p.single_ms = float(single[i])
                if encs is not None:
                    p.enc = np.asarray(encs[i], dtype=np.float64)
                self._pieces[p.spec] = p
        return [self._pieces[spec] for spec in state]

    def _make_piece(self, spec: PieceSpec) -> Piece:
        name, off, dim, dev, parts = spec
        t = self._tables[name]
        if dev == FREE:
            shard = Shard(name, 0, off, dim, 0, t.rows)
        else:
            row_off, rows = even_row_layout(t.rows, parts)[dev % parts]
            shard = Shard(name, dev, off, dim, row_off, rows)
        pt = piece_table(t, shard)
        need = self.task.shard_memory_bytes(t, shard.rows, dim)
        return Piece(spec, t, pt, self.sim.piece_id(pt), need, shard)
