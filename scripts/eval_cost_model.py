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
from embshard.costs.collect import load_samples
from embshard.costs.neural import NeuralCostModels
from embshard.costs.pretrain import regression_metrics
from embshard.plan import Shard
from embshard.tables import Table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/cpu_fbgemm/cost_models.pt")
    ap.add_argument("--data", required=True, help="a compute.jsonl written by train.py stage=collect")
    args = ap.parse_args()
    models = NeuralCostModels.load(args.checkpoint)
    samples = load_samples(args.data, kind="compute")
    shards = [
        [Table(f"x{i}", t["rows"], t["dim"], t["pooling_factor"], t["reuse_histogram"], t["bytes_per_element"])
         for i, t in enumerate(s["tables"])]
        for s in samples
    ]
    measured = np.array([s["median_ms"] for s in samples])
    batch = samples[0]["batch_size"]
    neural = models.compute_ms(shards) * models.batch_ratio(batch)
    analytic = AnalyticCostModel()
    estimated = np.array([analytic.compute_ms([(t, Shard.whole(t, 0)) for t in s], batch) for s in shards])
    for name, pred in (("neural", neural), ("analytic", estimated)):
        m = regression_metrics(measured, pred)
        print(f"{name:9s} n={m['n']}  RMSE {m['rmse_ms']:.3f} ms  MAPE {m['mape_pct']:.1f}%  "
              f"R2 {m['r2']:.3f}  Kendall tau {m['kendall_tau']:.3f}")


if __name__ == "__main__":
    main()
