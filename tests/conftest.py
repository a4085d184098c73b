"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def heavy_task(seed: int, index: int):
    """Task `index` of `scripts/heavy_tasks.py --seed <seed>` (the script's draws, in its order)."""
    import importlib.util

    import numpy as np

    spec = importlib.util.spec_from_file_location("heavy_tasks", ROOT / "scripts" / "heavy_tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = np.random.default_rng(seed)
    for i in range(index + 1):
        task = mod.heavy_task(rng, f"heavy-{seed}-{i:03d}")
    return task


@pytest.fixture
def refused_in_process():
    """An entry point's run under its one-line error handler, in this process, for refusals that
    come before any work (a subprocess would only add its imports of torch): call it with the
    overrides (`entry="shard"` for shard.py; train.py by default); it returns the exit status and
    the non-empty stderr lines (`tests/_entry.py`'s run, which puts back cwd, environment and
    threads). Each entry point's own process is still checked by
    tests/test_no_silent_fallbacks.py, the subprocess runs of test_shard_cli and test_stages, and
    train.py's torchrun runs in test_dlrm."""
    def run(*overrides: str, entry: str = "train") -> tuple[int, list[str]]:
        from _entry import run_entry

        done = run_entry(entry, *overrides)
        return done.returncode, [line for line in done.stderr.splitlines() if line.strip()]

    return run


@pytest.fixture(scope="session")
def shard_help() -> str:
    """`python shard.py --help` from shard.py's own process: run once for the tests that read it
    (test_honest_runs, test_no_silent_fallbacks)."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(ROOT / "shard.py"), "--help"], cwd=ROOT,
                          env=dict(os.environ, WANDB_MODE="offline"), capture_output=True, text=True, timeout=120,
                          check=True).stdout


def pytest_collection_modifyitems(config, items):
    """Tests marked slow (real processes, kernel timings) run first, so no long one is left to
    end the run on one core while the other waits. With `make test`'s `--dist worksteal` the
    worker given them runs them one after another while the other runs the fast ones and then
    takes what is still pending (one multi-process test at a time, not two on 2 cores). The
    order among the slow ones and among the rest is the files' own."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
