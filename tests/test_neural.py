"""Neural cost models: tiny models trained on tiny synthetic cost data with known labels."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from embshard.costs import neural as N
from embshard.costs.base import CostModel
from embshard.costs.pretrain import (
    pretrain,
    regression_metrics,
    split_comm,
    split_compute,
    split_tables,
    split_tables_honouring,
)
from embshard.errors import InputError
from embshard.plan import Plan, Shard
from embshard.stats import kendall_tau_b
from embshard.tables import Table
from embshard.task import Task

BATCH = 1024
BATCHES = (512, 1024, 2048)
DIMS = (4, 8, 16, 32, 64, 128)


# ---------------------------------------------------------------------------------------
# synthetic cost data with a known formula
# ---------------------------------------------------------------------------------------
def make_pool(n: int, rng: np.random.Generator) -> list[Table]:
    pool = []
    for i in range(n):
        hist = rng.dirichlet(np.ones(17) * 0.5)
        pool.append(Table(f"t{i}", int(rng.integers(1_000, 1_000_000)), int(rng.choice(DIMS)),
                          float(rng.uniform(1, 40)), tuple(float(x) for x in hist)))
    return pool


def true_compute_ms(tables, batch=BATCH) -> float:
    """Sum of per-table lookup work (linear in the batch) with a fusion discount for many
    tables, plus a launch."""
    work = sum(t.pooling_factor * t.dim * (1 + 0.1 * math.log(t.rows)) for t in tables) * batch / BATCH
    return 0.05 + 2e-3 * work * (0.7 + 0.3 / len(tables))


def true_comm_ms(widths, delays, batch=BATCH):
    d = len(widths)
    total = sum(widths)
    vol = [4.0 * batch / d * ((d - 2) * w + total) / 1e6 for w in widths]
    bw = [0.2 + 2.0 * v for v in vol]
    fw = [b + (max(delays) - x) for b, x in zip(bw, delays)]
    return fw, bw


def write_data(path: Path, n_compute=600, n_comm=300, devices=(2, 3, 4, 5, 6, 8), seed=0, max_tables=5, n_pool=120) -> list[Table]:
    rng = np.random.default_rng(seed)
    pool = make_pool(n_pool, rng)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "compute.jsonl", "w") as f:
        for _ in range(n_compute):
            k = int(rng.integers(1, max_tables + 1))
            tables = [pool[i].with_dim(int(rng.choice(DIMS))) for i in rng.choice(len(pool), k, replace=False)]
            batch = int(rng.choice(BATCHES))
            ms = true_compute_ms(tables, batch) * float(rng.normal(1, 0.02))
            f.write(json.dumps({"kind": "compute", "tables": [t.to_dict() for t in tables], "batch_size": batch,
                                "median_ms": ms, "spread_ms": 0.01, "samples_ms": [ms] * 3}) + "\n")
    with open(path / "comm.jsonl", "w") as f:
        for _ in range(n_comm):
            d = int(rng.choice(devices))
            widths = [int(x) for x in rng.integers(4, 400, size=d)]
            delays = [float(x) for x in rng.uniform(0, 10, size=d)]
            batch = int(rng.choice(BATCHES))
            fw, bw = true_comm_ms(widths, delays, batch)
            f.write(json.dumps({"kind": "comm", "num_devices": d, "batch_size": batch, "widths": widths,
                                "delays_ms": delays, "forward_ms": fw, "backward_ms": bw}) + "\n")
    (path / "profile.json").write_text(json.dumps({"backend": "synthetic", "device": "formula", "torch": torch.__version__}))
    return pool


# 30 epochs: the trained fixture's test-set Kendall tau is 0.98 (compute) and 0.98-0.99 (comm) at 30
# as at 60, against the tests' 0.8 and 0.75
FAST = {"max_epochs": 30, "batch_size": 32, "lr": 3e-3, "patience": 25, "progress": False, "wandb": False,
        "val_fraction": 0.1, "test_fraction": 0.15, "holdout_num_devices": 6, "val_by": "tables",
        "compute": {"hidden": 32, "hidden2": 16, "context_hidden": 8},
        "comm": {"hidden": 32, "embed": 16}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("neural")
    write_data(root / "data")
    objective = pretrain(FAST, root / "data", root / "out")
    return root, objective


# ---------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------
def test_kendall_tau_b_known_values():
    x = np.arange(10.0)
    assert kendall_tau_b(x, x) == pytest.approx(1.0)
    assert kendall_tau_b(x, -x) == pytest.approx(-1.0)
    # ties: x = [1,1,2,3], y = [1,2,2,3]: C=4, D=0, n0=6, n1=1, n2=1 -> 4/5
    assert kendall_tau_b([1, 1, 2, 3], [1, 2, 2, 3]) == pytest.approx(0.8)
    # chunking gives the same answer as one block
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=300), rng.normal(size=300)
    assert kendall_tau_b(a, b, chunk=7) == pytest.approx(kendall_tau_b(a, b, chunk=1000))
    m = regression_metrics(np.array([1.0, 2.0, 4.0]), np.array([1.0, 2.0, 4.0]))
    assert m["rmse_ms"] == 0 and m["r2"] == 1 and m["mape_pct"] == 0


# ---------------------------------------------------------------------------------------
# splits
# ---------------------------------------------------------------------------------------
def test_heldout_split_is_by_table_names(tmp_path):
    write_data(tmp_path, n_compute=200, n_comm=20)
    samples = N.load_compute_samples(tmp_path / "compute.jsonl")
    tables = split_tables([t.name for s in samples for t in s.tables], 0.1, 0.2, seed=3)
    assert not set(tables["test"]) & set(tables["train"]) and not set(tables["val"]) & set(tables["train"])
    split = split_compute(samples, tables)
    assert sum(len(v) for v in split.values()) == len(samples)
    for i in split["train"]:
        assert all(t.name in tables["train"] for t in samples[i].tables)
    for i in split["val"]:
        assert not {t.name for t in samples[i].tables} & set(tables["test"])
    assert all({t.name for t in samples[i].tables} & set(tables["test"]) for i in split["test"])
    assert split_tables(["a", "b", "c", "d"], 0.25, 0.25, 1) == split_tables(["d", "c", "b", "a"], 0.25, 0.25, 1)
    # the collector's own held-out tables (samples marked split="test") are the test tables
    for s in samples[:20]:
        s.split = "test"
    marked = {t.name for s in samples[:20] for t in s.tables}
    tables = split_tables_honouring(samples, 0.1, 0.2, seed=3)
    assert set(tables["test"]) == marked and not marked & (set(tables["train"]) | set(tables["val"]))
    assert set(split_compute(samples, tables)["test"]) >= set(range(20))


# ---------------------------------------------------------------------------------------
# training and accuracy
# ---------------------------------------------------------------------------------------
def test_pretrain_learns_formula_and_writes_outputs(trained):
    root, objective = trained
    out = root / "out"
    for name in ("cost_models.pt", "metrics.json", "metrics.csv", "data_card.md", "logs/compute/metrics.csv"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    assert objective == pytest.approx(metrics["compute"]["val"]["kendall_tau"])
    assert metrics["compute"]["test"]["n"] > 20
    assert metrics["compute"]["test"]["kendall_tau"] > 0.8, metrics["compute"]["test"]
    assert metrics["compute"]["test"]["mape_pct"] < 20, metrics["compute"]["test"]
    assert set(metrics["compute"]["by_batch"]) == {str(b) for b in BATCHES}
    for kind in ("forward_comm", "backward_comm"):
        assert metrics[kind]["test"]["kendall_tau"] > 0.8, (kind, metrics[kind]["test"])
        assert metrics[kind]["test"]["r2"] > 0.8, (kind, metrics[kind]["test"])
    card = (out / "data_card.md").read_text()
    assert "## Training envelope" in card and "512, 1024, 2048" in card


def test_batch_size_is_an_input_not_a_linear_scale(trained):
    root, _ = trained
    models = N.NeuralCostModels.load(root / "out" / "cost_models.pt")
    pool = make_pool(40, np.random.default_rng(11))  # tables never trained on
    shards = [pool[i : i + 3] for i in range(0, 39, 3)]
    for batch in BATCHES:
        pred = models.at_batch(batch).compute_ms(shards)
        truth = np.array([true_compute_ms(s, batch) for s in shards])
        assert np.median(np.abs(pred - truth) / truth) < 0.2, batch
    # the same shards at twice the batch: about twice the time (the formula is linear in it)
    ratio = models.at_batch(2048).compute_ms(shards) / models.at_batch(1024).compute_ms(shards)
    assert 1.6 < np.median(ratio) < 2.4


def test_comm_model_generalises_to_unseen_device_count(trained):
    root, _ = trained
    metrics = json.loads((root / "out" / "metrics.json").read_text())["metrics"]
    data = torch.load(root / "out" / "cost_models.pt", weights_only=True)["data"]
    samples = N.load_comm_samples(root / "data" / "comm.jsonl")
    split = split_comm(samples, 0.1, 0.1, 0, 6)
    assert all(samples[i].num_devices != 6 for k in ("train", "val", "test") for i in split[k])
    assert split["heldout_devices"] and all(samples[i].num_devices == 6 for i in split["heldout_devices"])
    assert data["comm_samples"]["heldout_devices"] > 0 and data["holdout_num_devices"] == 6
    for kind in ("forward_comm", "backward_comm"):
        m = metrics[kind]["heldout_devices"]
        assert m["kendall_tau"] > 0.75 and m["r2"] > 0.7, (kind, m)
    # and any D at all, never seen (12), in the plausible direction: more bytes, more time
    models = N.NeuralCostModels.load(root / "out" / "cost_models.pt").at_batch(BATCH)
    w = np.full((2, 12), 64.0)
    w[1] *= 4
    fw, bw = models.comm_ms(w, np.zeros((2, 12)))
    assert fw.shape == bw.shape == (2, 12) and np.all(np.isfinite(fw)) and np.all(bw >= 0)
    assert bw[1].mean() > bw[0].mean()


def test_checkpoint_loads_weights_only_and_matches_torch(trained):
    root, _ = trained
    path = root / "out" / "cost_models.pt"
    raw = torch.load(path, weights_only=True)
    assert raw["format_version"] == N.FORMAT_VERSION and raw["data"]["batch_sizes"] == list(BATCHES)
    assert set(raw["normalization"]) == set(N.MODEL_KEYS) and raw["profile"]["backend"] == "synthetic"
    assert raw["data"]["tables"]["test"] and "metrics" in raw and raw["envelope"]["compute_batch_sizes"] == list(BATCHES)
    models = N.NeuralCostModels.load(path).at_batch(BATCH)
    rng = np.random.default_rng(5)
    pool = make_pool(12, rng)
    shards = [pool[:3], pool[3:4], [], pool[4:12]]
    fast = models.compute_ms(shards)
    assert fast[2] == 0.0 and np.all(fast[[0, 1, 3]] > 0)
    # numpy inference == the torch network on the same inputs
    net = models.models.net("compute")
    for sh, v in zip(shards, fast):
        if sh:
            x = torch.from_numpy(N.compute_features(sh, BATCH))[None]
            with torch.no_grad():
                ref = net(x, torch.ones(1, len(sh))).item()
            assert v == pytest.approx(ref, rel=1e-4)
    # compute model tracks the formula on unseen tables
    pred = models.compute_ms([[t] for t in pool] + [pool[i : i + 4] for i in range(8)])
    truth = [true_compute_ms([t]) for t in pool] + [true_compute_ms(pool[i : i + 4]) for i in range(8)]
    assert kendall_tau_b(truth, pred) > 0.7


def test_compute_model_is_permutation_invariant_and_positive(trained):
    root, _ = trained
    models = N.NeuralCostModels.load(root / "out" / "cost_models.pt").at_batch(BATCH)
    pool = make_pool(6, np.random.default_rng(9))
    a = models.compute_ms([pool, pool[::-1], [pool[i] for i in (3, 1, 5, 0, 4, 2)]])
    assert a[0] == pytest.approx(a[1], rel=1e-5) and a[0] == pytest.approx(a[2], rel=1e-5)
    torch.manual_seed(0)
    net = N.ComputeNet(hidden=16, hidden2=8, context_hidden=8)
    x = torch.from_numpy(N.compute_features(pool[:5], BATCH))[None]
    perm = torch.randperm(5)
    pad = torch.cat([x[:, perm], torch.from_numpy(N.compute_features(pool[:2], BATCH))[None]], dim=1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]], dtype=torch.float32)  # padding rows ignored
    y = net(x, torch.ones(1, 5))
    assert y.item() > 0 and y.item() == pytest.approx(net(pad, mask).item(), rel=1e-5)


def test_device_costs_simulate_the_plan_at_the_tasks_batch(trained):
    from embshard.plan import device_pieces

    root, _ = trained
    models = N.NeuralCostModels.load(root / "out" / "cost_models.pt")
    assert isinstance(models, CostModel)
    pool = make_pool(6, np.random.default_rng(1))
    task = Task("t", 3, 1 << 40, BATCH, tuple(pool))
    shards = [Shard.whole(t, i % 3) for i, t in enumerate(pool[:5])]
    last = pool[5]  # column halves on devices 0 and 2 (dim 4 cannot split: put it whole)
    if last.dim >= 8:
        shards += [Shard(last.name, 0, 0, last.dim // 2, 0, last.rows), Shard(last.name, 2, last.dim // 2, last.dim // 2, 0, last.rows)]
    else:
        shards.append(Shard.whole(last, 2))
    plan = Plan("t", "manual", shards)
    costs = models.device_costs(task, plan)
    p = models.at_batch(BATCH)
    # each device's pieces written out by hand from the placement above (not through
    # device_pieces), predicted one device at a time
    if last.dim >= 8:
        half = last.with_dim(last.dim // 2)
        by_hand = [[pool[0], pool[3], half], [pool[1], pool[4]], [pool[2], half]]
    else:
        by_hand = [[pool[0], pool[3]], [pool[1], pool[4]], [pool[2], last]]
    compute = np.array([float(p.compute_ms([pieces])[0]) for pieces in by_hand])
    assert costs.compute_ms == pytest.approx(list(compute), rel=1e-5)
    widths = np.array([float(sum(t.dim for t in pieces)) for pieces in by_hand])
    assert widths.sum() == sum(t.dim for t in pool)  # every column sent once
    # the slowest device leads by nothing; the others wait for it in the forward all-to-all
    delays = compute - compute.min()
    fw, bw = p.comm_ms(widths, delays)
    assert costs.forward_comm_ms == pytest.approx(list(fw), rel=1e-5)
    assert costs.backward_comm_ms == pytest.approx(list(bw), rel=1e-5)
    slowest = int(np.argmax(compute + fw + bw))
    assert costs.plan_cost_ms == pytest.approx(compute[slowest] + fw[slowest] + bw[slowest], rel=1e-5)
    # another batch size is the models' own prediction at that batch (no linear rescaling)
    task2 = Task("t", 3, 1 << 40, 2 * BATCH, tuple(pool))
    c2 = models.device_costs(task2, plan)
    assert c2.compute_ms == pytest.approx(list(models.at_batch(2 * BATCH).compute_ms(device_pieces(task2, plan))))
    assert 1.5 < c2.plan_cost_ms / costs.plan_cost_ms < 2.5


def test_envelope_flags_what_the_models_never_saw(trained):
    root, _ = trained
    models = N.NeuralCostModels.load(root / "out" / "cost_models.pt")
    pool = make_pool(30, np.random.default_rng(4))
    inside = Task("in", 2, 1 << 40, BATCH, tuple(pool[:4]))
    plan = Plan("in", "m", [Shard.whole(t, i % 2) for i, t in enumerate(inside.tables)])
    rep = models.envelope_report(inside, plan)
    assert rep["out_of_envelope_devices"] == 0 and rep["imputed_histograms"] == 0, rep
    # 30 pieces on one device (trained on 1..5), a batch never seen, a table without a histogram
    flat = [Table(t.name, t.rows, t.dim, t.pooling_factor) for t in pool]
    outside = Task("out", 2, 1 << 40, 8 * BATCH, tuple(flat))
    plan = Plan("out", "m", [Shard.whole(t, 0) for t in flat[:-1]] + [Shard.whole(flat[-1], 1)])
    rep = models.envelope_report(outside, plan)
    assert rep["out_of_envelope_devices"] == 2 and rep["imputed_histograms"] == 30
    reasons = " ".join(rep["reasons"]["0"])
    assert "pieces=29 >" in reasons and "batch=8192 >" in reasons
    assert rep["comm_out_of_envelope"] and any("batch" in r for r in rep["comm_reasons"])


# ---------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["garbage", "truncated", "wrong_dict", "wrong_shapes", "missing"])
def test_bad_checkpoint_one_line_input_error(trained, tmp_path, kind):
    root, _ = trained
    good = root / "out" / "cost_models.pt"
    bad = tmp_path / "cost_models.pt"
    if kind == "garbage":
        bad.write_bytes(b"\x00not a checkpoint" * 10)
    elif kind == "truncated":
        bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif kind == "wrong_dict":
        torch.save({"format_version": N.FORMAT_VERSION, "hello": 1}, bad)
    elif kind == "wrong_shapes":
        b = torch.load(good, weights_only=True)
        b["compute"]["hparams"]["hidden"] = 99
        torch.save(b, bad)
    with pytest.raises(InputError) as e:
        N.NeuralCostModels.load(bad)
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg


def test_bad_data_line_one_line_input_error(tmp_path):
    write_data(tmp_path, n_compute=30, n_comm=20)
    lines = (tmp_path / "compute.jsonl").read_text().splitlines()
    lines[6] = lines[6][: len(lines[6]) // 2]  # a torn line
    (tmp_path / "compute.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"compute\.jsonl:7: not valid JSON"):
        pretrain(FAST, tmp_path, tmp_path / "out")
    assert not (tmp_path / "out" / "cost_models.pt").exists()
    # a well-formed line with a bad value
    write_data(tmp_path, n_compute=30, n_comm=20)
    lines = (tmp_path / "comm.jsonl").read_text().splitlines()
    obj = json.loads(lines[2])
    obj["forward_ms"] = obj["forward_ms"][:-1]
    lines[2] = json.dumps(obj)
    (tmp_path / "comm.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"comm\.jsonl:3: "):
        N.load_comm_samples(tmp_path / "comm.jsonl")
    with pytest.raises(InputError, match="unknown cost-model pretrain setting"):
        pretrain({"max_epoch": 3}, tmp_path, tmp_path / "out")


def test_wandb_offline_and_csv_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    write_data(tmp_path / "data", n_compute=80, n_comm=40)
    cfg = dict(FAST, max_epochs=2, wandb=True, progress=True)
    pretrain(cfg, tmp_path / "data", tmp_path / "out")
    assert list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    csv = (tmp_path / "out" / "logs" / "forward_comm" / "metrics.csv").read_text()
    assert "forward_comm/val_loss" in csv.splitlines()[0]


def test_hydra_config_instantiates_the_bundle(trained):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from embshard.costs.pretrain import resolve_config

    root, _ = trained
    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "cost_model" / "neural.yaml")
    assert resolve_config(cfg)["compute"]["hidden"] == 128  # every yaml field is known
    cfg.path = str(root / "out" / "cost_models.pt")
    models = instantiate(cfg)
    assert isinstance(models, N.NeuralCostModels) and models.at_batch(BATCH).batch_size == BATCH


def test_numpy_inference_matches_torch_and_running_sums(trained):
    root, _ = trained
    bundle = torch.load(root / "out" / "cost_models.pt", weights_only=True)
    torch.manual_seed(0)
    net = N.ComputeNet(**bundle["compute"]["hparams"])
    net.load_state_dict(bundle["compute"]["state_dict"])
    with torch.no_grad():  # perturb every weight: the check must not depend on the trained values
        for prm in net.parameters():
            prm.add_(0.05 * torch.randn_like(prm))
    bundle["compute"] = {"state_dict": {k: v.clone() for k, v in net.state_dict().items()}, "hparams": bundle["compute"]["hparams"]}
    models = N.NeuralCostModels(bundle).at_batch(2048)
    pool = make_pool(9, np.random.default_rng(3))
    shards = [pool[:1], pool[1:5], pool[5:9]]
    for sh, fast in zip(shards, models.compute_ms(shards)):
        x = torch.from_numpy(N.compute_features(sh, 2048))[None]
        with torch.no_grad():
            ref = net.eval()(x, torch.ones(1, len(sh))).item()
        assert fast == pytest.approx(ref, rel=1e-4, abs=1e-6)
    # the search's running sums: head_ms(sum of encodings) is the same prediction
    enc = models.table_encodings(pool[1:5])
    assert models.head_ms(enc.sum(0, keepdims=True))[0] == pytest.approx(models.compute_ms([pool[1:5]])[0], rel=1e-6)


def test_per_task_kendall_taus_never_mixes_tasks():
    from embshard.costs.pretrain import per_task_kendall_taus

    # Task "a" is ranked right, task "b" exactly wrong, on scales where pooling all five plans
    # would give a high tau (b's costs are 100x a's); task "c" has one plan: no tau.
    rows = ([{"task": "a", "m": m, "p": m + 0.5} for m in (1.0, 2.0, 3.0)]
            + [{"task": "b", "m": m, "p": 400.0 - m} for m in (100.0, 200.0)]
            + [{"task": "c", "m": 5.0, "p": 1.0}])
    assert per_task_kendall_taus(rows, "m", "p") == [1.0, -1.0]
    # Tasks keyed by (report, name): same names in two reports stay apart.
    rows2 = [{**r, "task": (0, r["task"])} for r in rows[:3]] + [{**r, "task": (1, "a")} for r in rows[3:5]]
    assert per_task_kendall_taus(rows2, "m", "p") == [1.0, -1.0]


def test_an_objective_without_a_value_is_nan_and_says_why():
    """A validation set of fewer than two samples (a tiny collection) has no Kendall tau: the
    objective is nan, never a lookup error or a silent number, and the reason names the set."""
    from embshard.costs.pretrain import _objective, _undefined_objective, regression_metrics

    one = {"compute": {"val": regression_metrics(np.array([2.0]), np.array([1.0]))}}
    empty = {"compute": {"val": regression_metrics(np.array([]), np.array([]))}}
    flat = {"compute": {"val": regression_metrics(np.array([1.0, 2.0, 3.0]), np.array([5.0, 5.0, 5.0]))}}
    for metrics, n in ((one, 1), (empty, 0)):
        assert math.isnan(_objective(metrics, "compute/val/kendall_tau"))
        why = _undefined_objective(metrics, "compute/val/kendall_tau")
        assert f"compute/val has {n} sample(s)" in why and "at least 2" in why
    assert math.isnan(_objective(flat, "compute/val/kendall_tau"))  # constant predictions: tau undefined
    assert "(3 samples) gives no value" in _undefined_objective(flat, "compute/val/kendall_tau")
    with pytest.raises(InputError, match="is not a metric"):
        _objective(one, "compute/val/kendal_tau")
