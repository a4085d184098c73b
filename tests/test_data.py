"""dlrm_datasets reader, synthetic generator, trace replay and task generators."""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from embshard.data import dlrm_datasets
from embshard.data import synthetic as syn
from embshard.data.dlrm_datasets import (
    DlrmDataset,
    aggregate,
    load_trace,
    open_cached,
    read_table_pool,
    trace_stats,
)
from embshard.data.indices import batch_indices
from embshard.data.tasks import (
    DIMS,
    dreamshard_tasks,
    load_pool,
    neuroshard_tasks,
    split_pool,
    table_pool_from_dataset,
)
from embshard.errors import InputError
from embshard.tables import Table, TraceRef
from embshard.task import load_tasks


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "small.pt"
    specs = syn.generate_synthetic(path, num_tables=16, batch_size=512, seed=3)
    return path, specs


@pytest.fixture(scope="module")
def demo_file(tmp_path_factory):
    """The demo scale: 64 tables x batch 4096."""
    path = tmp_path_factory.mktemp("demo") / "demo.pt"
    specs = syn.generate_synthetic(path, num_tables=64, batch_size=4096, seed=0)
    return path, specs


def _save(path, obj):
    torch.save(obj, path)
    return path


def _tiny():
    # table 0: bags [5], [5, 7], []        table 1: bags [200, 200, 200], [3], [0]
    indices = torch.tensor([5, 5, 7, 200, 200, 200, 3, 0], dtype=torch.int64)
    lengths = torch.tensor([[1, 2, 0], [3, 1, 1]], dtype=torch.int64)
    offsets = torch.tensor([0, 1, 3, 3, 6, 7, 8], dtype=torch.int64)
    return indices, offsets, lengths


# ----------------------------------------------------------------------------- reader
@pytest.mark.parametrize("suffix", [".pt", ".pt.gz"])
def test_round_trip_plain_and_gzip(tmp_path, suffix):
    path = tmp_path / f"x{suffix}"
    syn.generate_synthetic(path, num_tables=6, batch_size=128, seed=1)
    raw = path.read_bytes()
    assert (raw[:2] == b"\x1f\x8b") == suffix.endswith(".gz")
    opener = gzip.open if suffix.endswith(".gz") else open
    with opener(path, "rb") as f:
        indices, offsets, lengths = torch.load(f, weights_only=True)
    ds = DlrmDataset.open(path)
    assert (ds.num_tables, ds.batch_size, ds.num_indices) == (6, 128, indices.numel())
    for t in range(6):
        idx, off = ds.trace(t)
        a, b = int(offsets[t * 128]), int(offsets[(t + 1) * 128])
        assert off.shape == (129,) and int(off[0]) == 0 and int(off[-1]) == b - a
        assert torch.equal(idx, indices[a:b])
        assert torch.equal(off[1:] - off[:-1], lengths[t])
        s = ds.table_stats(t)
        assert s.pooling_factor == pytest.approx((b - a) / 128)
        assert s.rows == max(int(indices[a:b].max()) + 1, 100)
        assert sum(s.reuse_histogram) == pytest.approx(1.0)
    # the same statistics from a fresh reduction of the raw tensors
    agg = ds.aggregate_stats()
    assert agg.num_indices == indices.numel()
    assert agg.num_unique == sum(
        torch.unique(indices[int(offsets[t * 128]):int(offsets[(t + 1) * 128])]).numel() for t in range(6)
    )


def test_features_of_hand_built_file(tmp_path):
    path = _save(tmp_path / "tiny.pt", _tiny())
    ds = DlrmDataset.open(path)
    s0, s1 = ds.table_stats(0), ds.table_stats(1)
    assert s0.rows == 100 and s1.rows == 201  # max+1 floored at 100
    assert s0.pooling_factor == pytest.approx(1.0) and s1.pooling_factor == pytest.approx(5 / 3)
    h0 = np.zeros(17); h0[0] = h0[1] = 0.5          # row 7 once, row 5 twice
    h1 = np.zeros(17); h1[0] = 2 / 3; h1[2] = 1 / 3  # rows 3, 0 once; row 200 three times
    np.testing.assert_allclose(s0.reuse_histogram, h0)
    np.testing.assert_allclose(s1.reuse_histogram, h1)
    a1 = np.zeros(17); a1[0] = 2 / 5; a1[2] = 3 / 5
    np.testing.assert_allclose(s1.access_histogram, a1)
    assert (s0.num_unique, s1.num_unique) == (2, 3)
    idx, off = ds.trace(1)
    assert idx.tolist() == [200, 200, 200, 3, 0] and off.tolist() == [0, 3, 4, 5]
    # declared hash sizes override the derived rows, and must hold every index
    assert DlrmDataset.open(path, hash_sizes=[10, 1000]).table_stats(1).rows == 1000
    with pytest.raises(InputError, match="hash size"):
        DlrmDataset.open(path, hash_sizes=[6, 1000]).table_stats(0)
    t0, t1 = ds.tables(dim=16, prefix="x")
    assert (t0.name, t0.dim, t0.rows, t0.trace) == ("x0", 16, 100, TraceRef(str(path.resolve()), 0))
    assert t1.reuse_histogram == pytest.approx(tuple(h1))


def _bad(tmp_path, name, obj):
    return _save(tmp_path / name, obj)


@pytest.mark.parametrize(
    "case, match",
    [
        ("two_items", "got 2 items"),
        ("not_tuple", "expected a tuple"),
        ("lengths_rank", "lengths must have rank 2"),
        ("indices_rank", "indices must have rank 1"),
        ("float_indices", "integer tensor"),
        ("offsets_len", "expected T\\*B\\+1"),
        ("not_monotone", "not monotone"),
        ("last_offset", "offsets\\[-1\\]"),
        ("negative", "negative indices"),
        ("lengths_mismatch", "disagrees"),
    ],
)
def test_wrong_shapes_are_one_line_input_errors(tmp_path, case, match):
    i, o, l = _tiny()
    obj = {
        "two_items": (i, o),
        "not_tuple": {"indices": i},
        "lengths_rank": (i, o, l.reshape(-1)),
        "indices_rank": (i.reshape(2, 4), o, l),
        "float_indices": (i.float(), o, l),
        "offsets_len": (i, o[:-1], l),
        "not_monotone": (i, torch.tensor([0, 1, 3, 2, 6, 7, 8]), torch.tensor([[1, 2, -1], [4, 1, 1]])),
        "last_offset": (i[:-1], o, l),
        "negative": (torch.tensor([5, 5, 7, 200, 200, 200, 3, -1]), o, l),
        "lengths_mismatch": (i, o, torch.tensor([[1, 2, 0], [3, 1, 2]])),
    }[case]
    path = _bad(tmp_path, f"{case}.pt", obj)
    with pytest.raises(InputError, match=match) as e:
        DlrmDataset.open(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bags", [3, 7, 1 << 22], ids=["a-table-a-chunk", "chunks-across-tables", "one-chunk"])
def test_the_first_table_with_faulty_offsets_is_named_whatever_the_chunks(tmp_path, monkeypatch, bags):
    """Offsets are checked a chunk of bags at a time: the error names the first faulty table
    (here a wrong length in table 1, offsets decreasing in table 3), as one table at a time would."""
    monkeypatch.setattr(dlrm_datasets, "VALIDATE_BAGS", bags)
    lengths = torch.ones(4, 3, dtype=torch.int64)
    offsets = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 10, 12])  # table 1, bag 1: 2 long; table 3 decreases
    indices = torch.zeros(12, dtype=torch.int64)
    path = _bad(tmp_path, "two_faults.pt", (indices, offsets, lengths.clone()))
    with pytest.raises(InputError, match=r"lengths\[1, 1\] = 1 disagrees with the offsets \(2\)"):
        DlrmDataset.open(path)
    lengths[1, 1] = 2  # table 1 now right
    path = _bad(tmp_path, "one_fault.pt", (indices, offsets, lengths))
    with pytest.raises(InputError, match="offsets decrease at table 3, bag 1"):
        DlrmDataset.open(path)


def test_truncated_and_foreign_files(tmp_path, small_file):
    src, _ = small_file
    gz = tmp_path / "t.pt.gz"
    with gzip.open(gz, "wb", compresslevel=1) as f:
        f.write(src.read_bytes())
    data = gz.read_bytes()
    (tmp_path / "trunc.pt.gz").write_bytes(data[: len(data) // 2])
    raw = src.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "junk.pt").write_bytes(b"this is not a torch file at all")
    (tmp_path / "pickle.pt").write_bytes(__import__("pickle").dumps(object, protocol=2))
    assert DlrmDataset.open(gz).num_tables == 16  # the intact gzip copy reads
    for name in ("trunc.pt.gz", "trunc.pt", "junk.pt", "pickle.pt", "missing.pt"):
        with pytest.raises(InputError) as e:
            DlrmDataset.open(tmp_path / name)
        assert name in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- replay
def test_trace_replay(small_file):
    path, _ = small_file
    ds = DlrmDataset.open(path)
    table = ds.tables(dim=8)[2]
    idx, off = ds.trace(2)
    bags = {tuple(idx[off[b]:off[b + 1]].tolist()) for b in range(ds.batch_size)}
    rng = np.random.default_rng(0)
    i1, o1 = batch_indices(table, 300, rng)
    assert i1.dtype == o1.dtype == torch.int64
    assert o1.shape == (301,) and int(o1[0]) == 0 and int(o1[-1]) == i1.numel()
    assert all(tuple(i1[o1[b]:o1[b + 1]].tolist()) in bags for b in range(300))  # real bags
    i2, o2 = batch_indices(table, 300, rng)
    assert not (torch.equal(o1, o2) and torch.equal(i1, i2))  # fresh per call
    i3, _ = batch_indices(table, 300, rng, rows=7)  # row-wise shard
    assert int(i3.max()) < 7 and int(i3.min()) >= 0
    # load_trace reads the file once per process
    assert open_cached(path) is open_cached(str(path))
    li, lo = load_trace(table.trace)
    assert torch.equal(li, idx) and torch.equal(lo, off)


def test_cost_models_see_a_trace_as_it_is_replayed(small_file, tmp_path):
    """A replay draws bags with replacement, so at 4x the trace's bags every touched row is read
    about four times as often as the trace's own histogram says: the histogram the cost models
    see (`replayed_table`, `planning_view`, the collector's `piece_record`) is the replay's."""
    from embshard.costs.collect.records import piece_record
    from embshard.costs.features import planning_view, replayed_table
    from embshard.plan import Shard
    from embshard.task import Task

    path, _ = small_file
    ds = DlrmDataset.open(path)
    n = ds.batch_size
    tables = [t for t in ds.tables(dim=8) if ds.table_stats(int(t.trace.table_index)).num_unique > 500][:4]
    assert len(tables) >= 2
    for ratio in (1, 4):
        for table in tables:
            want = replayed_table(table, ratio * n).reuse_histogram
            got = np.zeros(17)
            for seed in range(3):  # what the measured evaluator runs: batch_indices' replay
                idx, _ = batch_indices(table, ratio * n, np.random.default_rng(seed))
                got += trace_stats(idx, ratio * n).reuse_histogram
            tv, _ = syn.histogram_distances(got, want)
            stale, _ = syn.histogram_distances(got, table.reuse_histogram)
            assert tv < 0.04, (ratio, table.name, tv)
            assert stale > 2 * tv + 0.05, (ratio, table.name, stale, tv)  # the trace's own histogram is not it
            # without a histogram the trace's access counts give the same (exact per row)
            bare = replayed_table(replace(table, reuse_histogram=None), ratio * n).reuse_histogram
            assert syn.histogram_distances(bare, want)[0] < 0.03
    task = Task("t", 2, 10**9, 4 * n, tuple(tables) + (Table("free", 1000, 8, 2.0),))
    view, imputed = planning_view(task)
    assert [t.reuse_histogram for t in view.tables[:-1]] == [replayed_table(t, 4 * n).reuse_histogram for t in tables]
    assert imputed == ["free"]
    given, _ = planning_view(task, replay_traces=False)  # the behaviour before 2026-11-27, for comparisons
    assert [t.reuse_histogram for t in given.tables[:-1]] == [t.reuse_histogram for t in tables]
    rec = piece_record(tables[0], Shard(tables[0].name, 0, 0, 8, 0, tables[0].rows), 4 * n)
    assert rec["reuse_histogram"] == pytest.approx(list(view.tables[0].reuse_histogram))
    # a trace that cannot be read: the histogram as given, and a warning naming the table
    lost = replace(tables[0], name="lost", trace=TraceRef(str(tmp_path / "gone.pt"), 0))
    with pytest.warns(UserWarning, match="'lost': its trace cannot be read"):
        assert replayed_table(lost, 4 * n).reuse_histogram == tables[0].reuse_histogram


def test_draw_without_trace_matches_features(demo_file):
    path, _ = demo_file
    ds = DlrmDataset.open(path)
    B = ds.batch_size
    checked = 0
    for t in range(ds.num_tables):
        s = ds.table_stats(t)
        if s.num_unique < 2000:
            continue
        table = Table(f"free{t}", s.rows, 8, s.pooling_factor, s.reuse_histogram)
        idx, off = batch_indices(table, B, np.random.default_rng(t))
        assert off.shape == (B + 1,) and int(off[-1]) == idx.numel()
        assert 0 <= int(idx.min()) and int(idx.max()) < s.rows
        got = trace_stats(idx, B)
        assert got.pooling_factor == pytest.approx(s.pooling_factor, rel=0.1)
        tv, _ = syn.histogram_distances(got.reuse_histogram, s.reuse_histogram)
        assert tv < 0.12, (t, tv)
        checked += 1
        if checked == 6:
            break
    assert checked >= 3
    # hot rows sit at stable, per-table ids: same name -> same hot row
    r, _ = syn.expected_table_bins(10**6, 1.2, math.exp(syn.DEFAULT_PARAMS.log_q), 20.0 * 2048)
    table = Table("fixed", 10**6, 8, 20.0, tuple(r / r.sum()))  # a skewed table
    hot = [int(np.bincount(batch_indices(table, 2048, np.random.default_rng(k))[0].numpy()).argmax())
           for k in range(2)]
    assert hot[0] == hot[1]


# ----------------------------------------------------------------------------- generator
def test_generator_is_seeded_and_validates(tmp_path):
    a, b, c = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "c.pt"
    syn.generate_synthetic(a, 4, 64, seed=5)
    syn.generate_synthetic(b, 4, 64, seed=5)
    syn.generate_synthetic(c, 4, 64, seed=6)
    ta, tb, tc = (torch.load(p, weights_only=True) for p in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(ta, tb))
    assert not torch.equal(ta[0], tc[0])
    for kw in ({"num_tables": 0}, {"batch_size": -1}, {"scale": 0.0}, {"scale": 2.0}):
        with pytest.raises(InputError):
            syn.generate_synthetic(tmp_path / "bad.pt", **{"num_tables": 4, "batch_size": 8, **kw})
    assert not (tmp_path / "bad.pt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_generator_is_heavy_tailed(demo_file):
    specs = syn.draw_table_specs(856, seed=0)
    rows = np.array([s.rows for s in specs])
    pf = np.array([s.pooling_factor for s in specs])
    assert rows.min() <= 300 and rows.max() >= 1e7
    assert pf.min() <= 1.0 and pf.max() >= 100
    assert (pf <= 1.0).mean() > 0.1 and (pf >= 20).mean() > 0.1
    assert np.std([s.zipf for s in specs]) > 0.1
    assert pf.mean() == pytest.approx(syn.TARGET_POOLING_FACTOR, rel=1e-3)
    # as the reader sees the demo file
    path, _ = demo_file
    ds = DlrmDataset.open(path)
    st = [ds.table_stats(t) for t in range(ds.num_tables)]
    r = np.array([s.rows for s in st])
    p = np.array([s.pooling_factor for s in st if s.pooling_factor > 0])
    assert r.max() / r.min() > 1000
    assert p.max() / p.min() > 30
    assert len({round(s.pooling_factor, 2) for s in st}) > 50  # not all alike


def test_sampler_agrees_with_model(demo_file):
    """The sampled file (reduced by the reader's code) matches the model's expectation."""
    path, specs = demo_file
    ds = DlrmDataset.open(path)
    emp = ds.aggregate_stats()
    # the model at each table's realised number of accesses (bag lengths are random, and a
    # shift of all of a small table's rows across a bin edge is noise, not disagreement)
    realised = [replace(sp, pooling_factor=ds.table_stats(t).pooling_factor) for t, sp in enumerate(specs)]
    model = syn.expected_stats(realised, ds.batch_size)
    assert emp.num_indices == pytest.approx(model.num_indices, rel=0.02)
    assert emp.num_unique == pytest.approx(model.num_unique, rel=0.02)
    assert syn.histogram_distances(emp.row_histogram, model.row_histogram)[0] < 0.01
    assert syn.histogram_distances(emp.access_histogram, model.access_histogram)[0] < 0.03


def test_calibrated_to_published_statistics():
    """At full scale (856 x 65536) the model reproduces fbgemm_t856_bs65536's statistics."""
    specs = syn.draw_table_specs(856, seed=0)
    full = syn.expected_stats(specs, 65536, ratio=1.08)
    assert full.indices_per_bag == pytest.approx(15.81, rel=0.01)
    assert full.num_unique == pytest.approx(syn.TARGET_NUM_UNIQUE, rel=0.1)
    tv_r, mx_r = syn.histogram_distances(full.row_histogram, syn.TARGET_ROW_HISTOGRAM)
    tv_a, mx_a = syn.histogram_distances(full.access_histogram, syn.TARGET_ACCESS_HISTOGRAM)
    assert tv_r < 0.06 and mx_r < 0.04, (tv_r, mx_r)
    assert tv_a < 0.10 and mx_a < 0.04, (tv_a, mx_a)
    # and a sampled full-batch slice of the tables agrees with the model's expectation
    sub = specs[::107]  # 8 tables of the 856, full batch
    emp = aggregate((trace_stats(idx, 65536) for _, _, idx in _stream(sub, 65536)), 65536)
    model = syn.expected_stats(sub, 65536)
    assert emp.num_unique == pytest.approx(model.num_unique, rel=0.03)
    assert syn.histogram_distances(emp.access_histogram, model.access_histogram)[0] < 0.03


def _stream(specs, batch):
    for t, spec in enumerate(specs):
        lengths, idx = syn.table_trace(spec, batch, np.random.default_rng(t))
        yield spec, lengths, idx


# ----------------------------------------------------------------------------- tasks
@pytest.fixture(scope="module")
def pool(demo_file, tmp_path_factory):
    path, _ = demo_file
    out = tmp_path_factory.mktemp("pool") / "pool.json"
    entries = table_pool_from_dataset(path, out=out)
    assert read_table_pool(out) == json.loads(out.read_text()) == entries
    return out


def test_neuroshard_tasks(pool, tmp_path):
    entries = read_table_pool(pool)
    cap = 2 << 30
    tasks = neuroshard_tasks(pool, 12, min_tables=10, max_tables=30, max_total_bytes=cap,
                             num_devices=[2, 4], batch_size=1024, seed=7, out_dir=tmp_path)
    assert len(tasks) == 12
    by_name = {e["name"]: e for e in entries}
    for t in tasks:
        assert 10 <= len(t.tables) <= 30
        assert all(tb.dim in DIMS for tb in t.tables)
        assert sum(tb.size_bytes for tb in t.tables) <= cap
        assert len({tb.name for tb in t.tables}) == len(t.tables)
        assert t.num_devices in (2, 4) and t.batch_size == 1024
        for tb in t.tables:
            assert tb.trace is not None and tb.rows == by_name[tb.name]["rows"]
        assert sum(t.table_memory_bytes(tb) for tb in t.tables) <= t.num_devices * t.device_memory_bytes
    assert len({len(t.tables) for t in tasks}) > 1
    assert len({tb.dim for t in tasks for tb in t.tables}) == len(DIMS)
    again = load_tasks(tmp_path)
    assert [t.to_dict() for t in again] == [t.to_dict() for t in tasks]
    same = neuroshard_tasks(pool, 12, min_tables=10, max_tables=30, max_total_bytes=cap,
                            num_devices=[2, 4], batch_size=1024, seed=7)
    assert [t.to_dict() for t in same] == [t.to_dict() for t in tasks]
    # replay works from a task table
    tb = tasks[0].tables[0]
    idx, off = batch_indices(tb, 64, np.random.default_rng(0))
    assert off.shape == (65,) and (idx.numel() == 0 or int(idx.max()) < tb.rows)


def test_table_draw_keeps_room_under_a_cap_the_random_draws_cannot_meet(pool):
    """A cap that the n smallest tables at the smallest dim just meet: random draws (random
    dims, taken in a random order) practically never end with n tables, the draw that keeps room
    for the rest always does, within the cap, n distinct tables; 1 byte less and it names the
    n smallest tables' bytes and the excess."""
    from embshard.data.tasks import _draw_tables

    entries = read_table_pool(pool)
    n = len(entries) - 2
    dims = tuple(sorted(DIMS))
    smallest = sorted(e["rows"] * dims[0] * int(e.get("bytes_per_element", 4)) for e in entries)
    cap = sum(smallest[:n])
    for seed in range(3):
        tables = _draw_tables(entries, n, dims, cap, np.random.default_rng(seed), attempts=0)
        assert len(tables) == n and len({t.name for t in tables}) == n
        assert sum(t.size_bytes for t in tables) <= cap
    again = _draw_tables(entries, n, dims, cap, np.random.default_rng(0), attempts=5)
    assert [t.to_dict() for t in again] == [t.to_dict() for t in
                                            _draw_tables(entries, n, dims, cap, np.random.default_rng(0), attempts=5)]
    with pytest.raises(InputError, match=rf"the {n} smallest at dim {dims[0]} take {cap} bytes, 1 over it"):
        _draw_tables(entries, n, dims, cap - 1, np.random.default_rng(0), attempts=5)
    free = _draw_tables(entries, n, dims, None, np.random.default_rng(0), attempts=0)  # no cap: any n tables
    assert len({t.name for t in free}) == n
    with pytest.raises(InputError, match=rf"cannot draw {len(entries) + 1} tables from a pool of {len(entries)}$"):
        _draw_tables(entries, len(entries) + 1, dims, None, np.random.default_rng(0), attempts=0)


@pytest.mark.parametrize("kw", [
    {"num_tasks": 0}, {"min_tables": 20, "max_tables": 10}, {"min_tables": 1000},
    {"dims": [3]}, {"max_total_bytes": -5}, {"max_total_bytes": 10}, {"num_devices": 0},
    {"batch_size": 0},
])
def test_task_generator_rejects_bad_inputs(pool, kw):
    args = {"num_tasks": 2, **kw}
    with pytest.raises(InputError):
        neuroshard_tasks(pool, **args)


def test_dreamshard_split_is_disjoint(pool, tmp_path):
    entries = load_pool(pool)
    out = dreamshard_tasks(pool, tmp_path, num_train_tasks=5, num_test_tasks=4,
                           min_tables=5, max_tables=12, num_devices=2, batch_size=512, seed=3)
    split = json.loads((tmp_path / "split.json").read_text())
    train, test = set(split["train"]), set(split["test"])
    assert train and test and not (train & test)
    assert train | test == {e["name"] for e in entries}
    assert len(list((tmp_path / "train").glob("*.json"))) == 5
    assert len(list((tmp_path / "test").glob("*.json"))) == 4
    for t in load_tasks(tmp_path / "train"):
        assert {tb.name for tb in t.tables} <= train
    for t in load_tasks(tmp_path / "test"):
        assert {tb.name for tb in t.tables} <= test
    a, b = split_pool(pool, seed=3)
    assert [e["name"] for e in a] == split["train"]
    c, _ = split_pool(pool, seed=4)
    assert [e["name"] for e in c] != split["train"]


def test_clis(tmp_path, small_file):
    from embshard.data import synthetic, tasks

    f = tmp_path / "cli.pt.gz"
    assert synthetic.main([str(f), "--num-tables", "12", "--batch-size", "64"]) == 0
    assert DlrmDataset.open(f).num_tables == 12
    assert synthetic.main([str(tmp_path / "x.pt"), "--num-tables", "0"]) == 2
    pj = tmp_path / "pool.json"
    assert tasks.main(["pool", str(f), "--out", str(pj)]) == 0
    assert tasks.main(["neuroshard", "--pool", str(pj), "--out", str(tmp_path / "ns"),
                       "--num-tasks", "3", "--min-tables", "2", "--max-tables", "5",
                       "--batch-size", "128"]) == 0
    assert len(load_tasks(tmp_path / "ns")) == 3
    assert tasks.main(["dreamshard", "--pool", str(pj), "--out", str(tmp_path / "ds"),
                       "--num-train", "2", "--num-test", "2", "--min-tables", "2",
                       "--max-tables", "4", "--batch-size", "128"]) == 0
    assert tasks.main(["neuroshard", "--pool", str(tmp_path / "nope.json"), "--out",
                       str(tmp_path / "x")]) == 2
