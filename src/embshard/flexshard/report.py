"""Traffic tables and charts of shard.py evaluate=traffic (and the budget curve script)."""

from __future__ import annotations

import os
from typing import Any, Sequence

from embshard.io import save_png

MB = 1e6
_PURPOSE_COLORS = {"ids": "#8172B2", "embeddings_fw": "#4C72B0", "gradients_bw": "#55A868", "replica_sync": "#C44E52"}


def traffic_rows(results: Sequence[Any]) -> list[dict[str, Any]]:
    """One row per result: MB per step by purpose and link class, busiest device, modeled ms."""
    rows = []
    for r in results:
        row: dict[str, Any] = {"task": r.task, "algorithm": r.algorithm, "valid": r.valid, "error": r.error}
        if r.traffic is not None:
            d = r.traffic.to_dict()
            a2a, total = d["all_to_all_bytes"], d["traffic_bytes"]
            row.update(
                a2a_intra_mb=a2a["intra_host"] / MB, a2a_inter_mb=a2a["inter_host"] / MB, a2a_total_mb=a2a["total"] / MB,
                sync_mb=d["bytes_by_purpose"]["replica_sync"]["total"] / MB,
                total_mb=total["total"] / MB, inter_mb=total["inter_host"] / MB,
                busiest_mb=d["busiest_device_bytes"] / MB, modeled_comm_ms=d["modeled_comm_ms"],
                memory_max_bytes=max(r.memory_bytes) if r.memory_bytes else None,
            )
        rows.append(row)
    return rows


def format_traffic(results: Sequence[Any]) -> str:
    """Fixed-width table: per task and algorithm, MB per step and the modeled comm time."""
    header = ["task", "algorithm", "a2a intra MB", "a2a inter MB", "a2a total MB", "replica sync MB",
              "total MB", "busiest dev MB", "modeled ms", "max dev mem GB"]
    lines, invalid = [], []
    for row in traffic_rows(results):
        if "modeled_comm_ms" not in row:
            lines.append([row["task"], row["algorithm"], "INVALID"] + ["-"] * (len(header) - 3))
            invalid.append(f"  {row['algorithm']} on {row['task']}: {row['error']}")
            continue
        lines.append([row["task"], row["algorithm"]] + [f"{row[k]:.2f}" for k in (
            "a2a_intra_mb", "a2a_inter_mb", "a2a_total_mb", "sync_mb", "total_mb", "busiest_mb")] +
            [f"{row['modeled_comm_ms']:.3f}", f"{row['memory_max_bytes'] / 2**30:.3f}"])
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(l, widths)) for l in lines]
    return "\n".join(out + (["no valid plan:"] + invalid if invalid else []))


def plot_traffic(results: Sequence[Any], path: str | os.PathLike) -> bool:
    """Stacked bars of MB per step by purpose (hatched: between hosts), and the modeled comm
    time, per algorithm (first task when several). False (nothing written) without traffic."""
    rows = [r for r in results if r.traffic is not None]
    if not rows:
        return False
    task = rows[0].task
    rows = [r for r in rows if r.task == task]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.algorithm for r in rows]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(min(16.0, max(10.0, 2.2 * len(names))), 4.8))
    bottom = [0.0] * len(rows)
    for purpose, color in _PURPOSE_COLORS.items():
        for cls, hatch in (("intra_host", None), ("inter_host", "//")):
            vals = [r.traffic.bytes_by_purpose[purpose][cls] / MB for r in rows]
            ax_b.bar(range(len(rows)), vals, bottom=bottom, color=color, hatch=hatch, edgecolor="white",
                     label=f"{purpose} ({cls.replace('_', ' ')})")
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax_b.set_ylabel("MB per training step (all devices)")
    ax_b.set_title(f"{task}: traffic by purpose and link", fontsize=10)
    ax_b.legend(fontsize=7, loc="best")
    ax_t.bar(range(len(rows)), [r.modeled_comm_ms for r in rows], color="#DD8452")
    ax_t.set_ylabel("modeled communication ms per step")
    ax_t.set_title("Modeled comm time (two-tier topology)", fontsize=10)
    for ax in (ax_b, ax_t):
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    fig.tight_layout()
    save_png(fig, path)
    return True
