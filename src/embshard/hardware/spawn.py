"""One group of measuring ranks: spawn D processes, collect one message from each, clean up.

Communication (`hardware.comm`) and DistributedModelParallel's embedding step
(`hardware.dmp_step`) both time work that needs D real processes meeting in collectives. Each
rank puts one `("ok", rank, body)` or `("error", rank, traceback)` on the queue it is given.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
from typing import Any, Callable


def run_ranks(target: Callable[..., None], world: int, make_args: Callable[[int, str, Any], tuple],
              timeout_s: float, what: str) -> dict[int, Any]:
    """Run `target(*make_args(rank, store_path, results))` in `world` spawned processes and
    return every rank's body.

    Args:
        make_args: a rank's arguments, given its rank, the path of a FileStore the group can
            rendezvous through (in a temporary folder removed afterwards) and the results queue.
        what: names the measurement in errors ("comm", "DMP step").

    Raises:
        RuntimeError: a rank reported an error (its traceback in the message) or died silently.
        TimeoutError: not every rank reported within `timeout_s`.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="embshard-ranks-")
    results: queue.Queue = ctx.Queue()
    procs = []
    try:
        for rank in range(world):
            p = ctx.Process(target=target, args=make_args(rank, os.path.join(tmp, "store"), results), daemon=True)
            p.start()
            procs.append(p)
        per_rank: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(per_rank) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} measurement on {world} ranks took longer than {timeout_s:.0f} s")
            try:
                kind, rank, body = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if not dead:
                    continue
                try:  # give a dying rank's error message a moment to arrive before reporting
                    kind, rank, body = results.get(timeout=2.0)
                except queue.Empty:
                    raise RuntimeError(f"{what} worker exited with code {dead[0].exitcode} and no message") from None
            if kind == "error":
                raise RuntimeError(f"{what} worker rank {rank} failed:\n{body}")
            per_rank[rank] = body
        for p in procs:
            p.join(timeout=60)
        return per_rank
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)
