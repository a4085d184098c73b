"""The rank processes of the multi-process tests (tests/_dmp_worker.py, _planner_worker.py,
_flexshard_worker.py), started warm: each rank is still its own process running the worker
script as `__main__` with its own argv, environment, output and gloo process group, but it is
forked from a server (multiprocessing's forkserver) that imported torch, TorchRec and the
modules the workers use once, before any of them ran, instead of a fresh interpreter that
imports them again: about 5 s of CPU a rank on the 2-core machine of docs/development.md.
The server only imports (no intra-op thread pool or process group has started in it), so a rank
starts as a fresh one would after its imports. One server per pytest process, started by the
first call and stopped when that process exits. test_measurement's pinning and allocator
checks start their worker functions from the same server (`context()`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

# what the worker scripts import at the top or in their run (imported once, in the server)
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed._shard.sharded_tensor",
    "torchrec", "torchrec.distributed.model_parallel", "torchrec.distributed.embeddingbag",
    "torchrec.distributed.embedding", "torchrec.distributed.planner", "torchrec.models.dlrm",
    "torchrec.optim.apply_optimizer_in_backward", "torchrec.sparse.jagged_tensor",
    "embshard", "embshard.torchrec_bridge", "embshard.search.torchrec_planner", "embshard.hardware.comm",
    "dlrm.sequence_embedding",
]


_STOP_REGISTERED = False


def context():
    """The multiprocessing context whose processes are forked from the warm server (for a test's
    own targets: a fresh process without a fresh interpreter's imports)."""
    global _STOP_REGISTERED
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    if not _STOP_REGISTERED:  # stop the server and wait for it when this process exits (no stray process left)
        import atexit
        from multiprocessing import forkserver

        atexit.register(getattr(forkserver._forkserver, "_stop", lambda: None))
        _STOP_REGISTERED = True
    return ctx


def _rank(script: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the forked rank: `python script *argv` with env as its environment, in cwd, its stdout
    and stderr into log."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONWARNINGS") == "ignore":
        import warnings

        warnings.simplefilter("ignore")
    os.chdir(cwd)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))  # as `python script` puts it first
    import runpy

    runpy.run_path(script, run_name="__main__")
    sys.stdout.flush()
    sys.stderr.flush()


def run_ranks(script: Path, argvs: Sequence[Sequence[str]], log_dir: Path, env: Mapping[str, str] | None = None,
              cwd: Path | None = None, timeout: float = 180) -> list[tuple[int | None, str]]:
    """Run `python script *argv` once per argv in argvs, all at once; wait for every one (killing
    the rest at `timeout` seconds); (exit code, output) per rank, in order. A rank that raises
    exits 1 with its traceback in its output, as the script's own process would."""
    import time

    ctx = context()
    env = dict(os.environ if env is None else env)
    procs, logs = [], []
    for i, argv in enumerate(argvs):
        log = Path(log_dir) / f"rank_output_{i}.log"
        p = ctx.Process(target=_rank, args=(str(script), [str(a) for a in argv], env, str(cwd or os.getcwd()), str(log)))
        p.start()
        procs.append(p)
        logs.append(log)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [(p.exitcode, log.read_text() if log.exists() else "") for p, log in zip(procs, logs)]
