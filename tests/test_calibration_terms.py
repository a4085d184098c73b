"""Calibration of the compute model's kinds of work (`calibration.compute_terms`): loading,
what it changes in a prediction, the fit, and `scripts/calibrate_cost_models.py --plans`."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from embshard import Plan, Table, Task
from embshard.costs.neural import RATE_TERMS, ComputeSample, NeuralCostModels, compute_features, fit_term_scales
from embshard.errors import InputError

from conftest import ROOT

CHECKPOINT = ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt"
#: a machine on which bags cost half and touched bytes 1.8x what the shipped model says
TRUE = {"bags_1e4": 0.5, "touched_mb": 1.8, "lookup_mb": 1.3}


def _bundle(calibration=None):
    bundle = torch.load(CHECKPOINT, map_location="cpu", weights_only=True)
    if calibration is not None:
        bundle["calibration"] = calibration
    return bundle


def _shards(rng, n, prefix="s"):
    out = []
    for i in range(n):
        k = int(rng.integers(1, 6))
        out.append([Table(f"{prefix}{i}_{j}", int(10 ** rng.uniform(2, 7)), int(rng.choice([4, 8, 16, 32, 64, 128])),
                          float(10 ** rng.uniform(-1.5, 1.7))) for j in range(k)])
    return out


@pytest.mark.parametrize("bad, needle", [({"compute_terms": {"lookups": 2.0}}, "unknown kinds of work ['lookups']"),
                                         ({"compute_terms": {"bags_1e4": 0.0}}, "compute_terms.bags_1e4"),
                                         ({"compute_terms": {"pieces": float("inf")}}, "compute_terms.pieces"),
                                         ({"compute_terms": [1.0] * 7}, "must map kinds of work")])
def test_bad_kinds_of_work_are_a_one_line_error(bad, needle):
    with pytest.raises(InputError) as e:
        NeuralCostModels(_bundle(bad), source="ck.pt")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_kind_of_work_scales_only_its_own_term_in_both_nets():
    plain = NeuralCostModels(_bundle())
    cal = NeuralCostModels(_bundle({"compute_terms": TRUE}), source="cal")
    rng = np.random.default_rng(1)
    shards = _shards(rng, 6)
    c = np.array([TRUE.get(k, 1.0) for k in RATE_TERMS])
    for sh in shards:
        pooled = plain._compute.encode(compute_features(sh, 8192)).sum(0)[None]
        parts, base = plain._compute.head_parts(pooled)
        want = float((parts * c).sum() + base[0])
        assert float(plain._compute.head(pooled)[0]) == pytest.approx(float(parts.sum() + base[0]), rel=1e-12)
        got = float(cal.at_batch(8192).compute_ms([sh])[0])
        assert got == pytest.approx(want, rel=1e-6)  # the rates are float32
        assert got != pytest.approx(float(plain.at_batch(8192).compute_ms([sh])[0]), rel=1e-3)
        x = torch.from_numpy(compute_features(sh, 8192))[None]
        with torch.no_grad():  # the torch net of the calibrated models predicts the same
            assert cal.net("compute")(x, torch.ones(1, len(sh))).item() == pytest.approx(got, rel=1e-4)
    # the calibration's raw state is the shipped one: fitting again starts from the model as trained
    assert torch.equal(cal.raw_state("compute")["rate_scale"], plain.raw_state("compute")["rate_scale"])


def test_fit_recovers_how_the_kinds_weigh_whatever_each_sessions_speed():
    truth = NeuralCostModels(_bundle({"compute_terms": TRUE}))
    plain = NeuralCostModels(_bundle())
    rng = np.random.default_rng(2)
    samples, groups = [], []
    for g, speed in enumerate((0.6, 1.0, 1.7)):  # three sessions, each its own speed
        for sh in _shards(rng, 20, prefix=f"g{g}_"):
            b = int(rng.choice([2048, 8192, 32768]))
            samples.append(ComputeSample(sh, b, speed * float(truth.at_batch(b).compute_ms([sh])[0])))
            groups.append(g)
    fit = fit_term_scales(plain, samples, groups, ridge=0.0)
    want = np.array([TRUE.get(k, 1.0) for k in RATE_TERMS])
    got = np.array([fit[k] for k in RATE_TERMS])
    # the level is not the fit's (each group has its own speed): the ratios between kinds are
    ratio = got / want
    assert ratio.std() / ratio.mean() < 0.02, dict(zip(RATE_TERMS, np.round(got, 3)))
    # without the groups' offsets the sessions' speeds would be read as kinds of work
    one = fit_term_scales(plain, samples, None, ridge=0.0)
    r1 = np.array([one[k] for k in RATE_TERMS]) / want
    assert r1.std() / r1.mean() > ratio.std() / ratio.mean()
    with pytest.raises(InputError, match="need at least 14"):
        fit_term_scales(plain, samples[:5])


def _load_script():
    spec = importlib.util.spec_from_file_location("calibrate_cost_models", ROOT / "scripts" / "calibrate_cost_models.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_calibrate_from_measured_plans_fits_the_kinds_and_fails_cleanly(tmp_path, capsys):
    """A shard.py out_dir as evaluate=measured leaves it (report.json, plans/, config.yaml),
    its measurements made by a machine with other kinds of work than the model's."""
    truth = NeuralCostModels(_bundle({"compute_terms": TRUE}))
    rng = np.random.default_rng(3)
    out_dir, tasks_dir = tmp_path / "run", tmp_path / "tasks"
    tasks_dir.mkdir()
    results = []
    for t in range(4):
        tables = [tb for sh in _shards(rng, 4, prefix=f"t{t}_") for tb in sh]
        task = Task(name=f"task{t}", tables=tables, num_devices=3, device_memory_bytes=2 ** 40, batch_size=8192)
        (tasks_dir / f"task{t}.json").write_text(json.dumps(task.to_dict()))
        for a in range(3):
            devices = rng.integers(0, 3, size=len(tables))
            devices[:3] = [0, 1, 2]
            plan = Plan.from_dict({"task": task.name, "algorithm": f"alg{a}", "shards": [
                {"table": tb.name, "device": int(d), "col_offset": 0, "dim": tb.dim, "row_offset": 0, "rows": tb.rows}
                for tb, d in zip(tables, devices)]})
            (out_dir / "plans" / task.name).mkdir(parents=True, exist_ok=True)
            (out_dir / "plans" / task.name / f"alg{a}.json").write_text(json.dumps(plan.to_dict()))
            ms = [1.3 * float(truth.at_batch(8192).compute_ms([[tb for tb, d in zip(tables, devices) if d == k]])[0])
                  for k in range(3)]
            results.append({"task": task.name, "algorithm": f"alg{a}", "valid": True,
                            "measured_device_costs": {"compute_ms": ms, "source": "kernels"}})
    (out_dir / "report.json").write_text(json.dumps({"results": results}))
    (out_dir / "config.yaml").write_text(f"task_file: {tasks_dir}\n")
    script = _load_script()
    out = tmp_path / "terms.pt"
    assert script.main(["--checkpoint", str(CHECKPOINT), "--plans", str(out_dir), "--terms-only", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    cal = NeuralCostModels.load(out)
    assert cal.scale == {"compute": 1.0, "forward_comm": 1.0, "backward_comm": 1.0}
    got = cal.calibration["compute_terms"]
    # 36 shards of a few pieces each (and the ridge) pin the kinds less tightly than the fit's
    # own test; the two far from 1 come out on their side, and a plan's devices agree again
    assert got["bags_1e4"] < 0.8 < 1.3 < got["touched_mb"], got
    before, after = (float(line.rsplit(" ", 1)[1]) for line in printed.splitlines() if "across a plan's devices" in line)
    assert after < 0.3 * before, printed
    # no report there, or neither source: one line, exit 2, nothing written
    assert script.main(["--plans", str(tmp_path), "--terms", "--out", str(tmp_path / "x.pt")]) == 2
    assert script.main(["--out", str(tmp_path / "y.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("error: ") for e in err) and "no report.json" in err[0]
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "y.pt").exists()


def test_scales_calibrate_on_top_of_kinds_of_work_and_keep_them(tmp_path):
    """A checkpoint that carries only kinds of work (its models' scales 1) is calibrated as
    an uncalibrated one: the scale is fitted on the predictions with those kinds, which stay."""
    terms = tmp_path / "terms.pt"
    torch.save(_bundle({"compute_terms": TRUE}), terms)
    with_terms = NeuralCostModels.load(terms)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(4)
    lines = []
    for sh in _shards(rng, 10):  # this machine runs the kinds-calibrated model's shards at 0.5x
        ms = 0.5 * float(with_terms.at_batch(4096).compute_ms([sh])[0])
        lines.append(json.dumps({"kind": "compute", "tables": [t.to_dict() for t in sh], "batch_size": 4096, "median_ms": ms}))
    (data / "compute.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "both.pt"
    assert _load_script().main(["--checkpoint", str(terms), "--data", str(data), "--out", str(out)]) == 0
    both = NeuralCostModels.load(out)
    assert both.scale["compute"] == pytest.approx(0.5) and both.calibration["compute_terms"] == TRUE


def test_fidelity_refuses_to_rescale_reports_by_a_kinds_of_work_calibration(tmp_path, capsys):
    """eval_fidelity.py --calibration rescales a report's estimates by the models' scales; kinds
    of work change every estimate differently, so that would be silently wrong: refused."""
    spec = importlib.util.spec_from_file_location("eval_fidelity", ROOT / "scripts" / "eval_fidelity.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    terms = tmp_path / "terms.pt"
    torch.save(_bundle({"compute_terms": TRUE}), terms)
    assert script.main([str(ROOT / "docs" / "user_eval" / "report.json"), "--calibration", str(terms)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compute_terms" in err[0]


def test_measured_plans_are_read_where_shard_py_writes_them_for_one_task_or_many(tmp_path):
    """shard.py writes plans/<algorithm>.json for a run of one task, plans/<task>/<algorithm>.json
    for several; a valid measured row whose plan file is missing is skipped, or named."""
    from embshard.report import measured_plan_devices

    task = Task(name="one", tables=[Table("a", 1000, 8, 2.0), Table("b", 5000, 16, 1.0)], num_devices=2,
                device_memory_bytes=2 ** 30, batch_size=2048)
    plan = Plan.from_dict({"task": "one", "algorithm": "alg", "shards": [
        {"table": t.name, "device": d, "col_offset": 0, "dim": t.dim, "row_offset": 0, "rows": t.rows}
        for d, t in enumerate(task.tables)]})
    row = {"task": "one", "algorithm": "alg", "valid": True, "measured_device_costs": {"compute_ms": [1.0, 2.0]}}
    missing = {**row, "algorithm": "gone"}
    for layout, tasks in (("plans/alg.json", ["one"]), ("plans/one/alg.json", ["one", "two"])):
        out = tmp_path / layout.replace("/", "_")
        (out / layout).parent.mkdir(parents=True)
        (out / layout).write_text(json.dumps(plan.to_dict()))
        (out / "report.json").write_text(json.dumps({"tasks": tasks, "results": [row, missing]}))
        got = list(measured_plan_devices(out, lambda name: task))
        assert [(r["algorithm"], [[p.name for p in d] for d in pieces], ms) for r, _, pieces, ms in got] == \
            [("alg", [["a"], ["b"]], [1.0, 2.0])]
        with pytest.raises(InputError, match="no plan file .*gone.json"):
            list(measured_plan_devices(out, lambda name: task, require_plans=True))
