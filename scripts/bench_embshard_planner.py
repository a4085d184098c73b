"""Planning time of `EmbShardPlanner.plan` for a TorchRec module of 856 tables on 128 ranks
(a benchmark, not a test: meta device, no processes).

Example:
    .venv/bin/python scripts/bench_embshard_planner.py --algorithms neuroshard,autoshard
    .venv/bin/python scripts/bench_embshard_planner.py --algorithms neuroshard,autoshard,torchrec --repeats 1

The module is one EmbeddingBagCollection on the meta device holding every table of the
planning benchmarks' synthetic 856-table pool (`embshard.data.tasks.planning_bench_tasks`:
dims 4..128; the same tables scripts/bench_neuroshard_planning.py and bench_rl_planning.py
plan), each table's pooling factor given as a `ParameterConstraints`, as a TorchRec user
would; the topology has 128 GPUs in 16 hosts of 8 with HBM equal to the benchmark task's
memory per device (1.5x an even share) and TorchRec's per-rank batch 512 (65536 in all). The
time is all of `plan()`: reading the module, the search (the shipped checkpoint), the
validator, the export to a TorchRec ShardingPlan and the summary (the neural cost model's
estimate). One untimed warm-up plan of a 10-table module runs first (imports, checkpoint load).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def module_of(task):
    """An EmbeddingBagCollection (meta device) with the task's tables, and their pooling factors
    as TorchRec constraints."""
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=[t.name])
               for t in task.tables]
    constraints = {t.name: ParameterConstraints(pooling_factors=[max(t.pooling_factor, 1e-3)]) for t in task.tables}
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta")), constraints


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=856)
    ap.add_argument("--devices", type=int, default=128)
    ap.add_argument("--devices-per-host", type=int, default=8)
    ap.add_argument("--algorithms", default="neuroshard,autoshard")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("torchrec").setLevel(logging.ERROR)

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import Topology

    from embshard import EmbShardPlanner
    from embshard.data.tasks import planning_bench_tasks

    task, warm = planning_bench_tasks(args.tables, args.devices, ROOT / "data", seed=args.seed)
    module, constraints = module_of(task)
    warm_module, warm_constraints = module_of(warm)
    per_rank_batch = task.batch_size // args.devices
    print(f"module: {len(task.tables)} tables on {args.devices} ranks ({args.devices // args.devices_per_host} hosts x "
          f"{args.devices_per_host}), {task.device_memory_bytes / 2**30:.2f} GiB HBM each, batch {per_rank_batch} per rank")
    for name in args.algorithms.split(","):
        planner = EmbShardPlanner(
            topology=Topology(world_size=args.devices, local_world_size=args.devices_per_host, compute_device="cuda",
                              hbm_cap=task.device_memory_bytes),
            batch_size=per_rank_batch, constraints=constraints, algorithm=name, storage_reservation=0.0, debug=False)
        warm_planner = EmbShardPlanner(topology=Topology(world_size=2, compute_device="cuda",
                                                         hbm_cap=warm.device_memory_bytes),
                                       batch_size=512, constraints=warm_constraints, algorithm=name, debug=False)
        warm_planner.plan(warm_module, [EmbeddingBagCollectionSharder()])
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            sharding_plan = planner.plan(module, [EmbeddingBagCollectionSharder()])
            times.append(time.perf_counter() - start)
        kinds: dict[str, int] = {}
        for ps in sharding_plan.plan[""].values():
            kinds[ps.sharding_type] = kinds.get(ps.sharding_type, 0) + 1
        used = planner.last_plan.memory_bytes(planner.last_task)
        print(f"{name:>12}: min {min(times):.2f} s, median {statistics.median(times):.2f} s over {len(times)} "
              f"(search {planner.last_search_seconds:.2f} s of the last); {len(sharding_plan.plan[''])} tables: "
              f"{', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}; fullest rank "
              f"{max(used) / planner.last_task.device_memory_bytes:.0%} of its memory", flush=True)


if __name__ == "__main__":
    main()
