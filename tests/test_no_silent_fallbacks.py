"""Issue 17, verification: what the re-try and the audit still found (tests/test_honest_runs.py
holds one test per item of the issue). A misspelt command-line key or group option is one
line and exit 2, not Hydra's exit 1 with the advice to add the key with '+'; the torch backend
refuses a task it would time with the wrong optimizer update instead of warning and measuring
SGD; --help names every option of its groups; a task or plan file's error names the file."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from embshard import InputError, Plan, Table, Task
from embshard.cli import refuse_additions, refuse_unknown_keys

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ENV = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0")


def refused(capsys, argv: list[str], config: str = "shard") -> str:
    """The one stderr line `refuse_unknown_keys` exits 2 with."""
    with pytest.raises(SystemExit) as e:
        refuse_unknown_keys(argv, CONF, config, f"{config}.py")
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "+" not in line  # never Hydra's advice to add the key with '+'
    return line


# ----------------------------------------------------------------------------- command-line keys
@pytest.mark.parametrize("arg, message", [
    ("evalute=none", "error: evalute=none: 'evalute' is not a shard.py key (did you mean 'evaluate'?)"),
    ("searchers.neuroshard.checkpont=x.pt",
     "'searchers.neuroshard' has no key 'checkpont' (did you mean 'searchers.neuroshard.checkpoint'?)"),
    ("searchers.neuroshrd.checkpoint=x.pt", "'searchers' has no key 'neuroshrd' (did you mean 'searchers.neuroshard'?)"),
    ("measure.visitz=3", "'measure' has no key 'visitz' (did you mean 'measure.visits'?)"),
    ("hardware=torch_cpux", "hardware has no option 'torch_cpux' (did you mean hardware=torch_cpu?); options: dmp_cpu, "
                            "fbgemm_cpu, fbgemm_cuda, torch_cpu, torch_cuda"),
    ("measure=quik", "measure has no option 'quik' (did you mean measure=quick?)"),
    ("dataset=synthetic", "'dataset' is not a shard.py key"),  # train.py's group, not shard.py's
])
def test_unknown_shard_keys_and_group_options_are_one_line_errors(capsys, arg, message):
    line = refused(capsys, ["evaluate=none", arg] if arg != "evalute=none" else [arg])
    assert line.startswith(f"error: {arg}: ") and message in line


@pytest.mark.parametrize("arg, message", [
    ("data_dri=/tmp/x", "'data_dri' is not a train.py key (did you mean 'data_dir'?)"),
    ("rl=dreamshrd", "rl has no option 'dreamshrd' (did you mean rl=dreamshard?)"),
])
def test_unknown_train_keys_are_one_line_errors(capsys, arg, message):
    line = refused(capsys, ["stage=pretrain", arg], config="train")
    assert line.startswith(f"error: {arg}: ") and message in line


@pytest.mark.parametrize("config, argv", [
    ("shard", ["evaluate=none", "algorithm=torchrec", "hardware=torch_cpu", "measure=quick", "measure.visits=2",
               "searchers.neuroshard.checkpoint=null", "cost_model=analytic", "hydra.run.dir=.", "--help"]),
    # a group whose options set keys elsewhere (experiment: package _global_), then one of those keys
    ("train", ["stage=tasks", "experiment=e2e_tiny", "dlrm.steps=3", "+anything=1", "hardware=null"]),
])
def test_known_keys_and_options_pass(capsys, config, argv):
    refuse_unknown_keys(argv, CONF, config, f"{config}.py")
    assert capsys.readouterr().err == ""


def test_removing_a_shard_key_is_one_line_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as e:
        refuse_additions(["task_file=t.json", "~evaluate"], CONF, "shard", "shard.py")
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: ~evaluate: shard.py's keys cannot be removed; give evaluate a value "
                                       "instead; python shard.py --help lists them\n")


@pytest.mark.parametrize("config, arg, message", [
    # a key train.py has: Hydra would answer with a several-line error
    ("train", "+stage=tasks", "train.py takes its own keys without '+': write stage=tasks"),
    # a nested key: written without '+', refuse_unknown_keys then judges the key itself
    ("train", "+dlrm.steps=3", "write dlrm.steps=3"),
    # a key it does not have: Hydra would add it and nothing would read it
    ("train", "+data_dri=/tmp/x", "'data_dri' is not a train.py key (did you mean 'data_dir'?)"),
    # a planner added under a new name (+search@searchers.NAME=planner) is allowed; these are not
    ("shard", "+search@searchers.dreamshard=autoshard", "searchers.dreamshard exists; set its keys instead"),
    ("shard", "+search@searchers.ds_old=dreamshrd", "no planner 'dreamshrd' (did you mean 'dreamshard'?)"),
    ("shard", "+search@searchers.a.b=dreamshard", "write +search@searchers.<new name>=<planner>"),
])
def test_plus_overrides_are_refused_in_one_line(capsys, config, arg, message):
    first = "stage=synthetic" if config == "train" else "task_file=t.json"
    with pytest.raises(SystemExit) as e:
        refuse_additions([first, arg], CONF, config, f"{config}.py")
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {arg}: ") and message in line


@pytest.mark.slow
@pytest.mark.parametrize("script, args, message", [
    ("shard.py", ["evalute=none"], "error: evalute=none: 'evalute' is not a shard.py key (did you mean 'evaluate'?)"),
    ("train.py", ["stage=pretrain", "data_dri=/tmp/x"], "error: data_dri=/tmp/x: 'data_dri' is not a train.py key"),
])
def test_entry_points_exit_2_on_a_misspelt_key_and_write_nothing(tmp_path, script, args, message):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / script), *args, f"out_dir={out}"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""  # Hydra's own answer: exit 1, "use +evalute=none"
    (line,) = proc.stderr.splitlines()
    assert line.startswith(message)
    assert not out.exists() and list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- torch backend, other optimizers
def adam_task(optimizer: str = "adam") -> Task:
    return Task("small_adam", 2, 1 << 30, 64, (Table("a", 100, 8, 1.0), Table("b", 200, 4, 2.0)), optimizer=optimizer)


def _measure_refused(refused_in_process, tmp_path, task: Task, *overrides: str) -> list[str]:
    """shard.py measuring `task` (size_greedy, quick protocol) in this process: asserts it exits
    2 and writes nothing; its stderr lines."""
    task.save(tmp_path / "task.json")
    code, err = refused_in_process(f"task_file={tmp_path / 'task.json'}", f"out_dir={tmp_path / 'out'}",
                                   "algorithm=size_greedy", "evaluate=measured", "measure=quick", "progress=false",
                                   *overrides, entry="shard")
    assert code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task.json"]
    return err


def test_shard_py_refuses_to_measure_an_adam_task_on_the_torch_backend(refused_in_process, tmp_path):
    """Before: a UserWarning among the progress bars, SGD timed, the cost reported as the task's, exit 0."""
    err = _measure_refused(refused_in_process, tmp_path, adam_task(), "hardware=torch_cpu")
    assert err == ["error: the torch backend times an SGD update only and task 'small_adam' uses optimizer 'adam': "
                   "measure it with backend fbgemm (hardware=fbgemm_cpu or fbgemm_cuda)"]


def test_torch_kernels_time_sgd_tasks_and_refuse_others():
    from embshard.hardware.backends import ShardInput, make_kernel
    from embshard.hardware.evaluator import HardwareEvaluator
    from embshard.plan import Shard

    task = adam_task("rowwise_adagrad")
    shards = [ShardInput(task.tables[0], Shard("a", 0, 0, 8, 0, 100))]
    with pytest.raises(InputError, match="times an SGD update only .* optimizer 'rowwise_adagrad'"):
        make_kernel("torch", shards, 64, optimizer="rowwise_adagrad")
    with pytest.raises(InputError, match="task 'small_adam' uses optimizer 'rowwise_adagrad'"):
        HardwareEvaluator(backend="torch", comm_backend=None).check_task(task)
    make_kernel("torch", shards, 64, optimizer="sgd")
    HardwareEvaluator(backend="torch", comm_backend=None).check_task(adam_task("sgd"))
    HardwareEvaluator(backend="fbgemm", comm_backend=None).check_task(task)


def test_fbgemm_cpu_kernels_refuse_adam_in_one_line_before_measuring(refused_in_process, tmp_path):
    """Before: FBGEMM's AssertionError ("Optimizer adam is not supported in CPU mode") and its
    traceback after the planners had run; now exit 2, one line, nothing written."""
    from embshard.hardware.backends import ShardInput, make_kernel
    from embshard.hardware.evaluator import HardwareEvaluator
    from embshard.plan import Shard

    err = _measure_refused(refused_in_process, tmp_path, adam_task(), "hardware=fbgemm_cpu")
    assert len(err) == 1
    assert err[0].startswith("error: FBGEMM's CPU kernel has no fused 'adam' update and task 'small_adam' uses it: ")
    shards = [ShardInput(adam_task().tables[0], Shard("a", 0, 0, 8, 0, 100))]
    with pytest.raises(InputError, match="no fused 'adam' update"):
        make_kernel("fbgemm", shards, 64, optimizer="adam")
    with pytest.raises(InputError, match="no fused 'adam' update"):
        HardwareEvaluator(backend="torch", comm_backend="gloo", step="dmp").check_task(adam_task())
    for optimizer in ("sgd", "rowwise_adagrad", "adagrad"):  # the updates it has
        HardwareEvaluator(backend="fbgemm", comm_backend=None).check_task(adam_task(optimizer))
        make_kernel("fbgemm", shards, 64, optimizer=optimizer)


def test_measuring_refuses_in_one_line_what_this_machine_cannot_allocate(monkeypatch, refused_in_process, tmp_path):
    """Before: FBGEMM's RuntimeError traceback ("can't allocate memory: you tried to allocate
    73499892800 bytes") after the planners had run, for a user's task of real-size tables."""
    from embshard.hardware import evaluator as ev
    from embshard.plan import Plan, Shard

    task = Task("big", 2, 1 << 30, 64, (Table("a", 100_000, 64, 1.0), Table("b", 100, 8, 1.0)))
    a = task.table_memory_bytes(task.tables[0])  # 25.6 MB of weights, 32 KB of outputs and gradients
    share = -(-(a + task.table_memory_bytes(task.tables[1])) // 2)
    monkeypatch.setattr(ev, "memory_free_bytes", lambda device: share - 1)
    with pytest.raises(InputError, match=rf"^measuring task 'big' allocates at least {share} bytes for one device "
                                         rf"\(its tables' training memory over 2 devices\) and this machine has {share - 1} "
                                         r"bytes free on cpu: plan it without measuring \(evaluate=estimated\)"):
        ev.HardwareEvaluator(comm_backend=None).check_task(task)
    err = _measure_refused(refused_in_process, tmp_path, task)
    assert len(err) == 1 and err[0].startswith("error: measuring task 'big' allocates at least")
    # the even share fits, the plan's fuller device does not: refused before anything is measured
    monkeypatch.setattr(ev, "memory_free_bytes", lambda device: a - 1)
    hw = ev.HardwareEvaluator(comm_backend=None)
    hw.check_task(task)
    plan = Plan("big", "mine", [Shard("a", 0, 0, 64, 0, 100_000), Shard("b", 1, 0, 8, 0, 100)])
    monkeypatch.setattr(ev, "measure_compute", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(InputError, match=rf"^plan 'mine' of task 'big' puts {a} bytes on device 0 and this machine "
                                         rf"has {a - 1} bytes free on cpu to measure it"):
        hw.measure_many(task, [plan])
    monkeypatch.setattr(ev, "memory_free_bytes", lambda device: None)  # unreadable: no check
    hw.check_task(task)
    hw.check_fits(task, [plan])


@pytest.mark.parametrize("over, message", [
    ({"backend": "torch", "optimizer": "adam"}, "torch backend times an SGD update only"),
    ({"backend": "fbgemm", "optimizer": "adam"}, "CPU kernel has no fused 'adam' update"),
    ({"optimizer": "adamw"}, "collect.optimizer must be one of"),  # was a KeyError at the first kernel
])
def test_collect_refuses_an_optimizer_it_cannot_time_before_measuring(over, message):
    from embshard.costs.collect.config import resolve_config

    with pytest.raises(InputError, match=message):
        resolve_config(over)
    resolve_config({"backend": "torch", "optimizer": "sgd"})


# ----------------------------------------------------------------------------- --help
@pytest.mark.slow
def test_shard_help_names_every_option_of_its_groups(shard_help):
    text = shard_help
    for group in ("cost_model", "hardware", "measure"):
        (line,) = [l for l in text.splitlines() if l.strip().startswith(f"{group}=")]
        listed = set(line.split()[0].split("=", 1)[1].split("|"))
        assert listed == {p.stem for p in (CONF / group).glob("*.yaml")}, group


# ----------------------------------------------------------------------------- which file
TASK = {"name": "x", "num_devices": 2, "device_memory_bytes": 1 << 30, "batch_size": 64,
        "tables": [{"name": "a", "rows": 100, "dim": 4, "pooling_factor": 1.0}]}


@pytest.mark.parametrize("change, message", [
    (lambda d: d["tables"][0].update(pooling=2.0), "table 'a': unknown field 'pooling' (did you mean 'pooling_factor'?)"),
    (lambda d: d["tables"][0].update(rows=-3), "table 'a': rows"),
    (lambda d: d.update(num_devices=0), "task 'x': num_devices must be a positive integer"),
    (lambda d: d.update(optimiser="adam"), "task 'x': unknown field 'optimiser' (did you mean 'optimizer'?)"),
])
def test_task_file_errors_name_the_file_once(tmp_path, change, message):
    d = json.loads(json.dumps(TASK))
    change(d)
    path = tmp_path / "task.json"
    path.write_text(json.dumps(d))
    with pytest.raises(InputError) as e:
        Task.load(path)
    assert str(e.value).startswith(f"{path}: ") and str(e.value).count(str(path)) == 1
    assert message in str(e.value) and "\n" not in str(e.value)


def test_plan_file_shard_errors_name_the_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"task": "x", "algorithm": "mine", "shards": [
        {"table": "a", "device": 0, "col_offset": 0, "dim": 4, "row_offset": 0, "rows": 100, "replika": 1}]}))
    with pytest.raises(InputError) as e:
        Plan.load(path)
    assert str(e.value).startswith(f"{path}: shard of table 'a': unknown field 'replika' (did you mean 'replica'?)")


def test_did_you_mean_prefers_the_key_the_typo_begins():
    from embshard.errors import nearest_name

    keys = ["bytes_per_element", "dim", "num_poolings", "pooling_factor", "rows"]
    # a truncated key means the one it begins; difflib alone would pick num_poolings (ratio 0.74 vs 0.67)
    assert nearest_name("pooling", keys) == "pooling_factor"
    assert nearest_name("dims", keys) == "dim"  # the key the typo extends
    assert nearest_name("rowz", keys) == "rows"  # no prefix: difflib's closest
    assert nearest_name("zzz", keys) is None


def test_a_planner_added_under_a_new_name_passes_and_its_keys_are_known(capsys):
    argv = ["task_file=t.json", "algorithms=[dreamshard,ds_old]", "+search@searchers.ds_old=dreamshard",
            "searchers.ds_old.checkpoint=old.pt", "searchers.ds_old.name=ds_old"]
    refuse_additions(argv, CONF, "shard", "shard.py")
    refuse_unknown_keys(argv, CONF, "shard", "shard.py")
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):  # without the addition, the new name's keys are unknown
        refuse_unknown_keys([a for a in argv if not a.startswith("+")], CONF, "shard", "shard.py")
    assert "'searchers' has no key 'ds_old'" in capsys.readouterr().err



def test_measured_fuzzing_shrinks_tasks_to_what_this_machine_can_measure():
    """scripts/fuzz_planners.py measured: every fuzzed task, shrunk, stays a valid task within the
    limits it promises (8 devices, 120 tables, batch 8,192, 512 MiB of tables) that some plan fits."""
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("fuzz_planners", ROOT / "scripts" / "fuzz_planners.py")
    fz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fz)
    shrunk = 0
    for i, td in fz.tasks(2, 40):
        small = fz.measurable(td, random.Random(f"2-{i}"))
        assert small == fz.measurable(td, random.Random(f"2-{i}"))  # the same task every time
        task = Task.from_dict(small)
        assert task.num_devices <= 8 and len(task.tables) <= 120 and task.batch_size <= 8192
        assert task.optimizer == (td["optimizer"] if td["optimizer"] != "adam" else "rowwise_adagrad")
        assert task.tables_memory_bytes() <= 1 << 29
        assert max(task.table_memory_bytes(t) for t in task.tables) <= task.device_memory_bytes
        assert task.tables_memory_bytes() <= task.num_devices * task.device_memory_bytes
        shrunk += small["tables"] != td["tables"]
    assert shrunk > 0  # the draws include tasks too big to measure here


def test_torchrec_fuzzing_draws_the_same_modules_and_flags_a_plan_that_drops_a_table(monkeypatch):
    """scripts/fuzz_planners.py torchrec: a seed draws the same TorchRec modules every time; a module
    planned through EmbShardPlanner is ok (or a one-line refusal), and a ShardingPlan with a table
    left out is a defect (INVALID), not ok."""
    import importlib.util
    import random

    import embshard

    spec = importlib.util.spec_from_file_location("fuzz_planners", ROOT / "scripts" / "fuzz_planners.py")
    fz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fz)

    def names(module):
        return [n for n, _ in module.named_parameters()]

    a, b = fz.draw_module(random.Random(5)), fz.draw_module(random.Random(5))
    assert a[4] == b[4] and names(a[0]) == names(b[0]) and set(a[1]) == set(b[1])
    module, cons, topo, batch, desc = fz.draw_module(random.Random(7))
    assert desc == "37 tables, 3 cuda ranks (1 per host), batch 7 per rank, 9 constrained"
    rec = fz.plan_module(module, cons, topo, batch, "size_lookup_greedy", 60)
    assert rec["kind"] == "ok", rec
    real = embshard.EmbShardPlanner.to_torchrec

    def drop_one(self, task, plan, collections):
        sp = real(self, task, plan, collections)
        per = next(iter(sp.plan.values()))
        per.pop(next(iter(per)))
        return sp

    monkeypatch.setattr(embshard.EmbShardPlanner, "to_torchrec", drop_one)
    rec = fz.plan_module(module, cons, topo, batch, "size_lookup_greedy", 60)
    assert rec["kind"] == "INVALID" and "missing from the ShardingPlan" in rec["message"]


def test_fuzz_compare_tells_the_same_plans_from_other_plans_and_changed_outcomes(tmp_path, capsys):
    """scripts/fuzz_planners.py compare: per algorithm, same plans counted by the plan digests
    `run` records (a real plan's digest changes when one shard moves), an outcome that changed
    named, and --strict exits 1 on any difference."""
    import importlib.util

    import embshard

    spec = importlib.util.spec_from_file_location("fuzz_planners", ROOT / "scripts" / "fuzz_planners.py")
    fz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fz)
    task = Task.from_dict(next(td for _, td in fz.tasks(3, 6) if 1 < len(td["tables"]) < 100 and td["num_devices"] > 1
                               and not any(t.get("kind") for t in td["tables"])) | {"device_memory_bytes": 1 << 50})
    plan = embshard.plan(task, algorithm="size_lookup_greedy")
    moved = embshard.Plan(plan.task, plan.algorithm, [dataclasses.replace(plan.shards[0], device=(plan.shards[0].device + 1) % task.num_devices)] + plan.shards[1:])
    digest, other = fz.plan_signature(plan), fz.plan_signature(moved)
    assert digest == fz.plan_signature(embshard.plan(task, algorithm="size_lookup_greedy")) and digest != other

    def rec(name, alg, kind, sig=None, seconds=1.0):
        return {"task": name, "algorithm": alg, "kind": kind, "seconds": seconds} | ({"plan": sig} if sig else {})

    old = [rec("a", "x", "ok", digest), rec("b", "x", "ok", digest), rec("c", "x", "ok", digest, 2.0), rec("a", "y", "refused")]
    new = [rec("a", "x", "ok", digest, 0.5), rec("b", "x", "ok", other), rec("c", "x", "CRASH"), rec("a", "y", "refused")]
    for name, recs in (("old", old), ("new", new)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = [str(tmp_path / "old.jsonl"), str(tmp_path / "new.jsonl")]
    assert fz.main(["compare", *args]) == 0
    out = capsys.readouterr().out
    assert "x                    3 tasks: same plan 1 of 3 planned" in out
    assert "c: ok -> CRASH" in out and "other plan: b" in out
    assert "y                    1 tasks: same plan 0 of 0 planned" in out
    assert fz.main(["compare", *args, "--strict"]) == 1
    (tmp_path / "new.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    assert fz.main(["compare", args[0], args[0], "--strict"]) == 0


def test_dmp_step_refuses_a_batch_its_ranks_do_not_share_evenly_before_planning(refused_in_process, tmp_path):
    """Before: a rank without a sample raised inside its worker ("batch_size must be a positive
    integer, got 0"; fuzzed: batch 1 on 8 ranks), and batch 4096 on 5 ranks failed in a row_wise
    table's backward all-gather (820 against 819 samples); shard.py ended in a RuntimeError
    traceback both times. TorchRec trains every rank on the same local batch."""
    from embshard.hardware.evaluator import HardwareEvaluator

    task = Task("tiny_batch", 4, 1 << 28, 3, (Table("a", 100, 8, 2.0), Table("b", 50, 8, 1.0)))
    err = _measure_refused(refused_in_process, tmp_path, task, "hardware=dmp_cpu")
    assert err == ["error: task 'tiny_batch': TorchRec's DMP step gives every rank the same local batch, and batch 3 "
                   "does not split evenly over 4 ranks: give a multiple of 4 (e.g. 4), or measure the kernels "
                   "(hardware=fbgemm_cpu)"]
    dmp = HardwareEvaluator(backend="torch", comm_backend="gloo", step="dmp")
    with pytest.raises(InputError, match=r"batch 4096 does not split evenly over 5 ranks: give a multiple of 5 \(e.g. 4095\)"):
        dmp.check_task(Task("five", 5, 1 << 28, 4096, task.tables))
    dmp.check_task(Task("even", 4, 1 << 28, 4, task.tables))  # one sample a rank: measured
    HardwareEvaluator(comm_backend=None).check_task(task)  # the kernel measurement times uneven and empty shares


def test_dmp_step_refuses_a_row_wise_table_with_fewer_rows_than_ranks_before_planning(refused_in_process, tmp_path):
    """Before: TorchRec's row blocks of a 1-row table over 4 ranks left 3 ranks an empty block, the
    CPU kernel raised "weights[0] must be a GPU or MTIA tensor" in those ranks, and (the rank
    that failed skipping no barrier) the others waited until the timeout (fuzzed, hardware=dmp_cpu)."""
    from embshard.hardware.evaluator import HardwareEvaluator

    one_row = Table("one", 1, 96, 0.05, sharding_types=["row_wise", "data_parallel"])
    task = Task("rows", 4, 1 << 28, 64, (one_row, Table("b", 50, 8, 1.0)))
    err = _measure_refused(refused_in_process, tmp_path, task, "hardware=dmp_cpu")
    assert err == ["error: task 'rows': table 'one' (1 row) may only be row_wise (its sharding_types), and TorchRec's row "
                   "blocks over 4 ranks leave some rank an empty block, which its CPU kernels cannot run in DMP's step: "
                   "measure the kernels (hardware=fbgemm_cpu)"]
    HardwareEvaluator(comm_backend=None).check_task(task)  # the kernels time the one block on its rank
    dmp = HardwareEvaluator(backend="torch", comm_backend="gloo", step="dmp")
    dmp.check_task(Task("four", 4, 1 << 28, 64, (dataclasses.replace(one_row, rows=4), task.tables[1])))  # 1 row a rank
    hosts = Task("hosts", 4, 1 << 28, 64, (dataclasses.replace(one_row, rows=3, sharding_types=["table_row_wise"]),),
                 devices_per_host=2)
    with pytest.raises(InputError, match=r"table 'one' \(1 row\) may only be table_row_wise .* over 2 ranks"):
        dmp.check_task(dataclasses.replace(hosts, tables=(dataclasses.replace(hosts.tables[0], rows=1),)))
    dmp.check_task(hosts)  # 3 rows over a host's 2 ranks: blocks of 2 and 1
