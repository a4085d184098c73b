"""The portfolio planner (issue 18, item 3): every member plans, the cost models rank, the
measured guard decides; and the headroom beside the ratio in the evaluation tables (item 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from embshard import InfeasibleError, InputError, Plan, Shard, Table, Task, validate
from embshard.costs.analytic import AnalyticCostModel
from embshard.costs.base import DeviceCosts
from embshard.search.base import Capabilities, GuardedSharder
from embshard.search.baselines import GreedySharder, RoundRobinSharder
from embshard.search.neuroshard import NeuroShardSharder
from embshard.search.portfolio import PortfolioSharder

ROOT = Path(__file__).resolve().parents[1]


def tiny_task(devices: int = 2, n: int = 6) -> Task:
    tables = tuple(Table(f"t{i}", 1000 * (i + 1), 4 * (1 + i % 4), 1.0 + 2 * i) for i in range(n))
    return Task("tiny", devices, 64 * 2**20, 256, tables)


class Fixed:
    """A planner that returns one given plan (a stand-in for a learned member)."""

    capabilities = Capabilities(("pooled",), splits_tables=False)

    def __init__(self, name: str, devices: list[int]):
        self.name, self.devices = name, devices

    def shard(self, task: Task) -> Plan:
        return Plan(task.name, self.name, [Shard.whole(t, d) for t, d in zip(task.tables, self.devices)])


class Nowhere:
    capabilities = Capabilities(("pooled",), splits_tables=False)
    name = "nowhere"

    def shard(self, task: Task) -> Plan:
        raise InfeasibleError("table 't0' needs 9 bytes but the most free memory on any device is 1 bytes (device 0): "
                              "short by 8 bytes", table="t0", shortfall_bytes=8)


class Scripted:
    """Measured costs by plan (keyed by the member label the guard gives it)."""

    def __init__(self, costs: dict[str, float]):
        self.costs = costs
        self.calls: list[list[str]] = []

    def measure_many(self, task, plans, visits=None):
        self.calls.append([p.algorithm for p in plans])
        # a little paired noise so the bootstrap interval has a width
        jitter = 1.0 + 0.002 * (len(self.calls) % 3)
        return [DeviceCosts([self.costs[p.algorithm] * jitter], [0.0], [0.0]) for p in plans]


def test_without_hardware_the_cost_models_pick_and_report_names_every_member():
    task = tiny_task()
    members = {"lopsided": Fixed("lopsided", [0] * 6), "nowhere": Nowhere(), "size_greedy": GreedySharder("size"),
               "round_robin": RoundRobinSharder(), "again": Fixed("again", [0] * 6)}
    p = PortfolioSharder(members, ranker=None)
    plan = p.shard(task)
    validate(task, plan)
    judge = AnalyticCostModel()
    costs = {m: judge.device_costs(task, s.shard(task)).plan_cost_ms for m, s in members.items() if m != "nowhere"}
    assert judge.device_costs(task, plan).plan_cost_ms == pytest.approx(min(costs.values()))
    info = p.last_search_info["portfolio"]
    rows = {m["member"]: m for m in info["members"]}
    assert rows["nowhere"]["valid"] is False and "short by 8 bytes" in rows["nowhere"]["error"]
    assert rows["again"]["same_as"] == "lopsided"  # a duplicate plan is ranked once
    assert info["pick"] == info["won"] == info["ranking"][0] and info["interval"] is None
    assert p.last_search_info["cost_model"] == "analytic" and p.last_guard is None
    assert plan.algorithm == "portfolio"


def test_no_member_with_a_plan_raises_the_members_infeasibility():
    with pytest.raises(InfeasibleError):
        PortfolioSharder({"nowhere": Nowhere()}, ranker=None).shard(tiny_task())


class InWorker:
    """A member that says in its plan's name which process planned it."""

    capabilities = Capabilities(("pooled",), splits_tables=False)
    name = "in_worker"

    def shard(self, task: Task) -> Plan:
        return Plan(task.name, f"pid{os.getpid()}", [Shard.whole(t, i % task.num_devices) for i, t in enumerate(task.tables)])


@pytest.mark.skipif(sys.platform != "linux", reason="the members plan in forked workers on Linux only")
def test_members_planned_in_workers_give_the_plans_and_rows_of_members_planned_in_turn():
    """`workers=2` plans every member in forked worker processes (the stand-in member's plan
    carries the planning process's id), and the members' plans, the ranking and the rows are
    those of `workers=1` (one after another here), the real NeuroShard member included."""
    task = tiny_task(devices=3, n=9)

    def members():
        return {"in_worker": InWorker(), "nowhere": Nowhere(), "neuroshard": NeuroShardSharder(verify=0),
                "size_greedy": GreedySharder("size"), "round_robin": RoundRobinSharder()}

    serial, forked = PortfolioSharder(members(), ranker=None, workers=1), PortfolioSharder(members(), ranker=None, workers=2)
    rows = {}
    for p in (serial, forked):
        got = p.plan_members(task, AnalyticCostModel())
        assert [r["member"] for r, _, _ in got] == list(p.members)
        rows[p.workers] = got
    assert rows[1][0][1].algorithm == f"pid{os.getpid()}" and rows[2][0][1].algorithm != f"pid{os.getpid()}"
    for (r1, p1, e1), (r2, p2, e2) in zip(rows[1], rows[2]):
        assert {k: v for k, v in r1.items() if k != "search_seconds"} == {k: v for k, v in r2.items() if k != "search_seconds"}
        assert (p1 is None) == (p2 is None) and (p1 is None or p1.signature() == p2.signature())
        assert type(e1) is type(e2)  # the member's own error comes back from the worker
    assert isinstance(rows[2][1][2], InfeasibleError) and rows[2][1][2].shortfall_bytes == 8
    assert serial.shard(task) == forked.shard(task)
    assert forked.last_search_info["portfolio"]["workers"] == 2 and serial.last_search_info["portfolio"]["workers"] == 1
    def strip(info):
        return [{k: v for k, v in m.items() if k != "search_seconds"} for m in info["portfolio"]["members"]]

    assert strip(forked.last_search_info) == strip(serial.last_search_info)


class SeesImputed:
    """Plans round robin and names, in its plan, how many of the task's histogram-less tables
    had no imputed histogram yet when it began (0: it was handed them)."""

    capabilities = Capabilities(("pooled",), splits_tables=False)
    name = "sees_imputed"

    def shard(self, task: Task) -> Plan:
        from embshard.costs.features import pending_imputations

        left = len(pending_imputations(task.tables, task.batch_size))
        return Plan(task.name, f"left{left}", [Shard.whole(t, i % task.num_devices) for i, t in enumerate(task.tables)])


@pytest.mark.skipif(sys.platform != "linux", reason="the members plan in forked workers on Linux only")
def test_workers_share_the_imputation_of_the_tables_without_histograms(monkeypatch):
    """Planned in workers, a task's histogram-less tables are imputed once across the workers (a
    share each, not all in every worker, nor in the parent) and every member begins with all of
    them known; the parent ends up knowing them too, the same values as imputed here."""
    from embshard.costs import features as F
    from embshard.data import synthetic as syn

    task = tiny_task(devices=3, n=9)
    F._IMPUTED.clear()
    calls = []
    real = syn.expected_row_bins_many
    monkeypatch.setattr(syn, "expected_row_bins_many", lambda specs, **kw: calls.append(len(specs)) or real(specs, **kw))
    members = {"a": SeesImputed(), "b": SeesImputed(), "c": SeesImputed()}
    got = PortfolioSharder(members, ranker=None, workers=2).plan_members(task, AnalyticCostModel())
    assert [plan.algorithm for _, plan, _ in got] == ["left0"] * 3
    assert calls == []  # the parent computed none of them: the workers did
    adopted = dict(F._IMPUTED)
    assert len(adopted) == 9 and F.pending_imputations(task.tables, task.batch_size) == []
    F._IMPUTED.clear()
    assert [adopted[(t.rows, t.pooling_factor, task.batch_size)] for t in task.tables] == \
        F.imputed_histograms([(t.rows, t.pooling_factor, task.batch_size) for t in task.tables])
    assert calls == [9]


class Dies:
    """A member whose process dies while it plans (as one killed for memory would)."""

    capabilities = Capabilities(("pooled",), splits_tables=False)
    name = "dies"

    def shard(self, task: Task) -> Plan:
        os._exit(3)


@pytest.mark.skipif(sys.platform != "linux", reason="the members plan in forked workers on Linux only")
def test_a_worker_that_dies_is_an_error_that_says_how_to_plan_without_workers():
    p = PortfolioSharder({"size_greedy": GreedySharder("size"), "dies": Dies()}, ranker=None, workers=2)
    with pytest.raises(RuntimeError, match=r"worker process planning the members died.*workers=1"):
        p.shard(tiny_task())


@pytest.mark.parametrize("workers", [0, -1, 1.5, "many", True])
def test_workers_must_be_a_positive_count_or_auto(workers):
    with pytest.raises(InputError, match="workers must be a positive integer or 'auto'"):
        PortfolioSharder({"size_greedy": GreedySharder("size")}, ranker=None, workers=workers)


def test_auto_plans_small_tasks_in_this_process_and_big_ones_on_every_core():
    """`workers="auto"` plans a small task in this process and forks one worker per core (at most
    one per member) from PARALLEL_FROM_TABLES tables or PARALLEL_FROM_PAIRS table x device pairs
    on, but never inside a daemonic process (a multiprocessing pool's worker), which may not
    start children."""
    import multiprocessing as mp

    from embshard.search.portfolio import PARALLEL_FROM_PAIRS, PARALLEL_FROM_TABLES

    p = PortfolioSharder({f"m{i}": GreedySharder("size") for i in range(64)}, ranker=None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    every = min(cores, 64) if sys.platform == "linux" else 1
    assert p.worker_count(tiny_task()) == 1
    many = Task("many", 2, 2**40, 256, tuple(Table(f"t{i}", 10, 4, 1.0) for i in range(PARALLEL_FROM_TABLES)))
    assert p.worker_count(many) == every
    assert p.worker_count(Task("fewer", 2, 2**40, 256, many.tables[:-1])) == 1
    wide = Task("wide", -(-PARALLEL_FROM_PAIRS // (PARALLEL_FROM_TABLES - 1)), 2**40, 256, many.tables[:-1])
    assert len(wide.tables) < PARALLEL_FROM_TABLES and p.worker_count(wide) == every
    assert PortfolioSharder({"size_greedy": GreedySharder("size")}, ranker=None).worker_count(many) == 1
    if sys.platform != "linux":
        return
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=lambda: q.put(p.worker_count(many)), daemon=True)
    child.start()
    got = q.get(timeout=60)
    child.join(60)
    assert got == 1


@pytest.mark.parametrize("learned_ms, expect", [(8.0, "learned"), (12.0, "size_greedy")])
def test_guard_returns_the_measured_best_and_names_the_member_and_interval(learned_ms, expect):
    """The learned member's plan is the candidate (size_greedy's the guard measures as its
    heuristic): it is kept only when measured better than the best heuristic's, beyond the
    bootstrap interval; otherwise the heuristic's."""
    task = tiny_task()
    members = {"learned": Fixed("learned", [0, 1, 0, 1, 1, 0]), "size_greedy": GreedySharder("size")}
    p = PortfolioSharder(members, ranker=None, verify=2, verify_heuristics=["size_greedy"], verify_min_rounds=3,
                         verify_max_rounds=6)
    assert isinstance(p, GuardedSharder)
    size_plan = GreedySharder("size").shard(task)
    assert size_plan.signature() != members["learned"].shard(task).signature()
    p.attach_evaluator(Scripted({"learned": learned_ms, "size_greedy": 10.0}))
    plan = p.shard(task)
    info = p.last_search_info["portfolio"]
    assert info["won"] == expect == p.last_guard.chosen
    if expect == "learned":
        assert info["verdict"] == "better" and info["interval"]["high"] < 1.0
    else:  # the learned plan (the one candidate: size_greedy is the guard's own) measured worse
        assert info["verdict"] == "worse" and info["interval"]["low"] > 1.0
    want = members["learned"].shard(task) if expect == "learned" else size_plan
    assert plan.shards == want.shards
    assert p.last_search_pick is not None


def test_guard_candidates_are_the_learned_members_even_where_the_ranker_prefers_a_heuristic():
    """The guard measures its heuristics anyway; `verify` slots go to the best-ranked other
    members, so a learned plan the ranker puts below a heuristic is still measured."""
    task = tiny_task()
    members = {"lopsided": Fixed("lopsided", [0] * 6), "worse": Fixed("worse", [1] * 6),
               "size_greedy": GreedySharder("size")}
    p = PortfolioSharder(members, ranker=None, verify=1, verify_heuristics=["size_greedy"], verify_min_rounds=3,
                         verify_max_rounds=6)
    evaluator = Scripted({"lopsided": 8.0, "worse": 7.0, "size_greedy": 10.0})
    p.attach_evaluator(evaluator)
    plan = p.shard(task)
    info = p.last_search_info["portfolio"]
    assert info["ranking"][0] == "size_greedy"  # the analytic ranker: everything on one device is worst
    # one slot: the better-ranked learned member (lopsided before worse by member order at equal cost)
    assert set(evaluator.calls[0]) == {"lopsided", "size_greedy"}
    assert info["won"] == "lopsided" and info["verdict"] == "better"
    assert plan.shards == members["lopsided"].shard(task).shards


def test_members_follow_the_searchers_overrides():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="shard", overrides=["searchers.neuroshard.checkpoint=null",
                                                      "searchers.dreamshard.samples=0"])
        p = instantiate(cfg.searchers.portfolio)
    assert isinstance(p, PortfolioSharder) and p.name == "portfolio"
    assert list(p.members) == ["neuroshard", "dreamshard", "autoshard", "size_lookup_greedy", "lookup_greedy",
                               "dim_greedy", "size_greedy", "round_robin", "random"]
    assert isinstance(p.members["neuroshard"], NeuroShardSharder) and p.members["neuroshard"].checkpoint is None
    assert p.members["dreamshard"].samples == 0


def test_the_python_api_builds_the_portfolio_with_every_member_and_plans_with_it():
    """api.plan / EmbShardPlanner take the portfolio by name, as shard.py does (its members come
    from the other planners' configs, which it interpolates)."""
    from embshard import api

    p = api.searcher("portfolio", verify=0)
    assert isinstance(p, PortfolioSharder) and isinstance(p.members["neuroshard"], NeuroShardSharder)
    assert list(p.members) == ["neuroshard", "dreamshard", "autoshard", "size_lookup_greedy", "lookup_greedy",
                               "dim_greedy", "size_greedy", "round_robin", "random"]
    task = Task.load(ROOT / "examples" / "tasks" / "small.json")
    plan = api.plan(task, "portfolio")
    validate(task, plan)
    assert plan.algorithm == "portfolio" and {s.table for s in plan.shards} == {t.name for t in task.tables}


@pytest.mark.slow
def test_portfolio_measured_on_real_kernels_returns_its_measured_best():
    """Every default member plans a tiny task, and the guard measures on FBGEMM's CPU kernel (a
    kernels-only evaluator, one visit of two steps): the row shard.py writes names the member that
    won and the interval, and the plan returned is the guard's rule applied to what it measured."""
    from embshard.compare import plan_task
    from embshard.hardware.evaluator import HardwareEvaluator
    from embshard.hardware.protocol import MeasurementProtocol

    task = tiny_task()
    p = PortfolioSharder(verify=2, verify_heuristics=["size_lookup_greedy", "lookup_greedy"], verify_visits=1,
                         verify_budget_s=5, verify_min_rounds=2, verify_max_rounds=2)
    p.attach_evaluator(HardwareEvaluator(comm_backend=None, protocol=MeasurementProtocol(repetitions=2, visits=1,
                                                                                          probe=False), seed=0))
    results = {r.algorithm: r for r in plan_task(task, {"portfolio": p})}
    rows = {name: r.to_dict() for name, r in results.items()}  # what report.json holds per result
    assert set(rows) == {"portfolio", "portfolio_pick"} and all(r["valid"] for r in rows.values())
    info, guard = rows["portfolio"]["search_info"]["portfolio"], rows["portfolio"]["guard"]
    assert {m["member"] for m in info["members"]} >= {"neuroshard", "dreamshard", "autoshard", "size_lookup_greedy"}
    assert info["won"] == guard["chosen"] and info["pick"] == guard["search_pick"] == info["ranking"][0]
    cands = guard["candidates"]
    assert [c["label"] for c in cands if c["source"] == "search"] == info["ranking"][:2]
    assert all(c["measured_ms"] > 0 for c in cands)
    s = min((c for c in cands if c["source"] == "search"), key=lambda c: c["measured_ms"])["label"]
    h = min((c for c in cands if c["source"] == "heuristic"), key=lambda c: c["measured_ms"])["label"]
    verdict = guard["decision"]["verdict"]
    assert info["verdict"] == verdict
    if verdict == "same plan":
        assert info["won"] == s
    else:
        assert info["won"] == (s if verdict == "better" else h)
        assert info["interval"] == guard["decision"]["ratio"] and info["interval"]["low"] <= info["interval"]["high"]
    validate(task, results["portfolio"].plan)
    assert results["portfolio_pick"].plan.signature() == p.last_search_pick.signature()


# ----------------------------------------------------------------------------- item 5: headroom beside the ratio
def _result(task: str, algorithm: str, cost: float, gap: float) -> dict:
    ref = cost / (1 + gap / 100)  # the balance reference a gap of `gap` % above it implies
    return {"task": task, "algorithm": algorithm, "valid": True, "measured_cost_ms": cost, "memory_bytes": [1, 1],
            "measured_spread_ms": 0.0, "headroom": {"measured": {"gap_pct": gap, "balance_reference_ms": ref}},
            "search_seconds": 0.1}


def test_summaries_give_each_methods_gap_beside_its_ratio(tmp_path):
    report = {"results": [_result("a", "size_greedy", 10.0, 20.0), _result("a", "portfolio", 9.0, 5.0),
                          _result("b", "size_greedy", 20.0, 30.0), _result("b", "portfolio", 19.0, 7.0)]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    env = dict(os.environ, WANDB_MODE="offline")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "summarize_improvement.py"), str(path),
                          "--algorithm", "portfolio"], capture_output=True, text=True, env=env, check=True).stdout
    assert "gap to balance +5.0% (best heuristic +20.0%)" in out
    assert "mean gap to balance +6.0% (the best heuristics' +25.0%)" in out
    table = subprocess.run([sys.executable, str(ROOT / "scripts" / "summarize_improvement.py"), str(path),
                            "--algorithm", "portfolio", "--by-devices"], capture_output=True, text=True, env=env,
                           check=True).stdout
    ratio = (9 / 10 + 19 / 20) / 2
    assert f"| portfolio | 14.0 ({ratio:.3f}x; +6.0%) |" in table


def test_portfolio_eval_summary_pools_every_setting_and_compares_with_neuroshard(tmp_path):
    for run, setting, task, costs in [
        ("b1", "20-30x4", "t1", {"size_greedy": 10.0, "lookup_greedy": 12.0, "neuroshard": 9.0, "portfolio": 8.0}),
        ("b1", "20-30x2", "t2", {"size_greedy": 20.0, "neuroshard": 20.0, "portfolio": 19.0}),
        ("b2", "20-30x4", "t3", {"size_greedy": 10.0, "neuroshard": 11.0, "portfolio": 10.0}),  # a later batch
    ]:
        (tmp_path / run / setting).mkdir(parents=True)
        gaps = {"t1": {"portfolio": 60.0}, "t2": {"neuroshard": 25.0}, "t3": {"size_greedy": 25.0}}[task]
        results = [_result(task, a, c, gaps.get(a, 0.0)) for a, c in costs.items()]
        (tmp_path / run / setting / "report.json").write_text(json.dumps({"results": results}))
    out = tmp_path / "summary"
    text = subprocess.run([sys.executable, str(ROOT / "scripts" / "portfolio_eval.py"), "summarize",
                           str(tmp_path / "b1"), str(tmp_path / "b2"), "--out", str(out)],
                          capture_output=True, text=True, check=True).stdout
    assert "All settings together (3 tasks)" in text
    assert f"| portfolio | {(0.8 + 0.95 + 1.0) / 3:.3f} [" in text
    assert f"portfolio over NeuroShard (guarded), per task: {(8 / 9 + 19 / 20 + 10 / 11) / 3:.3f} [" in text
    assert json.loads((out / "summary.json").read_text())["20-30x4"]["portfolio"]["tasks"] == 2
    # room left: t1's lowest balance reference is portfolio's 8 / 1.6 = 5 over size_greedy's 10; t3's
    # size_greedy's 10 / 1.25 = 8 over 10; t2's neuroshard's 20 / 1.25 = 16 over 20
    assert f"- 20-30x4: {(0.5 + 0.8) / 2:.3f} [0.500, 0.800] (2 tasks); 20-30x2: 0.800 (1 tasks)" in text
    # any pair on request: lookup_greedy over size_greedy exists on t1 only (one task, no interval)
    text = subprocess.run([sys.executable, str(ROOT / "scripts" / "portfolio_eval.py"), "summarize",
                           str(tmp_path / "b1"), str(tmp_path / "b2"), "--out", str(out),
                           "--pairs", "lookup_greedy/size_greedy", "neuroshard/size_greedy"],
                          capture_output=True, text=True, check=True).stdout
    assert "lookup_greedy over size_greedy, per task: 1.200 over 1 tasks" in text
    assert f"neuroshard over size_greedy, per task: {(0.9 + 1.0 + 1.1) / 3:.3f} [" in text
    assert "portfolio over NeuroShard" not in text
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "portfolio_eval.py"), "summarize",
                          str(tmp_path / "b1"), "--out", str(out), "--pairs", "portfolio"], capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == ["error: --pairs 'portfolio': write A/B (A's measured cost over B's per task)"]


def test_portfolio_eval_across_pairs_one_algorithm_over_two_runs_of_the_same_tasks(tmp_path):
    # run "after" on a machine 2x slower: the ratio to the best heuristic cancels it
    for run, scale, ns in [("before", 1.0, {"t1": 9.0, "t2": 10.0, "t3": 10.0}),
                           ("after", 2.0, {"t1": 8.0, "t2": 9.0, "t3": 10.0})]:
        for task, setting in [("t1", "8-12x4"), ("t2", "8-12x4"), ("t3", "20-30x2")]:
            d = tmp_path / run / setting
            d.mkdir(parents=True, exist_ok=True)
            f = d / "report.json"
            old = json.loads(f.read_text())["results"] if f.exists() else []
            rows = [_result(task, "size_greedy", 10.0 * scale, 0.0), _result(task, "lookup_greedy", 12.0 * scale, 0.0),
                    _result(task, "neuroshard", ns[task] * scale, 0.0)]
            f.write_text(json.dumps({"results": old + rows}))
    script = [sys.executable, str(ROOT / "scripts" / "portfolio_eval.py"), "across"]
    text = subprocess.run(script + [f"{tmp_path / 'after'}:neuroshard", f"{tmp_path / 'before'}:neuroshard"],
                          capture_output=True, text=True, check=True).stdout
    assert "3 tasks measured in both" in text
    assert f"ratio to the best heuristic per task: {(0.8 + 0.9 + 1.0) / 3:.3f} against {(0.9 + 1.0 + 1.0) / 3:.3f}" in text
    assert f"the first over the second, per task: {(8 / 9 + 0.9 + 1.0) / 3:.3f} [" in text
    assert "control, the best heuristic's measured cost in the first run over the second: 2.000 [2.000, 2.000]" in text
    assert "| 8-12x4 | 2 | 0.850 | 0.950 |" in text and "| 20-30x2 | 1 | 1.000 | 1.000 |" in text
    bad = subprocess.run(script + [f"{tmp_path / 'after'}:portfolio", f"{tmp_path / 'before'}:neuroshard"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "no task has both algorithms" in bad.stderr


def test_portfolio_eval_combine_joins_passes_per_task_and_refuses_a_task_twice(tmp_path):
    """Two passes summarised apart, then combined: the same figures as one summary of both."""
    script = [sys.executable, str(ROOT / "scripts" / "portfolio_eval.py")]
    for run, setting, task, costs in [
        ("b1", "20-30x4", "t1", {"size_greedy": 10.0, "neuroshard": 9.0, "portfolio": 8.0}),
        ("b1", "20-30x2", "t2", {"size_greedy": 20.0, "neuroshard": 20.0, "portfolio": 19.0}),
        ("b2", "20-30x4", "t3", {"size_greedy": 10.0, "neuroshard": 11.0, "portfolio": 10.0}),
    ]:
        (tmp_path / run / setting).mkdir(parents=True, exist_ok=True)
        results = [_result(task, a, c, 10.0 if a == "portfolio" else 2.0) for a, c in costs.items()]
        (tmp_path / run / setting / "report.json").write_text(json.dumps({"results": results}))
    for run in ("b1", "b2"):
        subprocess.run([*script, "summarize", str(tmp_path / run), "--out", str(tmp_path / f"s_{run}")],
                       capture_output=True, text=True, check=True)
    out = tmp_path / "both"
    text = subprocess.run([*script, "combine", str(tmp_path / "s_b1" / "summary.json"),
                           str(tmp_path / "s_b2" / "summary.json"), "--out", str(out)],
                          capture_output=True, text=True, check=True).stdout
    combined = json.loads((out / "combined.json").read_text())
    four = combined["20-30x4"]["portfolio"]
    assert four["tasks"] == 2 and four["task_names"] == ["t1", "t3"]
    assert four["mean_ratio"] == pytest.approx((0.8 + 1.0) / 2) and four["mean_gap_pct"] == pytest.approx(10.0)
    assert combined["20-30x2"]["portfolio"]["tasks"] == 1
    assert f"| portfolio | {(0.8 + 0.95 + 1.0) / 3:.3f} [" in text
    assert f"portfolio over neuroshard, per task: {(8 / 9 + 19 / 20 + 10 / 11) / 3:.3f} [" in text
    assert "Summaries without task names" not in text
    # the same tasks in two summaries (a copy of b1's) are refused, naming the task
    copy = tmp_path / "copy.json"
    copy.write_text((tmp_path / "s_b1" / "summary.json").read_text())
    bad = subprocess.run([*script, "combine", str(tmp_path / "s_b1" / "summary.json"), str(copy), "--out", str(out)],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "task t1 (20-30x4, size_greedy) is in an earlier summary too" in bad.stderr


def _summarize_one_setting(tmp_path, report):
    """`portfolio_eval.py summarize`'s printed text for `report` as the run of one setting."""
    (tmp_path / "runs" / "20-30x4").mkdir(parents=True)
    (tmp_path / "runs" / "20-30x4" / "report.json").write_text(json.dumps(report))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "portfolio_eval.py"), "summarize",
                           str(tmp_path / "runs"), "--out", str(tmp_path / "s")],
                          capture_output=True, text=True, check=True).stdout


def test_guard_agreement_flags_a_final_measurement_in_which_plans_slowed_unevenly(tmp_path):
    """The final measurement against the guard's first round of the same plans: a task whose
    plans all slowed alike agrees (sd 0); one whose plans slowed by 1.0-1.5x is flagged, and the
    portfolio's worse-beyond-interval verdict there is named beside it."""
    import math

    from embshard.report import guard_agreement

    def task(name, guard_ms, final_ms, worse=False):
        rows = [_result(name, "neuroshard_pick" if a == "neuroshard" else a, c, 0.0) for a, c in final_ms.items()]
        guard = {"candidates": [{"label": a, "measured_ms": c} for a, c in guard_ms.items()]}
        rows.append(dict(_result(name, "portfolio", final_ms["neuroshard"], 0.0), guard=guard,
                         vs_best_heuristic={"interval": {"verdict": "worse" if worse else "not resolved"}}))
        return rows

    guard = {"neuroshard": 10.0, "size_greedy": 12.0, "lookup_greedy": 11.0, "dim_greedy": 14.0}
    calm = task("calm", guard, {a: 1.2 * c for a, c in guard.items()})  # 20% slower, every plan alike
    slows = {"neuroshard": 1.5, "size_greedy": 1.0, "lookup_greedy": 1.25, "dim_greedy": 1.0}
    stormy = task("stormy", guard, {a: slows[a] * c for a, c in guard.items()}, worse=True)
    unguarded = [_result("plain", a, c, 0.0) for a, c in guard.items()]
    report = {"results": calm + stormy + unguarded}
    got = guard_agreement(report)
    assert set(got) == {"calm", "stormy"}  # no guard: left out
    assert got["calm"][0] == pytest.approx(0.0, abs=1e-12) and got["calm"][1] == 4
    logs = [math.log(x) for x in slows.values()]
    mean = sum(logs) / 4
    assert got["stormy"] == (pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in logs) / 4)), 4)

    text = _summarize_one_setting(tmp_path, report)
    assert "Measurement agreement (2 tasks with a guard)" in text
    assert f"- 20-30x4: stormy ({got['stormy'][0]:.3f}; portfolio worse beyond interval)" in text
    assert "calm (" not in text


def test_guard_reversals_flag_one_plan_that_moved_against_the_pair_the_guard_settled(tmp_path):
    """A guard that ranked a below b over 4 paired rounds, and a final measurement that put a 20%
    above b while five other plans held: the spread of guard_agreement stays under its threshold,
    the pair check names a/b with both ratios; a task whose plans all slowed alike moves no pair;
    a guard of one round is left out."""
    import math

    from embshard.report import guard_agreement, guard_reversals

    def task(name, final_scale, rounds=4):
        first = {"neuroshard": 10.0, "size_lookup_greedy": 9.5, "lookup_greedy": 10.2, "dim_greedy": 11.0,
                 "size_greedy": 12.0, "round_robin": 11.5, "random": 12.5}
        paired = ("neuroshard", "size_lookup_greedy", "lookup_greedy")
        guard = {"candidates": [{"label": a, "measured_ms": c} for a, c in first.items()],
                 "rounds": [first] + [{a: first[a] * (1 + 0.01 * k) for a in paired} for k in range(1, rounds)]}
        means = {a: sum(r[a] for r in guard["rounds"]) / rounds for a in paired}
        final = {a: final_scale.get(a, 1.0) * means.get(a, c) for a, c in first.items()}
        rows = [_result(name, "neuroshard_pick" if a == "neuroshard" else a, c, 0.0) for a, c in final.items()]
        rows.append(dict(_result(name, "portfolio", final["size_lookup_greedy"], 0.0), guard=guard))
        return rows, means

    moved_rows, means = task("moved", {"size_lookup_greedy": 1.22})
    calm_rows, _ = task("calm", {a: 1.1 for a in ("neuroshard", "size_lookup_greedy", "lookup_greedy", "dim_greedy",
                                                "size_greedy", "round_robin", "random")})
    short_rows, _ = task("short", {"size_lookup_greedy": 1.22}, rounds=1)
    report = {"results": moved_rows + calm_rows + short_rows}
    got = guard_reversals(report)
    assert set(got) == {"moved", "calm"}
    assert got["calm"]["shift"] == pytest.approx(0.0, abs=1e-12)
    m = got["moved"]
    assert m["pair"][0] == "size_lookup_greedy" and m["rounds"] == 4
    assert m["shift"] == pytest.approx(math.log(1.22))
    assert m["final_ratio"] / m["guard_ratio"] == pytest.approx(1.22)
    assert m["guard_ratio"] == pytest.approx(means["size_lookup_greedy"] / means[m["pair"][1]])
    assert guard_agreement(report)["moved"][0] < 0.1  # the spread alone does not flag it

    text = _summarize_one_setting(tmp_path, report)
    assert "every task agrees" in text
    assert "Plans that moved against each other (2 tasks with a guard of 2 or more rounds)" in text
    assert (f"- 20-30x4: moved (size_lookup_greedy/{m['pair'][1]}: guard {m['guard_ratio']:.3f} over 4 rounds, "
            f"final {m['final_ratio']:.3f})") in text
    assert "calm (" not in text
