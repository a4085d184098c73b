"""The placement floor (embshard.flexshard.floor): its per-step cost by hand, the dealing
probabilities, and the bound itself against the traffic model's counts of real plans."""

from __future__ import annotations


import numpy as np
import pytest

from embshard import InputError, Plan, Table, Task
from embshard.flexshard.baselines import (DataParallelSharder, HugeCTRHybridSharder, RowWiseSharder,
                                          TableRowWiseSharder)
from embshard.flexshard.floor import placement_floor, set_probabilities, step_cost
from embshard.flexshard.layout import Tiers, tier_layout
from embshard.flexshard.traffic import TrafficModel
from embshard.search.flexshard import FlexShardSharder

A, B, C = 1, 2, 4  # host bit masks


@pytest.mark.parametrize("holders, touched, hosts, want", [
    (A, 0, 2, 0),          # nobody looked it up
    (A, A, 2, 0),          # only the holder's host
    (A, B, 2, 2),          # value over, gradient back
    (A, A | B, 2, 2),
    (A | B, A, 2, 1),      # the other copy learns A's change
    (A | B, A | B, 2, 2),  # each copy the other's
    (A, A | B | C, 3, 4),  # two values out, two gradients in
    (A | B | C, A | B | C, 3, 3),
    (A | B, C, 3, 3),      # C receives the value, then sends to both copies (or one relays): max(1, 2) after it
])
def test_step_cost_by_hand(holders, touched, hosts, want):
    assert step_cost(holders, touched, hosts) == want


def test_dealing_probabilities_sum_to_one_and_match_sampling():
    p = set_probabilities(np.array([0, 1, 3, 40]), 3)
    assert p.sum(axis=1) == pytest.approx(np.ones(4))
    assert p[0, 0] == 1.0 and p[1].tolist() == pytest.approx([0, 1 / 3, 1 / 3, 0, 1 / 3, 0, 0, 0])
    rng = np.random.default_rng(0)
    hosts = rng.integers(0, 3, size=(200_000, 3))
    masks = np.bitwise_or.reduce(np.left_shift(1, hosts), axis=1)
    assert np.bincount(masks, minlength=8) / masks.size == pytest.approx(p[2], abs=0.005)
    assert p[3, 7] == pytest.approx(1 - 3 * (2 / 3) ** 40 + 3 * (1 / 3) ** 40)


def test_floor_of_one_row_by_hand():
    # 2 hosts x 1 device, 4 samples (0, 1 on host 0; 2, 3 on host 1); row 5 looked up by samples
    # 0, 2 and 3 (twice by 3): the hosts {0, 1} -> 2 vectors in hindsight; dealt at random, three
    # samples miss one host with chance 2 / 8, so 2 * (1 - 1/8) = 1.75 vectors are expected. Row 1,
    # one sample: on its holder's host in hindsight (0), dealt at random 2 vectors half the time (1)
    t = Table("s", 10, 8, 1.0, kind="sequence")
    task = Task("one", 2, 1 << 20, 4, (t,), devices_per_host=1)
    batch = {"s": (np.array([5, 1, 5, 5, 5]), np.array([1, 1, 1, 2]))}  # row 1: sample 1 only
    f = placement_floor(task, [batch])
    assert f.oracle_bytes == 2 * 4 * 8
    assert f.expected_bytes == pytest.approx((1.75 + 1) * 4 * 8)
    assert f.expected_ms == pytest.approx(f.expected_bytes / (2 * task.inter_host_gbps * 2**30 / 1e3))


def _zipf_batches(task: Task, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        batch = {}
        for t in task.tables:
            lengths = rng.integers(1, 7, size=task.batch_size)
            ranks = rng.zipf(1.3, size=int(lengths.sum())) - 1
            batch[t.name] = ((ranks * 7919) % t.rows, lengths)
        out.append(batch)
    return out


def _dealt(batch, rng):
    """The same samples dealt to devices in another order."""
    out = {}
    for name, (ids, lengths) in batch.items():
        order = rng.permutation(lengths.size)
        starts = np.r_[0, np.cumsum(lengths)[:-1]]
        out[name] = (np.concatenate([ids[starts[i]:starts[i] + lengths[i]] for i in order]), lengths[order])
    return out


def _inter_bytes(model: TrafficModel, batches) -> tuple[float, float]:
    steps = [model.step(b) for b in batches]
    inter = np.mean([sum(m[~model.intra].sum() for m in s.phases.values()) for s in steps])
    ms = np.mean([sum(model.step_ms(s).values()) for s in steps])
    return float(inter), float(ms)


@pytest.mark.parametrize("hosts", [2, 3])
def test_no_plan_beats_either_floor(hosts):
    tables = tuple(Table(f"s{i}", r, d, 3.5, kind="sequence") for i, (r, d) in enumerate([(300, 8), (5000, 16)]))
    task = Task("f", hosts * 2, 1 << 30, 96, tables, devices_per_host=2, hosts=hosts)
    batches = _zipf_batches(task, 2)
    floor = placement_floor(task, batches)
    assert 0 < floor.oracle_bytes and 0 < floor.expected_bytes
    plans = [RowWiseSharder().shard(task), RowWiseSharder(dedup_ids=True).shard(task),
             TableRowWiseSharder().shard(task), DataParallelSharder().shard(task),
             HugeCTRHybridSharder(fit_batches=2).shard(task), FlexShardSharder(fit_batches=2).shard(task)]
    rng = np.random.default_rng(1)
    dealings = [[_dealt(b, rng) for b in batches] for _ in range(30)]
    for plan in plans:
        model = TrafficModel(task, plan)
        inter, ms = _inter_bytes(model, batches)
        assert inter >= floor.oracle_bytes and ms >= floor.oracle_ms, plan.algorithm  # hard bound, these steps
        mean_inter = np.mean([_inter_bytes(model, d)[0] for d in dealings])
        assert mean_inter >= 0.97 * floor.expected_bytes, plan.algorithm  # in expectation (30 dealings)


def test_two_hosts_a_copy_per_host_with_sparse_sync_reaches_the_expected_floor():
    t = Table("u", 400, 64, 4.0, kind="sequence")
    task = Task("u", 4, 1 << 30, 64, (t,), devices_per_host=2)
    front, shards = tier_layout(task, t, np.arange(t.rows), Tiers(0, t.rows))
    plan = Plan(task.name, "host", shards, {"u": front}, dedup_ids=True, sparse_sync=True)
    batches = _zipf_batches(task, 2)
    floor = placement_floor(task, batches)
    rng = np.random.default_rng(2)
    model = TrafficModel(task, plan)
    mean_inter = np.mean([_inter_bytes(model, [_dealt(b, rng) for b in batches])[0] for _ in range(40)])
    # each message is a row id (8 bytes) and its 256-byte gradient, plus one count per peer
    assert floor.expected_bytes <= mean_inter <= 1.08 * floor.expected_bytes


def test_floor_refuses_what_it_does_not_cover():
    pooled = Task("p", 4, 1 << 20, 4, (Table("p", 10, 4, 1.0),), devices_per_host=2)
    with pytest.raises(InputError, match="pooled"):
        placement_floor(pooled, [{"p": (np.arange(4), np.ones(4, dtype=np.int64))}])
    one_host = Task("o", 2, 1 << 20, 4, (Table("s", 10, 4, 1.0, kind="sequence"),))
    with pytest.raises(InputError, match="one host"):
        placement_floor(one_host, [{"s": (np.arange(4), np.ones(4, dtype=np.int64))}])
    two = Task("t", 2, 1 << 20, 4, (Table("s", 10, 4, 1.0, kind="sequence"),), devices_per_host=1)
    with pytest.raises(InputError, match="no batch"):
        placement_floor(two, [{}])
    with pytest.raises(InputError, match="replayed steps"):
        placement_floor(two, [])
