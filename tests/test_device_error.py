"""scripts/device_error.py: the within-plan error of the compute model on measured plans."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from embshard.costs.neural import NeuralCostModels
from embshard.plan import Plan, Shard, device_pieces
from embshard.tables import Table
from embshard.task import Task

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt"
SCRIPT = [sys.executable, str(ROOT / "scripts" / "device_error.py")]


def test_within_plan_error_removes_each_plans_own_factor(tmp_path, capsys):
    task = Task("x-0", 2, 10**9, 8192, (Table("a", 50_000, 16, 4.0), Table("b", 200_000, 32, 12.0),
                                          Table("c", 3_000, 8, 1.0)))
    plan = Plan("x-0", "size_greedy", [Shard("a", 0, 0, 16, 0, 50_000), Shard("b", 1, 0, 32, 0, 200_000),
                                       Shard("c", 1, 0, 8, 0, 3_000)])
    pred = NeuralCostModels.load(CKPT).at_batch(8192).compute_ms(device_pieces(task, plan))
    (tmp_path / "tasks" / "s").mkdir(parents=True)
    (tmp_path / "runs" / "s" / "plans" / "x-0").mkdir(parents=True)
    (tmp_path / "tasks" / "s" / "x-0.json").write_text(json.dumps(task.to_dict()))
    (tmp_path / "runs" / "s" / "plans" / "x-0" / "size_greedy.json").write_text(json.dumps(plan.to_dict()))
    # measured: device 0 at 1.1x its prediction, device 1 at 0.9x, on a machine 3x slower that day
    measured = [3 * 1.1 * float(pred[0]), 3 * 0.9 * float(pred[1])]
    result = {"task": "x-0", "algorithm": "size_greedy", "valid": True, "measured_device_costs": {"compute_ms": measured}}
    (tmp_path / "runs" / "s" / "report.json").write_text(json.dumps({"results": [result]}))
    out = tmp_path / "summary.json"
    # the script's main in this process (its own process: the refusal below)
    spec = importlib.util.spec_from_file_location("device_error", ROOT / "scripts" / "device_error.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    assert script.main([str(tmp_path), "--checkpoint", str(CKPT), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 devices of 1 measured plans" in text
    s = json.loads(out.read_text())
    assert s["within_plan_sd"] == pytest.approx(math.log(1.1 / 0.9) / 2, abs=1e-3)  # the 3x is gone
    assert s["mean_log_error"] == pytest.approx(math.log(3) + (math.log(1.1) + math.log(0.9)) / 2, abs=1e-3)
    bad = subprocess.run(SCRIPT + [str(tmp_path / "tasks")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [f"error: {tmp_path / 'tasks'}: no runs/<setting>/report.json"]
