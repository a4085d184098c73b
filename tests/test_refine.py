"""Measured refinement (`embshard.search.refine`): the guard's first round corrects the compute
model per table, and the best measured plan is improved against the corrected model.

The "machine" here is scripted: a device's compute is the analytic model's cost of its fused
shard where two tables are looked up more or less often than the model is told (a hidden
factor on their pooling factor: not the form the correction fits), so the tests check that
the correction finds the mispriced tables and that the refined plan is cheaper on that machine,
not that the code agrees with itself.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from embshard import Plan, Shard, Table, Task, validate
from embshard.costs.base import DeviceCosts
from embshard.plan import device_pieces
from embshard.search.baselines import GreedySharder
from embshard.search.portfolio import PortfolioSharder
from embshard.search.refine import MeasuredRefinement, Refiner, fit_correction
from embshard.search.simulator import AnalyticPredictor, Simulator, batch_ratio

HIDDEN = {"t3": 3.0, "t7": 0.3}  # the machine's true lookups of these tables over the model's


def task_of(devices: int = 3, n: int = 12, memory: int = 1 << 30) -> Task:
    tables = tuple(Table(f"t{i}", 200_000 * (1 + i % 5), 8 * (1 + i % 4), 10.0 + 6 * (i % 6)) for i in range(n))
    return Task("r", devices, memory, 8192, tables)


class Machine:
    """Measures a device as the analytic cost of its shard with HIDDEN's lookups; no comm.
    Each call's costs are scaled by a small repeating jitter (paired noise, as a real session
    drifts), so intervals over rounds have a width."""

    def __init__(self, task: Task):
        self.sim = Simulator(AnalyticPredictor(batch_size=task.batch_size))
        self.calls: list[list[str]] = []

    def compute(self, task: Task, plan: Plan) -> list[float]:
        per = device_pieces(task, plan)
        true = [[replace(p, pooling_factor=p.pooling_factor * HIDDEN.get(p.name, 1.0)) for p in pieces]
                for pieces in per]
        return [float(x) for x in self.sim.compute_of(true)]

    def true_cost(self, task: Task, plan: Plan) -> float:
        return max(self.compute(task, plan))

    def measure_many(self, task, plans, visits=None):
        self.calls.append([p.algorithm for p in plans])
        jitter = 1.0 + 0.003 * (len(self.calls) % 3)
        n = task.num_devices
        return [DeviceCosts([c * jitter for c in self.compute(task, p)], [0.0] * n, [0.0] * n) for p in plans]


def model_of(task: Task) -> tuple[Simulator, float]:
    sim = Simulator(AnalyticPredictor(batch_size=task.batch_size))
    return sim, batch_ratio(sim.predictor, task)


def random_plans(task: Task, k: int, seed: int = 0) -> list[Plan]:
    rng = np.random.default_rng(seed)
    return [Plan(task.name, f"r{j}", [Shard.whole(t, int(rng.integers(task.num_devices))) for t in task.tables])
            for j in range(k)]


def test_the_correction_finds_the_tables_the_model_misprices():
    task = task_of()
    machine = Machine(task)
    plans = random_plans(task, 6)
    costs = machine.measure_many(task, plans)
    sim, ratio = model_of(task)
    c = fit_correction(task, sim, ratio, plans, costs)
    assert c is not None and c.shards == len({tuple(sorted(s.table for s in p.shards_on(d)))
                                             for p in plans for d in range(3) if p.shards_on(d)})
    ranked = sorted(c.factors, key=c.factor)
    assert ranked[-1] == "t3" and ranked[0] == "t7"  # priced too low / too high by the model
    assert c.factor("t3") > 0.3 and c.factor("t7") < -0.2
    assert c.rms_after < 0.5 * c.rms_before


def test_the_refined_plan_is_cheaper_on_the_machine_and_valid():
    task = task_of()
    machine = Machine(task)
    start = GreedySharder("lookup").shard(task)  # balanced to the model, not to the machine
    plans = [start] + random_plans(task, 4)
    costs = machine.measure_many(task, plans)
    sim, ratio = model_of(task)
    refiner = Refiner(task, task, sim, ratio, fit_correction(task, sim, ratio, plans, costs))
    refined = refiner.refine(start, costs[0])
    validate(task, refined)
    assert sorted(s.table for s in refined.shards) == sorted(t.name for t in task.tables)
    assert refiner.info["moves"] >= 1
    assert machine.true_cost(task, refined) < 0.95 * machine.true_cost(task, start)


def test_refinement_keeps_every_device_within_its_memory():
    free = task_of()
    tight = Task(free.name, 3, int(1.02 * max(GreedySharder("size").shard(free).memory_bytes(free))), 8192, free.tables)
    machine = Machine(tight)
    start = GreedySharder("size").shard(tight)
    validate(tight, start)
    plans = [start] + random_plans(tight, 4, seed=1)
    costs = machine.measure_many(tight, plans)
    sim, ratio = model_of(tight)
    budget = tight.device_memory_bytes
    refiner = Refiner(tight, tight, sim, ratio, fit_correction(tight, sim, ratio, plans, costs))
    refined = refiner.refine(start, costs[0])
    validate(tight, refined)
    assert max(refined.memory_bytes(tight)) <= budget
    # the same climb with memory to spare goes further: memory was what held it back
    loose = Refiner(free, free, sim, ratio, fit_correction(free, sim, ratio, plans, costs))
    loose.refine(start, costs[0])
    assert machine.true_cost(free, loose.refine(start, costs[0])) <= machine.true_cost(tight, refined)


def test_a_plan_with_replicas_is_left_as_it_is():
    task = task_of()
    start = GreedySharder("lookup").shard(task)
    t0 = task.tables[0]
    d0 = next(s.device for s in start.shards if s.table == t0.name)
    replicated = Plan(task.name, "dp", list(start.shards) + [Shard(t0.name, (d0 + 1) % 3, 0, t0.dim, 0, t0.rows, 1)])
    machine = Machine(task)
    costs = machine.measure_many(task, [replicated])
    sim, ratio = model_of(task)
    refiner = Refiner(task, task, sim, ratio, fit_correction(task, sim, ratio, [replicated], costs))
    assert refiner.refine(replicated, costs[0]) is replicated and refiner.info["skipped"] == "replicated pieces"


class Fixed:
    """A learned member's stand-in: one given plan."""

    from embshard.search.base import Capabilities

    capabilities = Capabilities(("pooled",), splits_tables=False)
    name = "learned"

    def __init__(self, plan_of):
        self.plan_of = plan_of

    def shard(self, task: Task) -> Plan:
        return self.plan_of(task)


@pytest.mark.parametrize("refine", [True, False])
def test_the_portfolio_guard_measures_the_refined_plan_and_keeps_it_where_it_is_better(refine):
    task = task_of()
    machine = Machine(task)
    members = {"learned": Fixed(lambda t: Plan(t.name, "learned", GreedySharder("size").shard(t).shards)),
               "lookup_greedy": GreedySharder("lookup"), "size_lookup_greedy": GreedySharder("size_lookup")}
    p = PortfolioSharder(members, ranker=None, verify=1, verify_heuristics=["lookup_greedy", "size_lookup_greedy"],
                         verify_refine=refine, workers=1)
    p.attach_evaluator(machine)
    plan = p.shard(task)
    validate(task, plan)
    g = p.last_guard
    labels = [c["label"] for c in g.candidates]
    if not refine:
        assert "refined" not in labels and g.refinement is None
        assert all("refined" not in r for r in g.rounds)
        return
    assert g.refinement["proposed"] and labels[-1] == "refined"
    assert g.candidates[-1]["measured_ms"] is None  # not in round 1: it did not exist then
    assert "refined" not in g.rounds[0] and all("refined" in r for r in g.rounds[1:])
    assert g.decision["rounds"] == len(g.rounds) - 1 >= 3  # the verdict on the paired rounds only
    assert g.decision["verdict"] == "better" and g.chosen == "refined"
    assert p.last_search_info["portfolio"]["won"] == "refined"
    best_heuristic = min(machine.true_cost(task, GreedySharder(k).shard(task)) for k in ("lookup", "size_lookup"))
    assert machine.true_cost(task, plan) < best_heuristic


def test_neuroshards_guard_refines_with_the_models_it_searched_against():
    from embshard.search.neuroshard import NeuroShardSharder

    task = task_of()
    machine = Machine(task)
    s = NeuroShardSharder(checkpoint=None, verify=2, verify_heuristics=["lookup_greedy", "size_lookup_greedy"],
                          verify_refine=True)
    s.attach_evaluator(machine)
    plan = s.shard(task)
    validate(task, plan)
    g = s.last_guard
    assert g.refinement is not None and g.refinement["correction"]["shards"] > 0
    assert g.refinement["from"] in [c["label"] for c in g.candidates]
    if g.refinement["proposed"]:
        assert all("refined" in r for r in g.rounds[1:]) and g.decision["rounds"] == len(g.rounds) - 1
    assert machine.true_cost(task, plan) <= min(machine.true_cost(task, GreedySharder(k).shard(task))
                                                for k in ("lookup", "size_lookup"))


def test_the_portfolio_refines_with_its_ranking_models():
    from embshard.costs.predictor import DEFAULT_CHECKPOINT

    task = task_of()
    neural = PortfolioSharder({"lookup_greedy": GreedySharder("lookup")}, ranker=DEFAULT_CHECKPOINT, verify_refine=True)
    r = neural.refinement_for(task)
    assert r.simulator.predictor is neural.ranking_model()[0].at_batch(task.batch_size)
    analytic = PortfolioSharder({"lookup_greedy": GreedySharder("lookup")}, ranker=None).refinement_for(task)
    assert isinstance(analytic.simulator.predictor, AnalyticPredictor)
    with pytest.raises(Exception, match="verify_refine must be true or false"):
        PortfolioSharder({"lookup_greedy": GreedySharder("lookup")}, ranker=None, verify_refine="yes")
