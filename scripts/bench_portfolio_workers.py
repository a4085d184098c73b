"""The portfolio's planning time one member after another (`workers=1`) against forked workers
(`workers=auto`, one per core), by task size (a benchmark, not a test).

Example:
    .venv/bin/python scripts/bench_portfolio_workers.py --sizes 8x2,24x4,48x4,128x8,256x8,512x16,1366x12

With `--task-file`, times the portfolio on that task instead, `--repeats` times for each of
`--workers` (e.g. the harsh 5,384 x 1,024 task of `scripts/bench_rl_planning.py --save-task`):
    .venv/bin/python scripts/bench_portfolio_workers.py --task-file harsh.json --workers auto --repeats 10

Tasks are a user's tables without reuse histograms (rows 1,000-2,000,000, dims 4-128, pooling
factor 1-40, batch 4096, device memory 1.5x an even share and at least 1.05x the largest table),
planned by `PortfolioSharder(verify=0)` (nothing measured). The two settings alternate, each on a
fresh task object with no histogram imputed yet, after one untimed warm-up plan; prints each
run's seconds and the median ratio of forked to serial.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from embshard import Table, Task
from embshard.costs import features
from embshard.search.portfolio import PortfolioSharder


def user_task(tables: int, devices: int, seed: int) -> Task:
    rng = np.random.default_rng(seed)
    ts = tuple(Table(f"t{i}", int(rng.integers(1_000, 2_000_000)), 4 * int(rng.integers(1, 33)),
                     float(rng.uniform(1, 40))) for i in range(tables))
    probe = Task("probe", devices, 1, 4096, ts)
    need = [probe.table_memory_bytes(t) for t in ts]
    return Task(f"user-{tables}x{devices}", devices, int(max(1.5 * sum(need) / devices, 1.05 * max(need))), 4096, ts)


def timed(tables: int, devices: int, seed: int, workers: int | str, task_file: str | None = None) -> float:
    task = Task.load(task_file) if task_file else user_task(tables, devices, seed)
    features._IMPUTED.clear()  # every run imputes its tables' histograms itself
    p = PortfolioSharder(workers=workers, verify=0)
    p.ranking_model()
    t0 = time.perf_counter()
    p.shard(task)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8x2,24x4,48x4,128x8,256x8,512x16,1366x12", help="TABLESxDEVICES,...")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each setting per size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-file", help="time the portfolio on this task file instead of generated sizes")
    ap.add_argument("--workers", default="1,auto", help="with --task-file: the settings to time, e.g. auto")
    args = ap.parse_args()
    timed(8, 2, args.seed + 1, "auto")  # warm-up: imports, checkpoints
    if args.task_file:
        settings = [w if w == "auto" else int(w) for w in args.workers.split(",")]
        for i in range(args.repeats):
            for w in settings:
                print(f"{args.task_file} run {i + 1} workers={w}: {timed(0, 0, args.seed, w, args.task_file):.2f} s", flush=True)
        return
    print(f"{'tables x devices':>16}  {'workers=1 (s)':>16}  {'workers=auto (s)':>18}  auto / 1")
    for size in args.sizes.split(","):
        tables, devices = (int(x) for x in size.split("x"))
        serial, forked = [], []
        for _ in range(args.repeats):
            serial.append(timed(tables, devices, args.seed, 1))
            forked.append(timed(tables, devices, args.seed, "auto"))
        ratio = statistics.median(f / s for f, s in zip(forked, serial))
        print(f"{size:>16}  {' '.join(f'{x:.2f}' for x in serial):>16}  {' '.join(f'{x:.2f}' for x in forked):>18}  {ratio:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
