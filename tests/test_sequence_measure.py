"""Sequence tables under evaluate=estimated / measured: unpooled kernels, each copy's share of the
samples, all-to-all widths of one vector per id, and the caveat shard.py writes beside them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from embshard.compare import sequence_caveat
from embshard.errors import InputError
from embshard.hardware import compute as compute_mod
from embshard.hardware.backends import FbgemmKernel, GroupKernel, ShardInput, TorchKernel, make_kernel, shard_batch
from embshard.hardware.evaluator import HardwareEvaluator
from embshard.plan import Plan, Shard
from embshard.tables import Table
from embshard.task import Task

from test_hardware import BACKENDS, need_backend, proto

ROOT = Path(__file__).resolve().parents[1]


def whole(t: Table, device: int = 0, copies: int = 1) -> ShardInput:
    return ShardInput(t, Shard.whole(t, device), copies)


def weights(kernel) -> list[np.ndarray]:
    """Every weight of a kernel, per op / weight group, in the kernel's order."""
    if isinstance(kernel, GroupKernel):
        return [w for p in kernel.parts for w in weights(p)]
    if isinstance(kernel, FbgemmKernel):
        return [w.detach().clone().numpy() for w in kernel.op.split_embedding_weights()]
    return [w.detach().clone().numpy() for _, _, w in kernel.groups]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_device_of_both_kinds_runs_one_pooled_op_and_one_unpooled_op_per_width(backend):
    """A pooled table and sequence tables of widths 8 and 16: three ops; the pooled one returns a
    sum per sample, each unpooled one a vector per id; one step moves every looked-up row of every
    op by -lr x count x 1e-3 (the output gradient), as the pooled kernel does."""
    need_backend(backend)
    p = Table("p", 40, 4, 3.0)
    s8 = Table("s8", 30, 8, 5.0, kind="sequence")
    s16 = Table("s16", 20, 16, 2.0, kind="sequence")
    shards = [whole(s16), whole(p), whole(s8)]
    k = make_kernel(backend, shards, 12)
    assert isinstance(k, GroupKernel) and len(k.parts) == 3
    assert [sorted(x.table.name for x in part.shards) for part in k.parts] == [["p"], ["s8"], ["s16"]]
    rng = np.random.default_rng(3)
    draws = shard_batch([whole(p), whole(s8), whole(s16)], 12, np.random.default_rng(3)).per_shard
    batch = k.make_batch(rng)  # the same draws, in the parts' order
    outs = k.forward(batch)
    assert [tuple(o.shape) for o in outs] == [(12, 4), (draws[1][0].numel(), 8), (draws[2][0].numel(), 16)]
    assert draws[1][0].numel() > 12  # more ids than samples: unpooled outputs are not per sample
    before = weights(k)
    k.step(batch)
    after = weights(k)
    for (idx, _), (t, b, a) in zip(draws, zip((p, s8, s16), before, after)):
        counts = np.bincount(idx.numpy(), minlength=t.rows)
        np.testing.assert_allclose(a, b - 0.01 * 1e-3 * counts[:, None], rtol=0, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_refuse_the_wrong_kind_or_mixed_widths_unpooled(backend):
    need_backend(backend)
    cls = FbgemmKernel if backend == "fbgemm" else TorchKernel
    p, s = Table("p", 10, 4, 1.0), Table("s", 10, 4, 2.0, kind="sequence")
    with pytest.raises(InputError, match="pooled shards only"):
        cls([whole(s)], 4)
    with pytest.raises(InputError, match="sequence shards only"):
        cls([whole(p)], 4, pooling="none")
    with pytest.raises(InputError, match="one width"):
        cls([whole(s), whole(Table("s2", 10, 8, 2.0, kind="sequence"))], 4, pooling="none")
    assert not isinstance(make_kernel(backend, [whole(p)], 4), GroupKernel)  # pooled only: one op, as before


def test_each_copy_of_a_sequence_piece_serves_its_share_of_the_samples():
    """Copy r of k keeps the ids of samples s with s % k == r (bags stay [batch + 1]); the copies
    together see every id once. A pooled shard ignores copies (each copy pools its own batch)."""
    s = Table("s", 200, 4, 6.0, kind="sequence")
    full = shard_batch([whole(s)], 64, np.random.default_rng(1)).per_shard[0]
    lengths = (full[1][1:] - full[1][:-1]).numpy()
    got = []
    for r in range(3):
        piece = ShardInput(s, Shard("s", r, 0, 4, 0, 200, replica=r), copies=3)
        idx, off = shard_batch([piece], 64, np.random.default_rng(1)).per_shard[0]
        mine = (off[1:] - off[:-1]).numpy()
        assert off.numel() == 65
        np.testing.assert_array_equal(mine, np.where(np.arange(64) % 3 == r, lengths, 0))
        got.append(idx)
    assert sorted(torch.cat(got).tolist()) == sorted(full[0].tolist())
    p = Table("p", 200, 4, 6.0)
    a = shard_batch([whole(p)], 64, np.random.default_rng(1)).per_shard[0]
    b = shard_batch([ShardInput(p, Shard("p", 1, 0, 4, 0, 200, replica=1), copies=3)], 64,
                    np.random.default_rng(1)).per_shard[0]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_device_widths_count_one_vector_per_id_for_sequence_pieces():
    s = Table("s", 100, 8, 5.0, kind="sequence")
    p = Table("p", 100, 4, 1.0, num_poolings=2.0)
    tables = {"s": s, "p": p}
    cases = [
        # whole sequence table: 8 columns x 5 ids per sample; a pooled table read by 2 features: 2 x 4
        ([Shard.whole(s, 0), Shard.whole(p, 1)], [40, 8, 0]),
        # row halves: each serves half the ids
        ([Shard("s", 0, 0, 8, 0, 50), Shard("s", 2, 0, 8, 50, 50), Shard.whole(p, 1)], [20, 8, 20]),
        # the first 20 rows in 2 copies serve 20% of the ids, half on each; the rest 80% on device 2
        ([Shard("s", 0, 0, 8, 0, 20), Shard("s", 1, 0, 8, 0, 20, replica=1), Shard("s", 2, 0, 8, 20, 80),
          Shard.whole(p, 1)], [4, 12, 32]),
        # a rectangle on every device: each id is looked up where its sample is
        ([Shard("s", d, 0, 8, 0, 100, replica=d) for d in range(3)] + [Shard.whole(p, 0)], [8, 0, 0]),
    ]
    for shards, expected in cases:
        plan = Plan("t", "x", shards)
        assert plan.device_widths(3, tables) == expected, shards
    # without the tables, every piece counts as a pooled one of one feature (the old contract)
    assert Plan("t", "x", cases[0][0]).device_widths(3) == [8, 4, 0]


def test_data_parallel_floats_and_partial_pooled_copies():
    """Each rank all-reduces rows x dim gradient values of a pooled rectangle held on every
    device; a sequence table's copies and a pooled copy on some devices only count nothing
    there, and the latter is named by `partly_replicated_pooled`."""
    p, q, s = Table("p", 100, 4, 1.0), Table("q", 30, 8, 1.0), Table("s", 50, 16, 3.0, kind="sequence")
    tables = {"p": p, "q": q, "s": s}
    every_p = [Shard("p", d, 0, 4, 0, 100, replica=d) for d in range(3)]
    every_s = [Shard("s", d, 0, 16, 0, 50, replica=d) for d in range(3)]
    two_q = [Shard("q", 0, 0, 8, 0, 30), Shard("q", 2, 0, 8, 0, 30, replica=1)]
    plan = Plan("t", "x", every_p + every_s + two_q)
    assert plan.data_parallel_floats(3, tables) == 400
    assert plan.partly_replicated_pooled(3, tables) == ["q"]
    assert plan.device_widths(3, tables) == [0, 0, 0]  # q's copies send nothing (replicated pooled)
    assert plan.data_parallel_floats(1, tables) == 0  # one device: nothing to all-reduce
    # column halves of q, each on every device: both halves all-reduced
    halves = [Shard("q", d, c, 4, 0, 30, replica=d) for d in range(3) for c in (0, 4)]
    plan = Plan("t", "x", every_p + halves + [Shard.whole(s, 1)])
    assert plan.data_parallel_floats(3, tables) == 400 + 240
    assert plan.partly_replicated_pooled(3, tables) == []
    assert Plan("t", "x", [Shard.whole(p, 0), Shard.whole(q, 1)]).data_parallel_floats(3, tables) == 0


def test_a_data_parallel_copy_is_its_own_op_at_the_local_batch():
    """TorchRec runs data-parallel tables on each rank's own samples: a pooled copy of k is
    stepped by a pooled op of ceil(batch / k) bags beside the device's other pooled op, and its
    output has that many rows."""
    a, p = Table("a", 300, 8, 2.0), Table("p", 200, 4, 6.0)
    k = make_kernel("torch", [whole(a), whole(p, copies=3)], 64)
    assert isinstance(k, GroupKernel) and [part.batch_size for part in k.parts] == [64, 22]
    assert k.batch_size == 64
    batch = k.make_batch(np.random.default_rng(0))
    assert [int(o.numel()) - 1 for _, o in batch.per_shard] == [64, 22]
    outs = k.forward(batch)
    assert [tuple(o.shape) for o in outs] == [(64, 8), (22, 4)]
    k.step(batch)
    only = make_kernel("torch", [whole(p, copies=4)], 64)  # a device with copies only
    assert not isinstance(only, GroupKernel) and only.batch_size == 16


def seq_task(devices: int = 2) -> Task:
    return Task("seqm", devices, 256 * 2**20, 64,
                (Table("s", 400, 8, 6.0, kind="sequence"), Table("p", 300, 4, 2.0)))


def test_the_evaluator_times_each_copy_of_a_sequence_piece_on_its_share(monkeypatch):
    """measure_many hands the kernels each rectangle's number of copies, and the all-to-all the
    sequence widths."""
    seen = []
    real = compute_mod.make_kernel

    def spy(backend, shards, *a, **k):
        seen.append(sorted((s.table.name, s.shard.replica, s.copies) for s in shards))
        return real(backend, shards, *a, **k)

    monkeypatch.setattr(compute_mod, "make_kernel", spy)
    task = seq_task()
    plan = Plan("seqm", "copies", [Shard.whole(task.tables[0], 0), Shard("s", 1, 0, 8, 0, 400, replica=1),
                                   Shard.whole(task.tables[1], 1)])
    ev = HardwareEvaluator(backend="torch", comm_backend=None, protocol=proto(0, 1))
    (costs,) = ev.measure_many(task, [plan])
    assert seen == [[("s", 0, 2)], [("p", 0, 1), ("s", 1, 2)]]
    assert all(c > 0 for c in costs.compute_ms)
    # replicated on both devices: every id local, so only the pooled table sends
    assert plan.device_widths(2, task.table_by_name) == [0, 4]


def test_sequence_caveat_names_what_the_evaluation_leaves_out():
    task = seq_task()
    for mode in ("estimated", "measured"):
        line = sequence_caveat(task, mode)
        assert line is not None and "'s'" in line and "uniform row shares" in line and "evaluate=traffic" in line
        assert "\n" not in line
    assert "unpooled" in sequence_caveat(task, "measured") and "as pooled" in sequence_caveat(task, "estimated")
    assert sequence_caveat(task, "traffic") is None and sequence_caveat(task, "none") is None
    # TorchRec's DMP step runs an EmbeddingCollection and routes every id: nothing left out
    assert sequence_caveat(task, "measured", step="dmp") is None
    assert sequence_caveat(task, "estimated", step="dmp") is not None
    pooled = Task("pooled", 2, 256 * 2**20, 64, (Table("p", 300, 4, 2.0),))
    assert sequence_caveat(pooled, "measured") is None


def test_shard_py_writes_the_caveat_beside_estimates_of_sequence_tables(tmp_path, capsys):
    from test_shard_cli import run_shard_here

    out = tmp_path / "out"
    proc = run_shard_here(f"task_file={ROOT / 'examples' / 'tasks' / 'sequence.json'}", "algorithms=[row_wise,flexshard]",
                          "evaluate=estimated", "plot=false", f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert set(report["caveats"]) == {"sequence"}
    assert report["caveats"]["sequence"] in proc.stdout
    assert all(r["valid"] and r["estimated_cost_ms"] > 0 for r in report["results"])


def test_a_guarded_planner_on_a_task_of_both_kinds_is_measured_whole(capsys, tmp_path):
    """evaluate=measured on a task of both kinds: NeuroShard plans the pooled tables (its guard
    measuring them), the sequence tables placed around them, and the whole plan guarded against
    the heuristics' plans of the whole task; the caveat printed; no `neuroshard_pick` row, whose
    plan would hold the pooled tables only."""
    from test_honest_runs import report, run_in_process

    tables = (Table("s0", 3000, 8, 6.0, kind="sequence"), Table("p0", 5000, 8, 2.0), Table("p1", 900, 16, 5.0),
              Table("p2", 2000, 4, 1.0))
    task = Task("both", 2, 64 * 2**20, 128, tables)
    code, stdout, err, out = run_in_process(capsys, tmp_path, task, "evaluate=measured", "measure=quick", "plot=false",
                                            "algorithms=[neuroshard,size_lookup_greedy]")
    assert code == 0, err
    rep = report(out)
    by = {r["algorithm"]: r for r in rep["results"]}
    assert set(by) == {"neuroshard", "size_lookup_greedy"}
    ns = by["neuroshard"]
    assert ns["valid"] and ns["search_info"]["mixed"]["sequence_tables"] == 1
    # report.json's guard is the whole plan's, against the heuristics of the whole task; the guard
    # of the pooled tables alone is kept beside the mixed record
    assert ns["guard"]["candidates"][0]["label"] == "neuroshard#1"
    assert any(c["label"] == "size_lookup_greedy" for c in ns["guard"]["candidates"])
    assert ns["search_info"]["mixed"]["pooled_guard"]["candidates"][0]["label"] == "neuroshard#1"
    assert all(r["measured_cost_ms"] > 0 for r in by.values())
    assert rep["caveats"]["both"] in stdout


class CostByPlan:
    """Measures a plan by a rule on it (a stand-in for the hardware in a test of the guard's logic)."""

    def __init__(self, cost):
        self.cost, self.calls = cost, []

    def measure_many(self, task, plans, visits=None):
        from embshard.costs.base import DeviceCosts

        self.calls.append([p.algorithm for p in plans])
        return [DeviceCosts([self.cost(p)] * task.num_devices, [0.0] * task.num_devices, [0.0] * task.num_devices)
                for p in plans]


@pytest.mark.parametrize("two_part_cheaper", [True, False])
def test_the_whole_plan_of_a_task_of_both_kinds_is_guarded_against_the_heuristics_of_the_whole_task(two_part_cheaper):
    """NeuroShard with hardware on a task of both kinds: after its own guard on the pooled tables,
    the whole two-part plan is measured against every heuristic's plan of the whole task; it is kept
    only where shown better, else the best heuristic's plan, under NeuroShard's name."""
    from embshard.api import plan_with_info
    from embshard.search.neuroshard import NeuroShardSharder

    tables = (Table("s0", 3000, 8, 6.0, kind="sequence"), Table("s1", 800, 16, 3.0, kind="sequence")) + tuple(
        Table(f"p{i}", 500 * (i + 1), 4 * (1 + i % 3), 1.0 + i) for i in range(6))
    task = Task("both", 2, 64 * 2**20, 128, tables)  # where the two-part plan is no heuristic's
    sharder = NeuroShardSharder(checkpoint=None)
    # whole-task plans hold the sequence table; the pooled guard's plans do not
    two_part = {"neuroshard": 1.0 if two_part_cheaper else 3.0}
    ev = CostByPlan(lambda p: (two_part.get(p.algorithm, 2.0) if any(s.table == "s0" for s in p.shards)
                               else (1.0 if p.algorithm == "neuroshard" else 2.0)))
    plan, info = plan_with_info(task, sharder, "neuroshard", hardware=ev)
    g = info["guard"]
    assert [c["label"] for c in g["candidates"]][0] == "neuroshard#1"
    assert {c["label"] for c in g["candidates"] if c["source"] == "heuristic"} >= {"size_lookup_greedy", "lookup_greedy"}
    assert plan.algorithm == "neuroshard" and {s.table for s in plan.shards} == {t.name for t in tables}
    if two_part_cheaper:
        assert g["decision"]["verdict"] == "better" and g["chosen"] == "neuroshard#1"
    else:
        assert g["decision"]["verdict"] == "worse" and g["chosen"] != "neuroshard#1"
        assert g["chosen"] in {c["label"] for c in g["candidates"] if c["source"] == "heuristic"}
    assert sharder.last_guard is not None  # its own guard ran on the pooled tables first


def test_task_to_collections_holds_one_bag_collection_and_an_embedding_collection_per_width():
    pytest.importorskip("torchrec")
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    from embshard.torchrec_bridge import collections_plan, task_to_collections, task_to_ebc

    tables = (Table("s8", 300, 8, 4.0, kind="sequence"), Table("p", 500, 16, 2.0),
              Table("s16", 200, 16, 3.0, kind="sequence"), Table("s8b", 100, 8, 2.0, kind="sequence"))
    task = Task("kinds", 2, 1 << 30, 64, tables)
    parts = task_to_collections(task)
    assert list(parts) == ["ebc", "ec8", "ec16"]
    assert isinstance(parts["ebc"], EmbeddingBagCollection) and isinstance(parts["ec8"], EmbeddingCollection)
    assert [c.name for c in parts["ebc"].embedding_bag_configs()] == ["p"]
    assert [c.name for c in parts["ec8"].embedding_configs()] == ["s8", "s8b"]
    assert [(c.name, c.embedding_dim) for c in parts["ec16"].embedding_configs()] == [("s16", 16)]
    plan = Plan("kinds", "x", [Shard.whole(tables[0], 0), Shard.whole(tables[1], 1), Shard.whole(tables[2], 1),
                               Shard("s8b", 0, 0, 8, 0, 50), Shard("s8b", 1, 0, 8, 50, 50)])
    exported = collections_plan(task, plan, parts, prefix="m.")
    assert sorted(exported.plan) == ["m.ebc", "m.ec16", "m.ec8"]
    assert sorted(exported.plan["m.ec8"]) == ["s8", "s8b"] and exported.plan["m.ec8"]["s8b"].sharding_type == "row_wise"
    assert exported.plan["m.ec16"]["s16"].ranks == [1]
    with pytest.raises(InputError, match="sequence table.*EmbeddingCollection"):
        task_to_ebc(task)


@pytest.mark.slow
def test_dmp_step_runs_an_embedding_collection_beside_the_bags():
    """hardware=dmp_cpu on a task of both kinds: TorchRec's DMP over an EmbeddingBagCollection and
    an EmbeddingCollection per sequence width, on 2 gloo processes, a sequence table row-wise."""
    pytest.importorskip("torchrec")
    from embshard.hardware.dmp_step import measure_dmp_steps

    tables = (Table("p", 4000, 16, 3.0), Table("s8", 3000, 8, 5.0, kind="sequence"),
              Table("s16", 2000, 16, 4.0, kind="sequence"))
    task = Task("dmpboth", 2, 1 << 30, 256, tables)
    plan = Plan(task.name, "x", [Shard.whole(tables[0], 0), Shard.whole(tables[2], 0),
                                 Shard("s8", 0, 0, 8, 0, 1500), Shard("s8", 1, 0, 8, 1500, 1500)])
    [s] = measure_dmp_steps(task, [plan], proto(1, 2))
    assert len(s.forward_ms) == 2 and all(x > 0 for x in s.input_dist_ms + s.forward_ms + s.backward_ms)
    assert s.step_ms > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_of_one_kernel_steps_on_a_rebuilt_kernel_of_the_same_shards(backend):
    """measure_compute may rebuild a kernel at a visit and replay the batches an earlier build
    drew (inputs kept, kernel not): a device of both kinds steps on them."""
    need_backend(backend)
    shards = [whole(Table("p", 40, 4, 3.0)), whole(Table("s8", 30, 8, 5.0, kind="sequence")),
              whole(Table("s16", 20, 16, 2.0, kind="sequence"))]
    batch = make_kernel(backend, shards, 12).make_batch(np.random.default_rng(0))
    again = make_kernel(backend, shards, 12)
    assert again.num_inputs == len(batch.per_shard)
    again.step(batch)
    assert [tuple(o.shape)[1] for o in again.forward(batch)] == [4, 8, 16]


def test_dmp_step_refuses_replicated_sequence_tables_in_one_line_before_spawning():
    """TorchRec's data-parallel EmbeddingCollection fails inside DMP's CPU step (its output split):
    refused before any process starts, naming the plan and the tables."""
    pytest.importorskip("torchrec")
    from embshard.errors import PlanError
    from embshard.hardware.dmp_step import measure_dmp_steps

    task = seq_task()
    s, p = task.tables
    plan = Plan(task.name, "dp", [Shard(s.name, d, 0, s.dim, 0, s.rows, replica=d) for d in range(2)] + [Shard.whole(p, 0)])
    with pytest.raises(PlanError) as e:
        measure_dmp_steps(task, [plan], proto(0, 1))
    assert "'dp'" in str(e.value) and "['s']" in str(e.value) and "\n" not in str(e.value)


def test_shard_py_writes_no_caveat_under_torchrecs_step():
    import shard
    from test_honest_runs import shard_cfg

    task = seq_task()
    assert set(shard._caveats([task], shard_cfg("evaluate=measured"))) == {"seqm"}
    assert shard._caveats([task], shard_cfg("evaluate=measured", "hardware=dmp_cpu")) == {}
    assert set(shard._caveats([task], shard_cfg("evaluate=estimated", "hardware=dmp_cpu"))) == {"seqm"}
