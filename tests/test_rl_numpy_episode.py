"""DreamShard's and AutoShard's planning episodes (argmax and sampled) in numpy
(search/rl/numpy_episode.py) against the torch networks and the torch rollout they stand in
for, and `placement_costs` against `device_costs`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embshard import validate
from embshard.search.rl.env import best_plan, rollout
from embshard.search.rl.nets import AutoShardNet, DreamShardCostNet, DreamShardPolicy, TaskContext, cost_features
from embshard.search.rl.numpy_episode import NumpyAutoShard, NumpyDreamShard, autoshard_supported
from embshard.search.rl.sharders import AutoShardSharder, DreamShardSharder
from test_scale import make_task  # tasks of n random tables on d devices

SHARDERS = {"dreamshard": DreamShardSharder, "autoshard": AutoShardSharder}


def random_nets(seed: int) -> tuple[DreamShardCostNet, DreamShardPolicy]:
    """Networks of the shipped kind with random weights (not just the checkpoint's)."""
    torch.manual_seed(seed)
    costnet = DreamShardCostNet(8, hidden=16, out=6, head_hidden=10, structured_comm=True, volume=(3, 0.5, 2.0))
    policy = DreamShardPolicy(8, hidden=16, out=6, cost_hidden=5, scorer_hidden=7)
    for p in list(costnet.parameters()) + list(policy.parameters()):
        torch.nn.init.normal_(p, std=0.3)
    return costnet, policy


def random_state(width: int, d: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    sums = torch.rand(d, width, generator=g) * 3
    counts = torch.randint(0, 4, (d,), generator=g).float()
    sums[counts == 0] = 0.0
    table = torch.rand(width, generator=g)
    cand = torch.randperm(d, generator=g)[:m]
    return sums, counts, table, cand


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_placement_costs_are_device_costs_of_the_three_blocks_and_numpy_agrees(seed):
    costnet, policy = random_nets(seed)
    fast = NumpyDreamShard(costnet, policy)
    d, m = 9, 5
    with torch.no_grad():
        sums, counts, table, cand = random_state(costnet.width, d, m, seed)
        smax = sums.max(0).values
        c0 = costnet.device_costs(sums, counts)[:, 0]
        task = TaskContext(sums[:, -1].sum()[None], torch.tensor([float(d)]), c0.max()[None])
        s, c = sums[cand][None], counts[cand][None]
        now, taking, taken = costnet.placement_costs(s, c, table, smax[None], task, taken=True)
        total_if = task.total_mb + costnet.encoder.volume_mb(table)
        want_now = costnet.device_costs(s, c, max_sums=smax[None], task=task)
        want_with = costnet.device_costs(s + table, c + 1, max_sums=(smax + table)[None],
                                         task=TaskContext(total_if, task.devices, task.slowest_ms))
        want_taken = costnet.device_costs(s + table, c + 1, max_sums=torch.maximum(smax, s + table),
                                          task=TaskContext(total_if, task.devices, task.slowest_ms))
        for got, want in ((now, want_now), (taking, want_with), (taken, want_taken)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        n_now, n_with = fast.placement(sums[cand].numpy(), counts[cand].numpy(), table.numpy(), smax.numpy(),
                                       float(task.total_mb), d, float(task.slowest_ms))
        # a device once it took the table, priced alone as the episode does
        taken_np = (s + table)[0].numpy()
        n_taken = np.concatenate([
            fast.costs(taken_np[i : i + 1], (c + 1)[0, i : i + 1].numpy(),
                       fast.features(np.maximum(smax.numpy(), taken_np[i])[None]) @ fast.h_ctx,
                       total_if.numpy(), d, float(task.slowest_ms)) for i in range(m)])
        for got, want in ((n_now, want_now), (n_with, want_with), (n_taken, want_taken)):
            np.testing.assert_allclose(got, want[0].numpy(), rtol=1e-4, atol=1e-4)
        # and the policy's logits
        u = torch.rand(m, policy.encoder[-2].out_features)
        tenc = torch.rand(policy.encoder[-2].out_features)
        want = policy.logits(u[None], cost_features(want_now, 2.0), tenc[None], cost_features(want_with, 2.0))[0]
        got = fast.policy_logits(u.numpy(), n_now, n_with, tenc.numpy(), 2.0)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


def test_the_split_policy_logits_equal_the_scorer_on_the_concatenated_inputs():
    """`DreamShardPolicy.logits` applies the table's part of the scorer's first layer once and
    fuses the last layer with the skip path: the same numbers as the scorer on every input."""
    _, policy = random_nets(3)
    with torch.no_grad():
        dev, tab = torch.rand(2, 7, 6), torch.rand(2, 6)
        costs, whatif = torch.rand(2, 7, 6), torch.rand(2, 7, 6)
        parts = [dev, policy.cost_encoder(costs), tab[:, None].expand_as(dev), policy.cost_encoder(whatif)]
        want = (policy.scorer(torch.cat(parts, -1)) + policy.skip(torch.cat([costs, whatif], -1))).squeeze(-1)
        torch.testing.assert_close(policy.logits(dev, costs, tab, whatif), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_numpy_autoshard_costs_and_logits_equal_the_torch_network(seed):
    torch.manual_seed(seed)
    net = AutoShardNet(8, hidden=16, out=6, head_hidden=10, lstm_hidden=7, scorer_hidden=9)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    assert autoshard_supported(net)
    fast = NumpyAutoShard(net)
    with torch.no_grad():
        sums, counts, _, cand = random_state(net.width, 9, 5, seed)
        cost = net.shard_cost(sums, counts)
        np.testing.assert_allclose(fast.shard_cost(sums.numpy(), counts.numpy()), cost.numpy(), rtol=1e-4, atol=1e-5)
        used, state = torch.rand(9), torch.rand(7)
        even, scale = 1.7, 9 / 20
        feats = torch.stack([torch.log1p(cost), cost / even, used], dim=-1)
        want = net.logits(state[None], net.actions(sums * scale, feats)[None], feats[None])[0][cand]
        fast.s, fast.cnt, fast.cost, fast.used = sums.numpy(), counts.numpy(), cost.numpy(), used.numpy()
        fast.h, fast.scale, fast.even = state[None].numpy(), np.float32(scale), np.float32(even)
        np.testing.assert_allclose(fast.logits(0, cand.numpy()), want.numpy(), rtol=1e-4, atol=1e-4)


def groups(devices: torch.Tensor) -> list[tuple[int, ...]]:
    """Tables (placement order) by device, the devices' labels left out."""
    by: dict[int, list[int]] = {}
    for t, dev in enumerate(devices.tolist()):
        by.setdefault(dev, []).append(t)
    return sorted(tuple(v) for v in by.values())


@pytest.mark.parametrize("algorithm", ["dreamshard", "autoshard"])
@pytest.mark.parametrize("n,d,m", [(40, 6, None), (60, 24, 8), (120, 40, 16)])
def test_numpy_episode_places_every_table_where_the_torch_episode_does(algorithm, n, d, m):
    agent = SHARDERS[algorithm](f"checkpoints/{algorithm}_cpu/policy.pt", samples=0).load()
    task = make_task(n, d, seed=n)
    with torch.inference_mode():
        view = agent.prepare(task)
        torch_devices = rollout(agent, view, 1, train=False, sample=False, max_candidates=m).devices[0]
        fast = agent.planning_episodes(view, 0, None, m)
    # the same tables together; which of the identical empty devices takes a group is a tie the
    # kernels' rounding may break either way (torch's too, for rows of one call)
    assert groups(fast.devices[0]) == groups(torch_devices)
    plan = fast.plan(0, algorithm)
    validate(task, plan)
    # the estimate is the agent's estimate of that plan
    assert float(fast.estimated_ms[0]) == pytest.approx(agent.estimate_plan(task, plan), rel=1e-5)


@pytest.mark.parametrize("algorithm", ["dreamshard", "autoshard"])
@pytest.mark.parametrize("n,d,m", [(30, 4, 128), (12, 2, None), (40, 8, 8), (60, 24, 8), (100, 150, 128)])
def test_sampled_episodes_in_numpy_place_every_table_where_the_torch_rollout_does(algorithm, n, d, m):
    """The same noise from the same generator: every sampled episode puts every table on the
    device the torch rollout's does (on all devices by number, and on a lazy step's candidates
    by rank), and the generator is left where the torch rollout leaves it."""
    agent = SHARDERS[algorithm](f"checkpoints/{algorithm}_cpu/policy.pt").load()
    task = make_task(n, d, seed=n + d)
    g_torch, g_numpy = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    with torch.inference_mode():
        view = agent.prepare(task)
        want = rollout(agent, view, 6, train=False, sample=True, argmax_first=True, generator=g_torch, max_candidates=m)
        got = agent.planning_episodes(view, 5, g_numpy, m)
    assert got.devices.shape == want.devices.shape == (6, n)
    assert groups(got.devices[0]) == groups(want.devices[0])  # the argmax episode: up to identical devices
    assert got.devices[1:].tolist() == want.devices[1:].tolist()
    assert len({tuple(r) for r in got.devices[1:].tolist()}) > 1  # the noise does make episodes differ
    assert torch.equal(g_numpy.get_state(), g_torch.get_state())
    torch.testing.assert_close(got.estimated_ms, want.estimated_ms, rtol=1e-5, atol=0)
    for k in range(6):
        validate(task, got.plan(k, algorithm))


@pytest.mark.parametrize("algorithm,cls", [("dreamshard", NumpyDreamShard), ("autoshard", NumpyAutoShard)])
def test_planning_goes_through_numpy_argmax_and_sampled_alike(monkeypatch, algorithm, cls):
    agent = SHARDERS[algorithm](f"checkpoints/{algorithm}_cpu/policy.pt", samples=0).load()
    task = make_task(30, 10)
    calls = []
    for route in ("episode", "sampled"):
        real = getattr(cls, route)
        monkeypatch.setattr(cls, route, lambda self, *a, _r=real, _n=route, **k: calls.append(_n) or _r(self, *a, **k))
    argmax, _ = best_plan(agent, task, 0, algorithm=algorithm, max_candidates=4)
    assert calls == ["episode"]
    best, _ = best_plan(agent, task, 3, generator=torch.Generator().manual_seed(0), algorithm=algorithm, max_candidates=4)
    assert calls == ["episode", "episode", "sampled"]  # the argmax episode, then the sampled ones
    validate(task, argmax)
    validate(task, best)


def test_a_steps_cheapest_devices_are_those_of_the_full_stable_sort():
    """The partition shortcut gives the m cheapest devices in the order of the full stable sort
    (ties: lowest index first), and the rest, asked for lazily, continues it; inf (no room) and
    NaN scores included."""
    from embshard.search.rl.numpy_episode import _cheapest_first, _the_rest

    rng = np.random.default_rng(7)
    for trial in range(300):
        d = int(rng.integers(1, 300))
        score = rng.integers(0, 5, d).astype(float) if trial % 2 else rng.random(d)  # many ties, or none
        score[rng.random(d) < 0.2] = np.inf
        if trial % 7 == 0:
            score[rng.integers(0, d, 2)] = np.nan
        m = int(rng.integers(1, d + 2))
        full = np.argsort(score, kind="stable")
        assert _cheapest_first(score, m).tolist() == full[:m].tolist()
        assert list(_the_rest(score, m)) == full[m:].tolist()


@pytest.mark.parametrize("algorithm", ["dreamshard", "autoshard"])
def test_a_task_without_room_names_the_table_the_torch_rollout_names(algorithm):
    """Memory for exactly the biggest table or an even share: the episodes run out of room at
    different steps, and the error is the torch rollout's (its first failure in step order,
    the argmax episode first at a step), whichever episode the numpy route ran first."""
    import dataclasses

    from embshard.errors import InfeasibleError

    agent = SHARDERS[algorithm](f"checkpoints/{algorithm}_cpu/policy.pt").load()
    task = make_task(40, 4, seed=3)
    need = [task.table_memory_bytes(t) for t in task.tables]
    task = dataclasses.replace(task, device_memory_bytes=int(max(max(need), sum(need) / task.num_devices)))
    with torch.inference_mode():
        view = agent.prepare(task)
        with pytest.raises(InfeasibleError) as want:
            rollout(agent, view, 9, train=False, sample=True, argmax_first=True,
                    generator=torch.Generator().manual_seed(0), max_candidates=128)
        with pytest.raises(InfeasibleError) as got:
            agent.planning_episodes(view, 8, torch.Generator().manual_seed(0), 128)
    assert str(got.value) == str(want.value)
