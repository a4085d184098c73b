"""The collection config: defaults (conf/collect/*.yaml spells them out), resolution, checks."""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

from embshard.errors import InputError
from embshard.tables import DIM_ALIGNMENT, _is_int

log = logging.getLogger("embshard.costs.collect")

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
    "batch_size": 4096,
    "progress": True,
    # the measurement protocol (conf/measure/*.yaml; null: MeasurementProtocol's defaults)
    "measure": None,
    # time the speed probe again after this many chunks (and at the start of every session)
    "probe_every_chunks": 25,
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
        "rank0_only": True,
        "timeout_s": None,
    },
}
#: Settings that may change between a run and its resumption (they do not change samples).
_FREE_KEYS = {"progress", "pool", "probe_every_chunks"}
_FREE_SUB_KEYS = {"num_samples", "timeout_s", "max_cached_bytes"}


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
    from embshard.task import OPTIMIZER_STATE_BYTES_PER_ROW

    if c["optimizer"] not in OPTIMIZER_STATE_BYTES_PER_ROW:
        raise InputError(f"collect.optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES_PER_ROW)}, got {c['optimizer']!r}")
    if c["backend"] == "torch":  # it would time SGD and label the samples with the other optimizer
        from embshard.hardware.backends import check_torch_optimizer

        check_torch_optimizer(c["optimizer"])
    else:  # FBGEMM's CPU kernel has no fused Adam
        from embshard.hardware.backends import check_fbgemm_optimizer

        check_fbgemm_optimizer(c["optimizer"], c["device"])
    from embshard.hardware.protocol import MeasurementProtocol

    c["measure"] = MeasurementProtocol.from_config(c["measure"]).to_dict()
    _pos_int("probe_every_chunks", c["probe_every_chunks"])
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
