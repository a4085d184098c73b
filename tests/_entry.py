"""An entry point's run (train.py or shard.py) in the test's own process, for runs whose process
boundary is not what the test checks: a subprocess would first spend seconds of CPU importing
torch, TorchRec and Lightning. The config is composed as the entry point composes it
(conf/<entry>.yaml with the overrides), `run` is called under the same one-line error handler
as `main`, and what the process would leave behind is put back: the working directory, the
environment, torch's thread count, comm ranks kept up for the next measurement. Each entry point's own process is still run by other tests
(shard.py: test_shard_cli's contract, infeasible and bad-input tests; train.py: the torchrun
tests of test_dlrm, test_cluster, --help and misspelt-key tests)."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import subprocess
from pathlib import Path
from typing import Mapping

ROOT = Path(__file__).resolve().parents[1]


def run_entry(entry: str, *overrides: str, cwd: Path | None = None,
              env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python <entry>.py *overrides` in this process: its exit status (0, or what it exited
    with), stdout and stderr, as subprocess.run(capture_output=True, text=True) gives them. An
    exception that is not a user error propagates (the subprocess would print its traceback)."""
    import torch
    from hydra import compose, initialize_config_dir

    from embshard.cli import one_line_errors

    module = importlib.import_module(entry)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name=entry, overrides=list(overrides))
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd, saved_threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    code = 0
    try:
        os.environ.update(env or {})
        os.chdir(cwd or ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                one_line_errors(module.run, cfg)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        import sys

        if "embshard.hardware.comm" in sys.modules:  # comm ranks kept up by a measured run: closed at exit
            sys.modules["embshard.hardware.comm"].close_kept()
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(saved_threads)
    return subprocess.CompletedProcess([f"{entry}.py", *overrides], code, out.getvalue(), err.getvalue())
