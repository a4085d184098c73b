"""`search=dreamshard` and `search=autoshard`: plan with a trained policy, no hardware.

Inference is one policy forward per table (all devices scored at once) through the shared
rollout loop, placing through `MemoryLedger.place`, so every plan is valid. `samples=0` is
the references' argmax; `samples=K` also samples K episodes (batched with the argmax one)
and keeps the one the agent's cost network estimates cheapest (best-of-K). Sampling is
skipped on tasks with more than `sample_max_work` tables x devices x samples, where its
extra ledger look-ahead work would dominate (856 tables x 128 devices x 8 samples is 877k:
argmax only, about 4 s here, where best-of-8 took 23-29 s).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from embshard.errors import InputError
from embshard.hardware.protocol import torch_threads
from embshard.plan import Plan, validate
from embshard.search.base import Capabilities
from embshard.search.rl.checkpoint import load_checkpoint, resolve_path
from embshard.search.rl.env import best_plan
from embshard.task import Task

log = logging.getLogger(__name__)


class RLSharder:
    """A trained policy as a Sharder.

    Args:
        checkpoint: the policy file (`train.py stage=rl`); relative paths resolve against the
            working directory, then the project root. Loaded on first use.
        samples: sampled episodes besides the argmax one (0: argmax only).
        sample_max_work: sample only when tables x devices x samples <= this (None: always).
        seed: seeds the sampling.
        num_threads: torch threads while planning (None: unchanged).
        max_candidates: on a task of more devices than this, each placement scores only this
            many devices with room, those whose predicted cost is lowest now (`env.rollout`);
            None: every device.
    """

    algorithm = "rl"
    #: policies trained on pooled tasks; whole tables only
    capabilities = Capabilities(("pooled",), splits_tables=False)

    def __init__(self, checkpoint: str | os.PathLike, samples: int = 0, sample_max_work: int | None = 200_000,
                 seed: int = 0, num_threads: int | None = 1, name: str | None = None,
                 max_candidates: int | None = 128):
        if int(samples) < 0:
            raise InputError(f"{self.algorithm}: samples must be >= 0, got {samples!r}")
        self.checkpoint = str(checkpoint)
        self.samples = int(samples)
        self.sample_max_work = None if sample_max_work is None else int(sample_max_work)
        self.seed = int(seed)
        self.num_threads = num_threads
        if max_candidates is not None and int(max_candidates) < 1:
            raise InputError(f"{self.algorithm}: max_candidates must be >= 1 or null, got {max_candidates!r}")
        self.max_candidates = None if max_candidates is None else int(max_candidates)
        self.name = name or self.algorithm
        self._agent: Any = None
        self.bundle: dict[str, Any] | None = None
        self.last_search_seconds: float | None = None
        self.last_predicted_cost_ms: float | None = None
        self.last_stats: dict[str, Any] = {}
        self.last_search_info: dict[str, Any] = {}

    def load(self) -> Any:
        if self._agent is None:
            self._agent, self.bundle = load_checkpoint(self.checkpoint, self.algorithm)
        return self._agent

    def samples_for(self, task: Task) -> int:
        work = len(task.tables) * task.num_devices * self.samples
        if self.sample_max_work is not None and work > self.sample_max_work:
            return 0
        return self.samples

    def shard(self, task: Task) -> Plan:
        agent = self.load()
        start = time.perf_counter()
        samples = self.samples_for(task)
        with torch_threads(self.num_threads), torch.inference_mode():  # no autograd bookkeeping per op
            gen = torch.Generator().manual_seed(self.seed)
            plan, estimate_ms = best_plan(agent, task, samples, generator=gen, algorithm=self.name,
                                          max_candidates=self.max_candidates)
        validate(task, plan)
        self.last_search_seconds = time.perf_counter() - start
        estimate = self.trusted_estimate(task, plan, estimate_ms)
        self.last_predicted_cost_ms = estimate["ms"]
        self.last_stats = {"samples": samples, "estimated_ms": estimate["ms"]}
        # samples below samples_requested: the task was over sample_max_work (argmax only)
        self.last_search_info = {"checkpoint": str(resolve_path(self.checkpoint)), "samples": samples,
                                 "samples_requested": self.samples, "estimate": estimate}
        if samples < self.samples:
            log.info("%s: %s has %d tables x %d devices; argmax only (sample_max_work=%s)", self.name, task.name,
                     len(task.tables), task.num_devices, self.sample_max_work)
        return plan


    def trusted_estimate(self, task: Task, plan: Plan, network_ms: float) -> dict[str, Any]:
        """What this planner reports as its plan's estimate: its cost network's, unless the task
        lies outside the device counts and batches the network was trained on (as NeuroShard's
        comm models answer only inside theirs) or the network's answer is more than FAR_FACTOR
        times off the analytic model's estimate of the same quantity; then the analytic model's,
        with the reason. The plan is the policy's either way. `of` names the quantity:
        DreamShard estimates the plan cost, AutoShard the slowest device's compute."""
        from embshard.costs.analytic import AnalyticCostModel
        from embshard.costs.neural.models import FAR_FACTOR

        costs = AnalyticCostModel().device_costs(task, plan)
        of = "plan cost" if self.algorithm == "dreamshard" else "slowest device's compute"
        ref = costs.plan_cost_ms if self.algorithm == "dreamshard" else max(costs.compute_ms)
        where = (f"{len(task.tables)} tables, {task.num_devices} devices, batch {task.batch_size}; "
                 f"trained on {self._trained()}")
        outside = self._outside_training(task)
        if outside:
            return {"ms": float(ref), "of": of, "source": "analytic",
                    "reason": f"the task's {outside} lies outside what the cost network was trained on ({where})"}
        if ref > 0 and 1.0 / FAR_FACTOR <= network_ms / ref <= FAR_FACTOR:
            return {"ms": float(network_ms), "of": of, "source": "cost network"}
        return {"ms": float(ref), "of": of, "source": "analytic",
                "reason": f"the cost network's estimate is over {FAR_FACTOR:g}x off the analytic model's ({where})"}

    def _outside_training(self, task: Task) -> str | None:
        """'device count' or 'batch' where the task is outside the checkpoint's training range
        (checked as the cost models' envelope checks theirs: `Range.outside` with its default
        tolerance); None inside, or when the checkpoint does not record its range."""
        from embshard.costs.envelope import DEFAULT_TOLERANCE, Range

        card = (self.bundle or {}).get("data_card") or {}
        devices, batches = card.get("device_counts"), card.get("batch_sizes")
        if devices and Range.of(devices).outside(task.num_devices, 0.0):
            return "device count"
        if batches and Range.of(batches).outside(task.batch_size, DEFAULT_TOLERANCE):
            return "batch"
        return None

    def _trained(self) -> str:
        card = (self.bundle or {}).get("data_card") or {}
        return (f"{card.get('min_tables')}-{card.get('max_tables')} tables, devices {card.get('device_counts')}, "
                f"batch {card.get('batch_sizes')}")


class DreamShardSharder(RLSharder):
    """DreamShard (`search=dreamshard`)."""

    algorithm = "dreamshard"


class AutoShardSharder(RLSharder):
    """AutoShard (`search=autoshard`)."""

    algorithm = "autoshard"
