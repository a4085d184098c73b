"""User-style fuzzing of the planners (a robustness check, not a test): random tasks of the kind
users bring, every planner on each, and anything that is not a valid plan or a one-line error
is reported.

Example:
    .venv/bin/python scripts/fuzz_planners.py run --seed 1 --tasks 30            # make fuzz
    .venv/bin/python scripts/fuzz_planners.py run --seed 2 --tasks 200 --algorithms neuroshard,portfolio
    .venv/bin/python scripts/fuzz_planners.py task --seed 2 --index 143 --out task.json  # one task again
    .venv/bin/python scripts/fuzz_planners.py measured --seed 3 --tasks 10                 # make fuzz-measured
    .venv/bin/python scripts/fuzz_planners.py measured --seed 6 --tasks 10 --override hardware=dmp_cpu
    .venv/bin/python scripts/fuzz_planners.py torchrec --seed 1 --tasks 30                 # make fuzz-torchrec
    PYTHONPATH=/tmp/old/src .venv/bin/python scripts/fuzz_planners.py run --seed 61 --tasks 40 --out old.jsonl
    .venv/bin/python scripts/fuzz_planners.py run --seed 61 --tasks 40 --out new.jsonl
    .venv/bin/python scripts/fuzz_planners.py compare old.jsonl new.jsonl   # same plans? time new/old

A task: 1-1,500 tables (log-uniform rows 1..2e8, dims 4-1,024, pooling 0.01-500, fp16, several
bags, Pareto-tailed reuse histograms or none, sharding-type constraints, min_partition, sequence
tables in some tasks) on 1-128 devices (hosts in some), batch 1-262,144, any optimizer, memory
per device from 0.9x an even share (no plan can exist) to 20x. `task --seed S --index I` writes
the I-th task of seed S, the same every time.

`run` plans each task with every `--algorithms` (`embshard.plan`, validated), with a time limit
per plan, and writes one JSON line per (task, algorithm) to `--out`: `kind` is `ok` (a valid
plan), `refused` (a one-line EmbshardError: no plan fits, a constraint it cannot honour, a table
kind it does not plan), or a defect: `CRASH` (any other exception, with its traceback),
`MULTILINE` (an error of more than one line), `TIMEOUT` (over `--timeout` seconds), `INVALID`
(a plan the validator refuses), `ESTIMATE` (the shipped cost models' estimate of an ok plan not
finite and positive). `--slow` marks ok plans slower than that. Prints the defects and a count
per kind; exit status 1 when there is a defect. Failing tasks are written beside `--out`
(`<out>.tasks/<task>.json`) to reproduce them with shard.py.

Each ok record carries its plan's digest (`plan`), so `compare` tells two runs of the same tasks
apart: the code before a change (a worktree's src/ on PYTHONPATH, which then comes before this
checkout's) and after it, per algorithm: same plans, changed outcomes, planning time new / old.

`measured` (`make fuzz-measured`) takes the same tasks, shrunk so this machine can measure them
(`measurable`: at most 8 devices, 120 tables, batch 8,192 and 512 MiB of tables, no Adam), through
`shard.py evaluate=measured measure=quick` with `--algorithms` (their guards on), one process per
task: a defect is a traceback, an exit status other than 0, 1 or 2, an exit 2 without exactly one
`error:` line, or a run over `--timeout` seconds. Tasks and their runs are kept under
`<out>.tasks/`.

`torchrec` (`make fuzz-torchrec`) calls `EmbShardPlanner.plan` as a TorchRec user does, on random
meta-device modules (`draw_module`: 1-3 EmbeddingBagCollections or EmbeddingCollections, nested,
1-200 tables each of 1..1e8 rows, dims 4-1,024, fp32 or fp16, SUM or MEAN bags, 1-3 features;
`ParameterConstraints` with sharding_types, min_partition and pooling_factors on some tables; a
cuda or cpu `Topology` of 1-64 ranks in hosts, memory 0.8x-20x an even share; batch 1-32,768 per
rank). A defect is an error other than a one-line EmbshardError (CRASH, MULTILINE), a plan over
the time limit, or a `ShardingPlan` that misses a table, gives a table a sharding type its
constraint leaves out, names a rank outside the world, or whose embshard plan the validator
refuses (INVALID).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# after PYTHONPATH's entries (sys.path[1:]), so that another version's src/ there comes first
sys.path.insert(1 + len([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]), str(ROOT / "src"))

DEFECTS = ("CRASH", "MULTILINE", "TIMEOUT", "INVALID", "ESTIMATE")
SHARDING = ["data_parallel", "table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise"]


def draw_task(rng: random.Random, name: str) -> dict[str, Any]:
    """One user-style task JSON (module docstring); `rng` is consumed in a fixed order."""
    import numpy as np

    from embshard.task import Task

    d = rng.choice([1, 2, 3, 4, 5, 8, 12, 16, 24, 32, 64, 128])
    nt = int(rng.choice([1, 2, 3, rng.randint(4, 30), rng.randint(30, 200), rng.randint(200, 1500)]))
    batch = int(rng.choice([1, 7, 512, 2048, 4096, 8192, 16384, 65536, 131072, 262144]))
    opt = rng.choice(["sgd", "rowwise_adagrad", "adagrad", "adam"])
    tables = []
    seq = rng.random() < 0.15
    for k in range(nt):
        rows = int(math.exp(rng.uniform(0, math.log(2e8))))
        dim = 4 * int(rng.choice([1, 2, 4, 8, 16, 32, 64, 3, 5, 24, 100, 256]))
        pf = float(rng.choice([1.0, round(math.exp(rng.uniform(math.log(0.01), math.log(500))), 3)]))
        t: dict[str, Any] = {"name": f"t{k}", "rows": rows, "dim": dim, "pooling_factor": pf}
        if rng.random() < 0.1:
            t["bytes_per_element"] = 2
        if rng.random() < 0.1:
            t["num_poolings"] = float(rng.choice([2.0, 3.0]))
        if rng.random() < 0.25:
            h = np.array([rng.paretovariate(1.0) for _ in range(17)])
            h /= h.sum()
            h = [round(x, 6) for x in h]
            h[0] = round(1 - sum(h[1:]), 6)
            if h[0] >= 0:
                t["reuse_histogram"] = h
        if rng.random() < 0.1:
            t["sharding_types"] = rng.sample(SHARDING, rng.randint(1, 3))
        if rng.random() < 0.05:
            t["min_partition"] = int(rng.choice([4, 8, 16, 32]))
        if seq and rng.random() < 0.5:
            t["kind"] = "sequence"
        tables.append(t)
    task: dict[str, Any] = {"name": name, "num_devices": d, "batch_size": batch, "optimizer": opt, "tables": tables}
    probe = Task.from_dict(task | {"device_memory_bytes": 1 << 50})
    need = probe.tables_memory_bytes()
    big = max(probe.table_memory_bytes(t) for t in probe.tables)
    slack = rng.choice([0.9, 1.02, 1.1, 1.5, 3.0, 20.0])
    task["device_memory_bytes"] = min(1 << 50, int(max(need / d * slack, big * rng.choice([0.5, 1.01, 1.2]))))
    if rng.random() < 0.2 and d % 2 == 0 and d > 2:
        task["devices_per_host"] = d // 2
    return task


def tasks(seed: int, count: int):
    """The first `count` tasks of `seed`, as (index, task JSON)."""
    rng = random.Random(seed)
    for i in range(count):
        yield i, draw_task(rng, f"fz{seed}-{i}")


class _Timeout(Exception):
    pass


def _alarm(*_: Any) -> None:
    raise _Timeout()


def _attempt(rec: dict[str, Any], timeout_s: int, body) -> dict[str, Any]:
    """`rec` filled by `body(rec, t0)` under a `timeout_s` alarm (`body` cancels it once its plan is
    made), or with what stopped it: TIMEOUT, a one-line EmbshardError (refused), a multi-line one
    (MULTILINE), any other exception (CRASH, with its traceback)."""
    from embshard.errors import EmbshardError

    t0 = time.perf_counter()
    signal.alarm(timeout_s)
    try:
        body(rec, t0)
    except _Timeout:
        rec |= {"kind": "TIMEOUT", "seconds": timeout_s}
    except EmbshardError as e:
        signal.alarm(0)
        m = str(e)
        rec |= {"kind": "refused" if "\n" not in m.strip() else "MULTILINE", "message": m[:300]}
    except Exception as e:  # noqa: BLE001 - what the fuzzer is looking for
        signal.alarm(0)
        rec |= {"kind": "CRASH", "message": repr(e)[:300], "traceback": traceback.format_exc()[-3000:]}
    return rec


def plan_one(task, algorithm: str, timeout_s: int, model) -> dict[str, Any]:
    """Plan `task` with `algorithm`: the record `run` writes (module docstring)."""
    import numpy as np

    import embshard
    from embshard.errors import PlanError
    from embshard.plan import validate

    def body(rec: dict[str, Any], t0: float) -> None:
        plan = embshard.plan(task, algorithm=algorithm)
        signal.alarm(0)
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        try:
            validate(task, plan)
        except PlanError as e:
            rec |= {"kind": "INVALID", "message": str(e)[:300]}
            return
        rec["plan"] = plan_signature(plan)
        est = float(model.device_costs(task, plan).plan_cost_ms)
        rec["estimate_ms"] = round(est, 3)
        rec["kind"] = "ok" if np.isfinite(est) and est > 0 else "ESTIMATE"

    return _attempt({"algorithm": algorithm}, timeout_s, body)


def plan_signature(plan) -> str:
    """A short digest of where every piece of `plan` lives (`Plan.signature`): equal digests,
    the same plan."""
    return hashlib.sha1(repr(plan.signature()).encode()).hexdigest()[:16]


def compare(args: argparse.Namespace) -> int:
    """Two `run` records of the same tasks (say, the code before a change and after it, by
    PYTHONPATH): per algorithm, on how many (task, algorithm) pairs the plans are the same, which
    outcomes changed, and the planning time new / old per pair (mean ratio, bootstrap 95%)."""
    import numpy as np

    from embshard.stats import paired_ratio_summary

    def load(path: str) -> dict[tuple[str, str], dict[str, Any]]:
        return {(r["task"], r["algorithm"]): r for r in map(json.loads, Path(path).read_text().splitlines()) if r}

    old, new = load(args.old), load(args.new)
    both = sorted(set(old) & set(new))
    if not both:
        print(f"error: {args.old} and {args.new} share no (task, algorithm) record", file=sys.stderr)
        return 2
    changed = 0
    for algorithm in sorted({a for _, a in both}):
        keys = [k for k in both if k[1] == algorithm]
        same = sum(old[k].get("plan") is not None and old[k].get("plan") == new[k].get("plan") for k in keys)
        planned = sum(old[k].get("plan") is not None for k in keys)
        # an outcome that changed: into or out of "slow", or anything but ok / slow on either side
        kinds = [(k[0], old[k]["kind"], new[k]["kind"]) for k in keys
                 if (old[k]["kind"] == "slow") != (new[k]["kind"] == "slow")
                 or (old[k]["kind"] != new[k]["kind"] and {old[k]["kind"], new[k]["kind"]} - {"ok", "slow"})]
        diff = [k[0] for k in keys if old[k].get("plan") is not None and new[k].get("plan") is not None
                and old[k]["plan"] != new[k]["plan"]]
        timed = [(old[k]["seconds"], new[k]["seconds"]) for k in keys
                 if "plan" in old[k] and "plan" in new[k] and max(old[k]["seconds"], new[k]["seconds"]) >= args.min_seconds]
        line = f"{algorithm:20s} {len(keys)} tasks: same plan {same} of {planned} planned"
        if timed:
            o, n = np.maximum(np.array(timed).T, 0.01)  # seconds are kept to 0.01
            r = paired_ratio_summary(n / o)
            line += (f"; seconds new/old on the {len(timed)} over {args.min_seconds:g} s {r.mean:.3f}x "
                     f"[{r.low:.3f}, {r.high:.3f}] {r.verdict} (total {o.sum():.1f} -> {n.sum():.1f} s)")
        print(line)
        for name, a, b in kinds:
            print(f"    {name}: {a} -> {b}")
        if diff:
            print(f"    other plan: {', '.join(diff[:20])}" + (" ..." if len(diff) > 20 else ""))
        changed += len(diff) + len(kinds)
    return 1 if changed and args.strict else 0


def run(args: argparse.Namespace) -> int:
    import logging
    import warnings

    from embshard.costs.predictor import load_models
    from embshard.task import Task

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGALRM, _alarm)
    model = load_models(str(ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt"), "fuzz").neural
    algorithms = [a for a in args.algorithms.split(",") if a]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    keep = Path(f"{out}.tasks")
    counts: Counter[str] = Counter()
    defects = 0
    with out.open("w") as f:
        for i, td in tasks(args.seed, args.tasks):
            task = Task.from_dict(td)
            desc = f"{len(task.tables)} tables x {task.num_devices} devices, batch {task.batch_size}, {task.optimizer}"
            for algorithm in algorithms:
                rec = {"task": td["name"], "index": i, "desc": desc} | plan_one(task, algorithm, args.timeout, model)
                if rec["kind"] == "ok" and rec["seconds"] > args.slow:
                    rec["kind"] = "slow"
                counts[rec["kind"]] += 1
                f.write(json.dumps(rec) + "\n")
                f.flush()
                if rec["kind"] in DEFECTS or rec["kind"] == "slow":
                    keep.mkdir(exist_ok=True)
                    (keep / f"{td['name']}.json").write_text(json.dumps(td))
                    print(f"{rec['kind']:9s} {td['name']} ({desc}) {algorithm}: "
                          f"{rec.get('message', '')[:200] or str(rec.get('seconds')) + ' s'}", flush=True)
                defects += rec["kind"] in DEFECTS
    print(f"{args.tasks} tasks x {len(algorithms)} algorithms: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f"; records in {out}")
    return 1 if defects else 0


def measurable(td: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """`td` shrunk so this machine can measure it: at most 8 devices, 120 tables and batch 8,192,
    Adam swapped for row-wise Adagrad (FBGEMM's CPU kernel has no fused Adam),
    rows scaled down (and, where the outputs alone are too much, the batch halved) until the
    tables' training memory is at most 512 MiB, and memory per device 1.02-3x an even share (at
    least the largest table's)."""
    from embshard.task import Task

    td = json.loads(json.dumps(td)) | {"num_devices": min(td["num_devices"], 8), "batch_size": min(td["batch_size"], 8192)}
    if td["optimizer"] == "adam":  # FBGEMM's CPU kernel has none (its one-line refusal has a test): measure the rest
        td["optimizer"] = "rowwise_adagrad"
    if td["num_devices"] % td.get("devices_per_host", 1):
        td.pop("devices_per_host")
    td["tables"] = td["tables"][:120]
    probe = Task.from_dict(td | {"device_memory_bytes": 1 << 50})
    need = probe.tables_memory_bytes()
    while need > 1 << 29:  # rows scaled down; where outputs alone are too much, the batch halved too
        if all(t["rows"] == 1 for t in td["tables"]):
            td["batch_size"] = max(1, td["batch_size"] // 2)
        for t in td["tables"]:
            t["rows"] = max(1, int(t["rows"] * 0.9 * (1 << 29) / need))
        probe = Task.from_dict(td | {"device_memory_bytes": 1 << 50})
        need = probe.tables_memory_bytes()
    big = max(probe.table_memory_bytes(t) for t in probe.tables)
    td["device_memory_bytes"] = int(max(need / td["num_devices"] * rng.choice([1.02, 1.5, 3.0]), big * 1.01))
    return td


def measured(args: argparse.Namespace) -> int:
    """`measured`: fuzzed tasks, shrunk (`measurable`), through shard.py evaluate=measured."""
    import subprocess

    out = Path(args.out)
    keep = Path(f"{out}.tasks")
    keep.mkdir(parents=True, exist_ok=True)
    counts: Counter[str] = Counter()
    with out.open("w") as f:
        for i, td in tasks(args.seed, args.tasks):
            td = measurable(td, random.Random(f"{args.seed}-{i}"))
            path = keep / f"{td['name']}.json"
            path.write_text(json.dumps(td))
            desc = f"{len(td['tables'])} tables x {td['num_devices']} devices, batch {td['batch_size']}, {td['optimizer']}"
            cmd = [sys.executable, str(ROOT / "shard.py"), f"task_file={path}", "evaluate=measured", "measure=quick",
                   f"algorithms=[{args.algorithms}]", "plot=false", "progress=false", f"out_dir={keep / td['name']}",
                   *args.override]
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT,
                                   env=os.environ | {"WANDB_MODE": os.environ.get("WANDB_MODE", "offline")})
            except subprocess.TimeoutExpired:
                rec = {"kind": "TIMEOUT", "seconds": args.timeout}
            else:
                errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
                rec = {"seconds": round(time.perf_counter() - t0, 1), "rc": p.returncode,
                       "message": errors[-1][:300] if errors else ""}
                if "Traceback" in p.stderr or p.returncode not in (0, 1, 2):
                    rec |= {"kind": "CRASH", "traceback": p.stderr[-3000:]}
                elif p.returncode == 2 and len(errors) != 1:
                    rec |= {"kind": "MULTILINE", "message": p.stderr[-600:]}
                else:
                    rec["kind"] = "ok" if p.returncode == 0 else "refused"
            rec = {"task": td["name"], "index": i, "desc": desc} | rec
            counts[rec["kind"]] += 1
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(f"{rec['kind']:9s} {td['name']} ({desc}) {rec['seconds']} s {rec.get('message', '')[:200]}", flush=True)
    print(f"{args.tasks} tasks measured: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
          + f"; records in {out}, tasks and runs in {keep}")
    return 1 if any(counts[k] for k in DEFECTS) else 0


SHARDING_TORCHREC = ["table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel", "table_column_wise"]
DIMS_TORCHREC = [4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 200, 256, 512, 1024]


def draw_module(rng: random.Random):
    """(module, constraints by table, Topology, per-rank batch, description) of one TorchRec user's
    model (module docstring); `rng` is consumed in a fixed order."""
    import torch
    from torch import nn
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    root, constraints, total, tables = nn.Module(), {}, 0, 0
    for c in range(rng.choice([1, 1, 2, 3])):
        sequence = rng.random() < 0.25
        seq_dim = rng.choice([4, 8, 16, 32, 64, 128])  # an EmbeddingCollection's tables share one dim
        configs = []
        for j in range(int(round(10 ** rng.uniform(0, 2.3)))):
            name = f"c{c}t{j}"
            rows = max(1, int(10 ** rng.uniform(0, 8)))
            dim = seq_dim if sequence else rng.choice(DIMS_TORCHREC)
            features = [f"{name}f{k}" for k in range(rng.choice([1, 1, 1, 2, 3]))]
            dtype = rng.choice([DataType.FP32, DataType.FP32, DataType.FP16])
            total += rows * dim * (2 if dtype == DataType.FP16 else 4)
            if sequence:
                configs.append(EmbeddingConfig(name=name, num_embeddings=rows, embedding_dim=dim,
                                               feature_names=features, data_type=dtype))
            else:
                configs.append(EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=features,
                                                  data_type=dtype, pooling=rng.choice([PoolingType.SUM, PoolingType.MEAN])))
            if rng.random() < 0.3:
                kw: dict[str, Any] = {}
                if rng.random() < 0.6:
                    kw["sharding_types"] = rng.sample(SHARDING_TORCHREC, rng.choice([1, 1, 2, 3]))
                if rng.random() < 0.3:
                    kw["min_partition"] = rng.choice([4, 8, 16, 32, 128])
                if rng.random() < 0.3:
                    kw["pooling_factors"] = [rng.uniform(0.1, 100) for _ in features]
                if kw:
                    constraints[name] = ParameterConstraints(**kw)
        tables += len(configs)
        collection = (EmbeddingCollection if sequence else EmbeddingBagCollection)(tables=configs, device=torch.device("meta"))
        holder = root
        for d in range(rng.choice([0, 1, 2])):
            sub = nn.Module()
            setattr(holder, f"m{c}_{d}", sub)
            holder = sub
        setattr(holder, f"coll{c}", collection)
    world = rng.choice([1, 2, 3, 4, 8, 16, 32, 64])
    local = rng.choice([x for x in (1, 2, 4, 8, world) if x <= world and world % x == 0])
    device = rng.choice(["cuda", "cpu"])
    cap = int(max(1 << 20, total / world * rng.choice([0.8, 1.2, 2, 5, 20])))
    topology = Topology(world_size=world, compute_device=device, local_world_size=local,
                        **({"hbm_cap": cap} if device == "cuda" else {"ddr_cap": cap}))
    batch = rng.choice([1, 7, 64, 512, 4096, 32768])
    desc = f"{tables} tables, {world} {device} ranks ({local} per host), batch {batch} per rank, {len(constraints)} constrained"
    return root, constraints, topology, batch, desc


def plan_module(module, constraints, topology, batch: int, algorithm: str, timeout_s: int) -> dict[str, Any]:
    """Plan `module` through `EmbShardPlanner` with `algorithm`: the record `torchrec` writes."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import embshard
    from embshard.errors import PlanError
    from embshard.plan import validate

    def body(rec: dict[str, Any], t0: float) -> None:
        planner = embshard.EmbShardPlanner(topology=topology, batch_size=batch, constraints=constraints,
                                           algorithm=algorithm, debug=False)
        sp = planner.plan(module, [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])
        signal.alarm(0)
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        wrong = []
        planned = {n: ps for per in sp.plan.values() for n, ps in per.items()}
        missing = sorted({t.name for t in planner.last_task.tables} - set(planned))
        if missing:
            wrong.append(f"tables missing from the ShardingPlan: {', '.join(missing[:5])}")
        for n, ps in planned.items():
            allowed = getattr(constraints.get(n), "sharding_types", None)
            if allowed and ps.sharding_type not in allowed:
                wrong.append(f"table {n!r} sharded {ps.sharding_type}, its constraint allows {allowed}")
            if any(not 0 <= r < topology.world_size for r in ps.ranks or []):
                wrong.append(f"table {n!r} on ranks {ps.ranks} of a world of {topology.world_size}")
        try:
            validate(planner.last_task, planner.last_plan)
        except PlanError as e:
            wrong.append(str(e))
        rec["kind"] = "INVALID" if wrong else "ok"
        if wrong:
            rec["message"] = "; ".join(wrong)[:300]

    return _attempt({"algorithm": algorithm}, timeout_s, body)


def torchrec(args: argparse.Namespace) -> int:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGALRM, _alarm)
    algorithms = [a for a in args.algorithms.split(",") if a]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    counts: Counter[str] = Counter()
    rng = random.Random(args.seed)
    with out.open("w") as f:
        for i in range(args.tasks):
            module, constraints, topology, batch, desc = draw_module(rng)
            for algorithm in algorithms:
                rec = {"task": f"tr{args.seed}-{i}", "desc": desc} | plan_module(module, constraints, topology, batch,
                                                                               algorithm, args.timeout)
                counts[rec["kind"]] += 1
                f.write(json.dumps(rec) + "\n")
                f.flush()
                if rec["kind"] in DEFECTS:
                    print(f"{rec['kind']:9s} {rec['task']} ({desc}) {algorithm}: {rec.get('message', '')[:200]}", flush=True)
    print(f"{args.tasks} modules x {len(algorithms)} algorithms: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f"; records in {out} "
          f"(`torchrec --seed {args.seed}` draws the same modules again)")
    return 1 if any(counts[k] for k in DEFECTS) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="plan fuzzed tasks with every algorithm; report defects")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--tasks", type=int, default=30)
    r.add_argument("--algorithms", default="neuroshard,dreamshard,autoshard,portfolio,size_lookup_greedy,lookup_greedy")
    r.add_argument("--timeout", type=int, default=120, help="seconds per plan before it counts as TIMEOUT")
    r.add_argument("--slow", type=float, default=10.0, help="seconds above which an ok plan is reported as slow")
    r.add_argument("--out", default="experiments/fuzz/results.jsonl")
    m = sub.add_parser("measured", help="measure shrunk fuzzed tasks through shard.py; report defects")
    m.add_argument("--seed", type=int, default=1)
    m.add_argument("--tasks", type=int, default=10)
    m.add_argument("--algorithms", default="size_lookup_greedy,neuroshard,portfolio")
    m.add_argument("--timeout", type=int, default=900, help="seconds per task before it counts as TIMEOUT")
    m.add_argument("--out", default="experiments/fuzz/measured.jsonl")
    m.add_argument("--override", action="append", default=[],
                   help="a shard.py override for every task, e.g. hardware=dmp_cpu (TorchRec's DMP step); repeatable")
    tr = sub.add_parser("torchrec", help="plan random TorchRec modules through EmbShardPlanner; report defects")
    tr.add_argument("--seed", type=int, default=1)
    tr.add_argument("--tasks", type=int, default=30)
    tr.add_argument("--algorithms", default="neuroshard,portfolio,dreamshard,autoshard,size_lookup_greedy,torchrec")
    tr.add_argument("--timeout", type=int, default=120, help="seconds per plan before it counts as TIMEOUT")
    tr.add_argument("--out", default="experiments/fuzz/torchrec.jsonl")
    c = sub.add_parser("compare", help="two `run` records of the same tasks: same plans? planning time new/old")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--strict", action="store_true", help="exit 1 when any plan or outcome differs")
    c.add_argument("--min-seconds", type=float, default=1.0,
                   help="time ratios only of plans that took this long in either run (shorter ones are noise)")
    t = sub.add_parser("task", help="write one fuzzed task JSON")
    t.add_argument("--seed", type=int, required=True)
    t.add_argument("--index", type=int, required=True)
    t.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "task":
        for i, td in tasks(args.seed, args.index + 1):
            if i == args.index:
                Path(args.out).write_text(json.dumps(td, indent=1))
                print(f"wrote {args.out}: {len(td['tables'])} tables x {td['num_devices']} devices")
        return 0
    return {"measured": measured, "torchrec": torchrec, "compare": compare}.get(args.cmd, run)(args)


if __name__ == "__main__":
    sys.exit(main())
