"""The machine speed probe: a few fixed kernels and one all-to-all, timed in seconds.

Every measuring session (a cost-data collection, a refine round, a measured `shard.py` run,
a throughput run) times the probe first and stores it beside what it measured. Two probes of
the same backend say how much faster or slower the machine measures now than then, per
kind of cost (`Probe.speed_vs`): compute from the kernels (geometric mean of their ratios),
communication from the all-to-all. A checkpoint trained on costs measured beside probe A
and used beside probe B rescales its predictions by B / A (`costs.neural.NeuralCostModels.
rescale_to`): a faster, slower or busier machine than the one the data came from.

The probe kernels are chosen to span what a shard is: a small cache-resident table with many
lookups, a large table (hundreds of MB, random rows), and a wide one. Their tables are fixed
(names, rows, dims, pooling factors) and their batches drawn from fixed seeds, so every
probe times the same work under the protocol it is given.
"""

from __future__ import annotations

import math
import platform
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from embshard.errors import InputError
from embshard.hardware.protocol import MeasurementProtocol

PROBE_VERSION = 1
#: (name, rows, dim, pooling factor, batch): the probe's kernels, one table each.
PROBE_KERNELS: tuple[tuple[str, int, int, float, int], ...] = (
    ("probe_cache", 20_000, 64, 24.0, 4096),
    ("probe_memory", 2_000_000, 64, 8.0, 8192),
    ("probe_wide", 100_000, 256, 4.0, 4096),
)
#: A GPU runs the CPU-sized probe kernels in a fraction of a millisecond, where launch overhead
#: and timer resolution dominate: on CUDA the probe's batches are this much larger.
CUDA_BATCH_FACTOR = 16
#: The probe's all-to-all: per-rank widths at this global batch (no compute delays).
PROBE_COMM_WIDTHS = (128, 128)
PROBE_COMM_BATCH = 16384
#: Scale keys, as the cost models name them.
SCALE_KEYS = ("compute", "forward_comm", "backward_comm")


@dataclass(frozen=True)
class Probe:
    """One timing of the probe: per kernel ms, all-to-all ms, and where and how it was taken."""

    compute_ms: dict[str, float]
    comm_ms: float | None
    noise: dict[str, float] = field(default_factory=dict)
    backend: str = "fbgemm"
    device: str = "cpu"
    comm_backend: str | None = "gloo"
    protocol: str = ""
    host: str = ""
    created: str = ""
    seconds: float = 0.0
    version: int = PROBE_VERSION

    @property
    def probe_id(self) -> str:
        """A short name: host and time."""
        return f"{self.host}@{self.created}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "probe") -> "Probe":
        if not isinstance(d, Mapping):
            raise InputError(f"{source}: a probe must be a mapping, got {type(d).__name__}")
        try:
            version = int(d.get("version", PROBE_VERSION))
            if version != PROBE_VERSION:
                raise InputError(f"{source}: probe version {version}, expected {PROBE_VERSION}")
            compute = {str(k): float(v) for k, v in dict(d["compute_ms"]).items()}
            comm = None if d.get("comm_ms") is None else float(d["comm_ms"])
        except InputError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{source}: not a probe ({type(e).__name__}: {e})") from None
        if not compute or any(not math.isfinite(v) or v <= 0 for v in compute.values()):
            raise InputError(f"{source}: probe compute times must be positive, got {compute}")
        if comm is not None and (not math.isfinite(comm) or comm <= 0):
            raise InputError(f"{source}: probe comm time must be positive, got {comm}")
        keep = {k: d[k] for k in ("backend", "device", "comm_backend", "protocol", "host", "created", "seconds") if k in d}
        return cls(compute_ms=compute, comm_ms=comm, noise={str(k): float(v) for k, v in dict(d.get("noise") or {}).items()},
                   version=version, **keep)

    def speed_vs(self, reference: "Probe") -> dict[str, float]:
        """How much longer the same work takes beside this probe than beside `reference`, per
        cost model: compute (geometric mean over the kernels both timed), forward and backward
        comm (the all-to-all; 1.0 when either probe has none)."""
        if self.backend != reference.backend or str(self.device).split(":")[0] != str(reference.device).split(":")[0]:
            raise InputError(f"probes of different hardware cannot be compared: {self.backend}/{self.device} "
                             f"vs {reference.backend}/{reference.device}")
        common = sorted(set(self.compute_ms) & set(reference.compute_ms))
        if not common:
            raise InputError("the two probes share no kernel")
        compute = math.exp(sum(math.log(self.compute_ms[k] / reference.compute_ms[k]) for k in common) / len(common))
        comm = 1.0
        if self.comm_ms is not None and reference.comm_ms is not None:
            comm = self.comm_ms / reference.comm_ms
        return {"compute": compute, "forward_comm": comm, "backward_comm": comm}


def probe_tables() -> list[Any]:
    """The probe's tables (one per kernel)."""
    from embshard.tables import Table

    return [Table(name=name, rows=rows, dim=dim, pooling_factor=pf) for name, rows, dim, pf, _ in PROBE_KERNELS]


def _probe_sets(device: str) -> tuple[list[Any], list[list[Any]], list[int], list[int]]:
    """(tables, shard sets, batch sizes, item seeds) of the probe's kernels on `device`."""
    from embshard.hardware.backends import ShardInput
    from embshard.plan import Shard

    tables = probe_tables()
    sets = [[ShardInput(t, Shard(t.name, 0, 0, t.dim, 0, t.rows))] for t in tables]
    factor = CUDA_BATCH_FACTOR if str(device).startswith("cuda") else 1
    return tables, sets, [b * factor for *_, b in PROBE_KERNELS], [9000 + k for k in range(len(sets))]


def measure_compute_with_probe(shard_sets: Sequence[Sequence[Any]], batch_size: int | Sequence[int],
                               backend: str = "fbgemm", device: str = "cpu", optimizer: str | Sequence[str] = "sgd",
                               protocol: MeasurementProtocol | None = None, seed: int = 0,
                               session: Probe | None = None, **kw: Any) -> tuple[list[Any], Probe]:
    """`hardware.compute.measure_compute` with the probe's kernels visited in every round too,
    as control items: the machine's speed *while these kernels ran* (a session's speed drifts
    by several percent over minutes, more than one probe at its start can follow). Returns the
    sets' timings and that tracked probe (its all-to-all taken from `session`, the session's
    start probe, when given)."""
    from embshard.hardware.compute import measure_compute

    protocol = protocol or MeasurementProtocol()
    tables, probe_sets, probe_batches, probe_seeds = _probe_sets(device)
    n = len(shard_sets)
    batches = [int(batch_size)] * n if isinstance(batch_size, (int, np.integer)) else [int(b) for b in batch_size]
    items = list(kw.pop("item_seeds", None) or range(n))
    t0 = time.perf_counter()
    # the probe's kernels always update with SGD, whatever the sets use: probes compare across runs
    optimizers = [optimizer] * n if isinstance(optimizer, str) else list(optimizer)
    timings = measure_compute(list(shard_sets) + probe_sets, batches + probe_batches, backend=backend, device=device,
                              optimizer=optimizers + ["sgd"] * len(probe_sets), protocol=protocol, seed=seed,
                              item_seeds=items + probe_seeds, **kw)
    mine, control = timings[:n], timings[n:]
    probe = Probe(compute_ms={t.name: tm.median_ms for t, tm in zip(tables, control)},
                  comm_ms=session.comm_ms if session is not None else None,
                  noise={t.name: tm.noise for t, tm in zip(tables, control)}, backend=backend, device=str(device),
                  comm_backend=session.comm_backend if session is not None else None,
                  protocol=f"{protocol.name}, tracked", host=socket.gethostname() or platform.node(),
                  created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  seconds=round(time.perf_counter() - t0, 2))
    return mine, probe


def run_probe(protocol: MeasurementProtocol | None = None, backend: str = "fbgemm", device: str = "cpu",
              comm_backend: str | None = "gloo", seed: int = 0) -> Probe:
    """Time the probe under `protocol` (at least 3 visits, so its noise can be estimated)."""
    from embshard.hardware.compute import measure_compute

    protocol = protocol or MeasurementProtocol()
    probe_protocol = protocol.replace(visits=max(3, protocol.visits), probe=False)
    t0 = time.perf_counter()
    tables, sets, batches, seeds = _probe_sets(device)
    timings = measure_compute(sets, batches, backend=backend, device=device, protocol=probe_protocol,
                              seed=seed, item_seeds=seeds)
    compute = {t.name: tm.median_ms for t, tm in zip(tables, timings)}
    noise = {t.name: tm.noise for t, tm in zip(tables, timings)}
    comm_ms = None
    if comm_backend is not None and _comm_possible(comm_backend, len(PROBE_COMM_WIDTHS)):
        from embshard.hardware.comm import measure_comm

        [r] = measure_comm([(list(PROBE_COMM_WIDTHS), None)], PROBE_COMM_BATCH, protocol=probe_protocol,
                           backend=comm_backend)
        per_rep = [f + b for f, b in zip(r.forward_samples_ms[0], r.backward_samples_ms[0])]
        tm = probe_protocol.summarize([[x] for x in per_rep])
        comm_ms, noise["all_to_all"] = tm.median_ms, tm.noise
    return Probe(compute_ms=compute, comm_ms=comm_ms, noise=noise, backend=backend, device=str(device),
                 comm_backend=comm_backend if comm_ms is not None else None, protocol=protocol.name,
                 host=socket.gethostname() or platform.node(),
                 created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 seconds=round(time.perf_counter() - t0, 2))


def _comm_possible(comm_backend: str, ranks: int) -> bool:
    if comm_backend == "nccl":
        import torch

        return torch.cuda.device_count() >= ranks
    return True


def rescale_summary(reference: Probe | None, current: Probe | None) -> dict[str, Any]:
    """What report.json says about rescaling: the two probes and the scales (or why none)."""
    if current is None:
        return {"applied": False, "reason": "no probe in this session (measure.probe=false or nothing measured)"}
    if reference is None:
        return {"applied": False, "reason": "the checkpoint records no probe", "probe": current.to_dict()}
    try:
        scales = current.speed_vs(reference)
    except InputError as e:
        return {"applied": False, "reason": f"not rescaled: {e}", "reference": reference.to_dict(),
                "probe": current.to_dict()}
    return {"applied": True, "scales": scales, "reference": reference.to_dict(), "probe": current.to_dict()}


_CURRENT: Probe | None = None


def current_probe() -> Probe | None:
    """The probe of the measuring session this process is in (`use_probe`), if any: cost
    models loaded while it is set rescale themselves to it."""
    return _CURRENT


@contextmanager
def use_probe(probe: Probe | None) -> Iterator[Probe | None]:
    """Make `probe` the session's probe while the block runs (None: no rescaling)."""
    global _CURRENT
    old, _CURRENT = _CURRENT, probe
    try:
        yield probe
    finally:
        _CURRENT = old


def median_probe(probes: Sequence[Probe]) -> Probe:
    """The probe whose compute speed is the median of `probes` (the reference of a dataset
    measured over several sessions)."""
    if not probes:
        raise InputError("no probes")
    base = probes[0]
    ranked = sorted(probes, key=lambda p: p.speed_vs(base)["compute"])
    return ranked[len(ranked) // 2]
