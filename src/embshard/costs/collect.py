"""Cost-data collection for the learned cost models (NeuroShard's "pre-train" data).

Two kinds of samples, both measured on real hardware:

* **compute**: a random shard of 1..N tables drawn from an *augmented* table pool (every
  pool table at every dim of a dim set, plus the column halves d/2 that column-wise splits
  produce; optionally both halves of one table on the same device), under a cap on the
  shard's weight bytes. Label: the fused forward+backward (fused optimizer update) time of
  ONE kernel holding the shard (`hardware.compute.measure_compute`: median, IQR, samples).
* **comm**: random per-device embedding widths for D devices (D drawn per chunk from a
  range), each device's width the sum of some random tables' dims, placed somewhere between
  balanced and random, and random per-device compute delays (0..max ms, the smallest one
  0). Labels: per-device forward all-to-all time (from the device's own entry, so it
  includes waiting for the slowest) and backward time, between D real processes
  (`hardware.comm.measure_comm`, one spawn per chunk).

Layout of an output folder::

    profile.json                       hardware profile + collection config (checked on resume)
    compute/rank00-chunk000012.jsonl   one JSON object per line, written atomically per chunk
    comm/rank00-chunk000003.jsonl
    compute.jsonl, comm.jsonl          `merge`: all chunks, validated, deduplicated, in order

Work is cut into chunks of `chunk_size` samples. Chunk c of a kind is a pure function of
(seed, kind, c): its random draws use the seed [seed, kind code, c]. Chunk c belongs to rank
c mod WORLD_SIZE (torchrun's RANK / WORLD_SIZE; comm chunks to rank 0 only when
`comm.rank0_only`), so the *inputs* of a collection do not depend on how many ranks ran it.
A chunk whose file exists (under any rank's name) is skipped: a killed run, restarted with
the same command, continues where it stopped. `num_samples` is rounded up to whole chunks,
so raising it later only adds chunks.

Every sample carries `id` ("<kind>-<chunk>-<index>", unique within a folder) and `split`
("train", or "test" when it was drawn from held-out tables; see `holdout`); every table of a
compute sample keeps its pool `name`, so a trainer can also hold out by table name itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from embshard.errors import InputError
from embshard.io import atomic_path, write_json_atomic
from embshard.tables import DIM_ALIGNMENT, NUM_REUSE_BINS, Table, _is_int

log = logging.getLogger(__name__)

KINDS = ("compute", "comm")
_KIND_CODE = {"compute": 0xC0, "comm": 0xC1}
PROFILE = "profile.json"
FORMAT_VERSION = 1
_CHUNK_RE = re.compile(r"^rank(\d+)-chunk(\d+)\.jsonl$")
_TABLE_KEYS = ("name", "rows", "dim", "pooling_factor", "reuse_histogram", "bytes_per_element", "histogram_imputed")

#: The defaults (conf/collect/cpu.yaml spells the same values out).
DEFAULTS: dict[str, Any] = {
    "pool": None,
    "tables": None,
    "exclude_tables": [],
    "exclude_tables_from": None,
    "holdout": {"fraction": 0.25, "sample_share": 0.2, "seed": 0},
    "seed": 0,
    "backend": "fbgemm",
    "device": "cpu",
    "optimizer": "sgd",
    "num_threads": 1,
    "batch_size": 4096,
    "progress": True,
    "compute": {
        "num_samples": 2000,
        "chunk_size": 16,
        "min_tables": 1,
        "max_tables": 15,
        "dims": [4, 8, 16, 32, 64, 128],
        "column_halves": True,
        "pair_prob": 0.03,
        "max_bytes": 512 << 20,
        "batch_sizes": None,
        "pool_share": 1.0,
        "pool_batch_sizes": None,
        "generated": {"min_rows": 100, "max_rows": 5_000_000, "max_pooling": 200.0, "onehot_share": 0.15,
                      "histogram_share": 0.5},
        "row_piece_prob": 0.0,
        "row_parts": [2, 4, 8, 16],
        "max_lookups": None,
        "warmups": 2,
        "repetitions": 6,
        "rounds": 2,
        "max_cached_bytes": 4 << 30,
    },
    "comm": {
        "num_samples": 400,
        "chunk_size": 10,
        "min_devices": 2,
        "max_devices": 8,
        "tables_per_device": [2.0, 15.0],
        "dims": [4, 8, 16, 32, 64, 128],
        "max_delay_ms": 20.0,
        "batch_sizes": None,
        "max_mb_per_rank": None,
        "backend": "gloo",
        "warmups": 2,
        "repetitions": 6,
        "rank0_only": True,
        "timeout_s": None,
    },
}
#: Settings that may change between a run and its resumption (they do not change samples).
_FREE_KEYS = {"progress", "pool"}
_FREE_SUB_KEYS = {"num_samples", "timeout_s", "max_cached_bytes"}


# ----------------------------------------------------------------------------- config
def _plain(cfg: Any) -> Any:
    """A DictConfig / Mapping as plain dicts and lists."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(cfg, (DictConfig, ListConfig)):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(cfg, Mapping):
        return {k: _plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [_plain(v) for v in cfg]
    return cfg


def resolve_config(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """`cfg` over DEFAULTS (nested), with unknown keys rejected and values checked."""
    cfg = _plain(cfg) or {}
    if not isinstance(cfg, dict):
        raise InputError(f"collect config must be a mapping, got {type(cfg).__name__}")
    out = json.loads(json.dumps(DEFAULTS))
    for k, v in cfg.items():
        if k not in out:
            raise InputError(f"collect: unknown setting {k!r}; known: {', '.join(sorted(out))}")
        if isinstance(out[k], dict):
            if v is None:
                continue
            if not isinstance(v, dict):
                raise InputError(f"collect.{k} must be a mapping, got {v!r}")
            for kk, vv in v.items():
                if kk not in out[k]:
                    raise InputError(f"collect.{k}: unknown setting {kk!r}; known: {', '.join(sorted(out[k]))}")
                if isinstance(out[k][kk], dict) and isinstance(vv, dict):
                    unknown = set(vv) - set(out[k][kk])
                    if unknown:
                        raise InputError(f"collect.{k}.{kk}: unknown setting(s) {sorted(unknown)}; "
                                         f"known: {', '.join(sorted(out[k][kk]))}")
                    out[k][kk] = {**out[k][kk], **vv}
                else:
                    out[k][kk] = vv
        else:
            out[k] = v
    _check_config(out)
    return out


def _pos_int(where: str, v: Any, zero: bool = False) -> int:
    if not _is_int(v) or v < (0 if zero else 1):
        raise InputError(f"collect.{where} must be a {'non-negative' if zero else 'positive'} integer, got {v!r}")
    return int(v)


def _dims(where: str, dims: Any) -> list[int]:
    if not isinstance(dims, list) or not dims or any(not _is_int(d) or d <= 0 or d % DIM_ALIGNMENT for d in dims):
        raise InputError(f"collect.{where} must be a list of positive multiples of {DIM_ALIGNMENT}, got {dims!r}")
    return sorted(set(int(d) for d in dims))


def _batch_list(where: str, v: Any) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or any(not _is_int(b) or b <= 0 for b in v):
        raise InputError(f"collect.{where} must be a list of positive integers (or null), got {v!r}")
    return [int(b) for b in v]


def _check_config(c: dict[str, Any]) -> None:
    _pos_int("batch_size", c["batch_size"])
    _pos_int("seed", c["seed"], zero=True)
    if c["backend"] not in ("fbgemm", "torch"):
        raise InputError(f"collect.backend must be fbgemm or torch, got {c['backend']!r}")
    if c["num_threads"] is not None:
        _pos_int("num_threads", c["num_threads"])
    h = c["holdout"]
    if not isinstance(h["fraction"], (int, float)) or not 0 <= h["fraction"] < 1:
        raise InputError(f"collect.holdout.fraction must be in [0, 1), got {h['fraction']!r}")
    if not isinstance(h["sample_share"], (int, float)) or not 0 <= h["sample_share"] <= 1:
        raise InputError(f"collect.holdout.sample_share must be in [0, 1], got {h['sample_share']!r}")
    if (h["fraction"] > 0) != (h["sample_share"] > 0):
        raise InputError("collect.holdout: fraction and sample_share must both be 0 or both be > 0")
    _pos_int("holdout.seed", h["seed"], zero=True)
    for key in ("tables", "exclude_tables"):
        v = c[key]
        if v is not None and (not isinstance(v, list) or any(not isinstance(x, str) for x in v)):
            raise InputError(f"collect.{key} must be a list of table names, got {v!r}")
    k = c["compute"]
    for f in ("num_samples", "chunk_size", "min_tables", "max_tables", "max_bytes"):
        _pos_int(f"compute.{f}", k[f], zero=(f == "num_samples"))
    _pos_int("compute.warmups", k["warmups"], zero=True)
    _pos_int("compute.repetitions", k["repetitions"])
    _pos_int("compute.rounds", k["rounds"])
    _pos_int("compute.max_cached_bytes", k["max_cached_bytes"], zero=True)
    if k["min_tables"] > k["max_tables"]:
        raise InputError(f"collect.compute.min_tables ({k['min_tables']}) > max_tables ({k['max_tables']})")
    k["dims"] = _dims("compute.dims", k["dims"])
    for f in ("pair_prob", "pool_share", "row_piece_prob"):
        if not isinstance(k[f], (int, float)) or not 0 <= k[f] <= 1:
            raise InputError(f"collect.compute.{f} must be in [0, 1], got {k[f]!r}")
    k["batch_sizes"] = _batch_list("compute.batch_sizes", k["batch_sizes"])
    k["pool_batch_sizes"] = _batch_list("compute.pool_batch_sizes", k["pool_batch_sizes"])
    if k["max_lookups"] is not None:
        _pos_int("compute.max_lookups", k["max_lookups"])
    parts = k["row_parts"]
    if not isinstance(parts, list) or not parts or any(not _is_int(x) or x < 2 for x in parts):
        raise InputError(f"collect.compute.row_parts must be a list of integers >= 2, got {parts!r}")
    g = k["generated"]
    if not isinstance(g, dict):
        raise InputError(f"collect.compute.generated must be a mapping, got {g!r}")
    _pos_int("compute.generated.min_rows", g["min_rows"])
    _pos_int("compute.generated.max_rows", g["max_rows"])
    if g["min_rows"] > g["max_rows"]:
        raise InputError(f"collect.compute.generated: min_rows ({g['min_rows']}) > max_rows ({g['max_rows']})")
    if not isinstance(g["max_pooling"], (int, float)) or not 1 <= g["max_pooling"] < 1e5:
        raise InputError(f"collect.compute.generated.max_pooling must be in [1, 1e5), got {g['max_pooling']!r}")
    for f in ("onehot_share", "histogram_share"):
        if not isinstance(g[f], (int, float)) or not 0 <= g[f] <= 1:
            raise InputError(f"collect.compute.generated.{f} must be in [0, 1], got {g[f]!r}")
    m = c["comm"]
    for f in ("num_samples", "chunk_size", "min_devices", "max_devices"):
        _pos_int(f"comm.{f}", m[f], zero=(f == "num_samples"))
    _pos_int("comm.warmups", m["warmups"], zero=True)
    _pos_int("comm.repetitions", m["repetitions"])
    if m["min_devices"] < 2 or m["min_devices"] > m["max_devices"]:
        raise InputError(f"collect.comm needs 2 <= min_devices <= max_devices, got {m['min_devices']}..{m['max_devices']}")
    m["dims"] = _dims("comm.dims", m["dims"])
    tpd = m["tables_per_device"]
    if (not isinstance(tpd, list) or len(tpd) != 2 or any(not isinstance(x, (int, float)) for x in tpd)
            or not 0 < tpd[0] <= tpd[1]):
        raise InputError(f"collect.comm.tables_per_device must be [low, high] with 0 < low <= high, got {tpd!r}")
    md = m["max_delay_ms"]
    if isinstance(md, list):  # a range: each chunk draws its own maximum, log-uniformly
        if len(md) != 2 or any(not isinstance(x, (int, float)) for x in md) or not 0 < md[0] <= md[1] < 1e4:
            raise InputError(f"collect.comm.max_delay_ms must be a number in [0, 10000) or [low, high], got {md!r}")
    elif not isinstance(md, (int, float)) or not 0 <= md < 1e4:
        raise InputError(f"collect.comm.max_delay_ms must be in [0, 10000), got {md!r}")
    m["batch_sizes"] = _batch_list("comm.batch_sizes", m["batch_sizes"])
    if m["max_mb_per_rank"] is not None and (not isinstance(m["max_mb_per_rank"], (int, float)) or m["max_mb_per_rank"] <= 0):
        raise InputError(f"collect.comm.max_mb_per_rank must be a positive number, got {m['max_mb_per_rank']!r}")
    if m["backend"] not in ("gloo", "nccl"):
        raise InputError(f"collect.comm.backend must be gloo or nccl, got {m['backend']!r}")


# ----------------------------------------------------------------------------- pool
def select_pool(entries: list[dict[str, Any]], tables: Sequence[str] | None = None,
                exclude_tables: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The pool entries named in `tables` (all when None), less `exclude_tables`."""
    names = {e["name"] for e in entries}
    for key, wanted in (("tables", tables or ()), ("exclude_tables", exclude_tables or ())):
        unknown = sorted(set(wanted) - names)
        if unknown:
            raise InputError(f"collect.{key}: {len(unknown)} name(s) not in the pool, e.g. {unknown[:5]}")
    keep = set(tables) if tables is not None else names
    keep -= set(exclude_tables or ())
    out = [e for e in entries if e["name"] in keep]
    if not out:
        raise InputError("collect: no pool tables left after `tables` / `exclude_tables`")
    return out


def table_dims(dims: Sequence[int], column_halves: bool = True) -> list[int]:
    """The dim set, plus d/2 for every d whose half is still a multiple of 4."""
    out = set(int(d) for d in dims)
    if column_halves:
        out |= {d // 2 for d in dims if d % 2 == 0 and (d // 2) % DIM_ALIGNMENT == 0}
    return sorted(out)


def augmented_pool(pool: Any, dims: Sequence[int] = (4, 8, 16, 32, 64, 128), column_halves: bool = True,
                   tables: Sequence[str] | None = None, exclude_tables: Sequence[str] = ()) -> list[Table]:
    """Every (selected) pool table at every dim of `table_dims(dims, column_halves)`.

    The tables keep their pool names (and trace references, so kernels replay real indices).
    """
    from embshard.data.tasks import load_pool

    entries = select_pool(load_pool(pool), tables, exclude_tables)
    ds = table_dims(dims, column_halves)
    return [_table(e, d) for e in entries for d in ds]


def _table(entry: dict[str, Any], dim: int) -> Table:
    keys = ("name", "rows", "pooling_factor", "reuse_histogram", "bytes_per_element", "trace")
    return Table.from_dict({k: entry[k] for k in keys if k in entry} | {"dim": int(dim)})


def _split(entries: list[dict[str, Any]], holdout: Mapping[str, Any]) -> tuple[list, list]:
    """(train entries, test entries): a seeded table split when holdout.fraction > 0."""
    if holdout["fraction"] <= 0:
        return entries, []
    from embshard.data.tasks import split_pool

    return split_pool(entries, holdout["fraction"], holdout["seed"])


# ----------------------------------------------------------------------------- draws
def draw_compute_shard(entries: Sequence[dict[str, Any]], dims: Sequence[int], n: int, max_bytes: int,
                       pair_prob: float, rng: np.random.Generator, *, batch_size: int = 4096,
                       generated: Mapping[str, Any] | None = None, pool_share: float = 1.0,
                       row_piece_prob: float = 0.0, row_parts: Sequence[int] = (2, 4, 8, 16),
                       max_lookups: float | None = None, prefix: str = "g") -> list[tuple[Table, "Shard"]]:
    """Up to `n` pieces of distinct tables for one kernel: (table, shard) pairs.

    Each table comes from the pool (`entries`, with probability `pool_share`) or is
    `embshard.data.tasks.generated_table` (`generated`: its distribution). A table enters whole, or with probability `pair_prob` as both column
    halves (a device holding both halves of a column split), or with probability
    `row_piece_prob` as one row block of TorchRec's even layout over k ranks (k from
    `row_parts`; the block serves only the lookups that fall in its rows). The pieces'
    weight bytes stay <= `max_bytes` and their lookups per step (pooling factor × rows share
    × batch) <= `max_lookups`. At least one piece when any fits.
    """
    from embshard.data.tasks import generated_table
    from embshard.plan import Shard, even_row_layout

    chosen: list[tuple[Table, Shard]] = []
    used = 0
    work = 0.0
    order = iter(rng.permutation(len(entries)).tolist()) if len(entries) else iter(())
    for attempt in range(4 * n + 20):
        if len(chosen) >= n:
            break
        if entries and (generated is None or rng.random() < pool_share):
            i = next(order, None)
            if i is None:
                if generated is None:
                    break
                continue
            e = entries[int(i)]
            bpe = int(e.get("bytes_per_element", 4))
            fits = [d for d in dims if used + e["rows"] * d * bpe <= max_bytes]
            if not fits:
                continue
            d = int(rng.choice(dims))
            if d not in fits:
                d = int(rng.choice(fits))
            table = _table(e, d)
        else:
            table = generated_table(f"{prefix}{attempt}", batch_size, rng, dims=dims, **(generated or {}))
        rows, row_off, share = table.rows, 0, 1.0
        halves = (len(chosen) + 2 <= n and table.dim % 2 == 0 and (table.dim // 2) % DIM_ALIGNMENT == 0
                  and rng.random() < pair_prob)
        if not halves and row_piece_prob > 0 and rng.random() < row_piece_prob:
            k = int(rng.choice(np.asarray(row_parts)))
            blocks = [(off, size) for off, size in even_row_layout(table.rows, k) if size > 0]
            row_off, rows = blocks[int(rng.integers(len(blocks)))]
            share = rows / table.rows
        nbytes = rows * table.dim * table.bytes_per_element
        lookups = table.pooling_factor * share * batch_size
        if used + nbytes > max_bytes or (max_lookups is not None and chosen and work + lookups > max_lookups):
            continue
        if halves:
            h = table.dim // 2
            chosen += [(table, Shard(table.name, 0, 0, h, 0, rows)), (table, Shard(table.name, 0, h, h, 0, rows))]
        else:
            chosen.append((table, Shard(table.name, 0, 0, table.dim, row_off, rows)))
        used += nbytes
        work += lookups
    return chosen


def draw_widths(num_devices: int, dims: Sequence[int], tables_per_device: Sequence[float],
                rng: np.random.Generator, max_width: int | None = None) -> list[int]:
    """Per-device width sums of a random table placement.

    round(U(tables_per_device) × D) tables with random dims, placed in descending dim order;
    with probability `alpha` (drawn once, uniform in [0, 1]) a table goes to the device
    with the smallest width so far (balanced), otherwise to a random device. A table that
    would take a device past `max_width` is left out.
    """
    n = max(1, int(round(rng.uniform(*tables_per_device) * num_devices)))
    ds = np.sort(rng.choice(np.asarray(dims), size=n))[::-1]
    alpha = rng.random()
    widths = np.zeros(num_devices, dtype=np.int64)
    for d in ds:
        dev = int(np.argmin(widths)) if rng.random() < alpha else int(rng.integers(num_devices))
        if max_width is not None and widths[dev] + d > max_width:
            continue
        widths[dev] += int(d)
    if not widths.any():
        widths[0] = int(min(dims))
    return [int(w) for w in widths]


def draw_delays(num_devices: int, max_delay_ms: float, rng: np.random.Generator) -> list[float]:
    """Uniform per-device delays in [0, max), shifted so the smallest is 0 (as a plan's are:
    compute time less the fastest device's), rounded to µs."""
    x = rng.uniform(0.0, max_delay_ms, size=num_devices)
    return [round(float(v), 3) for v in x - x.min()]


def _chunk_rng(seed: int, kind: str, chunk: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), _KIND_CODE[kind], int(chunk)])


def _measure_seed(seed: int, kind: str, chunk: int) -> int:
    return int(_chunk_rng(seed, kind, chunk).integers(0, 2**31 - 1)) ^ 0x5EED


# ----------------------------------------------------------------------------- profile
def device_name(device: str) -> str:
    """The CPU model (from /proc/cpuinfo) or the CUDA device's name."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def library_versions() -> dict[str, str | None]:
    from importlib import metadata

    import torch

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for key, dists in (("fbgemm_gpu", ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly")), ("torchrec", ("torchrec",))):
        out[key] = None
        for d in dists:
            try:
                out[key] = f"{d} {metadata.version(d)}"
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def _pool_digest(entries: list[dict[str, Any]]) -> str:
    """Hash of the pool's table features (not of where their traces live)."""
    body = [{k: e.get(k) for k in _TABLE_KEYS if k != "dim"} for e in entries]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _match_block(c: dict[str, Any], hardware: dict[str, Any], pool: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for two runs to write into the same folder."""
    coll = {k: v for k, v in c.items() if k not in _FREE_KEYS}
    for sub in ("compute", "comm"):
        coll[sub] = {k: v for k, v in c[sub].items() if k not in _FREE_SUB_KEYS}
    hw = {k: hardware[k] for k in ("backend", "device_type", "device_name", "comm_backend", "versions")}
    hw["versions"] = {k: v for k, v in hw["versions"].items() if k in ("torch", "fbgemm_gpu")}
    return {"format": FORMAT_VERSION, "hardware": hw, "collection": coll,
            "pool": {"digest": pool["digest"], "tables": pool["tables"]}}


def hardware_profile(c: Mapping[str, Any]) -> dict[str, Any]:
    """Backend, device name, library versions, threads, batch size, host and date."""
    import torch

    dev = str(c["device"])
    return {
        "backend": c["backend"],
        "device": dev,
        "device_type": "cuda" if dev.startswith("cuda") else dev,
        "device_name": device_name(dev),
        "comm_backend": c["comm"]["backend"],
        "num_threads": c["num_threads"] if c["num_threads"] is not None else torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "batch_size": c["batch_size"],
        "optimizer": c["optimizer"],
        "versions": library_versions(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
    }


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
            if d:
                return d
        return None
    if a != b:
        sa, sb = json.dumps(a), json.dumps(b)
        sa = sa if len(sa) < 80 else sa[:77] + "..."
        sb = sb if len(sb) < 80 else sb[:77] + "..."
        return f"{path}: folder has {sa}, this run has {sb}"
    return None


def _ensure_profile(out_dir: Path, profile: dict[str, Any]) -> None:
    path = out_dir / PROFILE
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"{path}: unreadable profile ({e.__class__.__name__}); delete the folder or fix the file") from None
        if not isinstance(old, dict) or "match" not in old:
            raise InputError(f"{path}: not a cost-data profile (no 'match' block)")
        diff = _first_difference(old["match"], profile["match"])
        if diff:
            raise InputError(f"{out_dir} holds cost data from another setup ({diff}); use another out_dir")
        return
    write_json_atomic(path, profile)


def read_profile(out_dir: str | os.PathLike, require_hardware: bool = True) -> dict[str, Any]:
    """The profile.json of a cost-data folder (the one reader, for collection and pre-training).

    Args:
        require_hardware: also require the collector's "hardware" block; pre-training
            accepts any JSON object (hand-made profiles of test data have none).
    """
    path = Path(out_dir) / PROFILE
    if not path.is_file():
        raise InputError(f"{path}: no cost-data profile (not a collection folder? the collector writes it beside the data)")
    try:
        prof = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(prof, dict) or (require_hardware and "hardware" not in prof):
        raise InputError(f"{path}: not a cost-data profile")
    return prof


# ----------------------------------------------------------------------------- validation
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


# ----------------------------------------------------------------------------- ranks
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


# ----------------------------------------------------------------------------- collection
class Collected(NamedTuple):
    """What one `collect` call did."""

    out_dir: Path
    rank: int
    world_size: int
    new_chunks: dict[str, int]
    skipped_chunks: dict[str, int]
    new_samples: dict[str, int]
    seconds: dict[str, float]


def collect(
    cfg: Mapping[str, Any] | None,
    out_dir: str | os.PathLike,
    pool: Any = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    max_chunks: int | None = None,
    on_chunk: Callable[[str, int, Path], None] | None = None,
) -> Collected:
    """Collect this rank's missing chunks of compute and comm samples into `out_dir`.

    Args:
        cfg: the `collect` config group (conf/collect/*.yaml), or a dict; unset keys take
            DEFAULTS.
        out_dir: the collection folder; created, or resumed when it holds a matching profile.
        pool: the table pool (dlrm_datasets file, pool JSON or list of table dicts);
            default `cfg.pool`.
        rank, world_size: default torchrun's RANK / WORLD_SIZE (else 0 / 1).
        max_chunks: stop after collecting this many new chunks (None: all).
        on_chunk: called as on_chunk(kind, chunk, path) after each chunk file is written.

    Raises:
        InputError: bad config or pool, or `out_dir` holds data from another setup.
    """
    from embshard.data.tasks import load_pool

    c = resolve_config(cfg)
    pool = pool if pool is not None else c["pool"]
    if pool is None:
        raise InputError("collect: no table pool (set collect.pool or the dataset)")
    all_entries = load_pool(pool)
    exclude = list(c["exclude_tables"] or [])
    if c["exclude_tables_from"]:
        # a task split (split.json of stage=tasks): its test tables never enter pre-training
        from embshard.task import read_json

        split = read_json(c["exclude_tables_from"])
        if not isinstance(split, dict) or not isinstance(split.get("test"), list):
            raise InputError(f"{c['exclude_tables_from']}: expected a split with a 'test' list of table names")
        exclude += [n for n in split["test"] if n not in exclude]
    entries = select_pool(all_entries, c["tables"], exclude)
    train_entries, test_entries = _split(entries, c["holdout"])
    r, w, local_rank = rank_info(rank, world_size)
    device = c["device"]
    if str(device) == "cuda":
        device = f"cuda:{local_rank}"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    hardware = hardware_profile(c | {"device": device})
    pool_info = {
        "source": str(pool) if isinstance(pool, (str, os.PathLike)) else "in-memory list",
        "digest": _pool_digest(all_entries),
        "tables": [e["name"] for e in entries],
        "train_tables": [e["name"] for e in train_entries],
        "test_tables": [e["name"] for e in test_entries],
    }
    profile = {
        "format": FORMAT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware,
        "pool": pool_info,
        "collection": c,
        "match": _match_block(c, hardware, pool_info),
    }
    _ensure_profile(out, profile)

    todo: list[tuple[float, str, int]] = []
    skipped = {k: 0 for k in KINDS}
    for kind in KINDS:
        n_chunks = math.ceil(c[kind]["num_samples"] / c[kind]["chunk_size"])
        existing = _existing_chunks(out, kind)
        for ch, paths in existing.items():
            for p in paths:
                _read_jsonl(p, kind)  # a damaged chunk stops the run here, with its name
        for ch in range(n_chunks):
            if chunk_owner(kind, ch, w, c["comm"]["rank0_only"]) != r:
                continue
            if ch in existing:
                skipped[kind] += 1
                continue
            todo.append(((ch + 0.5) / n_chunks, kind, ch))
    todo.sort()
    if max_chunks is not None:
        todo = todo[: max(0, int(max_chunks))]

    dims = {"compute": table_dims(c["compute"]["dims"], c["compute"]["column_halves"])}
    new_chunks = {k: 0 for k in KINDS}
    new_samples = {k: 0 for k in KINDS}
    seconds = {k: 0.0 for k in KINDS}
    bar = None
    if c["progress"] and todo:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=f"cost data (rank {r}/{w})", unit="chunk")
    try:
        for _, kind, ch in todo:
            t0 = time.perf_counter()
            if kind == "compute":
                samples = _compute_chunk(c, ch, train_entries, test_entries, dims["compute"], device)
            else:
                samples = _comm_chunk(c, ch)
            path = chunk_path(out, kind, r, ch)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                tmp.write_text("".join(json.dumps(s, separators=(",", ":")) + "\n" for s in samples))
            seconds[kind] += time.perf_counter() - t0
            new_chunks[kind] += 1
            new_samples[kind] += len(samples)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(compute=new_samples["compute"], comm=new_samples["comm"])
            if on_chunk is not None:
                on_chunk(kind, ch, path)
    finally:
        if bar is not None:
            bar.close()
    for kind in KINDS:
        if new_samples[kind]:
            log.info("rank %d: %d new %s samples in %.0f s (%.1f/min), %d chunks already there",
                     r, new_samples[kind], kind, seconds[kind], 60 * new_samples[kind] / max(seconds[kind], 1e-9),
                     skipped[kind])
    return Collected(out, r, w, new_chunks, skipped, new_samples, seconds)


def _table_record(t: Table) -> dict[str, Any]:  # the table fields a sample stores
    return {
        "name": t.name,
        "rows": t.rows,
        "dim": t.dim,
        "pooling_factor": t.pooling_factor,
        "reuse_histogram": list(t.reuse_histogram) if t.reuse_histogram is not None else None,
        "bytes_per_element": t.bytes_per_element,
    }


def _chunk_batch(section: Mapping[str, Any], default: int, rng: np.random.Generator) -> int:
    """The batch size of one chunk: drawn from the section's `batch_sizes`, else `default`."""
    sizes = section.get("batch_sizes")
    return int(rng.choice(np.asarray(sizes))) if sizes else int(default)


def piece_record(table: Table, shard: "Shard", batch_size: int) -> dict[str, Any]:
    """The JSON record of one measured piece: the Table the cost models see for it (its rows
    × dim, its share of the lookups), with the reuse histogram the features use; imputed
    ones (`features.imputed_histogram`, from the whole table) are flagged."""
    from embshard.costs.features import with_histogram
    from embshard.plan import piece_table

    full, imputed = with_histogram(table, batch_size)
    rec = _table_record(piece_table(full, shard))
    if imputed:
        rec["histogram_imputed"] = True
    return rec


def _compute_chunk(c: dict[str, Any], chunk: int, train: list, test: list, dims: list[int],
                   device: str) -> list[dict[str, Any]]:
    from embshard.hardware.backends import ShardInput
    from embshard.hardware.compute import measure_compute

    k = c["compute"]
    rng = _chunk_rng(c["seed"], "compute", chunk)
    batch = _chunk_batch(k, c["batch_size"], rng)
    generated = k["generated"] if k["pool_share"] < 1 or not (train or test) else None
    pool_share = k["pool_share"]
    if k["pool_batch_sizes"] is not None and batch not in k["pool_batch_sizes"]:
        # a pool table's histogram (and trace) describe it at the trace's batch only
        pool_share = 0.0
        generated = k["generated"]
    shards, splits = [], []
    for i in range(k["chunk_size"]):
        side = "test" if rng.random() < c["holdout"]["sample_share"] and (test or generated) else "train"
        entries = test if side == "test" else train
        n = int(rng.integers(k["min_tables"], k["max_tables"] + 1))
        cap = None
        if k["max_lookups"] is not None:  # log-uniform in [cap/100, cap]: mostly small shards, some at the cap
            cap = float(k["max_lookups"]) * math.exp(-rng.uniform(0.0, math.log(100.0)))
        drawn = draw_compute_shard(entries, dims, n, k["max_bytes"], k["pair_prob"], rng, batch_size=batch,
                                   generated=generated, pool_share=pool_share, row_piece_prob=k["row_piece_prob"],
                                   row_parts=k["row_parts"], max_lookups=cap, prefix=f"g{chunk:06d}-{i:03d}-")
        if not drawn:
            raise InputError(f"collect: no {side} table fits under compute.max_bytes={k['max_bytes']} at any dim")
        shards.append(drawn)
        splits.append(side)
    sets = [[ShardInput(t, sh) for t, sh in s] for s in shards]
    timings = measure_compute(
        sets, batch, backend=c["backend"], device=device, optimizer=c["optimizer"],
        warmups=k["warmups"], repetitions=k["repetitions"], rounds=k["rounds"],
        seed=_measure_seed(c["seed"], "compute", chunk), max_cached_bytes=k["max_cached_bytes"],
        num_threads=c["num_threads"],
    )
    return [
        compute_record(f"compute-{chunk:06d}-{i:03d}", side, [piece_record(t, sh, batch) for t, sh in s], batch,
                       tm.median_ms, tm.spread_ms, tm.samples_ms)
        for i, (s, side, tm) in enumerate(zip(shards, splits, timings))
    ]


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


def _comm_chunk(c: dict[str, Any], chunk: int) -> list[dict[str, Any]]:
    from embshard.hardware.comm import CommConfig, measure_comm

    m = c["comm"]
    rng = _chunk_rng(c["seed"], "comm", chunk)
    d = int(rng.integers(m["min_devices"], m["max_devices"] + 1))
    batch = _chunk_batch(m, c["batch_size"], rng)
    max_width = None
    if m["max_mb_per_rank"] is not None:
        # a rank's buffers hold 2 x (batch x its width + its samples x total width) floats;
        # a balanced config of width w per device: 16 x batch x w bytes <= the cap
        max_width = max(4, int(m["max_mb_per_rank"] * 1e6 / (16.0 * batch) / 4) * 4)
    md = m["max_delay_ms"]
    if isinstance(md, list):
        md = float(math.exp(rng.uniform(math.log(md[0]), math.log(md[1]))))
    configs = [
        CommConfig.make(draw_widths(d, m["dims"], m["tables_per_device"], rng, max_width), draw_delays(d, md, rng))
        for _ in range(m["chunk_size"])
    ]
    results = measure_comm(configs, batch, warmups=m["warmups"], repetitions=m["repetitions"],
                           backend=m["backend"], timeout_s=m["timeout_s"])
    return [comm_record(f"comm-{chunk:06d}-{i:03d}", batch, cfg.widths, cfg.delays_ms, res.forward_ms, res.backward_ms,
                        res.forward_spread_ms, res.backward_spread_ms) for i, (cfg, res) in enumerate(zip(configs, results))]


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


# ----------------------------------------------------------------------------- merge
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
