"""Run one trial of a W&B sweep YAML without a W&B server (offline).

The command is built the way `wandb agent` builds it (wandb's own `create_sweep_command`
and `create_sweep_command_args`: `${env} ${interpreter} ${program} ${args_no_hyphens}`,
`${envvar:NAME}`), for one configuration drawn from the sweep's `parameters`.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from embshard.errors import InputError


def sample_parameters(sweep: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """One value per parameter: `value`, a random one of `values`, or a uniform draw in [min, max]."""
    rng = random.Random(seed)
    out = {}
    for name, spec in (sweep.get("parameters") or {}).items():
        if "value" in spec:
            out[name] = spec["value"]
        elif "values" in spec:
            out[name] = rng.choice(spec["values"])
        elif "min" in spec and "max" in spec:
            lo, hi = spec["min"], spec["max"]
            out[name] = rng.randint(lo, hi) if isinstance(lo, int) and isinstance(hi, int) else rng.uniform(lo, hi)
        else:
            raise InputError(f"sweep parameter {name!r}: needs value, values or min/max")
    return out


def trial_command(sweep_file: str | os.PathLike, params: dict[str, Any], extra: list[str] | None = None) -> list[str]:
    """The argv `wandb agent` would run for `params` (interpreter: this Python)."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args

    sweep = yaml.safe_load(Path(sweep_file).read_text())
    macros = create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    macros.update(env=["/usr/bin/env"], interpreter=[sys.executable], program=[sweep["program"]])
    argv: list[str] = []
    for chunk in create_sweep_command(list(sweep.get("command") or ["${env}", "${interpreter}", "${program}", "${args}"])):
        chunk = str(chunk)
        if chunk.startswith("${") and chunk.endswith("}"):
            argv += [str(x) for x in macros.get(chunk[2:-1], [])]
        else:
            argv.append(chunk)
    return argv + list(extra or [])


def run_trial(sweep_file: str | os.PathLike, seed: int = 0, extra: list[str] | None = None,
              cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Draw one configuration and run it with W&B offline; returns the finished process."""
    path = Path(sweep_file)
    if not path.is_file():
        raise InputError(f"{path}: no such sweep file")
    sweep = yaml.safe_load(path.read_text())
    argv = trial_command(path, sample_parameters(sweep, seed), extra)
    env = dict(os.environ, WANDB_MODE="offline")
    return subprocess.run(argv, cwd=cwd or path.resolve().parents[1], env=env, text=True, capture_output=True)
