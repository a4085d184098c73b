"""The host profile of a collection folder (profile.json): hardware, versions, pool, config; checked on resume."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from embshard.costs.collect.config import _FREE_KEYS, _FREE_SUB_KEYS
from embshard.costs.collect.records import _TABLE_KEYS, FORMAT_VERSION, PROFILE
from embshard.errors import InputError
from embshard.io import write_json_atomic

if TYPE_CHECKING:
    from embshard.hardware.probe import Probe

log = logging.getLogger("embshard.costs.collect")

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
        "num_threads": (c["measure"] or {}).get("threads") or torch.get_num_threads(),
        "measure": c["measure"],
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


PROBES = "probes"


def save_probe(out_dir: Path, probe: "Probe", rank: int) -> str:
    """Write a session's probe into `out_dir/probes/` (atomically); its id is the file's stem."""
    folder = Path(out_dir) / PROBES
    folder.mkdir(parents=True, exist_ok=True)
    stamp = probe.created.replace(":", "").replace("-", "").replace("+0000", "Z")
    stem = f"rank{rank:02d}-{stamp}"
    n = 0
    while (folder / f"{stem}.json").exists():
        n += 1
        stem = f"rank{rank:02d}-{stamp}-{n}"
    write_json_atomic(folder / f"{stem}.json", probe.to_dict())
    return stem


def read_probes(out_dir: str | os.PathLike) -> dict[str, "Probe"]:
    """Every probe of a collection folder, by id (empty for data measured without probes)."""
    from embshard.hardware.probe import Probe

    folder = Path(out_dir) / PROBES
    out: dict[str, Probe] = {}
    if folder.is_dir():
        for p in sorted(folder.glob("*.json")):
            try:
                body = json.loads(p.read_text())
            except (OSError, ValueError) as e:
                raise InputError(f"{p}: unreadable probe ({type(e).__name__})") from None
            out[p.stem] = Probe.from_dict(body, source=str(p))
    return out
