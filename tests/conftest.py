"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def refused_in_process(capsys):
    """train.py's run under its one-line error handler, in this process, for refusals that come
    before any work (a subprocess would only add its imports of torch): call it with train.py's
    overrides; it returns the exit status and the non-empty stderr lines."""
    def run(*overrides: str) -> tuple[int, list[str]]:
        import train
        from hydra import compose, initialize_config_dir

        from embshard.cli import one_line_errors

        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(overrides))
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            one_line_errors(train.run, cfg)
        return done.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]

    return run
