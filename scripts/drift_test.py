"""Drift test: do measurements reproduce between sessions, on an idle and on a busy machine?

The same 64 random shards (drawn like the broad cost-data collection) and the same 10 plans
of one task are measured in separate sessions (separate processes), each under a measurement
protocol (conf/measure/*.yaml), one on an otherwise idle machine and one with a CPU-bound
background process (a busy loop, one core's worth, unpinned; bounded in time, stopped at the
end). `compare` reports per shard the median and largest |difference| between two sessions,
the same after dividing out the sessions' speed probes, and Kendall τ of the plans' ranking.

    python scripts/drift_test.py prepare --out experiments/drift          # shards, task, plans
    python scripts/drift_test.py session --out experiments/drift --protocol cpu --label idle
    python scripts/drift_test.py session --out experiments/drift --protocol cpu --label busy --load cpu
    python scripts/drift_test.py compare --out experiments/drift          # every (idle, busy) pair
    make drift                                                            # all of it, both protocols

On a GPU machine without FBGEMM: `--backend torch --device cuda --protocol cuda` (plans are
then timed compute only: one GPU has no all-to-all).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
NUM_SHARDS = 64
GENERATED = {"min_rows": 100, "max_rows": 5_000_000, "max_pooling": 200.0, "onehot_share": 0.15,
             "histogram_share": 0.5}
BATCHES = (2048, 4096, 8192, 16384, 32768, 65536)
DIMS = (4, 8, 16, 32, 64, 128, 256)


# ----------------------------------------------------------------------------- prepare
def prepare(out: Path, seed: int, with_torchrec: bool) -> None:
    """Draw the shards and the task, plan it with 10 planners, write everything to `out`."""
    from embshard.costs.collect import draw_compute_shard, piece_record
    from embshard.data.tasks import user_tasks
    from embshard.io import write_json_atomic
    from embshard.plan import Plan, normalize
    from embshard.search.baselines import (
        GreedySharder,
        PileUpSharder,
        RandomSharder,
        RoundRobinSharder,
    )
    from embshard.tables import Table

    rng = np.random.default_rng([seed, 0xD1F7])
    shards = []
    while len(shards) < NUM_SHARDS:
        batch = int(rng.choice(BATCHES))
        cap = 8e6 * math.exp(-rng.uniform(0.0, math.log(100.0)))
        n = int(rng.integers(1, 41))
        drawn = draw_compute_shard([], DIMS, n, 512 << 20, 0.02, rng, batch_size=batch, generated=GENERATED,
                                   pool_share=0.0, row_piece_prob=0.1, max_lookups=cap,
                                   prefix=f"d{len(shards):02d}-")
        if drawn:
            shards.append({"batch_size": batch, "pieces": [{"table": t.to_dict(), "shard": s.to_dict()} for t, s in drawn],
                           "features": [piece_record(t, s, batch) for t, s in drawn]})
    [task] = user_tasks(1, seed=seed, min_tables=28, max_tables=28, num_devices=4, batch_sizes=8192,
                        memory_slack=1.5, name_prefix="drift", dims=(8, 16, 32, 64, 128), min_rows=1000,
                        max_rows=1_000_000, min_pooling=1.0, max_pooling=120.0, histogram_share=0.0)
    sharders: list[Any] = [RandomSharder(seed=s, name=f"random{s}") for s in range(3)]
    sharders += [RoundRobinSharder(), PileUpSharder()] + [GreedySharder(k) for k in ("size", "dim", "lookup", "size_lookup")]
    if with_torchrec:
        from embshard.search.torchrec_planner import TorchRecPlanner

        sharders.append(TorchRecPlanner())
    else:
        from embshard.search.neuroshard import NeuroShardSharder

        sharders.append(NeuroShardSharder(checkpoint=str(ROOT / "checkpoints/cpu_fbgemm/cost_models.pt"), verify=0))
    plans = {}
    for s in sharders:
        plan = s.shard(task)
        plans[s.name] = normalize(task, plan).to_dict() if hasattr(plan, "to_dict") else plan
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "shards.json", shards)
    write_json_atomic(out / "task.json", task.to_dict())
    write_json_atomic(out / "plans.json", plans)
    _ = (Plan, Table)
    print(f"{out}: {len(shards)} shards, task {task.name} ({len(task.tables)} tables, {task.num_devices} devices), "
          f"{len(plans)} plans")


# ----------------------------------------------------------------------------- one session
def _busy_loop(seconds: float, kind: str = "cpu") -> subprocess.Popen:
    """A background load that stops by itself: `cpu` a busy loop (one core's worth, unpinned);
    `gpu` a loop of matrix products on the same GPU."""
    if kind == "gpu":
        code = ("import time, torch\nx = torch.randn(4096, 4096, device='cuda')\n"
                f"end = time.time() + {seconds:.0f}\nwhile time.time() < end:\n    y = x @ x\n    torch.cuda.synchronize()\n")
    else:
        code = f"import time\nend = time.time() + {seconds:.0f}\nx = 0\nwhile time.time() < end:\n    x += 1\n"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def session(out: Path, protocol_name: str, label: str, load: str, backend: str, device: str,
            comm_backend: str | None, seed: int, max_load_s: float, limit: int | None = None,
            with_plans: bool = True, max_cached_bytes: int = 0) -> Path:
    """Measure the prepared shards and plans once under a protocol; write the session file."""
    from embshard.hardware.backends import ShardInput
    from embshard.hardware.evaluator import HardwareEvaluator
    from embshard.hardware.probe import measure_compute_with_probe, run_probe
    from embshard.io import write_json_atomic
    from embshard.plan import Plan, Shard
    from embshard.tables import Table
    from embshard.task import Task

    from embshard.hardware.protocol import load_protocol

    protocol = load_protocol(protocol_name)
    shards = json.loads((out / "shards.json").read_text())[:limit]
    task = Task.from_dict(json.loads((out / "task.json").read_text()))
    plans = {k: Plan.from_dict(v) for k, v in json.loads((out / "plans.json").read_text()).items()}
    sets = [[ShardInput(Table.from_dict(p["table"]), Shard.from_dict(p["shard"])) for p in s["pieces"]] for s in shards]
    batches = [s["batch_size"] for s in shards]
    bg = _busy_loop(max_load_s, load) if load != "none" else None
    if bg is not None:
        time.sleep(2.0)  # let the load start before the first timing
    t0 = time.perf_counter()
    try:
        # a probe under the pinned protocol in every session (also under legacy): what divides
        # the sessions' speed out in `compare`
        probe = run_probe(load_protocol("cpu" if device == "cpu" else "cuda").replace(probe=False), backend=backend,
                          device=device, comm_backend=comm_backend)
        t_shards = time.perf_counter()
        # the probe's kernels ride along in every visit (control items): the speed of this session
        # while the shards ran, under the same protocol (also under legacy)
        timings, tracked = measure_compute_with_probe(sets, batches, backend=backend, device=device,
                                                      protocol=protocol.replace(probe=True), seed=seed, progress=True,
                                                      session=probe, max_cached_bytes=max_cached_bytes)
        t_plans = time.perf_counter()
        ev = HardwareEvaluator(backend=backend, device=device, comm_backend=comm_backend, protocol=protocol, seed=seed,
                               progress=True, max_cached_bytes=max_cached_bytes)
        names = sorted(plans) if with_plans else []
        costs = ev.measure_many(task, [plans[n] for n in names])
        t_end = time.perf_counter()
    finally:
        if bg is not None:
            bg.terminate()
            bg.wait(timeout=10)
    body = {
        "protocol": protocol.to_dict(), "max_cached_bytes": max_cached_bytes, "label": label, "load": load, "backend": backend, "device": device,
        "probe": probe.to_dict(),
        "tracked_probe": tracked.to_dict(),
        "seconds": {"probe": round(t_shards - t0, 1), "shards": round(t_plans - t_shards, 1),
                    "plans": round(t_end - t_plans, 1)},
        "shards": [{"ms": t.median_ms, "noise": t.noise, "samples_ms": list(t.samples_ms)} for t in timings],
        "plans": {n: {"cost_ms": c.plan_cost_ms, "compute_ms": c.compute_ms, "forward_comm_ms": c.forward_comm_ms,
                      "backward_comm_ms": c.backward_comm_ms} for n, c in zip(names, costs)},
    }
    path = out / "sessions" / f"{protocol.name}-{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, body)
    print(f"{path}: shards {body['seconds']['shards']} s, plans {body['seconds']['plans']} s")
    return path


# ----------------------------------------------------------------------------- compare
def compare_pair(a: dict, b: dict) -> dict[str, Any]:
    """Drift figures between two sessions of the same inputs."""
    from embshard.hardware.probe import Probe
    from embshard.stats import kendall_tau_b

    ma = np.array([s["ms"] for s in a["shards"]])
    mb = np.array([s["ms"] for s in b["shards"]])
    keep = (ma > 0) & (mb > 0)
    diff = np.abs(mb[keep] / ma[keep] - 1.0)
    speed = Probe.from_dict(b["probe"]).speed_vs(Probe.from_dict(a["probe"]))
    if a.get("tracked_probe") and b.get("tracked_probe"):
        tracked = Probe.from_dict(b["tracked_probe"]).speed_vs(Probe.from_dict(a["tracked_probe"]))
    else:  # sessions measured before the tracked probe existed
        tracked = {"compute": float("nan")}
    diff_probe = np.abs(mb[keep] / tracked["compute"] / ma[keep] - 1.0)
    names = sorted(a["plans"])
    pa = [a["plans"][n]["cost_ms"] for n in names]
    pb = [b["plans"][n]["cost_ms"] for n in names]
    plan_diff = np.abs(np.array(pb) / np.array(pa) - 1.0) if names else np.array([float("nan")])
    return {
        "shard_median_abs_diff": float(np.median(diff)), "shard_max_abs_diff": float(diff.max()),
        "shard_mean_ratio": float(np.mean(mb[keep] / ma[keep])),
        "probe_compute_ratio": speed["compute"], "probe_comm_ratio": speed["forward_comm"],
        "tracked_probe_compute_ratio": tracked["compute"],
        "shard_median_abs_diff_probe_normalised": float(np.median(diff_probe)),
        "plan_kendall_tau": float(kendall_tau_b(pa, pb)), "plan_median_abs_diff": float(np.median(plan_diff)),
        "plan_max_abs_diff": float(plan_diff.max()),
        "seconds": {"a": a["seconds"], "b": b["seconds"]},
    }


def compare(out: Path) -> dict[str, Any]:
    from embshard.io import write_json_atomic

    sessions = {p.stem: json.loads(p.read_text()) for p in sorted((out / "sessions").glob("*.json"))}
    protocols = sorted({s.rsplit("-", 1)[0] for s in sessions})
    rows = {}
    for proto in protocols:
        labels = sorted(k.rsplit("-", 1)[1] for k in sessions if k.rsplit("-", 1)[0] == proto)
        for i, la in enumerate(labels):
            for lb in labels[i + 1:]:
                rows[f"{proto}: {la} vs {lb}"] = compare_pair(sessions[f"{proto}-{la}"], sessions[f"{proto}-{lb}"])
    lines = ["| protocol: sessions | shard median abs diff | shard max | ... divided by the tracked probe | plan tau | "
             "plan median abs diff | speed ratio: start probe / tracked probe / shards' mean | seconds (shards + plans) |",
             "|---|---|---|---|---|---|---|---|"]
    for k, r in rows.items():
        secs = r["seconds"]["b"]
        lines.append(f"| {k} | {100 * r['shard_median_abs_diff']:.1f}% | {100 * r['shard_max_abs_diff']:.1f}% | "
                     f"{100 * r['shard_median_abs_diff_probe_normalised']:.1f}% | {r['plan_kendall_tau']:.2f} | "
                     f"{100 * r['plan_median_abs_diff']:.1f}% | {r['probe_compute_ratio']:.3f} / "
                     f"{r['tracked_probe_compute_ratio']:.3f} / {r['shard_mean_ratio']:.3f} | "
                     f"{secs['shards']:.0f} + {secs['plans']:.0f} |")
    text = "\n".join(lines)
    print(text)
    write_json_atomic(out / "drift.json", rows)
    (out / "drift.md").write_text(text + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["prepare", "session", "compare"])
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "drift")
    ap.add_argument("--protocol", default="cpu", help="conf/measure/<name>.yaml (cpu, legacy, cuda, ...)")
    ap.add_argument("--label", default="idle")
    ap.add_argument("--load", choices=["none", "cpu", "gpu"], default="none",
                    help="cpu: a busy loop beside the session; gpu: matrix products on the same GPU")
    ap.add_argument("--max-load-s", type=float, default=1800.0, help="the busy loop stops by itself after this")
    ap.add_argument("--backend", default="fbgemm")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--comm-backend", default="gloo", help="gloo | nccl | none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-torchrec", action="store_true", help="prepare: NeuroShard's plan instead of TorchRec's")
    ap.add_argument("--limit", type=int, default=None, help="session: only the first N shards")
    ap.add_argument("--skip-plans", action="store_true", help="session: shards only")
    ap.add_argument("--max-cached-bytes", type=int, default=0,
                    help="session: kernels kept between visits within a call (the evaluator's default 0: every kernel "
                         "rebuilt each visit; 2147483648 was the default before 2026-12-04)")
    args = ap.parse_args(argv)
    from embshard.errors import EmbshardError

    try:
        if args.command == "prepare":
            prepare(args.out, args.seed, with_torchrec=not args.no_torchrec)
        elif args.command == "session":
            comm = None if args.comm_backend == "none" else args.comm_backend
            session(args.out, args.protocol, args.label, args.load, args.backend, args.device, comm, args.seed,
                    args.max_load_s, args.limit, not args.skip_plans, args.max_cached_bytes)
        else:
            compare(args.out)
    except EmbshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
