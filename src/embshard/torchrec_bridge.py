"""The bridge to TorchRec: module -> task, task -> EmbeddingBagCollection, TorchRec ShardingPlan <-> our Plan.

* `task_from_module(module, topology, batch_size, constraints)` (`Task.from_module`): every
  EmbeddingBagCollection (pooled tables) and EmbeddingCollection (sequence tables) anywhere in
  a module tree, the TorchRec `Topology` and `ParameterConstraints`, as one Task.

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

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

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


def _check_names(tables) -> None:
    probe = torch.nn.ModuleDict()
    for t in tables:
        if "." in t.name or hasattr(probe, t.name):
            raise InputError(
                f"table {t.name!r}: TorchRec cannot hold a table of this name (it names an "
                "nn.Module attribute or contains '.'); rename the table"
            )


def task_to_ebc(task: Task, device: str | torch.device = "meta"):
    """An `EmbeddingBagCollection` with one SUM-pooled bag per table of `task`.

    The config name and the single feature name of every bag are the table name, so
    TorchRec's parameter names (`embedding_bags.<table>.weight`) and plan keys (`<table>`)
    are our table names. A task with sequence tables is refused (one line): they are no bags;
    `task_to_collections` builds both kinds.
    """
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    seq = [t.name for t in task.tables if t.is_sequence]
    if seq:
        raise InputError(f"task {task.name!r}: sequence table(s) {seq[:3]} are no EmbeddingBagCollection bags (one "
                         "vector per id, not a sum): build an EmbeddingCollection for them (task_to_collections)")
    _check_names(task.tables)
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


def task_to_collections(task: Task, device: str | torch.device = "meta") -> dict[str, torch.nn.Module]:
    """The collections a TorchRec model of `task` holds, by name: `ebc` (its pooled tables, as
    `task_to_ebc`) and `ec<dim>`, one `EmbeddingCollection` per width of its sequence tables
    (TorchRec's EmbeddingCollection holds tables of one width), each table's config name and
    single feature the table's name."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    _check_names(task.tables)
    out: dict[str, torch.nn.Module] = {}
    pooled = tuple(t for t in task.tables if not t.is_sequence)
    if pooled:
        out["ebc"] = task_to_ebc(dataclasses.replace(task, tables=pooled), device)
    for dim in sorted({t.dim for t in task.tables if t.is_sequence}):
        configs = [EmbeddingConfig(name=t.name, feature_names=[t.name], num_embeddings=t.rows, embedding_dim=t.dim,
                                   data_type=_data_type(t))
                   for t in task.tables if t.is_sequence and t.dim == dim]
        out[f"ec{dim}"] = EmbeddingCollection(tables=configs, device=torch.device(device))
    return out


def collections_plan(task: Task, plan: Plan, collections: dict[str, torch.nn.Module], world_size: int | None = None,
                     device_type: str = "cpu", prefix: str = ""):
    """One TorchRec `ShardingPlan` for `plan` over `collections` (`task_to_collections`), each
    collection's tables keyed by its path (`prefix` + its name), as `plan_to_torchrec` exports
    one collection."""
    from torchrec.distributed.types import ShardingPlan

    validate(task, plan)
    out = {}
    for name, module in collections.items():
        names = {c.name for c in (module.embedding_bag_configs() if hasattr(module, "embedding_bag_configs")
                                  else module.embedding_configs())}
        sub_task = dataclasses.replace(task, tables=tuple(t for t in task.tables if t.name in names))
        sub_plan = Plan(task.name, plan.algorithm, [s for s in plan.shards if s.table in names],
                        row_maps=plan.row_maps)
        out.update(plan_to_torchrec(sub_task, sub_plan, world_size=world_size, device_type=device_type,
                                    module_path=prefix + name, check=False).plan)
    return ShardingPlan(out)


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


# ---------------------------------------------------------------------------- module -> task
#: TorchRec's planner defaults (torchrec/distributed/planner/constants.py): per-rank batch size
#: and pooling factor when a constraint names none.
TORCHREC_BATCH_SIZE = 512
TORCHREC_POOLING_FACTOR = 1.0
#: ParameterConstraints fields that ask for something other than FBGEMM's fused kernel in
#: device memory: embshard cannot honour them (a one-line error names the table).
UNSUPPORTED_CONSTRAINTS = ("cache_params", "key_value_params", "device_group")
#: Fused optimizers by the names TorchRec and FBGEMM give them -> the task's optimizer.
_OPTIMIZERS = {
    "sgd": "sgd", "exact_sgd": "sgd",
    "rowwiseadagrad": "rowwise_adagrad", "row_wise_adagrad": "rowwise_adagrad",
    "exact_row_wise_adagrad": "rowwise_adagrad",
    "adagrad": "adagrad", "exact_adagrad": "adagrad",
    "adam": "adam",
}


@dataclass(frozen=True)
class Collection:
    """One embedding collection of a module: where it is and which tables it holds."""

    path: str                 # its path in the module ("" for the module itself)
    kind: str                 # "pooled" (EmbeddingBagCollection) or "sequence" (EmbeddingCollection)
    tables: tuple[str, ...]


def topology_task_fields(topology) -> dict:
    """num_devices, devices_per_host, memory per device and bandwidths of a TorchRec Topology.

    Memory is each device's HBM (compute_device cuda/mtia) or DDR (cpu), the smallest of them
    (a task has one budget per device). TorchRec's bandwidths (bytes per ms) become GiB/s."""
    from embshard.task import BYTES_PER_GB

    accelerator = topology.compute_device in ("cuda", "mtia")
    caps = [d.storage.hbm if accelerator else d.storage.ddr for d in topology.devices]
    to_gbps = lambda bw: float(bw) * 1000 / BYTES_PER_GB  # noqa: E731
    return dict(num_devices=int(topology.world_size), devices_per_host=int(topology.local_world_size),
                device_memory_bytes=int(min(caps)), intra_host_gbps=to_gbps(topology.intra_host_bw),
                inter_host_gbps=to_gbps(topology.inter_host_bw))


def find_collections(module: torch.nn.Module, sharders: Sequence | None = None) -> list[tuple[str, torch.nn.Module]]:
    """Every EmbeddingBagCollection and EmbeddingCollection in `module`'s tree, by path, that
    a sharder of `sharders` shards (all of them when None), as DistributedModelParallel finds
    them (exact module type). A module of another type a sharder would shard is an
    InputError: embshard plans only these two."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    supported = (EmbeddingBagCollection, EmbeddingCollection)
    types = None if sharders is None else {s.module_type for s in sharders}
    found = []
    for path, m in module.named_modules():
        if types is not None and type(m) not in types:
            continue
        if type(m) in supported:
            found.append((path, m))
        elif types is not None:
            raise InputError(f"module {path or '<root>'!r} ({type(m).__name__}): embshard plans EmbeddingBagCollection "
                             "and EmbeddingCollection modules only; drop its sharder or plan it with TorchRec's planner")
    if not found:
        names = "" if sharders is None else f" that the sharders given ({', '.join(type(s).__name__ for s in sharders)}) shard"
        raise InputError(f"{type(module).__name__} has no EmbeddingBagCollection or EmbeddingCollection{names}: "
                         "nothing to plan")
    return found


def task_from_module(module: torch.nn.Module, topology, batch_size: int | None = None,
                     constraints: Mapping | None = None, sharders: Sequence | None = None,
                     name: str | None = None, storage_reservation: float = 0.0) -> tuple[Task, list[Collection]]:
    """The task a TorchRec module poses, and where its collections are (`Task.from_module`).

    Args:
        module: any module tree; every EmbeddingBagCollection (pooled tables) and
            EmbeddingCollection (sequence tables) in it is read, at any depth; table names
            must be unique across them. Meta-device modules are fine.
        topology: a TorchRec `Topology` (world size, local world size, HBM/DDR caps, bandwidths).
        batch_size: TorchRec's per-rank batch size (default 512, TorchRec's); the task's batch
            is the global one, batch_size × world size.
        constraints: TorchRec `ParameterConstraints` by table name: `sharding_types`,
            `min_partition`, `pooling_factors` / `num_poolings` / `batch_sizes` (the table's
            lookups and bags per sample), `compute_kernels` (must allow fused; dense for
            data_parallel). `cache_params`, `key_value_params` and `device_group` cannot be
            honoured: InputError naming the table. A constraint for a table the module does
            not have is an InputError too.
        sharders: the TorchRec sharders DistributedModelParallel will use (default: TorchRec's
            EmbeddingBagCollectionSharder / EmbeddingCollectionSharder); their sharding types
            on the topology's compute device bound every table's `sharding_types`.
        storage_reservation: share of each device's memory kept for everything but embeddings.

    Returns:
        (task, collections).
    """
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from embshard.errors import check_keys
    from embshard.tables import Table

    if not 0.0 <= storage_reservation < 1.0:
        raise InputError(f"storage_reservation must be in [0, 1), got {storage_reservation!r}")
    batch = TORCHREC_BATCH_SIZE if batch_size is None else batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise InputError(f"batch_size must be a positive integer (TorchRec's per-rank batch), got {batch_size!r}")
    collections = find_collections(module, sharders)
    by_type = {s.module_type: s for s in (sharders or ())}
    device = topology.compute_device
    constraints = dict(constraints or {})
    tables: list[Table] = []
    where: list[Collection] = []
    owner: dict[str, str] = {}
    optimizers: set[str] = set()
    for path, m in collections:
        pooled = isinstance(m, EmbeddingBagCollection)
        sharder = by_type.get(type(m)) or (EmbeddingBagCollectionSharder() if pooled else EmbeddingCollectionSharder())
        configs = m.embedding_bag_configs() if pooled else m.embedding_configs()
        for cfg in configs:
            if cfg.name in owner:
                raise InputError(f"table {cfg.name!r} is in both {owner[cfg.name] or '<root>'!r} and {path or '<root>'!r}; "
                                 "embshard needs table names unique across the module's collections")
            owner[cfg.name] = path
            tables.append(_table_of(cfg, "pooled" if pooled else "sequence", constraints.get(cfg.name), sharder,
                                    device, batch, Table))
        optimizers |= _optimizers_of(m, sharder)
        where.append(Collection(path, "pooled" if pooled else "sequence", tuple(c.name for c in configs)))
    check_keys(constraints, list(owner), "constraints", what="table")
    if len(optimizers) > 1:
        raise InputError(f"the collections use different fused optimizers {sorted(optimizers)}; embshard plans one")
    fields = topology_task_fields(topology)
    fields["device_memory_bytes"] = int(fields["device_memory_bytes"] * (1.0 - storage_reservation))
    task = Task(name=name or type(module).__name__, batch_size=batch * fields["num_devices"], tables=tuple(tables),
                optimizer=optimizers.pop() if optimizers else "sgd", **fields)
    return task, where


def _table_of(cfg, kind: str, c, sharder, device: str, batch: int, Table):
    """One Table from a TorchRec table config and its ParameterConstraints (or None)."""
    from torchrec.modules.embedding_configs import DataType

    where = f"table {cfg.name!r}"
    bytes_per_element = {DataType.FP32: 4, DataType.FP16: 2}.get(cfg.data_type)
    if bytes_per_element is None:
        raise InputError(f"{where}: data type {cfg.data_type} has no training kernel here (fp32 and fp16 only)")
    for field_name in UNSUPPORTED_CONSTRAINTS:
        if c is not None and getattr(c, field_name, None) not in (None, False):
            raise InputError(f"{where}: constraint {field_name} cannot be honoured: embshard plans FBGEMM's fused "
                             "kernel with the whole table in device memory (plan this table with TorchRec's planner)")
    if c is not None and getattr(c, "use_virtual_table", False):
        raise InputError(f"{where}: constraint use_virtual_table cannot be honoured: embshard plans FBGEMM's fused "
                         "kernel with the whole table in device memory")
    offered = [str(getattr(t, "value", t)) for t in sharder.sharding_types(device)]
    wanted = offered if c is None or not c.sharding_types else [str(getattr(t, "value", t)) for t in c.sharding_types]
    kernels = None if c is None or not c.compute_kernels else {str(getattr(k, "value", k)) for k in c.compute_kernels}
    allowed = [t for t in wanted if t in offered and compute_kernel(t) in sharder.compute_kernels(t, device)
               and (kernels is None or compute_kernel(t) in kernels)]
    if not allowed:
        why = (f"compute_kernels {sorted(kernels)} allow none of its sharding types {wanted} (embshard runs "
               f"{FUSED!r}, and {DENSE!r} for data_parallel)" if kernels is not None and not
               [t for t in wanted if compute_kernel(t) in kernels] else
               f"sharding_types {wanted}: {type(sharder).__name__} on {device} offers {offered}")
        raise InputError(f"{where}: constraint cannot be honoured: {why}")
    features = list(cfg.feature_names) or [cfg.name]
    pfs = list(c.pooling_factors) if c is not None else [TORCHREC_POOLING_FACTOR] * len(features)
    if c is not None and pfs == [TORCHREC_POOLING_FACTOR] and len(features) > 1:
        pfs = pfs * len(features)  # TorchRec's default (one entry) for a table read by several features
    pools = list(c.num_poolings) if c is not None and c.num_poolings else [1.0] * len(pfs)
    batches = list(c.batch_sizes) if c is not None and c.batch_sizes else [batch] * len(pfs)
    if not len(pfs) == len(pools) == len(batches):
        raise InputError(f"{where}: pooling_factors, num_poolings and batch_sizes must have one entry per feature, "
                         f"got {len(pfs)}, {len(pools)} and {len(batches)}")
    if len(pfs) != len(features):
        raise InputError(f"{where}: pooling_factors has {len(pfs)} entries for its {len(features)} feature(s) "
                         f"{features}")
    share = [n * b / batch for n, b in zip(pools, batches)]  # bags per sample of the task's batch
    lookups = sum(pf * s for pf, s in zip(pfs, share))
    bags = sum(share)
    if kind == "sequence":  # one output per id: the pooling factor is the mean sequence length
        bags = 1.0
    return Table(cfg.name, cfg.num_embeddings, cfg.embedding_dim, lookups, bytes_per_element=bytes_per_element,
                 kind=kind, num_poolings=bags if bags > 0 else 1.0, sharding_types=tuple(allowed),
                 min_partition=c.min_partition if c is not None else None)


def _optimizers_of(module: torch.nn.Module, sharder) -> set[str]:
    """The fused optimizer(s) training applies to the collection's tables, by our names:
    `apply_optimizer_in_backward` (each parameter's `_optimizer_classes`) or the sharder's
    `fused_params["optimizer"]`; none: SGD (FBGEMM's default)."""
    names = set()
    for p in module.parameters():
        for cls in getattr(p, "_optimizer_classes", None) or ():
            names.add(cls.__name__.lower())
    fused = (getattr(sharder, "fused_params", None) or {}).get("optimizer")
    if fused is not None:
        names.add(str(getattr(fused, "value", fused)).lower())
    out = set()
    for n in names:
        if n not in _OPTIMIZERS:
            raise InputError(f"fused optimizer {n!r}: embshard counts the state of SGD, row-wise Adagrad, Adagrad and "
                             "Adam only")
        out.add(_OPTIMIZERS[n])
    return out
