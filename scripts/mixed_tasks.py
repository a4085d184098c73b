"""Small tasks of pooled and sequence tables (a model of an EmbeddingBagCollection beside an
EmbeddingCollection) for measured comparisons of the mixed path (docs/torchrec.md, "The row
split, measured"); a benchmark input, not a test.

    python scripts/mixed_tasks.py --out experiments/mixed --num-tasks 5 --seed 660

A task: 2 or 4 devices, batch 1,024, 2,048 or 4,096, memory 512 MiB per device; 4-12 pooled
tables (rows log-uniform in [1e3, 3e5], dims 8-64, pooling factor log-uniform in [1, 20]) and
1-3 sequence tables (rows log-uniform in [1e3, 2e5], dim 16 or 32, 3-30 ids a sample). No
reuse histograms, as a user gives them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def draw(rng: np.random.Generator, name: str) -> dict:
    d = int(rng.choice([2, 4]))
    b = int(rng.choice([1024, 2048, 4096]))
    tables = []
    for k in range(int(rng.integers(4, 13))):
        tables.append({"name": f"p{k}", "rows": int(10 ** rng.uniform(3, 5.5)), "dim": int(rng.choice([8, 16, 32, 64])),
                       "pooling_factor": round(float(10 ** rng.uniform(0, 1.3)), 2)})
    for k in range(int(rng.integers(1, 4))):
        tables.append({"name": f"s{k}", "rows": int(10 ** rng.uniform(3, 5.3)), "dim": int(rng.choice([16, 32])),
                       "pooling_factor": round(float(rng.uniform(3, 30)), 1), "kind": "sequence"})
    return {"name": name, "num_devices": d, "device_memory_bytes": 512 << 20, "batch_size": b, "tables": tables}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-tasks", type=int, default=5)
    ap.add_argument("--seed", type=int, default=660)
    args = ap.parse_args(argv)
    if args.num_tasks < 1:
        sys.exit("error: --num-tasks must be >= 1")

    from embshard.io import write_json_atomic
    from embshard.task import Task

    out = Path(args.out)
    rng = np.random.default_rng(args.seed)
    for i in range(args.num_tasks):
        task = draw(rng, f"mx{i}")
        Task.from_dict(task)  # the validator's check, before anything is written
        write_json_atomic(out / f"mx{i}.json", task)
        print(out / f"mx{i}.json", f"{task['num_devices']} devices, batch {task['batch_size']}, "
              f"{sum(t.get('kind') != 'sequence' for t in task['tables'])} pooled and "
              f"{sum(t.get('kind') == 'sequence' for t in task['tables'])} sequence tables")


if __name__ == "__main__":
    main()
