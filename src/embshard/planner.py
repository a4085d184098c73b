"""`EmbShardPlanner`: a TorchRec `ShardingPlanner` that plans with any searcher of this project.

One line changes in a TorchRec training script:

    planner = EmbShardPlanner(topology=topology, batch_size=batch_size, constraints=constraints,
                              algorithm="neuroshard")           # was: EmbeddingShardingPlanner(...)
    plan = planner.collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, plan=plan, sharders=sharders, device=device)

`plan(module, sharders)`:

1. reads every EmbeddingBagCollection (pooled tables) and EmbeddingCollection (sequence tables)
   of the module tree, the topology and the constraints, as one Task
   (`embshard.torchrec_bridge.task_from_module`: memory per device, global batch, fused
   optimizer, per table its lookups and bags per sample and the sharding types the constraints
   and the sharders allow on the topology's compute device);
2. plans it with the searcher named `algorithm`, built from its conf/search/ config with the
   keyword overrides (`embshard.api.plan`; tables whose constraints leave out table_wise are
   shaped first: `embshard.search.constrained`; a model of both kinds given to a planner of pooled
   tables has its sequence tables planned by size_lookup_greedy in the same memory budget:
   `embshard.search.mixed`), and validates the plan (coverage, memory, the constraints);
3. exports it per collection (`plan_to_torchrec`, keyed by each collection's path), with the
   constraints' `stochastic_rounding`, `bounds_check_mode`, `output_dtype` and `enforce_hbm`
   carried into each `ParameterSharding` as TorchRec's planner does;
4. logs a per-rank summary (memory, pieces, estimated cost), and, with `out_dir`, writes the
   task and the plan as this project's JSON (`task.json`, `plan.json`), so that
   `python shard.py task_file=DIR/task.json plan_files=[DIR/plan.json] algorithms=[] evaluate=measured`
   measures what was planned.

`collective_plan` plans on rank 0 and broadcasts the plan (an error on rank 0 is raised on every
rank, instead of leaving the others waiting). What cannot be honoured (a compute kernel other
than fused / dense for data_parallel, UVM caching, key-value or virtual tables, a module type
other than the two collections) is a one-line InputError naming the table or module.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingPlanner

from embshard.errors import EmbshardError, InputError
from embshard.plan import Plan
from embshard.task import Task
from embshard.torchrec_bridge import Collection, plan_to_torchrec, task_from_module

log = logging.getLogger("embshard.planner")

#: TorchRec's HeuristicalStorageReservation default: a share of each device's memory kept for
#: the dense model, KJTs and activations.
STORAGE_RESERVATION = 0.15
#: ParameterConstraints fields copied into each table's ParameterSharding (as TorchRec's planner does).
PASSED_THROUGH = ("stochastic_rounding", "bounds_check_mode", "output_dtype", "enforce_hbm")


class EmbShardPlanner(ShardingPlanner):
    """A TorchRec ShardingPlanner backed by this project's searchers (module docstring).

    Args:
        topology: TorchRec `Topology` (world size, local world size, HBM/DDR caps, bandwidths).
            None: the default process group's world on this machine's device, as TorchRec's.
        batch_size: per-rank batch size, as TorchRec's planner takes it (None: 512, TorchRec's).
        constraints: `ParameterConstraints` by table name (see `task_from_module`).
        algorithm: a searcher by its config name (conf/searchers/all.yaml): neuroshard,
            dreamshard, autoshard, torchrec, or a heuristic (size_lookup_greedy, lookup_greedy,
            dim_greedy, size_greedy, round_robin, random, ...).
        storage_reservation: share of each device's memory not given to embeddings (TorchRec's
            default 0.15), or a TorchRec `FixedPercentageStorageReservation` /
            `HeuristicalStorageReservation`, whose percentage is taken (Heuristical's estimate
            of the dense model's size is not).
        out_dir: where each `plan` writes `task.json` and `plan.json` (None: nowhere).
        hardware: conf/hardware/ name of an evaluator for a searcher that measures candidates
            (NeuroShard's guard with `verify=K`); None: nothing is measured.
        cost_model: conf/cost_model/ name of the model behind the summary's estimated costs
            (neural: the shipped checkpoint; analytic), or None for no estimate.
        debug: log the summary at INFO (else DEBUG).
        seed: the searchers' seed.
        **overrides: keys of the searcher's config, e.g. `checkpoint=`, `verify=`, `beam_width=`.
    """

    def __init__(
        self,
        topology: Optional[Topology] = None,
        batch_size: Optional[int] = None,
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
        algorithm: str = "neuroshard",
        storage_reservation: Any = STORAGE_RESERVATION,
        out_dir: Optional[str | Path] = None,
        hardware: Optional[str] = None,
        cost_model: Optional[str] = "neural",
        debug: bool = True,
        seed: int = 0,
        **overrides: Any,
    ) -> None:
        from embshard import api

        if topology is None:
            if not dist.is_initialized():
                raise InputError("EmbShardPlanner needs a topology (or an initialized default process group)")
            topology = Topology(world_size=dist.get_world_size(), local_world_size=_local_world_size(),
                                compute_device="cuda" if torch.cuda.is_available() else "cpu")
        self._topology = topology
        self._batch_size = batch_size
        self._constraints = dict(constraints or {})
        self.algorithm = algorithm
        # a TorchRec StorageReservation object keeps its share in `_percentage`
        self.storage_reservation = float(getattr(storage_reservation, "_percentage", storage_reservation))
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.cost_model = cost_model
        self.debug = debug
        self.seed = seed
        self.overrides = overrides
        # build the searcher now: an unknown algorithm or override fails here, on every rank
        self.searcher = api.searcher(algorithm, seed=seed, **overrides)
        self.hardware = api.hardware(hardware, seed=seed) if hardware is not None else None
        self.last_task: Task | None = None
        self.last_plan: Plan | None = None
        self.last_collections: list[Collection] = []
        self.last_search_seconds: float | None = None
        self.last_summary: str | None = None
        #: on a model of both kinds planned in two parts (`embshard.search.mixed`), what was done
        self.last_mixed: dict | None = None

    # ------------------------------------------------------------------ ShardingPlanner
    def plan(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """Plan `module` for `sharders` on this process (module docstring)."""
        from embshard import api

        task, collections = task_from_module(module, self._topology, self._batch_size, self._constraints,
                                             sharders=sharders, name=type(module).__name__,
                                             storage_reservation=self.storage_reservation)
        start = time.perf_counter()
        plan, self.last_mixed = api.plan_with_info(task, self.searcher, self.algorithm, hardware=self.hardware)
        self.last_search_seconds = time.perf_counter() - start
        plan.algorithm = self.algorithm
        sharding_plan = self.to_torchrec(task, plan, collections)
        self.last_task, self.last_plan, self.last_collections = task, plan, collections
        self.last_summary = self.summary(task, plan, collections)
        log.log(logging.INFO if self.debug else logging.DEBUG, "%s", self.last_summary)
        if self.out_dir is not None:
            self.save(self.out_dir)
        return sharding_plan

    def collective_plan(self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
                        pg: Optional[dist.ProcessGroup] = None) -> ShardingPlan:
        """Plan on rank 0 of `pg` (default: the world) and broadcast, as TorchRec's planner does;
        every rank gets the same plan, or the same one-line error."""
        if pg is None:
            if not dist.is_initialized():
                raise InputError("collective_plan needs a process group (or an initialized default one); "
                                 "use plan() in a single process")
            pg = dist.GroupMember.WORLD
        if sharders is None:
            from torchrec.distributed.sharding_plan import get_default_sharders

            sharders = get_default_sharders()
        payload: list[Any] = [None]
        if pg.rank() == 0:
            try:
                sharding_plan = self.plan(module, sharders)
                payload = [("ok", sharding_plan, self.last_task.to_dict(), self.last_plan.to_dict(),
                            self.last_collections, self.last_summary, self.last_search_seconds)]
            except EmbshardError as e:
                payload = [("error", type(e).__name__, str(e))]
        if pg.size() > 1:
            dist.broadcast_object_list(payload, src=dist.get_global_rank(pg, 0), group=pg)
        status, *rest = payload[0]
        if status == "error":
            import embshard.errors as errors

            raise getattr(errors, rest[0], EmbshardError)(rest[1])
        sharding_plan, task_dict, plan_dict, collections, summary, seconds = rest
        if pg.rank() != 0:
            self.last_task, self.last_plan = Task.from_dict(task_dict), Plan.from_dict(plan_dict)
            self.last_collections, self.last_summary, self.last_search_seconds = collections, summary, seconds
        return sharding_plan

    # ------------------------------------------------------------------ export, summary, files
    def to_torchrec(self, task: Task, plan: Plan, collections: list[Collection]) -> ShardingPlan:
        """The ShardingPlan: each collection's tables under its path, constraints' kernel
        options carried into their ParameterShardings."""
        out: dict[str, Any] = {}
        for c in collections:
            names = set(c.tables)
            sub_task = dataclasses.replace(task, tables=tuple(t for t in task.tables if t.name in names))
            sub_plan = Plan(task.name, plan.algorithm, [s for s in plan.shards if s.table in names])
            exported = plan_to_torchrec(sub_task, sub_plan, world_size=task.num_devices,
                                        device_type=self._topology.compute_device, module_path=c.path,
                                        local_world_size=task.devices_per_host, check=False)
            module_plan = exported.plan[c.path]
            for name, ps in module_plan.items():
                constraint = self._constraints.get(name)
                for field in PASSED_THROUGH:
                    value = getattr(constraint, field, None) if constraint is not None else None
                    if value is not None:
                        setattr(ps, field, value)
            out[c.path] = module_plan
        return ShardingPlan(out)

    def summary(self, task: Task, plan: Plan, collections: list[Collection]) -> str:
        """Per rank: memory used of the budget, pieces, estimated cost; the sharding types used;
        the algorithm and the model it searched against. TorchRec's planner logs the like."""
        from embshard.compare import binary_size
        from embshard.layouts import choose_layout

        used = plan.memory_bytes(task)
        pieces = [0] * task.num_devices
        for s in plan.shards:
            pieces[s.device] += 1
        costs, note = self._estimate(task, plan)
        kinds: dict[str, int] = {}
        by_table: dict[str, list] = {}
        for s in plan.shards:
            by_table.setdefault(s.table, []).append(s)
        for t in task.tables:
            kind = choose_layout(t, by_table[t.name], task.num_devices, task.devices_per_host)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        where = ", ".join(f"{c.path or '<root>'} ({len(c.tables)})" for c in collections)
        info = dict(getattr(self.searcher, "last_search_info", None) or {})
        checkpoint = info.get("checkpoint") or getattr(self.searcher, "checkpoint", None)
        lines = [
            f"EmbShardPlanner: {len(task.tables)} tables in {where} on {task.num_devices} ranks "
            f"({task.hosts} host(s) x {task.devices_per_host}), {binary_size(task.device_memory_bytes)} per rank for "
            f"embeddings, batch {task.batch_size // task.num_devices} per rank",
            f"  algorithm {self.algorithm}" + (f", checkpoint {checkpoint}" if checkpoint else "")
            + f", planned in {self.last_search_seconds or 0.0:.2f} s; sharding types: "
            + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
            *self._mixed_lines(),
            f"  {'rank':>4}  {'memory used / budget':>24}  {'pieces':>6}  {'est. ms (compute + comm)':>26}",
        ]
        for d in range(task.num_devices):
            est = "" if costs is None else (f"{costs.total_ms[d]:8.2f} ({costs.compute_ms[d]:.2f} + "
                                            f"{costs.forward_comm_ms[d] + costs.backward_comm_ms[d]:.2f})")
            lines.append(f"  {d:>4}  {binary_size(used[d]):>11} / {binary_size(task.device_memory_bytes):<10}  "
                         f"{pieces[d]:>6}  {est:>26}")
        if costs is not None:
            lines.append(f"  estimated plan cost {costs.plan_cost_ms:.2f} ms per step ({note}; not measured)")
        else:
            lines.append(f"  no estimated cost: {note}")
        return "\n".join(lines)

    def _mixed_lines(self) -> list[str]:
        m = self.last_mixed
        if m is None:
            return []
        if "fallback" in m:
            return [f"  {m['fallback']}"]
        split = m.get("row_split") or []
        cut = f", {', '.join(split)} cut into row blocks over every rank" if split else ""
        return [f"  {m['pooled_tables']} pooled table(s) by {self.algorithm}, {m['sequence_tables']} sequence table(s) "
                f"by {m['sequence_planner']}{cut} ({m['reserved_bytes']} bytes per rank reserved for them)"]

    def _estimate(self, task: Task, plan: Plan):
        """(DeviceCosts, what estimated them) by the `cost_model` config, or (None, why not)."""
        if self.cost_model is None:
            return None, "cost_model=None"
        from hydra.utils import instantiate
        from omegaconf import OmegaConf

        from embshard import api

        path = api.CONF / "cost_model" / f"{self.cost_model}.yaml"
        if not path.is_file():
            return None, f"unknown cost model {self.cost_model!r}"
        try:
            cfg = OmegaConf.load(path)
            cfg.pop("pretrain", None)
            model = instantiate(cfg)
            return model.device_costs(task, plan), f"{self.cost_model} cost model"
        except EmbshardError as e:
            return None, str(e).splitlines()[0]

    def save(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write the last planned task and plan as this project's JSON (each atomically):
        OUT/task.json and OUT/plan.json."""
        if self.last_task is None or self.last_plan is None:
            raise InputError("nothing planned yet: call plan() or collective_plan() first")
        out = Path(out_dir)
        self.last_task.save(out / "task.json")
        self.last_plan.save(out / "plan.json")
        return out / "task.json", out / "plan.json"


def _local_world_size() -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))

