"""The same ids looked up pooled and unpooled: what a sequence table's kernel costs against a
pooled one's on this machine (docs/measurement.md, "Sequence tables"); a benchmark, not a test.

    python scripts/pooling_probe.py                       # 500k rows x 64, batch 4096, 30 ids a sample
    python scripts/pooling_probe.py --rows 100000 --dim 32 --ids 10 --backends torch

For each backend: one table, measured as a pooled table (one sum per sample) and as a sequence
table (one vector per id), the kernels the evaluator builds (`embshard.hardware.backends`), on the
same batches, one thread; the median over `--steps` of the forward alone and of the whole step
(forward, backward, fused SGD update), and the unpooled step over the pooled one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def time_kernel(kernel, batches) -> tuple[float, float]:
    """Median ms of the forward alone and of the whole step over `batches` (the first untimed)."""
    kernel.step(batches[0])
    fw, step = [], []
    for b in batches[1:]:
        t = time.perf_counter()
        kernel.forward(b)
        fw.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        kernel.step(b)
        step.append((time.perf_counter() - t) * 1e3)
    return float(np.median(fw)), float(np.median(step))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--ids", type=float, default=30.0, help="ids per sample (pooling factor / sequence length)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backends", default="fbgemm,torch")
    args = ap.parse_args(argv)
    if min(args.rows, args.dim, args.batch, args.steps) < 1 or args.ids <= 0:
        sys.exit("error: --rows, --dim, --batch, --steps must be >= 1 and --ids > 0")

    import torch

    from embshard.errors import InputError
    from embshard.hardware.backends import ShardInput, available_backends, make_kernel
    from embshard.plan import Shard
    from embshard.tables import Table

    torch.set_num_threads(1)
    print(f"{args.rows} rows x {args.dim}, batch {args.batch}, {args.ids:g} ids a sample, median of {args.steps} steps")
    print(f"{'backend':8} {'kind':9} {'forward ms':>11} {'step ms':>9}")
    for backend in args.backends.split(","):
        if backend not in available_backends():
            print(f"{backend:8} unavailable here")
            continue
        got = {}
        for kind in ("pooled", "sequence"):
            t = Table("t", args.rows, args.dim, args.ids, kind=kind)
            try:
                k = make_kernel(backend, [ShardInput(t, Shard.whole(t, 0))], args.batch)
            except InputError as e:
                sys.exit(f"error: {e}")
            rng = np.random.default_rng(0)  # the same ids for both kinds
            got[kind] = time_kernel(k, [k.make_batch(rng) for _ in range(args.steps + 1)])
            del k
            print(f"{backend:8} {kind:9} {got[kind][0]:11.1f} {got[kind][1]:9.1f}")
        print(f"{backend:8} unpooled step / pooled step: {got['sequence'][1] / got['pooled'][1]:.1f}x")


if __name__ == "__main__":
    main()
