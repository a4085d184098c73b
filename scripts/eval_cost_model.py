"""Score a compute cost model on measured shards it never saw (a benchmark, not a test).

Example:
    .venv/bin/python scripts/eval_cost_model.py --checkpoint checkpoints/cpu_fbgemm/cost_models.pt \\
        --data experiments/neuroshard_cpu/costdata/compute.jsonl

Prints RMSE, MAPE, R² and Kendall τ of the neural compute model and of the analytic model
on every shard of a collected compute.jsonl (for example one from another table pool), or with
`--subset validation|test` on the shards `cost_model.pretrain.val_by=split` puts there (the
collector's held-out tables cut into validation and test tables; the folder's profile.json
says which were held out), so two checkpoints can be compared on validation tables:

    .venv/bin/python scripts/eval_cost_model.py --checkpoint A/cost_models.pt \
        --data experiments/costdata_broad/compute.jsonl --subset validation
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from embshard.costs.analytic import AnalyticCostModel
from embshard.costs.neural import NeuralCostModels, load_compute_samples
from embshard.costs.pretrain import regression_metrics
from embshard.plan import Shard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/cpu_fbgemm/cost_models.pt")
    ap.add_argument("--data", required=True, help="a compute.jsonl written by train.py stage=collect")
    ap.add_argument("--subset", choices=("validation", "test"), default=None,
                    help="only the shards val_by=split puts in this split (default: every shard)")
    ap.add_argument("--seed", type=int, default=0, help="cost_model.pretrain.seed (the coin for shards of generated "
                                                         "tables only)")
    args = ap.parse_args()
    models = NeuralCostModels.load(args.checkpoint)
    samples = load_compute_samples(args.data)
    if args.subset:
        from embshard.costs.collect import read_profile
        from embshard.costs.pretrain import split_by_pool

        profile = read_profile(Path(args.data).parent, require_hardware=False)
        _, _, idx = split_by_pool(samples, profile, args.seed)
        samples = [samples[i] for i in idx["val" if args.subset == "validation" else "test"]]
    measured = np.array([s.ms for s in samples])
    neural = np.array([models.at_batch(s.batch_size).compute_ms([s.tables])[0] for s in samples])
    analytic = AnalyticCostModel()
    estimated = np.array([analytic.compute_ms([(t, Shard.whole(t, 0)) for t in s.tables], s.batch_size) for s in samples])
    for name, pred in (("neural", neural), ("analytic", estimated)):
        m = regression_metrics(measured, pred)
        print(f"{name:9s} n={m['n']}  RMSE {m['rmse_ms']:.3f} ms  MAPE {m['mape_pct']:.1f}%  "
              f"R2 {m['r2']:.3f}  Kendall tau {m['kendall_tau']:.3f}")


if __name__ == "__main__":
    main()
