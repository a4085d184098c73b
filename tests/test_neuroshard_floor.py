"""NeuroShard's heuristic floor (`floor`): its pick is never a plan its own models price above a
heuristic's plan, on a task where its greedy does end above one (heavy-tailed pooling, 2 devices,
tight memory: `scripts/heavy_tasks.py`)."""

from __future__ import annotations

import pytest

from conftest import heavy_task
from embshard import InputError, Table, Task, validate
from embshard.search.guard import heuristic_plans
from embshard.search.neuroshard import NeuroShardSharder
from embshard.search.portfolio import PortfolioSharder


@pytest.fixture(scope="module")
def tight() -> Task:
    task = heavy_task(631, 1)  # 65 tables on 2 devices, memory 1.3x an even share
    assert (len(task.tables), task.num_devices) == (65, 2)
    return task


def small_task() -> Task:
    tables = tuple(Table(f"t{i}", 2000 * (i + 1), 8 * (1 + i % 4), 1.0 + 3 * i) for i in range(8))
    return Task("small", 2, 256 * 2**20, 2048, tables)


def test_the_pick_is_never_priced_above_a_heuristics_plan_where_the_search_ends_above_one(tight):
    searched = NeuroShardSharder(verify=0, floor=())
    alone = searched.shard(tight)
    floored = NeuroShardSharder(verify=0)
    plan = floored.shard(tight)
    validate(tight, plan)
    info = floored.last_search_info["floor"]
    priced = info["heuristics_ms"]
    assert set(priced) == set(floored.floor.heuristics)
    # the precondition that makes this task a test: the search alone ends above a heuristic
    assert searched.predicted_costs(tight, alone).plan_cost_ms > min(priced.values()) * 1.01
    assert info["kept"] == min(priced, key=priced.get)
    assert plan.algorithm == "neuroshard"
    own = floored.predicted_costs(tight, plan).plan_cost_ms
    assert own == pytest.approx(min(priced.values()), rel=1e-6)
    assert own < searched.predicted_costs(tight, alone).plan_cost_ms
    # the plan returned is that heuristic's, shard for shard
    hp, _ = heuristic_plans([info["kept"]], tight, "test")
    assert plan.signature() == hp[info["kept"]].signature()
    assert floored.last_search_pick.signature() == plan.signature()


def test_the_search_keeps_its_pick_where_it_is_cheaper_and_a_margin_gives_it_up():
    task = small_task()
    ns = NeuroShardSharder(verify=0)
    plan = ns.shard(task)
    info = ns.last_search_info["floor"]
    assert info["kept"] == "search" and info["search_ms"] <= min(info["heuristics_ms"].values())
    assert plan.signature() == NeuroShardSharder(verify=0, floor=()).shard(task).signature()
    # a margin the search cannot meet: the cheapest heuristic's plan
    wide = NeuroShardSharder(verify=0, floor_margin=0.99)
    got = wide.shard(task)
    kept = wide.last_search_info["floor"]["kept"]
    assert kept in wide.floor.heuristics
    hp, _ = heuristic_plans([kept], task, "test")
    assert got.signature() == hp[kept].signature()


def test_the_floor_is_skipped_above_its_work_and_off_when_empty():
    task = small_task()
    ns = NeuroShardSharder(verify=0, floor_max_work=len(task.tables) * task.num_devices - 1, floor_margin=0.99)
    plan = ns.shard(task)
    assert "floor_max_work" in ns.last_search_info["floor"]["skipped"]
    assert plan.signature() == NeuroShardSharder(verify=0, floor=()).shard(task).signature()
    off = NeuroShardSharder(verify=0, floor=[])
    off.shard(task)
    assert "floor" not in off.last_search_info


@pytest.mark.parametrize("kw, text", [
    ({"floor": ["size_greedy", "bogus"]}, "floor must list heuristics"),
    ({"floor": "size_greedy"}, "floor must list heuristics"),
    ({"floor_margin": 1.0}, "floor_margin must be a number in [0, 1)"),
    ({"floor_margin": -0.1}, "floor_margin must be a number in [0, 1)"),
    ({"floor_margin": True}, "floor_margin must be a number in [0, 1)"),
    ({"floor_max_work": 0}, "floor_max_work must be an integer >= 1 or null"),
    ({"floor_max_work": "many"}, "floor_max_work must be an integer >= 1 or null"),
])
def test_bad_floor_settings_are_one_line_errors(kw, text):
    with pytest.raises(InputError) as e:
        NeuroShardSharder(verify=0, **kw)
    assert text in str(e.value) and "\n" not in str(e.value)


def test_the_portfolio_turns_its_neuroshard_members_floor_off():
    member = NeuroShardSharder(verify=0)
    assert member.floor
    PortfolioSharder(members={"neuroshard": member}, verify=0)
    assert not member.floor and member.floor.heuristics == ()
