"""DreamShard's and AutoShard's side of the shared rollout loop (`env.rollout`), and their
policy losses, recomputed with gradients from recorded rollouts.

A rollout runs without gradients; the loss replays it: the per-device encoding sums a
policy saw before step t are an exclusive cumulative sum of the placed tables' encodings
over the recorded actions, so one batched forward gives every step's logits again, now
with gradients. Inputs that come from a frozen network (DreamShard's cost features) are
recorded instead of recomputed.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as Fn

from embshard.errors import InfeasibleError
from embshard.plan import Plan
from embshard.search.rl import numpy_episode
from embshard.search.rl.env import Rollouts, TaskView
from embshard.search.rl.features import FeatureNorm
from embshard.search.rl.losses import masked_entropy, masked_log_softmax, normalised_advantages, reinforce_loss, vtrace
from embshard.search.rl.nets import AutoShardNet, DreamShardCostNet, DreamShardPolicy, TaskContext, cost_features
from embshard.task import Task

ESTIMATES = ("overall", "devices")


def _ordered_view(task: Task, x: torch.Tensor, single_ms: torch.Tensor) -> TaskView:
    names = [t.name for t in task.tables]
    order = sorted(range(len(names)), key=lambda i: (-float(single_ms[i]), names[i]))
    needs = [task.table_memory_bytes(task.tables[i]) for i in order]
    view = TaskView(task, order, x[order], needs, float(single_ms.sum()) / task.num_devices)
    view.cache["single_ms"] = single_ms[order]  # each table's predicted cost alone (column splits read it)
    return view


def _placed_onehot(devices: torch.Tensor, d: int) -> torch.Tensor:
    """[K, N, D] float: 1 where table t went to device d (rows of unplaced steps are 0)."""
    return Fn.one_hot(devices.clamp(min=0), d).float() * (devices >= 0).unsqueeze(-1).float()


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim=dim) - x


def _safe(mask: torch.Tensor) -> torch.Tensor:
    """A step whose mask is all False (an overflow) was sampled from every device."""
    return mask | ~mask.any(dim=-1, keepdim=True)


def _rows(x: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """x [K, D, E] at the devices cand [K, M]: [K, M, E]."""
    return x.gather(1, cand[..., None].expand(-1, -1, x.shape[-1]))


def _pad(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    return torch.cat([Fn.pad(r, (0, width - r.shape[1])) for r in rows], dim=0)


def _numpy_rollouts(agent, view: TaskView, state: dict[str, torch.Tensor], devices: np.ndarray) -> Rollouts:
    """K numpy planning episodes as `env.rollout` returns them: `devices` [K, N], `state` holds
    the end's sums and counts."""
    k = len(devices)
    overflow = torch.zeros(k, dtype=torch.bool)
    return Rollouts(view, torch.from_numpy(devices), torch.ones(k, view.num_tables, dtype=torch.bool),
                    agent.estimate(view, state), agent.reward(view, state, overflow), overflow)


def _with_sampled(fast: Any, view: TaskView, samples: int, generator: torch.Generator | None,
                  max_candidates: int | None, inputs: dict[str, torch.Tensor]) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """The numpy argmax episode and `samples` sampled ones after it (`numpy_episode`): devices
    [1 + K, N], the devices' sums [1 + K, D, E] and counts [1 + K, D]."""
    try:
        devices, sums, counts = fast.episode(view, max_candidates, **inputs)
    except InfeasibleError:
        if samples > 0:  # a sampled episode that ran out of room at an earlier step is the one raised
            fast.sampled(view, samples, generator, max_candidates, until=fast.step, **inputs)
        raise
    devices, sums, counts = devices[None], sums[None].copy(), counts[None].copy()
    if samples > 0:
        more, s, c = fast.sampled(view, samples, generator, max_candidates, **inputs)
        devices, sums, counts = (np.concatenate([devices, more]), np.concatenate([sums, s]),
                                 np.concatenate([counts, c]))
    return devices, torch.from_numpy(sums), torch.from_numpy(counts)


class _Estimating:
    """Estimate a given plan by replaying it as an episode."""

    def planning_episodes(self, view: TaskView, samples: int, generator: torch.Generator | None,
                          max_candidates: int | None) -> Rollouts | None:
        """The argmax planning episode and `samples` sampled ones (episode 0 the argmax) by a
        faster route than `env.rollout`, or None where the agent has none (then `env.rollout`
        plans)."""
        return None

    def estimate_plan(self, task: Task, plan: Plan) -> float:
        with torch.no_grad():
            view = self.prepare(task)
            device_of = {s.table: s.device for s in plan.shards}
            state = self.init_state(view, 1)
            for t, table in enumerate(view.tables):
                self.advance(view, state, t, torch.tensor([device_of[table.name]]), torch.tensor([True]))
            self.finish(view, state)
            return float(self.estimate(view, state)[0])


class DreamShardAgent(_Estimating):
    """DreamShard (NeurIPS 2022) on the estimated MDP.

    Args:
        norm: input normalisation (train-pool statistics).
        costnet, policy: the two networks.
        reward_comm: the overall head (and the "devices" estimate) include forward comm with
            its wait, i.e. the full measured plan cost; False: compute + backward comm only,
            the reference's three heads.
        estimate: "overall" (the reference: the overall head on the element-wise max) or
            "devices" (max over devices of the summed per-device heads).
    """

    algorithm = "dreamshard"

    def __init__(self, norm: FeatureNorm, costnet: DreamShardCostNet, policy: DreamShardPolicy,
                 reward_comm: bool = True, estimate: str = "overall"):
        self.norm, self.costnet, self.policy = norm, costnet, policy
        self.reward_comm = bool(reward_comm)
        self.estimate_kind = estimate

    def modules(self) -> dict[str, torch.nn.Module]:
        return {"costnet": self.costnet, "policy": self.policy}

    @torch.no_grad()
    def planning_episodes(self, view: TaskView, samples: int, generator: torch.Generator | None,
                          max_candidates: int | None) -> Rollouts | None:
        """The planning episodes in numpy (`numpy_episode`: the same networks and steps, a
        fraction of torch's per-operation cost), for the shipped kind of networks."""
        if not numpy_episode.supported(self.costnet, self.policy):
            return None
        state = self.init_state(view, 1)
        fast = numpy_episode.NumpyDreamShard(self.costnet, self.policy)
        devices, state["S"], state["cnt"] = _with_sampled(
            fast, view, samples, generator, max_candidates,
            {"enc_c": view.cache["enc_c"], "enc_p": state["enc_p"], "init_costs": state["costs"][0]})
        state["costs"] = self.costnet.device_costs(state["S"], state["cnt"])
        return _numpy_rollouts(self, view, state, devices)

    # ------------------------------------------------------------------ episode
    @torch.no_grad()
    def prepare(self, task: Task) -> TaskView:
        x = torch.from_numpy(self.norm(task.tables, task.batch_size))
        enc = self.costnet.encoder(x)
        single = self.costnet.device_costs(enc[:, None, :], torch.ones(len(x), 1))[:, 0, 0]
        view = _ordered_view(task, x, single)
        view.cache["enc_c"] = enc[view.order]
        return view

    def init_state(self, view: TaskView, k: int, lazy: bool = False) -> dict[str, torch.Tensor]:
        d, ec = view.num_devices, self.costnet.width
        s = torch.zeros(k, d, ec)
        cnt = torch.zeros(k, d)
        enc_p = self.policy.encoder(view.x)
        state = {"S": s, "cnt": cnt, "U": torch.zeros(k, d, enc_p.shape[1]), "enc_p": enc_p,
                 "costs": self.costnet.device_costs(s, cnt)}
        if lazy:  # the element-wise max of the sums over devices, kept as tables are placed
            state["Smax"] = torch.zeros(k, ec)
        return state

    def step(self, view, state, t, used_share, cand=None):
        k, d = state["cnt"].shape
        if cand is not None:
            return self._step_candidates(view, state, t, cand)
        if self.costnet.structured_comm:  # every device a candidate, with the task's context
            return self._step_candidates(view, state, t, torch.arange(d).expand(k, d), record=True)
        cf = cost_features(state["costs"], view.even_ms)
        rec = {"cost": cf}
        table_enc = whatif = None
        if self.policy.encode_table:
            enc = view.cache["enc_c"][t]
            whatif = cost_features(self.costnet.device_costs(state["S"] + enc, state["cnt"] + 1), view.even_ms)
            rec["whatif"] = whatif
            table_enc = state["enc_p"][t].expand(k, -1)
        logits = self.policy.logits(state["U"] * (d / view.num_tables), cf, table_enc, whatif)
        return logits, rec

    def _step_candidates(self, view, state, t, cand, record: bool = False):
        """[K, M] logits of the candidate devices `cand` [K, M] only (a lazy planning state, or
        every device of a structured-comm cost network, `record`ing the training inputs)."""
        k, d = state["cnt"].shape
        s = _rows(state["S"], cand)
        cnt = state["cnt"].gather(1, cand)
        smax = state["Smax"] if "Smax" in state else state["S"].max(dim=1).values
        net = self.costnet
        task = self._task_context(state, d) if net.structured_comm else None
        table_enc = whatif = None
        if self.policy.encode_table:
            # as `step`: every device's cost were it to take the table (the context's max too; the
            # task's payload grows by the table's, once); a lazy state also prices each candidate
            # as it will be once it took the table (the devices' max grows by this device only),
            # as `advance` computes it, so that `advance` need not run the network again
            lazy = "Smax" in state
            now, taking, taken = net.placement_costs(s, cnt, view.cache["enc_c"][t], smax, task, taken=lazy)
            cf, whatif = cost_features(now, view.even_ms), cost_features(taking, view.even_ms)
            if lazy:
                state["taken"] = (cand, taken)
            elif record and net.structured_comm:  # every device, in order: each one's compute once it
                # took the table, which is all `advance` needs (compute reads the device's own sum)
                state["taken_compute"] = taking[..., 0]
            table_enc = state["enc_p"][t].expand(k, -1)
        else:
            cf = cost_features(net.device_costs(s, cnt, max_sums=smax, task=task), view.even_ms)
        rec = {"cost": cf} if record else {}
        if record and whatif is not None:
            rec["whatif"] = whatif
        logits = self.policy.logits(_rows(state["U"], cand) * (d / view.num_tables), cf, table_enc, whatif)
        return logits, rec

    def _task_context(self, state, d: int) -> TaskContext:
        """The structured comm heads' view of all devices: total payload, count, slowest compute."""
        k = state["cnt"].shape[0]
        return TaskContext(self.costnet.encoder.volume_mb(state["S"]).sum(-1), torch.full((k,), float(d)),
                           state["costs"][..., 0].max(-1).values)

    def candidate_scores(self, view, state) -> torch.Tensor:
        """[K, D] the devices' predicted cost now, lowest first (stale but for the devices that
        changed, in a lazy state): which devices a lazy step scores."""
        return state["costs"].sum(-1)

    def advance(self, view, state, t, devices, placed):
        rows, on = torch.arange(len(devices)), placed[:, None].float()  # an episode not placed adds 0
        state["S"][rows, devices] += on * view.cache["enc_c"][t]
        state["cnt"][rows, devices] += on[:, 0]
        state["U"][rows, devices] += on * state["enc_p"][t]
        if "Smax" not in state:
            taken = state.pop("taken_compute", None)
            if taken is None:
                state["costs"] = self.costnet.device_costs(state["S"], state["cnt"])
                state["stale"] = False
                return
            # a structured-comm step over every device: only the compute column is read before
            # `finish` (the next step recomputes every device's costs with the task's context)
            c = state["costs"][rows, devices, 0]
            state["costs"][rows, devices, 0] = torch.where(placed, taken[rows, devices], c)
            state["stale"] = True
            return
        s = state["S"][rows, devices]
        state["Smax"] = torch.maximum(state["Smax"], s)
        taken = state.pop("taken", None)
        hit = None if taken is None else taken[0] == devices[:, None]  # [K, M]: the device was a candidate
        if hit is not None and bool(hit.any(dim=1).all()):
            fresh = taken[1][hit][:, None]  # the step's costs of the device that took the table
        else:
            task = self._task_context(state, view.num_devices) if self.costnet.structured_comm else None
            fresh = self.costnet.device_costs(s[:, None], state["cnt"][rows, devices][:, None], max_sums=state["Smax"],
                                              task=task)
        state["costs"][rows, devices] = torch.where(placed[:, None], fresh[:, 0], state["costs"][rows, devices])

    def finish(self, view, state) -> None:
        """Every device's costs as of the end of the episode (a lazy state kept only some)."""
        if "Smax" in state or state.pop("stale", False):
            state["costs"] = self.costnet.device_costs(state["S"], state["cnt"])

    def estimate(self, view, state):
        if self.estimate_kind == "overall":
            return self.costnet.plan_cost(state["S"])
        c = state["costs"]
        per_device = c.sum(-1) if self.reward_comm else c[..., 0] + c[..., 2]
        return per_device.max(-1).values

    def reward(self, view, state, overflow):
        # an episode that ran out of memory scores as twice all its compute on one device
        return torch.where(overflow, torch.full_like(overflow, -2.0 * view.even_ms * view.num_devices, dtype=torch.float32),
                           -self.estimate(view, state))

    # ------------------------------------------------------------------ loss
    def replay(self, r: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π of the taken actions [K, N], entropy [K, N]) with gradients."""
        view = r.view
        k, n = r.devices.shape
        d = view.num_devices
        enc_p = self.policy.encoder(view.x)
        contrib = _placed_onehot(r.devices, d).unsqueeze(-1) * enc_p[None, :, None, :]
        u = _exclusive_cumsum(contrib, dim=1) * (d / n)
        table_enc = enc_p.unsqueeze(0).expand(k, -1, -1) if self.policy.encode_table else None
        logits = self.policy.logits(u, r.records["cost"], table_enc, r.records.get("whatif"))
        mask = _safe(r.masks)
        logp = masked_log_softmax(logits, mask)
        return logp.gather(-1, r.actions.clamp(min=0).unsqueeze(-1)).squeeze(-1), masked_entropy(logp, mask)

    def policy_loss(self, batch: Sequence[Rollouts], entropy_coef: float, per_task_baseline: bool) -> tuple[torch.Tensor, dict]:
        rewards = torch.cat([r.rewards for r in batch])
        groups = torch.cat([torch.full((len(r.rewards),), i) for i, r in enumerate(batch)]) if per_task_baseline else None
        adv = normalised_advantages(rewards, groups)
        width = max(r.devices.shape[1] for r in batch)
        replays = [self.replay(r) for r in batch]
        logp = _pad([x[0] for x in replays], width)
        ent = _pad([x[1] for x in replays], width)
        steps = _pad([r.steps.float() for r in batch], width).bool()
        loss = reinforce_loss(logp, ent, steps, adv, entropy_coef)
        est = torch.cat([r.estimated_ms for r in batch])
        return loss, {"estimated_reward": float(rewards.mean()), "estimated_cost_ms": float(est.mean()),
                      "entropy": float((ent.detach() * steps).sum() / steps.sum()), "overflow": float(torch.cat([r.overflow for r in batch]).float().mean())}


class AutoShardAgent(_Estimating):
    """AutoShard (KDD 2022) on the estimated MDP: compute cost only, reward = min / max of
    the predicted per-device compute (a balance ratio), -1 for a memory overflow."""

    algorithm = "autoshard"

    def __init__(self, norm: FeatureNorm, net: AutoShardNet):
        self.norm, self.net = norm, net

    def modules(self) -> dict[str, torch.nn.Module]:
        return {"net": self.net}

    # ------------------------------------------------------------------ episode
    def states(self, enc: torch.Tensor) -> torch.Tensor:
        """[N, H] LSTM states over the placement sequence: (table encoding, fraction placed)."""
        n = enc.shape[0]
        frac = torch.arange(n, dtype=enc.dtype)[:, None] / n
        h, _ = self.net.lstm(torch.cat([self.net.encoder.features(enc), frac], dim=1).unsqueeze(0))
        return h[0]

    @torch.no_grad()
    def prepare(self, task: Task) -> TaskView:
        x = torch.from_numpy(self.norm(task.tables, task.batch_size))
        enc = self.net.encoder(x)
        view = _ordered_view(task, x, self.net.shard_cost(enc, torch.ones(len(x))))
        view.cache["enc"] = enc[view.order]
        view.cache["h"] = self.states(view.cache["enc"])
        return view

    @torch.no_grad()
    def planning_episodes(self, view: TaskView, samples: int, generator: torch.Generator | None,
                          max_candidates: int | None) -> Rollouts | None:
        """The planning episodes in numpy (`numpy_episode`), for the shipped kind of network."""
        if not numpy_episode.autoshard_supported(self.net):
            return None
        fast = numpy_episode.NumpyAutoShard(self.net)
        devices, sums, counts = _with_sampled(fast, view, samples, generator, max_candidates,
                                              {"enc": view.cache["enc"], "h": view.cache["h"]})
        return _numpy_rollouts(self, view, {"S": sums, "cnt": counts}, devices)

    def init_state(self, view, k, lazy: bool = False):
        d = view.num_devices
        state = {"S": torch.zeros(k, d, self.net.width), "cnt": torch.zeros(k, d)}
        if lazy:  # each device's predicted compute, refreshed for the device that changed
            state["cost"] = self.net.shard_cost(state["S"], state["cnt"])
        return state

    def _device_inputs(self, view: TaskView, s: torch.Tensor, cnt: torch.Tensor, used: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(action vectors, raw device features [log(1 + ms), share of an even split, memory used])."""
        costs = self.net.shard_cost(s, cnt)
        feats = torch.stack([torch.log1p(costs), costs / max(view.even_ms, 1e-3), used], dim=-1).detach()
        return self.net.actions(s * (view.num_devices / view.num_tables), feats), feats

    def step(self, view, state, t, used_share, cand=None):
        if cand is None:
            a, feats = self._device_inputs(view, state["S"], state["cnt"], used_share)
            rec = {"used": used_share}
        else:  # the candidate devices only (the device features are per device)
            a, feats = self._device_inputs(view, _rows(state["S"], cand), state["cnt"].gather(1, cand),
                                           used_share.gather(1, cand))
            rec = {}
        h = view.cache["h"][t].expand(a.shape[0], -1)
        return self.net.logits(h, a, feats), rec

    def candidate_scores(self, view, state) -> torch.Tensor:
        """[K, D] the devices' predicted compute now, lowest first (a lazy state)."""
        return state["cost"]

    def advance(self, view, state, t, devices, placed):
        oh = Fn.one_hot(devices, view.num_devices).float() * placed[:, None].float()
        state["S"] += oh[..., None] * view.cache["enc"][t]
        state["cnt"] += oh
        if "cost" in state:
            rows = torch.arange(len(devices))
            fresh = self.net.shard_cost(state["S"][rows, devices], state["cnt"][rows, devices])
            state["cost"][rows, devices] = torch.where(placed, fresh, state["cost"][rows, devices])

    def finish(self, view, state) -> None:
        """Nothing to refresh: the estimate reads the sums."""

    def estimate(self, view, state):
        return self.net.shard_cost(state["S"], state["cnt"]).max(-1).values

    def reward(self, view, state, overflow):
        c = self.net.shard_cost(state["S"], state["cnt"])
        balance = c.min(-1).values / c.max(-1).values.clamp_min(1e-6)
        return torch.where(overflow, torch.full_like(balance, -1.0), balance)

    # ------------------------------------------------------------------ loss
    def replay(self, r: Rollouts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log π of the taken actions, entropy, values), [K, N] each, with gradients."""
        view = r.view
        k, n = r.devices.shape
        d = view.num_devices
        enc = self.net.encoder(view.x)
        h = self.states(enc).unsqueeze(0).expand(k, -1, -1)
        oh = _placed_onehot(r.devices, d)
        s = _exclusive_cumsum(oh.unsqueeze(-1) * enc[None, :, None, :], dim=1)
        cnt = _exclusive_cumsum(oh, dim=1)
        a, feats = self._device_inputs(view, s, cnt, r.records["used"])
        logits = self.net.logits(h, a, feats)
        mask = _safe(r.masks)
        logp = masked_log_softmax(logits, mask)
        logp_a = logp.gather(-1, r.actions.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return logp_a, masked_entropy(logp, mask), self.net.values(h, a)

    def policy_loss(self, batch: Sequence[Rollouts], entropy_coef: float, value_coef: float, gamma: float = 1.0,
                    rho_bar: float = 1.0, c_bar: float = 1.0) -> tuple[torch.Tensor, dict]:
        width = max(r.devices.shape[1] for r in batch)
        replays = [self.replay(r) for r in batch]
        logp, ent, values = (_pad([x[i] for x in replays], width) for i in range(3))
        steps = _pad([r.steps.float() for r in batch], width).bool()
        behaviour = _pad([r.behaviour_logp for r in batch], width)
        rewards = torch.zeros_like(logp)
        last = steps.sum(1) - 1
        rewards[torch.arange(len(last)), last] = torch.cat([r.rewards for r in batch])
        vs, adv = vtrace(behaviour, logp.detach(), rewards, values.detach(), steps, gamma, rho_bar, c_bar)
        w = steps.float()
        pg = -(adv * logp * w).sum() / w.sum()
        value_loss = 0.5 * (((vs - values) ** 2) * w).sum() / w.sum()
        entropy = (ent * w).sum() / w.sum()
        loss = pg + value_coef * value_loss - entropy_coef * entropy
        est = torch.cat([r.estimated_ms for r in batch])
        return loss, {"estimated_reward": float(torch.cat([r.rewards for r in batch]).mean()),
                      "estimated_cost_ms": float(est.mean()), "entropy": float(entropy.detach()), "value_loss": float(value_loss.detach()),
                      "overflow": float(torch.cat([r.overflow for r in batch]).float().mean())}
