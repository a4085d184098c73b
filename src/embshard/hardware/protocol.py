"""The one measurement protocol: how every kernel, all-to-all and training step is timed.

Compute (`hardware.compute`), communication (`hardware.comm`), the speed probe
(`hardware.probe`) and end-to-end training (`dlrm.runner`) all take a `MeasurementProtocol`
(Hydra group `measure/`) instead of their own warm-ups, repetitions, threads and timers:

* **pinning** (`pin`): every measuring process runs on its own cores of the cores it was
  allowed at the start (`os.sched_getaffinity`), so the scheduler never moves it mid-kernel;
  process k of a group gets `threads` consecutive cores from core k × threads (mod n) of the
  allowed cores ordered idlest first (over the last 0.2 s), so a measurement does not start
  beside a busy process.
* **threads** (`threads`): a fixed intra-op thread count while timing, recorded with the data.
* **timer** (`timer`): what counts the work. `thread_cpu` (CPU time of the measuring thread:
  a single-threaded CPU kernel runs entirely on the calling thread, so time the OS gave to
  anything else is not counted); `wall` (all-to-alls, whose cost is waiting; multi-threaded
  kernels); `cuda_events` (GPU). `auto` picks thread_cpu on CPU with one thread, wall with
  more, cuda_events on CUDA.
* **allocator** (`malloc`): `cache` keeps freed memory in the process (glibc: no mmap, no
  trim), so a step reuses the pages of the last one instead of faulting in fresh ones from
  the kernel. Per-step page faults were up to half of a step's time here and moved with the
  machine's memory state; a GPU's caching allocator does the same thing.
* **schedule**: `visits` interleaved visits per item (A B C A B C ...), each visit first
  reading the item's weights (`touch`: the measured state is "weights resident", as in a
  GPU's memory), then `warmups` untimed steps, then `repetitions` timed steps on distinct
  batches. With `fresh_inputs` false every visit replays the same batches (drawn from the
  item's seed), so visits, and sessions, time the same work.
* **statistic**: `median` of all samples, or `median_of_visits` (median over visits of the
  visit's mean); with every measurement a noise figure: the half-width of a bootstrap 95%
  interval of the statistic (resampling visits), relative to it.
* **probe** (`probe`): a short fixed set of kernels and one all-to-all timed at the start
  of each measuring session (`hardware.probe`), stored with what was measured.

`legacy` (conf/measure/legacy.yaml) is the protocol before this one (unpinned, wall clock,
default allocator, fresh batches, one visit); the drift test compares them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from embshard.errors import InputError

TIMERS = ("auto", "thread_cpu", "wall", "cuda_events")
STATISTICS = ("median", "median_of_visits")
MALLOCS = ("cache", "default")
PINS = ("auto", "none")

# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_GLIBC_DEFAULT_TRIM, _GLIBC_DEFAULT_MMAP_MAX = 128 * 1024, 65536


@dataclass(frozen=True)
class MeasurementProtocol:
    """How to time: pinning, threads, timer, allocator, schedule, statistic, probe.

    Args:
        name: a label recorded with every measurement.
        pin: "auto" (each measuring process on its own core), "none", or a list of core ids
            to use instead of the allowed set.
        threads: torch intra-op threads while timing kernels (null: leave torch's setting).
        timer: auto | thread_cpu | wall | cuda_events.
        malloc: cache | default (see the module docstring).
        touch: read an item's weights at the start of each visit.
        warmups: untimed steps per visit.
        repetitions: timed steps per visit.
        visits: interleaved visits per item.
        fresh_inputs: draw new batches at every visit (false: replay the same ones).
        statistic: median | median_of_visits.
        comm_warmups, comm_repetitions: untimed / timed rounds of each all-to-all.
        probe: time the speed probe at the start of each measuring session.
    """

    name: str = "pinned"
    pin: str | tuple[int, ...] = "auto"
    threads: int | None = 1
    timer: str = "auto"
    malloc: str = "cache"
    touch: bool = True
    warmups: int = 1
    repetitions: int = 3
    visits: int = 5
    fresh_inputs: bool = False
    statistic: str = "median"
    comm_warmups: int = 2
    comm_repetitions: int = 10
    probe: bool = True

    def __post_init__(self) -> None:
        where = f"measure ({self.name})"
        if isinstance(self.pin, str):
            if self.pin not in PINS:
                raise InputError(f"{where}: pin must be one of {PINS} or a list of core ids, got {self.pin!r}")
        else:
            cores = tuple(self.pin)
            if not cores or any(not _is_int(c) or c < 0 for c in cores):
                raise InputError(f"{where}: pin must be a non-empty list of core ids, got {self.pin!r}")
            object.__setattr__(self, "pin", tuple(int(c) for c in cores))
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            raise InputError(f"{where}: threads must be a positive integer or null, got {self.threads!r}")
        for key, allowed in (("timer", TIMERS), ("statistic", STATISTICS), ("malloc", MALLOCS)):
            if getattr(self, key) not in allowed:
                raise InputError(f"{where}: {key} must be one of {allowed}, got {getattr(self, key)!r}")
        if self.pin != "none" and self.threads is None:
            raise InputError(f"{where}: a pinned process needs a fixed thread count (threads: null would start one "
                             "thread per core of the machine on the cores it is pinned to); set threads or pin=none")
        if self.timer == "thread_cpu" and self.threads != 1:
            raise InputError(f"{where}: timer=thread_cpu counts one thread's CPU time; it needs threads=1 "
                             f"(got {self.threads!r}); use timer=wall for multi-threaded kernels")
        for key, low in (("warmups", 0), ("repetitions", 1), ("visits", 1), ("comm_warmups", 0),
                         ("comm_repetitions", 1)):
            v = getattr(self, key)
            if not _is_int(v) or v < low:
                raise InputError(f"{where}: {key} must be an integer >= {low}, got {v!r}")
        for key in ("touch", "fresh_inputs", "probe"):
            if not isinstance(getattr(self, key), bool):
                raise InputError(f"{where}: {key} must be true or false, got {getattr(self, key)!r}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: "MeasurementProtocol | Mapping[str, Any] | None") -> "MeasurementProtocol":
        """A protocol from a Hydra node or dict (unknown keys are an error); None: the default."""
        if cfg is None:
            return cls()
        if isinstance(cfg, cls):
            return cfg
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(cfg, DictConfig):
                cfg = OmegaConf.to_container(cfg, resolve=True)
        except ImportError:  # pragma: no cover
            pass
        if not isinstance(cfg, Mapping):
            raise InputError(f"measure: expected a mapping, got {type(cfg).__name__}")
        known = {f.name for f in fields(cls)}
        body = {k: v for k, v in cfg.items() if k != "_target_"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise InputError(f"measure: unknown setting(s) {unknown}; known: {', '.join(sorted(known))}")
        if isinstance(body.get("pin"), list):
            body["pin"] = tuple(body["pin"])
        return cls(**body)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if isinstance(self.pin, tuple):
            d["pin"] = list(self.pin)
        return d

    def replace(self, **changes: Any) -> "MeasurementProtocol":
        return MeasurementProtocol(**(asdict(self) | changes))

    # ------------------------------------------------------------------ timers
    def timer_for(self, device: str | Any = "cpu", threads: int | None = None) -> str:
        """The timer this protocol uses for kernels on `device` (resolves `auto`)."""
        cuda = str(device).startswith("cuda")
        if self.timer != "auto":
            if self.timer == "cuda_events" and not cuda:
                raise InputError("measure.timer=cuda_events needs a CUDA device")
            return self.timer
        if cuda:
            return "cuda_events"
        n = self.threads if threads is None else threads
        return "thread_cpu" if n == 1 else "wall"

    def visit_inputs(self, visit: int) -> int:
        """The input set a visit replays (0 unless `fresh_inputs`)."""
        return visit if self.fresh_inputs else 0

    # ------------------------------------------------------------------ statistic
    def summarize(self, visits: Sequence[Sequence[float]], seed: int = 0) -> "Timing":
        """The statistic, spread and noise of samples grouped by visit ([visit][repetition], ms)."""
        return Timing.of_visits(visits, self.statistic, seed=seed)


def load_protocol(name_or_path: str) -> MeasurementProtocol:
    """A protocol from conf/measure/<name>.yaml (or a path), its `defaults` chain resolved,
    without Hydra: the files are flat `key: value` lines, so scripts that run where only torch
    is installed (a GPU machine) read the same protocols as the Hydra entry points."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "conf" / "measure"

    def read(ref: str) -> dict[str, Any]:
        path = Path(ref) if ref.endswith(".yaml") else root / f"{ref}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in root.glob("*.yaml"))
            raise InputError(f"no measurement protocol {ref!r} (conf/measure/: {', '.join(known)})")
        body = _flat_yaml(path.read_text())
        out: dict[str, Any] = {}
        for d in body.pop("defaults", []) or []:
            if d != "_self_":
                out |= read(d)
        return out | body

    return MeasurementProtocol.from_config(read(name_or_path))


def _flat_yaml(text: str) -> dict[str, Any]:
    import json

    out: dict[str, Any] = {}
    key = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if line.startswith("  - ") and key == "defaults":
            out["defaults"].append(line[4:].strip())
            continue
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "defaults":
            out["defaults"] = []
            continue
        out[key] = json.loads(value) if value and value[0] in "[0123456789-" else {
            "true": True, "false": False, "null": None}.get(value, value)
    return out


# ----------------------------------------------------------------------------- the result
@dataclass(frozen=True)
class Timing:
    """One measured quantity (ms): the protocol's statistic, spread and noise.

    `median_ms` is the statistic (the median of all samples, or the median of the visits'
    means); `spread_ms` the interquartile range of all samples; `noise` the half-width of a
    bootstrap 95% interval of the statistic (visits resampled, or samples when there is one
    visit), relative to the statistic (0.02 = ±2%).
    """

    median_ms: float
    spread_ms: float
    samples_ms: tuple[float, ...] = field(default=(), repr=False)
    noise: float = 0.0
    visits: int = 1

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> "Timing":
        """Median and IQR of one flat list of samples (one visit)."""
        return cls.of_visits([list(samples_ms)] if len(samples_ms) else [], "median")

    @classmethod
    def of_visits(cls, visits: Sequence[Sequence[float]], statistic: str = "median", seed: int = 0) -> "Timing":
        groups = [np.asarray(v, dtype=np.float64) for v in visits if len(v)]
        if not groups:
            return cls(0.0, 0.0, (), 0.0, 0)
        flat = np.concatenate(groups)
        q1, q3 = np.percentile(flat, [25, 75])
        value = _statistic(groups, statistic)
        noise = _bootstrap_noise(groups, statistic, value, seed)
        return cls(float(value), float(q3 - q1), tuple(float(x) for x in flat), float(noise), len(groups))


def _statistic(groups: Sequence[np.ndarray], statistic: str) -> float:
    if statistic == "median_of_visits":
        return float(np.median([g.mean() for g in groups]))
    return float(np.median(np.concatenate(groups)))


def _bootstrap_noise(groups: Sequence[np.ndarray], statistic: str, value: float, seed: int,
                     draws: int = 200) -> float:
    """Relative half-width of the bootstrap 95% interval of the statistic."""
    if value <= 0:
        return 0.0
    rng = np.random.default_rng(seed)
    if len(groups) >= 3:
        idx = rng.integers(0, len(groups), size=(draws, len(groups)))
        stats = [_statistic([groups[i] for i in row], statistic) for row in idx]
    else:
        flat = np.concatenate(groups)
        if len(flat) < 3:
            return 0.0
        stats = np.median(flat[rng.integers(0, len(flat), size=(draws, len(flat)))], axis=1)
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float((hi - lo) / 2.0 / value)


# ----------------------------------------------------------------------------- processes
def allowed_cores(idlest_first: bool = False, window_s: float = 0.2) -> list[int]:
    """The cores this process may run on now (all of them where affinity is not supported).

    `idlest_first`: ordered by how busy each was over the last `window_s` seconds (from
    /proc/stat; the idlest first, ties by number), so measuring processes land on the cores
    that other work leaves free rather than beside it."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = list(range(os.cpu_count() or 1))
    if not idlest_first or len(cores) < 2:
        return cores
    first = _core_times()
    time.sleep(window_s)
    last = _core_times()
    if not first or not last:
        return cores

    def busy(c: int) -> float:
        (b0, t0), (b1, t1) = first.get(c, (0, 0)), last.get(c, (0, 0))
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    return sorted(cores, key=lambda c: (round(busy(c), 2), c))


def _core_times() -> dict[int, tuple[int, int]]:
    """Per core (busy jiffies, total jiffies) from /proc/stat ({} where it cannot be read)."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3:4].isdigit():
                    name, *vals = line.split()
                    v = [int(x) for x in vals]
                    idle = v[3] + (v[4] if len(v) > 4 else 0)
                    out[int(name[3:])] = (sum(v) - idle, sum(v))
    except OSError:
        return {}
    return out


def cores_for(protocol: MeasurementProtocol, index: int, cores: Sequence[int] | None = None) -> list[int] | None:
    """The cores measuring process `index` of a group runs on (None: not pinned): `threads`
    consecutive cores of the pool (one when threads is 1), process by process, wrapping around."""
    if protocol.pin == "none":
        return None
    pool = list(protocol.pin) if isinstance(protocol.pin, tuple) else list(cores if cores is not None else allowed_cores())
    width = min(len(pool), protocol.threads or 1)
    start = (index * width) % len(pool)
    return sorted({int(pool[(start + j) % len(pool)]) for j in range(width)})


def _pin(cores: list[int] | None) -> None:
    if cores is None:
        return
    try:
        os.sched_setaffinity(0, set(cores))
    except (AttributeError, OSError) as e:
        raise InputError(f"measure.pin: cannot pin to cores {cores} ({e}); set measure.pin=none") from None


@dataclass
class ProcessSettings:
    """What `measuring_process` set, to record with the measurement."""

    cores: list[int] | None
    threads: int | None
    malloc: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextmanager
def measuring_process(protocol: MeasurementProtocol, index: int = 0, cores: Sequence[int] | None = None,
                      threads: int | None | str = "protocol") -> Iterator[ProcessSettings]:
    """Pin this process, fix torch's threads and the allocator for a measurement; restore after.

    Args:
        index: this process's number in its group (its cores are `cores_for(protocol, index)`).
        cores: the cores the group may use (default: this process's allowed set now).
        threads: override the protocol's thread count ("protocol": use it).
    """
    import torch

    n_threads = protocol.threads if threads == "protocol" else threads
    if cores is None and protocol.pin == "auto":
        cores = allowed_cores(idlest_first=True)
    pinned = cores_for(protocol, index, cores)
    old_affinity = os.sched_getaffinity(0) if pinned is not None else None
    old_threads = torch.get_num_threads()
    # threads first: a thread pool created while pinned keeps that affinity for good
    if n_threads is not None:
        torch.set_num_threads(int(n_threads))
    _pin(pinned)
    malloc = "default"
    if protocol.malloc == "cache":
        malloc = "cache" if _set_malloc_cache(True) else "default (mallopt unavailable)"
    try:
        yield ProcessSettings(pinned, n_threads, malloc)
    finally:
        if malloc == "cache":
            _set_malloc_cache(False)
        if old_affinity is not None:
            os.sched_setaffinity(0, old_affinity)
        if n_threads is not None:
            torch.set_num_threads(old_threads)


def set_worker_process(protocol: MeasurementProtocol, index: int, cores: Sequence[int] | None,
                       threads: int | None | str = "protocol") -> ProcessSettings:
    """The settings of `measuring_process` for a spawned worker that measures until it exits
    (nothing to restore)."""
    import torch

    n_threads = protocol.threads if threads == "protocol" else threads
    if n_threads is not None:
        torch.set_num_threads(int(n_threads))
    pinned = cores_for(protocol.replace(threads=n_threads), index, cores)
    _pin(pinned)
    malloc = "default"
    if protocol.malloc == "cache":
        malloc = "cache" if _set_malloc_cache(True) else "default (mallopt unavailable)"
    return ProcessSettings(pinned, n_threads, malloc)


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        try:
            name = ctypes.util.find_library("c") or "libc.so.6"
            lib = ctypes.CDLL(name)
            lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            lib.mallopt.restype = ctypes.c_int
            lib.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC = lib
        except (OSError, AttributeError):  # not glibc
            _LIBC = False
    return _LIBC


def _set_malloc_cache(on: bool) -> bool:
    """glibc: keep freed memory (no mmap, no trim) when `on`; back to glibc's defaults and
    return the kept memory to the OS when not. False where mallopt is not available."""
    lib = _libc()
    if not lib:
        return False
    if on:
        return bool(lib.mallopt(_M_MMAP_MAX, 0)) and bool(lib.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    lib.mallopt(_M_MMAP_MAX, _GLIBC_DEFAULT_MMAP_MAX)
    lib.mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT_TRIM)
    lib.malloc_trim(0)
    return True


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with `n` torch intra-op threads (None: leave the setting alone); restore after."""
    import torch

    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------- timers
class Stopwatch:
    """Times one call with the protocol's timer (ms). CUDA work is synchronised."""

    def __init__(self, kind: str, device: Any = "cpu"):
        if kind not in TIMERS[1:]:
            raise InputError(f"unknown timer {kind!r}; one of {TIMERS[1:]}")
        self.kind = kind
        self.device = device
        self._cuda = str(device).startswith("cuda")

    def time(self, fn: Any) -> float:
        if self.kind == "cuda_events":
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return float(start.elapsed_time(end))
        if self._cuda:
            import torch

            torch.cuda.synchronize(self.device)
        clock = time.thread_time_ns if self.kind == "thread_cpu" else time.perf_counter_ns
        t0 = clock()
        fn()
        if self._cuda:
            import torch

            torch.cuda.synchronize(self.device)
        return (clock() - t0) / 1e6


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def relative_difference(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    """|b/a − 1| per item (items with a ≤ 0 are skipped)."""
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    keep = x > 0
    return np.abs(y[keep] / x[keep] - 1.0)


__all__ = ["MeasurementProtocol", "Timing", "Stopwatch", "measuring_process", "set_worker_process", "cores_for",
           "allowed_cores", "ProcessSettings", "relative_difference", "TIMERS", "STATISTICS"]

