"""Every sweep YAML builds a valid command, and one cost-model sweep trial runs offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from embshard.sweeps import run_trial, sample_parameters, trial_command

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = sorted((ROOT / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("path", SWEEPS, ids=[p.name for p in SWEEPS])
def test_sweep_builds_the_agent_command(path):
    sweep = yaml.safe_load(path.read_text())
    params = sample_parameters(sweep, seed=1)
    argv = trial_command(path, params)
    assert argv[:2] == ["/usr/bin/env", sys.executable] and sweep["program"] in argv
    program_args = argv[argv.index(sweep["program"]) + 1:]
    for name, value in params.items():
        assert f"{name}={value}" in program_args
    assert not any(a.startswith("--") for a in program_args)  # Hydra overrides, no hyphens


@pytest.mark.slow
@pytest.mark.e2e
def test_one_cost_model_trial_runs_offline(tmp_path, monkeypatch):
    """A real collection, then one trial of sweeps/cost_models.yaml on it (about a minute: in
    `make test-e2e`). `make test` covers its parts: the collector on real kernels
    (test_collect), pre-training judged on the collector's held-out tables (test_pretrain_split),
    this sweep file's agent command (test_sweep_builds_the_agent_command) and a trial run offline
    end to end (test_rl_cli's RL sweep trial)."""
    env = dict(os.environ, WANDB_MODE="offline")
    data = tmp_path / "costdata"
    collect = subprocess.run(
        [sys.executable, "train.py", "stage=collect", "collect=tiny", "measure=quick", f"dataset.path={tmp_path / 'syn.pt'}",
         "dataset.num_tables=24", "dataset.batch_size=256", f"out_dir={data}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert collect.returncode == 0, collect.stderr
    monkeypatch.setenv("EMBSHARD_COST_DATA", str(data))
    out = tmp_path / "trial"
    proc = run_trial(ROOT / "sweeps" / "cost_models.yaml", seed=0,
                     extra=["cost_model.pretrain.max_epochs=3", "cost_model.pretrain.holdout_num_devices=null",
                            f"out_dir={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert "compute" in metrics["metrics"] and (out / "cost_models.pt").is_file()
    assert list((out / "wandb").glob("offline-run-*"))
