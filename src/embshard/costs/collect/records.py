"""Cost-data samples as files: the records, their validation, chunk files, loading, merging."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from embshard.errors import InputError
from embshard.io import atomic_path
from embshard.plan import Shard
from embshard.tables import Table, _is_int

log = logging.getLogger("embshard.costs.collect")

KINDS = ("compute", "comm")
PROFILE = "profile.json"
FORMAT_VERSION = 1
_CHUNK_RE = re.compile(r"^rank(\d+)-chunk(\d+)\.jsonl$")
_TABLE_KEYS = ("name", "rows", "dim", "pooling_factor", "reuse_histogram", "bytes_per_element", "histogram_imputed")


def chunk_path(out_dir: Path, kind: str, rank: int, chunk: int) -> Path:
    return out_dir / kind / f"rank{rank:02d}-chunk{chunk:06d}.jsonl"


def _existing_chunks(out_dir: Path, kind: str) -> dict[int, list[Path]]:
    found: dict[int, list[Path]] = {}
    folder = out_dir / kind
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            m = _CHUNK_RE.match(p.name)
            if m and p.is_file():
                found.setdefault(int(m.group(2)), []).append(p)
    return found


def _table_record(t: Table) -> dict[str, Any]:  # the table fields a sample stores
    return {
        "name": t.name,
        "rows": t.rows,
        "dim": t.dim,
        "pooling_factor": t.pooling_factor,
        "reuse_histogram": list(t.reuse_histogram) if t.reuse_histogram is not None else None,
        "bytes_per_element": t.bytes_per_element,
    }


def piece_record(table: Table, shard: "Shard", batch_size: int) -> dict[str, Any]:
    """The JSON record of one measured piece: the Table the cost models see for it (its rows
    × dim, its share of the lookups), with the reuse histogram the features use (a traced
    table's as replayed at `batch_size`, `features.replayed_table`); imputed ones
    (`features.imputed_histogram`, from the whole table) are flagged."""
    from embshard.costs.features import piece_histogram
    from embshard.plan import piece_table

    full, imputed = piece_histogram(table, batch_size)
    rec = _table_record(piece_table(full, shard))
    if imputed:
        rec["histogram_imputed"] = True
    return rec


def compute_record(sample_id: str, split: str, tables: list[dict[str, Any]], batch_size: int, median_ms: float,
                   spread_ms: float, samples_ms: Sequence[float] = (), **extra: Any) -> dict[str, Any]:
    """One compute sample as the cost data stores it (`extra`: e.g. origin, task, round)."""
    return {
        "kind": "compute",
        "id": sample_id,
        "split": split,
        "tables": tables,
        "batch_size": batch_size,
        "median_ms": float(median_ms),
        "spread_ms": float(spread_ms),
        "samples_ms": [float(x) for x in samples_ms],
        **extra,
    }


def comm_record(sample_id: str, batch_size: int, widths: Sequence[int], delays_ms: Sequence[float],
                forward_ms: Sequence[float], backward_ms: Sequence[float], forward_spread_ms: Sequence[float],
                backward_spread_ms: Sequence[float], **extra: Any) -> dict[str, Any]:
    """One comm sample as the cost data stores it (`extra`: e.g. origin, task, round)."""
    return {
        "kind": "comm",
        "id": sample_id,
        "split": "train",
        "num_devices": len(widths),
        "batch_size": batch_size,
        "widths": [int(w) for w in widths],
        "delays_ms": [float(x) for x in delays_ms],
        "forward_ms": [float(x) for x in forward_ms],
        "backward_ms": [float(x) for x in backward_ms],
        "forward_spread_ms": [float(x) for x in forward_spread_ms],
        "backward_spread_ms": [float(x) for x in backward_spread_ms],
        **extra,
    }


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _float_list(s: dict, key: str, n: int | None = None) -> str | None:
    v = s.get(key)
    if not isinstance(v, list) or any(not _finite(x) or x < 0 for x in v):
        return f"{key!r} must be a list of non-negative numbers"
    if n is not None and len(v) != n:
        return f"{key!r} has {len(v)} entries, expected {n}"
    return None


def _sample_error(s: Any) -> str | None:
    """Why `s` is not a valid sample (None when it is)."""
    if not isinstance(s, dict):
        return f"a sample must be a JSON object, got {type(s).__name__}"
    kind = s.get("kind")
    if kind not in KINDS:
        return f"unknown sample kind {kind!r}"
    if not _is_int(s.get("batch_size")) or s["batch_size"] <= 0:
        return "'batch_size' must be a positive integer"
    if "id" in s and not isinstance(s["id"], str):
        return "'id' must be a string"
    if kind == "compute":
        tabs = s.get("tables")
        if not isinstance(tabs, list) or not tabs:
            return "'tables' must be a non-empty list"
        for t in tabs:
            if not isinstance(t, dict) or set(t) - set(_TABLE_KEYS) or {"name", "rows", "dim", "pooling_factor"} - set(t):
                return f"each table needs exactly the fields {list(_TABLE_KEYS)}"
            try:
                Table.from_dict({k: v for k, v in t.items() if k != "histogram_imputed"})
            except InputError as e:
                return str(e)
        for key in ("median_ms", "spread_ms"):
            if not _finite(s.get(key)) or s[key] < 0:
                return f"{key!r} must be a non-negative number"
        return _float_list(s, "samples_ms")
    d = s.get("num_devices")
    if not _is_int(d) or d < 1:
        return "'num_devices' must be a positive integer"
    w = s.get("widths")
    if not isinstance(w, list) or len(w) != d or any(not _is_int(x) or x < 0 for x in w):
        return f"'widths' must be {d} non-negative integers"
    for key in ("delays_ms", "forward_ms", "backward_ms", "forward_spread_ms", "backward_spread_ms"):
        err = _float_list(s, key, d)
        if err:
            return err
    return None


def _read_jsonl(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Every line of a JSON Lines file, validated; InputError names the file and line."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    if data and not data.endswith(b"\n"):
        n = data.count(b"\n") + 1
        raise InputError(f"{path}:{n}: truncated (the file does not end with a newline)")
    out = []
    for n, raw in enumerate(data.split(b"\n")[:-1] if data else [], start=1):
        try:
            s = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise InputError(f"{path}:{n}: not valid JSON (truncated or corrupted line)") from None
        err = _sample_error(s)
        if err is None and kind is not None and s["kind"] != kind:
            err = f"a {s['kind']} sample in a {kind} file"
        if err:
            raise InputError(f"{path}:{n}: bad sample: {err}")
        out.append(s)
    return out


def load_samples(path: str | os.PathLike, kind: str | None = None) -> list[dict[str, Any]]:
    """Samples of a JSON Lines file (`compute.jsonl`, `comm.jsonl` or a chunk file), every
    line validated. A collection folder is accepted too: its merged file of `kind`."""
    p = Path(path)
    if p.is_dir():
        if kind not in KINDS:
            raise InputError(f"{p} is a folder: say which kind of samples to load ({' or '.join(KINDS)})")
        p = p / f"{kind}.jsonl"
    if not p.is_file():
        raise InputError(f"{p}: no such sample file")
    return _read_jsonl(p, kind)


class Merged(NamedTuple):
    """`merge`'s result: the merged files and what went into them."""

    compute: Path
    comm: Path
    num_compute: int
    num_comm: int
    duplicates: int


def merge(out_dir: str | os.PathLike) -> Merged:
    """Merge every rank's chunk files into `compute.jsonl` and `comm.jsonl` (atomically).

    Every line is validated (a truncated or corrupted line or file is an InputError naming
    the file and line). Samples are ordered by (chunk, index), whichever rank wrote them;
    a sample seen twice (same id, e.g. a chunk collected by two ranks, or an identical
    line) is kept once, the first copy by file name.
    """
    out = Path(out_dir)
    from embshard.costs.collect.profile import read_profile

    read_profile(out)
    paths = []
    counts = []
    dups = 0
    for kind in KINDS:
        keyed: dict[str, tuple[tuple, dict]] = {}
        for ch, files in sorted(_existing_chunks(out, kind).items()):
            for p in files:
                for i, s in enumerate(_read_jsonl(p, kind)):
                    key = s.get("id") or json.dumps(s, sort_keys=True)
                    if key in keyed:
                        dups += 1
                        continue
                    keyed[key] = ((ch, i), s)
        ordered = [s for _, s in sorted(keyed.values(), key=lambda x: x[0])]
        target = out / f"{kind}.jsonl"
        with atomic_path(target) as tmp:
            tmp.write_text("".join(json.dumps(s, separators=(",", ":")) + "\n" for s in ordered))
        paths.append(target)
        counts.append(len(ordered))
    log.info("merged %d compute and %d comm samples (%d duplicates dropped) in %s", counts[0], counts[1], dups, out)
    return Merged(paths[0], paths[1], counts[0], counts[1], dups)
