#!/usr/bin/env python
"""Check (and optionally refit) the synthetic generator against fbgemm_t856_bs65536.pt.

The published target is one batch of 65,536 samples over 856 tables:
887,017,990 indices (15.8 per bag), 128,435,723 unique rows, and two 17-bin histograms
("Histogram of col sizes": share of unique rows per reuse bin; "Ratio of index
distribution": share of accesses per reuse bin).

What it prints, for the chosen scale (`--tables`, `--batch-size`):

1. EMPIRICAL: the generator's tables, sampled, reduced to the aggregate statistics by the
   same code the reader uses (`embshard.data.dlrm_datasets.trace_stats` per table, summed
   by `aggregate`). With `--write FILE` the batch is written to a dlrm_datasets file and
   read back through `DlrmDataset` instead (a full round trip; at full scale an 8.0 GB
   file, 8.2 GB peak memory, about 90 s on 2 cores).
2. MODEL: the same quantities as the model's exact expectation at that scale
   (`synthetic.expected_stats`), a check that sampling and model agree.
3. TARGET: the published numbers. Only at full scale (856 x 65536) are they directly
   comparable. At a smaller batch the reuse statistics are not the published ones: every
   table sees proportionally fewer accesses, so reuse shifts to low counts. Indices scale
   exactly (x batch/65536 x tables/856). For unique rows and the histograms the script
   then prints the model's expectation at full scale beside the published numbers (the
   calibration claim), and the model's expectation at the run's scale as the rescaled
   target for the empirical numbers.

Usage:
    python scripts/calibrate_synthetic.py                      # full scale, streamed (~40 s, 0.6 GB)
    python scripts/calibrate_synthetic.py --batch-size 8192    # 856 x 8192
    python scripts/calibrate_synthetic.py --fit                # refit SyntheticParams (~minutes)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, replace

import numpy as np

from embshard.data import synthetic as syn
from embshard.data.dlrm_datasets import DlrmDataset, aggregate, trace_stats

BIN_NAMES = [f"({0 if k == 0 else 2 ** (k - 1)},{2 ** k}]" for k in range(16)] + ["32768+"]


def _loss(stats: syn.AggregateStats) -> float:
    tv_r, mx_r = syn.histogram_distances(stats.row_histogram, syn.TARGET_ROW_HISTOGRAM)
    tv_a, mx_a = syn.histogram_distances(stats.access_histogram, syn.TARGET_ACCESS_HISTOGRAM)
    uniq = abs(math.log(stats.num_unique / syn.TARGET_NUM_UNIQUE))
    return tv_r + tv_a + mx_r + mx_a + uniq


_FIELDS = [
    # name, to-unconstrained, from-unconstrained
    ("small_fraction", lambda v: math.log(v / (1 - v)), lambda x: 1 / (1 + math.exp(-x))),
    ("log10_rows_mean", lambda v: v, lambda x: x),
    ("log10_rows_std", math.log, math.exp),
    ("onehot_fraction", lambda v: math.log(v / (1 - v)), lambda x: 1 / (1 + math.exp(-x))),
    ("small_onehot_fraction", lambda v: math.log(v / (1 - v)), lambda x: 1 / (1 + math.exp(-x))),
    ("log_pooling_std", math.log, math.exp),
    ("zipf_mean", lambda v: v, lambda x: x),
    ("zipf_std", math.log, math.exp),
    ("zipf_rows_corr", lambda v: v, lambda x: x),
    ("log_q", lambda v: v, lambda x: x),
]


def _params_from(x: np.ndarray, base: syn.SyntheticParams) -> syn.SyntheticParams:
    return replace(base, **{name: float(back(v)) for (name, _, back), v in zip(_FIELDS, x)})


def fit(seeds: list[int], iters: int, base: syn.SyntheticParams) -> syn.SyntheticParams:
    """Nelder-Mead on the model's exact full-scale expectation, averaged over seeds."""

    def f(x: np.ndarray) -> float:
        try:
            p = _params_from(np.clip(x, -12, 12), base)
        except (OverflowError, ValueError):
            return 1e9
        return float(np.mean([
            _loss(syn.expected_stats(syn.draw_table_specs(syn.FULL_NUM_TABLES, s, p),
                                     syn.FULL_BATCH_SIZE, ratio=1.12))
            for s in seeds
        ]))

    x0 = np.array([to(getattr(base, name)) for name, to, _ in _FIELDS])
    n = len(x0)
    simplex = [x0] + [x0 + np.eye(n)[i] * 0.3 for i in range(n)]
    vals = [f(x) for x in simplex]
    t0 = time.time()
    for it in range(iters):
        order = np.argsort(vals)
        simplex = [simplex[i] for i in order]
        vals = [vals[i] for i in order]
        if it % 20 == 0:
            print(f"  iter {it:4d}  loss {vals[0]:.4f}  ({time.time() - t0:.0f}s)", flush=True)
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - simplex[-1])
            fe = f(xe)
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(xc)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:
                for i in range(1, n + 1):
                    simplex[i] = simplex[0] + 0.5 * (simplex[i] - simplex[0])
                    vals[i] = f(simplex[i])
    best = simplex[int(np.argmin(vals))]
    print(f"  final loss {min(vals):.4f}")
    return _params_from(best, base)


def empirical(num_tables: int, batch_size: int, seed: int, write: str | None,
              params: syn.SyntheticParams) -> syn.AggregateStats:
    if write:
        syn.generate_synthetic(write, num_tables, batch_size, seed, params=params)
        ds = DlrmDataset.open(write)
        per_table = (ds.table_stats(t) for t in range(ds.num_tables))
        return aggregate(per_table, ds.batch_size)
    per_table = (
        trace_stats(idx, batch_size) for _, _, idx in
        syn.iter_synthetic_tables(num_tables, batch_size, seed, params)
    )
    return aggregate(per_table, batch_size)


def _report(label: str, got: syn.AggregateStats, want_rows, want_acc) -> None:
    tv_r, mx_r = syn.histogram_distances(got.row_histogram, want_rows)
    tv_a, mx_a = syn.histogram_distances(got.access_histogram, want_acc)
    print(f"  {label}: unique-row histogram  TV {tv_r:.4f}  max|diff| {mx_r:.4f}")
    print(f"  {label}: access histogram      TV {tv_a:.4f}  max|diff| {mx_a:.4f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=int, default=syn.FULL_NUM_TABLES)
    ap.add_argument("--batch-size", type=int, default=syn.FULL_BATCH_SIZE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", default=None, help="write the batch to this file and read it back")
    ap.add_argument("--fit", action="store_true", help="refit the mixture hyper-parameters first")
    ap.add_argument("--fit-iters", type=int, default=300)
    ap.add_argument("--fit-seeds", type=int, default=2)
    args = ap.parse_args(argv)

    params = syn.DEFAULT_PARAMS
    if args.fit:
        print(f"fitting SyntheticParams on the model's expectation at 856 x 65536 "
              f"(seeds 0..{args.fit_seeds - 1}) ...")
        params = fit(list(range(args.fit_seeds)), args.fit_iters, params)
        print("fitted:", asdict(params))
        print("(paste into SyntheticParams' defaults to make them the calibrated values)")

    T, B = args.tables, args.batch_size
    full = (T, B) == (syn.FULL_NUM_TABLES, syn.FULL_BATCH_SIZE)
    print(f"scale: {T} tables x batch {B} "
          f"({T / syn.FULL_NUM_TABLES:.3f} of the tables, {B / syn.FULL_BATCH_SIZE:.4f} of the batch)"
          f"{'  [FULL SCALE]' if full else ''}, seed {args.seed}")
    t0 = time.time()
    emp = empirical(T, B, args.seed, args.write, params)
    t_emp = time.time() - t0
    specs = syn.draw_table_specs(T, args.seed, params)
    model = syn.expected_stats(specs, B)
    model_full = syn.expected_stats(syn.draw_table_specs(syn.FULL_NUM_TABLES, args.seed, params),
                                    syn.FULL_BATCH_SIZE)
    idx_scale = (T * B) / (syn.FULL_NUM_TABLES * syn.FULL_BATCH_SIZE)
    print(f"sampled and reduced in {t_emp:.1f}s"
          f"{' (written to ' + args.write + ' and read back)' if args.write else ' (streamed)'}")
    rows_ = [f"{'':24s}{'empirical':>16s}{'model@scale':>16s}{'model@full':>16s}{'published':>16s}"]
    rows_.append(f"{'indices':24s}{emp.num_indices:16,.0f}{model.num_indices:16,.0f}"
                 f"{model_full.num_indices:16,.0f}{syn.TARGET_NUM_INDICES:16,d}")
    rows_.append(f"{'  published x scale':24s}{'':16s}{syn.TARGET_NUM_INDICES * idx_scale:16,.0f}")
    rows_.append(f"{'indices per bag':24s}{emp.indices_per_bag:16.3f}{model.indices_per_bag:16.3f}"
                 f"{model_full.indices_per_bag:16.3f}{syn.TARGET_POOLING_FACTOR:16.3f}")
    rows_.append(f"{'unique rows':24s}{emp.num_unique:16,.0f}{model.num_unique:16,.0f}"
                 f"{model_full.num_unique:16,.0f}{syn.TARGET_NUM_UNIQUE:16,d}")
    rows_.append(f"{'avg reuse':24s}{emp.avg_reuse:16.2f}{model.avg_reuse:16.2f}"
                 f"{model_full.avg_reuse:16.2f}{syn.TARGET_NUM_INDICES / syn.TARGET_NUM_UNIQUE:16.2f}")
    print("\n".join(rows_))
    for title, attr, target in (
        ("Histogram of col sizes (share of unique rows per reuse bin)", "row_histogram",
         syn.TARGET_ROW_HISTOGRAM),
        ("Ratio of index distribution (share of accesses per reuse bin)", "access_histogram",
         syn.TARGET_ACCESS_HISTOGRAM),
    ):
        print(f"\n{title}")
        print(f"{'bin':16s}{'empirical':>11s}{'model@scale':>13s}{'model@full':>12s}{'published':>11s}")
        for k in range(17):
            print(f"{BIN_NAMES[k]:16s}{getattr(emp, attr)[k]:11.3f}{getattr(model, attr)[k]:13.3f}"
                  f"{getattr(model_full, attr)[k]:12.3f}{target[k]:11.3f}")
    print("\ndistances")
    _report("empirical vs model@scale", emp, model.row_histogram, model.access_histogram)
    _report("model@full vs published ", model_full, syn.TARGET_ROW_HISTOGRAM, syn.TARGET_ACCESS_HISTOGRAM)
    if full:
        _report("EMPIRICAL (full scale) vs published", emp, syn.TARGET_ROW_HISTOGRAM,
                syn.TARGET_ACCESS_HISTOGRAM)
        print(f"  unique rows: empirical / published = {emp.num_unique / syn.TARGET_NUM_UNIQUE:.4f}; "
              f"indices: empirical / published = {emp.num_indices / syn.TARGET_NUM_INDICES:.4f}")
    else:
        print("  (not full scale: the empirical numbers are compared to the model's expectation at "
              "this scale, the published ones only through the model at full scale)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
