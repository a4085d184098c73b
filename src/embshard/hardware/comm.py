"""The all-to-all of pooled embeddings, timed between real torch.distributed processes.

The global batch B is split evenly over the D ranks (sample share b_p for rank p). In the
forward all-to-all rank r sends every peer p the pooled embeddings of its own shards for
p's samples, b_p × width_r floats, and receives b_r × width_p from each peer; the backward
is the reverse (each rank gets back the gradient of its own width).

Compute imbalance is part of the measurement: before the forward all-to-all every rank
waits its own delay (its compute time, less the smallest one), then enters; its forward
comm time runs from its entry until the all-to-all returns, so a fast rank's time includes
waiting for the slowest. The backward all-to-all starts from a barrier.

One process group is spawned for a whole batch of configurations; all of them are measured
inside, interleaved per repetition (A B C A B C ...), so machine drift hits all alike. On gloo
and loopback the group is kept for the next call of the same ranks, cores and protocol
(`KeptRanks`): a measured evaluation's rounds then pay a rank's start (seconds, mostly importing
torch) once, not per round. The
ranks follow the measurement protocol (`hardware.protocol`): rank r pinned to core r mod n of
the cores the caller was allowed, one thread, the caching allocator, the protocol's comm
warm-ups and repetitions; the timer is the wall clock (an all-to-all's cost is waiting and
moving bytes, not one thread's CPU time). On an emulated cluster (`hardware.cluster`) each rank
first enters its host's network namespace (rank // devices per host), so ranks of different
hosts meet over the shaped link.
"""

from __future__ import annotations

import atexit
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from embshard.hardware.protocol import MeasurementProtocol, allowed_cores
from embshard.hardware.spawn import RankGroup, run_ranks

if TYPE_CHECKING:
    from embshard.hardware.cluster import EmulatedCluster

#: Bytes per float sent (pooled embeddings and their gradients are fp32).
BYTES_PER_FLOAT = 4


@dataclass(frozen=True)
class CommConfig:
    """One all-to-all to time: per-rank embedding widths and per-rank delays before entry;
    `allreduce_floats` > 0 adds, after the backward all-to-all and timed with it, the all-reduce
    of that many fp32 gradient values on every rank (data-parallel tables' gradients, as DDP
    syncs them in TorchRec's data_parallel)."""

    widths: tuple[int, ...]
    delays_ms: tuple[float, ...]
    allreduce_floats: int = 0

    @classmethod
    def make(cls, widths: Sequence[int], delays_ms: Sequence[float] | None = None,
             allreduce_floats: int = 0) -> "CommConfig":
        widths = tuple(int(w) for w in widths)
        delays = tuple(float(x) for x in (delays_ms if delays_ms is not None else [0.0] * len(widths)))
        if len(delays) != len(widths):
            raise ValueError(f"{len(widths)} widths but {len(delays)} delays")
        if any(w < 0 for w in widths) or any(not np.isfinite(d) or d < 0 for d in delays):
            raise ValueError("widths and delays must be non-negative")
        if int(allreduce_floats) < 0:
            raise ValueError("allreduce_floats must be non-negative")
        return cls(widths, delays, int(allreduce_floats))


@dataclass
class CommResult:
    """Per-rank forward/backward comm time (median and spread, ms) of one configuration."""

    forward_ms: list[float]
    backward_ms: list[float]
    forward_spread_ms: list[float]
    backward_spread_ms: list[float]
    #: raw samples, [rank][repetition]
    forward_samples_ms: list[list[float]]
    backward_samples_ms: list[list[float]]
    #: per rank, the relative half-width of the bootstrap 95% interval of the median
    forward_noise: list[float] = field(default_factory=list)
    backward_noise: list[float] = field(default_factory=list)

    @classmethod
    def zero(cls, num_devices: int, repetitions: int = 0) -> "CommResult":
        z = [0.0] * num_devices
        s = [[0.0] * repetitions for _ in range(num_devices)]
        return cls(list(z), list(z), list(z), list(z), s, [list(x) for x in s])


def batch_split(batch_size: int, num_ranks: int) -> list[int]:
    """Samples per rank: the global batch split as evenly as integers allow."""
    base, extra = divmod(batch_size, num_ranks)
    return [base + (1 if r < extra else 0) for r in range(num_ranks)]


def measure_comm(
    configs: Sequence[CommConfig | tuple[Sequence[int], Sequence[float]]],
    batch_size: int,
    protocol: MeasurementProtocol | None = None,
    backend: str = "gloo",
    timeout_s: float | None = None,
    progress: bool = False,
    cores: Sequence[int] | None = None,
    cluster: "EmulatedCluster | None" = None,
    devices_per_host: int | None = None,
    keep: bool | None = None,
) -> list[CommResult]:
    """Time the forward and backward all-to-all of every configuration on real processes.

    Args:
        configs: CommConfig or (per-rank widths, per-rank delays in ms) pairs; all must have
            the same number of ranks D.
        batch_size: the global batch B.
        protocol: how to time (default `MeasurementProtocol()`): `comm_warmups` untimed rounds
            over all configs, then `comm_repetitions` timed rounds, each measuring every
            config once, in order; pinning and allocator of the ranks.
        backend: "gloo" (CPU tensors) or "nccl" (one CUDA device per rank).
        timeout_s: give up (kill the processes, raise TimeoutError) after this long;
            default scales with the work.
        progress: a tqdm bar over timed rounds (reported by rank 0).
        cores: the cores the ranks are pinned over (default: the caller's allowed set).
        cluster, devices_per_host: an emulated cluster that is up; rank r runs in host
            r // devices_per_host (None: every rank on this machine's loopback).
        keep: leave the ranks up for the next call with the same ranks, backend, cores and
            protocol (`KeptRanks`: a measured evaluation's every round then spawns them once,
            not once per round); None: keep them for gloo on this machine's loopback (not for
            nccl, nor on an emulated cluster, whose namespaces may go between calls).

    Returns:
        One CommResult per config. D = 1 gives zeros without spawning anything.
    """
    protocol = protocol or MeasurementProtocol()
    warmups, repetitions = protocol.comm_warmups, protocol.comm_repetitions
    cores = list(cores) if cores is not None else allowed_cores(idlest_first=True)
    cfgs = [c if isinstance(c, CommConfig) else CommConfig.make(*c) for c in configs]
    if not cfgs:
        return []
    d = len(cfgs[0].widths)
    if any(len(c.widths) != d for c in cfgs):
        raise ValueError("all comm configs must have the same number of ranks")
    if d == 1:
        return [CommResult.zero(1, repetitions) for _ in cfgs]
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < d:
            raise RuntimeError(f"nccl comm on {d} ranks needs {d} GPUs, found {torch.cuda.device_count()}")
    if timeout_s is None:
        rounds = warmups + repetitions
        per_round = sum(max(c.delays_ms) / 1e3 + 0.05 + 2e-9 * (batch_size * sum(c.widths) + d * c.allreduce_floats)
                        for c in cfgs)
        timeout_s = 120 + 10 * d + 4 * rounds * per_round * max(1, d / (os.cpu_count() or 1))

    payload = [(c.widths, c.delays_ms, c.allreduce_floats) for c in cfgs]
    if keep is None:
        keep = backend == "gloo" and cluster is None
    if keep:
        per_rank = KeptRanks.get(d, backend, cores, protocol, timeout_s).run(payload, batch_size, progress, timeout_s)
    else:
        def rank_args(rank: int, store: str, results: Any) -> tuple:
            where = None
            if cluster is not None:  # each emulated host's ranks inside its namespace
                host = rank // int(devices_per_host or d)
                where = (cluster.namespaces[host], cluster.interface(host))
            return (rank, d, store, backend, payload, batch_size, protocol.to_dict(), cores, results, progress,
                    float(timeout_s), where)

        per_rank = run_ranks(_worker, d, rank_args, timeout_s, "comm")

    out = []
    for k in range(len(cfgs)):
        fw = [per_rank[r][0][k] for r in range(d)]
        bw = [per_rank[r][1][k] for r in range(d)]
        tf = [protocol.summarize([[v] for v in x]) for x in fw]
        tb = [protocol.summarize([[v] for v in x]) for x in bw]
        out.append(
            CommResult(
                forward_ms=[t.median_ms for t in tf],
                backward_ms=[t.median_ms for t in tb],
                forward_spread_ms=[t.spread_ms for t in tf],
                backward_spread_ms=[t.spread_ms for t in tb],
                forward_samples_ms=fw,
                backward_samples_ms=bw,
                forward_noise=[t.noise for t in tf],
                backward_noise=[t.noise for t in tb],
            )
        )
    return out


def _sleep_until(t_end: float) -> None:
    """Sleep (not spin: ranks may outnumber cores) until perf_counter() reaches t_end."""
    while True:
        left = t_end - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left if left > 2e-3 else left / 2)


def _worker(rank, world, store_path, backend, payload, batch_size, protocol_dict, cores, results,
            progress, timeout_s, where=None) -> None:
    """One rank of a one-call group: join, measure `payload`, report, leave."""
    try:
        protocol = MeasurementProtocol.from_config(protocol_dict)
        dev = _join(rank, world, store_path, backend, protocol, cores, timeout_s, where)
        body = _measure(rank, world, dev, payload, batch_size, protocol, progress)
        _leave()
        results.put(("ok", rank, body))
    except BaseException:  # noqa: BLE001 - report everything to the parent, then die
        results.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1)


def _kept_worker(rank, world, store_path, backend, protocol_dict, cores, jobs, results, timeout_s) -> None:
    """One rank of a kept group: join once, then measure every job from `jobs` (payload, batch,
    progress; the protocol is the group's, part of what keeps it) and report it, until None, or until the parent is gone (killed without
    closing the group: a rank never outlives it waiting for work)."""
    import queue

    parent = os.getppid()
    try:
        protocol = MeasurementProtocol.from_config(protocol_dict)
        dev = _join(rank, world, store_path, backend, protocol, cores, timeout_s, None)
        while True:
            try:
                job = jobs.get(timeout=2.0)
            except queue.Empty:
                if os.getppid() != parent:
                    os._exit(0)
                continue
            if job is None:
                break
            payload, batch_size, progress = job
            body = _measure(rank, world, dev, payload, batch_size, protocol, progress)
            results.put(("ok", rank, body))
        _leave()
    except BaseException:  # noqa: BLE001 - report everything to the parent, then die
        results.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1)


def _join(rank, world, store_path, backend, protocol: MeasurementProtocol, cores, timeout_s, where):
    """Enter the namespace (if any), pin and set up the process by the protocol, join the
    process group; returns the rank's device."""
    import datetime

    if where is not None:  # before any socket or thread: they inherit the namespace
        from embshard.hardware.cluster import enter_namespace

        enter_namespace(where[0])
        os.environ["GLOO_SOCKET_IFNAME"] = where[1]

    import torch
    import torch.distributed as dist

    from embshard.hardware.protocol import set_worker_process

    set_worker_process(protocol, rank, cores, threads=1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu")
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dev


def _leave() -> None:
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _measure(rank, world, dev, payload, batch_size, protocol: MeasurementProtocol, progress):
    """(forward ms, backward ms) of this rank, [config][repetition], every config of `payload`
    measured once per round, interleaved, after the protocol's warm-up rounds."""
    import torch
    import torch.distributed as dist

    warmups, repetitions = protocol.comm_warmups, protocol.comm_repetitions

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    split = batch_split(batch_size, world)
    # one buffer per role, as big as the biggest config needs; each config uses views of
    # them (a rank holds one config's worth of memory, not the sum over all configs)
    plans = []
    for widths, delays, *rest in payload:
        w_me = widths[rank]
        # forward: send b_p × w_me to each p, receive b_me × w_p from each p
        f_in = [split[p] * w_me for p in range(world)]
        f_out = [split[rank] * widths[p] for p in range(world)]
        plans.append((f_in, f_out, delays[rank] / 1e3, int(rest[0]) if rest else 0))
    n_in = max(sum(p[0]) for p in plans)
    n_out = max(sum(p[1]) for p in plans)
    send, g_recv = torch.ones(n_in, device=dev), torch.empty(n_in, device=dev)
    recv, g_send = torch.empty(n_out, device=dev), torch.ones(n_out, device=dev)
    grads = torch.zeros(max(p[3] for p in plans), device=dev)  # data-parallel gradients (zeros: sums stay finite)
    # backward: the reverse, then the data-parallel all-reduce
    bufs = [(send[: sum(f_in)], recv[: sum(f_out)], f_in, f_out, g_send[: sum(f_out)], g_recv[: sum(f_in)], delay,
             grads[:n_ar]) for f_in, f_out, delay, n_ar in plans]

    fw = [[] for _ in payload]
    bw = [[] for _ in payload]
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=warmups + repetitions, desc=f"all-to-all x{world}", leave=False)
    for it in range(warmups + repetitions):
        for k, (send, recv, f_in, f_out, g_send, g_recv, delay, grad) in enumerate(bufs):
            sync()
            dist.barrier()
            t_start = time.perf_counter()
            _sleep_until(t_start + delay)
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send, output_split_sizes=f_out, input_split_sizes=f_in)
            sync()
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            dist.all_to_all_single(g_recv, g_send, output_split_sizes=f_in, input_split_sizes=f_out)
            if grad.numel():
                dist.all_reduce(grad)
            sync()
            t3 = time.perf_counter()
            if it >= warmups:
                fw[k].append((t1 - t0) * 1e3)
                bw[k].append((t3 - t2) * 1e3)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    dist.barrier()
    return fw, bw


class KeptRanks:
    """A group of comm ranks left up between `measure_comm` calls of the same ranks, backend,
    set of cores and protocol: spawned, pinned (by the core order of the call that started it)
    and joined once (a rank's start, mostly importing torch, takes
    seconds: a measured evaluation otherwise pays it every round of every plan set), then one
    job per call. One group at most is kept: a call that needs another closes it first, so idle
    ranks never pile up (a collection over many device counts). A group whose ranks failed or
    timed out is closed, never reused; the kept one is closed at exit (`close_kept`)."""

    _current: "KeptRanks | None" = None

    def __init__(self, key: tuple, world: int, backend: str, cores: Sequence[int], protocol: MeasurementProtocol,
                 timeout_s: float):
        import torch.multiprocessing as mp

        self.key = key
        self.jobs = [mp.get_context("spawn").Queue() for _ in range(world)]  # one per rank

        def rank_args(rank: int, store: str, results: Any) -> tuple:
            return (rank, world, store, backend, protocol.to_dict(), list(cores), self.jobs[rank], results,
                    float(timeout_s))

        self.group = RankGroup(_kept_worker, world, rank_args, "comm")

    @classmethod
    def get(cls, world: int, backend: str, cores: Sequence[int], protocol: MeasurementProtocol,
            timeout_s: float) -> "KeptRanks":
        """The kept group for these ranks (started, replacing any other, when there is none)."""
        # the cores as a set: `allowed_cores(idlest_first=True)` reorders them call by call on an
        # idle machine, and a kept group stays pinned as it was started
        key = (world, backend, tuple(sorted(cores)), tuple(sorted(protocol.to_dict().items())))
        kept = cls._current
        if kept is not None and (kept.key != key or not kept.group.alive()):
            close_kept()
            kept = None
        if kept is None:
            kept = cls._current = KeptRanks(key, world, backend, cores, protocol, timeout_s)
        return kept

    def run(self, payload, batch_size: int, progress: bool, timeout_s: float) -> dict[int, Any]:
        """Every rank's (forward, backward) samples of one job, measured under the group's
        protocol; the group is closed on any error."""
        try:
            for q in self.jobs:
                q.put((payload, batch_size, progress))
            return self.group.collect(timeout_s)
        except BaseException:
            close_kept()
            raise

    def close(self) -> None:
        for q in self.jobs:
            try:
                q.put(None)
            except (OSError, ValueError):  # a queue already closed
                pass
        self.group.close(grace_s=5.0)
        for q in self.jobs:
            q.close()


def close_kept() -> None:
    """Stop the kept comm ranks, if any (also run at interpreter exit)."""
    kept, KeptRanks._current = KeptRanks._current, None
    if kept is not None:
        kept.close()


atexit.register(close_kept)
