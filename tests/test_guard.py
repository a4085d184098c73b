"""NeuroShard's measured guard on its default path: `verify=auto` (the shipped config) measures
the search's 3 best plans once an evaluator is attached (shard.py attaches one exactly when
evaluate=measured), beside the six heuristics; every verdict of the rule, reached through
`shard()`; and `verify > 0` without an evaluator is an input error.

The evaluator is scripted (costs by plan), so the rule is tested, not the hardware.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from embshard import InputError, Table, Task, validate
from embshard.costs.base import DeviceCosts
from embshard.search.neuroshard import ROOT, NeuroShardSharder

HEURISTICS = ["size_lookup_greedy", "lookup_greedy", "dim_greedy", "size_greedy", "round_robin", "random"]


class CostByAlgorithm:
    """Measures every plan of algorithm `name` at `costs[name]` ms (search plans are named
    'neuroshard'), and records what it was asked to measure."""

    def __init__(self, costs: dict[str, float], default: float):
        self.costs, self.default = costs, default
        self.calls: list[list[str]] = []

    def measure_many(self, task, plans, visits=None):
        self.calls.append([p.algorithm for p in plans])
        return [DeviceCosts([self.costs.get(p.algorithm, self.default)] * task.num_devices, [0.0] * task.num_devices,
                            [0.0] * task.num_devices) for p in plans]


def task_of(tables, devices=2, memory=1 << 30) -> Task:
    return Task("g", devices, memory, 512, tuple(tables))


TABLES = [Table(f"t{i}", 1000 * (i + 1), 8 * (1 + i % 3), 2.0 + 3 * i) for i in range(8)]


def test_verify_auto_is_3_once_an_evaluator_is_attached_and_the_shipped_config_is_auto():
    cfg = OmegaConf.load(ROOT / "conf" / "search" / "neuroshard.yaml")
    assert cfg.verify == "auto"
    s = NeuroShardSharder(checkpoint=None)
    assert s.verify == "auto" and s.verify_count == 0
    assert s.search(task_of(TABLES)).partitioner.top_k == 1
    s.attach_evaluator(CostByAlgorithm({}, 1.0))
    assert s.verify_count == 3 and s.search(task_of(TABLES)).partitioner.top_k == 3
    s.attach_evaluator(None)
    assert s.verify_count == 0


def test_default_guard_measures_three_search_plans_and_the_six_heuristics_and_keeps_a_better_search_plan():
    s = NeuroShardSharder(checkpoint=None)  # verify=auto, every default
    ev = CostByAlgorithm({"neuroshard": 1.0}, default=2.0)
    s.attach_evaluator(ev)
    task = task_of(TABLES)
    plan = s.shard(task)
    g = s.last_guard
    labels = [c["label"] for c in g.candidates]
    searched = [x for x in labels if x.startswith("neuroshard#")]
    assert searched == ["neuroshard#1", "neuroshard#2", "neuroshard#3"]  # 8 tables on 2 devices: 3 distinct plans
    assert labels[3:] == HEURISTICS and [c["source"] for c in g.candidates] == ["search"] * 3 + ["heuristic"] * 6
    # round 1 measures each distinct plan once; then S and the two best heuristics (all tie at
    # 2.0, within the 10% margin; the first two distinct plans in their order), paired, until the
    # interval of S/H (0.5 every round: a zero-width interval) excludes 1 after 3 rounds
    assert len(ev.calls) == 3 and ev.calls[1] == ev.calls[2] == ["neuroshard", "size_lookup_greedy", "lookup_greedy"]
    assert g.decision["contenders"] == ["size_lookup_greedy", "lookup_greedy"]
    assert g.decision["heuristic"] == "size_lookup_greedy"  # equal means: the first
    assert g.decision["verdict"] == "better" and g.decision["rounds"] == 3
    assert g.decision["ratio"]["mean"] == pytest.approx(0.5) and g.decision["ratio"]["high"] == pytest.approx(0.5)
    # the search's own pick wins: the returned plan is the search's best, not changed
    assert g.chosen == "neuroshard#1" and not g.changed
    assert plan.shards == s.last_search_pick.shards and plan.algorithm == "neuroshard"
    validate(task, plan)


def test_guard_keeps_the_heuristic_when_the_search_is_worse():
    s = NeuroShardSharder(checkpoint=None, verify_heuristics=["lookup_greedy"])
    ev = CostByAlgorithm({"neuroshard": 3.0, "lookup_greedy": 2.0}, default=9.0)
    s.attach_evaluator(ev)
    task = task_of(TABLES)
    plan = s.shard(task)
    g = s.last_guard
    assert g.decision["verdict"] == "worse" and g.chosen == "lookup_greedy" and g.changed
    from embshard.search.baselines import GreedySharder

    assert plan.signature() == GreedySharder("lookup").shard(task).signature() and plan.algorithm == "neuroshard"


def test_guard_same_plan_verdict_measures_once():
    # one table on one device: the search and every heuristic give the same plan
    task = task_of([Table("only", 1000, 8, 1.0)], devices=1)
    s = NeuroShardSharder(checkpoint=None, verify=2, verify_heuristics=["size_greedy", "random"])
    ev = CostByAlgorithm({}, default=1.0)
    s.attach_evaluator(ev)
    plan = s.shard(task)
    g = s.last_guard
    assert g.decision == {"verdict": "same plan", "kept": "neuroshard#1", "heuristic": "size_greedy"}
    assert len(ev.calls) == 1 and ev.calls[0] == ["neuroshard"]  # identical plans measured once
    assert [c["same_as"] for c in g.candidates] == ["neuroshard#1"] * 3
    assert plan.shards == s.last_search_pick.shards


def test_guard_without_a_heuristic_plan_keeps_the_search_pick(monkeypatch):
    # heuristics that find no plan (a whole-table planner now cuts a table too large for a
    # device, so the real ones plan this task: tests/test_fit_cuts.py); the search splits it
    import embshard.search.guard as guard_module
    from embshard.errors import InfeasibleError

    class Nowhere:
        from embshard.search.base import WHOLE_TABLES as capabilities

        def shard(self, task):
            raise InfeasibleError("table 'big' needs 9 bytes but the most free memory on any device is 1 byte "
                                  "(device 0): short by 8 bytes", table="big", shortfall_bytes=8)

    monkeypatch.setattr(guard_module, "heuristic_sharders", lambda: {h: Nowhere for h in HEURISTICS})
    big = Table("big", 200_000, 64, 5.0)
    task = Task("g", 2, 40_000_000, 512, (big, Table("s", 1000, 8, 1.0)))
    assert task.table_memory_bytes(big) > task.device_memory_bytes
    s = NeuroShardSharder(checkpoint=None, verify=1)
    ev = CostByAlgorithm({}, default=1.0)
    s.attach_evaluator(ev)
    plan = s.shard(task)
    assert s.last_guard.decision == {"verdict": "no heuristic plan", "kept": "neuroshard#1"}
    assert [c["label"] for c in s.last_guard.candidates] == ["neuroshard#1"] and len(ev.calls) == 1
    # each heuristic left out is named in report.json's guard, with the reason
    skipped = s.last_guard.to_dict()["skipped"]
    assert sorted(skipped) == sorted(HEURISTICS)
    assert all("'big'" in why and "short by" in why for why in skipped.values())
    validate(task, plan)


def test_verify_without_an_evaluator_is_an_input_error():
    s = NeuroShardSharder(checkpoint=None, verify=2)
    with pytest.raises(InputError, match=r"^neuroshard: verify > 0 needs a hardware evaluator \(shard.py "
                                         r"evaluate=measured attaches one; or set searchers.neuroshard.verify=0\)$"):
        s.shard(task_of(TABLES))
    for bad in (-1, True, "3", 1.5):
        with pytest.raises(InputError, match="verify must be 'auto' or an integer >= 0"):
            NeuroShardSharder(checkpoint=None, verify=bad)


class CostsPerRound:
    """Measures plan `p` at the next of `costs[p.algorithm]` each time it is measured (the last
    value repeats): round 1 first, then the paired rounds."""

    def __init__(self, costs: dict[str, list[float]]):
        self.costs = {k: list(v) for k, v in costs.items()}
        self.calls: list[list[str]] = []

    def measure_many(self, task, plans, visits=None):
        self.calls.append([p.algorithm for p in plans])
        out = []
        for p in plans:
            seq = self.costs[p.algorithm]
            ms = seq.pop(0) if len(seq) > 1 else seq[0]
            out.append(DeviceCosts([ms] * task.num_devices, [0.0] * task.num_devices, [0.0] * task.num_devices))
        return out


def test_the_best_heuristic_is_the_lowest_mean_over_the_rounds_not_round_one():
    # round 1 puts size_lookup_greedy (9.0) ahead of lookup_greedy (9.5); every later round
    # measures lookup_greedy ~9.0 and size_lookup_greedy ~10.5. The search's plan (10.0) is
    # then worse than the best heuristic, lookup_greedy (mean (9.5 + 9.0 + 9.1) / 3 = 9.2,
    # against (9.0 + 10.5 + 10.6) / 3 = 10.03), and that is the plan kept; the rule of round 1
    # alone would have kept size_lookup_greedy.
    s = NeuroShardSharder(checkpoint=None, verify=1, verify_heuristics=["size_lookup_greedy", "lookup_greedy"],
                          verify_min_rounds=3, verify_max_rounds=3)
    ev = CostsPerRound({"neuroshard": [10.0], "size_lookup_greedy": [9.0, 10.5, 10.6],
                        "lookup_greedy": [9.5, 9.0, 9.1]})
    s.attach_evaluator(ev)
    task = task_of(TABLES)
    plan = s.shard(task)
    d = s.last_guard.decision
    assert d["contenders"] == ["size_lookup_greedy", "lookup_greedy"]  # 9.5 is within 10% of 9.0
    assert d["heuristic"] == "lookup_greedy" and d["kept"] == "lookup_greedy" and d["rounds"] == 3
    # S / lookup_greedy per round: 10 / 9.5, 10 / 9.0, 10 / 9.1
    assert d["ratio"]["mean"] == pytest.approx((10 / 9.5 + 10 / 9.0 + 10 / 9.1) / 3)
    from embshard.search.baselines import GreedySharder

    assert plan.shards == GreedySharder("lookup").shard(task).shards


def test_a_heuristic_beyond_the_margin_leaves_the_paired_rounds():
    s = NeuroShardSharder(checkpoint=None, verify=1, verify_heuristics=["size_lookup_greedy", "lookup_greedy"],
                          verify_min_rounds=3, verify_max_rounds=3)
    ev = CostsPerRound({"neuroshard": [5.0], "size_lookup_greedy": [9.0], "lookup_greedy": [9.91]})  # > 1.1 x 9.0
    s.attach_evaluator(ev)
    s.shard(task_of(TABLES))
    assert s.last_guard.decision["contenders"] == ["size_lookup_greedy"]
    assert ev.calls[1:] == [["neuroshard", "size_lookup_greedy"]] * 2
