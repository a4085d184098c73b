"""The FlexShard data path on 4 real gloo processes laid out as 2 hosts x 2 devices.

Under a FlexShard plan with all three tiers (replicated, per host, split), its dedup variant
and the row_wise and table_row_wise baselines, ShardedSequenceEmbedding's outputs and gradients equal an unsharded
TorchRec EmbeddingCollection's on the same batch and weights; the bytes each process sent to
each peer, by purpose, equal embshard.flexshard.traffic's count for the same batch; and
training under the FlexShard plan lowers the loss.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from embshard.flexshard.baselines import RowWiseSharder, TableRowWiseSharder
from embshard.flexshard.layout import Tiers, tier_layout
from embshard.flexshard.stats import BatchSplit, step_batch, task_access_stats
from embshard.flexshard.traffic import PURPOSES, TrafficModel
from embshard.plan import Plan, validate
from embshard.tables import Table
from embshard.task import Task

WORLD = 4


def _task() -> Task:
    tables = (Table("s0", 60, 8, 5.0, kind="sequence"), Table("s1", 200, 8, 4.0, kind="sequence"),
              Table("s2", 500, 8, 6.0, kind="sequence"))
    return Task("seq4", WORLD, 1 << 30, 32, tables, devices_per_host=2)


def _tiered_plan(task: Task, dedup: bool, sparse: bool) -> Plan:
    """All three tiers non-empty in every table (cuts fixed, so the test does not depend on the search)."""
    stats = task_access_stats(task, BatchSplit(2, 1))
    plan = Plan(task.name, "tiers", dedup_ids=dedup, sparse_sync=sparse)
    for t, (g, h) in zip(task.tables, [(3, 6), (5, 11), (4, 9)]):
        front, shards = tier_layout(task, t, stats[t.name].ids, Tiers(g, h))
        plan.shards += shards
        plan.row_maps[t.name] = front
    return plan


@pytest.mark.slow
def test_data_path_matches_embedding_collection_and_traffic_model(tmp_path: Path):
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    task = _task()
    task.save(tmp_path / "task.json")
    plans = {
        "flexshard": _tiered_plan(task, dedup=True, sparse=True),  # what FlexShard ships
        "sparse_sync_no_dedup": _tiered_plan(task, dedup=False, sparse=True),
        "dense_sync": _tiered_plan(task, dedup=False, sparse=False),  # HugeCTR's hybrid syncs so
        "row_wise": RowWiseSharder().shard(task),
        "table_row_wise": TableRowWiseSharder().shard(task),
    }
    for name, plan in plans.items():
        validate(task, plan)
        plan.save(tmp_path / "plans" / f"{name}.json")
    assert all(len(plans["flexshard"].row_maps[t.name]) for t in task.tables)

    torch.manual_seed(0)
    batch = {t.name: step_batch(t, task.batch_size, 3) for t in task.tables}  # a step after the fit steps
    inputs = {
        "plans": list(plans),
        "weights": {t.name: torch.rand(t.rows, t.dim) * 2 - 1 for t in task.tables},
        "ids": {k: torch.from_numpy(v[0]) for k, v in batch.items()},
        "lengths": {k: torch.from_numpy(v[1]) for k, v in batch.items()},
        "projection": {k: torch.randn(v[0].size, task.table(k).dim) for k, v in batch.items()},
        "readout": {t.name: torch.randn(t.dim) for t in task.tables},
        "target": {t.name: torch.randint(0, 2, (t.rows,)).float() * 2 - 1 for t in task.tables},
    }
    torch.save(inputs, tmp_path / "inputs.pt")

    from _ranks import run_ranks

    worker = Path(__file__).with_name("_flexshard_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # each rank its own process, started warm (tests/_ranks.py); dlrm/ is on the path there
    done = run_ranks(worker, [[r, WORLD, tmp_path] for r in range(WORLD)], tmp_path, env=env, timeout=180)
    for r, (code, log) in enumerate(done):
        assert code == 0, f"rank {r} failed:\n{log[-3000:]}"
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]

    # the reference: TorchRec's unsharded EmbeddingCollection on the whole global batch
    ec = EmbeddingCollection([EmbeddingConfig(num_embeddings=t.rows, embedding_dim=t.dim, name=t.name,
                                              feature_names=[t.name]) for t in task.tables], device=torch.device("cpu"))
    with torch.no_grad():
        for t in task.tables:
            ec.embeddings[t.name].weight.copy_(inputs["weights"][t.name])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[t.name for t in task.tables],
        values=torch.cat([inputs["ids"][t.name] for t in task.tables]),
        lengths=torch.cat([inputs["lengths"][t.name] for t in task.tables]),
    )
    ref = ec(kjt)
    sum(((ref[t.name].values() * inputs["projection"][t.name]).sum() for t in task.tables)).backward()

    starts = {}
    for t in task.tables:
        per_rank = torch.from_numpy(batch[t.name][1]).split(task.batch_size // WORLD)
        starts[t.name] = np.concatenate([[0], np.cumsum([int(x.sum()) for x in per_rank])])
    for name, plan in plans.items():
        model = TrafficModel(task, plan).step(batch)
        sync_rows = 0
        for r, res in enumerate(results):
            got = res["plans"][name]
            for t in task.tables:
                a, b = starts[t.name][r], starts[t.name][r + 1]
                want = ref[t.name].values()[a:b]
                assert torch.allclose(got["out"][t.name], want, atol=1e-6), f"{name}: rank {r} table {t.name} outputs differ"
                grad = ec.embeddings[t.name].weight.grad
                for rows, g in got["grads"][t.name]:
                    assert torch.allclose(g, grad[rows], atol=1e-5), f"{name}: rank {r} table {t.name} gradients differ"
                    sync_rows += rows.numel()
            for purpose in PURPOSES:
                assert np.array_equal(got["pair_bytes"][purpose].numpy(), model.purpose_matrix(purpose)[r]), (
                    f"{name}: rank {r} sent {got['pair_bytes'][purpose].tolist()} {purpose} bytes, "
                    f"the model counts {model.purpose_matrix(purpose)[r].tolist()}")
        assert sync_rows >= sum(t.rows for t in task.tables)  # every row's gradient was checked somewhere
    flex = TrafficModel(task, plans["flexshard"]).step(batch)
    assert flex.purpose_matrix("replica_sync").sum() > 0 and flex.purpose_matrix("embeddings_fw").sum() > 0

    curve = results[0]["curve"]
    assert all(res["curve"] == curve for res in results)  # every rank saw the same global loss
    assert curve[-1] < 0.7 * curve[0], curve
