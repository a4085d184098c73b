"""How long one device's fused embedding step takes here, per backend and batch size.

Example:
    .venv/bin/python scripts/bench_kernels.py --tables 20 --batch-sizes 2048,4096,65536

Draws `--tables` tables (pooling factor `--pooling`, dims from {4..128}, rows log-uniform in
[1e3, --max-rows]), puts them all on one device, and times forward + backward (fused SGD)
with the project's timing helper (warm-ups, fresh indices per repetition, median and IQR).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from embshard.hardware.backends import ShardInput, available_backends
from embshard.hardware.compute import measure_compute
from embshard.hardware.protocol import MeasurementProtocol
from embshard.plan import Shard
from embshard.tables import Table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=20)
    ap.add_argument("--pooling", type=float, default=15.0)
    ap.add_argument("--max-rows", type=int, default=1_000_000)
    ap.add_argument("--batch-sizes", default="2048,4096,65536")
    ap.add_argument("--backends", default=",".join(available_backends()))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmups", type=int, default=2)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    tables = [
        Table(
            f"t{i}",
            rows=int(np.exp(rng.uniform(np.log(1000), np.log(args.max_rows)))),
            dim=int(rng.choice([4, 8, 16, 32, 64, 128])),
            pooling_factor=args.pooling,
        )
        for i in range(args.tables)
    ]
    shards = [ShardInput(t, Shard.whole(t, 0)) for t in tables]
    gb = sum(s.nbytes for s in shards) / 1e9
    print(f"{len(tables)} tables, width {sum(t.dim for t in tables)}, {gb:.2f} GB of weights, "
          f"pooling {args.pooling}, threads {args.threads}")
    for backend in args.backends.split(","):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            reps = args.repetitions if b <= 8192 else max(3, args.repetitions // 2)
            t0 = time.perf_counter()
            protocol = MeasurementProtocol(warmups=args.warmups, repetitions=reps, visits=1, threads=args.threads,
                                           timer="auto" if args.threads == 1 else "wall", probe=False)
            [t] = measure_compute([shards], b, backend=backend, device=args.device, protocol=protocol, seed=args.seed)
            wall = time.perf_counter() - t0
            print(f"{backend:7s} batch {b:6d}: step {t.median_ms:9.1f} ms  (IQR {t.spread_ms:.1f}, "
                  f"n={len(t.samples_ms)}, wall {wall:.1f} s incl. build + index generation)", flush=True)


if __name__ == "__main__":
    main()
