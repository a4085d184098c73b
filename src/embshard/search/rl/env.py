"""The estimated MDP DreamShard and AutoShard share.

An episode places a task's tables one at a time, in descending predicted single-table cost;
an action is a device. States and the reward come from the agent's cost network, never from
hardware. Memory goes through the foundation's `MemoryLedger`, the ledger every baseline
uses, so "fits" means the same thing everywhere:

* `mask="lookahead"`: a device is feasible when the table fits there AND the tables still to
  be placed stay packable afterwards (the ledger's first-fit-decreasing look-ahead); when no
  device keeps them packable, any device with room is (exactly `MemoryLedger.place`'s rule).
* `mask="room"`: any device with room (DreamShard's reference: no look-ahead).
* `mask="none"`: every device (AutoShard's reference); a placement that overflows ends the
  episode with the agent's overflow reward.

Training rollouts compute these masks and sample from the masked softmax. Planning
(`train=False`) never builds a mask: it ranks devices by logit (perturbed by Gumbel noise
for a sampled episode; the first feasible device in a Gumbel-perturbed order is a sample of
the masked softmax) and hands that preference to `MemoryLedger.place`, which takes the
first feasible one. So a plan is always valid whatever mask a policy was trained with, and
a table that fits nowhere raises the ledger's InfeasibleError (table name and shortfall),
the same one-line error as the baselines.

K episodes of one task run together (one network call per step for all of them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from embshard.errors import InputError
from embshard.plan import MemoryLedger, Plan, Shard
from embshard.search.rl.losses import masked_log_softmax
from embshard.tables import Table
from embshard.task import Task

MASKS = ("lookahead", "room", "none")


@dataclass
class TaskView:
    """A task as a policy sees it: tables in placement order and their inputs.

    Attributes:
        order: indices into task.tables, in placement order (descending predicted cost).
        x: [N, F] normalised table inputs in placement order.
        needs: memory bytes of each table on a device, in placement order.
        even_ms: the task's predicted single-table compute summed, over the devices.
        cache: agent-specific per-task tensors (encodings, LSTM states).
    """

    task: Task
    order: list[int]
    x: torch.Tensor
    needs: list[int]
    even_ms: float
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def tables(self) -> list[Table]:
        return [self.task.tables[i] for i in self.order]

    @property
    def num_tables(self) -> int:
        return len(self.order)

    @property
    def num_devices(self) -> int:
        return self.task.num_devices


class Agent(Protocol):
    """What an algorithm supplies to the shared rollout loop."""

    algorithm: str

    def prepare(self, task: Task) -> TaskView: ...

    def init_state(self, view: TaskView, k: int, lazy: bool = False) -> dict[str, torch.Tensor]:
        """The state of K episodes before any placement. `lazy` (planning with candidate
        devices): per-device costs are refreshed only for the device that changes."""
        ...

    def step(self, view: TaskView, state: dict[str, torch.Tensor], t: int, used_share: torch.Tensor,
             cand: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """[K, D] logits for placing table t, and per-step inputs to record for training;
        with `cand` [K, M] (a lazy state), the [K, M] logits of those devices only."""
        ...

    def candidate_scores(self, view: TaskView, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """[K, D] the devices' predicted cost now (lower: scored first in a lazy state)."""
        ...

    def advance(self, view: TaskView, state: dict[str, torch.Tensor], t: int, devices: torch.Tensor,
                placed: torch.Tensor) -> None: ...

    def planning_episodes(self, view: TaskView, samples: int, generator: torch.Generator | None,
                          max_candidates: int | None) -> "Rollouts | None":
        """`rollout`'s planning episodes (the argmax one, then `samples` sampled ones, the same
        noise from `generator`) by a faster route, or None (no such route)."""
        ...

    def finish(self, view: TaskView, state: dict[str, torch.Tensor]) -> None:
        """Bring a lazy state up to date before `estimate`."""
        ...

    def estimate(self, view: TaskView, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """[K] estimated plan cost (lower is better; picks the best of K)."""
        ...

    def reward(self, view: TaskView, state: dict[str, torch.Tensor], overflow: torch.Tensor) -> torch.Tensor:
        """[K] terminal reward (higher is better)."""
        ...


@dataclass
class Rollouts:
    """K episodes of one task.

    devices[k, t] is the device of table t (placement order), -1 where episode k had ended
    (a memory overflow under mask="none" or "room"). Training rollouts also carry each
    step's action (the overflowing one included), mask, the behaviour policy's
    log-probability of its action and the agent's recorded inputs, all [K, N, ...].
    """

    view: TaskView
    devices: torch.Tensor
    steps: torch.Tensor
    estimated_ms: torch.Tensor
    rewards: torch.Tensor
    overflow: torch.Tensor
    actions: torch.Tensor | None = None
    masks: torch.Tensor | None = None
    behaviour_logp: torch.Tensor | None = None
    records: dict[str, torch.Tensor] = field(default_factory=dict)

    def plan(self, k: int, algorithm: str) -> Plan:
        task = self.view.task
        if bool(self.overflow[k]):
            raise InputError(f"episode {k} of task {task.name!r} overflowed memory; it has no plan")
        shards = [Shard.whole(t, int(d)) for t, d in zip(self.view.tables, self.devices[k].tolist())]
        return Plan(task.name, algorithm, shards)


def check_fits_anywhere(task: Task) -> None:
    """Raise the ledger's InfeasibleError for the first table (largest need first) that fits
    on no empty device, before any policy runs: the same message a largest-first baseline gives."""
    biggest = min(task.tables, key=lambda t: (-task.table_memory_bytes(t), t.name))
    need = task.table_memory_bytes(biggest)
    if need > task.device_memory_bytes:
        raise MemoryLedger(task).nowhere(biggest, need)


def _feasible(ledger: MemoryLedger, need: int, mask: str) -> np.ndarray:
    """Devices a policy may choose for a piece of `need` bytes (all False: none has room).

    `lookahead` follows `MemoryLedger.place` step by step (forget the piece from the pending
    list, then check every device with room), so that the later `take` is what `place` would
    do; the ledger exposes that check only inside `place`, which picks one device, not a set.
    """
    free = np.asarray(ledger.free, dtype=np.int64)
    room = free >= need
    if mask == "none":
        return np.ones_like(room)
    if mask == "room" or not room.any():
        return room
    ledger.forget_pending(need)
    packs = np.array([bool(r) and ledger.pending_pack_after(d, need) for d, r in enumerate(room)])
    return packs if packs.any() else room


@torch.no_grad()
def rollout(agent: Agent, view: TaskView, k: int, *, train: bool, sample: bool = True, argmax_first: bool = False,
            mask: str = "lookahead", generator: torch.Generator | None = None,
            max_candidates: int | None = None) -> Rollouts:
    """Run K episodes of one task.

    Args:
        train: record masks, behaviour log-probabilities and the agent's inputs; sample from
            the `mask`-ed softmax. False: plan through `MemoryLedger.place` (see module doc).
        sample: sample actions (False: argmax for every episode).
        argmax_first: episode 0 takes the argmax, the others sample (best-of-K planning).
        max_candidates: planning only: on a task of more devices than this, each step scores
            only the `max_candidates` devices with room whose predicted cost is lowest now (the
            others follow them in the ledger's preference, cheapest first), so a step costs
            O(max_candidates) network rows, not O(devices). None: every device.
    """
    if mask not in MASKS:
        raise InputError(f"mask must be one of {', '.join(MASKS)}, got {mask!r}")
    task, n, d = view.task, view.num_tables, view.num_devices
    tables = view.tables
    if not train:
        check_fits_anywhere(task)
    lookahead = mask == "lookahead" or not train
    ledgers = [MemoryLedger(task, pending=view.needs if lookahead else ()) for _ in range(k)]
    lazy = not train and max_candidates is not None and d > int(max_candidates)
    state = agent.init_state(view, k, lazy=lazy)
    devices = torch.full((k, n), -1, dtype=torch.long)
    alive = torch.ones(k, dtype=torch.bool)
    overflow = torch.zeros(k, dtype=torch.bool)
    masks = torch.zeros((k, n, d), dtype=torch.bool) if train else None
    blogp = torch.zeros((k, n)) if train else None
    actions = torch.full((k, n), -1, dtype=torch.long) if train else None
    records: dict[str, list[torch.Tensor]] = {}
    greedy = torch.zeros(k, dtype=torch.bool)
    if not sample:
        greedy[:] = True
    elif argmax_first:
        greedy[0] = True
    memory = float(task.device_memory_bytes)
    used = torch.tensor([[1.0 - f / memory for f in led.free] for led in ledgers], dtype=torch.float32)
    free = torch.tensor([led.free for led in ledgers], dtype=torch.float64) if lazy else None  # bytes, kept in step
    for t in range(n):
        table, need = tables[t], view.needs[t]
        if lazy:
            devices[:, t] = _place_candidates(agent, view, state, t, table, used, free, ledgers, int(max_candidates),
                                              greedy, generator)
        else:
            logits, rec = agent.step(view, state, t, used.clone())
            if train:
                for key, v in rec.items():
                    records.setdefault(key, []).append(v)
                m = torch.from_numpy(np.stack([_feasible(led, need, mask) if alive[i] else np.ones(d, bool)
                                               for i, led in enumerate(ledgers)]))
                ok = m.any(dim=1)
                logp = masked_log_softmax(logits, m | ~ok[:, None])
                drawn = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
                choice = torch.where(greedy, logp.argmax(dim=1), drawn)
                masks[:, t] = m
                blogp[:, t] = logp.gather(1, choice[:, None]).squeeze(1)
                for i in range(k):
                    if not alive[i]:
                        continue
                    dev = int(choice[i])
                    actions[i, t] = dev
                    if not ok[i] or ledgers[i].free[dev] < need:  # only mask="none"/"room" get here
                        alive[i] = False
                        overflow[i] = True
                        continue
                    ledgers[i].take(dev, need)
                    devices[i, t] = dev
            else:
                scores = logits.clone()
                noisy = ~greedy
                if noisy.any():
                    u = torch.rand(scores.shape, generator=generator).clamp(1e-9, 1 - 1e-9)
                    scores[noisy] += -torch.log(-torch.log(u[noisy]))
                prefs = torch.argsort(scores, dim=1, descending=True, stable=True).tolist()  # ties: lowest device first
                for i in range(k):
                    devices[i, t] = ledgers[i].place(table, need, prefs[i])
        placed = devices[:, t] >= 0
        for i in np.flatnonzero(placed.numpy()).tolist():  # the memory share of the device that took it
            dev = int(devices[i, t])
            used[i, dev] = 1.0 - ledgers[i].free[dev] / memory
            if free is not None:
                free[i, dev] = ledgers[i].free[dev]
        agent.advance(view, state, t, devices[:, t].clamp(min=0), placed)
    steps = torch.zeros((k, n), dtype=torch.bool)
    for i in range(k):  # an episode's steps run up to and including the one that overflowed
        last = int((devices[i] >= 0).sum()) + (1 if overflow[i] else 0)
        steps[i, :last] = True
    agent.finish(view, state)
    out = Rollouts(view, devices, steps, agent.estimate(view, state), agent.reward(view, state, overflow), overflow,
                   actions, masks, blogp)
    out.records = {key: torch.stack(v, dim=1) for key, v in records.items()}
    return out


def _place_candidates(agent: Agent, view: TaskView, state: dict[str, torch.Tensor], t: int, table: Table,
                      used: torch.Tensor, free: torch.Tensor, ledgers: list[MemoryLedger], m: int, greedy: torch.Tensor,
                      generator: torch.Generator | None) -> torch.Tensor:
    """One planning step of a lazy state: score the `m` devices with room whose predicted cost
    is lowest now, then place through the ledger: those devices by logit (Gumbel-perturbed for
    a sampled episode), then every other device cheapest first (ordered only when the ledger
    asks past the scored ones). `free` [K, D]: the ledgers' free bytes."""
    need = view.needs[t]
    score = agent.candidate_scores(view, state).double().masked_fill(free < need, float("inf"))
    cand = torch.sort(score, dim=1, stable=True).indices[:, :m]  # ties (identical devices): lowest device first
    logits, _ = agent.step(view, state, t, used, cand)
    noisy = ~greedy
    if noisy.any():
        u = torch.rand(logits.shape, generator=generator).clamp(1e-9, 1 - 1e-9)
        logits[noisy] += -torch.log(-torch.log(u[noisy]))
    first = cand.gather(1, torch.argsort(logits, dim=1, descending=True, stable=True)).tolist()
    out = torch.empty(len(ledgers), dtype=torch.long)

    def rest(i: int):
        scored = set(first[i])
        yield from (d for d in torch.argsort(score[i], stable=True).tolist() if d not in scored)

    for i, led in enumerate(ledgers):
        out[i] = led.place(table, need, itertools.chain(first[i], rest(i)))
    return out


def _planning_rollout(agent: Agent, task: Task, samples: int, generator: torch.Generator | None,
                      max_candidates: int | None) -> Rollouts:
    """The argmax episode and `samples` sampled ones of a plan search (episode 0 the argmax),
    by the agent's faster route where it has one."""
    view = agent.prepare(task)
    fast = agent.planning_episodes(view, samples, generator, max_candidates)
    if fast is not None:
        return fast
    return rollout(agent, view, 1 + samples, train=False, sample=samples > 0, argmax_first=True,
                   generator=generator, max_candidates=max_candidates)


def best_plan(agent: Agent, task: Task, samples: int, generator: torch.Generator | None = None,
              algorithm: str | None = None, max_candidates: int | None = None) -> tuple[Plan, float]:
    """Argmax plan (samples=0), or the one of {argmax + `samples` sampled episodes} with the
    lowest estimated cost. Returns (plan, its estimated cost in ms). `max_candidates`: see
    `rollout`."""
    r = _planning_rollout(agent, task, samples, generator, max_candidates)
    k = int(torch.argmin(r.estimated_ms))
    return r.plan(k, algorithm or agent.algorithm), float(r.estimated_ms[k])


def plan_candidates(agent: Agent, task: Task, samples: int, generator: torch.Generator | None = None,
                    algorithm: str | None = None, max_candidates: int | None = None) -> list[tuple[Plan, float]]:
    """Every distinct plan of {argmax + `samples` sampled episodes} with the agent's estimate
    (ms), the lowest estimate first (so the first is `best_plan`'s, from the same generator)."""
    r = _planning_rollout(agent, task, samples, generator, max_candidates)
    out: list[tuple[Plan, float]] = []
    seen: set[tuple] = set()
    for k in torch.argsort(r.estimated_ms, stable=True).tolist():
        plan = r.plan(k, algorithm or agent.algorithm)
        if plan.signature() not in seen:
            seen.add(plan.signature())
            out.append((plan, float(r.estimated_ms[k])))
    return out
