"""DreamShard's and AutoShard's planning episodes in numpy, the argmax one and the sampled
ones of a best-of-K search: the same networks and the same steps as the torch rollout
(`env.rollout`, train=False), for planning only.

A planning step is dozens of tiny tensor operations on at most `max_candidates` devices; through
torch each pays several microseconds of dispatch, which is most of a step, and 5,384 tables take
5,384 steps. numpy's operations cost a fraction of that. The weights are copied out of the torch
modules once per episode, so a checkpoint is still the one source of truth, and
tests/test_rl_numpy_episode.py checks that the costs and logits equal the torch modules' and
that both episodes place tables alike.

Each step scores the `m` devices whose predicted cost is lowest now (all of them when the task
has no more than `m` devices) and hands them in logit order to the memory ledger, then every
other device cheapest first; the device that took the table is priced again, alone (the lazy
torch step prices every DreamShard candidate for that in advance, to save a network call; here
one row costs less than M). Ties between equal logits (identical devices) are broken by device
number, so a plan can differ from the torch episode's by a relabelling of identical devices.

The sampled episodes of a best-of-K search (`sampled`) run in lockstep, one set of array
operations per step for all of them, as the torch rollout batches them: each step draws the
torch rollout's uniform noise from the same generator, in the same shape and order, and turns
it into Gumbel noise by the same torch operations, so a sampled episode perturbs the logits by
exactly what the torch episode does; its devices are scored as the torch step scores them (every
device, by device number, on a task of at most `m` devices; else the `m` cheapest with room, by
rank). The logits themselves agree with torch's to float rounding, so a near-tie can still go
the other way. The argmax episode of the search is `episode`'s.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from embshard.plan import MemoryLedger
from embshard.search.rl.env import TaskView, check_fits_anywhere
from embshard.search.rl.nets import COST_FEATURES, AutoShardNet, DreamShardCostNet, DreamShardPolicy


def supported(costnet: DreamShardCostNet, policy: DreamShardPolicy) -> bool:
    """The shipped kind of DreamShard (structured comm heads, additive encoder, table-aware
    policy with its skip path); other variants plan through torch."""
    return (costnet.structured_comm and costnet.encoder.own is not None and policy.encode_table
            and policy.skip is not None and len(policy.scorer) == 3 and len(costnet.compute) == 3)


def autoshard_supported(net: AutoShardNet) -> bool:
    """The shipped kind of AutoShard (additive encoder, skip path); others plan through torch."""
    return (net.encoder.own is not None and net.encoder.volume is None and net.skip is not None
            and len(net.scorer) == 3 and len(net.cost_head) == 3)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy().copy()


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, np.float32(0.0))


def _ms(y: np.ndarray) -> np.ndarray:
    """`nets.log1p_ms` (np.clip's arithmetic without its wrappers: called thousands of times)."""
    return np.expm1(np.minimum(np.maximum(y, np.float32(0.0)), np.float32(20.0)))


def _cheapest_first(score: np.ndarray, m: int) -> np.ndarray:
    """`np.argsort(score, kind="stable")[:m]` (the m cheapest devices, ties: lowest index first),
    sorting only the devices no dearer than the m-th cheapest: a step on a thousand devices."""
    if m >= len(score):
        return np.argsort(score, kind="stable")
    kth = np.partition(score, m - 1)[m - 1]
    near = np.flatnonzero(score <= kth)
    if len(near) < m:  # a NaN score (never expected): the plain sort, which puts NaN last
        return np.argsort(score, kind="stable")[:m]
    return near[np.argsort(score[near], kind="stable")[:m]]


def _the_rest(score: np.ndarray, m: int):
    """The devices after the m cheapest, cheapest first, sorted only when the ledger asks
    (none of the m cheapest took the table)."""
    yield from np.argsort(score, kind="stable")[m:].tolist()


class _Episode:
    """The planning loop both agents share; a subclass keeps the devices' state (`start`,
    `took`), each device's predicted cost now (`scores`) and scores candidates (`logits`)."""

    s: np.ndarray  # [D, E] the devices' encoding sums
    cnt: np.ndarray  # [D] their table counts
    used: np.ndarray  # [D] the share of each device's memory in use
    out: int  # the encoder's columns before its additive ones (`ShardEncoder.out`)
    c1w: np.ndarray  # the compute head's two layers: [E, H], [H], [H], a scalar bias
    c1b: np.ndarray
    c2w: np.ndarray
    c2b: float

    def features(self, sums: np.ndarray) -> np.ndarray:
        """`ShardEncoder.features`."""
        feats = sums.copy()
        np.log1p(feats[..., self.out :], out=feats[..., self.out :])
        return feats

    def compute_log(self, sums: np.ndarray, counts: np.ndarray, feats: np.ndarray) -> np.ndarray:
        """`ShardEncoder.compute_log` (additive) of sums [R, E], counts [R], their features."""
        y = _relu(feats @ self.c1w + self.c1b) @ self.c2w + self.c2b
        return np.log1p(sums[:, self.out] * np.exp(np.tanh(y))) * (counts > 0)

    def start(self, view: TaskView, **inputs: torch.Tensor) -> None:
        raise NotImplementedError

    def scores(self) -> np.ndarray:
        raise NotImplementedError

    def logits(self, t: int, rows: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def took(self, t: int, dev: int) -> None:
        raise NotImplementedError

    # the same for K episodes in lockstep (`sampled`): state arrays gain a leading episode axis
    def start_batch(self, view: TaskView, k: int, **inputs: torch.Tensor) -> None:
        raise NotImplementedError

    def scores_batch(self) -> np.ndarray:
        """[K, D] each episode's devices' predicted cost now."""
        raise NotImplementedError

    def logits_batch(self, t: int, cand: np.ndarray, used: np.ndarray) -> np.ndarray:
        """[K, M] logits of each episode's candidate devices `cand` [K, M] for table t; `used`
        [K, D]: the share of each device's memory in use."""
        raise NotImplementedError

    def took_batch(self, t: int, devs: np.ndarray) -> None:
        """Episode i's device devs[i] took table t."""
        raise NotImplementedError

    def batch_sums(self) -> tuple[np.ndarray, np.ndarray]:
        """The devices' encoding sums [K, D, E] and table counts [K, D] of the K episodes."""
        raise NotImplementedError

    def sampled(self, view: TaskView, k: int, generator: torch.Generator | None, max_candidates: int | None,
                until: int | None = None, **inputs: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """K sampled episodes (module doc): (the device of each table [K, N] in placement order,
        the devices' encoding sums [K, D, E] and table counts [K, D] at their end). The noise is
        that of episodes 1..K of the torch rollout of 1 + K episodes (episode 0 the argmax).
        `until`: stop before that step (the step where the argmax episode found no room: the
        torch rollout raises the first failure in step order, so only an earlier one of these
        episodes would be raised instead)."""
        with threadpool_limits(1, user_api="blas"):
            return self._run_sampled(view, k, generator, max_candidates, inputs, until)

    def _run_sampled(self, view: TaskView, k: int, generator: torch.Generator | None, max_candidates: int | None,
                     inputs: dict[str, torch.Tensor], until: int | None = None):
        task, d = view.task, view.num_devices
        n = view.num_tables if until is None else until
        check_fits_anywhere(task)
        lazy = max_candidates is not None and d > int(max_candidates)  # as `env.rollout` decides
        m = int(max_candidates) if lazy else d
        self.start_batch(view, k, **inputs)
        ledgers = [MemoryLedger(task, pending=view.needs) for _ in range(k)]
        free = np.array([led.free for led in ledgers], dtype=np.float64)  # [K, D]
        memory = float(task.device_memory_bytes)
        used = np.zeros((k, d), dtype=np.float32)
        every = np.broadcast_to(np.arange(d), (k, d))
        rows = np.arange(k)
        tables = view.tables
        out = np.empty((k, n), dtype=np.int64)
        for t in range(n):
            need = view.needs[t]
            # the torch rollout's draw for its 1 + K episodes; the argmax episode's row is unused
            u = torch.rand((1 + k, m), generator=generator).clamp(1e-9, 1 - 1e-9)
            gumbel = (-torch.log(-torch.log(u[1:]))).numpy()
            score = self.scores_batch().astype(np.float64)
            score[free < need] = np.inf
            cand = np.stack([_cheapest_first(score[i], m) for i in range(k)]) if lazy else every
            noisy = self.logits_batch(t, cand, used) + gumbel
            first = np.take_along_axis(cand, np.argsort(-noisy, axis=1, kind="stable"), axis=1).tolist()
            devs = np.empty(k, dtype=np.int64)
            for i, led in enumerate(ledgers):
                rest = _the_rest(score[i], m) if lazy else ()
                devs[i] = led.place(tables[t], need, itertools.chain(first[i], rest))
                free[i, devs[i]] = led.free[devs[i]]
            out[:, t] = devs
            used[rows, devs] = 1.0 - free[rows, devs] / memory
            self.took_batch(t, devs)
        return (out, *self.batch_sums())

    def episode(self, view: TaskView, max_candidates: int | None,
                **inputs: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The argmax episode: (the device of each table [N] in placement order, the devices'
        encoding sums [D, E] and table counts [D] at its end). `inputs`: the agent's per-task
        tensors (`start`)."""
        # numpy's BLAS on one thread, as the planners' torch: its own pool would spin on every core
        # (against the portfolio's other workers) for matrices this small
        with threadpool_limits(1, user_api="blas"):
            return self._run(view, max_candidates, inputs)

    def _run(self, view: TaskView, max_candidates: int | None, inputs: dict[str, torch.Tensor]):
        task, n, d = view.task, view.num_tables, view.num_devices
        self.step = 0  # the step where an InfeasibleError was raised (0: before any, as here)
        check_fits_anywhere(task)
        m = d if max_candidates is None else min(d, int(max_candidates))
        self.start(view, **inputs)
        ledger = MemoryLedger(task, pending=view.needs)
        free = np.asarray(ledger.free, dtype=np.float64)
        memory = float(task.device_memory_bytes)
        self.used = np.zeros(d, dtype=np.float32)
        tables = view.tables
        out = np.empty(n, dtype=np.int64)
        for t in range(n):
            self.step = t
            need = view.needs[t]
            score = self.scores().astype(np.float64)
            score[free < need] = np.inf
            cand = _cheapest_first(score, m)  # ties (identical devices): lowest first
            # empty devices are identical: one is scored for all (numpy's kernels may round the same
            # row differently at another position, which would break their tie at random)
            empty = self.cnt[cand] == 0
            keep = ~empty
            keep[np.argmax(empty)] = True
            src = np.cumsum(keep) - 1  # each candidate's scored row
            src[empty] = src[np.argmax(empty)]
            logits = self.logits(t, cand[keep])[src]
            first = cand[np.argsort(-logits, kind="stable")]
            dev = ledger.place(tables[t], need, itertools.chain(first.tolist(), _the_rest(score, m)))
            out[t] = dev
            free[dev] = ledger.free[dev]
            self.used[dev] = 1.0 - ledger.free[dev] / memory
            self.took(t, dev)
        return out, self.s, self.cnt


class NumpyDreamShard(_Episode):
    """The weights of a DreamShard cost network and policy as numpy arrays, and its planning
    episodes over them, argmax and sampled (see module doc)."""

    def __init__(self, costnet: DreamShardCostNet, policy: DreamShardPolicy):
        if not supported(costnet, policy):
            raise ValueError("NumpyDreamShard needs structured comm heads, an additive encoder and a table-aware policy")
        enc = costnet.encoder
        self.out = enc.out
        c1, c2 = costnet.compute[0], costnet.compute[2]
        self.c1w, self.c1b, self.c2w, self.c2b = _np(c1.weight.T), _np(c1.bias), _np(c2.weight[0]), float(c2.bias.detach()[0])
        heads = (costnet.forward_comm, costnet.backward_comm)
        w1 = _np(torch.cat([h[0].weight for h in heads]).T)  # [F + F + 3, 2H]: both heads' first layers
        f = enc.width
        self.h_feat, self.h_ctx, self.h_extra = w1[:f], w1[f : 2 * f], w1[2 * f :]
        self.h1b = _np(torch.cat([h[0].bias for h in heads]))
        self.h2w = _np(torch.block_diag(*[h[2].weight for h in heads]).T)  # [2H, 2]
        self.h2b = _np(torch.cat([h[2].bias for h in heads]))
        self.rate, self.base = _np(costnet.comm_rate.exp()), _np(costnet.comm_base.exp())
        e1, e2 = policy.cost_encoder[0], policy.cost_encoder[2]
        self.e1w, self.e1b, self.e2w, self.e2b = _np(e1.weight.T), _np(e1.bias), _np(e2.weight.T), _np(e2.bias)
        s1, s2 = policy.scorer[0], policy.scorer[2]
        w = s1.weight
        e = policy.encoder[-2].out_features
        c = e2.out_features
        self.s_rows = _np(torch.cat([w[:, : e + c], w[:, 2 * e + c :]], dim=1).T)  # [device, its costs, with the table]
        self.s_table, self.s1b = _np(w[:, e + c : 2 * e + c].T), _np(s1.bias)
        self.s2w = _np(torch.cat([s2.weight, policy.skip.weight], dim=1)[0])  # last layer and skip path together
        self.s2b = float((s2.bias + policy.skip.bias).detach()[0])

    # ------------------------------------------------------------------ networks
    @staticmethod
    def payload(out_d: np.ndarray, total: np.ndarray, devices: int) -> tuple[np.ndarray, np.ndarray]:
        """`DreamShardCostNet._payload`: (payload MB [R], the comm heads' extras [R, 3])."""
        d = np.float32(devices)
        volume = np.maximum(out_d * (d - 1) + (total - out_d), np.float32(0.0)) / max(d, np.float32(1.0))
        extra = np.empty((len(volume), 3), dtype=np.float32)
        extra[:, 0], extra[:, 1], extra[:, 2] = np.log1p(volume), np.log(max(d, np.float32(1.0))), np.log1p(total)
        return volume, extra

    def costs(self, sums: np.ndarray, counts: np.ndarray, ctx_part: np.ndarray, total: np.ndarray, devices: int,
              slowest: float, feats: np.ndarray | None = None, compute: np.ndarray | None = None) -> np.ndarray:
        """[R, 3] predicted ms (`DreamShardCostNet.device_costs` with a `TaskContext`) of R
        devices' sums [R, E] and counts [R], the context's part of the comm heads' first layer
        `ctx_part` [B, 2H] for B equal blocks of the rows (the features of the max over the task's
        devices, through that layer's columns for them), the task's payload MB `total` [R] and
        slowest compute (ms; one for every row, or one per row [R]); `feats`, `compute`: the
        devices' features and compute log where already known."""
        feats = self.features(sums) if feats is None else feats
        compute = self.compute_log(sums, counts, feats) if compute is None else compute
        volume, extra = self.payload(sums[:, -1], total, devices)
        pre = feats @ self.h_feat + extra @ self.h_extra + self.h1b
        pre = (pre.reshape(len(ctx_part), -1, pre.shape[-1]) + ctx_part[:, None]).reshape(pre.shape)
        raw = _relu(pre) @ self.h2w + self.h2b
        c_ms = _ms(compute)
        many = np.float32(1.0 if devices > 1 else 0.0)
        comm = many * (volume[:, None] * self.rate * np.exp(2.0 * np.tanh(raw / 2.0)) + self.base)  # [R, 2]: fw, bw
        comm[:, 0] += np.maximum(np.maximum(np.float32(slowest), c_ms) - c_ms, np.float32(0.0))
        out = np.empty((len(compute), 3), dtype=np.float32)
        out[:, 0] = compute
        out[:, 1:] = np.log1p(comm)
        return _ms(out)

    def placement(self, s: np.ndarray, cnt: np.ndarray, table: np.ndarray, smax: np.ndarray, total: float,
                  devices: int, slowest: float) -> tuple[np.ndarray, np.ndarray]:
        """`DreamShardCostNet.placement_costs` for one episode: (now, with) [M, 3] ms of the
        candidates' sums s [M, E] and counts [M]."""
        m = len(s)
        sums2 = np.concatenate([s, s + table])
        cnt2 = np.concatenate([cnt, cnt + 1])
        feats = self.features(sums2)
        total2 = np.repeat(np.array([total, total + table[-1]], dtype=np.float32), m)
        ctx = self.features(np.stack([smax, smax + table])) @ self.h_ctx  # the same for every device of a block
        out = self.costs(sums2, cnt2, ctx, total2, devices, slowest, feats=feats)
        return out[:m], out[m:]

    def policy_logits(self, device_enc: np.ndarray, now: np.ndarray, taking: np.ndarray, table_enc: np.ndarray,
                      even_ms: float) -> np.ndarray:
        """`DreamShardPolicy.logits` of M devices (device encodings [M, E] already scaled)."""
        scale = np.float32(max(even_ms, 1e-3))
        raw = np.concatenate([np.log1p(now), now / scale, np.log1p(taking), taking / scale], axis=-1)  # [M, 12]
        m = len(raw)
        enc = _relu(_relu(raw.reshape(2 * m, COST_FEATURES) @ self.e1w + self.e1b) @ self.e2w + self.e2b).reshape(m, -1)
        h = _relu(np.concatenate([device_enc, enc], axis=-1) @ self.s_rows + (table_enc @ self.s_table + self.s1b))
        return np.concatenate([h, raw], axis=-1) @ self.s2w + self.s2b

    # ------------------------------------------------------------------ episode
    def start(self, view: TaskView, enc_c: torch.Tensor, enc_p: torch.Tensor, init_costs: torch.Tensor) -> None:
        """`enc_c`, `enc_p`: the cost network's and the policy's table encodings [N, E] (placement
        order); `init_costs` [D, 3]: the costs of the empty devices."""
        d = view.num_devices
        self.enc_c, self.enc_p = _np(enc_c), _np(enc_p)
        self.s = np.zeros((d, self.enc_c.shape[1]), dtype=np.float32)
        self.smax = np.zeros(self.enc_c.shape[1], dtype=np.float32)
        self.cnt = np.zeros(d, dtype=np.float32)
        self.u = np.zeros((d, self.enc_p.shape[1]), dtype=np.float32)
        self.device_costs = _np(init_costs)
        self.scale, self.even_ms, self.devices = np.float32(d / view.num_tables), view.even_ms, d

    def scores(self) -> np.ndarray:
        return self.device_costs.sum(axis=1)

    def logits(self, t: int, rows: np.ndarray) -> np.ndarray:
        total, slowest = float(self.s[:, -1].sum()), float(self.device_costs[:, 0].max())
        now, taking = self.placement(self.s[rows], self.cnt[rows], self.enc_c[t], self.smax, total, self.devices, slowest)
        return self.policy_logits(self.u[rows] * self.scale, now, taking, self.enc_p[t], self.even_ms)

    def took(self, t: int, dev: int) -> None:
        slowest = float(self.device_costs[:, 0].max())
        self.s[dev] += self.enc_c[t]
        self.cnt[dev] += 1
        self.u[dev] += self.enc_p[t]
        self.smax = np.maximum(self.smax, self.s[dev])
        # priced as it is now (the devices' max grew by this device alone)
        self.device_costs[dev] = self.costs(self.s[dev : dev + 1], self.cnt[dev : dev + 1],
                                            self.features(self.smax[None]) @ self.h_ctx,
                                            np.array([self.s[:, -1].sum()], dtype=np.float32), self.devices, slowest)[0]

    # ------------------------------------------------------------------ K episodes
    def start_batch(self, view: TaskView, k: int, enc_c: torch.Tensor, enc_p: torch.Tensor,
                    init_costs: torch.Tensor) -> None:
        self.start(view, enc_c=enc_c, enc_p=enc_p, init_costs=init_costs)
        self.s = np.repeat(self.s[None], k, axis=0)
        self.smax = np.repeat(self.smax[None], k, axis=0)
        self.cnt = np.repeat(self.cnt[None], k, axis=0)
        self.u = np.repeat(self.u[None], k, axis=0)
        self.device_costs = np.repeat(self.device_costs[None], k, axis=0)

    def scores_batch(self) -> np.ndarray:
        return self.device_costs.sum(axis=2)

    def logits_batch(self, t: int, cand: np.ndarray, used: np.ndarray) -> np.ndarray:
        """`logits` for K episodes: block b < K of the cost rows is episode b's devices now,
        block K + b the same devices with the table."""
        k, m = cand.shape
        at = np.arange(k)[:, None], cand
        s, cnt, table = self.s[at].reshape(k * m, -1), self.cnt[at].reshape(-1), self.enc_c[t]
        total = self.s[:, :, -1].sum(axis=1)  # [K] each episode's payload MB
        slowest = np.tile(np.repeat(self.device_costs[:, :, 0].max(axis=1), m), 2)
        sums2 = np.concatenate([s, s + table])
        total2 = np.concatenate([np.repeat(total, m), np.repeat(total + table[-1], m)]).astype(np.float32)
        ctx = self.features(np.concatenate([self.smax, self.smax + table])) @ self.h_ctx  # [2K, 2H]
        both = self.costs(sums2, np.concatenate([cnt, cnt + 1]), ctx, total2, self.devices, slowest,
                          feats=self.features(sums2))
        return self.policy_logits(self.u[at].reshape(k * m, -1) * self.scale, both[: k * m], both[k * m :],
                                  self.enc_p[t], self.even_ms).reshape(k, m)

    def took_batch(self, t: int, devs: np.ndarray) -> None:
        at = np.arange(len(devs)), devs
        slowest = self.device_costs[:, :, 0].max(axis=1)
        self.s[at] += self.enc_c[t]
        self.cnt[at] += 1
        self.u[at] += self.enc_p[t]
        self.smax = np.maximum(self.smax, self.s[at])
        self.device_costs[at] = self.costs(self.s[at], self.cnt[at], self.features(self.smax) @ self.h_ctx,
                                           self.s[:, :, -1].sum(axis=1), self.devices, slowest)

    def batch_sums(self) -> tuple[np.ndarray, np.ndarray]:
        return self.s, self.cnt


class NumpyAutoShard(_Episode):
    """The weights of an AutoShard network as numpy arrays, and its planning episodes over them,
    argmax and sampled: the LSTM's states come in per table (`AutoShardAgent.prepare` computes
    them)."""

    def __init__(self, net: AutoShardNet):
        if not autoshard_supported(net):
            raise ValueError("NumpyAutoShard needs an additive encoder and the skip path")
        self.out = net.encoder.out
        c1, c2 = net.cost_head[0], net.cost_head[2]
        self.c1w, self.c1b, self.c2w, self.c2b = _np(c1.weight.T), _np(c1.bias), _np(c2.weight[0]), float(c2.bias.detach()[0])
        self.aw, self.ab = _np(net.action.weight.T), _np(net.action.bias)
        s1, s2 = net.scorer[0], net.scorer[2]
        h = net.action.out_features
        w = _np(s1.weight.T)  # [3H, S]: rows for the state, the action, their product
        self.s_state, self.s_action, self.s_both, self.s1b = w[:h], w[h : 2 * h], w[2 * h :], _np(s1.bias)
        self.s2w, self.s2b = _np(s2.weight[0]), float(s2.bias.detach()[0])
        self.kw, self.kb = _np(net.skip.weight[0]), float(net.skip.bias.detach()[0])

    def shard_cost(self, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """`AutoShardNet.shard_cost` (ms) of shards' sums [R, E] and counts [R]."""
        return _ms(self.compute_log(sums, counts, self.features(sums)))

    def start(self, view: TaskView, enc: torch.Tensor, h: torch.Tensor) -> None:
        """`enc`: the table encodings [N, E], `h`: the LSTM's state at each table [N, H] (placement order)."""
        d = view.num_devices
        self.enc, self.h = _np(enc), _np(h)
        self.s = np.zeros((d, self.enc.shape[1]), dtype=np.float32)
        self.cnt = np.zeros(d, dtype=np.float32)
        self.cost = np.zeros(d, dtype=np.float32)  # an empty device computes nothing
        self.scale, self.even = np.float32(d / view.num_tables), np.float32(max(view.even_ms, 1e-3))

    def scores(self) -> np.ndarray:
        return self.cost

    def logits(self, t: int, rows: np.ndarray) -> np.ndarray:
        """`AutoShardNet.logits` of the devices `rows`: the scorer's first layer on [state, action,
        state x action] as action @ (W_action + state x W_both) + state @ W_state."""
        c = self.cost[rows]
        feats = np.stack([np.log1p(c), c / self.even, self.used[rows]], axis=-1)
        a = _relu(np.concatenate([self.features(self.s[rows] * self.scale), feats], axis=-1) @ self.aw + self.ab)
        state = self.h[t]
        pre = a @ (self.s_action + state[:, None] * self.s_both) + (state @ self.s_state + self.s1b)
        return _relu(pre) @ self.s2w + self.s2b + feats @ self.kw + self.kb

    def took(self, t: int, dev: int) -> None:
        self.s[dev] += self.enc[t]
        self.cnt[dev] += 1
        self.cost[dev] = self.shard_cost(self.s[dev : dev + 1], self.cnt[dev : dev + 1])[0]

    # ------------------------------------------------------------------ K episodes
    # the K episodes' devices are rows e * D + device of flat arrays, which `logits` reads as they are
    def start_batch(self, view: TaskView, k: int, enc: torch.Tensor, h: torch.Tensor) -> None:
        self.start(view, enc=enc, h=h)
        self.k, self.d = k, view.num_devices
        self.s = np.zeros((k * self.d, self.enc.shape[1]), dtype=np.float32)
        self.cnt = np.zeros(k * self.d, dtype=np.float32)
        self.cost = np.zeros(k * self.d, dtype=np.float32)

    def scores_batch(self) -> np.ndarray:
        return self.cost.reshape(self.k, self.d)

    def logits_batch(self, t: int, cand: np.ndarray, used: np.ndarray) -> np.ndarray:
        self.used = used.reshape(-1)
        return self.logits(t, cand + (np.arange(self.k) * self.d)[:, None])

    def took_batch(self, t: int, devs: np.ndarray) -> None:
        flat = np.arange(self.k) * self.d + devs
        self.s[flat] += self.enc[t]
        self.cnt[flat] += 1
        self.cost[flat] = self.shard_cost(self.s[flat], self.cnt[flat])

    def batch_sums(self) -> tuple[np.ndarray, np.ndarray]:
        return self.s.reshape(self.k, self.d, -1), self.cnt.reshape(self.k, self.d)
