"""Time the end-to-end data path: ms to build one rank's trace-replay batch of a task.

    python scripts/bench_dlrm_data.py experiments/e2e/task.json [--ranks 2] [--batches 10]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlrm.data import TraceReplayBatches  # noqa: E402
from embshard.task import Task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task")
    ap.add_argument("--ranks", type=int, default=2, help="the local batch is the task's batch / ranks")
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--dense", type=int, default=13)
    a = ap.parse_args()
    torch.set_num_threads(1)
    task = Task.load(a.task)
    it = iter(TraceReplayBatches(task, task.batch_size // a.ranks, a.dense, seed=0))
    next(it)  # opens and caches the trace file
    start = time.perf_counter()
    for _ in range(a.batches):
        next(it)
    ms = (time.perf_counter() - start) / a.batches * 1000
    print(f"{task.name}: {len(task.tables)} tables, local batch {task.batch_size // a.ranks}: {ms:.1f} ms per batch")


if __name__ == "__main__":
    main()
