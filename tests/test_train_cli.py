"""train.py's data stages end to end, and its bad-input behaviour."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from embshard import Task

ROOT = Path(__file__).resolve().parents[1]


def test_tasks_stage_writes_valid_tasks_and_config(tmp_path):
    """train.py's run in this process (tests/_entry.py); its own process runs in the torchrun tests
    of test_dlrm.py and test_cluster.py and the --help and misspelt-key tests."""
    from _entry import run_entry

    data = tmp_path / "syn.pt"
    out = tmp_path / "tasks"
    proc = run_entry("train", "stage=tasks", f"dataset.path={data}", "dataset.num_tables=40", "dataset.batch_size=256",
                     "task.num_tasks=3", "task.min_tables=5", "task.max_tables=12", f"out_dir={out}",
                     env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr
    tasks = [Task.load(p) for p in sorted(out.glob("*.json"))]
    assert len(tasks) == 3
    for t in tasks:
        assert 5 <= len(t.tables) <= 12 and t.num_devices == 4
        assert all(tb.dim in (4, 8, 16, 32, 64, 128) and tb.trace is not None for tb in t.tables)
    assert "num_tasks: 3" in (out / "config.yaml").read_text()


def test_dreamshard_stage_splits_tables(tmp_path):
    """The stage's run in this process, with another task kind than the test above."""
    import train

    out = tmp_path / "ds"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "stage=tasks", "task=dreamshard", f"dataset.path={tmp_path / 'syn.pt'}", "dataset.num_tables=60",
            "dataset.batch_size=256", "task.num_train_tasks=2", "task.num_test_tasks=2", "task.min_tables=8",
            "task.max_tables=8", f"out_dir={out}", "progress=false"])
    train.run(cfg)
    split = json.loads((out / "split.json").read_text())
    train_tables = {tb.name for p in (out / "train").glob("*.json") for tb in Task.load(p).tables}
    test_tables = {tb.name for p in (out / "test").glob("*.json") for tb in Task.load(p).tables}
    assert train_tables <= set(split["train"]) and test_tables <= set(split["test"])
    assert not train_tables & test_tables


@pytest.mark.parametrize("kind", ["truncated", "wrong_shape", "missing"])
def test_bad_dataset_file_one_line_error_nothing_written(tmp_path, kind, refused_in_process):
    import torch

    path = tmp_path / "bad.pt.gz"
    if kind == "truncated":
        good = tmp_path / "good.pt"
        torch.save((torch.arange(40), torch.arange(0, 41, 2), torch.full((4, 5), 2)), good)
        blob = gzip.compress(good.read_bytes())
        path.write_bytes(blob[: len(blob) // 2])
        good.unlink()
    elif kind == "wrong_shape":
        with gzip.open(path, "wb") as f:
            torch.save((torch.arange(10), torch.arange(5)), f)
    out = tmp_path / "out"
    # train.py's run under its handler in this process (its own process: test_no_silent_fallbacks)
    code, lines = refused_in_process("stage=pool", "dataset=dlrm_2021", f"dataset.path={path}", f"out_dir={out}")
    assert code == 2, lines  # bad input: exit 2 (embshard.cli.one_line_errors)
    assert lines[-1].startswith("error: ") and not any("Traceback" in line for line in lines), lines
    assert not out.exists()


def test_train_configs_compose():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for task in ["neuroshard", "dreamshard"]:
            for dataset in ["synthetic", "dlrm_2021"]:
                cfg = compose(config_name="train", overrides=[f"task={task}", f"dataset={dataset}"])
                assert cfg.task.kind == task and cfg.dataset.kind in ("synthetic", "dlrm_datasets")
