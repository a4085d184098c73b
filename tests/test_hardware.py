"""Ground-truth measurement: backends, timing, all-to-all between processes, evaluator, analytic model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from embshard.costs.analytic import AnalyticCostModel
from embshard.costs.base import DeviceCosts
from embshard.errors import InputError, PlanError
from embshard.hardware import compute as compute_mod
from embshard.hardware.backends import ShardInput, available_backends, make_kernel, shard_batch
from embshard.hardware.comm import CommConfig, batch_split, measure_comm
from embshard.hardware.compute import measure_compute
from embshard.hardware.evaluator import HardwareEvaluator
from embshard.hardware.protocol import MeasurementProtocol, Timing
from embshard.plan import Plan, Shard
from embshard.tables import Table
from embshard.task import Task

#: Every backend, available here or not: one that cannot be imported is a skip with the reason,
#: never a case that silently vanishes from the run.
BACKENDS = ["fbgemm", "torch"]


def fbgemm_import_error() -> str | None:
    try:
        import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
    except Exception as e:  # ImportError, or an OSError from a mismatched native build
        return f"{type(e).__name__}: {e}"
    return None


def need_backend(backend: str) -> None:
    """Skip (with the import error) when `backend` cannot run here."""
    if backend == "fbgemm":
        error = fbgemm_import_error()
        if error is not None:
            pytest.skip(f"fbgemm_gpu cannot be imported here ({error})")


def make_task(n_tables=4, devices=2, rows=2000, dim=16, pooling=5.0, batch=256) -> Task:
    tables = tuple(Table(f"t{i}", rows, dim, pooling) for i in range(n_tables))
    return Task("hw", devices, 1 << 30, batch, tables)


def round_robin(task: Task, name="rr") -> Plan:
    return Plan(task.name, name, [Shard.whole(t, i % task.num_devices) for i, t in enumerate(task.tables)])


def all_on(task: Task, device: int, name="lopsided") -> Plan:
    """Every table on `device` but the last, which goes to the next device."""
    n = len(task.tables)
    return Plan(task.name, name, [
        Shard.whole(t, device if i < n - 1 else (device + 1) % task.num_devices) for i, t in enumerate(task.tables)
    ])


def finite_positive(xs):
    return all(math.isfinite(x) and x > 0 for x in xs)


# ---------------------------------------------------------------------------- timing
def test_timing_median_and_iqr():
    t = Timing.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert t.median_ms == 3.0
    assert t.spread_ms == pytest.approx(2.0)  # q3 4 - q1 2
    assert Timing.of([]).median_ms == 0.0


def proto(warmups: int = 1, repetitions: int = 2, visits: int = 1, **kw) -> MeasurementProtocol:
    """A short protocol for tests (no probe)."""
    return MeasurementProtocol(warmups=warmups, repetitions=repetitions, visits=visits, comm_warmups=1,
                               comm_repetitions=kw.pop("comm_repetitions", repetitions), probe=False, **kw)


def test_batch_split():
    assert batch_split(10, 3) == [4, 3, 3]


# ---------------------------------------------------------------------------- backends
def test_available_backends_are_the_importable_ones():
    # torch needs nothing beyond torch; fbgemm is listed exactly when its op imports
    assert available_backends() == (["fbgemm"] if fbgemm_import_error() is None else []) + ["torch"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_step_is_one_sgd_update_by_hand(backend):
    """One step: pooled sums, the output gradient 1e-3 everywhere, SGD at lr 0.01. A row looked
    up k times in the batch moves by -0.01 x k x 1e-3 in every column; other rows stay at 0.01."""
    need_backend(backend)
    from embshard.hardware.backends import LEARNING_RATE

    assert LEARNING_RATE == 0.01
    t = Table("a", 50, 8, 3.0)
    k = make_kernel(backend, [ShardInput(t, Shard.whole(t, 0))], 16)
    rng = np.random.default_rng(0)
    indices, _ = shard_batch([ShardInput(t, Shard.whole(t, 0))], 16, np.random.default_rng(0)).per_shard[0]
    batch = k.make_batch(rng)  # the same draws: one table, one shard
    counts = np.bincount(indices.numpy(), minlength=50)
    assert counts.sum() > 0 and (counts == 0).any()
    k.step(batch)
    after = (k.op.split_embedding_weights()[0] if backend == "fbgemm" else k.groups[0][2]).detach().numpy()
    expected = 0.01 - 0.01 * 1e-3 * counts[:, None] * np.ones((1, 8))
    np.testing.assert_allclose(after, expected, rtol=0, atol=1e-7)


def test_row_shards_see_only_their_lookups():
    t = Table("a", 1000, 8, 6.0)
    lo = ShardInput(t, Shard("a", 0, 0, 8, 0, 400))
    hi = ShardInput(t, Shard("a", 0, 0, 8, 400, 600))
    whole = ShardInput(t, Shard("a", 0, 0, 8, 0, 1000))
    b = shard_batch([whole, lo, hi], 128, np.random.default_rng(0))
    (wi, wo), (li, lo_off), (hi_i, hi_off) = b.per_shard
    assert li.numel() + hi_i.numel() == wi.numel() > 0
    assert int(li.max()) < 400 and int(hi_i.max()) < 600 and int(li.min()) >= 0 and int(hi_i.min()) >= 0
    assert lo_off.numel() == hi_off.numel() == 129
    assert int(lo_off[-1]) == li.numel() and int(hi_off[-1]) == hi_i.numel()
    # per bag, the two row shards' lookups add up to the table's
    assert torch.equal((lo_off[1:] - lo_off[:-1]) + (hi_off[1:] - hi_off[:-1]), wo[1:] - wo[:-1])
    # the high shard's indices are the table's indices in [400, 1000), shifted to 0
    assert sorted((hi_i + 400).tolist()) == sorted(wi[wi >= 400].tolist())


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_step_updates_weights(backend):
    need_backend(backend)
    t = Table("a", 500, 8, 4.0)
    k = make_kernel(backend, [ShardInput(t, Shard.whole(t, 0))], 32)
    if backend == "fbgemm":
        before = k.op.split_embedding_weights()[0].clone()
        k.step(k.make_batch(np.random.default_rng(0)))
        after = k.op.split_embedding_weights()[0]
    else:
        before = k.groups[0][2].detach().clone()
        k.step(k.make_batch(np.random.default_rng(0)))
        after = k.groups[0][2].detach()
    assert not torch.equal(before, after), "the fused/sparse update did not change the weights"


def test_unknown_backend_is_an_input_error():
    with pytest.raises(InputError):
        HardwareEvaluator(backend="tpu")


# ---------------------------------------------------------------------------- compute via the evaluator
@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_two_device_plan_has_positive_finite_costs(backend):
    need_backend(backend)
    task = make_task()
    # column shards, row shards, and two shards of one table on the same device
    shards = [
        Shard("t0", 0, 0, 8, 0, 2000), Shard("t0", 0, 8, 8, 0, 2000),
        Shard("t1", 0, 0, 16, 0, 500), Shard("t1", 1, 0, 16, 500, 1500),
        Shard.whole(task.tables[2], 1), Shard.whole(task.tables[3], 1),
    ]
    ev = HardwareEvaluator(backend=backend, comm_backend=None, protocol=proto(1, 3))
    c = ev.device_costs(task, Plan(task.name, "mixed", shards))
    assert isinstance(c, DeviceCosts)
    assert len(c.compute_ms) == 2 and finite_positive(c.compute_ms)
    assert len(c.compute_spread_ms) == 2 and all(math.isfinite(x) and x >= 0 for x in c.compute_spread_ms)
    assert c.forward_comm_ms == [0.0, 0.0] and c.backward_comm_ms == [0.0, 0.0]
    assert math.isfinite(c.plan_cost_ms) and c.plan_cost_ms == max(c.compute_ms)
    assert c.plan_cost_spread_ms is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_with_twenty_tables_costs_more_than_one_with_one(backend):
    need_backend(backend)
    task = make_task(n_tables=21, rows=20000, dim=32, pooling=20.0, batch=512)
    ev = HardwareEvaluator(backend=backend, comm_backend=None, protocol=proto(2, 5))
    c = ev.device_costs(task, all_on(task, 0))  # 20 tables on device 0, 1 on device 1
    assert c.compute_ms[0] > 3 * c.compute_ms[1], c.compute_ms


def test_empty_device_costs_zero_compute():
    task = make_task(n_tables=2, devices=3)
    c = HardwareEvaluator(backend="torch", comm_backend=None, protocol=proto(0, 2)).device_costs(
        task, round_robin(task))
    assert c.compute_ms[2] == 0.0 and c.compute_ms[0] > 0


def test_measure_many_interleaves_plans(monkeypatch):
    """Rounds visit A's devices then B's, then A's again: A B A B, not A A B B; by default the
    evaluator builds every kernel again at every visit (each plan timed in the same state)."""
    visits = []
    real = compute_mod.make_kernel

    def spy(backend, shards, *a, **k):
        visits.append(tuple(sorted(s.table.name for s in shards)))
        return real(backend, shards, *a, **k)

    monkeypatch.setattr(compute_mod, "make_kernel", spy)
    task = make_task(n_tables=4)
    a, b = round_robin(task, "a"), all_on(task, 0, "b")
    ev = HardwareEvaluator(backend="torch", comm_backend=None, protocol=proto(0, 2, visits=2))
    assert ev.max_cached_bytes == 0
    out = ev.measure_many(task, [a, b])
    assert len(out) == 2 and all(isinstance(c, DeviceCosts) for c in out)
    a0, a1, b0, b1 = ("t0", "t2"), ("t1", "t3"), ("t0", "t1", "t2"), ("t3",)
    # every visit rebuilds, in A B order...
    assert visits == [a0, a1, b0, b1] * 2
    visits.clear()
    # ...and where kernels may be kept between visits, only the first visit builds them
    HardwareEvaluator(backend="torch", comm_backend=None, protocol=proto(0, 2, visits=2),
                      max_cached_bytes=1 << 30).measure_many(task, [a, b])
    assert visits == [a0, a1, b0, b1]
    visits.clear()
    sets = [[ShardInput(task.table(n), Shard.whole(task.table(n), 0)) for n in s] for s in (a0, b0)]
    measure_compute(sets, 64, backend="torch", protocol=proto(0, 1, visits=2), max_cached_bytes=0)
    assert visits == [a0, b0, a0, b0]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2GiB"])
def test_evaluator_kernel_cache_setting_is_checked(bad):
    with pytest.raises(InputError, match=r"^hardware.max_cached_bytes must be an integer >= 0, got "):
        HardwareEvaluator(backend="torch", comm_backend=None, max_cached_bytes=bad)


def test_bad_plan_is_a_plan_error():
    task = make_task()
    with pytest.raises(PlanError):
        HardwareEvaluator(backend="torch", comm_backend=None).device_costs(
            task, Plan(task.name, "x", [Shard("nope", 0, 0, 16, 0, 10)]))


# ---------------------------------------------------------------------------- communication
def test_one_rank_has_zero_comm_without_spawning():
    [r] = measure_comm([([64], [0.0])], batch_size=1024, protocol=proto(1, 3))
    assert r.forward_ms == [0.0] and r.backward_ms == [0.0]
    task = make_task(devices=1)
    c = HardwareEvaluator(backend="torch", comm_backend="gloo", protocol=proto(0, 2)).device_costs(
        task, round_robin(task))
    assert c.forward_comm_ms == [0.0] and c.backward_comm_ms == [0.0] and c.compute_ms[0] > 0


def test_comm_config_validates():
    with pytest.raises(ValueError):
        CommConfig.make([8, 8], [0.0])
    with pytest.raises(ValueError):
        CommConfig.make([8, -1])
    with pytest.raises(ValueError, match="allreduce_floats"):
        CommConfig.make([8, 8], [0.0, 0.0], -1)
    assert CommConfig.make([8, 8]).allreduce_floats == 0


@pytest.mark.slow
def test_data_parallel_gradient_all_reduce_is_timed_with_the_backward_all_to_all():
    """4M fp32 gradient values (16 MB) all-reduced over 2 loopback ranks take milliseconds more
    than the same all-to-all without them; the forward all-to-all is not charged for them."""
    plain, dp = measure_comm([CommConfig.make([8, 8]), CommConfig.make([8, 8], None, 4_000_000)],
                             batch_size=256, protocol=proto(1, 3), keep=False)
    assert min(dp.backward_ms) > max(plain.backward_ms) + 1.0, (plain.backward_ms, dp.backward_ms)
    assert max(dp.forward_ms) < min(dp.backward_ms), (dp.forward_ms, dp.backward_ms)


@pytest.mark.slow
def test_kept_comm_ranks_serve_call_after_call_and_are_replaced_or_closed_not_piled_up():
    from embshard.hardware.comm import KeptRanks, close_kept

    close_kept()
    try:
        first = measure_comm([([8, 64], [0.0, 0.0])], batch_size=256, protocol=proto(1, 2))
        group = KeptRanks._current
        assert group is not None and group.group.alive()
        pids = [p.pid for p in group.group.procs]
        again, other = measure_comm([([8, 64], [0.0, 0.0]), ([64, 8], [0.0, 0.0])], batch_size=256, protocol=proto(1, 2))
        assert KeptRanks._current is group and [p.pid for p in group.group.procs] == pids  # no new spawn
        for r in (*first, again, other):
            assert finite_positive(r.forward_ms) and finite_positive(r.backward_ms) and len(r.forward_samples_ms[0]) == 2
        # another backend (or protocol, or ranks): the old ranks stopped first (one kept group at
        # most); and a group whose job failed is closed, never reused
        with pytest.raises(RuntimeError, match="rank"):
            measure_comm([([8, 8], [0.0, 0.0])], batch_size=64, protocol=proto(1, 1), backend="no-such-backend",
                         timeout_s=60, keep=True)
        assert not any(p.is_alive() for p in group.group.procs) and KeptRanks._current is None
    finally:
        close_kept()


@pytest.mark.slow
def test_kept_comm_ranks_exit_when_their_parent_is_killed(tmp_path):
    """A parent killed without closing its kept ranks (no atexit) leaves no rank waiting for work."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys\n"
        "from embshard.hardware.comm import KeptRanks, measure_comm\n"
        "from embshard.hardware.protocol import MeasurementProtocol\n"
        "if __name__ == '__main__':\n"
        "    measure_comm([([8, 8], [0.0, 0.0])], 64, MeasurementProtocol(comm_warmups=0, comm_repetitions=1))\n"
        "    print(' '.join(str(p.pid) for p in KeptRanks._current.group.procs), flush=True)\n"
        "    sys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(Path(f"/proc/{p}").exists() for p in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and
                                                  "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
                                                  for p in pids):
            time.sleep(0.5)
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]
        assert not alive, f"ranks {alive} outlived their killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.slow
def test_all_to_all_between_two_processes_includes_waiting_for_the_slow_rank():
    # the protocol of test_measure_many_with_comm_includes_compute_imbalance: in one pytest process
    # the second of the two finds these ranks kept up (embshard.hardware.comm.KeptRanks), not spawned again
    delayed, plain, wide = measure_comm(
        [([64, 64], [0.0, 50.0]), ([64, 64], [0.0, 0.0]), ([512, 64], [0.0, 0.0])],
        batch_size=2048, protocol=proto(1, 4),
    )
    for r in (delayed, plain, wide):
        assert len(r.forward_ms) == len(r.backward_ms) == 2
        assert finite_positive(r.forward_ms) and finite_positive(r.backward_ms)
        assert len(r.forward_spread_ms) == 2 and len(r.forward_samples_ms[0]) == 4
    # rank 1 waits 50 ms before entering: rank 0, already in the all-to-all, waits for it
    assert delayed.forward_ms[0] >= 40.0, delayed.forward_ms
    # the delayed rank itself does not wait, and with no delay nobody waits that long
    assert delayed.forward_ms[1] < 25.0, delayed.forward_ms
    assert max(plain.forward_ms) < 25.0, plain.forward_ms


@pytest.mark.slow
def test_comm_worker_errors_propagate_instead_of_hanging():
    with pytest.raises(RuntimeError, match="rank"):
        measure_comm([([8, 8], [0.0, 0.0])], batch_size=64, protocol=proto(1, 1), backend="no-such-backend",
                     timeout_s=60)


@pytest.mark.slow
def test_measure_many_with_comm_includes_compute_imbalance():
    task = make_task(n_tables=13, rows=20000, dim=32, pooling=20.0, batch=1024)
    lopsided, balanced = all_on(task, 0, "lopsided"), round_robin(task, "balanced")
    ev = HardwareEvaluator(backend="torch", comm_backend="gloo", protocol=proto(1, 4))  # see the all-to-all test
    out = ev.measure_many(task, [lopsided, balanced])
    assert len(out) == 2
    for c in out:
        assert len(c.compute_ms) == len(c.forward_comm_ms) == len(c.backward_comm_ms) == 2
        assert finite_positive(c.compute_ms + c.forward_comm_ms + c.backward_comm_ms)
        assert len(c.forward_comm_spread_ms) == len(c.backward_comm_spread_ms) == 2
        assert c.plan_cost_spread_ms is not None and c.plan_cost_spread_ms >= 0
    lop = out[0]
    gap = lop.compute_ms[0] - lop.compute_ms[1]
    assert gap > 5.0, lop.compute_ms
    # device 1 finishes its one table early and waits for device 0 in the forward all-to-all
    assert lop.forward_comm_ms[1] > 0.5 * gap, (lop.compute_ms, lop.forward_comm_ms)
    assert lop.forward_comm_ms[1] > 2 * lop.forward_comm_ms[0]


# ---------------------------------------------------------------------------- analytic model
def test_analytic_ranks_heavier_device_above_lighter():
    task = make_task(n_tables=10, rows=100000, dim=64, pooling=15.0, batch=4096)
    c = AnalyticCostModel().device_costs(task, all_on(task, 0))
    assert c.compute_ms[0] > 5 * c.compute_ms[1] > 0
    # the light device waits for the heavy one in the forward all-to-all
    assert c.forward_comm_ms[1] > c.compute_ms[0] - c.compute_ms[1] > 0
    assert c.forward_comm_ms[0] == pytest.approx(c.backward_comm_ms[0])
    assert c.plan_cost_ms == pytest.approx(max(c.total_ms))


def test_analytic_prices_data_parallel_copies_at_their_share_and_their_gradient_all_reduce():
    """A table copied onto all 4 devices: each copy looks up a quarter of the batch (less compute
    than the whole table on one device), sends nothing in the all-to-all, and every rank's
    backward pays the ring all-reduce of rows x dim fp32 values."""
    m = AnalyticCostModel(cache_bytes=0)

    def costs(pooling):
        task = make_task(n_tables=2, devices=4, rows=50_000, dim=64, pooling=pooling, batch=4096)
        t0, t1 = task.tables
        tw = Plan(task.name, "tw", [Shard.whole(t0, 0), Shard.whole(t1, 1)])
        dp = Plan(task.name, "dp", [Shard.whole(t0, 0)] + [Shard("t1", d, 0, 64, 0, 50_000, replica=d) for d in range(4)])
        return m.device_costs(task, tw), m.device_costs(task, dp)

    (alone, dp), (alone2, dp2) = costs(20.0), costs(40.0)
    # twice the lookups per sample: a copy's compute grows by a quarter of the whole table's growth
    assert dp2.compute_ms[1] - dp.compute_ms[1] == pytest.approx((alone2.compute_ms[1] - alone.compute_ms[1]) / 4)
    assert dp.compute_ms[0] > dp.compute_ms[1] == pytest.approx(dp.compute_ms[3])  # device 0 also holds t0
    ar = m.allreduce_ms(50_000 * 64, 4)
    assert ar == pytest.approx(m.comm_latency_ms + 1.5 * 50_000 * 64 * 4 * 1e-6 / m.net_bandwidth_gbps)
    no_ar = m.transfer_ms([64, 0, 0, 0], 4096)
    assert dp.backward_comm_ms == pytest.approx([b + ar for b in no_ar])
    assert m.allreduce_ms(10**6, 1) == 0.0 and m.allreduce_ms(0, 4) == 0.0


def test_analytic_single_device_has_zero_comm_and_row_split_halves_work():
    task = make_task(n_tables=1, devices=1, rows=100000, dim=64, batch=4096)
    m = AnalyticCostModel(cache_bytes=0)
    c = m.device_costs(task, round_robin(task))
    assert c.forward_comm_ms == [0.0] and c.backward_comm_ms == [0.0]
    t = task.tables[0]
    whole = m.forward_compute_ms([(t, Shard.whole(t, 0))], 4096)
    half = m.forward_compute_ms([(t, Shard("t0", 0, 0, 64, 0, 50000))], 4096)
    assert half < whole


def test_analytic_calibrate_recovers_parameters():
    truth = AnalyticCostModel(launch_ms=0.7, per_shard_ms=0.1, bandwidth_gbps=3.0, miss_ns=5.0,
                              output_bandwidth_gbps=1.5, net_bandwidth_gbps=1.2, comm_latency_ms=0.4)
    rng = np.random.default_rng(0)
    tables = [Table(f"t{i}", int(rng.integers(1000, 10**6)), int(rng.choice([4, 16, 64, 128])),
                    float(rng.uniform(1, 30))) for i in range(30)]
    samples = []
    for _ in range(40):
        pick = rng.choice(30, size=int(rng.integers(1, 12)), replace=False)
        ss = [(tables[i], Shard.whole(tables[i], 0)) for i in pick]
        b = int(rng.choice([512, 2048, 8192]))
        samples.append((ss, b, truth.compute_ms(ss, b)))
    comm = []
    for _ in range(10):
        w = [int(x) for x in rng.integers(0, 1000, size=4)]
        comm.append((w, 4096, truth.transfer_ms(w, 4096)))
    fit = AnalyticCostModel.calibrate(samples, comm)
    for name in ("launch_ms", "per_shard_ms", "bandwidth_gbps", "miss_ns", "output_bandwidth_gbps",
                 "net_bandwidth_gbps", "comm_latency_ms"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
