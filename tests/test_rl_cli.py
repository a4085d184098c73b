"""`train.py stage=rl` end to end: one offline trial of sweeps/rl.yaml (a tiny DreamShard run
whose plans are measured on FBGEMM's CPU kernel), and bad RL config as a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from embshard.search.rl.sharders import DreamShardSharder
from embshard.sweeps import run_trial
from embshard.task import Task

ROOT = Path(__file__).resolve().parents[1]

TINY = ["dataset.num_tables=24", "dataset.batch_size=256", "rl.tasks.num_train_tasks=4", "rl.tasks.num_val_tasks=1",
        "rl.tasks.min_tables=5", "rl.tasks.max_tables=8", "rl.tasks.num_devices=2", "rl.tasks.batch_size=256",
        "rl.tasks.max_total_bytes=null", "rl.iterations=1", "rl.measure_tasks=1", "rl.measure_plans_per_task=2",
        "measure=quick", "rl.cost_steps=10", "rl.policy_steps=2", "rl.hardware.comm_backend=null",
        "rl.validate.measure=false", "progress=false",
        "rl.cost_data=null"]  # experiment=rl_cpu warm-starts from `make checkpoint` data a clean clone lacks


@pytest.mark.slow
def test_one_rl_sweep_trial_trains_offline_and_its_policy_plans(tmp_path):
    out = tmp_path / "trial"
    proc = run_trial(ROOT / "sweeps" / "rl.yaml", seed=0,
                     extra=[f"dataset.path={tmp_path / 'syn.pt'}", *TINY, f"out_dir={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    card = metrics["data_card"]
    assert card["measurements"] == 2 and card["device_counts"] == [2] and card["batch_sizes"] == [256]
    assert set(card["train_tables"]).isdisjoint(card["test_tables"])
    assert metrics["history"][0]["measured/plan_cost_ms"] > 0 and 0 < metrics["objective"] < 10
    assert list((out / "wandb").glob("offline-run-*")) and (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert len((out / "measured_plans.jsonl").read_text().splitlines()) == 2
    assert torch.load(out / "policy.pt", weights_only=True)["algorithm"] == "dreamshard"
    task = Task.from_dict(json.loads((out / "measured_plans.jsonl").read_text().splitlines()[0])["task"])
    plan = DreamShardSharder(checkpoint=str(out / "policy.pt"), samples=2).shard(task)
    assert sorted(s.table for s in plan.shards) == sorted(t.name for t in task.tables)


@pytest.mark.parametrize("override, message", [("rl.mask=bogus", "rl.mask must be one of"),
                                               ("rl.iterations=0", "rl.iterations must be >= 1"),
                                               ("rl.algorithm=flexshard", "rl.algorithm must be one of"),
                                               ("rl.trace_histograms=bogus", "rl.trace_histograms must be one of"),
                                               ("rl.cost_data=/nonexistent/compute.jsonl", "no such file")])
def test_bad_rl_config_is_one_line_error_and_writes_nothing(tmp_path, capsys, override, message):
    import train

    out = tmp_path / "out"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["stage=rl", override, f"out_dir={out}"])
    with pytest.raises(SystemExit) as exit_:
        train.one_line_errors(train.run, cfg)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not out.exists()


def test_rl_wide_widens_rl_broads_tasks_and_keeps_the_rest():
    """experiment=rl_wide (make rl-wide) is rl_broad's training with wider tasks: its own table
    counts, device counts and dims, and rl_broad's batches, histogram share, replay without warm-start
    data and structured comm heads."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        broad = compose(config_name="train", overrides=["stage=rl", "rl=dreamshard", "experiment=rl_broad"]).rl
        wide = compose(config_name="train", overrides=["stage=rl", "rl=dreamshard", "experiment=rl_wide"]).rl
    assert (wide.tasks.min_tables, wide.tasks.max_tables) == (8, 48) != (broad.tasks.min_tables, broad.tasks.max_tables)
    assert list(wide.tasks.num_devices) == [2, 4, 8, 16] and list(wide.tasks.dims)[-1] == 256
    for key in ("batch_size", "no_histogram_fraction", "num_train_tasks"):
        assert wide.tasks[key] == broad.tasks[key]
    assert wide.cost_data is None and wide.nets.dreamshard.costnet.structured_comm is True
