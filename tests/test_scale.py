"""Scale with sane estimates (issue 18, item 4): what keeps planning cheap on many devices
(candidate devices, thinned caps, the ledger's carried packing) and what keeps a learned
model's estimate far outside its training from being reported as a cost. Speed itself is
measured by scripts/bench_neuroshard_planning.py and scripts/bench_rl_planning.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embshard import Table, Task, validate
from embshard.costs.analytic import AnalyticCostModel
from embshard.errors import InfeasibleError
from embshard.costs.neural import NeuralCostModels
from embshard.costs.neural.models import FAR_FACTOR
from embshard.costs.predictor import AnalyticPredictor
from embshard.packing import LookAhead
from embshard.plan import MemoryLedger, Plan, Shard
from embshard.search.greedy import GreedyPartitioner, cheapest
from embshard.search.neuroshard import NeuroShardSharder
from embshard.search.pieces import PieceBook, initial_state, row_split
from embshard.search.rl.env import best_plan
from embshard.search.rl.sharders import AutoShardSharder, DreamShardSharder
from embshard.search.simulator import Simulator

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt"


def make_task(n: int, d: int, seed: int = 0, batch: int = 4096, slack: float = 1.5) -> Task:
    rng = np.random.default_rng(seed)
    tables = tuple(Table(f"t{i}", int(rng.integers(1_000, 200_000)), 4 * int(rng.integers(1, 17)),
                         float(rng.uniform(1, 40))) for i in range(n))
    probe = Task("s", d, 1, batch, tables)
    need = [probe.table_memory_bytes(t) for t in tables]
    return Task(f"scale-{n}x{d}", d, int(max(slack * sum(need) / d, 1.05 * max(need))), batch, tables)


# ----------------------------------------------------------------------------- estimates
def test_comm_models_outside_their_device_counts_fall_back_to_the_analytic_model():
    models = NeuralCostModels.load(SHIPPED)
    trained = models.envelope.comm_devices
    d = max(trained) * 2
    p = models.at_batch(16384)
    w = np.full((1, d), 64.0)
    dl = np.linspace(0, 3, d)[None]
    fw, bw = p.comm_ms(w, dl)
    afw, abw = AnalyticPredictor(batch_size=16384).comm_ms(w, dl)
    np.testing.assert_allclose(fw, afw)
    np.testing.assert_allclose(bw, abw)
    assert sum(p.fallbacks.values()) == 1 and f"devices={d} outside" in next(iter(p.fallbacks))
    # inside the trained device counts, on an ordinary all-to-all, the comm models answer
    w4 = np.full((1, 4), 64.0)
    fw4, bw4 = p.comm_ms(w4, np.zeros((1, 4)))
    assert not np.allclose(bw4, AnalyticPredictor(batch_size=16384).comm_ms(w4, np.zeros((1, 4)))[1])
    assert sum(p.fallbacks.values()) == 1


def test_an_estimate_far_off_the_analytic_model_is_not_reported():
    """16 devices (trained) but 80,000 columns at batch 65536: the comm models extrapolate to
    ~1e7 ms; what comes out is the analytic model's, within FAR_FACTOR of it by construction."""
    models = NeuralCostModels.load(SHIPPED)
    p = models.at_batch(65536)
    w = np.full((1, 16), 5000.0)
    fw, bw = p.comm_ms(w, np.zeros((1, 16)))
    _, abw = AnalyticPredictor(batch_size=65536).comm_ms(w, np.zeros((1, 16)))
    np.testing.assert_allclose(bw, abw)
    assert "off the analytic model" in next(iter(p.fallbacks))


def test_report_says_who_estimated_the_all_to_all():
    models = NeuralCostModels.load(SHIPPED)
    for d, who in ((4, "neural"), (64, "analytic")):
        task = make_task(3 * d, d)
        plan = Plan(task.name, "rr", [Shard.whole(t, i % d) for i, t in enumerate(task.tables)])
        env = models.envelope_report(task, plan)
        assert env["comm_estimate"] == who
        assert (env["comm_fallback_reason"] is None) == (who == "neural")
        est = models.device_costs(task, plan).plan_cost_ms
        ref = AnalyticCostModel().device_costs(task, plan).plan_cost_ms
        assert 1 / FAR_FACTOR < est / ref < FAR_FACTOR


def test_neuroshard_names_its_comm_fallbacks():
    s = NeuroShardSharder(verify=0, beam_max_work=0)
    task = make_task(60, 32)
    plan = s.shard(task)
    validate(task, plan)
    assert s.last_search_info["comm_fallbacks"] and all("devices=32" in k for k in s.last_search_info["comm_fallbacks"])
    ref = AnalyticCostModel().device_costs(task, plan).plan_cost_ms
    assert 0.5 < s.last_predicted_cost_ms / ref < 2.0


@pytest.mark.parametrize("cls", [DreamShardSharder, AutoShardSharder])
def test_rl_estimate_far_outside_training_is_the_analytic_models(cls):
    """The shipped policies (trained on 20-30 tables at 2-8 devices, batch 2048-16384), asked for
    300 tables on 64 devices at batch 65536: the report's estimate is a sane one, and says whose
    it is; inside the training range the network's own."""
    s = cls(checkpoint=f"checkpoints/{cls.algorithm}_cpu/policy.pt", samples=0)
    s.load()
    card = s.bundle["data_card"]
    devices, batches = card["device_counts"], card["batch_sizes"]
    assert max(devices) < 64 and max(batches) < 65536
    task = make_task(300, 64, batch=65536)
    plan = s.shard(task)
    est = s.last_search_info["estimate"]
    costs = AnalyticCostModel().device_costs(task, plan)
    ref = costs.plan_cost_ms if est["of"] == "plan cost" else max(costs.compute_ms)
    assert est["ms"] == s.last_predicted_cost_ms and est["source"] == "analytic"
    assert est["ms"] == pytest.approx(ref) and "device count lies outside" in est["reason"]
    assert f"trained on 20-30 tables, devices {devices}, batch {batches}" in est["reason"]
    # inside its training range the network's own estimate is reported
    s.shard(make_task(25, devices[0], batch=batches[-1]))
    assert s.last_search_info["estimate"]["source"] == "cost network"
    s.shard(make_task(25, devices[0], batch=4 * batches[-1]))
    assert "batch lies outside" in s.last_search_info["estimate"]["reason"]


# ----------------------------------------------------------------------------- cheap planning
def test_candidate_devices_change_nothing_up_to_their_count_and_stay_valid_beyond():
    task = make_task(80, 24)
    full = NeuroShardSharder(checkpoint=None, verify=0, max_candidates=None, beam_max_work=0)
    same = NeuroShardSharder(checkpoint=None, verify=0, max_candidates=24, beam_max_work=0)
    few = NeuroShardSharder(checkpoint=None, verify=0, max_candidates=4, beam_max_work=0)
    p_full, p_same, p_few = full.shard(task), same.shard(task), few.shard(task)
    assert p_full.signature() == p_same.signature()
    validate(task, p_few)
    # the cheapest devices are where the cheapest placement is: little is lost
    assert few.last_predicted_cost_ms <= 1.10 * full.last_predicted_cost_ms


def test_cheapest_candidates_are_those_of_the_full_sort():
    """The partition shortcut picks the same devices as sorting every candidate by (cost, more
    free memory, index), ties and a NaN cost included."""
    rng = np.random.default_rng(0)
    for trial in range(400):
        d = int(rng.integers(2, 200))
        cost = rng.integers(0, 4, d).astype(float) if trial % 2 else rng.random(d)  # many ties, or none
        if trial % 5 == 0:
            cost[rng.integers(0, d, 3)] = np.nan
        free = rng.integers(0, 3, d)
        cand = np.sort(rng.choice(d, int(rng.integers(1, d + 1)), replace=False))
        k = int(rng.integers(1, len(cand) + 1))
        want = np.sort(cand[np.lexsort((cand, -free[cand], cost[cand]))[:k]])
        assert cheapest(cand, cost, free, k).tolist() == want.tolist()


def test_caps_are_thinned_evenly_only_over_the_work_budget():
    task = make_task(50, 8)
    sim = Simulator(AnalyticPredictor(batch_size=task.batch_size))
    caps = tuple(round(1.0 + 0.05 * i, 2) for i in range(11))
    part = GreedyPartitioner(task, sim, PieceBook(task, sim), caps, grid_max_work=50 * 8 * 11)
    assert part.thinned(caps, 50) == caps
    part.grid_max_work = 50 * 8 * 4
    assert part.thinned(caps, 50) == (1.0, 1.15, 1.35, 1.5)
    part.grid_max_work = 1
    assert part.thinned(caps, 50) == (1.0, 1.5)


@pytest.mark.parametrize("incremental, devices, slack", [(True, 48, 1.5), (True, 40, 1.02), (False, 12, 1.3)],
                         ids=["pooled", "pooled-tight", "keyed"])
def test_runs_under_larger_caps_picked_up_from_a_fork_are_the_runs_from_scratch(incremental, devices, slack):
    """A run under a larger cap picks up where its candidate devices first differ from a smaller
    cap's run: every run (devices, compute, widths) is the one from scratch, and steps were saved."""
    task = make_task(240, devices, seed=4, slack=slack)
    sim = Simulator(AnalyticPredictor(batch_size=task.batch_size))
    caps = tuple(round(1.0 + 0.05 * i, 2) for i in range(11))
    book = PieceBook(task, sim)
    part = GreedyPartitioner(task, sim, book, caps, incremental=incremental, max_candidates=6, grid_max_work=None)
    book.encode = part.incremental
    assert part.incremental == incremental
    pieces = book.pieces_of(initial_state(task))
    ordered = sorted(pieces, key=lambda p: (-p.single_ms, -p.need, p.spec))
    width = sum(p.dim for p in pieces)
    forked, _ = part._cap_runs([], ordered, caps, width)
    saved = part.steps_forked
    fresh, _ = part._cap_runs([], ordered, caps, width, forked=False)
    assert part.steps_forked == saved > 0
    assert len(forked) == len(fresh) > 2
    for a, b in zip(forked, fresh):
        assert a[0] == b[0] and a[1] == b[1]
        np.testing.assert_array_equal(a[2], b[2])
        np.testing.assert_array_equal(a[3], b[3])


def test_auto_keeps_running_sums_on_many_devices_or_many_tables():
    """incremental="auto": the keyed shard cache only on few devices with few tables; a shard of
    hundreds of tables re-predicted whole at every placement is quadratic in the tables."""
    from embshard.search.greedy import INCREMENTAL_MAX_KEYED_TABLES, INCREMENTAL_MIN_DEVICES

    def auto(n: int, d: int) -> bool:
        task = make_task(n, d, slack=3.0)
        sim = Simulator(AnalyticPredictor(batch_size=task.batch_size))
        return GreedyPartitioner(task, sim, PieceBook(task, sim), (1.0,), incremental="auto").incremental

    few = INCREMENTAL_MIN_DEVICES - 1
    assert not auto(INCREMENTAL_MAX_KEYED_TABLES, few)
    assert auto(INCREMENTAL_MAX_KEYED_TABLES + 1, few)
    assert auto(10, INCREMENTAL_MIN_DEVICES)


def _row_split_state(task: Task, names: list[str]) -> tuple:
    state = initial_state(task)
    for name in names:
        spec = next(s for s in state if s[0] == name)
        state = row_split(state, spec, tuple(range(task.num_devices)))
    return state


@pytest.mark.parametrize("predictor", ["sum", "sum_max"])
def test_row_blocks_enter_the_running_sums_as_one_at_a_time(predictor):
    """On many devices a row-split table is a block per device, put on its device before the
    greedy places the rest (`add_fixed`, `_place_fixed`, both in one pass): the running sums,
    each device's cost, free memory and widths are those of taking the blocks one by one, and
    the runs that follow place as the cached (keyed) shards do."""
    task = make_task(30, 48, seed=6, slack=20.0)
    pred = AnalyticPredictor(batch_size=task.batch_size)
    if predictor == "sum_max":
        from tests.test_neuroshard import SumMax
        pred = SumMax()
    sim = Simulator(pred)
    book = PieceBook(task, sim)
    part = GreedyPartitioner(task, sim, book, (1.0, 1.2), incremental=True, grid_max_work=None)
    book.encode = True
    state = _row_split_state(task, ["t3", "t17"])
    pieces = book.pieces_of(state)
    fixed = [p for p in pieces if p.fixed >= 0]
    assert len(fixed) == 2 * 48

    batched, single = part._accumulator(), part._accumulator()
    batched.add_fixed([(p.fixed, p) for p in fixed])
    for p in fixed:
        single.add(p.fixed, p, -1)
    np.testing.assert_array_equal(batched.sum, single.sum)
    np.testing.assert_allclose(batched.cost, single.cost, rtol=1e-12)
    assert (batched.cost > 0).all()

    ledger, free, widths = MemoryLedger(task), np.full(48, task.device_memory_bytes, dtype=np.int64), np.zeros(48, dtype=np.int64)
    part._place_fixed(fixed, ledger, free, widths)
    want_free, want_widths = np.full(48, task.device_memory_bytes, dtype=np.int64), np.zeros(48, dtype=np.int64)
    for p in fixed:
        want_free[p.fixed] -= p.need
        want_widths[p.fixed] += p.dim
    np.testing.assert_array_equal(free, want_free)
    np.testing.assert_array_equal(widths, want_widths)
    assert ledger.free == want_free.tolist()

    keyed = GreedyPartitioner(task, sim, PieceBook(task, sim), (1.0, 1.2), incremental=False, grid_max_work=None)
    a, b = part.partition(state), keyed.partition(state)
    assert a.devices == b.devices
    np.testing.assert_allclose(a.costs.compute_ms, b.costs.compute_ms, rtol=1e-9)


def test_row_blocks_that_overflow_a_device_name_the_first_block_without_room():
    task = make_task(6, 4, seed=2, slack=2.0)
    sim = Simulator(AnalyticPredictor(batch_size=task.batch_size))
    book = PieceBook(task, sim)
    part = GreedyPartitioner(task, sim, book, (1.0,), grid_max_work=None)
    fixed = [p for p in book.pieces_of(_row_split_state(task, ["t0", "t1"])) if p.fixed >= 0]
    free = np.array([task.device_memory_bytes] * 4, dtype=np.int64)
    t1_block = next(p for p in fixed if p.table.name == "t1" and p.fixed == 2)
    t0_block = next(p for p in fixed if p.table.name == "t0" and p.fixed == 2)
    free[2] = t0_block.need + t1_block.need - 1  # t0's block fits on device 2, t1's after it does not
    ledger = MemoryLedger(task)
    ledger.free = free.tolist()
    with pytest.raises(InfeasibleError) as e:
        part._place_fixed(fixed, ledger, free, np.zeros(4, dtype=np.int64))
    assert e.value.table == "t1" and f"needs {t1_block.need} bytes" in str(e.value)


@pytest.mark.parametrize("fit", ["first", "worst"])
def test_look_ahead_on_many_devices_packs_as_plain_decreasing_fit(fit):
    """Over 32 devices the proof packs first fit by runs of pieces and worst fit through a heap:
    the same assignment, slack and verdict as placing one piece at a time."""
    rng = np.random.default_rng(5)
    seen = set()
    for trial in range(120):
        d = int(rng.integers(33, 130))
        cap = int(rng.integers(10, 10**6))
        big = rng.integers(cap // 3, cap + 1, size=int(rng.integers(0, d)))
        small = (cap * rng.pareto(1.5, size=int(rng.integers(0, 400))) / 200).astype(np.int64)
        needs = np.minimum(np.concatenate([big, small, small[: len(small) // 4]]), cap)  # some equal
        free = rng.integers(0, cap + 1, size=d) if trial % 2 else np.full(d, cap)
        ahead = LookAhead(free, needs.tolist(), fit="first")
        for k in np.flatnonzero(rng.random(len(needs)) >= 0.8):  # a fifth placed already
            ahead.forget(int(k))
        got = ahead._pack(free, fit)
        f = free.astype(np.int64).copy()
        want = {}
        for k in np.argsort(-needs, kind="stable"):
            if not ahead.pending[k]:
                continue
            j = int(np.argmax(f)) if fit == "worst" else int(np.argmax(f >= needs[k]))
            if f[j] < needs[k]:
                want = None
                break
            f[j] -= needs[k]
            want[int(k)] = j
        seen.add(want is None)
        if want is None:
            assert got is None
            continue
        assert got is not None
        assign, slack = got
        assert {k: int(assign[k]) for k in want} == want
        np.testing.assert_array_equal(slack, f)
    assert seen == {True, False}  # both verdicts were checked


def _worst_fit_one_at_a_time(free: np.ndarray, needs: np.ndarray, pending: np.ndarray) -> dict | None:
    f = free.astype(np.int64).copy()
    want = {}
    for k in np.argsort(-needs, kind="stable"):
        if pending[k]:
            j = int(np.argmax(f))  # the most room, the lowest index among equals
            if f[j] < needs[k]:
                return None
            f[j] -= needs[k]
            want[int(k)] = j
    return {"assign": want, "slack": f}


@pytest.mark.parametrize("shape", ["even", "one_roomy", "leapfrog", "early_fail", "huge"])
def test_worst_fit_by_rounds_is_worst_fit_one_piece_at_a_time(shape, monkeypatch):
    """Worst fit on many devices places pieces by rounds in numpy (a run on the roomiest device,
    or a piece on each of the roomiest devices in turn) and hands over to the heap where rounds
    place few pieces; every shape gives one-piece-at-a-time's assignment, slack and verdict, and
    the shapes reach the paths they are meant to (the heap only for leapfrogging devices and
    for sizes whose keys overflow int64)."""
    heap_from = []
    real = LookAhead._worst_fit_heap

    def spy(self, free, todo, assign, shift, heap=None, start=0, to=None):
        heap_from.append(start)
        return real(self, free, todo, assign, shift, heap=heap, start=start, to=to)

    monkeypatch.setattr(LookAhead, "_worst_fit_heap", spy)
    rng = np.random.default_rng(11)
    verdicts = set()
    for trial in range(40):
        d = int(rng.integers(40, 300))
        cap = 10**6
        if shape == "even":  # equal rooms, small pieces, some equal, about full (a tenth not
            # pending): some fail late
            free = np.full(d, cap)
            needs = (cap * rng.pareto(2.0, size=int(rng.integers(20 * d, 40 * d))) / 100).astype(np.int64) + 1
            needs[: len(needs) // 5] = needs[len(needs) // 5]
            needs = np.clip(needs * (rng.uniform(1.06, 1.16) * d * cap / needs.sum()), 1, cap).astype(np.int64)
        elif shape == "one_roomy":  # one device with most of the memory takes long runs
            free = rng.integers(0, cap // 100, size=d)
            free[int(rng.integers(d))] = 50 * cap
            needs = rng.integers(1, cap // 50, size=int(rng.integers(d, 6 * d)))
        elif shape == "leapfrog":  # two roomy devices trade the lead piece after piece
            free = np.zeros(d, dtype=np.int64)
            free[3], free[7] = cap, cap - 1
            needs = np.full(int(rng.integers(200, 600)), int(rng.integers(1, cap // 1000)))
        elif shape == "early_fail":  # tight: a few big pieces decide
            free = rng.integers(cap // 2, cap, size=d)
            needs = np.concatenate([rng.integers(cap // 2, cap, size=d), rng.integers(1, cap // 10, size=3 * d)])
        else:  # rooms so large their keys would overflow int64
            free = np.full(d, 1 << 60) - rng.integers(0, 1 << 40, size=d)
            needs = rng.integers(1 << 50, 1 << 56, size=int(rng.integers(d, 3 * d)))
        pending = rng.random(len(needs)) < 0.9
        ahead = LookAhead(np.full(d, 1 << 62), needs.tolist(), fit="first")
        for k in np.flatnonzero(~pending):
            ahead.forget(int(k))
        got = ahead._pack(free, "worst")
        want = _worst_fit_one_at_a_time(free, needs, pending)
        verdicts.add(want is not None)
        if want is None:
            assert got is None
            continue
        assert got is not None
        assign, slack = got
        assert {k: int(assign[k]) for k in want["assign"]} == want["assign"]
        np.testing.assert_array_equal(slack, want["slack"])
    if shape == "leapfrog":
        assert heap_from and min(heap_from) > 0  # handed over part-way
    elif shape == "huge":
        assert heap_from and set(heap_from) == {0}
    else:
        assert not heap_from
    assert verdicts == {"even": {True, False}, "early_fail": {False}}.get(shape, {True})


def test_ledger_lookahead_keeps_the_rest_packable_and_rescues_a_stranded_table():
    """Two devices of 10; pending 6, 5, 5, 4: placing 6 and then 5 on the emptier device
    would strand the other 5 (6+4 | 5+5 is the only packing). The ledger's look-ahead finds it,
    whatever order of devices the caller prefers."""
    tables = tuple(Table(f"t{i}", 1, 4, 1.0) for i in range(4))
    task = Task("pack", 2, 10, 1, tables)
    for prefer in ([0, 1], [1, 0]):
        ledger = MemoryLedger(task, pending=[6, 5, 5, 4])
        d6 = ledger.place(tables[0], 6, prefer)
        d5 = ledger.place(tables[1], 5, [d6, 1 - d6])  # preferring the 6's device would strand a 5
        assert d5 == 1 - d6
        ledger.place(tables[2], 5, [d6, 1 - d6])
        ledger.place(tables[3], 4, [0, 1])
        assert ledger.free == [0, 0]


def test_greedy_lookahead_repacks_once_per_distinct_free_memory():
    """65 pieces of 6 on 64 devices of 10: no packing, so `choose` looks for a device after
    which the rest packs. Devices with the same free memory leave the same rooms, so one failed
    repack stands for all of them: 1 repack, not 64 (a user-style task of 40 tables on 128
    devices spent 75% of its 52 s there); then a device with other free memory is still tried
    and taken when the rest packs after it."""
    ahead = LookAhead(np.full(64, 10), [6] * 65, fit="worst")
    assert not ahead.valid
    assert ahead.choose(0, np.full(64, 10), list(range(64))) == 0 and ahead.repacks == 1 and not ahead.valid
    # devices 0-61 hold 6 (free 4), 62 and 63 are empty: the pending 6s pack only after a 6 on 62 or 63
    free = np.array([4] * 62 + [10, 10])
    ahead = LookAhead(free, [6, 6], fit="worst")
    ahead.valid = False
    assert ahead.choose(0, free, [62, 63]) == 62 and ahead.valid and ahead.repacks == 1
    ahead = LookAhead(np.array([10, 10, 10, 16]), [6, 6, 6, 6, 6, 6], fit="worst")
    assert not ahead.valid  # 3 + 2 sixes fit, 6 do not: no device after which the rest packs
    assert ahead.choose(0, np.array([10, 10, 10, 16]), [0, 1, 2, 3]) == 0 and ahead.repacks == 2


def test_ledger_lookahead_agrees_with_first_fit_decreasing_from_scratch():
    """Random placements on random ledgers: whenever the ledger accepts a device it keeps the
    rest packable (checked by first-fit decreasing), and it accepts every device FFD accepts."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        d = int(rng.integers(2, 7))
        needs = sorted(rng.integers(1, 40, size=int(rng.integers(3, 14))).tolist(), reverse=True)
        cap = int(max(max(needs), rng.uniform(0.9, 1.6) * sum(needs) / d))
        task = Task("r", d, cap, 1, tuple(Table(f"t{i}", 1, 4, 1.0) for i in range(len(needs))))
        ledger = MemoryLedger(task, pending=needs)
        order = rng.permutation(len(needs)).tolist()
        for k, i in enumerate(order):
            rest = [needs[j] for j in order[k + 1:]]
            ledger.forget_pending(needs[i])
            for dev in range(d):
                if ledger.free[dev] < needs[i]:
                    continue
                after = list(ledger.free)
                after[dev] -= needs[i]
                if _ffd(after, rest):
                    assert ledger.pending_pack_after(dev, needs[i])
                if ledger.pending_pack_after(dev, needs[i]):
                    assert _packs(after, rest)
            room = [x for x in range(d) if ledger.free[x] >= needs[i]]
            if not room:
                break
            ledger.take(int(rng.choice(room)), needs[i])


def _proof_holds(ledger: MemoryLedger) -> None:
    """The ledger's carried proof is a packing: every pending piece on a device, and each
    device's slack its free bytes less the pending bytes the proof puts there, never negative."""
    ahead = ledger._ahead
    if not ahead.valid or not ahead.num_pending:
        return
    assert (ahead.assign[ahead.pending] >= 0).all()
    held = np.bincount(ahead.assign[ahead.pending], weights=ahead.needs[ahead.pending], minlength=len(ledger.free))
    np.testing.assert_array_equal(ahead.slack, np.array(ledger.free) - held.astype(np.int64))
    assert (ahead.slack >= 0).all()


def test_ledger_mends_its_proof_under_tight_memory_instead_of_repacking():
    """A harsh task's shape: most devices are held by the proof for one piece of nearly a
    device each (no slack elsewhere holds one), and a greedy puts small pieces on the lowest
    devices first. Such a placement mends the proof (the big piece moves to a device whose small
    pieces move elsewhere first) instead of repacking every pending piece, the proof stays a
    packing after every step, and every piece is placed within memory."""
    rng = np.random.default_rng(7)
    d, cap = 48, 1000
    big = [990] * 40
    small = rng.integers(5, 60, size=300).tolist()
    while sum(big) + sum(small) > 0.9 * d * cap:
        small.pop()
    needs = big + small
    tables = tuple(Table(f"t{i}", 1, 4, 1.0) for i in range(len(needs)))
    ledger = MemoryLedger(Task("tight", d, cap, 1, tables), pending=needs)
    order = sorted(range(len(needs)), key=lambda i: (needs[i] == 990, rng.random()))  # small pieces first
    for i in order:
        ledger.place(tables[i], needs[i], range(d))
        _proof_holds(ledger)
    assert min(ledger.free) >= 0 and sum(ledger.free) == d * cap - sum(needs)
    assert ledger._ahead.mends > 0 and ledger._ahead.repacks == 0


def test_ledger_proof_stays_a_packing_through_random_placements():
    """Random ledgers placed by `place` with random preferences: after every placement the carried
    proof, whether kept, mended or repacked, is a packing of the pending pieces."""
    rng = np.random.default_rng(11)
    for _ in range(80):
        d = int(rng.integers(2, 9))
        needs = sorted(rng.integers(1, 40, size=int(rng.integers(3, 30))).tolist(), reverse=True)
        cap = int(max(max(needs), rng.uniform(1.0, 1.4) * sum(needs) / d))
        tables = tuple(Table(f"t{i}", 1, 4, 1.0) for i in range(len(needs)))
        ledger = MemoryLedger(Task("r", d, cap, 1, tables), pending=needs)
        for i in rng.permutation(len(needs)).tolist():
            try:
                ledger.place(tables[i], needs[i], rng.permutation(d).tolist())
            except InfeasibleError:
                break
            _proof_holds(ledger)


def _ffd(free: list[int], needs: list[int]) -> bool:
    f = list(free)
    for n in sorted(needs, reverse=True):
        j = next((j for j, x in enumerate(f) if x >= n), None)
        if j is None:
            return False
        f[j] -= n
    return True


def _packs(free: list[int], needs: list[int]) -> bool:
    """Exhaustive: some assignment of `needs` fits `free` (small cases only)."""
    needs = sorted(needs, reverse=True)

    def go(i: int, f: list[int]) -> bool:
        if i == len(needs):
            return True
        tried = set()
        for j in range(len(f)):
            if f[j] >= needs[i] and f[j] not in tried:
                tried.add(f[j])
                f[j] -= needs[i]
                if go(i + 1, f):
                    return True
                f[j] += needs[i]
        return False

    return go(0, list(free))


@pytest.mark.parametrize("cls", [DreamShardSharder, AutoShardSharder])
def test_rl_candidate_devices_plan_validly_and_estimate_the_plan_they_made(cls):
    task = make_task(40, 12)
    s = cls(checkpoint=f"checkpoints/{cls.algorithm}_cpu/policy.pt", samples=0)
    agent = s.load()
    with torch.no_grad():
        full, est_full = best_plan(agent, task, 0, max_candidates=None)
        same, est_same = best_plan(agent, task, 0, max_candidates=12)
        few, est_few = best_plan(agent, task, 0, max_candidates=3)
    assert full.signature() == same.signature() and est_full == est_same
    validate(task, few)
    # a lazy state refreshes every device before estimating: the estimate is the plan's
    assert est_few == pytest.approx(agent.estimate_plan(task, few), rel=1e-5)


def test_shipped_dreamshard_estimates_far_outside_its_training_from_its_own_network():
    """Item 2: the shipped DreamShard (structured comm heads) was trained on 20-30 tables at 2-8
    devices and batch 2048-16384; at 300 tables on 64 devices and batch 65536 its own network's
    estimate stays near the analytic model's (the previous network's was 1e5-1e6 times it),
    though the planner reports the analytic model's there (outside its training range)."""
    bundle = torch.load(ROOT / "checkpoints" / "dreamshard_cpu" / "policy.pt", map_location="cpu", weights_only=True)
    assert bundle["hparams"]["costnet"]["structured_comm"] is True
    assert set(bundle["data_card"]["split"]) >= {"train", "validation", "test", "keys"}
    s = DreamShardSharder("checkpoints/dreamshard_cpu/policy.pt", samples=0)
    task = make_task(300, 64, batch=65536)
    plan, network_ms = best_plan(s.load(), task, 0, generator=torch.Generator().manual_seed(0),
                                 algorithm="dreamshard", max_candidates=s.max_candidates)
    ref = AnalyticCostModel().device_costs(task, plan).plan_cost_ms
    assert 0.5 < network_ms / ref < 3.0
    assert s.shard(task).signature() == plan.signature()
    assert s.last_search_info["estimate"]["source"] == "analytic"


def test_dreamshard_lazy_step_prices_the_taken_device_as_advance_would():
    """A lazy step also prices each candidate as it will be once it took the table, so that
    `advance` reads the chosen device's costs instead of running the network again: they must
    be what `advance` computes itself (its fallback, for a device outside the candidates)."""
    agent = DreamShardSharder("checkpoints/dreamshard_cpu/policy.pt", samples=0).load()
    task = make_task(30, 12)
    with torch.inference_mode():
        view = agent.prepare(task)
        state = agent.init_state(view, 2, lazy=True)
        placed = torch.tensor([True, True])
        for t in range(12):
            cand = torch.topk(agent.candidate_scores(view, state), 4, dim=1, largest=False).indices
            logits, _ = agent.step(view, state, t, None, cand)
            assert state["taken"][1].shape == (2, 4, 3)
            devices = cand.gather(1, logits.argmax(1, keepdim=True)).squeeze(1)
            twin = {k: v.clone() for k, v in state.items() if k != "taken"}  # advance without the step's prices
            agent.advance(view, state, t, devices, placed)
            agent.advance(view, twin, t, devices, placed)
            torch.testing.assert_close(state["costs"], twin["costs"], rtol=1e-5, atol=1e-6)
            assert "taken" not in state


def test_dreamshard_full_step_keeps_compute_current_and_finish_refreshes_comm():
    """A step that scores every device (structured comm heads) leaves `advance` the compute of
    the device that took the table and marks the comm columns stale, since the next step
    prices every device again: the compute column must be what a full recompute gives after
    every step, and `finish` must bring back every column (the "devices" estimate reads them)."""
    agent = DreamShardSharder("checkpoints/dreamshard_cpu/policy.pt", samples=0).load()
    task = make_task(20, 4)
    with torch.inference_mode():
        view = agent.prepare(task)
        state = agent.init_state(view, 2)
        placed = torch.tensor([True, False])  # the second episode skips every step: nothing changes
        for t in range(view.num_tables):
            logits, _ = agent.step(view, state, t, torch.zeros(2, 4))
            assert state["taken_compute"].shape == (2, 4)
            agent.advance(view, state, t, logits.argmax(1), placed)
            full = agent.costnet.device_costs(state["S"], state["cnt"])
            torch.testing.assert_close(state["costs"][..., 0], full[..., 0], rtol=1e-5, atol=1e-6)
            assert state["stale"] and "taken_compute" not in state
        assert not torch.allclose(state["costs"], full)  # the comm columns are behind before finish
        agent.finish(view, state)
        torch.testing.assert_close(state["costs"], agent.costnet.device_costs(state["S"], state["cnt"]))
        assert state["cnt"][1].sum() == 0


def _first_fit_one_at_a_time(free: np.ndarray, needs: np.ndarray, pending: np.ndarray) -> bool:
    f = free.astype(np.int64).copy()
    for k in np.argsort(-needs, kind="stable"):
        if pending[k]:
            room = np.flatnonzero(f >= needs[k])
            if not len(room):
                return False
            f[room[0]] -= needs[k]
    return True


@pytest.mark.parametrize("fit", ["first", "worst"])
def test_a_repack_turned_down_from_its_largest_pieces_would_have_failed(fit, monkeypatch):
    """Under tight memory most repacks fail within their first pieces; `_pack` tells those from
    the 16 largest pending pieces and the rooms they can reach (`_fails_early`) before setting up
    a repack of every piece. Its verdict stays one-piece-at-a-time's, on rooms where a few devices
    can take the big pieces, and the early verdict is reached both ways."""
    told = []
    real = LookAhead._fails_early

    def spy(self, free, fit, r=16):
        told.append(real(self, free, fit, r))
        return told[-1]

    monkeypatch.setattr(LookAhead, "_fails_early", spy)
    rng = np.random.default_rng(5)
    cap = 10**6
    verdicts = set()
    for trial in range(80):
        d = int(rng.integers(33, 200))
        free = rng.integers(0, cap // 100, size=d)
        roomy = rng.choice(d, size=int(rng.integers(4, 40)), replace=False)
        free[roomy] = rng.integers(cap // 2, cap, size=len(roomy))
        big = rng.integers(cap // 4, cap, size=int(rng.integers(2, 24)))
        needs = np.concatenate([big, rng.integers(1, cap // 200, size=int(rng.integers(d, 4 * d)))])
        pending = rng.random(len(needs)) < 0.9
        ahead = LookAhead(np.full(d, 1 << 62), needs.tolist(), fit="first")
        for k in np.flatnonzero(~pending):
            ahead.forget(int(k))
        ahead._pack(free, fit)  # the largest pending pieces are noted, and stay noted until one is placed
        ahead.forget(int(np.argmax(np.where(pending, needs, -1))))
        pending = ahead.pending.copy()
        got = ahead._pack(free, fit)
        want = (_first_fit_one_at_a_time(free, needs, pending) if fit == "first"
                else _worst_fit_one_at_a_time(free, needs, pending) is not None)
        verdicts.add(want)
        assert (got is not None) == want, trial
    assert verdicts == {True, False}
    assert set(told) == {True, False}


def test_unpackable_only_where_no_packing_exists():
    """`LookAhead.unpackable` (the memory ledger asks it before mending or repacking its proof)
    says True only where no assignment of the pending pieces fits, checked against every
    assignment of small tasks, and it says so for some."""
    import itertools

    rng = np.random.default_rng(9)
    said = 0
    for trial in range(300):
        d = int(rng.integers(1, 5))
        n = int(rng.integers(1, 7))
        free = rng.integers(0, 100, size=d)
        needs = rng.integers(1, 100, size=n)
        ahead = LookAhead(np.full(d, 1 << 40), needs.tolist())
        exists = False
        for assign in itertools.product(range(d), repeat=n):
            used = np.bincount(np.array(assign), weights=needs, minlength=d)
            if (used <= free).all():
                exists = True
                break
        if ahead.unpackable(free):
            said += 1
            assert not exists, (free.tolist(), needs.tolist())
    assert said > 20


@pytest.mark.parametrize("devices", [4, 40])
def test_greedy_rule_skips_repacks_where_no_packing_exists_and_chooses_as_they_would(devices, monkeypatch):
    """`LookAhead.choose` with a proof already lost: where the pending pieces pack into the free
    memory by no packing (`unpackable`), none of its repacks could succeed, so it tries none and
    takes the first preferred device, as trying them all does."""
    rng = np.random.default_rng(3)
    free = rng.integers(50, 100, size=devices).astype(np.int64)
    needs = [120, 110, 30, 20, 10]  # the two largest fit no device: no packing exists
    preference = [int(x) for x in np.argsort(-free, kind="stable")[:3]]

    def choose(skip: bool) -> tuple[int, bool, int]:
        ahead = LookAhead(free.copy(), needs, fit="worst")
        assert not ahead.valid
        if not skip:
            monkeypatch.setattr(ahead, "unpackable", lambda f, r=16: False)
        device = ahead.choose(4, free, preference, lambda: [d for d in range(devices) if d not in preference])
        return device, ahead.valid, ahead.repacks

    fast, slow = choose(True), choose(False)
    assert fast == (preference[0], False, 0)
    assert slow[:2] == fast[:2] and slow[2] > 0
