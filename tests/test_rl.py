"""DreamShard and AutoShard: a short seeded training on a tiny setting, then the searchers built
from the checkpoints it writes: learning beats a random policy on the true cost, checkpoints
round-trip and fail with one line, unseen device counts plan, random feasible tasks (tight
memory included) always get valid plans, infeasible tasks get the baselines' one-line memory
error.

The "hardware" the policies are trained against is the closed-form AnalyticCostModel: it is
deterministic, so the true cost of any plan is known exactly, and learning is judged by it,
not by the cost network the policy trained against. (Training on FBGEMM's real kernels runs
in test_rl_cli.py.) The training runs once per module.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from embshard import InfeasibleError, InputError, Table, Task, validate
from embshard.costs.analytic import AnalyticCostModel
from embshard.costs.base import DeviceCosts
from embshard.search.baselines import GreedySharder, RandomSharder
from embshard.search.rl.checkpoint import load_checkpoint, save_checkpoint
from embshard.search.rl.env import best_plan, plan_candidates, rollout
from embshard.search.rl.losses import masked_log_softmax, vtrace
from embshard.search.rl.sharders import AutoShardSharder, DreamShardSharder
from embshard.search.rl.stage import make_agent, switches_of, train_agent

ROOT = Path(__file__).resolve().parents[1]
BATCH = 512
SHARDERS = {"dreamshard": DreamShardSharder, "autoshard": AutoShardSharder}
#: the "hardware" of these tests: deterministic, so a plan's true cost is known exactly
TRUTH = AnalyticCostModel()


def make_task(tables, num_devices, batch_size=BATCH, slack=1.5, name="t") -> Task:
    probe = Task(name, num_devices, 1, batch_size, tuple(tables))
    need = [probe.table_memory_bytes(t) for t in tables]
    memory = int(max(slack * sum(need) / num_devices, 1.05 * max(need)))
    return Task(name, num_devices, memory, batch_size, tuple(tables))


def random_tables(rng: np.random.Generator, n: int, prefix: str) -> list[Table]:
    return [Table(f"{prefix}{i}", int(rng.integers(1_000, 60_000)), int(4 * rng.integers(1, 17)),
                  float(rng.uniform(1.0, 30.0))) for i in range(n)]


def tiny_tasks(seed: int, count: int, num_devices: int, prefix: str) -> list[Task]:
    rng = np.random.default_rng(seed)
    return [make_task(random_tables(rng, int(rng.integers(6, 11)), f"{prefix}{k}_"), num_devices, name=f"{prefix}{k}")
            for k in range(count)]


def rl_config(algorithm: str, *overrides: str) -> dict:
    """The real conf/rl/<algorithm>.yaml, composed through train.yaml, with a tiny loop."""
    tiny = ["rl.iterations=3", "rl.measure_tasks=2", "rl.measure_plans_per_task=3", 
            "rl.cost_steps=60", "rl.policy_steps=8", "rl.wandb=false", "progress=false"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["stage=rl", f"rl={algorithm}", *tiny, *overrides])
    return OmegaConf.to_container(cfg.rl, resolve=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Both algorithms trained on tiny 2-device tasks; checkpoints written."""
    torch.set_num_threads(1)
    tasks = tiny_tasks(0, 8, 2, "train")
    out = {}
    for algorithm in SHARDERS:
        c = rl_config(algorithm)
        d = tmp_path_factory.mktemp(algorithm)
        agent, module, timing = train_agent(c, tasks, d, lambda task, plans: [TRUTH.device_costs(task, p) for p in plans])
        path = d / "policy.pt"
        card = {"measurements": module.measurements, "train_tables": sorted({t.name for k in tasks for t in k.tables})}
        save_checkpoint(path, agent, c["nets"][algorithm], switches_of(c), card, {"history": module.history})
        out[algorithm] = {"agent": agent, "module": module, "config": c, "path": path, "tasks": tasks}
    return out


def true_cost(task: Task, plan) -> float:
    return TRUTH.device_costs(task, plan).plan_cost_ms


@pytest.mark.parametrize("algorithm", list(SHARDERS))
def test_short_training_beats_the_random_policy_on_the_true_cost(trained, algorithm):
    t = trained[algorithm]
    agent, c = t["agent"], t["config"]
    assert t["module"].measurements == 3 * 2 * 3  # iterations x tasks x plans, each costed by the "hardware"
    held_out = tiny_tasks(1, 6, 2, "test")  # tables never seen in training
    # the random policy's expected cost per task: the mean over 8 random plans
    rnd = np.array([np.mean([true_cost(k, RandomSharder(seed=s).shard(k)) for s in range(8)]) for k in held_out])

    def ratios(planner) -> np.ndarray:  # the planner's argmax plan on each task, by its true cost
        return np.array([true_cost(k, best_plan(planner, k, 0)[0]) for k in held_out]) / rnd

    trained_ratios = ratios(agent)
    torch.manual_seed(1)
    untrained_ratios = ratios(make_agent(c, t["tasks"]))  # every network at its initial weights
    # better than random on average and on most tasks, and better than before training
    assert trained_ratios.mean() < 1.0, (trained_ratios, untrained_ratios)
    assert (trained_ratios < 1.0).sum() >= 4, trained_ratios
    assert trained_ratios.mean() < untrained_ratios.mean(), (trained_ratios, untrained_ratios)


@pytest.mark.parametrize("algorithm", list(SHARDERS))
def test_checkpoint_round_trip_plans_the_same(trained, algorithm):
    t = trained[algorithm]
    loaded, bundle = load_checkpoint(t["path"], algorithm)
    assert bundle["data_card"]["measurements"] == 18
    for name, module in t["agent"].modules().items():
        for k, v in module.state_dict().items():
            assert torch.equal(v, loaded.modules()[name].state_dict()[k]), k
    sharder = SHARDERS[algorithm](checkpoint=str(t["path"]), samples=3, seed=5)
    for task in tiny_tasks(2, 3, 2, "rt"):
        plan = sharder.shard(task)
        again, _ = best_plan(t["agent"], task, 3, generator=torch.Generator().manual_seed(5), algorithm=algorithm)
        assert plan.shards == again.shards
        assert sharder.last_predicted_cost_ms > 0


@pytest.mark.parametrize("algorithm", list(SHARDERS))
def test_bad_checkpoints_give_one_line_errors(trained, algorithm, tmp_path):
    good = trained[algorithm]["path"]
    other = trained["autoshard" if algorithm == "dreamshard" else "dreamshard"]["path"]
    bundle = torch.load(good, weights_only=True)
    cases: dict[str, Path] = {}
    cases["truncated"] = tmp_path / "truncated.pt"
    cases["truncated"].write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    cases["garbage"] = tmp_path / "garbage.pt"
    cases["garbage"].write_bytes(b"\x00not a checkpoint\xff" * 10)
    cases["pickled object"] = tmp_path / "object.pt"
    cases["pickled object"].write_bytes(pickle.dumps(Task))  # weights_only refuses arbitrary objects
    for name, change in (("features", lambda b: b["normalization"]["names"].__setitem__(0, "other")),
                         ("shapes", lambda b: b["state_dicts"][next(iter(b["state_dicts"]))].update(
                             {k: torch.zeros(3) for k in list(b["state_dicts"][next(iter(b["state_dicts"]))])[:1]})),
                         ("version", lambda b: b.__setitem__("format_version", 99))):
        b = torch.load(good, weights_only=True)
        change(b)
        cases[name] = tmp_path / f"{name}.pt"
        torch.save(b, cases[name])
    cases["other algorithm"] = other
    cases["missing"] = tmp_path / "nope.pt"
    messages = {}
    for name, path in cases.items():
        with pytest.raises(InputError) as err:
            SHARDERS[algorithm](checkpoint=str(path)).shard(tiny_tasks(3, 1, 2, "x")[0])
        msg = str(err.value)
        assert "\n" not in msg and str(path) in msg, (name, msg)
        messages[name] = msg
    assert "trained on other table features" in messages["features"]
    assert "not 'dreamshard'" in messages["other algorithm"] or "not 'autoshard'" in messages["other algorithm"]
    assert "make rl-checkpoints" in messages["missing"]
    assert bundle["algorithm"] == algorithm


@pytest.mark.parametrize("algorithm", list(SHARDERS))
def test_device_and_table_counts_unseen_in_training(trained, algorithm):
    sharder = SHARDERS[algorithm](checkpoint=str(trained[algorithm]["path"]), samples=2)
    rng = np.random.default_rng(4)
    for devices, tables in ((1, 5), (3, 9), (5, 30), (8, 60), (16, 40)):
        task = make_task(random_tables(rng, tables, "u"), devices, name=f"u{devices}")
        plan = sharder.shard(task)
        validate(task, plan)
        assert sorted(s.table for s in plan.shards) == sorted(t.name for t in task.tables)
        if devices > 1 and tables >= 3 * devices:
            assert len({s.device for s in plan.shards}) > 1  # spreads work, not piled on one device


@st.composite
def feasible_task_st(draw):
    """Any table and device count, several batch sizes; memory 1.0-1.2x (tight: memory binds)
    or 2-4x (loose) the larger of the biggest table's need and an even share of all needs."""
    n = draw(st.integers(1, 40))
    tables = [Table(f"h{i}", draw(st.integers(1, 300_000)), 4 * draw(st.integers(1, 32)), draw(st.floats(0.0, 80.0)))
              for i in range(n)]
    devices = draw(st.integers(1, 12))
    batch = draw(st.sampled_from([64, 512, 4096]))
    probe = Task("h", devices, 1, batch, tuple(tables))
    need = [probe.table_memory_bytes(t) for t in tables]
    slack = draw(st.one_of(st.floats(1.0, 1.2), st.floats(2.0, 4.0)))
    memory = int(slack * max(max(need), -(-sum(need) // devices)))
    return Task("h", devices, memory, batch, tuple(tables))


def first_fit_decreasing_packs(task: Task) -> bool:
    """An independent packer: the largest table first, each onto the first device with room."""
    free = [task.device_memory_bytes] * task.num_devices
    for need in sorted((task.table_memory_bytes(t) for t in task.tables), reverse=True):
        room = [d for d in range(task.num_devices) if free[d] >= need]
        if not room:
            return False
        free[room[0]] -= need
    return True


SHIPPED = {"dreamshard": ROOT / "checkpoints" / "dreamshard_cpu" / "policy.pt",
           "autoshard": ROOT / "checkpoints" / "autoshard_cpu" / "policy.pt"}


_SHARDERS: dict = {}


@settings(max_examples=40, deadline=None)
@given(task=feasible_task_st())
def test_random_feasible_tasks_always_get_valid_plans(trained, task):
    """The tiny policies trained here and the shipped ones: whenever a first-fit-decreasing
    packing exists (the look-ahead's promise), a valid plan; otherwise a valid plan or the
    structured InfeasibleError."""
    packs = first_fit_decreasing_packs(task)
    for algorithm, cls in SHARDERS.items():
        for checkpoint in (trained[algorithm]["path"], SHIPPED[algorithm]):
            key = (algorithm, str(checkpoint))  # loaded once for all examples (each plans afresh)
            if key not in _SHARDERS:
                _SHARDERS[key] = cls(checkpoint=str(checkpoint), samples=2)
            sharder = _SHARDERS[key]
            try:
                plan = sharder.shard(task)
            except InfeasibleError as e:
                assert not packs, f"{algorithm} ({checkpoint}) missed a plan first-fit decreasing finds: {e}"
                assert e.shortfall_bytes > 0
                continue
            validate(task, plan)
            assert sorted(s.table for s in plan.shards) == sorted(t.name for t in task.tables)
            assert all(m <= task.device_memory_bytes for m in plan.memory_bytes(task))


@pytest.mark.parametrize("algorithm", list(SHARDERS))
def test_infeasible_task_gives_the_baselines_one_line_memory_error(trained, algorithm):
    rng = np.random.default_rng(6)
    tables = random_tables(rng, 7, "i")
    probe = Task("i", 3, 1, BATCH, tuple(tables))
    biggest = max(tables, key=probe.table_memory_bytes)
    task = Task("i", 3, probe.table_memory_bytes(biggest) - 1000, BATCH, tuple(tables))
    with pytest.raises(InfeasibleError) as ours:
        SHARDERS[algorithm](checkpoint=str(trained[algorithm]["path"])).shard(task)
    with pytest.raises(InfeasibleError) as baseline:
        GreedySharder("size").shard(task)
    assert str(ours.value) == str(baseline.value) and "\n" not in str(ours.value)
    assert ours.value.table == biggest.name and ours.value.shortfall_bytes == 1000
    # every table fits alone but not all together: the ledger's error, naming a table and the shortfall
    same = [Table(f"s{i}", 10_000, 16, 5.0) for i in range(6)]
    one = Task("j", 2, 1, BATCH, tuple(same)).table_memory_bytes(same[0])
    tight = Task("j", 2, int(2.5 * one), BATCH, tuple(same))
    with pytest.raises(InfeasibleError) as err:
        SHARDERS[algorithm](checkpoint=str(trained[algorithm]["path"])).shard(tight)
    assert err.value.table in {t.name for t in same} and err.value.shortfall_bytes > 0 and "short by" in str(err.value)


@pytest.mark.parametrize("mask", ["lookahead", "room", "none"])
def test_training_rollouts_follow_their_mask(trained, mask):
    agent = trained["dreamshard"]["agent"]
    task = make_task(random_tables(np.random.default_rng(8), 12, "m"), 3, slack=1.05)
    r = rollout(agent, agent.prepare(task), 6, train=True, mask=mask, generator=torch.Generator().manual_seed(0))
    taken = r.actions.clamp(min=0).unsqueeze(-1)
    assert bool(torch.where(r.steps, r.masks.gather(-1, taken).squeeze(-1) | ~r.masks.any(-1), True).all())
    for k in range(6):
        if not bool(r.overflow[k]):
            validate(task, r.plan(k, "x"))
    if mask == "lookahead":
        assert not r.overflow.any()


def test_vtrace_matches_its_definition():
    g = torch.Generator().manual_seed(0)
    b, t = 3, 5
    blp, tlp = -torch.rand(b, t, generator=g), -torch.rand(b, t, generator=g)
    rew, val = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
    steps = torch.ones(b, t, dtype=torch.bool)
    steps[1, 3:] = False
    vs, adv = vtrace(blp, tlp, rew, val, steps, gamma=0.9)
    for i in range(b):
        n = int(steps[i].sum())
        rho = torch.exp(tlp[i, :n] - blp[i, :n]).clamp(max=1.0)
        v = torch.cat([val[i, :n], torch.zeros(1)])
        for s in range(n):  # v_s = V(x_s) + sum_t gamma^(t-s) (prod_{i<t} c_i) rho_t delta_t
            total, coef = val[i, s].clone(), 1.0
            for u in range(s, n):
                total += coef * rho[u] * (rew[i, u] + 0.9 * v[u + 1] - v[u])
                coef *= 0.9 * float(rho[u])
            assert float(vs[i, s]) == pytest.approx(float(total), abs=1e-5)
    assert float(vs[1, 3:].abs().sum()) == 0.0 and float(adv[1, 3:].abs().sum()) == 0.0
    logp = masked_log_softmax(torch.randn(4, 5), torch.tensor([[True, False, True, False, False]] * 4))
    assert torch.allclose(logp.exp().sum(-1), torch.ones(4)) and float(logp[:, 1].exp().max()) == 0.0


# ----------------------------------------------------------------------------- training tasks
@pytest.fixture(scope="module")
def pool_file(tmp_path_factory) -> Path:
    from embshard.data.synthetic import generate_synthetic

    path = tmp_path_factory.mktemp("pool") / "syn.pt"
    generate_synthetic(path, num_tables=32, batch_size=256, seed=0)
    return path


def small_task_config(*overrides: str) -> dict:
    return rl_config("dreamshard", "rl.tasks.min_tables=4", "rl.tasks.max_tables=6", "rl.tasks.max_total_bytes=null",
                     *overrides)


def test_training_tasks_cover_every_batch_device_count_and_a_share_without_histograms(pool_file):
    from embshard.search.rl.stage import training_tasks

    c = small_task_config("rl.tasks.num_train_tasks=13", "rl.tasks.num_val_tasks=8",
                          "rl.tasks.batch_size=[1024,4096]", "rl.tasks.num_devices=[2,8]",
                          "rl.tasks.no_histogram_fraction=0.25")
    train, val, split = training_tasks(c, pool_file, seed=0)
    assert len(train) == 13 and len(val) == 8
    assert [t.batch_size for t in val[:4]] == [1024, 4096, 1024, 4096]  # the batch sizes in turn
    assert sorted(t.batch_size for t in train).count(1024) == 7  # 13 split 7 + 6
    assert {t.num_devices for t in train} == {2, 8}
    assert len({t.name for t in train + val}) == 21
    bare = [t for t in train if all(tb.reuse_histogram is None and tb.trace is None for tb in t.tables)]
    assert len(bare) == 3 and {t.batch_size for t in bare} <= {1024, 4096}  # round(0.25 x 13)
    assert sum(all(tb.reuse_histogram is None for tb in t.tables) for t in val) == 2
    assert all(tb.reuse_histogram is not None for t in train if t not in bare for tb in t.tables)
    # the split holds: training tasks use train tables only, validation tasks validation tables only
    assert {tb.name for t in train for tb in t.tables} <= set(split["train"])
    assert {tb.name for t in val for tb in t.tables} <= set(split["validation"])


def test_one_batch_size_in_a_list_gives_the_tasks_of_the_scalar(pool_file):
    from embshard.search.rl.stage import training_tasks

    scalar = training_tasks(small_task_config("rl.tasks.batch_size=2048"), pool_file, seed=3)
    listed = training_tasks(small_task_config("rl.tasks.batch_size=[2048]", "rl.tasks.num_devices=[4]"), pool_file, seed=3)
    assert [t.to_dict() for t in scalar[0] + scalar[1]] == [t.to_dict() for t in listed[0] + listed[1]]


@pytest.mark.parametrize("override, message", [("rl.tasks.batch_size=[]", "rl.tasks.batch_size must be"),
                                               ("rl.tasks.num_devices=[2,0]", "rl.tasks.num_devices must be"),
                                               ("rl.tasks.batch_size=[512,512]", "lists a batch size twice"),
                                               ("rl.tasks.no_histogram_fraction=1.5", "no_histogram_fraction must lie")])
def test_bad_training_task_settings_are_input_errors(pool_file, override, message):
    from embshard.search.rl.stage import training_tasks

    with pytest.raises(InputError, match=message):
        training_tasks(small_task_config(override), pool_file, seed=0)


def test_features_see_a_traced_table_as_replayed_when_the_checkpoint_says_so(pool_file):
    """trace_histograms="replay": a traced table's inputs are those of its replay at the task's
    batch (as NeuroShard's cost models see it), recorded in the normalisation a checkpoint
    saves; a normalisation saved before the switch existed reads as "given"."""
    from embshard.costs.features import replayed_table, table_features, with_histogram
    from embshard.data.dlrm_datasets import DlrmDataset
    from embshard.search.rl.features import FeatureNorm

    ds = DlrmDataset.open(pool_file)
    tables = list(ds.tables(dim=8))[:6]
    batch = 4 * ds.batch_size  # each bag of the trace comes back about four times
    given = FeatureNorm.fit([(t, batch) for t in tables])
    replay = FeatureNorm.fit([(t, batch) for t in tables], "replay")
    want = np.stack([table_features(with_histogram(replayed_table(t, batch), batch)[0], batch) for t in tables])
    raw = replay(tables, batch) * replay.std + replay.mean
    np.testing.assert_allclose(raw, want, rtol=1e-4, atol=1e-4)
    own = given(tables, batch) * given.std + given.mean
    assert np.abs(own - raw).max() > 0.1  # the trace's own histogram describes another reuse
    bare = Table("bare", 5000, 8, 3.0)  # no trace: the same inputs either way
    np.testing.assert_allclose(replay([bare], batch) * replay.std + replay.mean,
                               given([bare], batch) * given.std + given.mean, rtol=1e-5, atol=1e-5)
    d = replay.to_dict()
    assert FeatureNorm.from_dict(d).trace_histograms == "replay"
    d.pop("trace_histograms")
    assert FeatureNorm.from_dict(d).trace_histograms == "given"
    with pytest.raises(ValueError, match="trace_histograms must be one of"):
        FeatureNorm(given.names, given.mean, given.std, "bogus")


@pytest.mark.parametrize("algorithm", list(SHARDERS))
def test_column_split_cuts_only_the_tables_that_set_the_bottleneck(trained, algorithm):
    """split_columns: a table predicted to cost more alone than an even share is cut into equal
    column slices (multiples of 4, at least min_partition, no more than the devices, only where
    its sharding_types allow column_wise); the plan kept, split or whole, is the one the cost
    network estimates lower, it is valid, and report info says which."""
    path = str(trained[algorithm]["path"])
    rng = np.random.default_rng(9)
    small = random_tables(rng, 6, "s")
    heavy = Table("heavy", 50_000, 64, 400.0)  # far more lookups than all the others together
    for devices in (2, 4):
        task = make_task(small + [heavy], devices, name=f"cut{devices}")
        sharder = SHARDERS[algorithm](checkpoint=path, samples=2, split_columns=True)
        red = sharder.column_slices(sharder.load(), task)
        assert red is not None and {t for t, _ in red.slices.values()} == {"heavy"}
        widths = [t.dim for t in red.task.tables if t.name in red.slices]
        assert len(widths) == devices and set(widths) == {64 // devices}  # capped by the devices
        assert sorted(off for _, off in red.slices.values()) == list(range(0, 64, 64 // devices))
        plan = sharder.shard(task)
        validate(task, plan)
        info = sharder.last_search_info["column_split"]
        assert info["tables"] == ["heavy"] and info["slices"] == devices
        on = [s for s in plan.shards if s.table == "heavy"]
        assert sum(s.dim for s in on) == 64
        if not info["chosen"]:
            assert len(on) == 1  # the whole table (slices on one device would merge back into one too)
        assert info["chosen"] == (info["split_estimate_ms"] < info["whole_estimate_ms"])
    # another judge: NeuroShard's cost models decide between the two plans instead
    task = make_task(small + [heavy], 4, name="judged")
    judged = SHARDERS[algorithm](checkpoint=path, split_columns=True,
                                 split_judge=str(ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt"))
    plan = judged.shard(task)
    validate(task, plan)
    info = judged.last_search_info["column_split"]
    assert info["chosen"] == (info["split_judged_ms"] < info["whole_judged_ms"])
    assert (len([s for s in plan.shards if s.table == "heavy"]) > 1) <= info["chosen"]
    # not allowed column_wise, or min_partition as wide as the table: never cut
    task = make_task(small + [dataclasses.replace(heavy, sharding_types=("table_wise",))], 4, name="tw")
    sharder = SHARDERS[algorithm](checkpoint=path, split_columns=True)
    assert sharder.column_slices(sharder.load(), task) is None
    task = make_task(small + [dataclasses.replace(heavy, min_partition=64)], 4, name="mp")
    assert sharder.column_slices(sharder.load(), task) is None
    task = make_task(small + [dataclasses.replace(heavy, min_partition=32)], 4, name="mp32")
    assert [t.dim for t in sharder.column_slices(sharder.load(), task).task.tables if t.name != "heavy"][-2:] == [32, 32]
    with pytest.raises(InputError, match="split_above must be > 0"):
        SHARDERS[algorithm](checkpoint=path, split_columns=True, split_above=0)


@pytest.mark.parametrize("algorithm", ["dreamshard", "autoshard"])
def test_judge_samples_keeps_the_sampled_plan_the_judge_estimates_lowest(trained, algorithm):
    """judge_samples: of the argmax and the sampled plans, the one NeuroShard's cost models
    estimate lowest is kept (not the policy network's pick), and report info says which;
    without a judge or without samples the policy's own best-of-K stands."""
    ckpt = str(ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt")
    path = str(trained[algorithm]["path"])
    task = make_task(random_tables(np.random.default_rng(4), 14, "j"), 4, name="judge")
    plans = []
    for seed in range(6):
        judged = SHARDERS[algorithm](checkpoint=path, samples=6, seed=seed, split_judge=ckpt, judge_samples=True)
        plan = judged.shard(task)
        validate(task, plan)
        agent, judge = judged.load(), judged._judge_model()
        cands = plan_candidates(agent, task, 6, generator=torch.Generator().manual_seed(seed))
        costs = [judge.device_costs(task, p).plan_cost_ms for p, _ in cands]
        assert len({p.signature() for p, _ in cands}) == len(cands)  # distinct plans
        assert plan.signature() == cands[int(np.argmin(costs))][0].signature()
        info = judged.last_search_info["judged_samples"]
        assert info["plans"] == len(cands) and info["judged_ms"] == pytest.approx(min(costs))
        assert info["network_pick_judged_ms"] == pytest.approx(costs[0])
        own = SHARDERS[algorithm](checkpoint=path, samples=6, seed=seed, split_judge=ckpt)
        assert own.shard(task).signature() == cands[0][0].signature()  # the network's best-of-K
        assert "judged_samples" not in own.last_search_info
        plans.append(len(cands))
    assert max(plans) > 1  # sampling gave the judge a choice
    # a judge that disagrees by construction (it prefers plans with shards on high devices):
    # the plan kept is its pick, not the network's
    class Contrary:
        def device_costs(self, task, plan):
            return SimpleNamespace(plan_cost_ms=-float(sum(s.device for s in plan.shards)))

    seed = int(np.argmax(plans))
    judged = SHARDERS[algorithm](checkpoint=path, samples=6, seed=seed, split_judge=ckpt, judge_samples=True)
    judged._judge = Contrary()
    cands = plan_candidates(judged.load(), task, 6, generator=torch.Generator().manual_seed(seed))
    want = max(cands, key=lambda c: sum(s.device for s in c[0].shards))[0]
    assert judged.shard(task).signature() == want.signature()
    assert judged.last_search_info["judged_samples"]["pick"] == [p.signature() for p, _ in cands].index(want.signature())
    argmax = SHARDERS[algorithm](checkpoint=path, samples=0, split_judge=ckpt, judge_samples=True)
    argmax.shard(task)
    assert "judged_samples" not in argmax.last_search_info


class ByPlan:
    """Measured costs by plan signature (the guard labels candidates, not their plans), a
    `default` for every other plan; records what each round measured."""

    def __init__(self, costs: dict[tuple, float], default: float):
        self.costs, self.default = costs, default
        self.rounds: list[int] = []

    def measure_many(self, task, plans, visits=None):
        self.rounds.append(len(plans))
        jitter = 1.0 + 0.002 * (len(self.rounds) % 3)  # paired noise, so the interval has a width
        return [DeviceCosts([self.costs.get(p.signature(), self.default) * jitter], [0.0], [0.0]) for p in plans]


@pytest.mark.parametrize("algorithm", ["dreamshard", "autoshard"])
def test_guard_keeps_a_measured_better_plan_of_the_policy_else_the_best_heuristic(trained, algorithm):
    """verify=K: the policy's K best distinct plans (its pick first) are measured with the
    heuristics' plans; the measured best of them is kept where shown better than the best
    heuristic's, else that heuristic's plan is, with the agent's estimate of the plan kept."""
    ckpt = str(ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt")
    path = str(trained[algorithm]["path"])
    task = make_task(random_tables(np.random.default_rng(4), 14, "g"), 4, name="guarded")

    def sharder(**kw):
        return SHARDERS[algorithm](checkpoint=path, samples=6, seed=1, split_judge=ckpt, judge_samples=True,
                                   verify_heuristics=["size_greedy", "lookup_greedy"], verify_min_rounds=3,
                                   verify_max_rounds=6, **kw)

    plain = sharder()
    pick = plain.shard(task)
    assert plain.last_guard is None and plain.verify_count == 0  # verify=0 (the class default): no guard
    auto = sharder(verify="auto")
    assert auto.shard(task).signature() == pick.signature() and auto.last_guard is None  # auto, no hardware
    with pytest.raises(InputError, match="verify > 0 needs a hardware evaluator"):
        sharder(verify=2).shard(task)
    with pytest.raises(InputError, match="verify must be 'auto' or an integer >= 0"):
        sharder(verify=-1)

    cands = plain.guard_candidates(pick, plain.last_weighed, 3)  # what it weighed: the guarded run weighs the same
    guarded = sharder(verify=3)
    assert cands[0].signature() == pick.signature() and len({p.signature() for p in cands}) == len(cands) >= 2
    heuristics = {h: GreedySharder(h.split("_")[0]).shard(task) for h in ("size_greedy", "lookup_greedy")}
    assert all(h.signature() not in {p.signature() for p in cands} for h in heuristics.values())

    # the second candidate measures best and below every heuristic: it is kept
    second = cands[1]
    measurer = ByPlan({pick.signature(): 9.0, second.signature(): 6.0}, default=10.0)
    guarded.attach_evaluator(measurer)
    plan = guarded.shard(task)
    validate(task, plan)
    g = guarded.last_guard
    assert plan.signature() == second.signature() and g.chosen == f"{algorithm}#2"
    assert g.decision["verdict"] == "better" and g.decision["ratio"]["high"] < 1.0
    assert measurer.rounds[0] == len(cands) + 2  # round 1: every candidate and both heuristics
    assert guarded.last_search_pick.signature() == pick.signature()
    assert [c["label"] for c in g.candidates][:len(cands)] == [f"{algorithm}#{i + 1}" for i in range(len(cands))]
    assert all(c["predicted_ms"] > 0 for c in g.candidates)  # the judge's estimates

    # every plan of the policy measures worse than the heuristics: the best heuristic's plan is kept
    guarded.attach_evaluator(ByPlan({heuristics["lookup_greedy"].signature(): 8.0}, default=12.0))
    plan = guarded.shard(task)
    assert plan.signature() == heuristics["lookup_greedy"].signature() and plan.algorithm == algorithm
    assert guarded.last_guard.chosen == "lookup_greedy" and guarded.last_guard.decision["verdict"] == "worse"
    want = guarded.load().estimate_plan(task, plan)  # the agent's estimate of the plan it returns
    assert guarded.last_stats["estimated_ms"] == pytest.approx(
        guarded.trusted_estimate(task, plan, want)["ms"])
