"""Train / validation / test tables (issue 18, item 1): the split, its record in checkpoints,
and the refusal of a test task that holds a table a planner was trained or tuned on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from embshard.data.split import SeenTables, TableSplit, check_unseen, key_of, seen_by_checkpoint
from embshard.data.tasks import neuroshard_tasks, split_pool, without_histograms
from embshard.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Path:
    from embshard.data.synthetic import generate_synthetic

    path = tmp_path_factory.mktemp("pool") / "synthetic_t200_bs256_s5.pt"
    generate_synthetic(path, num_tables=200, batch_size=256, seed=5)
    return path


def test_three_way_split_is_disjoint_complete_and_keeps_the_two_way_train_tables(pool):
    s = TableSplit.of_pool(pool, 0.25, 0.25, seed=3)
    names = [set(s.tables[k]) for k in ("train", "validation", "test")]
    assert sum(len(n) for n in names) == 200 and len(set().union(*names)) == 200
    assert (len(names[0]), len(names[1]), len(names[2])) == (100, 50, 50)
    train_two_way, _ = split_pool(pool, 0.5, 3)  # checkpoints of the earlier split keep their train tables
    assert names[0] == {e["name"] for e in train_two_way}
    assert TableSplit.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert TableSplit.of_pool(pool, 0.25, 0.25, seed=3) == s and TableSplit.of_pool(pool, 0.25, 0.25, seed=4) != s
    with pytest.raises(InputError):
        TableSplit.of_pool(pool, 0.5, 0.5)


def test_a_test_task_with_a_training_table_is_refused(pool):
    s = TableSplit.of_pool(pool, 0.25, 0.25, seed=3)
    test_tasks = neuroshard_tasks(s.entries(pool, "test"), 3, min_tables=5, max_tables=8, num_devices=2, seed=1,
                                  name_prefix="ok")
    trained = SeenTables("ckpt.pt", s.seen("test"))
    check_unseen(test_tasks, [trained])  # only test tables: fine
    for which in ("train", "validation"):
        (bad,) = neuroshard_tasks(s.entries(pool, "test")[:6] + s.entries(pool, which)[:1], 1, min_tables=7,
                                  max_tables=7, num_devices=2, seed=1, name_prefix=f"with-{which}")
        with pytest.raises(InputError) as e:
            check_unseen([bad], [trained])
        msg = str(e.value)
        assert "\n" not in msg and f"'{bad.name}'" in msg and s.entries(pool, which)[0]["name"] in msg
        # dropping the histogram or changing the dim does not hide the table
        user = without_histograms(bad)
        assert [t.reuse_histogram for t in user.tables] == [None] * 7 and any(t.reuse_histogram for t in bad.tables)
        assert [(t.name, t.rows, t.dim, t.pooling_factor) for t in user.tables] == [
            (t.name, t.rows, t.dim, t.pooling_factor) for t in bad.tables]
        with pytest.raises(InputError):
            check_unseen([user], [trained])


def test_names_decide_only_within_the_checkpoints_own_pool(pool):
    s = TableSplit.of_pool(pool, 0.25, 0.25, seed=3)
    (task,) = neuroshard_tasks(s.entries(pool, "test"), 1, min_tables=5, max_tables=5, num_devices=2, seed=2)
    names_only = SeenTables("old.pt", set(), pool=f"/elsewhere/{pool.name}", names={task.tables[0].name})
    with pytest.raises(InputError):
        check_unseen([task], [names_only], pool=str(pool))
    other_pool = SeenTables("old.pt", set(), pool="/elsewhere/synthetic_t512_bs4096_s1.pt", names={task.tables[0].name})
    check_unseen([task], [other_pool], pool=str(pool))  # a t17 of another pool is another table


def test_shipped_policies_record_what_they_were_trained_on():
    for algo in ("dreamshard", "autoshard"):
        seen = seen_by_checkpoint(ROOT / "checkpoints" / f"{algo}_cpu" / "policy.pt")
        assert len(seen.names) >= 64
        if (ROOT / "data" / "synthetic_t128_bs4096_s0.pt").is_file():  # keys from the pool file when it is here
            assert len(seen.keys) == len(seen.names)


def test_rl_stage_trains_on_train_tables_and_validates_on_validation_tables(pool):
    from embshard.search.rl.stage import training_tasks

    c = {"task_dir": None, "tasks": {"validation_fraction": 0.25, "test_fraction": 0.25, "num_train_tasks": 3,
                                     "num_val_tasks": 2, "min_tables": 6, "max_tables": 10, "dims": [4, 8, 16],
                                     "max_total_bytes": None, "num_devices": 2, "device_memory_bytes": None,
                                     "batch_size": 256, "optimizer": "sgd"}}
    train, val, split = training_tasks(c, pool, seed=3)
    s = TableSplit.from_dict(split)
    assert s == TableSplit.of_pool(pool, 0.25, 0.25, seed=3, pool_name=str(pool))
    keys = {k: set(v) for k, v in s.keys.items()}
    assert all(key_of(t) in keys["train"] for task in train for t in task.tables)
    assert val and all(key_of(t) in keys["validation"] for task in val for t in task.tables)


def _portfolio_eval(monkeypatch, *args: str) -> None:
    """scripts/portfolio_eval.py's main with these arguments, in this process (the script only
    parses them and calls the package; a process of its own would only add imports)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("portfolio_eval", ROOT / "scripts" / "portfolio_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["portfolio_eval.py", *args])
    module.main()


def test_portfolio_eval_refuses_tasks_holding_a_checkpoints_tables(pool, tmp_path, monkeypatch):
    """A checkpoint whose data card says it trained on the split's test tables: the evaluation
    writes no task and says which table."""
    s = TableSplit.of_pool(pool, 0.25, 0.25, seed=0)
    card_split = s.to_dict() | {"train": s.tables["test"], "test": s.tables["train"],
                                "keys": {"train": s.keys["test"], "validation": s.keys["validation"],
                                         "test": s.keys["train"]}}
    ckpt = tmp_path / "policy.pt"
    torch.save({"format": "embshard-rl-policy", "data_card": {"split": card_split}}, ckpt)
    out = tmp_path / "tasks"
    with pytest.raises(SystemExit) as refused:
        _portfolio_eval(monkeypatch, "tasks", "--dataset", str(pool), "--checkpoints", str(ckpt), "--num-tasks", "1",
                        "--out", str(out))
    last = str(refused.value.code)  # sys.exit("error: ..."): printed as one line, exit status 1
    assert "\n" not in last
    assert last.startswith("error: task ") and "was trained or tuned on by" in last and str(ckpt) in last
    assert not list(out.glob("*/*.json"))


def test_portfolio_eval_validation_tasks_hold_validation_tables_only(pool, tmp_path, monkeypatch):
    """--split validation: tasks (pv-*) of the split's validation tables, where checkpoints and
    switches are chosen; the default stays the test tables (pe-*)."""
    from embshard.task import load_tasks

    s = TableSplit.of_pool(pool, 0.25, 0.25, seed=0)
    keys = {k: set(v) for k, v in s.keys.items()}
    for split, prefix in (("validation", "pv-"), ("test", "pe-")):
        out = tmp_path / split
        _portfolio_eval(monkeypatch, "tasks", "--dataset", str(pool), "--checkpoints", "--num-tasks", "2",
                        "--split", split, "--max-total-bytes", str(1 << 40), "--out", str(out))
        tasks = [t for d in sorted(out.iterdir()) if d.is_dir() for t in load_tasks(d)]
        assert len(tasks) == 12 and all(t.name.startswith(prefix) for t in tasks)
        assert all(key_of(tb) in keys[split] for t in tasks for tb in t.tables)
