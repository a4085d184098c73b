"""Score a compute cost model on measured shards it never saw (a benchmark, not a test).

Example:
    .venv/bin/python scripts/eval_cost_model.py --checkpoint checkpoints/cpu_fbgemm/cost_models.pt \\
        --data experiments/neuroshard_cpu/costdata/compute.jsonl

Prints RMSE, MAPE, R² and Kendall τ of the neural compute model and of the analytic model
on every shard of a collected compute.jsonl (for example one from another table pool).
"""

from __future__ import annotations

import argparse

import numpy as np

from embshard.costs.analytic import AnalyticCostModel
from embshard.costs.neural import NeuralCostModels, load_compute_samples
from embshard.costs.pretrain import regression_metrics
from embshard.plan import Shard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/cpu_fbgemm/cost_models.pt")
    ap.add_argument("--data", required=True, help="a compute.jsonl written by train.py stage=collect")
    args = ap.parse_args()
    models = NeuralCostModels.load(args.checkpoint)
    samples = load_compute_samples(args.data)
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
