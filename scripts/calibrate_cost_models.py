"""Calibrate pre-trained cost models to this machine as it measures now.

A cost-data collection measured while other jobs shared the machine is slower by a roughly
constant factor than the same machine alone: the models then rank shards well but are off
in absolute ms. This fits one scale per model (median measured / predicted) on a few fresh
measurements and writes a copy of the checkpoint with a `calibration` entry
(`embshard.costs.neural`); the models and their envelope are unchanged.

Example (about 3 minutes of measuring here; `make calibrate` runs both steps):
    python train.py stage=collect collect=calibrate out_dir=experiments/calibrate
    python scripts/calibrate_cost_models.py --checkpoint checkpoints/cpu_fbgemm/cost_models.pt \\
        --data experiments/calibrate --out experiments/calibrate/cost_models.pt
    python shard.py task_file=... searchers.neuroshard.checkpoint=experiments/calibrate/cost_models.pt \\
        cost_model.path=experiments/calibrate/cost_models.pt

Prints the scales and the error on the calibration samples before and after. Errors are one
line and exit 2; the output is written atomically.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from embshard.costs.collect import PROFILE, read_profile
from embshard.costs.neural import NeuralCostModels, fit_calibration, load_comm_samples, load_compute_samples
from embshard.costs.pretrain import regression_metrics
from embshard.errors import EmbshardError, InputError
from embshard.io import atomic_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/cpu_fbgemm/cost_models.pt")
    ap.add_argument("--data", required=True, help="a folder with compute.jsonl (and comm.jsonl) from train.py stage=collect")
    ap.add_argument("--out", required=True, help="the calibrated checkpoint to write")
    args = ap.parse_args(argv)
    try:
        data = Path(args.data)
        models = NeuralCostModels.load(args.checkpoint)
        if models.calibration:
            raise InputError(f"{args.checkpoint}: already calibrated ({ {k: models.calibration[k] for k in models.scale} }); "
                             "calibrate the uncalibrated checkpoint")
        compute = load_compute_samples(data / "compute.jsonl")
        comm = load_comm_samples(data / "comm.jsonl") if (data / "comm.jsonl").is_file() else []
        if len(compute) < 8:
            raise InputError(f"{data / 'compute.jsonl'}: {len(compute)} compute samples, need at least 8 to calibrate")
        cal = fit_calibration(models, compute, comm)
        bundle = torch.load(models.source, map_location="cpu", weights_only=True)
        bundle["calibration"] = {**cal, "data": str(data), "checkpoint": str(args.checkpoint),
                                 "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                 "profile": read_profile(data, require_hardware=False) if (data / PROFILE).is_file() else {}}
        out = Path(args.out)
        with atomic_path(out) as tmp:
            torch.save(bundle, tmp)
        calibrated = NeuralCostModels.load(out)
    except EmbshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    measured = np.array([s.ms for s in compute])
    for name, m in (("before", models), ("after", calibrated)):
        pred = np.array([m.at_batch(s.batch_size).compute_ms([s.tables])[0] for s in compute])
        r = regression_metrics(measured, pred)
        print(f"compute {name:6s} n={r['n']}  MAPE {r['mape_pct']:.1f}%  Kendall tau {r['kendall_tau']:.3f}  "
              f"median predicted/measured {np.median(pred / measured):.2f}")
    print("scales (measured / predicted): " + ", ".join(f"{k} {cal[k]:.3f} (n={cal['samples'][k]})" for k in models.scale))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
