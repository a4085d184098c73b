"""Every run says what it really did and fails loudly when it did nothing (issue 17), one test
(or a few) per item: a learned planner without its model, a run with no valid plan, unknown
keys, algorithm=X and '+' overrides, table kinds, estimate captions, infeasibility hints,
--help, and the per-task table. shard.py runs in-process (composed configs) except where the
entry point itself is what is tested."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from embshard import InputError, Plan, PlanError, Shard, Table, Task
from embshard.flexshard.baselines import DataParallelSharder
from embshard.search.neuroshard import NeuroShardSharder

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt"
SEQUENCE_ALGORITHMS = ["data_parallel", "row_wise", "row_wise_dedup", "table_row_wise", "hugectr_hybrid", "flexshard"]
POOLED_ONLY = ["neuroshard", "dreamshard", "autoshard", "torchrec", "portfolio"]


def pooled_task(name="mine", devices=2, memory=64 * 2**20, batch=256) -> Task:
    return Task(name, devices, memory, batch, tuple(Table(f"t{i}", 1000 * (i + 1), 8 * (1 + i % 2), 1.0 + i)
                                                    for i in range(6)))


def shard_cfg(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="shard", overrides=list(overrides))


def run_in_process(capsys, tmp_path: Path, task_or_tasks, *overrides: str) -> tuple[int, str, str, Path]:
    """shard.py as its entry point runs it (`one_line_errors(run, cfg)`) on the task(s): exit
    code, stdout, stderr and the out_dir."""
    import shard
    from embshard.cli import one_line_errors

    tasks = task_or_tasks if isinstance(task_or_tasks, list) else [task_or_tasks]
    for t in tasks:
        t.save(tmp_path / "tasks" / f"{t.name}.json")
    out = tmp_path / "out"
    spec = tmp_path / "tasks" if len(tasks) > 1 else tmp_path / "tasks" / f"{tasks[0].name}.json"
    cfg = shard_cfg(f"task_file={spec}", f"out_dir={out}", "progress=false", *overrides)
    code = 0
    try:
        one_line_errors(shard.run, cfg)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err, out


def row(stdout: str, algorithm: str) -> str:
    """The table line of `algorithm` (its name, then two spaces)."""
    (line,) = [l for l in stdout.splitlines() if l.startswith(algorithm + " ")]
    return line


def report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


# ----------------------------------------------------------------------------- 1. learned planner, no model
@pytest.mark.parametrize("content", [None, b"not a torch file"])
def test_neuroshard_without_its_checkpoint_is_invalid_never_a_quiet_analytic_run(capsys, tmp_path, content):
    ckpt = tmp_path / "mine" / "cost_models.pt"
    if content is not None:
        ckpt.parent.mkdir()
        ckpt.write_bytes(content)
    code, out_, err, out = run_in_process(capsys, tmp_path, pooled_task(), "algorithms=[size_greedy,neuroshard]",
                                          "evaluate=none", f"searchers.neuroshard.checkpoint={ckpt}")
    assert code == 0, err  # size_greedy planned the task
    by = {r["algorithm"]: r for r in report(out)["results"]}
    assert not by["neuroshard"]["valid"] and str(ckpt) in by["neuroshard"]["error"]
    assert by["neuroshard"]["search_info"] is None
    assert sorted(p.name for p in (out / "plans").iterdir()) == ["size_greedy.json"]
    assert "INVALID" in row(out_, "neuroshard") and str(ckpt) in row(out_, "neuroshard")


def test_neuroshard_in_python_searches_against_the_shipped_checkpoint_and_says_so():
    from embshard.costs.neural import NeuralCostModels

    task = pooled_task()
    default, explicit = NeuroShardSharder(verify=0), NeuroShardSharder(checkpoint=str(SHIPPED), verify=0)
    plan = default.shard(task)
    assert isinstance(default.load_predictor(), NeuralCostModels)
    assert default.last_search_info["cost_model"] == "neural" and default.last_search_info["checkpoint"] == str(SHIPPED)
    assert plan.signature() == explicit.shard(task).signature()
    analytic = NeuroShardSharder(checkpoint=None, verify=0)
    analytic.shard(task)
    assert analytic.load_predictor() is None
    assert analytic.last_search_info["cost_model"] == "analytic" and analytic.last_search_info["checkpoint"] is None


# ----------------------------------------------------------------------------- 2. nothing valid: exit 1
def test_a_task_no_algorithm_can_plan_exits_1_and_claims_no_plans(capsys, tmp_path):
    # by hand: rows x dim x 4 + 2 x 256 x dim x 4 over the six tables = 1,203,456 bytes; two devices hold 80,000
    task = pooled_task(memory=40_000)
    code, stdout, err, out = run_in_process(capsys, tmp_path, task, "algorithms=[size_greedy,round_robin]", "evaluate=none")
    assert code == 1
    last = [l for l in err.splitlines() if l.strip()][-1]
    assert last.startswith("error: no valid plan for task(s) 'mine': every algorithm failed")
    assert "the tables need 1203456 bytes in all" in last and "2 devices hold 80000" in last
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "report.json"]
    wrote = [l for l in stdout.splitlines() if l.startswith("wrote ")]
    assert wrote == [f"wrote {out}/: report.json, config.yaml"]
    assert all(not r["valid"] for r in report(out)["results"])


def test_one_task_without_a_plan_among_several_still_exits_1_and_keeps_the_others(capsys, tmp_path):
    tasks = [pooled_task("fits"), pooled_task("tight", memory=40_000)]
    code, stdout, err, out = run_in_process(capsys, tmp_path, tasks, "algorithms=[size_greedy]", "evaluate=none")
    assert code == 1 and "'tight'" in err.splitlines()[-1] and "'fits'" not in err.splitlines()[-1]
    assert (out / "plans" / "fits" / "size_greedy.json").is_file() and not (out / "plans" / "tight").exists()
    assert "over the 2 tasks:" in stdout


# ----------------------------------------------------------------------------- 3. unknown keys
TASK = {"name": "x", "num_devices": 2, "device_memory_bytes": 1 << 30, "batch_size": 64,
        "tables": [{"name": "a", "rows": 100, "dim": 4, "pooling_factor": 1.0}]}


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(optimiser="rowwise_adagrad"),
     "task 'x': unknown field 'optimiser' (did you mean 'optimizer'?)"),
    (lambda d: d.update(num_device=2),
     "task 'x': unknown field 'num_device' (did you mean 'num_devices'?)"),
    (lambda d: d["tables"][0].update(pooling_facter=2.0),
     "table 'a': unknown field 'pooling_facter' (did you mean 'pooling_factor'?)"),
    (lambda d: d["tables"][0].update(trace={"file": "f.pt", "tabel_index": 0}),
     "table 'a': trace: unknown field 'tabel_index' (did you mean 'table_index'?)"),
    (lambda d: d.update(colour="red"), "task 'x': unknown field 'colour'; known:"),
])
def test_unknown_task_keys_at_every_level_are_one_line_errors_with_a_did_you_mean(tmp_path, change, message):
    d = json.loads(json.dumps(TASK))
    change(d)
    (tmp_path / "task.json").write_text(json.dumps(d))
    with pytest.raises(InputError) as e:
        Task.load(tmp_path / "task.json")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_misspelt_optimizer_stops_shard_py_before_anything_is_written(capsys, tmp_path):
    import shard
    from embshard.cli import one_line_errors

    (tmp_path / "task.json").write_text(json.dumps({**TASK, "optimiser": "rowwise_adagrad"}))
    with pytest.raises(SystemExit) as e:
        one_line_errors(shard.run, shard_cfg(f"task_file={tmp_path / 'task.json'}", f"out_dir={tmp_path / 'out'}",
                                             "evaluate=none"))
    assert e.value.code == 2
    (line,) = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert line.startswith("error: ") and "did you mean 'optimizer'?" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task.json"]


PLAN = {"task": "x", "algorithm": "hand", "shards": [
    {"table": "a", "device": 0, "col_offset": 0, "dim": 4, "row_offset": 0, "rows": 100}]}


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(algoritm="x"), "plan: unknown field 'algoritm' (did you mean 'algorithm'?)"),
    (lambda d: d["shards"][0].update(col_ofset=0), "shard of table 'a': unknown field 'col_ofset' (did you mean 'col_offset'?)"),
    (lambda d: d["shards"][0].update(replika=1), "shard of table 'a': unknown field 'replika' (did you mean 'replica'?)"),
    (lambda d: d.update(row_maps={"a": {"file": "m.npy", "rows": 1, "sha265": "0"}}),
     "row map of table 'a': unknown field 'sha265' (did you mean 'sha256'?)"),
])
def test_unknown_plan_keys_at_every_level_are_one_line_errors_with_a_did_you_mean(tmp_path, change, message):
    d = json.loads(json.dumps(PLAN))
    change(d)
    (tmp_path / "plan.json").write_text(json.dumps(d))
    with pytest.raises(InputError) as e:
        Plan.load(tmp_path / "plan.json")
    assert message in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- 4. algorithm=X, no '+'
def test_algorithm_runs_exactly_that_one(capsys, tmp_path):
    code, _, err, out = run_in_process(capsys, tmp_path, pooled_task(), "algorithm=neuroshard", "evaluate=none")
    assert code == 0, err
    assert [r["algorithm"] for r in report(out)["results"]] == ["neuroshard"]
    assert sorted(p.name for p in (out / "plans").iterdir()) == ["neuroshard.json"]


def test_algorithm_and_algorithms_together_is_an_input_error(capsys, tmp_path):
    code, _, err, out = run_in_process(capsys, tmp_path, pooled_task(), "algorithm=neuroshard", "algorithms=[size_greedy]")
    assert code == 2 and err.strip() == "error: set algorithm=X (one) or algorithms=[X,Y] (several), not both"
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("arg, message", [
    ("+algorithm=neuroshard", "write algorithm=neuroshard"),
    ("+algoritm=neuroshard", "'algoritm' is not a shard.py key (did you mean 'algorithm'?)"),
])
def test_plus_overrides_are_refused_in_one_line(tmp_path, arg, message):
    out = tmp_path / "out"
    env = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0")
    proc = subprocess.run([sys.executable, str(ROOT / "shard.py"), arg, f"out_dir={out}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {arg}: ") and message in line
    assert not out.exists()


# ----------------------------------------------------------------------------- 5. table kinds
def test_every_searcher_declares_what_it_is_meant_for():
    """The classes behind conf/searchers/all.yaml, against the kinds each algorithm's paper or
    data path is for (written out here, not read from the code)."""
    from hydra.utils import get_class

    cfg = shard_cfg()
    kinds = {name: get_class(cfg.searchers[name]._target_).capabilities.table_kinds for name in cfg.searchers}
    assert {n for n, k in kinds.items() if k == ("sequence",)} == set(SEQUENCE_ALGORITHMS)
    assert {n for n, k in kinds.items() if k == ("pooled",)} == set(POOLED_ONLY)
    assert {n for n, k in kinds.items() if set(k) == {"pooled", "sequence"}} == {
        "random", "round_robin", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy", "pile_up",
        "table_wise"}


def planned_without_evaluating(capsys, tmp_path, task, algorithms) -> tuple[str, dict, Path]:
    """shard.py evaluate=none on `task` with `algorithms` (it must exit 0): stdout, the results
    by algorithm, the out_dir."""
    code, stdout, err, out = run_in_process(capsys, tmp_path, task, "evaluate=none", f"algorithms=[{','.join(algorithms)}]")
    assert code == 0, err
    return stdout, {r["algorithm"]: r for r in report(out)["results"]}, out


def test_sequence_algorithms_refuse_a_pooled_task(capsys, tmp_path):
    stdout, by, out = planned_without_evaluating(capsys, tmp_path, pooled_task(), SEQUENCE_ALGORITHMS + ["size_greedy"])
    for name in SEQUENCE_ALGORITHMS:
        assert by[name]["error"] == (f"refused: {name} is meant for sequence tables; task 'mine' has only pooled tables "
                                     "(neuroshard, portfolio and the table-wise heuristics plan pooled tables)")
        assert by[name]["search_seconds"] is None and f"INVALID  refused: {name}" in row(stdout, name)
    assert by["size_greedy"]["valid"]
    assert sorted(p.name for p in (out / "plans").iterdir()) == ["size_greedy.json"]


def test_pooled_planners_plan_the_pooled_part_of_mixed_tasks_and_refuse_sequence_only_ones(capsys, tmp_path):
    """On a task of both kinds a planner of pooled tables plans its pooled tables, the sequence
    tables placed whole around them (search_info.mixed says so, no `_pick` row of the pooled part
    alone); on a task of sequence tables only it is refused, naming who plans them."""
    tables = (Table("s0", 300, 8, 4.0, kind="sequence"), Table("s1", 2000, 16, 3.0, kind="sequence"),
              Table("p0", 500, 8, 2.0), Table("p1", 900, 16, 5.0))
    task = Task("mixed", 4, 1 << 30, 64, tables, devices_per_host=2)
    code, _, err, out = run_in_process(capsys, tmp_path, task, "evaluate=none", f"algorithms=[{','.join(POOLED_ONLY)},"
                                       "table_wise,row_wise,flexshard]", "searchers.flexshard.fit_batches=1")
    assert code == 0, err
    results = report(out)["results"]
    by = {r["algorithm"]: r for r in results}
    assert not any(r["algorithm"].endswith("_pick") for r in results)
    for name in POOLED_ONLY:
        assert by[name]["valid"], by[name]["error"]
        # both sequence tables in TorchRec's row blocks, one per device
        assert by[name]["search_info"]["mixed"] == {"sequence_planner": "size_lookup_greedy", "sequence_tables": 2,
                                                    "pooled_tables": 2, "row_split": ["s0", "s1"],
                                                    "reserved_bytes": by[name]["search_info"]["mixed"]["reserved_bytes"]}
        plan = Plan.load(out / "plans" / f"{name}.json")
        assert {s.table for s in plan.shards} == {t.name for t in tables}
        for t, block in (("s0", 75), ("s1", 500)):
            assert sorted((s.device, s.row_offset, s.rows) for s in plan.shards if s.table == t) == [
                (d, block * d, block) for d in range(4)]
    assert all(by[n]["valid"] for n in ("table_wise", "row_wise", "flexshard"))
    seq_only = Task("seq", 4, 1 << 30, 64, tables[:2], devices_per_host=2)
    _, by, _ = planned_without_evaluating(capsys, tmp_path / "seq", seq_only, POOLED_ONLY + ["table_wise"])
    for name in POOLED_ONLY:
        assert by[name]["error"] == (f"refused: {name} is meant for pooled tables; task 'seq' has only sequence tables "
                                     "(flexshard, row_wise and size_lookup_greedy plan sequence tables)")


def test_torchrec_export_of_replicas_is_data_parallel_or_one_line():
    """Every table on every rank is TorchRec's data_parallel; replicas on some ranks only have no
    TorchRec equivalent: one line naming the table."""
    from embshard.torchrec_bridge import plan_to_torchrec

    task = pooled_task()
    exported = plan_to_torchrec(task, DataParallelSharder().shard(task))
    assert {ps.sharding_type for ps in exported.plan[""].values()} == {"data_parallel"}
    task = pooled_task(devices=3)
    t = task.tables[0]
    partial = Plan(task.name, "x", [Shard.whole(x, 0) for x in task.tables] + [Shard(t.name, 1, 0, t.dim, 0, t.rows, replica=1)])
    with pytest.raises(PlanError) as e:
        plan_to_torchrec(task, partial)
    assert f"table {t.name!r}" in str(e.value) and "data_parallel" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- 6. estimates say whose
def test_estimated_tables_name_the_model_and_say_they_are_estimates(capsys, tmp_path):
    code, stdout, err, out = run_in_process(capsys, tmp_path, pooled_task(), "algorithms=[size_greedy,neuroshard]",
                                            "evaluate=estimated")
    assert code == 0, err
    assert f"costs are ESTIMATES by the neural cost model ({SHIPPED}), not measurements" in stdout
    assert '"vs best" compares these estimates' in stdout
    assert "neuroshard searched against this same model, so its estimate favours it" in stdout
    assert "estimate (ms)" in stdout
    r = report(out)
    rescale = r["cost_model"].pop("rescale")  # how the checkpoint was put on this session's probe
    assert r["cost_model"] == {"name": "neural", "target": "embshard.costs.neural.NeuralCostModels.load",
                               "checkpoint": str(SHIPPED)}
    assert rescale is None or "applied" in rescale
    neuro = [x for x in r["results"] if x["algorithm"] == "neuroshard"][0]
    assert neuro["search_info"]["cost_model"] == "neural" and neuro["search_info"]["checkpoint"] == str(SHIPPED)


def test_analytic_estimates_are_named_as_such(capsys, tmp_path):
    code, stdout, err, out = run_in_process(capsys, tmp_path, pooled_task(), "algorithms=[size_greedy,neuroshard]",
                                            "evaluate=estimated", "cost_model=analytic")
    assert code == 0, err
    assert "costs are ESTIMATES by the analytic cost model, not measurements" in stdout
    assert "same model" not in stdout and report(out)["cost_model"]["name"] == "analytic"


def test_usage_no_longer_calls_the_default_estimate_analytic():
    assert "estimate only (analytic cost model)" not in (ROOT / "docs" / "usage.md").read_text()


# ----------------------------------------------------------------------------- 7. infeasibility hints
def test_whole_table_algorithms_cut_a_table_too_large_for_one_device(capsys, tmp_path):
    big = Table("user_id", 200_000, 64, 1.0)  # 51.2 MB of weights: fits no 40 MB device whole
    task = Task("split", 4, 40 * 10**6, 256, (big, *pooled_task().tables))
    assert task.table_memory_bytes(big) > task.device_memory_bytes
    code, stdout, err, out = run_in_process(capsys, tmp_path, task, "evaluate=none",
                                            "algorithms=[size_lookup_greedy,dreamshard,autoshard,neuroshard]")
    assert code == 0, err
    by = {r["algorithm"]: r for r in report(out)["results"]}
    for name in ("size_lookup_greedy", "dreamshard", "autoshard", "neuroshard"):
        assert by[name]["valid"], by[name]["error"]
        plan = Plan.load(out / "plans" / f"{name}.json")
        cut = [s for s in plan.shards if s.table == "user_id"]
        # TorchRec's way: equal column slices, each on its own device, every row in each
        assert len(cut) >= 2 and len({s.device for s in cut}) == len(cut) and all(s.rows == big.rows for s in cut)
        assert sorted(s.col_offset for s in cut) == list(range(0, big.dim, big.dim // len(cut)))
        assert max(plan.memory_bytes(task)) <= task.device_memory_bytes


def test_a_table_no_allowed_cut_fits_is_named_with_its_shortfall(capsys, tmp_path):
    # column slices may be no narrower than 64 and rows are not allowed: nothing fits a device
    big = Table("user_id", 200_000, 64, 1.0, sharding_types=("table_wise", "column_wise"), min_partition=64)
    task = Task("split", 4, 40 * 10**6, 256, (big, *pooled_task().tables))
    code, stdout, err, out = run_in_process(capsys, tmp_path, task, "evaluate=none",
                                            "algorithms=[size_lookup_greedy,dreamshard,autoshard]")
    assert code == 1, err  # every algorithm failed
    for r in report(out)["results"]:
        assert not r["valid"] and "'user_id'" in r["error"] and "short by" in r["error"], r
        assert r["error"].endswith("; 'user_id' fits no device whole and no cut its sharding_types allow fits one: "
                                   "allow column_wise with a smaller min_partition, or row_wise / table_row_wise"), r


def test_neuroshard_keeps_its_splitting_steps_out_of_info_logs(caplog):
    big = Table("user_id", 200_000, 64, 1.0)
    task = Task("split", 4, 40 * 10**6, 256, (big, *pooled_task().tables))
    with caplog.at_level(logging.INFO, logger="embshard.search.neuroshard"):
        NeuroShardSharder(checkpoint=None, verify=0, beam_steps=0).shard(task)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and "halving" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="embshard.search.neuroshard"):
        NeuroShardSharder(checkpoint=None, verify=0, beam_steps=0).shard(task)
    assert any("halving piece" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)


# ----------------------------------------------------------------------------- 8. --help
@pytest.mark.slow
def test_shard_help_is_a_short_usage_with_the_values(shard_help):
    from embshard.compare import EVALUATE_MODES

    text = shard_help
    lines = text.splitlines()
    assert len(lines) < 40 and lines[0].startswith("shard.py: ")
    assert any("task_file=PATH" in l for l in lines[:10])
    assert " | ".join(EVALUATE_MODES) in text
    for name in shard_cfg().searchers:
        assert name in text
    assert "now: [random,round_robin,size_greedy,dim_greedy,lookup_greedy,size_lookup_greedy,torchrec,neuroshard]" in text


@pytest.mark.slow
def test_train_help_is_a_short_usage_naming_every_stage():
    text = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True).stdout
    lines = text.splitlines()
    assert len(lines) < 40 and lines[0].startswith("train.py: ")
    stage_dir = ROOT / "conf" / "stage"
    if stage_dir.is_dir():
        stages = [p.stem for p in stage_dir.glob("*.yaml")]
    else:
        import train

        stages = list(train.STAGES)
    assert stages and all(f"  {s} " in text for s in stages)


# ----------------------------------------------------------------------------- 9. the table says it all
def test_evaluate_none_table_shows_pieces_memory_search_time_and_reasons(capsys, tmp_path):
    """Two tables, two devices, size_greedy puts one on each: the memory by hand is weights
    (rows x dim x 4) + output and its gradient (2 x batch x dim x 4)."""
    tables = (Table("a", 4096, 16, 1.0), Table("b", 1024, 8, 1.0))
    task = Task("hand", 2, 1 << 20, 128, tables)  # 1 MiB devices
    a_bytes, b_bytes = 4096 * 16 * 4 + 2 * 128 * 16 * 4, 1024 * 8 * 4 + 2 * 128 * 8 * 4  # 278528, 40960
    code, stdout, err, out = run_in_process(capsys, tmp_path, task, "algorithms=[size_greedy,data_parallel]", "evaluate=none")
    assert code == 0, err
    header = [l for l in stdout.splitlines() if l.startswith("algorithm ")][0]
    assert "pieces per device" in header and "memory per device (MiB of 1.00)" in header and "search (s)" in header
    cells = row(stdout, "size_greedy").split()
    assert cells[:3] == ["size_greedy", "valid", "1/1"]
    assert sorted(cells[3].split("/")) == sorted([f"{a_bytes / 2**20:.2f}", f"{b_bytes / 2**20:.2f}"])
    assert float(cells[4]) >= 0
    assert "INVALID  refused: data_parallel is meant for sequence tables" in row(stdout, "data_parallel")
    (r,) = [x for x in report(out)["results"] if x["algorithm"] == "size_greedy"]
    assert sorted(r["memory_bytes"]) == sorted([a_bytes, b_bytes]) and r["pieces"] == [1, 1]


def test_per_device_columns_summarise_many_devices():
    from embshard.report import per_device

    assert per_device([1, 2, 3], "{:d}") == "1/2/3"
    assert per_device(list(range(16)), "{:d}") == "0..15 over 16"


# ----------------------------------------------------------------------------- other fallbacks found
def test_refine_stops_when_neuroshard_planned_nothing_instead_of_scoring_the_heuristics(tmp_path):
    """The loop's convergence test is the models' error on the search's own shards; with none it
    used to score every algorithm's shards instead, silently."""
    from embshard.costs.refine import refine
    from embshard.data.tasks import user_tasks
    from embshard.errors import InfeasibleError
    from embshard.hardware.evaluator import HardwareEvaluator
    from embshard.hardware.protocol import load_protocol
    from embshard.search.baselines import GreedySharder
    from tests.test_neural import write_data

    write_data(tmp_path / "base", n_compute=20, n_comm=8)
    dist = dict(dims=[8], min_rows=500, max_rows=2_000, max_pooling=4.0, onehot_share=0.0, histogram_share=0.0)

    def make_tasks(r):
        return user_tasks(1, seed=r, min_tables=3, max_tables=3, num_devices=[2], batch_sizes=[256], **dist)

    def make_sharders(ckpt):
        return {"neuroshard": NeuroShardSharder(checkpoint=str(tmp_path / "missing.pt"), verify=0),
                "size_greedy": GreedySharder("size")}

    evaluator = HardwareEvaluator(comm_backend=None, protocol=load_protocol("quick"), seed=0)
    with pytest.raises(InfeasibleError, match="refine round 0: neuroshard found no valid plan on any task"):
        refine({"data_dir": str(tmp_path / "base"), "checkpoint": str(SHIPPED), "rounds": 1, "stop_ratio": 1.25},
               {}, make_tasks, make_sharders, evaluator, tmp_path / "out")
    assert not (tmp_path / "out" / "rounds" / "round0" / "metrics.json").exists()
