"""EmbShardPlanner, Task.from_module and embshard.plan: TorchRec modules planned by this
project's searchers, constraints honoured or refused in one line, and (slow) the plans run
under DistributedModelParallel on 2 gloo processes with outputs equal to the unsharded model's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import embshard
from embshard import InfeasibleError, InputError, Plan, PlanError, Shard, Table, Task, validate

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def _topology(world: int = 2, device: str = "cpu", local: int | None = None, cap: int | None = None):
    from torchrec.distributed.planner import Topology

    caps = {} if cap is None else ({"hbm_cap": cap} if device == "cuda" else {"ddr_cap": cap})
    return Topology(world_size=world, compute_device=device, local_world_size=local or world, **caps)


def _ebc(specs, device="meta"):
    """specs: (name, rows, dim, features)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d,
                                                             feature_names=f) for n, r, d, f in specs],
                                  device=torch.device(device))


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Module()
        self.user.tower = nn.Module()
        self.user.tower.ebc = _ebc([("u0", 1000, 16, ["a", "b"]), ("u1", 50, 8, ["c"])])
        self.item = nn.Module()
        self.item.ebc = _ebc([("i0", 3000, 32, ["d"]), ("i1", 400, 12, ["e"])])
        self.dense = nn.Linear(4, 4)


def _constraints(**kw):
    from torchrec.distributed.planner import ParameterConstraints

    return {name: ParameterConstraints(**c) for name, c in kw.items()}


# ---------------------------------------------------------------------------- module -> task
def test_from_module_reads_nested_collections_features_and_constraints():
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from embshard.torchrec_bridge import task_from_module

    model = Nested()
    model.seq = EmbeddingCollection(tables=[EmbeddingConfig(name="s0", num_embeddings=500, embedding_dim=8,
                                                            feature_names=["s"])], device=torch.device("meta"))
    cons = _constraints(u0=dict(pooling_factors=[3.0, 2.0]), i0=dict(pooling_factors=[5.0], num_poolings=[2.0],
                                                                     batch_sizes=[64]),
                        i1=dict(sharding_types=["column_wise"], min_partition=4), s0=dict(pooling_factors=[7.0]))
    task, where = task_from_module(model, _topology(4, cap=8 * GiB), batch_size=128, constraints=cons,
                                   storage_reservation=0.25)
    assert [(c.path, c.kind, c.tables) for c in where] == [
        ("user.tower.ebc", "pooled", ("u0", "u1")), ("item.ebc", "pooled", ("i0", "i1")),
        ("seq", "sequence", ("s0",))]
    assert task.num_devices == 4 and task.batch_size == 512 and task.device_memory_bytes == 6 * GiB
    t = task.table_by_name
    assert (t["u0"].pooling_factor, t["u0"].num_poolings) == (5.0, 2.0)  # two features: lookups summed, two bags
    assert (t["u1"].pooling_factor, t["u1"].num_poolings) == (1.0, 1.0)  # TorchRec's default pooling factor
    assert t["i0"].pooling_factor == pytest.approx(5.0) and t["i0"].num_poolings == pytest.approx(1.0)  # 2 x 64/128
    assert t["i1"].sharding_types == ("column_wise",) and t["i1"].min_partition == 4
    # the CPU sharder offers no row_wise: every table is bounded by what it offers
    assert t["u1"].sharding_types == ("data_parallel", "table_wise", "column_wise", "table_column_wise")
    assert t["s0"].kind == "sequence" and t["s0"].pooling_factor == 7.0
    # the output of every bag counts in memory
    assert task.shard_memory_bytes(t["u0"], 1000, 16) - 1000 * 16 * 4 == 2 * 512 * 2 * 16 * 4
    assert Task.from_module(model, _topology(4, cap=8 * GiB), 128, cons).to_dict()["tables"][0]["num_poolings"] == 2.0


def test_from_module_detects_the_fused_optimizer():
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    model = Nested()
    apply_optimizer_in_backward(RowWiseAdagrad, list(model.user.parameters()) + list(model.item.parameters()),
                                {"lr": 0.1})
    assert Task.from_module(model, _topology()).optimizer == "rowwise_adagrad"
    assert Task.from_module(Nested(), _topology()).optimizer == "sgd"


@pytest.mark.parametrize("constraint, match", [
    ({"i0": dict(compute_kernels=["fused_uvm_caching"])}, r"table 'i0'.*compute_kernels"),
    ({"i0": dict(sharding_types=["row_wise"])}, r"table 'i0'.*offers"),
    ({"i0": dict(cache_params="x")}, r"table 'i0'.*cache_params cannot be honoured"),
    ({"i00": dict(sharding_types=["table_wise"])}, r"unknown table 'i00' \(did you mean 'i0'\?\)"),
    ({"u0": dict(pooling_factors=[1.5, 2.0, 3.0])}, r"table 'u0'.*3 entries for its 2 feature"),
], ids=["uvm_kernel", "row_wise_on_cpu", "cache", "unknown_table", "pooling_factors"])
def test_constraints_that_cannot_be_honoured_are_one_line_errors(constraint, match):
    planner = embshard.EmbShardPlanner(topology=_topology(), constraints=_constraints(**constraint),
                                       algorithm="size_lookup_greedy")
    with pytest.raises(InputError, match=match) as e:
        planner.plan(Nested(), _sharders())
    assert "\n" not in str(e.value)


def test_no_collection_unknown_algorithm_and_override_are_one_line_errors():
    planner = embshard.EmbShardPlanner(topology=_topology(), algorithm="round_robin")
    with pytest.raises(InputError, match="Linear has no EmbeddingBagCollection or EmbeddingCollection") as e:
        planner.plan(nn.Linear(3, 3), _sharders())
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="did you mean 'neuroshard'"):
        embshard.EmbShardPlanner(topology=_topology(), algorithm="neuroshrd")
    with pytest.raises(InputError, match="did you mean beam_width"):
        embshard.EmbShardPlanner(topology=_topology(), algorithm="neuroshard", beam_widht=2)
    with pytest.raises(InputError, match="process group"):
        planner.collective_plan(Nested(), _sharders())


def test_a_table_that_fits_nowhere_names_it_and_the_shortfall():
    model = Nested()
    model.item.ebc = _ebc([("huge", 5_000_000, 64, ["d"]), ("i1", 400, 12, ["e"])])
    for algorithm in ("size_lookup_greedy", "neuroshard"):
        planner = embshard.EmbShardPlanner(topology=_topology(cap=GiB), algorithm=algorithm,
                                           constraints=_constraints(huge=dict(sharding_types=["table_wise"])))
        with pytest.raises(InfeasibleError, match=r"table 'huge' needs \d+ bytes .* short by \d+ bytes") as e:
            planner.plan(model, _sharders())
        assert "\n" not in str(e.value) and e.value.table == "huge"
    # a column-wise table is planned as column slices; the error names the table, not a slice
    task = Task("cw", 2, 700_000, 4096, (Table("t0", 42091, 4, 1.0, sharding_types=["column_wise", "row_wise"]),))
    for algorithm in ("size_lookup_greedy", "neuroshard", "dreamshard"):
        with pytest.raises(InfeasibleError, match=r"^table 't0' \(its column slice 0:4\) needs \d+ bytes .* short by") as e:
            embshard.plan(task, algorithm=algorithm)
        assert "__cw" not in str(e.value) and e.value.table == "t0"


def _sharders():
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]


# ---------------------------------------------------------------------------- the planner
@pytest.mark.parametrize("algorithm", ["neuroshard", "size_lookup_greedy", "torchrec", "dreamshard"])
def test_plan_honours_constraints_keyed_by_module_path(algorithm, tmp_path):
    cons = _constraints(u1=dict(sharding_types=["data_parallel"]), i0=dict(sharding_types=["column_wise"],
                        min_partition=8), i1=dict(sharding_types=["table_wise"]))
    planner = embshard.EmbShardPlanner(topology=_topology(4), batch_size=64, constraints=cons, algorithm=algorithm,
                                       out_dir=tmp_path)
    sp = planner.plan(Nested(), _sharders())
    assert set(sp.plan) == {"user.tower.ebc", "item.ebc"}
    kinds = {n: ps.sharding_type for mp in sp.plan.values() for n, ps in mp.items()}
    assert kinds["u1"] == "data_parallel" and kinds["i0"] == "column_wise" and kinds["i1"] == "table_wise"
    assert sp.plan["user.tower.ebc"]["u1"].compute_kernel == "dense"
    assert sp.plan["user.tower.ebc"]["u1"].ranks == [0, 1, 2, 3]
    assert all(s[1] >= 8 for s in (md.shard_sizes for md in sp.plan["item.ebc"]["i0"].sharding_spec.shards))
    # the plan JSON it wrote is this project's, valid for the task JSON beside it
    task, plan = Task.load(tmp_path / "task.json"), Plan.load(tmp_path / "plan.json")
    validate(task, plan)
    assert plan.algorithm == algorithm and plan.signature() == planner.last_plan.signature()
    dp = [s for s in plan.shards if s.table == "u1"]
    assert sorted(s.device for s in dp) == [0, 1, 2, 3]  # replicated: counted in memory on every rank
    summary = planner.last_summary
    assert f"algorithm {algorithm}" in summary and "data_parallel 1" in summary and "rank" in summary
    if algorithm == "neuroshard":
        assert "checkpoint" in summary and "cost_models.pt" in summary


def test_row_wise_constraint_on_gpu_topology_and_table_row_wise_per_host():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    cons = _constraints(i0=dict(sharding_types=["row_wise"]), u0=dict(sharding_types=["table_row_wise"]))
    planner = embshard.EmbShardPlanner(topology=_topology(4, device="cuda", local=2, cap=4 * GiB), constraints=cons,
                                       algorithm="neuroshard")
    sp = planner.plan(Nested(), [EmbeddingBagCollectionSharder()])
    i0 = sp.plan["item.ebc"]["i0"]
    assert i0.sharding_type == "row_wise" and i0.ranks == [0, 1, 2, 3]
    assert [md.shard_sizes[0] for md in i0.sharding_spec.shards] == [750] * 4
    u0 = sp.plan["user.tower.ebc"]["u0"]
    assert u0.sharding_type == "table_row_wise" and u0.ranks in ([0, 1], [2, 3])
    assert str(i0.sharding_spec.shards[1].placement) == "rank:1/cuda:1"


def test_validate_enforces_sharding_types_and_min_partition():
    task = Task("c", 2, GiB, 64, (Table("a", 100, 16, 1.0, sharding_types=["table_wise"]),
                                  Table("b", 100, 16, 1.0, sharding_types=["column_wise"], min_partition=8)))
    ok = Plan("c", "x", [Shard("a", 0, 0, 16, 0, 100), Shard("b", 1, 0, 8, 0, 100), Shard("b", 0, 8, 8, 0, 100)])
    validate(task, ok)
    with pytest.raises(PlanError, match=r"table 'a' is constrained to \['table_wise'\] but the plan shards it row_wise"):
        validate(task, Plan("c", "x", [Shard("a", 0, 0, 16, 0, 50), Shard("a", 1, 0, 16, 50, 50)] + ok.shards[1:]))
    with pytest.raises(PlanError, match="table 'b': column piece of width 4 .* min_partition 8"):
        validate(task, Plan("c", "x", ok.shards[:1] + [Shard("b", 1, 0, 4, 0, 100), Shard("b", 0, 4, 12, 0, 100)]))
    # the constraints are part of the task JSON and round-trip
    assert Task.from_dict(task.to_dict()) == task


def test_neuroshard_does_not_split_a_table_constrained_to_whole_tables():
    """Memory forces a split of 'big'; table_wise only: NeuroShard reports it cannot fit
    instead of splitting it; allowed column_wise, it splits by columns (never by rows)."""
    big = Table("big", 200_000, 64, 2.0)
    need = Task("m", 2, 1 << 40, 256, (big,)).table_memory_bytes(big)
    for types, outcome in ((["table_wise"], "infeasible"), (["table_wise", "column_wise"], "columns")):
        task = Task("m", 2, int(need * 0.6), 256, (Table("big", 200_000, 64, 2.0, sharding_types=types),
                                                    Table("small", 100, 8, 1.0)))
        if outcome == "infeasible":
            with pytest.raises(InfeasibleError, match="table 'big'"):
                embshard.plan(task, algorithm="neuroshard", checkpoint=None)
        else:
            plan = embshard.plan(task, algorithm="neuroshard", checkpoint=None)
            pieces = [s for s in plan.shards if s.table == "big"]
            assert len(pieces) == 2 and all(s.rows == 200_000 for s in pieces)


def test_embshard_plan_api_and_callable_module():
    import embshard.plan as plan_module

    task = Task.load(ROOT / "examples" / "tasks" / "small.json")
    plan = embshard.plan(task, algorithm="size_lookup_greedy")
    assert isinstance(plan, Plan) and plan.algorithm == "size_lookup_greedy"
    validate(task, plan)
    assert plan_module.Plan is Plan  # still the module of Plan
    with pytest.raises(InputError, match="refuse|meant for|pooled tables only"):
        embshard.plan(Task("s", 2, GiB, 64, (Table("q", 100, 8, 3.0, kind="sequence"),)), algorithm="neuroshard")


# ---------------------------------------------------------------------------- 2 gloo processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str], n: int = 2, timeout: int = 300) -> list[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="offline")
    procs = [subprocess.Popen([sys.executable, *[a.replace("{rank}", str(r)) for a in args]], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True) for r in range(n)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"
    return outputs


@pytest.mark.slow
def test_dmp_runs_embshard_plans_like_torchrecs_own(tmp_path):
    """THE DROP-IN CHECK: on 2 gloo processes DistributedModelParallel wraps TorchRec's DLRM and a
    model with two EmbeddingBagCollections at nested paths (mixed dims, a table read by two
    features, tables constrained to data_parallel, column_wise and table_wise), planned by
    EmbShardPlanner with neuroshard and with a heuristic, and by TorchRec's own planner as the
    control; an EmbeddingCollection (sequence tables) planned with the heuristic; and one beside an
    EmbeddingBagCollection planned with neuroshard (embshard.search.mixed): forward
    equals the unsharded model's on the same weights, backward runs, the constrained tables get
    their sharding types, collective_plan gives both ranks one plan."""
    from _ranks import run_ranks

    specs = ["embshard:neuroshard", "embshard:size_lookup_greedy", "torchrec"]
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="offline")
    done = run_ranks(ROOT / "tests" / "_planner_worker.py", [[rank, 2, port, tmp_path, *specs] for rank in range(2)],
                     tmp_path, env=env, cwd=ROOT, timeout=300)  # each rank its own process, started warm
    for rank, (code, out) in enumerate(done):
        assert code == 0, f"rank {rank} failed:\n{out[-3000:]}"
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert set(r0) == {(m, s) for m in ("dlrm", "two_towers") for s in specs} | {("sequences", specs[1]),
                                                                                ("both", specs[0])}
    for key in r0:
        for res in (r0[key], r1[key]):
            assert res["reference_abs"] > 0, f"{key}: all-zero reference output proves nothing"
            assert res["max_diff"] <= 1e-5, f"{key}: sharded output differs by {res['max_diff']}"
            assert res["backward_finite"], f"{key}: backward left non-finite gradients or weights"
        assert r0[key]["updated"] or r1[key]["updated"], f"{key}: backward did not reach the sharded tables"
        assert r0[key]["plan"] == r1[key]["plan"], f"{key}: collective_plan differs between ranks"
        kinds = {name.split("/")[1]: v[0] for name, v in r0[key]["plan"].items()}
        if key[0] == "two_towers":
            assert (kinds["u_small"], kinds["i_cw"], kinds["i_tw"]) == ("data_parallel", "column_wise", "table_wise")
        elif key[0] == "sequences":  # an EmbeddingCollection: sequence tables
            assert kinds == {"s0": "table_wise", "s1": "column_wise"}
        elif key[0] == "both":  # both collections in the plan, every table of each
            assert set(kinds) == {"p0", "p1", "q0", "q1"}
            assert {name.split("/")[0] for name in r0[key]["plan"]} == {"both.ebc", "both.ec"}
        else:
            assert kinds["t3"] == "data_parallel"


@pytest.mark.slow
@pytest.mark.e2e  # `make test-e2e`: test_dmp_runs_embshard_plans_like_torchrecs_own covers the planner under DMP
def test_example_trains_torchrecs_dlrm_on_two_processes(tmp_path):
    out = tmp_path / "plan"
    logs = _spawn(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(ROOT / "examples" / "torchrec_dlrm.py"), "--steps", "4", "--batch-size", "64",
                   "--out-dir", str(out)], n=1)
    assert "trained 4 steps on 2 ranks under EmbShardPlanner('neuroshard')" in logs[0]
    assert "EmbShardPlanner: 8 tables in model.sparse_arch.embedding_bag_collection" in logs[0]
    task, plan = Task.load(out / "task.json"), Plan.load(out / "plan.json")
    validate(task, plan)
    assert {s.replica for s in plan.shards if s.table == "t_cat_6"} == {0, 1}


def test_shard_py_plans_constrained_tasks_and_evaluates_plan_files(tmp_path, refused_in_process):
    """A task JSON with constraints is planned by shard.py's algorithms within them, and a plan
    file made elsewhere (as EmbShardPlanner(out_dir=...) writes it) is a row of its own, taken as
    it is (its data_parallel table not shaped twice). shard.py's run in this process
    (tests/_entry.py; its own process: tests/test_shard_cli.py)."""
    from _entry import run_entry

    task = Task.load(ROOT / "examples" / "tasks" / "constrained.json")
    made = embshard.plan(task, algorithm="round_robin")
    made.algorithm = "made_elsewhere"
    made.save(tmp_path / "made.json")
    out = tmp_path / "run"
    proc = run_entry("shard", f"task_file={ROOT / 'examples/tasks/constrained.json'}",
                     f"plan_files=[{tmp_path / 'made.json'}]", "algorithms=[size_lookup_greedy,neuroshard]",
                     "evaluate=estimated", f"out_dir={out}", env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    rows = {r["algorithm"]: r for r in report["results"]}
    assert set(rows) == {"size_lookup_greedy", "neuroshard", "made_elsewhere"}
    assert all(r["valid"] and r["estimated_cost_ms"] > 0 for r in rows.values()), rows
    for name in rows:
        plan = Plan.load(out / "plans" / f"{name}.json")
        validate(task, plan)
        assert sorted(s.device for s in plan.shards if s.table == "country") == [0, 1, 2, 3]
    assert Plan.load(out / "plans" / "made_elsewhere.json").signature() == made.signature()
    code, lines = refused_in_process(f"task_file={ROOT / 'examples/tasks/small.json'}",
                                     f"plan_files=[{tmp_path / 'nope.json'}]", "algorithms=[]", "evaluate=none",
                                     f"out_dir={tmp_path / 'bad'}", entry="shard")
    assert code == 2 and lines[-1].startswith("error: ") and "nope.json" in lines[-1], lines
    assert not (tmp_path / "bad").exists()


def test_kernel_measurement_times_data_parallel_tables_and_refuses_partial_copies():
    """A data_parallel table (a copy on every device) is timed by the kernel step: each copy pools
    its own rank's share of the samples. A pooled copy on some devices only is refused in one line
    (no sharding type says whose samples it serves)."""
    import dataclasses as dc

    from embshard.hardware.evaluator import HardwareEvaluator
    from embshard.hardware.protocol import MeasurementProtocol

    task = Task.load(ROOT / "examples" / "tasks" / "constrained.json")
    small = Task(task.name, task.num_devices, task.device_memory_bytes, 256,
                 tuple(dc.replace(t, rows=min(t.rows, 2000)) for t in task.tables), optimizer=task.optimizer)
    plan = embshard.plan(small, algorithm="round_robin")
    assert sorted(s.device for s in plan.shards if s.table == "country") == [0, 1, 2, 3]
    ev = HardwareEvaluator(backend="fbgemm", comm_backend=None,  # (rowwise_adagrad: FBGEMM's kernel)
                           protocol=MeasurementProtocol(warmups=0, repetitions=1, probe=False))
    [c] = ev.measure_many(small, [plan])
    assert len(c.compute_ms) == 4 and all(x > 0 for x in c.compute_ms)
    [tags] = [s for s in plan.shards if s.table == "tags"]
    partial = Plan(plan.task, "partial", plan.shards + [dc.replace(tags, device=(tags.device + 1) % 4, replica=1)])
    validate(small, partial)  # a valid plan (row-level replication), but not one the kernel step can time
    with pytest.raises(InputError, match=r"copies pooled table\(s\) \['tags'\] onto some devices but not all"
                                         r".*hardware=dmp_cpu") as e:
        ev.measure_many(small, [partial])
    assert "\n" not in str(e.value)


def test_table_column_wise_on_several_hosts_keeps_a_tables_slices_on_one_host():
    """TorchRec runs table_column_wise on one host of a multi-host job; a table allowed only
    that was refused here ("table_column_wise only on one host"). Its column slices are now
    fixed on the devices of one host, and the layout TorchRec gets is table_column_wise."""
    from embshard.layouts import choose_layout

    task = Task("tcw", 4, GiB, 4096, (Table("a", 10_000, 512, 2.0, sharding_types=["table_column_wise"]),
                                      Table("b", 5_000, 64, 1.0, sharding_types=["table_column_wise"]),
                                      Table("c", 100, 16, 1.0)), devices_per_host=2)
    for algorithm in ("size_lookup_greedy", "neuroshard"):
        plan = embshard.plan(task, algorithm=algorithm)
        for name in ("a", "b"):
            shards = [s for s in plan.shards if s.table == name]
            assert len({s.device // 2 for s in shards}) == 1  # one host
            assert choose_layout(task.table_by_name[name], shards, 4, 2)[0] == "table_column_wise"
        assert sorted((s.col_offset, s.dim) for s in plan.shards if s.table == "a") == [(0, 256), (256, 256)]
        assert {s.device // 2 for s in plan.shards if s.table == "a"} != {s.device // 2 for s in plan.shards if s.table == "b"}
    with pytest.raises(InputError, match=r"table 'g': sharding_types \['grid_shard'\] cannot be honoured here"):
        embshard.plan(Task("g", 4, GiB, 64, (Table("g", 100, 8, 1.0, sharding_types=["grid_shard"]),), devices_per_host=2),
                      algorithm="size_lookup_greedy")


def test_one_rank_plans_honour_row_wise_and_data_parallel_constraints():
    """On one rank TorchRec's row-wise layout is the whole table on rank 0 and data-parallel is
    the table once: a single shard is each of them (a user's constraints from a bigger cluster
    plan on one device), and a one-row table is row-wise only on the first rank."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    cons = _constraints(i0=dict(sharding_types=["row_wise"]), u0=dict(sharding_types=["table_row_wise"]),
                        u1=dict(sharding_types=["data_parallel"]))
    planner = embshard.EmbShardPlanner(topology=_topology(1, device="cuda", cap=4 * GiB), constraints=cons,
                                       algorithm="size_lookup_greedy")
    sp = planner.plan(Nested(), [EmbeddingBagCollectionSharder()])
    kinds = {n: sp.plan[m][n].sharding_type for m, n in [("item.ebc", "i0"), ("user.tower.ebc", "u0"),
                                                          ("user.tower.ebc", "u1"), ("item.ebc", "i1")]}
    assert kinds == {"i0": "row_wise", "u0": "table_row_wise", "u1": "data_parallel", "i1": "table_wise"}
    assert sp.plan["item.ebc"]["i0"].ranks == [0]
    one_row = Task("r", 4, GiB, 64, (Table("a", 1, 16, 1.0, sharding_types=["row_wise"]),))
    validate(one_row, Plan("r", "x", [Shard("a", 0, 0, 16, 0, 1)]))
    with pytest.raises(PlanError, match=r"table 'a' is constrained to \['row_wise'\] but the plan shards it table_wise"):
        validate(one_row, Plan("r", "x", [Shard("a", 1, 0, 16, 0, 1)]))
