"""TorchRec bridge: task -> EBC, Plan <-> ShardingPlan, TorchRec's planner as a Sharder,
and the exported plan running under DistributedModelParallel (2 gloo processes, CPU)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embshard.errors import InfeasibleError, InputError, PlanError
from embshard.plan import Plan, Shard, validate
from embshard.search.base import Sharder
from embshard.search.torchrec_planner import TorchRecPlanner
from embshard.tables import Table
from embshard.task import Task
from embshard.torchrec_bridge import plan_from_torchrec, plan_to_torchrec, task_to_ebc

GiB = 1 << 30


def _task(num_devices: int = 2, memory: int = GiB, batch: int = 64, **kw) -> Task:
    tables = (
        Table("tw0", 50, 8, 2.0),
        Table("tw1", 60, 12, 3.0),
        Table("cw", 40, 24, 2.0),
        Table("rw", 33, 16, 1.5),
        Table("fp16", 70, 8, 2.0, bytes_per_element=2),
        Table("grid", 41, 24, 2.0),
    )
    return Task("bridge", num_devices, memory, batch, tables, **kw)


def _mixed_plan(task: Task) -> Plan:
    """Table-wise, uneven column-wise (on ranks 1 then 0), TorchRec-layout row-wise, and a
    grid (two uneven column slices, each row-split over both ranks)."""
    return Plan(
        task.name,
        "manual",
        [
            Shard("tw0", 1, 0, 8, 0, 50),
            Shard("tw1", 0, 0, 12, 0, 60),
            Shard("cw", 1, 0, 8, 0, 40),
            Shard("cw", 0, 8, 16, 0, 40),
            Shard("rw", 0, 0, 16, 0, 17),  # ceil(33 / 2) = 17
            Shard("rw", 1, 0, 16, 17, 16),
            Shard("fp16", 0, 0, 8, 0, 70),
            Shard("grid", 0, 0, 8, 0, 21),  # ceil(41 / 2) = 21
            Shard("grid", 1, 0, 8, 21, 20),
            Shard("grid", 0, 8, 16, 0, 21),
            Shard("grid", 1, 8, 16, 21, 20),
        ],
    )


def _key(plan: Plan) -> list[tuple]:
    return sorted((s.table, s.device, s.col_offset, s.dim, s.row_offset, s.rows) for s in plan.shards)


# ---------------------------------------------------------------------------- task -> EBC
def test_task_to_ebc_matches_tables():
    task = _task()
    ebc = task_to_ebc(task)
    for t in task.tables:
        w = ebc.embedding_bags[t.name].weight
        assert tuple(w.shape) == (t.rows, t.dim)
        assert w.device.type == "meta"
        assert w.dtype == (torch.float16 if t.bytes_per_element == 2 else torch.float32)
    assert [c.feature_names for c in ebc.embedding_bag_configs()] == [[t.name] for t in task.tables]


def test_task_to_ebc_rejects_int8_tables():
    task = Task("q", 1, GiB, 8, (Table("q8", 10, 4, 1.0, bytes_per_element=1),))
    with pytest.raises(InputError, match="q8"):
        task_to_ebc(task)


@pytest.mark.parametrize("name", ["half", "train", "a.b"])
def test_task_to_ebc_rejects_names_torchrec_cannot_hold(name):
    task = Task("n", 1, GiB, 8, (Table(name, 10, 4, 1.0),))
    with pytest.raises(InputError, match="rename"):
        task_to_ebc(task)


# ---------------------------------------------------------------------------- round trips
def test_round_trip_mixed_plan():
    task = _task()
    plan = _mixed_plan(task)
    validate(task, plan)
    sp = plan_to_torchrec(task, plan)
    module_plan = sp.plan[""]
    kinds = {name: ps.sharding_type for name, ps in module_plan.items()}
    assert kinds == {"tw0": "table_wise", "tw1": "table_wise", "cw": "column_wise",
                     "rw": "row_wise", "fp16": "table_wise", "grid": "grid_shard"}
    assert all(ps.compute_kernel == "fused" for ps in module_plan.values())
    assert module_plan["cw"].ranks == [1, 0]
    assert [m.shard_sizes for m in module_plan["cw"].sharding_spec.shards] == [[40, 8], [40, 16]]
    assert str(module_plan["rw"].sharding_spec.shards[1].placement) == "rank:1/cpu"
    assert module_plan["grid"].ranks == [0, 1, 0, 1]
    back = plan_from_torchrec(task, sp, algorithm="manual")
    assert _key(back) == _key(plan)
    validate(task, back)


@pytest.mark.parametrize(
    "shards",
    [
        # table-wise everywhere
        [("a", 0, 0, 16, 0, 100), ("b", 1, 0, 32, 0, 10), ("c", 2, 0, 8, 0, 7), ("d", 3, 0, 12, 0, 1000)],
        # uneven column-wise, two pieces of one table on one rank
        [("a", 3, 0, 4, 0, 100), ("a", 1, 4, 8, 0, 100), ("a", 3, 12, 4, 0, 100),
         ("b", 0, 0, 32, 0, 10), ("c", 2, 0, 8, 0, 7), ("d", 0, 0, 12, 0, 1000)],
        # row-wise over 4 ranks, including a trailing empty block (7 rows -> 2, 2, 2, 1)
        [("a", 0, 0, 16, 0, 25), ("a", 1, 0, 16, 25, 25), ("a", 2, 0, 16, 50, 25), ("a", 3, 0, 16, 75, 25),
         ("b", 1, 0, 32, 0, 10), ("c", 0, 0, 8, 0, 2), ("c", 1, 0, 8, 2, 2), ("c", 2, 0, 8, 4, 2),
         ("c", 3, 0, 8, 6, 1), ("d", 2, 0, 12, 0, 1000)],
    ],
    ids=["table_wise", "column_wise_uneven", "row_wise"],
)
def test_round_trip_four_devices(shards):
    task = Task("rt", 4, GiB, 32, (Table("a", 100, 16, 1.0), Table("b", 10, 32, 1.0),
                                    Table("c", 7, 8, 1.0), Table("d", 1000, 12, 1.0)))
    plan = Plan("rt", "x", [Shard(*s) for s in shards])
    validate(task, plan)
    sp = plan_to_torchrec(task, plan, device_type="cuda", module_path="model.sparse.ebc")
    assert set(sp.plan) == {"model.sparse.ebc"}
    for ps in sp.plan["model.sparse.ebc"].values():
        for md, rank in zip(ps.sharding_spec.shards, ps.ranks):
            assert str(md.placement) == f"rank:{rank}/cuda:{rank}"
    back = plan_from_torchrec(task, sp, algorithm="x")
    assert _key(back) == _key(plan)


def test_row_wise_on_one_host_is_table_row_wise():
    task = Task("twrw", 4, GiB, 32, (Table("a", 100, 16, 1.0), Table("b", 10, 8, 1.0)), devices_per_host=2)
    plan = Plan("twrw", "x", [Shard("a", 2, 0, 16, 0, 50), Shard("a", 3, 0, 16, 50, 50), Shard("b", 0, 0, 8, 0, 10)])
    sp = plan_to_torchrec(task, plan)
    assert sp.plan[""]["a"].sharding_type == "table_row_wise"
    assert sp.plan[""]["a"].ranks == [2, 3]
    assert _key(plan_from_torchrec(task, sp, algorithm="x")) == _key(plan)


@pytest.mark.parametrize(
    "shards, match",
    [
        ([("a", 0, 0, 16, 0, 30), ("a", 1, 0, 16, 30, 70)], "row split"),          # uneven rows
        ([("a", 1, 0, 16, 0, 50), ("a", 0, 0, 16, 50, 50)], "row split"),          # reversed ranks
        ([("a", 0, 0, 8, 0, 50), ("a", 1, 0, 8, 50, 50), ("a", 0, 8, 8, 0, 100)], "rows and by columns"),
    ],
    ids=["uneven_rows", "reordered_rows", "grid"],
)
def test_export_rejects_what_torchrec_cannot_train(shards, match):
    task = Task("bad", 2, GiB, 32, (Table("a", 100, 16, 1.0), Table("b", 10, 8, 1.0)))
    plan = Plan("bad", "x", [Shard(*s) for s in shards] + [Shard("b", 0, 0, 8, 0, 10)])
    validate(task, plan)
    with pytest.raises(PlanError, match=f"table 'a'.*{match}") as e:
        plan_to_torchrec(task, plan)
    assert "\n" not in str(e.value)


def test_export_validates_first():
    task = _task()
    plan = _mixed_plan(task)
    plan.shards = [s for s in plan.shards if s.table != "fp16"]
    with pytest.raises(PlanError, match="fp16"):
        plan_to_torchrec(task, plan)


def test_import_data_parallel_as_replicas_and_rejects_missing_tables():
    """data_parallel imports as the whole table on every rank (replicas, counted in memory on
    each) and exports back as data_parallel with TorchRec's dense kernel."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise

    task = _task()
    ebc = task_to_ebc(task)
    gens = {t.name: table_wise(rank=0) for t in task.tables}
    gens["cw"] = data_parallel()
    mp = construct_module_sharding_plan(ebc, gens, local_size=2, world_size=2, device_type="cpu")
    plan = plan_from_torchrec(task, {"": mp})
    validate(task, plan)
    cw = sorted((s.device, s.replica, s.rows, s.dim) for s in plan.shards if s.table == "cw")
    assert cw == [(0, 0, 40, 24), (1, 1, 40, 24)]
    one_copy = task.shard_memory_bytes(task.table("cw"), 40, 24, copies=2)
    alone = Plan(task.name, "x", [s for s in plan.shards if s.table == "cw"])
    assert alone.memory_bytes(task) == [one_copy, one_copy]
    assert alone.device_widths(2) == [0, 0]  # replicas pool their own samples: no all-to-all
    back = plan_to_torchrec(task, plan)
    assert back.plan[""]["cw"].sharding_type == "data_parallel"
    assert back.plan[""]["cw"].compute_kernel == "dense" and back.plan[""]["cw"].ranks == [0, 1]
    del mp["cw"]
    with pytest.raises(PlanError, match="'cw' is missing"):
        plan_from_torchrec(task, {"": mp})


def test_export_rejects_replicas_on_some_ranks_only():
    task = _task(num_devices=3)
    shards = [Shard(t.name, 0, 0, t.dim, 0, t.rows) for t in task.tables]
    shards.append(Shard("cw", 1, 0, 24, 0, 40, replica=1))  # on ranks 0 and 1 of 3
    plan = Plan(task.name, "x", shards)
    validate(task, plan)
    with pytest.raises(PlanError, match="'cw'.*data_parallel") as e:
        plan_to_torchrec(task, plan)
    assert "\n" not in str(e.value)


def test_import_torchrec_helper_plans():
    """Plans made with TorchRec's own helpers (even column split, row_wise over 2) import."""
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise

    task = _task()
    ebc = task_to_ebc(task)
    gens = {t.name: table_wise(rank=1) for t in task.tables}
    gens["cw"] = column_wise(ranks=[0, 1, 0])
    gens["rw"] = row_wise()
    mp = construct_module_sharding_plan(ebc, gens, local_size=2, world_size=2, device_type="cpu")
    plan = plan_from_torchrec(task, {"": mp})
    validate(task, plan)
    cw = sorted((s.col_offset, s.dim, s.device) for s in plan.shards if s.table == "cw")
    assert cw == [(0, 8, 0), (8, 8, 1), (16, 8, 0)]
    rw = sorted((s.row_offset, s.rows, s.device) for s in plan.shards if s.table == "rw")
    assert rw == [(0, 17, 0), (17, 16, 1)]


# ---------------------------------------------------------------------------- planner
def _planner_task(memory: int, num_devices: int = 2, batch: int = 512) -> Task:
    tables = tuple(
        Table(f"t{i}", rows, dim, pf)
        for i, (rows, dim, pf) in enumerate(
            [(20_000, 64, 4.0), (5_000, 32, 10.0), (100_000, 16, 2.0), (1_000, 128, 20.0),
             (50_000, 32, 1.0), (2_000, 64, 8.0)]
        )
    )
    return Task("planner-6", num_devices, memory, batch, tables)


def test_torchrec_planner_returns_valid_plan_and_time():
    planner = TorchRecPlanner()
    assert isinstance(planner, Sharder) and planner.name == "torchrec"
    task = _planner_task(GiB)
    plan = planner.shard(task)
    validate(task, plan)
    assert plan.algorithm == "torchrec" and plan.task == task.name
    assert {s.table for s in plan.shards} == {t.name for t in task.tables}
    assert planner.last_search_seconds is not None and planner.last_search_seconds > 0
    assert planner.last_attempts >= 1
    plan_to_torchrec(task, plan, device_type="cuda")  # whatever TorchRec chose is exportable


def test_torchrec_planner_restricted_types_and_cpu():
    task = _planner_task(GiB)
    plan = TorchRecPlanner(sharding_types=("table_wise",), compute_device="cpu").shard(task)
    validate(task, plan)
    assert len(plan.shards) == len(task.tables)
    dp = TorchRecPlanner(sharding_types=("data_parallel",), compute_device="cpu").shard(task)
    validate(task, dp)
    assert {s.replica for s in dp.shards} == {0, 1} and len(dp.shards) == 2 * len(task.tables)


def test_torchrec_planner_tight_memory_stays_within_our_model():
    """Close to the limit TorchRec's storage model (one pooled output, not two) would
    overflow ours; the planner must still return a plan that passes our validate, or
    say it cannot."""
    big = Task("io", 2, 1 << 40, 65536, tuple(Table(f"t{i}", 1000 * (i + 1), 64, 2.0) for i in range(6)))
    need = sum(big.table_memory_bytes(t) for t in big.tables)
    for frac in (0.6, 0.52):
        task = Task("io", 2, int(need * frac), 65536, big.tables)
        planner = TorchRecPlanner()
        try:
            plan = planner.shard(task)
        except InfeasibleError as e:
            assert "over by" in str(e) or "no plan" in str(e)
        else:
            validate(task, plan)
            assert max(plan.memory_bytes(task)) <= task.device_memory_bytes


def test_torchrec_planner_out_of_memory_is_infeasible_error():
    task = _planner_task(2_000_000)
    with pytest.raises(InfeasibleError) as e:
        TorchRecPlanner().shard(task)
    msg = str(e.value)
    assert "\n" not in msg and "planner-6" in msg
    assert e.value.table is not None


# ---------------------------------------------------------------------------- DMP
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_exported_plan_runs_under_distributed_model_parallel(tmp_path: Path):
    """THE KEY TEST: 2 gloo processes, fused FBGEMM kernel on CPU, a plan mixing
    table-wise, uneven column-wise, row-wise and grid shards and an fp16 table: the pooled embeddings equal the
    unsharded EmbeddingBagCollection's with the same weights."""
    task = _task()
    plan = _mixed_plan(task)
    _run_dmp_workers(tmp_path, task, plan, 2, None)

    total_cells = sum(t.rows * t.dim for t in task.tables)
    copied = 0
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        copied += result["copied_cells"]
        assert sorted(result["keys"]) == sorted(t.name for t in task.tables)
        for name in result["keys"]:
            got, want = result["sharded"][name], result["expected"][name]
            assert got.shape == want.shape == (5, task.table(name).dim)
            assert want.abs().sum() > 0, "reference output is all zeros: the test would prove nothing"
            assert torch.allclose(got.float(), want.float(), atol=1e-3, rtol=1e-3), (
                f"rank {rank} table {name}: max diff {(got.float() - want.float()).abs().max()}"
            )
    assert copied == total_cells  # every cell of every table lives on exactly one rank
    _check_training_step(tmp_path, 2, task)


def _check_training_step(out_dir: Path, world_size: int, task: Task) -> None:
    """Every rank's shards after one step equal the reference's rows and columns after one SGD
    step on all ranks' batches (fp16 weights to fp16 precision); every cell is checked once."""
    checked = 0
    for rank in range(world_size):
        for u in torch.load(out_dir / f"rank{rank}.pt")["updated"]:
            fp16 = task.table(u["table"]).bytes_per_element == 2
            assert torch.allclose(u["got"], u["want"], atol=5e-3 if fp16 else 1e-5), (
                f"rank {rank} table {u['table']}: max diff {(u['got'] - u['want']).abs().max()}")
            checked += u["got"].numel()
            assert not torch.equal(u["want"], u["before"]) or u["got"].numel() == 0
    assert checked == sum(t.rows * t.dim for t in task.tables)


def _run_dmp_workers(tmp_path: Path, task: Task, plan: Plan, world_size: int, local_world_size: int | None) -> None:
    """tests/_dmp_worker.py as `world_size` ranks, each its own process (started warm: tests/_ranks.py)."""
    from _ranks import run_ranks

    task.save(tmp_path / "task.json")
    plan.save(tmp_path / "plan.json")
    worker = Path(__file__).with_name("_dmp_worker.py")
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    extra = [] if local_world_size is None else [local_world_size]
    done = run_ranks(worker, [[rank, world_size, port, tmp_path / "task.json", tmp_path / "plan.json", tmp_path, *extra]
                              for rank in range(world_size)], tmp_path, env=env, timeout=180)
    for rank, (code, out) in enumerate(done):
        assert code == 0, f"rank {rank} failed:\n{out[-3000:]}"


@pytest.mark.slow
def test_table_row_wise_plan_trains_under_distributed_model_parallel(tmp_path: Path):
    """4 gloo processes as 2 hosts x 2 devices: a table split by rows inside host 1
    (table-row-wise), one split by rows over all four ranks (row-wise), a column-wise and a
    table-wise one: the forward equals the unsharded reference's, and one training step leaves
    every shard equal to the reference's SGD step."""
    tables = (Table("twrw", 40, 8, 2.0), Table("rw", 33, 16, 1.5), Table("cw", 30, 16, 2.0), Table("tw", 20, 8, 1.0))
    task = Task("twrw4", 4, GiB, 64, tables, devices_per_host=2)
    plan = Plan(task.name, "manual", [
        Shard("twrw", 2, 0, 8, 0, 20), Shard("twrw", 3, 0, 8, 20, 20),             # ceil(40 / 2) = 20
        *[Shard("rw", d, 0, 16, 9 * d, min(9, 33 - 9 * d)) for d in range(4)],     # ceil(33 / 4) = 9: 9, 9, 9, 6
        Shard("cw", 0, 0, 8, 0, 30), Shard("cw", 3, 8, 8, 0, 30),
        Shard("tw", 1, 0, 8, 0, 20),
    ])
    types = {name: ps.sharding_type for name, ps in plan_to_torchrec(task, plan).plan[""].items()}
    assert types == {"twrw": "table_row_wise", "rw": "row_wise", "cw": "column_wise", "tw": "table_wise"}
    _run_dmp_workers(tmp_path, task, plan, 4, 2)
    for rank in range(4):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for name in result["keys"]:
            got, want = result["sharded"][name], result["expected"][name]
            assert want.abs().sum() > 0 and torch.allclose(got, want, atol=1e-4), (rank, name)
    _check_training_step(tmp_path, 4, task)
