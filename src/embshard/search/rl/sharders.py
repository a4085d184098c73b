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
    """

    algorithm = "rl"
    #: policies trained on pooled tasks; whole tables only
    capabilities = Capabilities(("pooled",), splits_tables=False)

    def __init__(self, checkpoint: str | os.PathLike, samples: int = 0, sample_max_work: int | None = 200_000,
                 seed: int = 0, num_threads: int | None = 1, name: str | None = None):
        if int(samples) < 0:
            raise InputError(f"{self.algorithm}: samples must be >= 0, got {samples!r}")
        self.checkpoint = str(checkpoint)
        self.samples = int(samples)
        self.sample_max_work = None if sample_max_work is None else int(sample_max_work)
        self.seed = int(seed)
        self.num_threads = num_threads
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
        with torch_threads(self.num_threads), torch.no_grad():
            gen = torch.Generator().manual_seed(self.seed)
            plan, estimate_ms = best_plan(agent, task, samples, generator=gen, algorithm=self.name)
        validate(task, plan)
        self.last_search_seconds = time.perf_counter() - start
        self.last_predicted_cost_ms = estimate_ms
        self.last_stats = {"samples": samples, "estimated_ms": estimate_ms}
        # samples below samples_requested: the task was over sample_max_work (argmax only)
        self.last_search_info = {"checkpoint": str(resolve_path(self.checkpoint)), "samples": samples,
                                 "samples_requested": self.samples}
        if samples < self.samples:
            log.info("%s: %s has %d tables x %d devices; argmax only (sample_max_work=%s)", self.name, task.name,
                     len(task.tables), task.num_devices, self.sample_max_work)
        return plan


class DreamShardSharder(RLSharder):
    """DreamShard (`search=dreamshard`)."""

    algorithm = "dreamshard"


class AutoShardSharder(RLSharder):
    """AutoShard (`search=autoshard`)."""

    algorithm = "autoshard"
