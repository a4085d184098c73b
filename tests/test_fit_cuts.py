"""Whole-table planners and tables too large for one device (search/constrained.py): cut first,
as TorchRec would shard them, within their sharding_types; a table that fits is never cut."""

from __future__ import annotations

import pytest

from embshard import Table, Task
from embshard.errors import InfeasibleError
from embshard.layouts import even_row_layout
from embshard.plan import validate
from embshard.search.baselines import GreedySharder
from embshard.search.constrained import MAX_FIT_SHRINK, fit_kind, fit_kinds, reduce_task, shard_constrained
from embshard.search.guard import MeasuredGuard

MB = 10**6
SMALL = tuple(Table(f"s{i}", 2_000, 16, 2.0) for i in range(6))


def sharder():
    return GreedySharder("size", name="size_greedy")


def test_a_task_whose_tables_all_fit_is_planned_as_before():
    task = Task("fits", 4, 40 * MB, 256, (Table("big", 100_000, 64, 1.0), *SMALL))
    assert not fit_kinds(task)
    assert shard_constrained(sharder(), task).shards == sharder().shard(task).shards


def test_a_table_too_large_is_cut_into_the_widest_equal_column_slices_that_fit():
    big = Table("big", 300_000, 64, 1.0)  # ~77 MB whole, ~38 MB a half, ~19 MB a quarter
    task = Task("cut", 4, 40 * MB, 256, (big, *SMALL))
    assert task.shard_memory_bytes(big, big.rows, 32) <= task.device_memory_bytes < task.table_memory_bytes(big)
    assert fit_kind(task, big) == ("column", 32)
    assert fit_kind(task, big, shrink=1) == ("column", 16)  # within half a device
    plan = shard_constrained(sharder(), task)
    validate(task, plan)
    cut = sorted((s.col_offset, s.dim, s.rows, s.device) for s in plan.shards if s.table == "big")
    assert [c[:3] for c in cut] == [(0, 32, big.rows), (32, 32, big.rows)] and cut[0][3] != cut[1][3]
    assert plan.algorithm == "size_greedy"


def test_without_column_wise_a_table_too_large_takes_torchrec_row_blocks():
    big = Table("big", 300_000, 64, 1.0, sharding_types=("table_wise", "row_wise"))
    task = Task("rows", 4, 40 * MB, 256, (big, *SMALL))
    assert fit_kind(task, big) == ("row_wise", 0)
    plan = shard_constrained(sharder(), task)
    blocks = sorted((s.row_offset, s.rows, s.device, s.dim) for s in plan.shards if s.table == "big")
    assert [(off, n) for off, n, _, _ in blocks] == even_row_layout(big.rows, 4)
    assert sorted(d for _, _, d, _ in blocks) == [0, 1, 2, 3] and {w for *_, w in blocks} == {64}
    # on two hosts, a table allowed only table_row_wise takes the blocks of one host
    hosted = Table("big", 300_000, 64, 1.0, sharding_types=("table_wise", "table_row_wise"))
    two = Task("rows2", 4, 40 * MB, 256, (hosted, *SMALL), devices_per_host=2)
    assert fit_kind(two, two.tables[0]) == ("table_row_wise", 0)
    plan = shard_constrained(sharder(), two)
    devs = sorted(s.device for s in plan.shards if s.table == "big")
    assert devs in ([0, 1], [2, 3])


def test_slices_that_do_not_pack_are_halved_and_searched_again():
    # the two halves of `big` (0.64 of a device each) and `mid` (0.58) do not pack on 2 devices;
    # its quarters (0.32 each) beside `mid` do
    big = Table("big", 200_000, 64, 1.0)
    mid = Table("mid", 90_000, 64, 1.0)
    task = Task("repack", 2, 40 * MB, 64, (big, mid))
    half, quarter = (task.shard_memory_bytes(big, big.rows, w) for w in (32, 16))
    assert task.table_memory_bytes(mid) + half > task.device_memory_bytes >= task.table_memory_bytes(mid) + quarter
    assert fit_kind(task, big) == ("column", 32)
    with pytest.raises(InfeasibleError):
        sharder().shard(reduce_task(task, fit=True).task)  # the widest slices alone: no plan
    plan = shard_constrained(sharder(), task)
    validate(task, plan)
    cut = [s for s in plan.shards if s.table == "big"]
    assert sum(s.dim for s in cut) == 64 and all(s.rows == big.rows for s in cut) and len(cut) >= 2
    assert max(plan.memory_bytes(task)) <= task.device_memory_bytes
    assert MAX_FIT_SHRINK >= 1


def test_a_sequence_table_and_a_splitting_planner_are_left_as_they_are():
    seq = Table("seq", 300_000, 64, 1.0, kind="sequence")
    task = Task("seq", 4, 40 * MB, 256, (seq, *SMALL))
    assert fit_kind(task, seq) is None
    with pytest.raises(InfeasibleError, match="'seq'"):
        shard_constrained(sharder(), task)


def test_the_guard_measures_heuristic_plans_of_a_task_with_a_table_too_large():
    big = Table("big", 300_000, 64, 1.0)
    task = Task("g", 4, 40 * MB, 256, (big, *SMALL))

    class Unit:
        def measure_many(self, task, plans, visits=None):
            from embshard.costs.base import DeviceCosts
            return [DeviceCosts([1.0] * task.num_devices, [0.0] * task.num_devices, [0.0] * task.num_devices)
                    for _ in plans]

    guard = MeasuredGuard(["size_greedy", "lookup_greedy"], owner="test")
    plan, result = guard.run(task, [("mine#1", shard_constrained(sharder(), task))], Unit(),
                             lambda p: None, "mine")
    assert not result.to_dict().get("skipped")  # both heuristics planned it, cut


def test_the_portfolio_cuts_a_table_too_large_for_its_whole_table_members():
    from embshard.search.baselines import RoundRobinSharder
    from embshard.search.portfolio import PortfolioSharder

    task = Task("p", 4, 40 * MB, 256, (Table("big", 300_000, 64, 1.0), *SMALL))
    p = PortfolioSharder({"size_greedy": sharder(), "round_robin": RoundRobinSharder()}, ranker=None)
    plan = p.shard(task)
    validate(task, plan)
    rows = p.last_search_info["portfolio"]["members"]
    assert [r["valid"] for r in rows] == [True, True], rows
    assert len([s for s in plan.shards if s.table == "big"]) == 2
