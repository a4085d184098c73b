"""Which TorchRec sharding types a table's shards are: the one place that knows TorchRec's layouts.

TorchRec trains a table only in a few layouts, named by its `ShardingType`s. Given the shards
of one table (our plan's rectangles), `torchrec_layouts` returns every sharding type they can
run as (the natural one first) together with the pieces TorchRec needs, in its order, or
raises a one-line PlanError naming the table when TorchRec cannot train them:

* one shard covering the whole table -> table_wise (also a one-piece column_wise or
  table_column_wise, as TorchRec itself plans a column-wise table narrower than its
  `min_partition`; row_wise / table_row_wise too where TorchRec's row blocks put every row on
  that rank: one rank, or a one-row table on the first; data_parallel on one rank);
* shards that each hold all rows and split the columns (any widths, any ranks, several per
  rank allowed) -> column_wise; table_column_wise too when they sit on one host;
* shards that each hold all columns and split the rows -> row_wise, but only in TorchRec's
  exact layout: blocks of ceil(rows / world_size) rows on ranks 0, 1, ..., world_size-1 in
  order (its input dist bucketizes ids by that block size, whatever the shard metadata says:
  an uneven 20/13 split of a 33-row table gave pooled sums off by up to 1.8 under DMP when we
  tried it); or the same over the `local_world_size` ranks of one host -> table_row_wise;
* column slices (any widths) each row-split in that layout over the ranks of one host ->
  grid_shard;
* the whole table on every rank, once as replica 0 and once as each other replica ->
  data_parallel (replicated; each rank looks up its own samples).

The validator (`embshard.plan.validate`) uses it for tables constrained to some sharding types
(`Table.sharding_types`), the exporter (`embshard.torchrec_bridge.plan_to_torchrec`) for every
table.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

from embshard.errors import PlanError
from embshard.tables import Table

#: One piece as TorchRec places it: (row offset, column offset, rows, columns, rank).
Piece = tuple[int, int, int, int, int]


class _ShardLike(Protocol):
    table: str
    device: int
    col_offset: int
    dim: int
    row_offset: int
    rows: int
    replica: int


def even_row_layout(rows: int, parts: int) -> list[tuple[int, int]]:
    """TorchRec's row-wise layout: (offset, size) per rank, blocks of ceil(rows/parts) (the
    last ones may be short or empty)."""
    block = math.ceil(rows / parts)
    out = []
    for i in range(parts):
        start = min(i * block, rows)
        out.append((start, min(block, rows - start)))
    return out


def describe(shards: Sequence[_ShardLike]) -> str:
    return ", ".join(
        f"rows {s.row_offset}:{s.row_offset + s.rows} cols {s.col_offset}:{s.col_offset + s.dim} on {s.device}"
        for s in shards
    )


def host_groups(world_size: int, local_world_size: int) -> list[list[int]]:
    """The ranks of each host (ranks are numbered host by host)."""
    per_host = min(local_world_size, world_size)
    return [list(range(h, min(h + per_host, world_size))) for h in range(0, world_size, per_host)]


def torchrec_layouts(table: Table, shards: Sequence[_ShardLike], world_size: int,
                     local_world_size: int) -> list[tuple[str, list[Piece]]]:
    """Every TorchRec sharding type `shards` (all of one table, replicas included) can run as,
    the natural one first, each with its pieces in TorchRec's order.

    Raises:
        PlanError: TorchRec cannot train this layout; the message names the table.
    """
    where = f"table {table.name!r}"
    hosts = host_groups(world_size, local_world_size)
    one_host = lambda ranks: any(set(ranks) <= set(h) for h in hosts)  # noqa: E731
    primary = [s for s in shards if s.replica == 0]
    if len(primary) != len(shards):
        whole = len(primary) == 1 and primary[0].rows == table.rows and primary[0].dim == table.dim
        if not whole or sorted(s.device for s in shards) != list(range(world_size)):
            raise PlanError(
                f"{where}: replicas ({describe(shards)}) are not TorchRec's data_parallel, which keeps the "
                f"whole table once on every one of the {world_size} ranks"
            )
        return [("data_parallel", [(0, 0, table.rows, table.dim, r) for r in range(world_size)])]
    if len(shards) == 1:
        s = shards[0]
        piece = [(0, 0, table.rows, table.dim, s.device)]
        out = [("table_wise", piece), ("column_wise", piece), ("table_column_wise", piece)]
        # TorchRec's row-wise layouts hold a one-row table (or any table on one rank) as one
        # block on the first rank: the same single shard (only then: blocks of ceil(rows / n)
        # leave rows to the other n - 1 ranks, so nothing else is laid out here, once per table
        # of every plan exported)
        for kind, ranks in [("row_wise", list(range(world_size)))] + [("table_row_wise", h) for h in hosts]:
            if ranks[0] == s.device and (table.rows == 1 or len(ranks) == 1):
                rows = _row_pieces(table, shards, 0, table.dim, ranks)
                if rows is not None:
                    out.append((kind, rows))
        if world_size == 1:  # data-parallel over one rank: the table once
            out.append(("data_parallel", piece))
        return out
    full_rows = all(s.row_offset == 0 and s.rows == table.rows for s in shards)
    full_cols = all(s.col_offset == 0 and s.dim == table.dim for s in shards)
    if full_rows:
        ordered = sorted(shards, key=lambda s: s.col_offset)
        pieces = [(0, s.col_offset, table.rows, s.dim, s.device) for s in ordered]
        out = [("column_wise", pieces)]
        if one_host([s.device for s in shards]):
            out.append(("table_column_wise", pieces))
        return out
    if not full_cols:
        return [("grid_shard", _grid_pieces(table, shards, hosts))]
    ordered = sorted(shards, key=lambda s: s.row_offset)
    out = []
    pieces = _row_pieces(table, ordered, 0, table.dim, list(range(world_size)))
    if pieces is not None:
        out.append(("row_wise", pieces))
    for ranks in hosts:
        pieces = _row_pieces(table, ordered, 0, table.dim, ranks)
        if pieces is not None:
            out.append(("table_row_wise", pieces))
    if out:
        return out
    block = math.ceil(table.rows / world_size)
    raise PlanError(
        f"{where}: row split ({describe(ordered)}) is not TorchRec's row-wise layout "
        f"(blocks of ceil({table.rows}/{world_size}) = {block} rows on ranks 0..{world_size - 1} "
        f"in order, or the same over the {local_world_size} ranks of one host)"
    )


def _row_pieces(table: Table, ordered: Sequence[_ShardLike], col_off: int, cols: int,
                ranks: list[int]) -> list[Piece] | None:
    """TorchRec's even row layout over `ranks` if `ordered` (by row offset) is exactly it."""
    layout = even_row_layout(table.rows, len(ranks))
    want = [(off, size, r) for (off, size), r in zip(layout, ranks) if size > 0]
    if [(s.row_offset, s.rows, s.device) for s in ordered] != want:
        return None
    return [(off, col_off, size, cols, r) for (off, size), r in zip(layout, ranks)]


def _grid_pieces(table: Table, shards: Sequence[_ShardLike], hosts: list[list[int]]) -> list[Piece]:
    """grid_shard: column slices, each row-split in TorchRec's layout over one host's ranks."""
    groups: dict[tuple[int, int], list[_ShardLike]] = {}
    for s in shards:
        groups.setdefault((s.col_offset, s.dim), []).append(s)
    pieces: list[Piece] = []
    for (col_off, cols), group in sorted(groups.items()):
        ordered = sorted(group, key=lambda s: s.row_offset)
        found = None
        for ranks in hosts:
            found = _row_pieces(table, ordered, col_off, cols, ranks)
            if found is not None:
                break
        if found is None:
            raise PlanError(
                f"table {table.name!r} is split by rows and by columns ({describe(shards)}); TorchRec "
                f"runs that only as grid_shard: every column slice row-split in blocks of "
                f"ceil({table.rows}/{len(hosts[0])}) rows over the ranks of one host, in order"
            )
        pieces += found
    return pieces


def choose_layout(table: Table, shards: Sequence[_ShardLike], world_size: int,
                  local_world_size: int) -> tuple[str, list[Piece]]:
    """The layout TorchRec will run: the natural one, or the first the table's
    `sharding_types` allow. Raises PlanError when none is allowed (naming the table)."""
    layouts = torchrec_layouts(table, shards, world_size, local_world_size)
    for kind, pieces in layouts:
        if table.allows(kind):
            return kind, pieces
    raise PlanError(
        f"table {table.name!r} is constrained to {list(table.sharding_types or ())} but the plan shards it "
        f"{layouts[0][0]} ({describe(shards)})"
    )


def check_min_partition(table: Table, shards: Sequence[_ShardLike]) -> None:
    """Column pieces of a table with `min_partition` are at least that wide (or the whole width)."""
    narrowest = table.narrowest_column_piece()
    for s in shards:
        if s.dim < narrowest:
            raise PlanError(
                f"table {table.name!r}: column piece of width {s.dim} on device {s.device} is narrower than its "
                f"min_partition {table.min_partition}"
            )
