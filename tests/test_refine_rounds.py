"""The refine loop's stop rule over several rounds (embshard.costs.refine.refine).

Pre-training and the models are stand-ins whose error is set per round, the evaluator is
scripted, so the rule itself is what runs: a round's models are scored on the shards the
search proposed (predicted before measuring) against their error on held-out random shards
(10% MAPE here); the loop stops after the first round whose ratio is <= stop_ratio, each
round's models are trained on the data grown by the rounds before, and a restart measures
nothing twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embshard import Plan, Shard, Table, Task
from embshard.costs import neural, refine as refine_mod
from embshard.costs.base import DeviceCosts
from embshard.search.baselines import GreedySharder
from tests.test_neural import write_data

#: each round's models over-predict every device's compute by this factor: MAPE (factor - 1) x 100%
OVER_PREDICTION = {"round0": 1.30, "round1": 1.20, "round2": 1.10, "round3": 1.05, "final": 1.0}
RANDOM_HELDOUT_MAPE = 10.0


class RoundModels:
    def __init__(self, path: Path):
        self.factor = OVER_PREDICTION[Path(path).parent.name]
        self.metrics = {"compute": {"test": {"mape_pct": RANDOM_HELDOUT_MAPE, "n": 50}}}

    def device_costs(self, task, plan):
        return DeviceCosts([self.factor * c for c in MEASURED], [1.0, 1.0], [1.0, 1.0])


MEASURED = [2.0, 4.0]


class Evaluator:
    class protocol:
        probe = False

    def __init__(self):
        self.rounds = 0

    def measure_many(self, task, plans):
        self.rounds += 1
        return [DeviceCosts(list(MEASURED), [1.0, 1.0], [1.0, 1.0], compute_spread_ms=[0.1, 0.1],
                            forward_comm_spread_ms=[0.1, 0.1], backward_comm_spread_ms=[0.1, 0.1]) for _ in plans]


class TwoDevicePlan:
    """A 'neuroshard' that puts the first table on device 0 and the rest on device 1."""

    def shard(self, task):
        return Plan(task.name, "neuroshard", [Shard.whole(t, int(i > 0)) for i, t in enumerate(task.tables)])


@pytest.fixture
def loop(tmp_path, monkeypatch):
    trained_on: list[tuple[str, int]] = []

    def fake_pretrain(cfg, data_dir, out_dir):
        rows = len((Path(data_dir) / "compute.jsonl").read_text().splitlines())
        trained_on.append((Path(out_dir).name, rows))
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "cost_models.pt").write_bytes(b"stand-in")

    monkeypatch.setattr(refine_mod, "pretrain", fake_pretrain)
    monkeypatch.setattr(neural.NeuralCostModels, "load", classmethod(lambda cls, path, **kw: RoundModels(path)))
    write_data(tmp_path / "base", n_compute=10, n_comm=5)
    tables = (Table("a", 1000, 8, 2.0), Table("b", 500, 16, 1.0), Table("c", 800, 8, 3.0))

    def make_tasks(r):
        return [Task(f"r{r}k{k}", 2, 1 << 30, 256, tables) for k in range(2)]

    def make_sharders(ckpt):
        return {"neuroshard": TwoDevicePlan(), "size_greedy": GreedySharder("size")}

    def run(rounds, stop_ratio, evaluator=None):
        cfg = {"data_dir": str(tmp_path / "base"), "checkpoint": None, "rounds": rounds, "stop_ratio": stop_ratio}
        return refine_mod.refine(cfg, {}, make_tasks, make_sharders, evaluator or Evaluator(), tmp_path / "out")

    return run, trained_on, tmp_path / "out"


def test_the_loop_stops_after_the_first_round_within_the_ratio(loop):
    run, trained_on, out = loop
    ev = Evaluator()
    summary = run(rounds=4, stop_ratio=1.25, evaluator=ev)
    # MAPE on the search's shards 30%, 20%, 10% against 10% on random shards: ratios 3, 2, 1;
    # round 2 is the first <= 1.25, so round 3 never runs
    ratios = [h["search_to_random_mape"] for h in summary["rounds"]]
    assert ratios == pytest.approx([3.0, 2.0, 1.0])
    assert [h["round"] for h in summary["rounds"]] == [0, 1, 2] and ev.rounds == 2 * 3  # 2 tasks a round
    assert summary["converged"] is True
    assert not (out / "rounds" / "round3").exists() and not (out / "round3").exists()
    # each round's models are trained on the data grown by every round before it: per round,
    # 2 tasks x 2 algorithms x 2 devices = 8 compute samples are appended to the 10 random ones
    assert trained_on == [("round0", 10), ("round1", 18), ("round2", 26), ("final", 34)]
    rows = [json.loads(x) for x in (out / "data" / "compute.jsonl").read_text().splitlines()]
    assert [r.get("round") for r in rows[10:]] == [0] * 8 + [1] * 8 + [2] * 8
    # the scores are those of the predictions made before measuring
    r0 = summary["rounds"][0]["scores"]["compute"]
    assert r0["neuroshard"]["mape_pct"] == pytest.approx(30.0) and r0["all"]["n"] == 8
    assert len((out / "refine.md").read_text().splitlines()) == 2 + 3  # header, rule, a line per round


def test_the_loop_runs_every_round_when_the_error_stays_high(loop):
    run, trained_on, out = loop
    summary = run(rounds=2, stop_ratio=1.5)
    assert [h["search_to_random_mape"] for h in summary["rounds"]] == pytest.approx([3.0, 2.0])
    assert summary["converged"] is False and [t for t, _ in trained_on] == ["round0", "round1", "final"]
    # a restart with more rounds reuses the measured rounds and measures only the new one
    ev = Evaluator()
    again = run(rounds=3, stop_ratio=1.5, evaluator=ev)
    assert [h["round"] for h in again["rounds"]] == [0, 1, 2] and ev.rounds == 2
    assert again["rounds"][2]["search_to_random_mape"] == pytest.approx(1.0) and again["converged"] is True


def test_the_ratio_exactly_at_the_stop_ratio_stops(loop):
    run, _, _ = loop
    summary = run(rounds=3, stop_ratio=2.0)  # round 1's ratio is exactly 2.0
    assert [h["round"] for h in summary["rounds"]] == [0, 1] and summary["converged"] is True
