"""Where every id is looked up under a plan, and how replicas synchronise their gradients.

One implementation serves both the traffic model (embshard.flexshard.traffic) and the data
path (dlrm.sequence_embedding), so the bytes the model counts are the bytes the data path
sends.

Routing: a table's replica-0 shards cut its (remapped) rows into segments; each segment is
held by the devices of that rectangle's copies. Device s looks an id up on the nearest
holder: itself, else the lowest-numbered holder on its own host, else the lowest-numbered
holder anywhere. Rows of a table-wise or row-wise shard have one holder; FlexShard's
replicated tier is held everywhere (always local) and its per-host tier once per host
(always inside the host).

Replica sync: after backward every rectangle held by several devices all-reduces its
gradient among its holders, in four phases: reduce-scatter inside each host, reduce-scatter
then all-gather among the hosts (the copies with the same local index), all-gather inside
each host (irregular holder sets: a flat reduce-scatter + all-gather over all holders).

* dense (`sync_schedule`; HugeCTR's hybrid and data_parallel plans): every row every step,
  fp32, chunked by elements. Per row of N bytes that moves 2(p-1)/p N inside a host and
  2(h-1)/(h p) N between hosts per device.
* sparse (`SparseSync`; plans with `sparse_sync`, FlexShard's): only the rows some holder
  looked up in the step, each sent as (int64 row, fp32 gradient) to the holder that owns
  it in the phase: with r = row + a rotation per table (a hash of its name, so that no copy
  owns every table's hottest row), a row's owner inside a host is local copy `r mod p`, its
  owner among the hosts host `(r // p) mod h` (rows are laid out hottest first, so owners
  interleave and every holder reduces an even share of hot and cold rows). Between two hosts the
  reduce-scatter and all-gather become one exchange: each copy sends the other its touched
  rows and both add (2u row messages per row where one host touches it with probability u,
  against u + g for the two phases, g >= u the probability that either does). Before each phase the
  holders exchange, per peer and group, how many rows follow (one int64 each). A row
  touched by none of its holders moves nothing; the phases then deliver, to every holder,
  the sum over holders of every row any of them touched.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from embshard.errors import PlanError
from embshard.flexshard.rowmap import RowMap
from embshard.plan import Plan, Shard
from embshard.tables import Table
from embshard.task import Task

#: The four collective steps of a replica sync (see the module docstring).
SYNC_PHASES = ("intra_reduce_scatter", "inter_reduce_scatter", "inter_all_gather", "intra_all_gather")
#: Which sync phases add what they receive (reduce) rather than overwrite (gather).
SYNC_REDUCES = (True, True, False, False)


@dataclass
class ColumnRoute:
    """Routing of one column range of a table (the whole width unless column-split)."""

    col_offset: int
    dim: int
    seg_starts: np.ndarray        # [segments] first (remapped) row of each segment, ascending
    seg_rows: np.ndarray          # [segments] rows in each segment
    dest: np.ndarray              # [devices, segments] the device a requester looks a segment up on
    holders: list[np.ndarray]     # per segment, the devices holding it (ascending)
    _lut: np.ndarray | None = field(default=None, repr=False)

    def route(self, src: torch.Tensor, new_ids: torch.Tensor) -> torch.Tensor:
        """Destination device of each (requesting device, remapped id) pair."""
        seg = torch.searchsorted(torch.from_numpy(self.seg_starts), new_ids, right=True) - 1
        return torch.from_numpy(self.dest)[src, seg]

    def segment_lut(self, row_map: RowMap) -> np.ndarray:
        """Segment of every original row id (the traffic model's fast path: one gather per id)."""
        if self._lut is None:
            new = row_map.to_new(torch.arange(int(self.seg_starts[-1] + self.seg_rows[-1]))).numpy()
            seg = np.searchsorted(self.seg_starts, new, side="right") - 1
            self._lut = seg.astype(np.int16 if len(self.seg_starts) < 2**15 else np.int32)
        return self._lut

    def dest_set(self, src: int) -> np.ndarray:
        """Every device that device `src` may send this column range's ids to."""
        return np.unique(self.dest[src])


@dataclass
class TableRoute:
    table: Table
    row_map: RowMap
    columns: list[ColumnRoute] = field(default_factory=list)

    @property
    def full_width(self) -> bool:
        return len(self.columns) == 1


@dataclass(frozen=True)
class SyncGroup:
    """A rectangle held by several devices: its gradients are all-reduced among them."""

    table: str
    row_offset: int
    rows: int
    col_offset: int
    dim: int
    members: tuple[int, ...]

    @property
    def elements(self) -> int:
        return self.rows * self.dim


def nearest_holders(holders: np.ndarray, num_devices: int, devices_per_host: int) -> np.ndarray:
    """For every requesting device, the holder it uses (module docstring: self, own host, lowest)."""
    holders = np.sort(np.asarray(holders, dtype=np.int64))
    req = np.arange(num_devices)
    if holders.size == 1:
        return np.full(num_devices, holders[0], dtype=np.int64)
    out = np.full(num_devices, holders[0], dtype=np.int64)
    host_first: dict[int, int] = {}
    for h in holders[::-1]:
        host_first[int(h) // devices_per_host] = int(h)
    own_host = np.array([host_first.get(int(r) // devices_per_host, -1) for r in req])
    out = np.where(own_host >= 0, own_host, out)
    is_holder = np.isin(req, holders)
    return np.where(is_holder, req, out)


def plan_routes(task: Task, plan: Plan) -> dict[str, TableRoute]:
    """Routing tables of every table of a (validated) plan."""
    by_table: dict[str, list[Shard]] = {t.name: [] for t in task.tables}
    for s in plan.shards:
        by_table[s.table].append(s)
    routes = {}
    for t in task.tables:
        row_map = RowMap(t.rows, plan.row_maps.get(t.name, np.zeros(0, dtype=np.int64)))
        route = TableRoute(t, row_map)
        copies: dict[tuple, list[int]] = {}
        for s in by_table[t.name]:
            copies.setdefault(s.rectangle, []).append(s.device)
        by_cols: dict[tuple[int, int], list[tuple]] = {}
        for rect in copies:
            by_cols.setdefault((rect[3], rect[4]), []).append(rect)
        for (col_offset, dim), rects in sorted(by_cols.items()):
            rects.sort(key=lambda r: r[1])
            holders = [np.array(sorted(copies[r]), dtype=np.int64) for r in rects]
            dest = np.stack([nearest_holders(h, task.num_devices, task.devices_per_host) for h in holders], axis=1)
            route.columns.append(ColumnRoute(
                col_offset, dim,
                np.array([r[1] for r in rects], dtype=np.int64),
                np.array([r[2] for r in rects], dtype=np.int64),
                dest, holders,
            ))
        if sum(c.seg_rows.sum() * c.dim for c in route.columns) != t.rows * t.dim:
            raise PlanError(f"table {t.name!r}: column ranges of the plan do not line up (grid shards with uneven rows)")
        routes[t.name] = route
    return routes


def sync_groups(task: Task, plan: Plan) -> list[SyncGroup]:
    """Every rectangle with more than one copy, in a fixed order (table order, then rows, cols)."""
    order = {t.name: i for i, t in enumerate(task.tables)}
    copies: dict[tuple, list[int]] = {}
    for s in plan.shards:
        copies.setdefault(s.rectangle, []).append(s.device)
    groups = [
        SyncGroup(rect[0], rect[1], rect[2], rect[3], rect[4], tuple(sorted(devs)))
        for rect, devs in copies.items() if len(devs) > 1
    ]
    return sorted(groups, key=lambda g: (order[g.table], g.row_offset, g.col_offset))


def _chunks(n: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, sizes) of `n` elements split into `parts` nearly equal chunks."""
    sizes = np.full(parts, n // parts, dtype=np.int64)
    sizes[: n % parts] += 1
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return starts, sizes


def _exchange(members: list[int], starts: np.ndarray, sizes: np.ndarray, gather: bool) -> list[tuple[int, int, int, int]]:
    """Transfers of a reduce-scatter (member i sends chunk j to member j) or an all-gather
    (member j sends chunk j to every other member), as (src, dst, start, length)."""
    out = []
    for i, a in enumerate(members):
        for j, b in enumerate(members):
            if i != j and sizes[j]:
                out.append((b, a, int(starts[j]), int(sizes[j])) if gather else (a, b, int(starts[j]), int(sizes[j])))
    return out


def sync_schedule(group: SyncGroup, devices_per_host: int) -> list[list[tuple[int, int, int, int]]]:
    """The transfers (src, dst, start element, length) of each of the four SYNC_PHASES that
    all-reduce one group's gradient (flattened rows × dim, row-major)."""
    by_host: dict[int, list[int]] = {}
    for m in group.members:
        by_host.setdefault(m // devices_per_host, []).append(m)
    hosts = [by_host[h] for h in sorted(by_host)]
    phases: list[list[tuple[int, int, int, int]]] = [[], [], [], []]
    n = group.elements
    p = len(hosts[0])
    if any(len(h) != p for h in hosts):  # irregular: flat reduce-scatter + all-gather
        starts, sizes = _chunks(n, len(group.members))
        phases[0] = _exchange(list(group.members), starts, sizes, gather=False)
        phases[3] = _exchange(list(group.members), starts, sizes, gather=True)
        return phases
    starts, sizes = _chunks(n, p)
    for h in hosts:
        phases[0] += _exchange(h, starts, sizes, gather=False)
        phases[3] += _exchange(h, starts, sizes, gather=True)
    if len(hosts) > 1:
        for j in range(p):
            peers = [h[j] for h in hosts]
            sub_starts, sub_sizes = _chunks(int(sizes[j]), len(hosts))
            phases[1] += _exchange(peers, starts[j] + sub_starts, sub_sizes, gather=False)
            phases[2] += _exchange(peers, starts[j] + sub_starts, sub_sizes, gather=True)
    return phases


@dataclass(frozen=True)
class SparseSync:
    """The sparse sync rule of one group (module docstring): which of a holder's touched rows
    it sends to whom in each phase, and which it keeps. The traffic model applies it to every
    holder's rows; the data path to its own, learning the rest from the count exchange.

    `hosts`: the holders grouped by host (each ascending); a single list of all holders when
    the hosts hold unequal numbers of copies (the flat fallback). `rotation`: added to a row
    before its owners are picked.
    """

    group: SyncGroup
    hosts: tuple[tuple[int, ...], ...]
    hierarchical: bool
    rotation: int = 0

    @classmethod
    def of(cls, group: SyncGroup, devices_per_host: int) -> "SparseSync":
        by_host: dict[int, list[int]] = {}
        for m in group.members:
            by_host.setdefault(m // devices_per_host, []).append(m)
        hosts = [tuple(sorted(by_host[h])) for h in sorted(by_host)]
        rotation = zlib.crc32(group.table.encode())
        if any(len(h) != len(hosts[0]) for h in hosts):
            return cls(group, (tuple(sorted(group.members)),), False, rotation)
        return cls(group, tuple(hosts), True, rotation)

    def _where(self, device: int) -> tuple[int, int]:
        for hi, h in enumerate(self.hosts):
            if device in h:
                return hi, h.index(device)
        raise ValueError(f"device {device} holds no copy of {self.group}")

    def peers(self, phase: int, device: int) -> list[int]:
        """The holders `device` exchanges with in `phase` (ascending; counts go to each of them
        every step, rows only where there are some)."""
        hi, j = self._where(device)
        if phase in (0, 3):  # inside the host (flat: among all holders)
            return [d for d in self.hosts[hi] if d != device]
        if not self.hierarchical or len(self.hosts) == 1 or (phase == 2 and len(self.hosts) == 2):
            return []  # two hosts: the exchange of phase 1 is the whole all-reduce between them
        return sorted(h[j] for m, h in enumerate(self.hosts) if m != hi)

    def sends(self, phase: int, device: int, rows: np.ndarray) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """({peer: positions of `rows` sent to it}, positions kept) for a holder whose touched
        rows (group-local, ascending) are `rows` when `phase` starts. Reduce-scatter phases
        (0, 1) hand each row to its owner and keep the holder's own; gather phases (2, 3), and
        phase 1 between two hosts (the exchange), send every row to every peer and keep them
        all. Receivers add what they get to what they keep."""
        hi, j = self._where(device)
        peers = self.peers(phase, device)
        everything = np.arange(rows.size)
        if not peers:
            return {}, everything
        if phase in (2, 3) or (phase == 1 and len(self.hosts) == 2):
            return {p: everything for p in peers}, everything
        r = rows + self.rotation
        if phase == 0:
            group = self.hosts[hi]
            owner_index = r % len(group)
            owners = np.asarray(group, dtype=np.int64)[owner_index]
        else:  # phase 1: rows already all of chunk j; owner host (r // p) mod h
            p = len(self.hosts[0])
            host_index = (r // p) % len(self.hosts)
            owners = np.asarray([h[j] for h in self.hosts], dtype=np.int64)[host_index]
        out = {peer: np.flatnonzero(owners == peer) for peer in peers}
        return {k: v for k, v in out.items() if v.size}, np.flatnonzero(owners == device)


def sparse_sync_rules(task: Task, plan: Plan) -> list[SparseSync]:
    """The sparse sync rule of every group of `sync_groups`, in the same order."""
    return [SparseSync.of(g, task.devices_per_host) for g in sync_groups(task, plan)]


def link_is_intra(num_devices: int, devices_per_host: int) -> np.ndarray:
    """[src, dst] True where both devices share a host."""
    host = np.arange(num_devices) // devices_per_host
    return host[:, None] == host[None, :]
