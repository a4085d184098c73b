"""shard.py end to end: the shard.py contract (docs/usage.md), bad input, and every config composing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from embshard import Plan, Shard, Table, Task, TraceRef, validate
from embshard.costs.base import DeviceCosts

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ["random", "round_robin", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy"]


def small_task(path: Path, name="small", devices=2, tables=8) -> Task:
    task = Task(
        name,
        devices,
        64 * 2**20,
        256,
        tuple(Table(f"t{i}", 1000 * (i + 1), 4 * (1 + i % 4), 1.0 + 2 * i) for i in range(tables)),
    )
    task.save(path)
    return task


def run_shard(*overrides: str) -> subprocess.CompletedProcess:
    """shard.py's own process (the contract: files, stdout, exit status and one error line)."""
    env = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0")
    return subprocess.run(
        [sys.executable, str(ROOT / "shard.py"), *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def run_shard_here(*overrides: str) -> subprocess.CompletedProcess:
    """shard.py's run in this process (tests/_entry.py), where the process is not what is checked."""
    from _entry import run_entry

    return run_entry("shard", *overrides, env={"WANDB_MODE": "offline"})


@pytest.mark.slow
def test_contract_outputs_with_estimated_costs(tmp_path):
    """Through shard.py's own process (the other success runs here run in this process)."""
    task = small_task(tmp_path / "task.json")
    out = tmp_path / "out"
    proc = run_shard(f"task_file={tmp_path / 'task.json'}", f"algorithms=[{','.join(BASELINES)}]", "evaluate=estimated", f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert [r["algorithm"] for r in report["results"]] == BASELINES
    for r in report["results"]:
        assert r["valid"] and r["error"] is None
        assert r["estimated_cost_ms"] > 0 and r["measured_cost_ms"] is None
        assert len(r["memory_bytes"]) == task.num_devices and r["search_seconds"] >= 0
        plan = Plan.load(out / "plans" / f"{r['algorithm']}.json")
        validate(task, plan)
    assert (out / "config.yaml").read_text().count("size_greedy") >= 1
    assert "size_greedy" in proc.stdout  # the comparison table


def test_several_tasks_from_a_folder(tmp_path):
    small_task(tmp_path / "tasks" / "a.json", name="a")
    small_task(tmp_path / "tasks" / "b.json", name="b", devices=3)
    out = tmp_path / "out"
    proc = run_shard_here(f"task_file={tmp_path / 'tasks'}", "algorithms=[size_greedy,random]", "evaluate=none", f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert (out / "plans" / "a" / "size_greedy.json").is_file() and (out / "plans" / "b" / "random.json").is_file()


@pytest.mark.slow
def test_infeasible_task_is_reported_not_dropped(tmp_path):
    task = small_task(tmp_path / "task.json")
    tight = Task(task.name, 2, task.table_memory_bytes(task.tables[-1]) - 10, task.batch_size, task.tables)
    tight.save(tmp_path / "task.json")
    out = tmp_path / "out"
    proc = run_shard(f"task_file={tmp_path / 'task.json'}", "algorithms=[size_greedy]", "evaluate=estimated", f"out_dir={out}")
    assert proc.returncode == 1, proc.stderr  # no valid plan for the task: report written, exit 1
    (result,) = json.loads((out / "report.json").read_text())["results"]
    assert not result["valid"] and "'t7'" in result["error"] and "short by" in result["error"]
    assert not (out / "plans" / "size_greedy.json").exists()


@pytest.mark.parametrize(
    "content, overrides, message, process",
    [
        ('{"name": ', [], "malformed JSON", True),  # one through shard.py's own process
        (None, [], "no such file", False),
        ('{"name": "x", "num_devices": 0, "device_memory_bytes": 1, "batch_size": 1, "tables": []}', [], "num_devices", False),
        ('{"name": "x", "num_devices": 2, "device_memory_bytes": 9999, "batch_size": 1, "tables": [{"name": "a", "rows": -3, "dim": 4, "pooling_factor": 1}]}', [], "rows", False),
        ('{"name": "x", "num_devices": 2, "device_memory_bytes": 9999, "batch_size": 1, "tables": [{"name": "a", "rows": 3, "dim": 5, "pooling_factor": 1}]}', [], "multiple of 4", False),
        ("VALID", ["algorithms=[size_greedy,nope]"], "unknown algorithm", False),
        ("VALID", ["evaluate=sometimes"], "evaluate must be", False),
        # a planner's own setting, refused in its __init__ (Hydra wraps it: exit 1 and 5 lines before)
        ("VALID", ["algorithms=[neuroshard]", "searchers.neuroshard.floor_margin=2"], "floor_margin must be", False),
        ("VALID", ["algorithms=[neuroshard]", "searchers.neuroshard.split_above=-1"], "split_above must be", False),
    ],
)
def test_bad_input_one_line_error_exit_2_nothing_written(tmp_path, content, overrides, message, process,
                                                         refused_in_process):
    """Bad input: exit 2 (docs/usage.md), one line, nothing written. The first case runs shard.py's
    own process; the others its run under the same handler in this process (no torch to import)."""
    path = tmp_path / "task.json"
    if content == "VALID":
        small_task(path)
    elif content is not None:
        path.write_text(content)
    out = tmp_path / "out"
    args = (f"task_file={path}", "evaluate=none", f"out_dir={out}", *overrides)
    if process:
        proc = run_shard(*args)
        code, lines = proc.returncode, [l for l in proc.stderr.splitlines() if l.strip()]
        assert "Traceback" not in proc.stderr
    else:
        code, lines = refused_in_process(*args, entry="shard")
        assert not any("Traceback" in line for line in lines)
    assert code == 2, lines
    assert lines[-1].startswith("error: ") and message in lines[-1], lines
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["task.json"] if content is not None else [])


def test_every_config_composes_and_instantiates():
    from embshard.costs.analytic import AnalyticCostModel
    from embshard.hardware.evaluator import HardwareEvaluator
    from embshard.search.baselines import GreedySharder

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="shard")
        for name in cfg.searchers:
            sharder = instantiate(cfg.searchers[name])
            assert sharder.name == name and callable(sharder.shard)
            assert type(sharder).__name__ == cfg.searchers[name]._target_.rsplit(".", 1)[-1]
        size = instantiate(cfg.searchers["size_greedy"])
        assert isinstance(size, GreedySharder) and size.key == "size"
        # each hardware config is the backend, device and all-to-all its name says
        expected = {"fbgemm_cpu": ("fbgemm", "cpu", "gloo"), "torch_cpu": ("torch", "cpu", "gloo"),
                    "fbgemm_cuda": ("fbgemm", "cuda", "nccl"), "torch_cuda": ("torch", "cuda", "nccl")}
        for hw, (backend, device, comm) in expected.items():
            c = compose(config_name="shard", overrides=[f"hardware={hw}"])
            assert (c.hardware.backend, c.hardware.device, c.hardware.comm_backend) == (backend, device, comm), hw
            assert c.hardware._target_ == "embshard.hardware.evaluator.HardwareEvaluator"
        cpu = instantiate(compose(config_name="shard", overrides=["hardware=torch_cpu"]).hardware)
        assert isinstance(cpu, HardwareEvaluator) and cpu.backend == "torch"
        # both cost models cost a plan: the analytic one by its formula, the shipped neural one
        task = Task("c", 2, 1 << 30, 256, (Table("a", 1000, 8, 2.0), Table("b", 500, 16, 1.0)))
        plan = Plan("c", "x", [Shard.whole(task.tables[0], 0), Shard.whole(task.tables[1], 1)])
        neural = instantiate(cfg.cost_model).device_costs(task, plan)
        analytic = instantiate(compose(config_name="shard", overrides=["cost_model=analytic"]).cost_model)
        assert isinstance(analytic, AnalyticCostModel)
        assert analytic.device_costs(task, plan).plan_cost_ms == pytest.approx(
            AnalyticCostModel().device_costs(task, plan).plan_cost_ms)
        assert len(neural.compute_ms) == 2 and all(c > 0 for c in neural.compute_ms + neural.backward_comm_ms)


@pytest.mark.slow
def test_measured_run_on_real_kernels_with_chart_guard_and_headroom(tmp_path):
    task = small_task(tmp_path / "task.json", tables=6)
    out = tmp_path / "out"
    # verify_visits = rounds: the guard's measurements and the final one time under one protocol, so
    # one group of kept comm ranks serves both (embshard.hardware.comm.KeptRanks), not two spawns
    proc = run_shard_here(f"task_file={tmp_path / 'task.json'}", "algorithms=[size_greedy,lookup_greedy,neuroshard]",
                     "evaluate=measured", "rounds=2", "measure=quick", "measure.repetitions=3",
                     "searchers.neuroshard.verify=2", "searchers.neuroshard.verify_heuristics=[size_greedy]",
                     "searchers.neuroshard.verify_visits=2", "searchers.neuroshard.verify_budget_s=20",
                     "searchers.neuroshard.verify_min_rounds=2", "searchers.neuroshard.verify_max_rounds=2",
                     f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert [r["algorithm"] for r in report["results"]] == ["size_greedy", "lookup_greedy", "neuroshard", "neuroshard_pick"]
    for r in report["results"]:
        devices = r["measured_device_costs"]
        assert r["measured_cost_ms"] > 0 and r["measured_spread_ms"] is not None
        assert r["measured_cost_ms"] == pytest.approx(max(devices["total_ms"]))
        assert all(c > 0 for c in devices["compute_ms"]) and all(c > 0 for c in devices["backward_comm_ms"])
        # the headroom shown is that of the measured per-device costs (not the estimate's)
        measured_costs = DeviceCosts(devices["compute_ms"], devices["forward_comm_ms"], devices["backward_comm_ms"])
        assert r["headroom"]["measured"] == pytest.approx(measured_costs.headroom())
        assert r["envelope"]["devices"] == task.num_devices and "out_of_envelope_devices" in r["envelope"]
    guard = report["results"][2]["guard"]
    assert [c["source"] for c in guard["candidates"]][-1] == "heuristic"
    # the rule: S (search's round-1 best) is kept only when the paired interval of S/H lies below 1
    rows = guard["candidates"]
    s = min((c for c in rows if c["source"] == "search"), key=lambda c: c["measured_ms"])["label"]
    h = min((c for c in rows if c["source"] == "heuristic"), key=lambda c: c["measured_ms"])["label"]
    decision = guard["decision"]
    if decision["verdict"] != "same plan":
        assert (decision["search"], decision["heuristic"]) == (s, h)
        if decision["verdict"] == "better":
            assert decision["ratio"]["high"] < 1.0
        assert guard["chosen"] == (s if decision["verdict"] == "better" else h)
        assert 1 <= decision["rounds"] <= 2  # verify_max_rounds
    assert report["results"][2]["search_seconds"] > guard["measure_seconds"] > 0
    assert "imbalance" in proc.stdout and "gap to balance" in proc.stdout and "neuroshard_pick" in proc.stdout
    assert (out / "measured_cost.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_truncated_trace_file_during_measurement_fails_cleanly(tmp_path):
    trace = tmp_path / "trace.pt"
    trace.write_bytes(b"PK\x03\x04 truncated")
    task = Task("tr", 2, 64 * 2**20, 64, (Table("a", 1000, 8, 2.0, trace=TraceRef(str(trace), 0)), Table("b", 500, 4, 1.0)))
    task.save(tmp_path / "task.json")
    out = tmp_path / "out"
    proc = run_shard(f"task_file={tmp_path / 'task.json'}", "algorithms=[size_greedy]", "evaluate=measured",
                     "measure=quick", f"out_dir={out}")
    assert proc.returncode == 2, proc.stderr  # a truncated dataset file is bad input (docs/usage.md)
    last = [l for l in proc.stderr.splitlines() if l.strip()][-1]
    assert last.startswith("error: ") and str(trace) in last, proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".shard-*"))
