"""The planner's roles as small protocols: the predictor protocols a cost model states, the
numpy forward pass against the torch nets it copies, and the greedy partitioner and the
measured guard used by a caller that is not NeuroShard."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embshard import Table, Task, validate
from embshard.costs.base import DeviceCosts
from embshard.costs.features import NUM_FEATURES, shard_features
from embshard.costs.neural import (BACKWARD_COMM_FEATURES, COMM_FEATURE_NAMES, CommNet, ComputeNet, NeuralCostModels,
                                   NumpyCommNet, NumpyComputeNet)
from embshard.costs.predictor import (AnalyticFamily, AnalyticPredictor, EncodingPredictor, PredictorFamily,
                                      ShardPredictor, supports_incremental)
from embshard.plan import Plan, Shard
from embshard.search.greedy import GreedyPartitioner
from embshard.search.guard import MeasuredGuard
from embshard.search.pieces import PieceBook, initial_state
from embshard.search.simulator import Simulator

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt"


def random_tables(rng: np.random.Generator, n: int) -> list[Table]:
    out = []
    for i in range(n):
        hist = rng.dirichlet(np.ones(17))
        out.append(Table(f"t{i}", int(rng.integers(100, 2_000_000)), 4 * int(rng.integers(1, 65)),
                         float(rng.uniform(0.5, 80)), tuple(float(x) for x in hist)))
    return out


# ----------------------------------------------------------------------------- numpy == torch
def test_numpy_compute_forward_equals_the_torch_net():
    """A compute net with trained-like (random, non-trivial) weights and data-fitted scales:
    the numpy copy's head(sum of encodings) is the torch net's forward on the padded shards."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    net = ComputeNet()
    shards = [random_tables(rng, int(rng.integers(1, 12))) for _ in range(40)]
    feats = [shard_features(s, int(b)) for s, b in zip(shards, rng.choice([2048, 8192, 65536], size=40))]
    net.init_from_data(feats, rng.uniform(0.5, 200.0, size=40), steps=20)
    with torch.no_grad():  # move the zero-initialised output layers off their start
        for layer in (net.rates[-1], net.context[-1]):
            layer.weight.normal_(0.0, 0.3)
            layer.bias.normal_(0.0, 0.3)
    k = max(len(f) for f in feats)
    x = np.zeros((len(feats), k, NUM_FEATURES), np.float32)
    mask = np.zeros((len(feats), k), np.float32)
    for i, f in enumerate(feats):
        x[i, : len(f)], mask[i, : len(f)] = f, 1.0
    with torch.no_grad():
        want = net(torch.from_numpy(x), torch.from_numpy(mask)).double().numpy()
    fast = NumpyComputeNet(net.state_dict())
    got = fast.head(np.stack([fast.encode(f).sum(0) for f in feats]))
    np.testing.assert_allclose(got, want, rtol=2e-5)
    assert want.std() / want.mean() > 0.1  # a spread of answers, not one constant


@pytest.mark.parametrize("with_delays", [True, False])
def test_numpy_comm_forward_equals_the_torch_net(with_delays):
    rng = np.random.default_rng(1)
    torch.manual_seed(1)
    names = COMM_FEATURE_NAMES if with_delays else BACKWARD_COMM_FEATURES
    net = CommNet(in_features=len(names))
    fast = NumpyCommNet(net.state_dict())
    for d in (2, 5, 16):
        x = rng.normal(size=(7, d, len(names))).astype(np.float32)
        with torch.no_grad():
            want = net(torch.from_numpy(x), torch.ones(7, d)).numpy()
        np.testing.assert_allclose(fast(x), want, rtol=1e-5, atol=1e-5)


def test_shipped_models_predict_what_their_torch_nets_compute():
    """The loaded bundle's numpy predictions against its own torch nets (`net(kind)`)."""
    models = NeuralCostModels.load(SHIPPED)
    rng = np.random.default_rng(2)
    shards = [random_tables(rng, int(rng.integers(1, 8))) for _ in range(12)]
    p = models.at_batch(8192)
    feats = [shard_features(s, 8192) for s in shards]
    net = models.net("compute")
    k = max(len(f) for f in feats)
    x = np.zeros((len(feats), k, NUM_FEATURES), np.float32)
    mask = np.zeros((len(feats), k), np.float32)
    for i, f in enumerate(feats):
        x[i, : len(f)], mask[i, : len(f)] = f, 1.0
    with torch.no_grad():
        want = net(torch.from_numpy(x), torch.from_numpy(mask)).double().numpy() * models.scale["compute"]
    np.testing.assert_allclose(p.compute_ms(shards), want, rtol=2e-5)


# ----------------------------------------------------------------------------- protocols
class ComputeOnly:
    """A predictor that states no encoding: the greedy must re-predict whole shards."""

    batch_size = None

    def compute_ms(self, shards):
        return np.array([sum(t.pooling_factor * t.dim for t in s) * 1e-3 for s in shards], dtype=float)

    def comm_ms(self, widths, delays_ms):
        w = np.asarray(widths, dtype=float)
        bw = 0.01 * w
        return bw + delays_ms.max(axis=1, keepdims=True) - delays_ms, bw


def test_predictors_state_their_capabilities():
    models = NeuralCostModels.load(SHIPPED)
    assert isinstance(models, PredictorFamily) and isinstance(AnalyticFamily(), PredictorFamily)
    for p in (models.at_batch(4096), AnalyticPredictor(batch_size=4096)):
        assert isinstance(p, EncodingPredictor) and supports_incremental(p)
    only = ComputeOnly()
    assert isinstance(only, ShardPredictor) and not supports_incremental(only)


@pytest.mark.parametrize("incremental", [True, False])
def test_greedy_partitioner_serves_any_predictor(incremental):
    """The partitioner alone (no beam, no NeuroShard), against a predictor that offers no
    encoding: it falls back to whole-shard prediction and balances the stated costs."""
    tables = [Table(f"t{i}", 1000, 8 * (1 + i % 4), float(1 + i)) for i in range(12)]
    task = Task("p", 3, 1 << 30, 1024, tuple(tables))
    sim = Simulator(ComputeOnly())
    part = GreedyPartitioner(task, sim, PieceBook(task, sim), caps=(1.0, 1.5), incremental=incremental, top_k=2)
    assert part.incremental is False  # not an EncodingPredictor: never the running sums
    result = part.partition(initial_state(task))
    plans = part.plans("mine")
    assert 1 <= len(plans) <= 2 and plans[0][1] == pytest.approx(result.cost_ms)
    validate(task, plans[0][0])
    compute = result.costs.compute_ms
    total = sum(t.pooling_factor * t.dim for t in tables) * 1e-3
    assert max(compute) <= total / 3 * 1.25  # balanced to within a quarter of an even share


class Scripted:
    def __init__(self, costs: dict[str, list[float]]):
        self.costs = {k: list(v) for k, v in costs.items()}

    def measure_many(self, task, plans, visits=None):
        return [DeviceCosts([self.costs[p.algorithm].pop(0)], [0.0], [0.0]) for p in plans]


def test_guard_serves_any_planner_candidates():
    """The guard on two candidates of some other planner: the better-measured one is S, kept
    only when its paired interval against the best heuristic lies below 1."""
    tables = tuple(Table(f"t{i}", 100, 8, 1.0 + i) for i in range(4))
    task = Task("g", 2, 1 << 30, 64, tables)
    a = Plan(task.name, "a", [Shard.whole(t, int(i == 3)) for i, t in enumerate(tables)])
    b = Plan(task.name, "b", [Shard.whole(t, int(i >= 2)) for i, t in enumerate(tables)])
    ev = Scripted({"a": [20.0], "b": [9.0, 9.0, 9.1, 8.9], "size_greedy": [10.0, 10.0, 10.1, 10.0]})
    guard = MeasuredGuard(heuristics=["size_greedy"], min_rounds=3, max_rounds=6, owner="other")
    plan, result = guard.run(task, [("a", a), ("b", b)], ev, lambda p: None, "other")
    assert result.decision["verdict"] == "better" and result.chosen == "b" and result.search_pick == "a"
    assert plan.algorithm == "other" and plan.shards == b.shards
