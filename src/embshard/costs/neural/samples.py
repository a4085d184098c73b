"""Cost data as the neural models train on it: typed compute and comm samples read from the
collector's JSON Lines files, and labels put on one machine speed (`normalize_to_probe`)."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence


from embshard.costs.neural.features import forward_wait_ms
from embshard.errors import InputError
from embshard.tables import Table

_TABLE_KEYS = ("name", "rows", "dim", "pooling_factor", "reuse_histogram", "bytes_per_element")


@dataclass
class ComputeSample:
    tables: list[Table]
    batch_size: int
    ms: float
    #: the collector's split ("train", or "test" when drawn from its held-out tables)
    split: str | None = None
    #: where the shard came from: "random" (collector's draw) or "<algorithm>" (a device
    #: shard of a plan the refine stage measured)
    origin: str = "random"
    #: pieces whose reuse histogram was imputed (`features.imputed_histogram`), not measured
    imputed_histograms: int = 0
    #: the speed probe of the session that measured it (the collection's probes/ folder)
    probe: str | None = None


@dataclass
class CommSample:
    widths: list[int]
    delays_ms: list[float]
    batch_size: int
    forward_ms: list[float]
    backward_ms: list[float]
    probe: str | None = None

    @property
    def num_devices(self) -> int:
        return len(self.widths)


def read_jsonl(path: str | os.PathLike) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line; InputError naming file:line otherwise."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"cost data file {path} not found")
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{no}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{no}: expected a JSON object, got {type(obj).__name__}")
            out.append((no, obj))
    return out


def load_compute_samples(path: str | os.PathLike) -> list[ComputeSample]:
    samples = []
    for no, obj in read_jsonl(path):
        if obj.get("kind", "compute") != "compute":
            continue
        where = f"{path}:{no}"
        try:
            tables = [Table.from_dict({k: t[k] for k in _TABLE_KEYS if k in t}) for t in obj["tables"]]
            ms = float(obj["median_ms"])
            batch = int(obj["batch_size"])
        except InputError as e:
            raise InputError(f"{where}: {str(e).splitlines()[0]}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: bad compute sample ({type(e).__name__}: {e})") from None
        if not tables or not math.isfinite(ms) or ms <= 0 or batch <= 0:
            raise InputError(f"{where}: compute sample needs >= 1 table, a positive median_ms and batch_size")
        split = obj.get("split")
        imputed = sum(1 for t in obj["tables"] if t.get("histogram_imputed") or t.get("reuse_histogram") is None)
        samples.append(ComputeSample(tables, batch, ms, str(split) if split is not None else None,
                                     str(obj.get("origin", "random")), imputed, _probe_id(obj, where)))
    if not samples:
        raise InputError(f"{path}: no compute samples")
    return samples


def load_comm_samples(path: str | os.PathLike) -> list[CommSample]:
    samples = []
    for no, obj in read_jsonl(path):
        if obj.get("kind", "comm") != "comm":
            continue
        where = f"{path}:{no}"
        try:
            widths = [int(w) for w in obj["widths"]]
            delays = [float(x) for x in obj.get("delays_ms") or [0.0] * len(widths)]
            fw = [float(x) for x in obj["forward_ms"]]
            bw = [float(x) for x in obj["backward_ms"]]
            batch = int(obj["batch_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: bad comm sample ({type(e).__name__}: {e})") from None
        d = len(widths)
        if d < 2 or not (len(delays) == len(fw) == len(bw) == d) or int(obj.get("num_devices", d)) != d:
            raise InputError(f"{where}: comm sample needs D >= 2 and D widths, delays, forward and backward times")
        vals = delays + fw + bw
        if batch <= 0 or any(w < 0 for w in widths) or any(not math.isfinite(v) or v < 0 for v in vals):
            raise InputError(f"{where}: comm sample has a negative or non-finite value")
        samples.append(CommSample(widths, delays, batch, fw, bw, _probe_id(obj, where)))
    if not samples:
        raise InputError(f"{path}: no comm samples")
    return samples


def _probe_id(obj: dict[str, Any], where: str) -> str | None:
    p = obj.get("probe")
    if p is not None and not isinstance(p, str):
        raise InputError(f"{where}: 'probe' must be a probe id (a string), got {p!r}")
    return p


def normalize_to_probe(compute: Sequence[ComputeSample], comm: Sequence[CommSample],
                       probes: dict[str, Any]) -> dict[str, Any] | None:
    """Put every sample's labels on one machine speed, in place: the reference is the median
    of the probes the samples name (`hardware.probe.median_probe`); a sample measured beside a
    probe that ran s× slower than the reference has its compute ms divided by s, its backward
    comm and its forward comm beyond the wait by the comm ratio (the wait is a sleep, the same
    on any machine). Returns what was done (None when no sample names a probe).

    Raises:
        InputError: some samples name a probe and others do not, or a named probe is missing.
    """
    from embshard.hardware.probe import median_probe

    named = [s.probe for s in [*compute, *comm]]
    if all(p is None for p in named):
        return None
    missing = sum(p is None for p in named)
    if missing:
        raise InputError(f"{missing} of {len(named)} cost samples name no speed probe (measured without the "
                         "protocol's probe): re-measure them, or drop them from the data folder")
    unknown = sorted({p for p in named if p not in probes})
    if unknown:
        raise InputError(f"cost samples name probe(s) the data folder's probes/ lacks: {unknown[:3]}")
    used = sorted(set(named))
    reference = median_probe([probes[p] for p in used])
    speed = {p: probes[p].speed_vs(reference) for p in used}
    for s in compute:
        s.ms /= speed[s.probe]["compute"]
    for s in comm:
        wait = forward_wait_ms(s.delays_ms)
        f, b = speed[s.probe]["forward_comm"], speed[s.probe]["backward_comm"]
        s.forward_ms = [float(w + (x - w) / f) if x > w else float(x) for x, w in zip(s.forward_ms, wait)]
        s.backward_ms = [float(x / b) for x in s.backward_ms]
    ratios = [v["compute"] for v in speed.values()]
    return {"reference": reference.to_dict(), "probes": len(used),
            "compute_speed_range": [float(min(ratios)), float(max(ratios))],
            "comm_speed_range": [float(min(v["forward_comm"] for v in speed.values())),
                                 float(max(v["forward_comm"] for v in speed.values()))]}


def most_common_batch(batches: Iterable[int]) -> int:
    return Counter(batches).most_common(1)[0][0]


