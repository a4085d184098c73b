"""TorchRec's EmbeddingShardingPlanner as a Sharder (the industrial peer).

The planner runs in this process with no process group: the topology carries the world
size. It plans an EmbeddingBagCollection built on the meta device, so no table memory is
allocated. Settings, and why:

* compute_device "cuda" by default, so it plans as for GPUs (that is where row_wise,
  table_row_wise and grid_shard are offered) even on a CPU-only machine;
* compute kernel restricted to "fused" (FBGEMM's table-batched kernel, all in device
  memory), the kernel our memory model and our measurements assume; UVM caching would
  keep only a cache in HBM and break the comparison;
* data_parallel is not offered by default (`sharding_types` may add it: replicated tables
  become replicas in our plan); a table's own `sharding_types` and `min_partition`
  (`Table`, from the task or a TorchRec `ParameterConstraints`) replace the default for it;
* TorchRec's batch_size is per rank, ours is global: it gets ceil(batch / devices);
* storage reservation: a fixed percentage, 0 by default, because `device_memory_bytes`
  is already the budget for embedding work.

Memory: TorchRec's storage model for a shard is weights (+ optimizer state, which it
only counts when the optimizer is applied in backward; we tell it the task's optimizer)
+ input ids + one pooled output of the global batch; ours (`Task.shard_memory_bytes`)
counts weights + optimizer state + 2 × batch × width × 4 bytes. So TorchRec can hand back
a plan that overflows our budget. Every plan it returns is checked with our `validate`;
when a device is over, TorchRec is re-run with its HBM capacity shrunk by the overage
ratio (at most `max_retries` times), and when that does not help we raise InfeasibleError
naming the device and the overage. `last_search_seconds` counts all attempts;
`last_attempts` says how many there were and `last_hbm_cap` the capacity that worked.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from embshard.errors import InfeasibleError, PlanError
from embshard.plan import Plan, validate
from embshard.search.base import Capabilities
from embshard.task import Task
from embshard.torchrec_bridge import plan_from_torchrec, task_to_ebc

#: Sharding types TorchRec offers for an EmbeddingBagCollection on GPUs, minus data_parallel
#: (which the kernel measurement cannot time: it is TorchRec's DMP step's, hardware=dmp_cpu).
DEFAULT_SHARDING_TYPES = (
    "table_wise",
    "column_wise",
    "table_column_wise",
    "row_wise",
    "table_row_wise",
    "grid_shard",
)


def fused_optimizer_class(name: str):
    """The TorchRec optimizer class of a task's `optimizer` (what training fuses into backward)."""
    import torchrec.optim as trec_optim

    return {
        "sgd": trec_optim.SGD,
        "rowwise_adagrad": trec_optim.RowWiseAdagrad,
        "adagrad": trec_optim.Adagrad,
        "adam": trec_optim.Adam,
    }[name]


@dataclass
class TorchRecPlanner:
    """Sharder that asks TorchRec's `EmbeddingShardingPlanner` for a plan.

    Args:
        sharding_types: TorchRec sharding types allowed for every table.
        compute_device: "cuda" (plan as for GPUs; works without one) or "cpu".
        storage_reservation_percentage: share of each device's memory TorchRec keeps back.
        max_retries: re-plans with a smaller HBM capacity when TorchRec's plan overflows
            our memory model.
        quiet: silence TorchRec's planner log and warnings.
    """

    #: it plans an EmbeddingBagCollection: pooled tables only
    capabilities: ClassVar[Capabilities] = Capabilities(("pooled",), splits_tables=True)
    sharding_types: tuple[str, ...] = DEFAULT_SHARDING_TYPES
    compute_device: str = "cuda"
    storage_reservation_percentage: float = 0.0
    max_retries: int = 4
    quiet: bool = True
    name: str = "torchrec"
    last_search_seconds: float | None = field(default=None, init=False)
    last_attempts: int = field(default=0, init=False)
    last_hbm_cap: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        from embshard.tables import SHARDING_TYPES

        unknown = [t for t in self.sharding_types if t not in SHARDING_TYPES]
        if unknown:
            raise PlanError(f"unknown sharding type(s) {unknown}; known: {', '.join(SHARDING_TYPES)}")
        if self.compute_device not in ("cuda", "cpu"):
            raise PlanError(f"compute_device must be 'cuda' or 'cpu', got {self.compute_device!r}")
        if not 0.0 <= self.storage_reservation_percentage < 1.0:
            raise PlanError("storage_reservation_percentage must be in [0, 1)")

    # ------------------------------------------------------------------ Sharder
    def shard(self, task: Task) -> Plan:
        start = time.perf_counter()
        self.last_attempts = 0
        try:
            return self._shard(task)
        finally:
            self.last_search_seconds = time.perf_counter() - start

    def _shard(self, task: Task) -> Plan:
        cap = task.device_memory_bytes
        overflow: InfeasibleError | None = None
        for attempt in range(self.max_retries + 1):
            self.last_attempts = attempt + 1
            try:
                sharding_plan = self._plan_once(task, cap)
            except InfeasibleError:
                if overflow is None:
                    raise
                raise overflow from None  # a smaller capacity made TorchRec give up
            plan = plan_from_torchrec(task, sharding_plan, algorithm=self.name)
            used = plan.memory_bytes(task)
            worst = max(range(task.num_devices), key=lambda d: used[d])
            if used[worst] <= task.device_memory_bytes:
                validate(task, plan)
                self.last_hbm_cap = cap
                return plan
            over = used[worst] - task.device_memory_bytes
            overflow = InfeasibleError(
                f"task {task.name!r}: TorchRec's plan puts {used[worst]} bytes on device {worst} "
                f"(budget {task.device_memory_bytes}, over by {over} bytes under our memory model; "
                f"{attempt + 1} attempt(s), TorchRec capacity down to {cap} bytes)",
                shortfall_bytes=over,
            )
            # Shrink TorchRec's capacity by the ratio it overshot ours, with 1% slack.
            cap = int(cap * task.device_memory_bytes / used[worst] * 0.99)
        assert overflow is not None
        raise overflow

    @property
    def last_search_info(self) -> dict[str, int | None]:
        """report.json `search_info`: attempts above 1 re-planned with TorchRec's capacity
        shrunk to `hbm_cap_bytes` because its plan overflowed our memory model."""
        return {"attempts": self.last_attempts, "hbm_cap_bytes": self.last_hbm_cap}

    # ------------------------------------------------------------------ TorchRec
    def _plan_once(self, task: Task, hbm_cap: int):
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
        from torchrec.distributed.planner.types import PlannerError

        with _quiet(self.quiet):
            ebc = task_to_ebc(task, device="meta")
            opt = fused_optimizer_class(task.optimizer)
            for p in ebc.parameters():
                p._optimizer_classes = [opt]  # what apply_optimizer_in_backward records
            caps = {"hbm_cap": hbm_cap} if self.compute_device == "cuda" else {"ddr_cap": hbm_cap}
            topology = Topology(
                world_size=task.num_devices,
                compute_device=self.compute_device,
                local_world_size=task.devices_per_host,
                **caps,
            )
            constraints = {
                t.name: ParameterConstraints(
                    sharding_types=list(t.sharding_types or self.sharding_types),
                    # the fused kernel, and TorchRec's dense one where it replicates a table
                    compute_kernels=["fused", "dense"],
                    min_partition=t.min_partition,
                    pooling_factors=[max(t.pooling_factor / t.num_poolings, 1e-6)],
                    num_poolings=[t.num_poolings],
                )
                for t in task.tables
            }
            planner = EmbeddingShardingPlanner(
                topology=topology,
                batch_size=math.ceil(task.batch_size / task.num_devices),
                constraints=constraints,
                storage_reservation=FixedPercentageStorageReservation(self.storage_reservation_percentage),
                debug=not self.quiet,
            )
            try:
                return planner.plan(ebc, [EmbeddingBagCollectionSharder()])
            except PlannerError as e:
                raise _infeasible(task, hbm_cap, e) from None


def _infeasible(task: Task, cap: int, error: Exception) -> InfeasibleError:
    """One-line InfeasibleError from TorchRec's (multi-line) PlannerError."""
    text = " ".join(str(error).split())
    named = [t.name for t in task.tables if f"'{t.name}'" in text or f" {t.name} " in f" {text} "]
    biggest = max(task.tables, key=task.table_memory_bytes)
    table = named[0] if len(named) == 1 else None
    where = f"table {table!r}" if table else f"task {task.name!r} (largest table {biggest.name!r})"
    if len(text) > 300:
        text = text[:300] + "..."
    return InfeasibleError(
        f"TorchRec planner found no plan for {where} on {task.num_devices} devices of "
        f"{cap} bytes: {text}",
        table=table or biggest.name,
    )


class _quiet:
    """Silence TorchRec's planner logging and warnings for the duration of a call."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            self._warn = warnings.catch_warnings()
            self._warn.__enter__()
            warnings.simplefilter("ignore")
            self._loggers = [logging.getLogger(n) for n in ("torchrec", "torchrec.distributed.planner")]
            self._levels = [lg.level for lg in self._loggers]
            for lg in self._loggers:
                lg.setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc):
        if self.on:
            for lg, level in zip(self._loggers, self._levels):
                lg.setLevel(level)
            self._warn.__exit__(*exc)
        return False
