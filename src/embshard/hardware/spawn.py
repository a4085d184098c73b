"""Groups of measuring ranks: spawn D processes, collect one message from each (per job, for a
group that stays up: `RankGroup`), clean up.

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
    group = RankGroup(target, world, make_args, what)
    try:
        per_rank = group.collect(timeout_s)
        for p in group.procs:
            p.join(timeout=60)
        return per_rank
    finally:
        group.close()


class RankGroup:
    """`world` spawned processes running `target(*make_args(rank, store_path, results))`, and
    the queue they answer on; `collect` takes one message from each rank. A group whose ranks
    answer job after job (`embshard.hardware.comm`'s kept ranks) is collected once per job."""

    def __init__(self, target: Callable[..., None], world: int, make_args: Callable[[int, str, Any], tuple], what: str):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world, self.what = world, what
        self.tmp = tempfile.mkdtemp(prefix="embshard-ranks-")
        self.results: queue.Queue = ctx.Queue()
        self.procs: list = []
        try:
            for rank in range(world):
                p = ctx.Process(target=target, args=make_args(rank, os.path.join(self.tmp, "store"), self.results),
                                daemon=True)
                p.start()
                self.procs.append(p)
        except BaseException:
            self.close()
            raise

    def collect(self, timeout_s: float) -> dict[int, Any]:
        """Every rank's next body; RuntimeError where a rank reported an error or died silently,
        TimeoutError where not every rank reported within `timeout_s`."""
        per_rank: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(per_rank) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.what} measurement on {self.world} ranks took longer than {timeout_s:.0f} s")
            try:
                kind, rank, body = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in self.procs if p.exitcode not in (None, 0)]
                if not dead:
                    continue
                try:  # give a dying rank's error message a moment to arrive before reporting
                    kind, rank, body = self.results.get(timeout=2.0)
                except queue.Empty:
                    raise RuntimeError(f"{self.what} worker exited with code {dead[0].exitcode} and no message") from None
            if kind == "error":
                raise RuntimeError(f"{self.what} worker rank {rank} failed:\n{body}")
            per_rank[rank] = body
        return per_rank

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, grace_s: float = 0.0) -> None:
        """Stop the ranks (those still running after `grace_s` seconds are terminated, then
        killed) and remove the rendezvous folder."""
        for p in self.procs:
            if grace_s > 0:
                p.join(timeout=grace_s)
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.results.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
