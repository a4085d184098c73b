"""User-style tasks with heavy-tailed pooling factors, small enough to measure on a 2-core CPU
(task files for shard.py; a benchmark input, not a test).

    python scripts/heavy_tasks.py --out experiments/heavy/tasks --num-tasks 60 --seed 632
    python scripts/heavy_tasks.py --out experiments/heavy/tasks --only-floor-changes      # those NeuroShard's floor changes
    python scripts/heavy_tasks.py --out experiments/heavy/vetoes --num-tasks 1000 --seed 642 --only-split-vetoes
    python scripts/heavy_tasks.py --out experiments/heavy/small --num-tasks 20 --seed 651 --max-tables 64 --max-batch 8192

A task: 30-80 tables by rows, dim and pooling factor only (no reuse histograms, no traces, as a
user gives them): rows log-uniform in [1e3, 5e6], dims from {8, 16, ..., 256}, pooling factor
1 + Pareto(1.2) capped at 300 (most tables pool 1-3 ids, a few tens to hundreds); 2, 4 or 8
devices; batch 2048, 8192 or 32768; memory per device 1.3x an even share of the tables' memory
(at least 1.05x the largest table). Where the lookups would exceed 6 million per device per step,
every pooling factor is scaled down (at least 1), which keeps a plan's measurement here to seconds.

`--max-tables` and `--max-batch` write only the draws within those bounds (every task is drawn,
so the ones kept are the same whatever else is kept; `--num-tasks` counts draws).

`--only-floor-changes` writes only the tasks on which NeuroShard's heuristic floor (`floor`,
conf/search/neuroshard.yaml) returns another plan than its search's pick (where
`search_info.floor` kept a heuristic's plan; nothing is measured), and prints each with its
predicted costs: the tasks a measured comparison of the floor needs (every other task gets the
same plan either way).

`--only-split-vetoes` writes only the tasks on which the analytic check (`split_check=analytic`,
NeuroShard's default until 2026-12-03) turns down the cut of the costliest tables that NeuroShard's
models predict cheaper (`search_info.costly_split`: above the beam's bounds, so tasks of more than
64 tables), and prints both models' cut / uncut ratios: the tasks where that check and its absence
(the default since) plan differently.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from embshard import Table, Task

DIMS = (8, 16, 32, 64, 128, 256)
MAX_LOOKUPS_PER_DEVICE = 6e6


def heavy_task(rng: np.random.Generator, name: str) -> Task:
    """One task of the module docstring, drawn from `rng` in a fixed order."""
    n = int(rng.integers(30, 81))
    devices = int(rng.choice([2, 4, 8]))
    batch = int(rng.choice([2048, 8192, 32768]))
    tables = []
    for k in range(n):
        rows = int(np.exp(rng.uniform(np.log(1e3), np.log(5e6))))
        dim = int(rng.choice(DIMS))
        tables.append(Table(f"h{k}", rows, dim, round(float(min(300.0, rng.pareto(1.2) + 1.0)), 3)))
    lookups = sum(t.pooling_factor for t in tables) * batch
    if lookups / devices > MAX_LOOKUPS_PER_DEVICE:
        s = MAX_LOOKUPS_PER_DEVICE * devices / lookups
        tables = [Table(t.name, t.rows, t.dim, round(max(1.0, t.pooling_factor * s), 3)) for t in tables]
    probe = Task("probe", devices, 1 << 50, batch, tuple(tables))
    need = [probe.table_memory_bytes(t) for t in tables]
    memory = int(max(1.3 * sum(need) / devices, 1.05 * max(need)))
    return Task(name, devices, memory, batch, tuple(tables))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder of task files (created)")
    ap.add_argument("--num-tasks", type=int, default=60)
    ap.add_argument("--seed", type=int, default=632)
    ap.add_argument("--only-floor-changes", action="store_true",
                    help="write only the tasks where NeuroShard's floor changes its plan")
    ap.add_argument("--only-split-vetoes", action="store_true",
                    help="write only the tasks where split_check=analytic turns down NeuroShard's costliest cut")
    ap.add_argument("--max-tables", type=int, default=None, help="write only draws of at most this many tables")
    ap.add_argument("--max-batch", type=int, default=None, help="write only draws of at most this batch")
    args = ap.parse_args()
    if args.only_floor_changes and args.only_split_vetoes:
        ap.error("--only-floor-changes and --only-split-vetoes select different tasks; give one")
    if args.num_tasks < 1:
        ap.error(f"--num-tasks must be >= 1, got {args.num_tasks}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    if args.only_floor_changes or args.only_split_vetoes:
        from embshard.search.neuroshard import BEAM_MAX_PIECES, NeuroShardSharder

        floored = NeuroShardSharder(verify=0)
        checked = NeuroShardSharder(verify=0, split_check="analytic")
    written = 0
    for i in range(args.num_tasks):
        task = heavy_task(rng, f"heavy-{args.seed}-{i:03d}")
        if (args.max_tables is not None and len(task.tables) > args.max_tables) or (
                args.max_batch is not None and task.batch_size > args.max_batch):
            continue
        if args.only_floor_changes:
            floored.shard(task)
            f = floored.last_search_info["floor"]
            if f.get("kept", "search") == "search":  # the search's pick (or the floor skipped)
                continue
            print(f"{task.name} ({len(task.tables)} tables x {task.num_devices}, batch {task.batch_size}): search "
                  f"{f['search_ms']:.2f} ms predicted, {f['kept']} {f['heuristics_ms'][f['kept']]:.2f} ms", flush=True)
        if args.only_split_vetoes:
            if len(task.tables) <= BEAM_MAX_PIECES:  # the beam runs: no costliest cut to check
                continue
            checked.shard(task)
            c = checked.last_search_info.get("costly_split")
            if not c or c["kept"] or "analytic_ms" not in c:  # not tried, kept, or dearer by the models
                continue
            (uncut, cut), (a_uncut, a_cut) = c["predicted_ms"], c["analytic_ms"]
            print(f"{task.name} ({len(task.tables)} tables x {task.num_devices}, batch {task.batch_size}): cut / uncut "
                  f"{cut / uncut:.3f} by NeuroShard's models, {a_cut / a_uncut:.3f} by the analytic model", flush=True)
        task.save(out / f"{task.name}.json")
        written += 1
    print(f"wrote {written} task(s) to {out}")


if __name__ == "__main__":
    main()
