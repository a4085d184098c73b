"""The bridge to TorchRec: task -> EmbeddingBagCollection, TorchRec ShardingPlan <-> our Plan.

* `task_to_ebc(task)`: one `EmbeddingBagConfig` per table (name and feature = table name,
  SUM pooling, fp32 or fp16 per `bytes_per_element`), on the meta device by default.
* `plan_from_torchrec(task, sharding_plan)`: import. Every `ShardMetadata` of every table
  becomes one `Shard` (rank = device, offsets/sizes = rectangle); empty shards (TorchRec
  pads row-wise splits with 0-row shards) are dropped. This covers table_wise,
  column_wise, row_wise, table_row_wise, table_column_wise and grid_shard alike.
  data_parallel becomes the whole table on every rank: replica 0 on rank 0 and replica k on
  rank k (counted in memory on every rank, as training allocates it).
* `plan_to_torchrec(task, plan)`: export. Each table's shards become one `ParameterSharding`
  with compute kernel "fused" (FBGEMM's table-batched kernel; "dense" for data_parallel, the
  only kernel TorchRec runs it with), built directly from `EnumerableShardingSpec` /
  `ShardMetadata` (TorchRec's helpers either fix the shard order to the rank order or, for
  uneven row splits, force the inference-only QUANT kernel). What TorchRec's training path can
  run, and which sharding type each layout is, is `embshard.layouts`; a table constrained to
  some sharding types (`Table.sharding_types`) is exported as the first of them its layout
  allows. Anything TorchRec cannot train (uneven or reordered row splits, row splits over a
  subset of ranks that is not one host, other row-and-column splits, replicas on some ranks
  only) raises a one-line PlanError naming the table, instead of failing, or silently
  computing wrong embeddings, inside TorchRec.
"""

from __future__ import annotations

import torch

from embshard.errors import InputError, PlanError
from embshard.layouts import choose_layout
from embshard.plan import Plan, Shard, validate
from embshard.task import Task

#: The compute kernel every exported table uses: FBGEMM's fused table-batched kernel.
FUSED = "fused"
#: data_parallel tables run TorchRec's dense kernel (the only one it offers for them).
DENSE = "dense"


def compute_kernel(sharding_type: str) -> str:
    """The compute kernel an exported table of `sharding_type` gets."""
    return DENSE if sharding_type == "data_parallel" else FUSED


def _data_type(table) -> "object":
    from torchrec.modules.embedding_configs import DataType

    if table.bytes_per_element == 4:
        return DataType.FP32
    if table.bytes_per_element == 2:
        return DataType.FP16
    raise InputError(
        f"table {table.name!r}: bytes_per_element {table.bytes_per_element} has no TorchRec "
        "training equivalent (only 4 = fp32 and 2 = fp16)"
    )


def task_to_ebc(task: Task, device: str | torch.device = "meta"):
    """An `EmbeddingBagCollection` with one SUM-pooled bag per table of `task`.

    The config name and the single feature name of every bag are the table name, so
    TorchRec's parameter names (`embedding_bags.<table>.weight`) and plan keys (`<table>`)
    are our table names.
    """
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    probe = torch.nn.ModuleDict()
    for t in task.tables:
        if "." in t.name or hasattr(probe, t.name):
            raise InputError(
                f"table {t.name!r}: TorchRec cannot hold a table of this name (it names an "
                "nn.Module attribute or contains '.'); rename the table"
            )
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            feature_names=[t.name],
            num_embeddings=t.rows,
            embedding_dim=t.dim,
            pooling=PoolingType.SUM,
            data_type=_data_type(t),
        )
        for t in task.tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device(device))


# ---------------------------------------------------------------------------- import
def _rank_of(placement) -> int:
    """The rank of a ShardMetadata placement ("rank:N/device" or a _remote_device)."""
    rank = placement.rank() if hasattr(placement, "rank") else None
    if rank is None:
        text = str(placement)
        if not text.startswith("rank:"):
            raise PlanError(f"shard placement {text!r} names no rank")
        rank = int(text[len("rank:") :].split("/")[0])
    return int(rank)


def _module_plan(task: Task, sharding_plan, module_path: str | None):
    """The per-table dict of `sharding_plan` for the EBC at `module_path` (or the only one)."""
    plans = getattr(sharding_plan, "plan", sharding_plan)
    if module_path is not None:
        if module_path not in plans:
            raise PlanError(
                f"TorchRec plan has no module {module_path!r} (it has {sorted(plans)})"
            )
        return plans[module_path]
    names = set(task.table_by_name)
    candidates = [p for p in plans.values() if names & set(p)]
    if len(candidates) != 1:
        raise PlanError(
            f"TorchRec plan has {len(candidates)} modules holding tables of task "
            f"{task.name!r}; pass module_path"
        )
    return candidates[0]


def plan_from_torchrec(
    task: Task,
    sharding_plan,
    algorithm: str = "torchrec",
    module_path: str | None = None,
) -> Plan:
    """Our Plan from TorchRec's `ShardingPlan` (or a bare per-table dict) for `task`.

    Every table of the task must be in the TorchRec plan, with a sharding spec (data_parallel:
    the whole table on every rank of `task.num_devices`, as replicas). The result is not
    validated against memory here: callers that need that run `plan.validate`.
    """
    module_plan = _module_plan(task, sharding_plan, module_path)
    tables = task.table_by_name
    extra = sorted(set(module_plan) - set(tables))
    if extra:
        raise PlanError(f"TorchRec plan shards table(s) {extra}, which task {task.name!r} does not have")
    shards: list[Shard] = []
    for t in task.tables:
        if t.name not in module_plan:
            raise PlanError(f"table {t.name!r} is missing from the TorchRec plan")
        ps = module_plan[t.name]
        if ps.sharding_type == "data_parallel":
            shards += [Shard(t.name, rank, 0, t.dim, 0, t.rows, replica=rank) for rank in range(task.num_devices)]
            continue
        spec = ps.sharding_spec
        if spec is None or not getattr(spec, "shards", None):
            raise PlanError(f"table {t.name!r}: TorchRec {ps.sharding_type} sharding has no shard metadata")
        for md in spec.shards:
            (row_off, col_off), (rows, cols) = md.shard_offsets, md.shard_sizes
            if rows == 0 or cols == 0:
                continue
            shards.append(Shard(t.name, _rank_of(md.placement), col_off, cols, row_off, rows))
    return Plan(task.name, algorithm, shards)


# ---------------------------------------------------------------------------- export
def _placement(rank: int, device_type: str, local_world_size: int) -> str:
    if device_type in ("cuda", "mtia"):
        return f"rank:{rank}/{device_type}:{rank % local_world_size}"
    return f"rank:{rank}/{device_type}"


def plan_to_torchrec(
    task: Task,
    plan: Plan,
    world_size: int | None = None,
    device_type: str = "cpu",
    module_path: str = "",
    local_world_size: int | None = None,
    check: bool = True,
):
    """TorchRec `ShardingPlan` for `plan`, keyed by `module_path`: the collection's path in the
    model DistributedModelParallel wraps ("" only when the collection itself is wrapped; for
    TorchRec's DLRM, "sparse_arch.embedding_bag_collection"). `embshard.EmbShardPlanner`
    finds every collection's path itself.

    Args:
        world_size: ranks TorchRec runs on; defaults to `task.num_devices`.
        device_type: "cpu" (gloo) or "cuda" (placements "rank:N/cuda:N % local_world_size");
            the device DistributedModelParallel runs on.
        local_world_size: ranks per host; defaults to `task.devices_per_host`.
        check: run our `validate` first (coverage, alignment and memory).

    Raises:
        PlanError: the plan is invalid, or a table's split is one TorchRec cannot train
            (see the module docstring); the message names the table.
    """
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    if check:
        validate(task, plan)
    # row maps are the sequence data path's (dlrm/sequence_embedding.py): TorchRec would look rows up unremapped
    if plan.row_maps:
        raise PlanError(f"plan {plan.algorithm!r} cannot be exported to TorchRec: table(s) {sorted(plan.row_maps)[:3]} "
                        "have row maps (a sequence-table plan: train it with train.py stage=sequence_throughput)")
    world_size = task.num_devices if world_size is None else world_size
    local_world_size = local_world_size or task.devices_per_host or world_size
    local_world_size = min(local_world_size, world_size)
    by_table: dict[str, list[Shard]] = {t.name: [] for t in task.tables}
    for s in plan.shards:
        if s.table not in by_table:
            raise PlanError(f"shard names table {s.table!r}, which task {task.name!r} does not have")
        if not 0 <= s.device < world_size:
            raise PlanError(f"table {s.table!r}: device {s.device} is not a rank of world size {world_size}")
        by_table[s.table].append(s)
    module_plan = EmbeddingModuleShardingPlan()
    for t in task.tables:
        if not by_table[t.name]:
            raise PlanError(f"table {t.name!r} is not placed on any device")
        kind, pieces = choose_layout(t, by_table[t.name], world_size, local_world_size)
        spec = None
        if kind != "data_parallel":
            spec = EnumerableShardingSpec([
                ShardMetadata(
                    shard_offsets=[row_off, col_off],
                    shard_sizes=[rows, cols],
                    placement=_placement(rank, device_type, local_world_size),
                )
                for row_off, col_off, rows, cols, rank in pieces
            ])
        module_plan[t.name] = ParameterSharding(
            sharding_type=kind,
            compute_kernel=compute_kernel(kind),
            ranks=[p[4] for p in pieces],
            sharding_spec=spec,
        )
    return ShardingPlan({module_path: module_plan})
