"""One TorchRec module planned by TorchRec's EmbeddingShardingPlanner and by EmbShardPlanner,
the plans measured by `shard.py evaluate=measured` (a benchmark, not a test).

Example (`make compare-planners`):
    .venv/bin/python scripts/compare_planners.py --out experiments/compare_planners

Builds an EmbeddingBagCollection (meta device) of `--tables` tables drawn from the synthetic
856-table pool of the planning benchmarks (NeuroShard-style draw, dims 4..128, 1 GiB of
weights in all: the measurement holds every plan's model on every rank at once), each table's
pooling factor given as a `ParameterConstraints`, plus `--data-parallel` of its smallest tables
constrained to data_parallel, as a TorchRec user would write them; a CPU `Topology` of
`--ranks` ranks. Each planner plans it: TorchRec's own (`EmbeddingShardingPlanner`, its
defaults) and EmbShardPlanner with each of `--algorithms`. Their plans become this project's
plan JSON (TorchRec's through `plan_from_torchrec`) beside the task JSON
(`EmbShardPlanner`'s `Task`), then one shard.py run measures them all, interleaved, as
TorchRec's DistributedModelParallel embedding step on gloo processes (`hardware=dmp_cpu`: the
input ids' all-to-all, lookups, output distribution, backward; it runs data_parallel tables
too, which the kernel measurement refuses):

    python shard.py task_file=OUT/task.json plan_files=[OUT/plans/*.json] algorithms=[] \
        evaluate=measured hardware=dmp_cpu out_dir=OUT/measured

With `--sequence N` the model holds an EmbeddingCollection beside the bags: N more tables of the
draw (those of the most ids a sample) as sequence tables of width `--sequence-dim`, their pooling
factors as the sequence lengths TorchRec's planner is given; both planners plan the two
collections, and the DMP step runs both:

    python scripts/compare_planners.py --out experiments/compare_planners_seq --sequence 4

Writes OUT/task.json, OUT/plans/<planner>.json and OUT/measured/ (report.json and the table).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=24)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2048, help="per rank (TorchRec's batch_size)")
    ap.add_argument("--data-parallel", type=int, default=2, help="smallest tables constrained to data_parallel")
    ap.add_argument("--max-total-bytes", type=int, default=1 << 30,
                    help="weights of all tables together (every plan's model is built on every rank at once)")
    ap.add_argument("--algorithms", default="neuroshard,size_lookup_greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "compare_planners")
    ap.add_argument("--shard-args", nargs="*", default=[], help="more shard.py overrides, e.g. measure=quick")
    ap.add_argument("--sequence", type=int, default=0, help="sequence tables in an EmbeddingCollection beside the bags")
    ap.add_argument("--sequence-dim", type=int, default=32)
    args = ap.parse_args()
    if args.sequence < 0 or args.sequence_dim < 1:
        sys.exit("error: --sequence must be >= 0 and --sequence-dim >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("torchrec").setLevel(logging.ERROR)

    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    from embshard import EmbShardPlanner, validate
    from embshard.data.tasks import neuroshard_tasks, table_pool_from_dataset
    from embshard.data.synthetic import generate_synthetic
    from embshard.torchrec_bridge import plan_from_torchrec

    data = ROOT / "data" / f"synthetic_t856_bs512_s{args.seed}.pt"
    if not data.is_file():
        generate_synthetic(data, num_tables=856, batch_size=512, seed=args.seed)
    n = args.tables + args.sequence
    (drawn,) = neuroshard_tasks(table_pool_from_dataset(data), 1, min_tables=n, max_tables=n,
                                num_devices=args.ranks, seed=args.seed, name_prefix="compare",
                                max_total_bytes=args.max_total_bytes)
    seq = sorted(drawn.tables, key=lambda t: (-t.pooling_factor, t.name))[: args.sequence]
    bags = [t for t in drawn.tables if t not in seq]
    tables = [EmbeddingBagConfig(name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=[t.name])
              for t in bags]
    module = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    if seq:  # an EmbeddingCollection beside the bags, as a model of both kinds holds them
        holder = torch.nn.Module()
        holder.ebc = module
        holder.ec = EmbeddingCollection(tables=[EmbeddingConfig(name=t.name, num_embeddings=t.rows,
                                                                embedding_dim=args.sequence_dim, feature_names=[t.name])
                                                for t in seq], device=torch.device("meta"))
        module = holder
    smallest = sorted(bags, key=lambda t: t.rows * t.dim)[: args.data_parallel]
    constraints = {t.name: ParameterConstraints(pooling_factors=[max(t.pooling_factor, 1e-3)],
                                                **({"sharding_types": ["data_parallel"]} if t in smallest else {}))
                   for t in drawn.tables}
    topology = Topology(world_size=args.ranks, compute_device="cpu", local_world_size=args.ranks)
    sharders = [EmbeddingBagCollectionSharder()] + ([EmbeddingCollectionSharder()] if seq else [])

    out = args.out
    plans = []
    task = None
    for name in args.algorithms.split(","):
        planner = EmbShardPlanner(topology=topology, batch_size=args.batch_size, constraints=constraints,
                                  algorithm=name, debug=False)
        planner.plan(module, sharders)
        task, plan = planner.last_task, planner.last_plan
        plan.algorithm = f"EmbShardPlanner:{name}"
        plans.append(plan)
        print(planner.last_summary)
    torchrec_plan = EmbeddingShardingPlanner(topology=topology, batch_size=args.batch_size, constraints=constraints,
                                             debug=False).plan(module, sharders)
    if seq:  # one plan of the two collections, each read at its path
        import dataclasses

        from embshard import Plan

        shards = []
        for path, names in (("ebc", {t.name for t in bags}), ("ec", {t.name for t in seq})):
            sub = dataclasses.replace(task, tables=tuple(t for t in task.tables if t.name in names))
            shards += plan_from_torchrec(sub, torchrec_plan, module_path=path).shards
        ours = Plan(task.name, "EmbeddingShardingPlanner", shards)
    else:
        ours = plan_from_torchrec(task, torchrec_plan, algorithm="EmbeddingShardingPlanner")
    validate(task, ours)  # TorchRec's plan under our memory model and rules, before anything is measured
    plans.insert(0, ours)
    task.save(out / "task.json")
    files = []
    for plan in plans:
        path = out / "plans" / f"{plan.algorithm.replace(':', '_')}.json"
        plan.save(path)
        files.append(str(path))
    kinds = {n: ps.sharding_type for m in torchrec_plan.plan.values() for n, ps in m.items()}
    print(f"EmbeddingShardingPlanner: " + ", ".join(f"{k} {list(kinds.values()).count(k)}" for k in sorted(set(kinds.values()))))
    cmd = [sys.executable, str(ROOT / "shard.py"), f"task_file={out / 'task.json'}", f"plan_files=[{','.join(files)}]",
           "algorithms=[]", "evaluate=measured", "hardware=dmp_cpu", f"out_dir={out / 'measured'}", *args.shard_args]
    print("$ " + " ".join(cmd[1:]), flush=True)
    code = subprocess.call(cmd, cwd=ROOT)
    if code == 0:
        print(paired_vs_torchrec(out / "measured" / "report.json"))
    return code


def paired_vs_torchrec(report_path: Path) -> str:
    """Each plan's cost / TorchRec's plan's, paired by repetition (measured in the same
    interleaved visit), with the bootstrap 95% interval and its verdict."""
    import json

    from embshard.stats import paired_ratio_summary

    results = {r["algorithm"]: r for r in json.loads(report_path.read_text())["results"] if r["valid"]}
    ref = results["EmbeddingShardingPlanner"]["measured_device_costs"]["plan_cost_samples_ms"]
    lines = ["paired ratio to EmbeddingShardingPlanner's plan (mean [95% CI], verdict):"]
    for name, r in results.items():
        samples = r["measured_device_costs"]["plan_cost_samples_ms"]
        if name == "EmbeddingShardingPlanner" or len(samples) != len(ref):
            continue
        s = paired_ratio_summary([a / b for a, b in zip(samples, ref)])
        lines.append(f"  {name}: {s.mean:.3f}x [{s.low:.3f}, {s.high:.3f}] {s.verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
