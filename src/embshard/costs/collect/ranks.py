"""torchrun helpers: this process's rank, which rank owns a chunk, waiting for the others."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from embshard.errors import InputError

if TYPE_CHECKING:
    from embshard.costs.collect.run import Collected

log = logging.getLogger("embshard.costs.collect")

def env_int(name: str, default: int) -> int:
    """An integer from the environment (torchrun's RANK, WORLD_SIZE, ...), `default` if unset."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise InputError(f"environment variable {name}={v!r} is not an integer") from None


def rank_info(rank: int | None = None, world_size: int | None = None) -> tuple[int, int, int]:
    """(rank, world size, local rank): arguments, else torchrun's environment, else (0, 1, 0)."""
    r = env_int("RANK", 0) if rank is None else int(rank)
    w = env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
    lr = env_int("LOCAL_RANK", r)
    if w < 1 or not 0 <= r < w:
        raise InputError(f"rank {r} is not in a world of size {w}")
    return r, w, lr


def chunk_owner(kind: str, chunk: int, world_size: int, rank0_only_comm: bool) -> int:
    if kind == "comm" and rank0_only_comm:
        return 0
    return chunk % world_size


def wait_for_ranks(got: Collected, timeout_hours: float = 168.0) -> None:
    """Block until every rank of a torchrun launch has finished collecting (a no-op for one
    rank), so that rank 0 can then `merge`. Uses a short-lived gloo group on torchrun's
    MASTER_ADDR / MASTER_PORT; the comm measurements' own groups use private file stores,
    so they never clash with it."""
    if got.world_size <= 1:
        return
    import datetime

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        return
    if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        raise InputError(f"rank {got.rank} of {got.world_size}: no MASTER_ADDR/MASTER_PORT to wait for the other "
                         "ranks (launch with torchrun, or run merge yourself when all ranks are done)")
    dist.init_process_group("gloo", rank=got.rank, world_size=got.world_size,
                            timeout=datetime.timedelta(hours=timeout_hours))
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
