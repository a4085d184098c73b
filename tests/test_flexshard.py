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
from embshard.flexshard.layout import Tiers, balance_placement, host_rotation, tier_layout
from embshard.flexshard.routing import SparseSync, SyncGroup, plan_routes
from embshard.flexshard.tiers import TierProblem, cuts_at, tier_costs
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


def test_reuse_histogram_must_sum_to_one_up_to_rounding():
    rounded = [0.3333, 0.3333, 0.3333] + [0.0] * 14  # shares rounded to 4 decimals: 0.9999
    assert Table("a", 5, 4, 1.0, reuse_histogram=rounded).reuse_histogram == tuple(rounded)
    for bad in ([0.5, 0.6] + [0.0] * 15, [0.0] * 17, [0.9] + [0.0] * 16):  # 1.1, nothing, 0.9
        with pytest.raises(InputError, match="reuse_histogram .* must sum to 1"):
            Table("a", 5, 4, 1.0, reuse_histogram=bad)


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
        h = draw(st.integers(0, hot.size - g))
        placed = rng.integers(0, task.num_devices, size=draw(st.integers(0, hot.size - g - h)))
        front, shards = tier_layout(task, t, hot, Tiers(g, h, placed))
        plan.shards += shards
        if front.size:
            plan.row_maps[t.name] = front
    return task, plan


@settings(max_examples=40, deadline=None)
@given(tiered_st(), st.data())
def test_validator_accepts_tiered_plans_and_rejects_broken_replicas(case, data):
    task, plan = case
    validate(task, plan)
    used = plan.memory_bytes(task)  # its value is checked by hand in test_tier_memory_by_hand
    tight = Task.from_dict({**task.to_dict(), "device_memory_bytes": max(used)})
    validate(tight, plan)
    with pytest.raises(PlanError, match="over by"):
        validate(Task.from_dict({**task.to_dict(), "device_memory_bytes": max(used) - 1}), plan)
    copies = [i for i, s in enumerate(plan.shards) if s.replica > 0]
    if copies:
        i = data.draw(st.sampled_from(copies))
        s = plan.shards[i]
        holders = [x for x in plan.shards if x.rectangle == s.rectangle]
        others = sorted(x.replica for x in holders if x.replica not in (0, s.replica))
        broken = {  # (the broken copy, what the validator must say)
            "copy on the device of replica 0": (
                Shard(s.table, next(x.device for x in holders if x.replica == 0), 0, s.dim, s.row_offset, s.rows,
                      s.replica), "have two copies with device"),
            "repeated replica index": (
                (Shard(s.table, s.device, 0, s.dim, s.row_offset, s.rows, others[0]), "have two copies with replica index")
                if others else  # only replica 0 to repeat: replica 0 then covers these rows twice
                (Shard(s.table, s.device, 0, s.dim, s.row_offset, s.rows, 0), "is covered twice")),
        }
        if s.rows > 1:
            broken["copy of nothing"] = (Shard(s.table, s.device, 0, s.dim, s.row_offset, s.rows - 1, s.replica),
                                         "copies no replica-0 shard")
        for what, (bad, message) in broken.items():
            shards = list(plan.shards)
            shards[i] = bad
            with pytest.raises(PlanError, match=message):
                validate(task, Plan(plan.task, plan.algorithm, shards, plan.row_maps))
    primary = [i for i, s in enumerate(plan.shards) if s.replica == 0]
    drop = data.draw(st.sampled_from(primary))
    dropped = [s for j, s in enumerate(plan.shards) if j != drop]
    with pytest.raises(PlanError, match="uncovered|is not placed on any device"):
        validate(task, Plan(plan.task, plan.algorithm, dropped, plan.row_maps))


def test_tier_memory_by_hand():
    # one table of 10 rows, width 4, 2 samples of 2 ids... batch 10 x pooling 2 = 20 lookups a step;
    # 2 hosts x 2 devices; 2 rows replicated, 4 per host (2 per device), 4 split (1 per device)
    t = Table("s", 10, 4, 2.0, kind="sequence")
    task = Task("hand", 4, 1 << 20, 10, (t,), devices_per_host=2)
    front, shards = tier_layout(task, t, np.arange(10), Tiers(2, 4))
    plan = Plan(task.name, "hand", shards, {"s": front})
    validate(task, plan)
    # per device: weights of 2 + 2 + 1 rows (5 x 16 B) and the outputs + gradients (2 x 16 B each)
    # of its share of the 20 lookups: replicated 20 * 2/10 / 4 copies = 1, per host
    # 20 * 2/10 / 2 copies = 2, split 20 * 1/10 = 2  ->  80 + 32 * (1 + 2 + 2) = 240
    assert plan.memory_bytes(task) == [240] * 4


def test_sparse_sync_rule_by_hand():
    # rows 0..9 on 2 hosts x 2 devices; owners: inside a host r mod 2, between the two hosts an exchange
    rule = SparseSync(SyncGroup("s", 0, 10, 0, 4, (0, 1, 2, 3)), ((0, 1), (2, 3)), True, rotation=0)
    held = {0: np.array([0, 1, 5]), 1: np.array([1, 2]), 2: np.array([], dtype=np.int64), 3: np.array([5, 6])}
    want_sent = [  # phase -> {(src, dst): rows}
        {(0, 1): [1, 5], (1, 0): [2], (3, 2): [6]},
        {(0, 2): [0, 2], (2, 0): [6], (1, 3): [1, 5], (3, 1): [5]},
        {},
        {(0, 1): [0, 2, 6], (1, 0): [1, 5], (2, 3): [0, 2, 6], (3, 2): [1, 5]},
    ]
    for phase, want in enumerate(want_sent):
        sent, nxt = {}, {}
        for d, rows in held.items():
            sends, keep = rule.sends(phase, d, rows)
            for peer, pos in sends.items():
                sent[(d, peer)] = rows[pos].tolist()
            nxt[d] = [rows[keep]]
        for (d, peer), rows in sent.items():
            nxt[peer].append(np.array(rows, dtype=np.int64))
        held = {d: np.unique(np.concatenate(v)) for d, v in nxt.items()}
        assert sent == want, phase
    assert all(rows.tolist() == [0, 1, 2, 5, 6] for rows in held.values())  # everyone: every touched row
    assert [rule.peers(k, 0) for k in range(4)] == [[1], [2], [], [1]]


def test_traffic_model_counts_the_sparse_sync_by_hand():
    name = next(f"s{i}" for i in range(100) if host_rotation(Table(f"s{i}", 10, 4, 1.0), 2) == 0
                and SparseSync.of(SyncGroup(f"s{i}", 0, 10, 0, 4, (0, 1, 2, 3)), 2).rotation % 2 == 0)
    t = Table(name, 10, 4, 2.0, kind="sequence")
    task = Task("hand", 4, 1 << 20, 4, (t,), devices_per_host=2)
    front, shards = tier_layout(task, t, np.arange(10), Tiers(10, 0))  # every row on every device
    plan = Plan(task.name, "hand", shards, {name: front}, sparse_sync=True)
    # one sample per device: device 0 looks up 0, 1, 5; device 1 1, 2; device 2 nothing; device 3 5, 6
    step = TrafficModel(task, plan).step({name: (np.array([0, 1, 5, 1, 2, 5, 6]), np.array([3, 2, 0, 2]))})
    sync = step.purpose_matrix("replica_sync")
    row = 8 + 4 * 4  # int64 row id + 4 fp32
    rows = np.zeros((4, 4))  # test_sparse_sync_rule_by_hand's transfers, summed over phases
    for (a, b), n in {(0, 1): 2 + 3, (1, 0): 1 + 2, (3, 2): 1 + 2, (0, 2): 2, (2, 0): 1, (1, 3): 2, (3, 1): 1,
                      (2, 3): 3}.items():
        rows[a, b] = n
    counts = np.array([[0, 2, 1, 0], [2, 0, 0, 1], [1, 0, 0, 2], [0, 1, 2, 0]]) * 8  # one int64 per peer and phase
    assert sync.tolist() == (rows * row + counts).tolist()
    assert step.purpose_matrix("ids").sum() == 4 * 3 * 8  # only the split counts: every lookup is local


def _uniform_steps(task: Task, rows: int, per_sample: int, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = np.full(task.batch_size, per_sample)
    return [{task.tables[0].name: (rng.integers(0, rows, size=task.batch_size * per_sample), lengths)}
            for _ in range(steps)]


@pytest.mark.parametrize("tiers, dedup", [("split", True), ("split", False), ("host", True), ("all", True)])
def test_tier_costs_are_the_traffic_models_expectation(tiers, dedup):
    # every row of a uniform table has a = batch x length / rows accesses per step; replaying random
    # steps through the traffic model must average to tier_costs' closed form (Poisson spread)
    rows, per_sample = 400, 4
    t = Table("u", rows, 8, float(per_sample), kind="sequence")
    task = Task("u", 8, 1 << 30, 256, (t,), devices_per_host=4)
    cut = {"split": Tiers(0, 0), "host": Tiers(0, rows), "all": Tiers(rows, 0)}[tiers]
    front, shards = tier_layout(task, t, np.arange(rows), cut)
    plan = Plan(task.name, tiers, shards, {"u": front} if cut.moved else {}, dedup_ids=dedup, sparse_sync=True)
    model = TrafficModel(task, plan)
    steps = [model.step(b) for b in _uniform_steps(task, rows, per_sample, 40)]
    a = task.batch_size * per_sample / rows
    intra, inter, sync = tier_costs(task, np.array([a]), np.array([t.dim]), dedup, sparse_sync=True)[tiers]
    bw_in, bw_out = task.intra_host_gbps * 2**30 / 1e3, task.inter_host_gbps * 2**30 / 1e3
    got = {"intra": 0.0, "inter": 0.0, "sync": 0.0}
    for st_ in steps:
        for purpose in ("ids", "embeddings_fw", "gradients_bw"):
            m = st_.purpose_matrix(purpose)
            got["intra"] += m[model.intra].sum() / bw_in
            got["inter"] += m[~model.intra].sum() / bw_out
        m = st_.purpose_matrix("replica_sync") - sum(model.sync.values())  # without the fixed counts
        got["sync"] += m[model.intra].sum() / bw_in + m[~model.intra].sum() / bw_out
    split_counts = 8 * (task.num_devices - 1) * task.num_devices  # one int64 per peer: not a row's cost
    got["intra"] -= len(steps) * split_counts * 3 / 7 / bw_in  # 3 of a device's 7 peers share its host
    got["inter"] -= len(steps) * split_counts * 4 / 7 / bw_out
    want = {"intra": intra[0] * rows * task.num_devices, "inter": inter[0] * rows * task.num_devices,
            "sync": sync[0] * rows * task.num_devices}
    for key in want:
        assert got[key] / len(steps) == pytest.approx(want[key], rel=0.03, abs=1e-9), key


def test_tier_cuts_are_the_best_contiguous_cuts_by_brute_force():
    rng = np.random.default_rng(3)
    tables = tuple(Table(f"t{i}", 60, 4 * (1 + i), 5.0, kind="sequence") for i in range(3))
    task = Task("bf", 8, 1 << 30, 64, tables, devices_per_host=4)
    per_step = [np.sort(np.round(rng.pareto(1.0, 12 + 5 * i) * 4) / 4)[::-1] for i in range(3)]
    problem = TierProblem.build(task, tables, per_step, dedup=True, sparse_sync=True)
    D, P = 8, 4
    for lam, theta in [(0.0, 0.0), (1e-9, 0.0), (1e-8, 1.0), (1e-7, 0.5)]:
        sol = cuts_at(problem, lam, theta)
        total = 0.0
        for t, a in zip(tables, per_step):  # every (g, f) with g <= f of every table, row by row
            c = tier_costs(task, a, np.full(a.size, t.dim), True, True)
            m = t.dim * 4 * lam
            row = {k: theta * v[0] + v[1] + v[2] for k, v in c.items()}
            best = min(row["all"][:g].sum() + m * g + row["host"][g:f].sum() + m * (f - g) / P
                       + row["split"][f:].sum() + m * (a.size - f) / D
                       for f in range(a.size + 1) for g in range(f + 1))
            total += best
        c = tier_costs(task, np.concatenate(per_step), np.concatenate([np.full(a.size, t.dim) for t, a in zip(tables, per_step)]), True, True)
        got = 0.0
        for (t, a), cut, off in zip(zip(tables, per_step), sol.cuts, np.cumsum([0] + [a.size for a in per_step])):
            m = t.dim * 4 * lam
            row = {k: theta * v[0][off:off + a.size] + v[1][off:off + a.size] + v[2][off:off + a.size] for k, v in c.items()}
            g, f = cut.replicated, cut.front
            got += (row["all"][:g].sum() + m * g + row["host"][g:f].sum() + m * (f - g) / P
                    + row["split"][f:].sum() + m * (a.size - f) / D)
        assert got == pytest.approx(total, rel=1e-9), (lam, theta)


def test_balance_placement_by_hand():
    # rounds of 3: 10, 9, 8 to devices 0, 1, 2; then the three 1s, the first to the least loaded (2)
    got = balance_placement([np.array([10.0, 8.0, 1.0]), np.array([9.0, 1.0, 1.0])], 3)
    assert [g.tolist() for g in got] == [[0, 2, 2], [1, 1, 0]]


def test_placed_global_rows_are_looked_up_on_their_devices():
    t = Table("s", 50, 4, 2.0, kind="sequence")
    task = Task("p", 4, 1 << 20, 8, (t,), devices_per_host=2)
    hot = np.array([7, 3, 11, 40, 2, 9])
    placed = np.array([3, 0, 3, 1])  # hot ranks 2..5 (after 1 replicated row and 1 per-host row)
    front, shards = tier_layout(task, t, hot, Tiers(1, 1, placed))
    plan = Plan(task.name, "p", shards, {"s": front})
    validate(task, plan)
    route = plan_routes(task, plan)["s"]
    for row, device in zip(hot[2:], placed):
        new = route.row_map.to_new(torch.tensor([int(row)]))
        for src in range(4):
            assert int(route.columns[0].route(torch.tensor([src]), new)) == device


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


def test_heldout_family_draws_within_its_ranges_and_replays(tmp_path):
    from embshard.flexshard.tasks import HeldoutFamily, heldout_draw, heldout_task

    family = HeldoutFamily(log10_rows=(3.0, 4.0), mean_length=(2.0, 6.0), batch_sizes=(64,), steps=3)
    for i in range(4):
        d = heldout_draw(family, i, seed=5)
        assert 2 <= d["hosts"] <= 4 and 4 <= d["devices_per_host"] <= 8 and 6 <= len(d["rows"]) <= 10
        assert all(10**3 - 1 <= r <= 10**4 + 1 for r in d["rows"]) and all(0.6 <= z <= 1.4 for z in d["zipf"])
        assert all(2.0 <= m <= 6.0 for m in d["mean_length"]) and set(d["dims"]) <= set(family.dims)
    task = heldout_task(family, 1, 5, tmp_path)
    again = heldout_task(family, 1, 5, tmp_path)  # a pure function of (seed, index); the trace is reused
    assert task == again and task.hosts == heldout_draw(family, 1, 5)["hosts"]
    need = max(RowWiseSharder().shard(Task.from_dict({**task.to_dict(), "device_memory_bytes": 1 << 50}))
               .memory_bytes(task))
    assert task.device_memory_bytes == math.ceil(1.25 * need)
    for t in task.tables:
        ids, lengths = step_batch(t, task.batch_size, 2, 0)  # the last of the trace's 3 steps
        assert lengths.size == task.batch_size and ids.size == lengths.sum() and ids.max() < t.rows


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

    # the claims script finds the task and the replayed step from the config.yaml beside the report
    import importlib.util

    from embshard.flexshard.floor import placement_floor
    from embshard.flexshard.traffic import global_batches

    spec = importlib.util.spec_from_file_location("flexshard_heldout", ROOT / "scripts" / "flexshard_heldout.py")
    heldout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heldout)
    result = heldout.claims([out / "report.json"])
    row, = result["tasks"]
    want = placement_floor(task, global_batches(task, range(2, 3), 0))  # fit 2 steps, replay step 2
    assert row["floor"]["expected_ms"] == pytest.approx(want.expected_ms) and want.expected_ms > 0
    assert row["flexshard_over_floor"] == pytest.approx(by["flexshard"]["modeled_comm_ms"] / want.expected_ms)
    assert row["comm_ms_vs_row_wise"]["floor_ratio"] == pytest.approx(
        want.expected_ms / min(by["row_wise"]["modeled_comm_ms"], by["table_row_wise"]["modeled_comm_ms"]))
    assert "| floor ms |" in heldout.markdown(result)


@pytest.mark.parametrize("change, message", [
    ({"hosts": 3}, "must equal num_devices"),
    ({"inter_host_gbps": -2}, "inter_host_gbps"),
    ({"tables": [{"name": "a", "rows": 5, "dim": 4, "pooling_factor": 1.0, "kind": "ragged"}]}, "kind must be"),
    ({"tables": [{"name": "a", "rows": 5, "dim": 4, "pooling_factor": -3.0, "kind": "sequence"}]}, "pooling_factor"),
    ({"tables": [{"name": "a", "rows": 5, "dim": 4, "pooling_factor": 1.0, "kind": "sequence",
                  "reuse_histogram": [0.5, 0.6] + [0.0] * 15}]}, "must sum to 1"),
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


def test_two_level_estimate_counts_per_host_dedup_by_hand():
    """scripts/flexshard_two_level.py: ids that cross hosts go through the requester's rail proxy
    and each distinct id crosses once per host."""
    from scripts.flexshard_two_level import inter_host_all_to_all, two_level_step

    t = Table("s", 10, 4, 2.0, kind="sequence")
    task = Task("hand2", 4, 1 << 20, 4, (t,), devices_per_host=2)  # hosts {0, 1} and {2, 3}
    plan = Plan(task.name, "rw", [Shard("s", 2, 0, 4, 0, 5), Shard("s", 3, 0, 4, 5, 5)], dedup_ids=True)
    model = TrafficModel(task, plan)
    # one sample per device: device 0 looks up 0, 6; device 1 0, 1; device 2 0 (its own); device 3 7 (its own)
    today, two = two_level_step(model, {"s": (np.array([0, 6, 0, 1, 0, 7]), np.array([2, 2, 1, 1]))})
    counts = 8 * 8  # the split counts: one int64 on each of the 8 inter-host pairs, both ways
    vec = 4 * 4
    # today: 0->2 {0}, 0->3 {6}, 1->2 {0, 1}: 4 ids and 4 vectors each way
    assert inter_host_all_to_all(model, today) == counts + 4 * 8 + 2 * 4 * vec
    # two-level: host 0's proxy for device 2 is device 0 (ids {0, 1}), for device 3 device 1 ({6})
    assert inter_host_all_to_all(model, two) == counts + 3 * 8 + 2 * 3 * vec
    assert two.phases["ids_to_proxy"][1, 0] == 2 * 8 and two.phases["ids_to_proxy"][0, 1] == 8
    assert two.phases["embeddings_from_proxy"][0, 1] == 2 * vec and two.phases["embeddings_from_proxy"][1, 0] == vec
    assert two.phases["ids_to_proxy"].sum() == 3 * 8
