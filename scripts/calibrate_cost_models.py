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

`--terms` also fits one scale per kind of compute work (`compute_terms`: lookups, bytes read,
bags, output, rows and bytes touched, pieces), each group of samples with its own offset, so
only how the kinds weigh against each other is fitted; the compute scale is then fitted on top.
`--plans DIR ...` takes the device shards of plans that `shard.py evaluate=measured` measured
(its out_dir: report.json, plans/, config.yaml's task_file) as compute samples, one group per
task (each task's plans are measured in one call, interleaved); `--terms-only` writes the
kinds of work alone, leaving the models' level to the speed probe (a checkpoint with kinds
only is calibrated again as an uncalibrated one, keeping its kinds unless `--terms` refits them):
    python scripts/calibrate_cost_models.py --terms-only --plans experiments/val/runs/20-30x2 \\
        --out experiments/val/cost_models_terms.pt

Prints the scales and the error on the calibration samples before and after (with `--plans`,
also the spread of measured / predicted across one plan's devices, which sets its measured
imbalance). Errors are one line and exit 2; the output is written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from embshard.costs.collect import PROFILE, read_profile
from embshard.costs.neural import (MODEL_KEYS, ComputeSample, NeuralCostModels, fit_calibration, fit_term_scales,
                                   load_comm_samples, load_compute_samples)
from embshard.costs.pretrain import regression_metrics
from embshard.errors import EmbshardError, InputError
from embshard.io import atomic_path
from embshard.report import measured_plan_devices
from embshard.stats import centred_within
from embshard.task import load_tasks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/cpu_fbgemm/cost_models.pt")
    ap.add_argument("--data", help="a folder with compute.jsonl (and comm.jsonl) from train.py stage=collect")
    ap.add_argument("--plans", nargs="+", default=[], metavar="DIR",
                    help="out_dirs of shard.py evaluate=measured: their plans' device shards as compute samples")
    ap.add_argument("--terms", action="store_true", help="also fit one scale per kind of compute work")
    ap.add_argument("--terms-only", action="store_true",
                    help="fit the kinds of work only; the three models' scales stay 1 (the machine's speed is the probe's)")
    ap.add_argument("--out", required=True, help="the calibrated checkpoint to write")
    args = ap.parse_args(argv)
    try:
        if not args.data and not args.plans:
            raise InputError("give --data (a collection) or --plans (measured shard.py runs), or both")
        data = Path(args.data) if args.data else None
        models = NeuralCostModels.load(args.checkpoint)
        before = models.calibration or {}
        if any(float(before.get(k, 1.0)) != 1.0 for k in MODEL_KEYS):
            raise InputError(f"{args.checkpoint}: already calibrated ({ {k: before.get(k, 1.0) for k in MODEL_KEYS} }); "
                             "calibrate the uncalibrated checkpoint")
        compute, comm, groups = [], [], []
        if data is not None:
            compute = load_compute_samples(data / "compute.jsonl")
            comm = load_comm_samples(data / "comm.jsonl") if (data / "comm.jsonl").is_file() else []
            groups = [f"probe:{s.probe}" for s in compute]  # one measuring session each
        plan_groups: list[list[int]] = []
        for d in args.plans:
            samples, task_of = measured_plan_samples(Path(d))
            first = len(compute)
            compute += samples
            groups += [f"{d}:{t}" for t, _ in task_of]
            by_plan: dict[tuple[str, str], list[int]] = {}
            for i, key in enumerate(task_of):
                by_plan.setdefault(key, []).append(first + i)
            plan_groups += list(by_plan.values())
        if len(compute) < 8:
            raise InputError(f"{len(compute)} compute samples, need at least 8 to calibrate")
        bundle = torch.load(models.source, map_location="cpu", weights_only=True)
        # kinds of work the checkpoint already carries stay unless fitted again (from the raw nets)
        terms = fit_term_scales(models, compute, groups) if args.terms or args.terms_only else before.get("compute_terms")
        fitted = NeuralCostModels({**bundle, "calibration": {"compute_terms": terms}}, source=models.source) if terms else models
        cal = fit_calibration(fitted, compute, comm)
        if args.terms_only:
            cal.update({k: 1.0 for k in models.scale})
        if terms:
            cal["compute_terms"] = terms
        bundle["calibration"] = {**cal, "data": str(data) if data else None, "plans": list(args.plans),
                                 "checkpoint": str(args.checkpoint),
                                 "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                 "profile": read_profile(data, require_hardware=False) if data and (data / PROFILE).is_file() else {}}
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
        line = (f"compute {name:6s} n={r['n']}  MAPE {r['mape_pct']:.1f}%  Kendall tau {r['kendall_tau']:.3f}  "
                f"median predicted/measured {np.median(pred / measured):.2f}")
        if plan_groups:
            line += f"  across a plan's devices: sd of log(measured/predicted) {within_plan_sd(measured, pred, plan_groups):.3f}"
        print(line)
    print("scales (measured / predicted): " + ", ".join(f"{k} {cal[k]:.3f} (n={cal['samples'][k]})" for k in models.scale))
    if terms:
        print("kinds of work: " + ", ".join(f"{k} {v:.3f}" for k, v in terms.items()))
    print(f"wrote {out}")
    return 0


def measured_plan_samples(out_dir: Path) -> tuple[list[ComputeSample], list[tuple[str, str]]]:
    """Every measured device shard of the valid plans in a shard.py out_dir, as a compute
    sample, with (task, algorithm) of each."""
    import yaml

    report, config = out_dir / "report.json", out_dir / "config.yaml"
    for f in (report, config):
        if not f.is_file():
            raise InputError(f"{out_dir}: no {f.name}; give the out_dir of a shard.py evaluate=measured run")
    try:
        task_file = (yaml.safe_load(config.read_text()) or {}).get("task_file")
    except yaml.YAMLError as e:
        raise InputError(f"{config}: unreadable ({type(e).__name__})") from None
    if not task_file:
        raise InputError(f"{config}: no task_file")
    tasks = {t.name: t for t in load_tasks(task_file)}

    def task_of(name: str):
        if name not in tasks:
            raise InputError(f"{report}: task {name!r} is not in {task_file}")
        return tasks[name]

    samples, keys = [], []
    try:
        for r, task, pieces_of, measured in measured_plan_devices(out_dir, task_of, require_plans=True):
            if r["measured_device_costs"].get("source") != "kernels":
                continue
            for pieces, ms in zip(pieces_of, measured):
                if pieces and ms > 0:
                    samples.append(ComputeSample(list(pieces), task.batch_size, float(ms), origin=r["algorithm"]))
                    keys.append((r["task"], r["algorithm"]))
    except json.JSONDecodeError as e:
        raise InputError(f"{report}: unreadable ({type(e).__name__})") from None
    if not samples:
        raise InputError(f"{report}: no plan measured device by device (evaluate=measured with the kernel hardware)")
    return samples, keys


def within_plan_sd(measured: np.ndarray, pred: np.ndarray, groups: list[list[int]]) -> float:
    """sd of log(measured / predicted) about each plan's own mean, over its devices."""
    multi = [g for g in groups if len(g) > 1]
    if not multi:
        return float("nan")
    return float(centred_within(np.log(measured / pred), multi)[np.concatenate(multi)].std())


if __name__ == "__main__":
    sys.exit(main())
