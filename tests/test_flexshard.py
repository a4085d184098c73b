"""FlexShard's contracts and logic: sequence tables and topology in tasks, row-level plans with
replicas and sidecar row maps (the one validator), access statistics, the tier search, the
baselines, the traffic model, and shard.py evaluate=traffic (in-process, with bad input)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard import InputError, Plan, PlanError, Shard, Table, Task, validate
from embshard.errors import InfeasibleError
from embshard.flexshard.baselines import (DataParallelSharder, HugeCTRHybridSharder, RowWiseSharder,
                                          TableRowWiseSharder, hugectr_threshold_per_step)
from embshard.flexshard.layout import Tiers, tier_layout
from embshard.flexshard.rowmap import RowMap
from embshard.flexshard.stats import BatchSplit, count_rows, step_batch, table_access_stats
from embshard.flexshard.traffic import TrafficModel, phase_ms
from embshard.search.flexshard import FlexShardSharder

ROOT = Path(__file__).resolve().parents[1]


def seq_task(hosts=2, per_host=2, memory=1 << 30, batch=64, rows=(50, 300, 2000), dims=(8, 8, 16), **kw) -> Task:
    tables = tuple(Table(f"s{i}", r, d, 3.0 + i, kind="sequence") for i, (r, d) in enumerate(zip(rows, dims)))
    return Task("seq", hosts * per_host, memory, batch, tables, devices_per_host=per_host, hosts=hosts, **kw)


# ---------------------------------------------------------------------------- contracts
def test_pooled_tables_and_tasks_round_trip_unchanged():
    d = {"name": "t", "rows": 10, "dim": 4, "pooling_factor": 1.5}
    assert Table.from_dict(d).to_dict() == {**d, "bytes_per_element": 4}
    task = {"name": "x", "num_devices": 4, "device_memory_bytes": 99999, "batch_size": 8, "optimizer": "sgd",
            "tables": [{**d, "bytes_per_element": 4}], "devices_per_host": 2}
    assert Task.from_dict(task).to_dict() == task
    t = Task.from_dict(task)
    assert (t.hosts, t.intra_host_gbps, t.inter_host_gbps) == (2, 600.0, 12.5)  # TorchRec's planner defaults


def test_sequence_table_and_topology_round_trip():
    task = seq_task(intra_host_gbps=300.0, inter_host_gbps=25.0)
    d = task.to_dict()
    assert d["tables"][0]["kind"] == "sequence" and d["inter_host_gbps"] == 25.0
    back = Task.from_dict(json.loads(json.dumps(d)))
    assert back == task and back.tables[0].is_sequence


@pytest.mark.parametrize("change, message", [
    ({"hosts": 3}, "must equal num_devices"),
    ({"devices_per_host": 3}, "does not divide"),
    ({"inter_host_gbps": 0}, "inter_host_gbps"),
    ({"intra_host_gbps": -1.0}, "intra_host_gbps"),
    ({"hosts": 0}, "hosts must be a positive integer"),
])
def test_bad_topology_is_an_input_error(change, message):
    d = {**seq_task().to_dict(), "devices_per_host": 2, "hosts": 2, **change}
    if "devices_per_host" in change:
        d.pop("hosts")
    with pytest.raises(InputError, match=message):
        Task.from_dict(d)


def test_bad_table_kind_is_an_input_error():
    with pytest.raises(InputError, match="kind must be one of"):
        Table.from_dict({"name": "a", "rows": 5, "dim": 4, "pooling_factor": 1.0, "kind": "jagged"})


def test_sequence_memory_counts_lookups_and_replicas_serve_their_share():
    task = seq_task(batch=100)
    t = task.tables[0]  # 50 rows, pooling factor 3 -> 300 lookups a step
    whole = task.shard_memory_bytes(t, t.rows, t.dim)
    assert whole == 50 * 8 * 4 + 2 * 300 * 8 * 4
    # a piece replicated on 4 devices serves a quarter of the batch on each
    assert task.shard_memory_bytes(t, 10, t.dim, copies=4) == 10 * 8 * 4 + 2 * math.ceil(300 * 10 / 50 / 4) * 8 * 4


@st.composite
def tiered_st(draw):
    hosts, per_host = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rows = [draw(st.integers(1, 400)) for _ in range(draw(st.integers(1, 3)))]
    task = seq_task(hosts, per_host, rows=tuple(rows), dims=(4,) * len(rows))
    plan = Plan(task.name, "tiers")
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    for t in task.tables:
        hot = rng.permutation(t.rows)[: draw(st.integers(0, t.rows))]
        g = draw(st.integers(0, hot.size))
        front, shards = tier_layout(task, t, hot, Tiers(g, draw(st.integers(0, hot.size - g))))
        plan.shards += shards
        if front.size:
            plan.row_maps[t.name] = front
    return task, plan


@settings(max_examples=40, deadline=None)
@given(tiered_st(), st.data())
def test_validator_accepts_tiered_plans_and_rejects_broken_replicas(case, data):
    task, plan = case
    validate(task, plan)
    used = plan.memory_bytes(task)
    assert sum(used) == sum(task.shard_memory_bytes(task.table(s.table), s.rows, s.dim, sum(
        x.rectangle == s.rectangle for x in plan.shards)) for s in plan.shards)
    tight = Task.from_dict({**task.to_dict(), "device_memory_bytes": max(used)})
    validate(tight, plan)
    with pytest.raises(PlanError, match="over by"):
        validate(Task.from_dict({**task.to_dict(), "device_memory_bytes": max(used) - 1}), plan)
    copies = [i for i, s in enumerate(plan.shards) if s.replica > 0]
    if copies:
        i = data.draw(st.sampled_from(copies))
        s = plan.shards[i]
        broken = {
            "copy on the same device": Shard(s.table, next(x.device for x in plan.shards if x.rectangle == s.rectangle
                                                           and x.replica == 0), 0, s.dim, s.row_offset, s.rows, s.replica),
            "copy of nothing": Shard(s.table, s.device, 0, s.dim, s.row_offset, s.rows + 1, s.replica),
            "repeated replica index": Shard(s.table, (s.device + 1) % task.num_devices, 0, s.dim, s.row_offset, s.rows, 0),
        }
        for what, bad in broken.items():
            shards = list(plan.shards)
            shards[i] = bad
            with pytest.raises(PlanError):
                validate(task, Plan(plan.task, plan.algorithm, shards, plan.row_maps))
    primary = [i for i, s in enumerate(plan.shards) if s.replica == 0]
    drop = data.draw(st.sampled_from(primary))
    dropped = [s for j, s in enumerate(plan.shards) if j != drop]
    with pytest.raises(PlanError):
        validate(task, Plan(plan.task, plan.algorithm, dropped, plan.row_maps))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.data())
def test_row_map_is_a_bijection_stored_with_the_front_only(rows, data):
    k = data.draw(st.integers(0, rows))
    front = np.random.default_rng(rows).permutation(rows)[:k]
    m = RowMap(rows, front)
    new = m.to_new(torch.arange(rows))
    assert sorted(new.tolist()) == list(range(rows))
    assert torch.equal(new[torch.from_numpy(front).long()], torch.arange(k))
    assert torch.equal(m.to_original(new), torch.arange(rows))


def test_plan_json_with_sidecar_row_maps_round_trips_and_rejects_tampering(tmp_path):
    task = seq_task()
    plan = FlexShardSharder(fit_batches=2).shard(task)
    assert plan.row_maps and any(s.replica for s in plan.shards)
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    validate(task, back)
    assert back.shards == plan.shards and back.row_maps.keys() == plan.row_maps.keys()
    assert all(np.array_equal(back.row_maps[k], v) for k, v in plan.row_maps.items())
    entry = json.loads((tmp_path / "p.json").read_text())["row_maps"]["s0"]
    assert entry["rows"] == len(plan.row_maps["s0"]) and "/" in entry["file"]  # a sidecar, not one entry per row
    sidecar = tmp_path / entry["file"]
    sidecar.write_bytes(sidecar.read_bytes()[:-8])
    with pytest.raises(InputError, match="sha256"):
        Plan.load(tmp_path / "p.json")
    with pytest.raises(PlanError, match="repeats a row id"):
        validate(task, Plan(task.name, "x", plan.shards, {"s0": np.array([1, 1])}))


# ---------------------------------------------------------------------------- statistics
def test_access_counts_stream_and_fit_only_on_early_steps():
    ids, counts = count_rows([np.array([3, 1, 3]), np.array([3, 7])], 10**9)  # the sort-and-merge path
    assert ids.tolist() == [3, 1, 7] and counts.tolist() == [3, 1, 1]
    dense = count_rows([np.array([3, 1, 3]), np.array([3, 7])], 10)
    assert [a.tolist() for a in dense] == [[3, 1, 7], [3, 1, 1]]
    t = Table("s", 1000, 8, 5.0, kind="sequence")
    stats = table_access_stats(t, 64, BatchSplit(2, 2))
    fit = np.concatenate([step_batch(t, 64, s)[0] for s in (0, 1)])
    assert stats.total == fit.size and stats.steps == 2
    assert np.array_equal(np.sort(stats.ids), np.unique(fit))
    assert not np.array_equal(step_batch(t, 64, 2)[0][:50], fit[:50])  # held-out steps are other batches


# ---------------------------------------------------------------------------- traffic model
def test_traffic_model_counts_a_small_case_by_hand():
    t = Table("s", 4, 4, 2.0, kind="sequence")
    task = Task("hand", 2, 1 << 20, 2, (t,), devices_per_host=1, inter_host_gbps=1.0)
    plan = RowWiseSharder().shard(task)  # rows 0-1 on device 0, 2-3 on device 1
    step = TrafficModel(task, plan).step({"s": (np.array([0, 2, 3, 2]), np.array([3, 1]))})
    # device 0 sends ids 2, 3 (16 B) plus one split count (8 B); device 1 only its count
    assert step.phases["ids"].tolist() == [[0, 24], [8, 0]]
    assert step.phases["embeddings_fw"].tolist() == [[0, 0], [32, 0]]
    assert step.phases["gradients_bw"].tolist() == [[0, 32], [0, 0]]
    ms = TrafficModel(task, plan).step_ms(step)
    assert ms["ids"] == pytest.approx(24 / (2**30 / 1e3))


def test_phase_time_is_the_busiest_device_on_its_slower_link():
    intra = np.array([[True, True, False], [True, True, False], [False, False, True]])
    m = np.array([[0, 600, 10], [0, 0, 0], [0, 0, 0]], dtype=float)
    assert phase_ms(m, intra, 600.0, 1.0) == pytest.approx(10.0)  # 10 B over 1 B/ms beats 600 B over 600 B/ms


# ---------------------------------------------------------------------------- search and baselines
def test_flexshard_respects_the_memory_cap_and_uses_more_memory_for_less_traffic():
    base = seq_task(batch=256, rows=(400, 3000, 20000), dims=(8, 16, 16))
    need = max(RowWiseSharder().shard(base).memory_bytes(base))
    objective = []
    for factor in (1.0, 1.2, 3.0):
        task = Task.from_dict({**base.to_dict(), "device_memory_bytes": int(need * factor)})
        sharder = FlexShardSharder(fit_batches=2)
        plan = sharder.shard(task)
        validate(task, plan)
        objective.append(sharder.last_search_info["objective_ms"])
    assert objective[0] >= objective[1] >= objective[2] and objective[2] < objective[0]
    with pytest.raises(InfeasibleError, match="short by"):
        FlexShardSharder(fit_batches=2).shard(Task.from_dict({**base.to_dict(), "device_memory_bytes": need - 1}))


def test_baselines_on_sequence_tables():
    task = seq_task()
    D = task.num_devices
    rw = RowWiseSharder().shard(task)
    assert [s.rows for s in rw.shards if s.table == "s1"] == [75] * 4  # ceil(300 / 4)
    twrw = TableRowWiseSharder().shard(task)
    for t in task.tables:
        assert len({s.device // task.devices_per_host for s in twrw.shards if s.table == t.name}) == 1
    dp = DataParallelSharder().shard(task)
    assert sorted(s.replica for s in dp.shards if s.table == "s0") == list(range(D))
    for plan in (rw, twrw, dp, HugeCTRHybridSharder(fit_batches=2).shard(task)):
        validate(task, plan)


def test_hugectr_threshold_follows_its_formula():
    # several nodes: nodes * (a2a / all-reduce bandwidth) * nodes / (nodes - 1) = 2 * 1.9/1.3 * 2
    assert hugectr_threshold_per_step(seq_task(hosts=2)) == pytest.approx(2 * 1.9 / 1.3 * 2)
    one = seq_task(hosts=1, per_host=4, batch=1024)  # one node: batch * sqrt(2 p / (M (M - 1))), M = 256
    assert hugectr_threshold_per_step(one) == pytest.approx(1024 * math.sqrt(0.02 / (256 * 255)))


# ---------------------------------------------------------------------------- shard.py
def _shard_cfg(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="shard", overrides=list(overrides))


def test_shard_evaluate_traffic_contract(tmp_path):
    import shard

    seq_task(batch=128).save(tmp_path / "task.json")
    algos = ["row_wise", "table_row_wise", "hugectr_hybrid", "flexshard"]
    out = tmp_path / "out"
    shard.run(_shard_cfg(f"task_file={tmp_path / 'task.json'}", f"algorithms=[{','.join(algos)}]", "evaluate=traffic",
                         "traffic.fit_batches=2", "traffic.eval_batches=1", "searchers.flexshard.fit_batches=2",
                         "searchers.hugectr_hybrid.fit_batches=2", f"out_dir={out}", "progress=false"))
    report = json.loads((out / "report.json").read_text())
    task = Task.load(tmp_path / "task.json")
    for r in report["results"]:
        assert r["valid"], r["error"]
        assert set(r["traffic_bytes"]) == {"intra_host", "inter_host", "total"} and r["modeled_comm_ms"] > 0
        assert r["traffic_bytes"]["total"] == pytest.approx(r["traffic_bytes"]["intra_host"] + r["traffic_bytes"]["inter_host"])
        assert set(r["traffic"]["bytes_by_purpose"]) == {"ids", "embeddings_fw", "gradients_bw", "replica_sync"}
        validate(task, Plan.load(out / "plans" / f"{r['algorithm']}.json"))
    by = {r["algorithm"]: r for r in report["results"]}
    assert by["row_wise"]["traffic"]["bytes_by_purpose"]["replica_sync"]["total"] == 0
    assert by["flexshard"]["modeled_comm_ms"] < by["row_wise"]["modeled_comm_ms"]
    assert (out / "traffic.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("change, message", [
    ({"hosts": 3}, "must equal num_devices"),
    ({"inter_host_gbps": -2}, "inter_host_gbps"),
    ({"tables": [{"name": "a", "rows": 5, "dim": 4, "pooling_factor": 1.0, "kind": "ragged"}]}, "kind must be"),
    ({"tables": [{"name": "a", "rows": 5, "dim": 4, "pooling_factor": -3.0, "kind": "sequence"}]}, "pooling_factor"),
    ("short_trace", "samples but"),
])
def test_bad_topology_or_sequence_input_one_line_error_no_files(tmp_path, capsys, change, message):
    import shard
    from embshard.cli import one_line_errors

    d = {**seq_task().to_dict(), "devices_per_host": 2}
    if change == "short_trace":
        from embshard.data.synthetic import generate_synthetic

        generate_synthetic(tmp_path / "trace.pt", num_tables=1, batch_size=100, seed=0)
        d["tables"][0]["trace"] = {"file": str(tmp_path / "trace.pt"), "table_index": 0}
    else:
        d.update(change)
    (tmp_path / "task.json").write_text(json.dumps(d))
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        one_line_errors(shard.run, _shard_cfg(f"task_file={tmp_path / 'task.json'}", "algorithms=[flexshard,row_wise]",
                                              "evaluate=traffic", f"out_dir={out}"))
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not out.exists()


# ---------------------------------------------------------------------------- train.py sequence stages
@pytest.mark.parametrize("experiment", ["flexshard_e2e", "flexshard_model_zipf1"])  # tiny: below; zipf1 includes model
def test_sequence_experiments_compose(experiment):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["stage=sequence_throughput", f"experiment={experiment}"])
    assert cfg.sequence.task.hosts * cfg.sequence.task.devices_per_host >= 4
    assert set(cfg.sequence.plans) <= set(cfg.searchers) and cfg.sequence.reference in cfg.sequence.plans
    assert cfg.sequence.trace.samples >= cfg.sequence.task.batch_size * (cfg.sequence.fit_batches + cfg.sequence.eval_batches)


def test_sequence_task_stage_and_plan_checks(tmp_path):
    from hydra import compose, initialize_config_dir

    from dlrm.sequence_stages import resolve_sequence_plans, run_sequence_task
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "stage=sequence_task", "experiment=flexshard_tiny", f"sequence.trace.path={tmp_path / 'trace.pt'}",
            f"out_dir={tmp_path / 'out'}"])
    run_sequence_task(cfg, ROOT)
    task = Task.load(tmp_path / "out" / "task.json")
    assert all(t.is_sequence and t.trace is not None for t in task.tables) and task.hosts == 2
    plans, fitted = resolve_sequence_plans(["flexshard", "row_wise"], task, 4, lambda n: instantiate(cfg.searchers[n]),
                                           list(cfg.searchers), fit_batches=4)
    assert list(plans) == ["flexshard", "row_wise"] and fitted["flexshard"] == 4
    with pytest.raises(PlanError, match="nproc_per_node 4"):
        resolve_sequence_plans(["row_wise"], task, 2, None, ["row_wise"], fit_batches=4)
    with pytest.raises(InputError, match="fitted on steps"):
        resolve_sequence_plans(["flexshard"], task, 4, lambda n: instantiate(cfg.searchers[n]), ["flexshard"], fit_batches=2)
