"""A sharded sequence-embedding module on torch.distributed that executes a row-level plan.

`ShardedSequenceEmbedding` is the data path of FlexShard and its baselines: TorchRec's
`EmbeddingCollection` semantics (every id of every sequence yields its own vector), with a
table's rows spread over devices as the plan says, replicas included. Per step:

1. every device maps its ids to the plan's row ids (the table's row map) and routes each to the
   nearest device holding its row (embshard.flexshard.routing: itself for a replicated row,
   a device of its own host for a per-host row, the owner otherwise); with `dedup_ids` each
   distinct id is sent once (TorchRec's use_index_dedup);
2. an all-to-all of the per-table counts, then of the ids;
3. each device looks the ids it received up in its local shards (its own ids included, so
   replicated rows are local lookups) and an all-to-all returns the embeddings; the backward
   of that all-to-all sends the gradients back to the rows' holders (autograd);
4. after backward, `sync_replica_grads()` all-reduces the gradients of every replicated piece
   among its holders, hierarchically (embshard.flexshard.routing): under a `sparse_sync` plan
   only the rows some holder looked up in the step (routing.SparseSync), otherwise every row
   (routing.sync_schedule).

Each local piece of a table is its own Parameter with sparse gradients, except replicated
pieces of dense-sync plans, whose dense gradients are all-reduced (torch.optim.SGD / Adagrad
take both). Every
collective counts the bytes it sends to each peer by purpose and link class, and times
itself, so a run reports exactly what crossed which link (`comm_bytes`, `comm_seconds`); the
counts equal embshard.flexshard.traffic's model of the same batches (tests/test_flexshard_data_path.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from embshard.errors import PlanError
from embshard.flexshard.routing import (SYNC_PHASES, SYNC_REDUCES, SparseSync, plan_routes, sync_groups,
                                        sync_schedule)
from embshard.flexshard.traffic import PURPOSES
from embshard.hardware.protocol import Stopwatch

#: collectives are timed by the measurement protocol's wall clock (their cost is waiting and moving bytes)
_WALL = Stopwatch("wall")
from embshard.plan import Plan
from embshard.task import Task


@dataclass
class CommLedger:
    """Bytes sent to other devices (by purpose and link class) and seconds spent in collectives."""

    host_of: list[int]
    rank: int
    #: enter every collective through a barrier, timed apart (`wait_seconds`), so `seconds` is the
    #: transfer itself and not the wait for the slowest rank (costs one barrier per collective)
    barrier_first: bool = False
    bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    wait_seconds: dict[str, float] = field(default_factory=dict)
    pair_bytes: dict[str, np.ndarray] = field(default_factory=dict)
    #: when a list: every collective appends (purpose, out_splits, in_splits, dtype) (replay_collectives)
    record: list | None = None

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        n = len(self.host_of)
        self.bytes = {p: {"intra_host": 0.0, "inter_host": 0.0} for p in PURPOSES}
        self.seconds = {p: 0.0 for p in PURPOSES}
        self.wait_seconds = {p: 0.0 for p in PURPOSES}
        self.pair_bytes = {p: np.zeros(n) for p in PURPOSES}

    def add(self, purpose: str, split_elements: list[int], element_bytes: int, seconds: float) -> None:
        """Count `split_elements[peer]` elements of `element_bytes` each sent to every other peer."""
        for peer, n in enumerate(split_elements):
            if peer == self.rank or not n:
                continue
            link = "intra_host" if self.host_of[peer] == self.host_of[self.rank] else "inter_host"
            self.bytes[purpose][link] += n * element_bytes
            self.pair_bytes[purpose][peer] += n * element_bytes
        self.seconds[purpose] += seconds


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group, ledger: CommLedger, purpose: str) -> torch.Tensor:
    """all_to_all_single, counted in the ledger in bytes of the tensor's own element size (not
    the traffic model's constants, so the two counts are independent)."""
    if ledger.barrier_first:
        ledger.wait_seconds[purpose] += _WALL.time(lambda: dist.barrier(group=group)) / 1e3
    ms = _WALL.time(lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group))
    ledger.add(purpose, in_splits, inp.element_size(), ms / 1e3)
    if ledger.record is not None:
        ledger.record.append((purpose, list(out_splits), list(in_splits), inp.dtype))
    return out


def replay_collectives(collectives: list, group=None, empty: bool = False) -> dict[str, float]:
    """Run a recorded step's collectives again (same splits, fresh buffers, each entered through
    a barrier) and return the seconds spent in the transfers: communication alone, without the
    step's compute competing for the CPU, by purpose. `empty`: the same collectives carrying
    nothing (their fixed cost, the latency floor)."""
    total = {p: 0.0 for p in PURPOSES}
    for purpose, out_splits, in_splits, dtype in collectives:
        if empty:
            out_splits, in_splits = [0] * len(out_splits), [0] * len(in_splits)
        inp = torch.ones(sum(in_splits), dtype=dtype)
        out = torch.empty(sum(out_splits), dtype=dtype)
        dist.barrier(group=group)
        total[purpose] += _WALL.time(lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)) / 1e3
    return total


class _EmbeddingAllToAll(torch.autograd.Function):
    """Forward: embeddings back to the devices that asked; backward: their gradients to the holders."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, out_splits: list[int], in_splits: list[int], group, ledger: CommLedger):
        ctx.splits, ctx.group, ctx.ledger = (out_splits, in_splits), group, ledger
        out = flat.new_empty(sum(out_splits))
        return _all_to_all(out, flat.contiguous(), out_splits, in_splits, group, ledger, "embeddings_fw")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits))
        _all_to_all(back, grad.contiguous(), in_splits, out_splits, ctx.group, ctx.ledger, "gradients_bw")
        return back, None, None, None, None


@dataclass
class LocalPiece:
    """One of this device's shards of a table: plan rows [start, start + rows)."""

    start: int
    rows: int
    replicated: bool
    param_name: str


def init_rows(original_ids: torch.Tensor, dim: int, table_index: int, seed: int, scale: float) -> torch.Tensor:
    """Initial weights of rows by original id, a pure function of (seed, table, row, column), so
    every copy of a row starts equal on every device and in every plan: uniform in [-scale, scale)."""
    cols = torch.arange(dim, dtype=torch.int64)
    x = (original_ids.to(torch.int64)[:, None] * 1_000_003 + cols[None, :] * 7919 + table_index * 104_729 + seed * 15_485_863)
    # splitmix-style integer mixing (int64 arithmetic wraps): decorrelates neighbouring rows
    x = (x ^ (x >> 31)) * 0x5DEECE66D
    x = (x ^ (x >> 29)) * 0x27D4EB2F
    x = x ^ (x >> 32)
    u = (x & ((1 << 24) - 1)).to(torch.float32) / float(1 << 24)
    return (2.0 * u - 1.0) * scale


class ShardedSequenceEmbedding(nn.Module):
    """The task's sequence tables sharded by `plan` over the ranks of `group` (see the module docstring).

    Args:
        task: every table must be `kind: sequence`.
        plan: a validated plan with full-width shards (row-level; replicas allowed).
        rank, world_size: this process's rank in `group` (world size = task.num_devices).
        weights: optional full tables (original row order) to copy the local rows from;
            otherwise `init_rows`.
        barrier_first: time the wait for the slowest rank apart from each transfer (CommLedger).
    """

    def __init__(self, task: Task, plan: Plan, rank: int, world_size: int, group=None,
                 weights: Mapping[str, torch.Tensor] | None = None, seed: int = 0, init_scale: float = 0.05,
                 barrier_first: bool = False):
        super().__init__()
        if world_size != task.num_devices:
            raise PlanError(f"task {task.name!r} has {task.num_devices} devices, the process group {world_size}")
        pooled = [t.name for t in task.tables if not t.is_sequence]
        if pooled:
            raise PlanError(f"the sequence data path takes sequence tables only; pooled: {pooled}")
        self.task, self.plan, self.rank, self.world, self.group = task, plan, rank, world_size, group
        self.tables = list(task.tables)
        self.routes = plan_routes(task, plan)
        for name, route in self.routes.items():
            if not route.full_width:
                raise PlanError(f"table {name!r}: the sequence data path needs full-width shards (no column splits)")
        self.ledger = CommLedger([d // task.devices_per_host for d in range(world_size)], rank, barrier_first)
        copies: dict[tuple, int] = {}
        for s in plan.shards:
            copies[s.rectangle] = copies.get(s.rectangle, 0) + 1
        self.params = nn.ParameterDict()
        self.pieces: dict[str, list[LocalPiece]] = {}
        for ti, t in enumerate(self.tables):
            mine = sorted((s for s in plan.shards if s.table == t.name and s.device == rank), key=lambda s: s.row_offset)
            self.pieces[t.name] = []
            for k, s in enumerate(mine):
                pname = f"{ti}_{k}"
                orig = self.routes[t.name].row_map.to_original(torch.arange(s.row_offset, s.row_offset + s.rows))
                w = weights[t.name][orig].clone().float() if weights is not None else init_rows(orig, t.dim, ti, seed, init_scale)
                self.params[pname] = nn.Parameter(w)
                self.pieces[t.name].append(LocalPiece(s.row_offset, s.rows, copies[s.rectangle] > 1, pname))
        if plan.sparse_sync:
            self._sparse = self._sparse_sync_plan()
        else:
            self._sync = self._sync_plan()

    # ------------------------------------------------------------------ forward
    def forward(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Embeddings of every id of this rank's batch: {table: [len(ids[table]), dim]}."""
        D, T, me = self.world, len(self.tables), self.rank
        src = torch.full((1,), me, dtype=torch.int64)
        queries, inverse, perms, counts = [], [], [], torch.zeros(D, T, dtype=torch.int64)
        for i, t in enumerate(self.tables):
            route = self.routes[t.name]
            new = route.row_map.to_new(ids[t.name].to(torch.int64))
            inv = None
            if self.plan.dedup_ids:
                new, inv = torch.unique(new, return_inverse=True)
            dest = route.columns[0].route(src.expand(new.numel()), new)
            perm = torch.argsort(dest, stable=True)
            counts[:, i] = torch.bincount(dest, minlength=D)
            queries.append(new[perm])
            perms.append(perm)
            inverse.append(inv)
        # 1. counts, 2. ids (dest-major, table-minor)
        recv_counts = torch.empty_like(counts)
        _all_to_all(recv_counts.view(-1), counts.view(-1), [T] * D, [T] * D, self.group, self.ledger, "ids")
        send_ids = torch.cat([q.split(counts[:, i].tolist())[d] for d in range(D) for i, q in enumerate(queries)])
        recv_ids = send_ids.new_empty(int(recv_counts.sum()))
        _all_to_all(recv_ids, send_ids, recv_counts.sum(1).tolist(), counts.sum(1).tolist(), self.group, self.ledger,
                    "ids")
        # 3. local lookups of what was received (src-major, table-minor), then embeddings back
        blocks = recv_ids.split(recv_counts.view(-1).tolist())
        looked = []
        for i, t in enumerate(self.tables):
            per_src = [blocks[s * T + i] for s in range(D)]
            emb = self._lookup(t.name, torch.cat(per_src))
            looked.append(emb.split(recv_counts[:, i].tolist()))
        dims = torch.tensor([t.dim for t in self.tables])
        flat = torch.cat([looked[i][s].reshape(-1) for s in range(D) for i in range(T)])
        out_flat = _EmbeddingAllToAll.apply(flat, (counts * dims).sum(1).tolist(), (recv_counts * dims).sum(1).tolist(),
                                            self.group, self.ledger)
        pieces = out_flat.split((counts * dims).view(-1).tolist())
        out = {}
        for i, t in enumerate(self.tables):
            sorted_emb = torch.cat([pieces[d * T + i].view(-1, t.dim) for d in range(D)])
            emb = sorted_emb[torch.argsort(perms[i])]
            out[t.name] = emb[inverse[i]] if inverse[i] is not None else emb
        return out

    def _lookup(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings of plan rows this device holds (each in one of its local pieces)."""
        t = self.task.table(table)
        out = torch.zeros(rows.numel(), t.dim)
        pieces = self.pieces[table]
        starts = torch.tensor([p.start for p in pieces], dtype=torch.int64)
        which = torch.searchsorted(starts, rows, right=True) - 1
        parts, where = [], []
        for k, p in enumerate(pieces):
            sel = torch.nonzero(which == k).view(-1)
            if sel.numel():
                sparse = self.plan.sparse_sync or not p.replicated
                parts.append(F.embedding(rows[sel] - p.start, self.params[p.param_name], sparse=sparse))
                where.append(sel)
        if parts:
            out = out.index_put((torch.cat(where),), torch.cat(parts))
        return out

    def forward_kjt(self, features):
        """TorchRec's interface: a KeyedJaggedTensor in, {feature: JaggedTensor} out (EmbeddingCollection)."""
        from torchrec.sparse.jagged_tensor import JaggedTensor

        jts = features.to_dict()
        emb = self.forward({k: jt.values() for k, jt in jts.items()})
        return {k: JaggedTensor(values=emb[k], lengths=jts[k].lengths()) for k in jts}

    # ------------------------------------------------------------------ replica sync
    def _sync_plan(self) -> list[tuple[list, list]]:
        """Per sync phase, this rank's (sends, receives): (peer, param name, start, length, reduce)."""
        me = self.rank
        names = {}
        for t in self.tables:
            for p in self.pieces[t.name]:
                names[(t.name, p.start)] = p.param_name
        phases: list[tuple[list, list]] = [([], []) for _ in SYNC_PHASES]
        self._sync_active = [False] * len(SYNC_PHASES)  # the same on every rank: skip phases nobody uses
        for g in sync_groups(self.task, self.plan):
            schedule = sync_schedule(g, self.task.devices_per_host)
            for k, transfers in enumerate(schedule):
                self._sync_active[k] |= bool(transfers)
            if me not in g.members:
                continue
            pname = names[(g.table, g.row_offset)]
            for k, transfers in enumerate(schedule):
                for src, dst, start, length in transfers:
                    if src == me:
                        phases[k][0].append((dst, pname, start, length))
                    if dst == me:
                        phases[k][1].append((src, pname, start, length))
        return [(sorted(s, key=lambda x: x[0]), sorted(r, key=lambda x: x[0])) for s, r in phases]

    def _sparse_sync_plan(self) -> dict:
        """This rank's groups (rule, param name, width), per phase its peers in ascending order
        with the groups it shares with each (global group order: every rank agrees), and which
        phases any rank uses."""
        me, names = self.rank, {}
        for t in self.tables:
            for p in self.pieces[t.name]:
                names[(t.name, p.start)] = p.param_name
        mine, active = {}, [False] * len(SYNC_PHASES)
        per_phase: list[dict[int, list[int]]] = [{} for _ in SYNC_PHASES]
        for g, group in enumerate(sync_groups(self.task, self.plan)):
            rule = SparseSync.of(group, self.task.devices_per_host)
            for k in range(len(SYNC_PHASES)):
                active[k] |= any(rule.peers(k, m) for m in group.members)
            if me not in group.members:
                continue
            mine[g] = (rule, names[(group.table, group.row_offset)], group.dim, group.rows)
            for k in range(len(SYNC_PHASES)):
                for peer in rule.peers(k, me):
                    per_phase[k].setdefault(peer, []).append(g)
        return {"groups": mine, "active": active,
                "peers": [sorted(d.items()) for d in per_phase]}

    def sync_replica_grads(self) -> None:
        """All-reduce (sum) the gradients of every replicated piece among its holders.

        Every rank must call it after backward, in step (each phase is a collective).
        """
        if self.plan.sparse_sync:
            self._sync_sparse()
            return
        grads = {}
        for pieces in self.pieces.values():
            for p in pieces:
                if p.replicated:
                    param = self.params[p.param_name]
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    grads[p.param_name] = param.grad.view(-1)
        for (sends, recvs), reduce, active in zip(self._sync, SYNC_REDUCES, self._sync_active):
            if not active:
                continue
            in_splits, out_splits = [0] * self.world, [0] * self.world
            for dst, _, _, n in sends:
                in_splits[dst] += n
            for src, _, _, n in recvs:
                out_splits[src] += n
            buf = torch.cat([grads[pn][a:a + n] for _, pn, a, n in sends]) if sends else torch.zeros(0)
            got = buf.new_empty(sum(out_splits))
            _all_to_all(got, buf, out_splits, in_splits, self.group, self.ledger, "replica_sync")
            offset = 0
            for _, pn, a, n in recvs:
                if reduce:
                    grads[pn][a:a + n] += got[offset:offset + n]
                else:
                    grads[pn][a:a + n] = got[offset:offset + n]
                offset += n

    def _sync_sparse(self) -> None:
        """routing.SparseSync on this rank's touched rows: per phase, a count per peer and group
        (int64), then the rows (int64 id as two fp32 words, then the fp32 gradients of those
        rows, per peer and group); received rows are summed in (reduce-scatter) or added to
        the held ones (all-gather: they are disjoint). Ends with every replicated piece's
        gradient a sparse tensor of the rows any holder touched, summed over holders."""
        plan = self._sparse
        state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for g, (_, pname, dim, _) in plan["groups"].items():
            grad = self.params[pname].grad
            if grad is None:
                state[g] = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dim))
            else:
                grad = grad.coalesce()
                state[g] = (grad.indices()[0], grad.values())
        for k, active in enumerate(plan["active"]):
            if not active:
                continue
            outgoing: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
            kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for g, (rule, _, _, _) in plan["groups"].items():
                rows, vals = state[g]
                sends, keep = rule.sends(k, self.rank, rows.numpy())
                for peer, pos in sends.items():
                    pos_t = torch.from_numpy(pos)
                    outgoing[(peer, g)] = (rows[pos_t], vals[pos_t])
                keep_t = torch.from_numpy(keep)
                kept[g] = (rows[keep_t], vals[keep_t])
            empty = (torch.zeros(0, dtype=torch.int64), None)
            peers = plan["peers"][k]
            counts = torch.tensor([outgoing.get((peer, g), empty)[0].numel() for peer, gs in peers for g in gs],
                                  dtype=torch.int64)
            splits = [0] * self.world
            for peer, gs in peers:
                splits[peer] = len(gs)
            got_counts = torch.empty_like(counts)
            _all_to_all(got_counts, counts, splits, splits, self.group, self.ledger, "replica_sync")
            parts, in_splits, out_splits = [], [0] * self.world, [0] * self.world
            i = 0
            for peer, gs in peers:
                for g in gs:
                    dim = plan["groups"][g][2]
                    if (peer, g) in outgoing:
                        rows, vals = outgoing[(peer, g)]
                        parts += [rows.view(torch.float32), vals.reshape(-1)]
                        in_splits[peer] += rows.numel() * (2 + dim)
                    out_splits[peer] += int(got_counts[i]) * (2 + dim)
                    i += 1
            buf = torch.cat(parts) if parts else torch.zeros(0)
            got = buf.new_empty(sum(out_splits))
            _all_to_all(got, buf, out_splits, in_splits, self.group, self.ledger, "replica_sync")
            incoming: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            offset, i = 0, 0
            for peer, gs in peers:
                for g in gs:
                    dim, n = plan["groups"][g][2], int(got_counts[i])
                    i += 1
                    if n:
                        rows = got[offset:offset + 2 * n].clone().view(torch.int64)
                        vals = got[offset + 2 * n:offset + n * (2 + dim)].view(n, dim)
                        incoming.setdefault(g, []).append((rows, vals))
                        offset += n * (2 + dim)
            for g, (rows, vals) in kept.items():
                more = incoming.get(g, [])
                if more:
                    rows = torch.cat([rows] + [r for r, _ in more])
                    vals = torch.cat([vals] + [v for _, v in more])
                    rows, inverse = torch.unique(rows, return_inverse=True)
                    vals = torch.zeros(rows.numel(), vals.shape[1]).index_add_(0, inverse, vals)
                state[g] = (rows, vals)
        for g, (_, pname, dim, nrows) in plan["groups"].items():
            rows, vals = state[g]
            self.params[pname].grad = torch.sparse_coo_tensor(rows[None], vals, (nrows, dim), is_coalesced=True,
                                                              check_invariants=False)  # rows: sorted, distinct

    # ------------------------------------------------------------------ inspection
    def local_rows(self, table: str) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, original row ids of its rows) of every local piece of `table`."""
        route = self.routes[table]
        return [(self.params[p.param_name], route.row_map.to_original(torch.arange(p.start, p.start + p.rows)))
                for p in self.pieces[table]]
