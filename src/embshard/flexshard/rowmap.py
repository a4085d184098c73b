"""The row remap of a row-level plan: a few rows moved to the front of a table.

A plan's row map for a table is `front`, the original ids of the rows that take new ids
0 .. len(front) - 1, in that order (hot rows, in the order the plan lays them out). The rows
they displace from the front take, in increasing order, the ids the moved rows left behind
(also in increasing order); every other row keeps its id. So the map is a bijection of
[0, rows) stored with len(front) numbers, however large the table, and the rest of the table
keeps TorchRec's block layout over (hashed, so evenly spread) original ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: tables up to this many rows map ids through a dense table (4 bytes a row, built on first use)
DENSE_MAX_ROWS = 1 << 24


@dataclass(frozen=True)
class RowMap:
    """Original row id <-> plan row id for one table (see the module docstring)."""

    rows: int
    front: np.ndarray  # original ids of new ids 0..k-1

    def __post_init__(self) -> None:
        front = np.ascontiguousarray(self.front, dtype=np.int64)
        k = front.size
        order = np.argsort(front, kind="stable")
        moved_sorted = front[order]
        # moved rows that came from outside the front leave holes there; front slots whose rows
        # were not moved are vacated: pair both, each sorted, in order
        holes = np.sort(front[front >= k])
        in_front = np.zeros(k, dtype=bool)
        in_front[front[front < k]] = True
        vacated = np.flatnonzero(~in_front).astype(np.int64)
        object.__setattr__(self, "front", front)
        object.__setattr__(self, "_sorted_ids", moved_sorted)
        object.__setattr__(self, "_sorted_new", order.astype(np.int64))
        object.__setattr__(self, "_vacated", vacated)  # original ids in [0, k) that were displaced
        object.__setattr__(self, "_holes", holes)      # where they go (ids >= k left by moved rows)

    @classmethod
    def identity(cls, rows: int) -> "RowMap":
        return cls(rows, np.zeros(0, dtype=np.int64))

    @property
    def size(self) -> int:
        return int(self.front.size)

    def to_new(self, ids: torch.Tensor) -> torch.Tensor:
        """Plan row ids of original ids (int64 tensor in, int64 tensor out)."""
        if self.size == 0:
            return ids
        if self.rows <= DENSE_MAX_ROWS:  # one gather per id (the data path maps every id every step)
            dense = self.__dict__.get("_dense")
            if dense is None:
                dense = self._sparse_to_new(torch.arange(self.rows, dtype=torch.int64)).to(torch.int32)
                object.__setattr__(self, "_dense", dense)
            return dense[ids].to(torch.int64)
        return self._sparse_to_new(ids)

    def _sparse_to_new(self, ids: torch.Tensor) -> torch.Tensor:
        out = ids.clone()
        moved = _assign(out, ids, self._sorted_ids, self._sorted_new)
        _assign(out, ids, self._vacated, self._holes, skip=moved)
        return out

    def to_original(self, new_ids: torch.Tensor) -> torch.Tensor:
        """Original ids of plan row ids (the inverse of `to_new`)."""
        if self.size == 0:
            return new_ids
        out = new_ids.clone()
        front = new_ids < self.size
        out[front] = torch.from_numpy(self.front)[new_ids[front]]
        _assign(out, new_ids, self._holes, self._vacated, skip=front)
        return out


def _assign(out: torch.Tensor, x: torch.Tensor, keys: np.ndarray, values: np.ndarray,
            skip: torch.Tensor | None = None) -> torch.Tensor:
    """Where x is one of the sorted `keys` (and not `skip`), set out to the matching `values`;
    returns where that was."""
    if keys.size == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    k = torch.from_numpy(keys)
    pos = torch.searchsorted(k, x).clamp_(max=k.numel() - 1)
    hit = k[pos] == x
    if skip is not None:
        hit &= ~skip
    out[hit] = torch.from_numpy(values)[pos[hit]]
    return hit
