"""Page faults inside a timed kernel step, with glibc's default allocator and with the
protocol's caching allocator (`measure.malloc=cache`).

    python scripts/page_faults.py [--shards 8] [--seed 123]

Draws random shards like the broad cost-data collection, builds each one's FBGEMM kernel, and
for each allocator runs warm steps, then times steps reading the thread's user and system CPU
time and the process's minor page faults. Prints per shard: faults per step, user / system ms,
wall ms, under both allocators.
"""

from __future__ import annotations

import argparse
import math
import resource
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--seed", type=int, default=123)
    args = ap.parse_args()

    from embshard.costs.collect import draw_compute_shard
    from embshard.hardware.backends import ShardInput, make_kernel
    from embshard.hardware.compute import set_rng
    from embshard.hardware.protocol import MeasurementProtocol, measuring_process

    rng = np.random.default_rng(args.seed)
    gen = {"min_rows": 100, "max_rows": 5_000_000, "max_pooling": 200.0, "onehot_share": 0.15, "histogram_share": 0.5}
    print("| shard | batch | pieces | allocator | faults / step | user ms | system ms | wall ms |")
    print("|---|---|---|---|---|---|---|---|")
    for i in range(args.shards):
        batch = int(rng.choice([2048, 4096, 8192, 16384, 32768, 65536]))
        cap = 12e6 * math.exp(-rng.uniform(0, math.log(100)))
        drawn = draw_compute_shard([], [4, 8, 16, 32, 64, 128, 256], int(rng.integers(1, 41)), 512 << 20, 0.02, rng,
                                   batch_size=batch, generated=gen, pool_share=0.0, row_piece_prob=0.1, max_lookups=cap,
                                   prefix=f"p{i}-")
        sets = [ShardInput(t, s) for t, s in drawn]
        for malloc in ("default", "cache"):
            proto = MeasurementProtocol(malloc=malloc, probe=False)
            with measuring_process(proto):
                kernel = make_kernel("fbgemm", sets, batch)
                batches = [kernel.make_batch(set_rng(0, i, 0, j)) for j in range(5)]
                for b in batches[:2]:
                    kernel.step(b)
                rows = []
                for b in batches[2:]:
                    r0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    kernel.step(b)
                    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    r1, t1 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
                    rows.append((f1 - f0, 1e3 * (r1.ru_utime - r0.ru_utime), 1e3 * (r1.ru_stime - r0.ru_stime),
                                 1e3 * (t1 - t0)))
                del kernel, batches
            f, u, s, w = np.median(np.array(rows), axis=0)
            print(f"| {i} | {batch} | {len(sets)} | {malloc} | {f:.0f} | {u:.1f} | {s:.1f} | {w:.1f} |", flush=True)


if __name__ == "__main__":
    main()
