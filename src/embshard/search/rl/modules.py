"""Lightning modules that train DreamShard and AutoShard.

One training epoch is one iteration of the reference loop:

1. (epoch start) sample plans from the current policy for a few training tasks and measure
   them on the hardware (`HardwareEvaluator.measure_many`, interleaved); add them to the
   replay buffer;
2. `cost_steps` cost-network steps on batches from the buffer;
3. `policy_steps` policy updates on the *estimated* MDP (no hardware): DreamShard's
   REINFORCE batches, AutoShard's V-trace learner steps on episodes from a lagged actor.

Optimisation is manual (two optimisers: the cost network and the policy), with linear
learning-rate decay over the policy updates. Logged per iteration (W&B offline + CSV), means over its steps:
`cost/loss`, `rl/estimated_reward`, `rl/estimated_cost_ms`, `rl/entropy`, and per
iteration `measured/plan_cost_ms` (the measured cost of the policy's sampled plans; for
AutoShard, which measures compute only, the slowest device's compute) and
`measured/estimated_ms` (what the cost network predicted for those same plans).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from embshard.costs.base import DeviceCosts
from embshard.plan import Plan
from embshard.search.rl.agents import AutoShardAgent, DreamShardAgent
from embshard.search.rl.buffer import Buffer, autoshard_cost_loss, dreamshard_cost_loss
from embshard.search.rl.env import Rollouts, rollout
from embshard.task import Task

log = logging.getLogger(__name__)

#: measure(task, plans) -> one DeviceCosts per plan (the hardware evaluator's measure_many)
Measure = Callable[[Task, Sequence[Plan]], list[DeviceCosts]]


class _RLModule(pl.LightningModule):
    """What both trainers share: the iteration structure, measuring, the cost steps."""

    def __init__(self, agent: Any, tasks: Sequence[Task], c: dict[str, Any], buffer: Buffer, measure: Measure | None):
        super().__init__()
        self.agent = agent
        self.nets = torch.nn.ModuleDict(agent.modules())
        self.tasks = list(tasks)
        self.c = c
        self.buffer = buffer
        self.measure = measure
        self.automatic_optimization = False
        self.rng = np.random.default_rng(int(c["seed"]))
        self.gen = torch.Generator().manual_seed(int(c["seed"]))
        self.history: list[dict[str, float]] = []
        #: every plan measured in training: task, plan, device costs (written as measured_plans.jsonl)
        self.measured_plans: list[dict[str, Any]] = []
        self.measurements = 0
        self.measure_seconds = 0.0
        self._it: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ Lightning plumbing
    def train_dataloader(self) -> DataLoader:
        return DataLoader(list(range(self.c["cost_steps"] + self.c["policy_steps"])), batch_size=None, shuffle=False)

    def configure_optimizers(self):
        cost_opt = torch.optim.Adam(self.cost_parameters(), lr=float(self.c["cost_lr"]))
        pol_opt = torch.optim.Adam(self.policy_parameters(), lr=float(self.c["lr"]))
        total = max(1, int(self.c["iterations"]) * int(self.c["policy_steps"]))
        sched = torch.optim.lr_scheduler.LinearLR(pol_opt, 1.0, float(self.c["lr_end_factor"]), total_iters=total)
        return [cost_opt, pol_opt], [sched]

    def on_train_epoch_start(self) -> None:
        self._it = {}
        if self.measure is not None:
            self.measure_policy_plans()

    def training_step(self, idx, batch_idx):
        cost_opt, pol_opt = self.optimizers()
        if int(idx) < self.c["cost_steps"]:
            if len(self.buffer) == 0:
                return None
            cost_opt.zero_grad()
            loss, parts = self.cost_loss(self.buffer.sample(int(self.c["cost_batch_size"]), self.rng))
            self.manual_backward(loss)
            cost_opt.step()
            self._note({"cost/loss": float(loss.detach()), **{f"cost/{k}": v for k, v in parts.items()}})
            return None
        if int(idx) == self.c["cost_steps"]:
            self.start_policy_phase()
        pol_opt.zero_grad()
        loss, info = self.policy_loss()
        self.manual_backward(loss)
        if self.c.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(self.policy_parameters(), float(self.c["grad_clip"]))
        pol_opt.step()
        self.lr_schedulers().step()
        self._note({f"rl/{k}": v for k, v in info.items()})
        return None

    def on_train_epoch_end(self) -> None:
        row = {"iteration": float(self.current_epoch), "measurements": float(self.measurements)}
        row.update({k: float(np.mean(v)) for k, v in self._it.items() if len(v)})
        self.history.append(row)
        self.log_dict({k: v for k, v in row.items() if k != "iteration"}, on_epoch=True, prog_bar=False)
        log.info("%s iteration %d: %s", self.agent.algorithm, self.current_epoch,
                 ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "iteration"))

    def _note(self, values: dict[str, float]) -> None:
        # kept for the iteration's means (logged at epoch end): Lightning's log_dict costs
        # tens of ms a call here, more than a training step
        for k, v in values.items():
            self._it.setdefault(k, []).append(v)

    # ------------------------------------------------------------------ measuring
    def measure_policy_plans(self) -> None:
        """Sample plans from the current policy for a few training tasks; measure; buffer."""
        if int(self.c["measure_tasks"]) == 0:
            return
        start = time.perf_counter()
        chosen = self.rng.choice(len(self.tasks), size=min(int(self.c["measure_tasks"]), len(self.tasks)), replace=False)
        measured, estimated = [], []
        for i in chosen:
            task = self.tasks[int(i)]
            r = rollout(self.agent, self.agent.prepare(task), int(self.c["measure_plans_per_task"]), train=False,
                        sample=True, generator=self.gen)
            plans = [r.plan(k, self.agent.algorithm) for k in range(len(r.devices))]
            costs = self.measure(task, plans)
            for plan, cost, est in zip(plans, costs, r.estimated_ms.tolist()):
                self.buffer.add_plan(task, plan, cost)
                self.measured_plans.append({"iteration": self.current_epoch, "task": task.to_dict(), "plan": plan.to_dict(),
                                            "estimated_ms": est, "measured": cost.to_dict()})
                measured.append(cost.plan_cost_ms)
                estimated.append(est)
            self.measurements += len(plans)
        self.measure_seconds += time.perf_counter() - start
        self._it["measured/plan_cost_ms"] = measured
        self._it["measured/estimated_ms"] = estimated

    # ------------------------------------------------------------------ per algorithm
    def cost_parameters(self):
        raise NotImplementedError

    def policy_parameters(self):
        raise NotImplementedError

    def cost_loss(self, batch):
        raise NotImplementedError

    def start_policy_phase(self) -> None:
        """Called before the first policy update of an iteration."""

    def policy_loss(self) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError


class DreamShardModule(_RLModule):
    """DreamShard: REINFORCE batches of `episodes` episodes (`rollouts_per_task` rollouts of
    each of episodes / rollouts_per_task tasks; with more than one, rewards are normalised
    within each task: a per-task baseline), entropy bonus, against the frozen cost network."""

    agent: DreamShardAgent

    def __init__(self, agent: DreamShardAgent, tasks, c, buffer, measure):
        super().__init__(agent, tasks, c, buffer, measure)
        self._views: dict[int, Any] = {}

    def cost_parameters(self):
        return self.agent.costnet.parameters()

    def policy_parameters(self):
        return self.agent.policy.parameters()

    def cost_loss(self, batch):
        return dreamshard_cost_loss(self.agent.costnet, batch, self.agent.reward_comm)

    def start_policy_phase(self) -> None:
        self._views = {}  # the cost network changed: orders and cost inputs too

    def policy_loss(self):
        per_task = max(1, int(self.c["rollouts_per_task"]))
        n_tasks = max(1, int(self.c["episodes"]) // per_task)
        chosen = self.rng.choice(len(self.tasks), size=n_tasks, replace=n_tasks > len(self.tasks))
        batch: list[Rollouts] = []
        for i in chosen:
            i = int(i)
            if i not in self._views:
                self._views[i] = self.agent.prepare(self.tasks[i])
            batch.append(rollout(self.agent, self._views[i], per_task, train=True, sample=True, mask=self.c["mask"],
                                 generator=self.gen))
        return self.agent.policy_loss(batch, float(self.c["entropy_coef"]), per_task > 1)


class AutoShardModule(_RLModule):
    """AutoShard: an IMPALA-style actor-learner in one process. The actor is a copy of the
    network refreshed every `actor_sync` learner steps, so it lags the learner as IMPALA's
    actors do; the learner corrects for the lag with V-trace."""

    agent: AutoShardAgent

    def __init__(self, agent: AutoShardAgent, tasks, c, buffer, measure):
        super().__init__(agent, tasks, c, buffer, measure)
        self.actor: AutoShardAgent | None = None
        self._learner_steps = 0

    def cost_parameters(self):
        net = self.agent.net  # the encoder is shared: both optimisers move it
        return list(net.encoder.parameters()) + list(net.cost_head.parameters())

    def policy_parameters(self):
        return [p for name, p in self.agent.net.named_parameters() if not name.startswith("cost_head.")]

    def cost_loss(self, batch):
        return autoshard_cost_loss(self.agent.net, batch)

    def start_policy_phase(self) -> None:
        self.actor = None  # the cost model changed: refresh the actor now

    def policy_loss(self):
        if self.actor is None or self._learner_steps % max(1, int(self.c["actor_sync"])) == 0:
            self.actor = AutoShardAgent(self.agent.norm, copy.deepcopy(self.agent.net))
        self._learner_steps += 1
        per_task = max(1, int(self.c["rollouts_per_task"]))
        n_tasks = max(1, int(self.c["episodes"]) // per_task)
        chosen = self.rng.choice(len(self.tasks), size=n_tasks, replace=n_tasks > len(self.tasks))
        batch = [rollout(self.actor, self.actor.prepare(self.tasks[int(i)]), per_task, train=True, sample=True,
                         mask=self.c["mask"], generator=self.gen) for i in chosen]
        return self.agent.policy_loss(batch, float(self.c["entropy_coef"]), float(self.c["value_coef"]),
                                      float(self.c["gamma"]))
