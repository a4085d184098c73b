"""NeuroShard's cost models pre-trained on a pool's train / validation / test tables
(`cost_model.pretrain.val_by=split`): the collector's held-out tables are cut into validation and
test tables, validation shards hold no training and no test table, the checkpoint records the
split, and an evaluation refuses a test task with one of its validation tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from embshard.costs.collect.profile import _pool_digest
from embshard.costs.pretrain import pretrain
from embshard.data.split import TableSplit, check_unseen, seen_by_checkpoint
from embshard.data.tasks import split_pool
from embshard.errors import InputError
from embshard.task import Task
from embshard.tables import Table

DIMS = (4, 8, 16, 32, 64)
FAST = {"max_epochs": 30, "batch_size": 32, "lr": 3e-3, "patience": 10, "progress": False, "wandb": False,
        "holdout_num_devices": None, "val_by": "split",
        "compute": {"hidden": 16, "hidden2": 8, "context_hidden": 8}, "comm": {"hidden": 16, "embed": 8}}


def _ms(tables: list[Table]) -> float:
    return 0.05 + 2e-3 * sum(t.pooling_factor * t.dim * (1 + 0.1 * math.log(t.rows)) for t in tables)


def _table(e: dict, dim: int) -> Table:
    return Table(e["name"], e["rows"], dim, e["pooling_factor"])


def write_collection(root: Path, n: int = 400, seed: int = 0) -> tuple[list[dict], list[dict], list[dict], list[str]]:
    """A pool file and cost data as the collector writes them: 25% of the pool's tables held out,
    a sixth of the shards drawn from them (some of generated tables only). Returns (pool, train
    entries, held-out entries, ids of the held-out shards of generated tables only)."""
    rng = np.random.default_rng(seed)
    pool = [{"name": f"t{i}", "rows": int(rng.integers(1_000, 500_000)), "pooling_factor": float(rng.uniform(1, 30))}
            for i in range(40)]
    (root / "pool.json").write_text(json.dumps(pool))
    train, held = split_pool(pool, 0.25, 0)
    data = root / "data"
    data.mkdir()
    generated_only = []
    with open(data / "compute.jsonl", "w") as f:
        for i in range(n):
            side = "test" if rng.random() < 0.3 else "train"
            entries = held if side == "test" else train
            k = int(rng.integers(1, 4))
            tables = [_table(entries[j], int(rng.choice(DIMS))) for j in rng.choice(len(entries), k, replace=False)]
            if side == "test" and rng.random() < 0.3:  # a shard of fresh generated tables only
                tables = [Table(f"g{i}-{j}", int(rng.integers(1_000, 500_000)), int(rng.choice(DIMS)),
                                float(rng.uniform(1, 30))) for j in range(k)]
                generated_only.append(f"compute-{i}")
            ms = _ms(tables) * float(rng.normal(1, 0.02))
            f.write(json.dumps({"kind": "compute", "id": f"compute-{i}", "split": side,
                                "tables": [t.to_dict() for t in tables], "batch_size": 1024, "median_ms": ms,
                                "spread_ms": 0.01, "samples_ms": [ms] * 3}) + "\n")
    with open(data / "comm.jsonl", "w") as f:
        for _ in range(60):
            d = int(rng.choice((2, 4)))
            widths = [int(x) for x in rng.integers(4, 400, size=d)]
            bw = [0.2 + 1e-3 * w for w in widths]
            f.write(json.dumps({"kind": "comm", "num_devices": d, "batch_size": 1024, "widths": widths,
                                "delays_ms": [0.0] * d, "forward_ms": bw, "backward_ms": bw}) + "\n")
    profile = {"pool": {"source": str(root / "pool.json"), "digest": _pool_digest(pool),
                        "train_tables": [e["name"] for e in train], "test_tables": [e["name"] for e in held]},
               "collection": {"holdout": {"fraction": 0.25, "sample_share": 0.3, "seed": 0}}}
    (data / "profile.json").write_text(json.dumps(profile))
    return pool, train, held, generated_only


def _task(name: str, tables: list[Table]) -> Task:
    return Task(name, 2, 1 << 30, 1024, tuple(tables))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    pool, train, held, generated_only = write_collection(root)
    pretrain(FAST, root / "data", root / "out")
    return root, pool, train, held


def test_validation_tables_are_half_of_the_collectors_held_out_tables(trained):
    root, pool, train, held = trained
    split = TableSplit.load(root / "out" / "split.json")
    assert set(split.tables["train"]) == {e["name"] for e in train}
    val, test = set(split.tables["validation"]), set(split.tables["test"])
    assert val and test and not val & test and val | test == {e["name"] for e in held}
    assert abs(len(val) - len(test)) <= 1
    # the same split TableSplit.of_pool draws from the pool itself (the evaluations' split)
    assert split.tables == TableSplit.of_pool(root / "pool.json", 0.125, 0.125, 0).tables


def test_no_training_shard_is_spent_on_validation_and_validation_shards_hold_no_test_table(trained):
    root, _, _, _ = trained
    samples = [json.loads(line) for line in (root / "data" / "compute.jsonl").read_text().splitlines()]
    out = json.loads((root / "out" / "metrics.json").read_text())
    counts = out["data"]["compute_samples"]
    assert counts["train"] == sum(s["split"] == "train" for s in samples)
    assert counts["val"] > 0 and counts["test"] > 0
    assert counts["train"] + counts["val"] + counts["test"] == len(samples)
    split = TableSplit.load(root / "out" / "split.json")
    # the shipped metrics name validation tables only of the split
    assert set(out["val_tables"]) == set(split.tables["validation"])
    assert set(out["heldout_tables"]) == set(split.tables["test"])
    card = (root / "out" / "data_card.md").read_text()
    assert f"{len(split.tables['train'])} train / {len(split.tables['validation'])} validation / " \
           f"{len(split.tables['test'])} test tables" in card
    assert "compute, validation tables" in card


def test_sample_assignment_by_the_split(trained):
    from embshard.costs import neural as N
    from embshard.costs.pretrain import split_by_pool

    root, _, _, _ = trained
    samples = N.load_compute_samples(root / "data" / "compute.jsonl")
    profile = json.loads((root / "data" / "profile.json").read_text())
    split, tables, idx = split_by_pool(samples, profile, seed=0)
    val, test, train = set(tables["val"]), set(tables["test"]), set(tables["train"])
    for i in idx["train"]:
        assert {t.name for t in samples[i].tables} <= train
    for i in idx["val"]:
        names = {t.name for t in samples[i].tables}
        assert not names & test and not names & train
    for i in idx["test"]:
        names = {t.name for t in samples[i].tables}
        assert not names & train and (names & test or not names & val)
    generated = [i for i, s in enumerate(samples) if all(t.name.startswith("g") for t in s.tables)]
    assert {i for i in generated if i in idx["val"]} and {i for i in generated if i in idx["test"]}


def test_checkpoint_records_the_split_and_a_test_task_with_a_validation_table_is_refused(trained):
    root, pool, _, _ = trained
    split = TableSplit.load(root / "out" / "split.json")
    seen = seen_by_checkpoint(root / "out" / "cost_models.pt")
    assert seen.keys == split.seen("test")
    by = {e["name"]: e for e in pool}
    test_task = _task("ok", [_table(by[n], 16) for n in split.tables["test"][:3]])
    check_unseen([test_task], [seen])
    v = split.tables["validation"][0]
    bad = _task("bad", [_table(by[n], 16) for n in split.tables["test"][:2]] + [_table(by[v], 8)])
    with pytest.raises(InputError, match=v):
        check_unseen([bad], [seen])


def test_val_by_split_needs_held_out_tables_and_the_pool(tmp_path):
    write_collection(tmp_path)
    profile_path = tmp_path / "data" / "profile.json"
    profile = json.loads(profile_path.read_text())
    (tmp_path / "pool.json").rename(tmp_path / "moved.json")
    with pytest.raises(InputError, match="is not here"):
        pretrain(FAST, tmp_path / "data", tmp_path / "out")
    changed = json.loads((tmp_path / "moved.json").read_text())
    changed[0]["rows"] += 1
    (tmp_path / "pool.json").write_text(json.dumps(changed))
    with pytest.raises(InputError, match="digest differs"):
        pretrain(FAST, tmp_path / "data", tmp_path / "out")
    profile["collection"]["holdout"]["fraction"] = 0
    profile_path.write_text(json.dumps(profile))
    with pytest.raises(InputError, match="held pool tables out"):
        pretrain(FAST, tmp_path / "data", tmp_path / "out")
    assert not (tmp_path / "out" / "cost_models.pt").exists()
