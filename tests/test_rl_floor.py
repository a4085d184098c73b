"""DreamShard's and AutoShard's heuristic floor (`floor`, embshard.search.floor): their pick is
never a plan their judge (NeuroShard's cost models) prices above a heuristic's plan, on a task
where DreamShard's policy does end above one (heavy-tailed pooling: `scripts/heavy_tasks.py`)."""

from __future__ import annotations

import pytest

from conftest import heavy_task
from embshard import InputError, validate
from embshard.costs.predictor import DEFAULT_CHECKPOINT
from embshard.search.floor import HeuristicFloor
from embshard.search.guard import DEFAULT_HEURISTICS, heuristic_plans
from embshard.search.portfolio import PortfolioSharder
from embshard.search.rl.sharders import AutoShardSharder, DreamShardSharder

DREAMSHARD = "checkpoints/dreamshard_cpu/policy.pt"


@pytest.fixture(scope="module")
def task():
    t = heavy_task(640, 1)
    assert (len(t.tables), t.num_devices) == (35, 4)
    return t


def dreamshard(**kw) -> DreamShardSharder:
    return DreamShardSharder(DREAMSHARD, samples=8, split_columns=True, split_judge=DEFAULT_CHECKPOINT,
                             judge_samples=True, **kw)


def test_the_pick_is_never_priced_above_a_heuristics_plan_where_the_policy_ends_above_one(task):
    alone = dreamshard()
    pick = alone.shard(task)
    assert "floor" not in alone.last_search_info  # off unless asked for
    floored = dreamshard(floor=DEFAULT_HEURISTICS)
    plan = floored.shard(task)
    validate(task, plan)
    judge = floored._judge_model()
    info = floored.last_search_info["floor"]
    priced = info["heuristics_ms"]
    assert set(priced) == set(DEFAULT_HEURISTICS)
    # the precondition that makes this task a test: the policy's pick is dearer by the judge
    assert judge.device_costs(task, pick).plan_cost_ms > 1.05 * min(priced.values())
    assert info["search_ms"] == pytest.approx(judge.device_costs(task, pick).plan_cost_ms, rel=1e-4)
    assert info["kept"] == min(priced, key=priced.get)
    hp, _ = heuristic_plans([info["kept"]], task, "test")
    assert plan.signature() == hp[info["kept"]].signature()
    assert plan.algorithm == "dreamshard"
    assert floored.last_search_pick.signature() == plan.signature()
    # the estimate reported is of the plan returned (the agent replays the heuristic's plan)
    assert floored.last_predicted_cost_ms != alone.last_predicted_cost_ms


def test_without_a_judge_the_floor_is_skipped_and_says_so(task):
    rl = AutoShardSharder("checkpoints/autoshard_cpu/policy.pt", samples=0, floor=DEFAULT_HEURISTICS)
    plan = rl.shard(task)
    assert rl.last_search_info["floor"] == {"skipped": "no split_judge to price the plans with"}
    assert plan.signature() == AutoShardSharder("checkpoints/autoshard_cpu/policy.pt", samples=0).shard(task).signature()


@pytest.mark.parametrize("kw, text", [
    ({"floor": ["bogus"]}, "floor must list heuristics"),
    ({"floor_margin": 1.5}, "floor_margin must be a number in [0, 1)"),
    ({"floor_max_work": 0}, "floor_max_work must be an integer >= 1 or null"),
])
def test_bad_floor_settings_are_one_line_errors_naming_the_planner(kw, text):
    with pytest.raises(InputError) as e:
        dreamshard(**kw)
    assert text in str(e.value) and str(e.value).startswith("dreamshard:") and "\n" not in str(e.value)


def test_the_portfolio_turns_its_rl_members_floors_off():
    member = dreamshard(floor=DEFAULT_HEURISTICS)
    assert member.floor
    PortfolioSharder(members={"dreamshard": member}, verify=0)
    assert isinstance(member.floor, HeuristicFloor) and not member.floor


class Recorder:
    """Measures every plan at 10 ms but `cheap` at 5 (paired jitter), recording round 1's plans."""

    def __init__(self, cheap: tuple):
        self.cheap, self.first, self.calls = cheap, None, 0

    def measure_many(self, task, plans, visits=None):
        from embshard.costs.base import DeviceCosts

        self.calls += 1
        if self.first is None:
            self.first = [p.signature() for p in plans]
        jitter = 1.0 + 0.002 * (self.calls % 3)
        return [DeviceCosts([(5.0 if p.signature() == self.cheap else 10.0) * jitter], [0.0], [0.0]) for p in plans]


def test_the_guard_measures_the_policys_own_pick_not_the_floors_plan(task):
    pick = dreamshard().shard(task)
    guarded = dreamshard(floor=DEFAULT_HEURISTICS, verify=2, verify_min_rounds=3, verify_max_rounds=4)
    measurer = Recorder(pick.signature())
    guarded.attach_evaluator(measurer)
    plan = guarded.shard(task)
    assert guarded.last_search_info["floor"]["kept"] != "search"  # the floor did return a heuristic's plan
    assert guarded.last_search_pick.signature() != pick.signature()
    # round 1 measured the policy's pick as dreamshard#1, and the guard kept it (measured cheapest)
    assert measurer.first[0] == pick.signature()
    assert guarded.last_guard.chosen == "dreamshard#1" and plan.signature() == pick.signature()


@pytest.mark.parametrize("algorithm", ["dreamshard", "autoshard"])
def test_the_floor_is_on_in_the_shipped_config(algorithm):
    from embshard.api import searcher

    s = searcher(algorithm)
    assert s.floor.heuristics == DEFAULT_HEURISTICS and s.split_judge is not None
    assert not searcher(algorithm, floor=[]).floor
