"""Cost-data collection: samples, resumption, ranks, merge, validation (costs/collect.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from embshard.costs import collect as col
from embshard.costs.collect import collect, load_samples, merge
from embshard.errors import InputError
from embshard.hardware.comm import CommResult

ROOT = Path(__file__).resolve().parents[1]
POOL = [
    dict(name=f"t{i}", rows=500 * (i + 1), pooling_factor=2.0 + i,
         reuse_histogram=[0.6, 0.3, 0.1] + [0.0] * 14)
    for i in range(8)
]


def tiny(**over):
    cfg = {
        "batch_size": 64,
        "progress": False,
        "holdout": {"fraction": 0.25, "sample_share": 0.3, "seed": 1},
        "measure": {"warmups": 1, "repetitions": 2, "visits": 1, "comm_warmups": 1, "comm_repetitions": 2,
                    "probe": False},
        "compute": {"num_samples": 12, "chunk_size": 4, "max_tables": 5, "max_bytes": 1 << 20},
        "comm": {"num_samples": 4, "chunk_size": 2, "min_devices": 2, "max_devices": 3, "max_delay_ms": 1.0},
    }
    for k, v in over.items():
        if isinstance(v, dict):
            cfg[k] = {**cfg.get(k, {}), **v}
        else:
            cfg[k] = v
    return cfg


@pytest.fixture
def fake_comm(monkeypatch):
    """measure_comm without processes: widths-dependent fake timings (fast, deterministic)."""
    calls = []

    def fake(configs, batch_size, protocol=None, backend="gloo", timeout_s=None, progress=False):
        calls.append(len(configs[0].widths))
        out = []
        for c in configs:
            fw = [1.0 + w / 100 + max(c.delays_ms) - d for w, d in zip(c.widths, c.delays_ms)]
            bw = [1.0 + w / 100 for w in c.widths]
            z = [0.0] * len(c.widths)
            out.append(CommResult(fw, bw, list(z), list(z), [[x] for x in fw], [[x] for x in bw]))
        return out

    monkeypatch.setattr("embshard.hardware.comm.measure_comm", fake)
    return calls


def inputs(samples):
    """What a sample is *of* (not its timing): comparable between runs."""
    out = []
    for s in samples:
        if s["kind"] == "compute":
            out.append((s["id"], s["split"], json.dumps(s["tables"], sort_keys=True)))
        else:
            out.append((s["id"], tuple(s["widths"]), tuple(s["delays_ms"])))
    return out


@pytest.mark.slow
# ----------------------------------------------------------------------------- real measurement
def test_collects_real_compute_and_comm_samples(tmp_path):
    cfg = tiny(comm={"num_samples": 2, "chunk_size": 2, "min_devices": 3, "max_devices": 3, "max_delay_ms": 30.0})
    got = collect(cfg, tmp_path, POOL)
    assert got.new_samples == {"compute": 12, "comm": 2}
    m = merge(tmp_path)
    assert (m.num_compute, m.num_comm, m.duplicates) == (12, 2, 0)
    comp = load_samples(m.compute)
    names = {e["name"]: e for e in POOL}
    prof = json.loads((tmp_path / "profile.json").read_text())
    test_tables = set(prof["pool"]["test_tables"])
    assert len(test_tables) == 2 and prof["hardware"]["backend"] == "fbgemm"
    assert prof["hardware"]["device_name"] and prof["hardware"]["versions"]["torch"]
    assert prof["hardware"]["batch_size"] == 64
    for s in comp:
        assert s["kind"] == "compute" and s["batch_size"] == 64
        assert 1 <= len(s["tables"]) <= 5
        assert s["median_ms"] > 0 and len(s["samples_ms"]) == 2
        assert sum(t["rows"] * t["dim"] * 4 for t in s["tables"]) <= 1 << 20 or len(s["tables"]) == 1
        for t in s["tables"]:
            assert t["rows"] == names[t["name"]]["rows"] and t["dim"] % 4 == 0
            assert t["reuse_histogram"] == names[t["name"]]["reuse_histogram"]
        in_test = {t["name"] in test_tables for t in s["tables"]}
        assert in_test == {s["split"] == "test"}, "a sample mixes held-out and training tables"
    comm = load_samples(m.comm)
    for s in comm:
        assert s["num_devices"] == 3 and len(s["widths"]) == 3 and len(s["forward_ms"]) == 3
        assert min(s["delays_ms"]) == 0.0 and max(s["delays_ms"]) < 30.0
        assert all(x > 0 for x in s["forward_ms"] + s["backward_ms"])
        # the device that enters first waits for the slowest: its forward time includes that
        first, last = int(np.argmin(s["delays_ms"])), int(np.argmax(s["delays_ms"]))
        gap = s["delays_ms"][last]
        if gap > 8:
            assert s["forward_ms"][first] >= s["forward_ms"][last] + 0.5 * gap
    assert max(max(s["delays_ms"]) for s in comm) > 8  # the check above ran


# ----------------------------------------------------------------------------- resume
def test_resume_after_interruption_gives_the_uninterrupted_samples(tmp_path, fake_comm):
    full = tmp_path / "full"
    collect(tiny(), full, POOL)
    want = inputs(load_samples(merge(full).compute)) + inputs(load_samples(full / "comm.jsonl"))

    run = tmp_path / "killed"

    def kill_after_two(kind, chunk, path):
        assert path.is_file()
        if len(list(run.glob("*/*.jsonl"))) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collect(tiny(), run, POOL, on_chunk=kill_after_two)
    assert len(list(run.glob("*/*.jsonl"))) == 2
    assert not list(run.glob("*/.*")), "a temporary file was left behind"
    part = collect(tiny(), run, POOL, max_chunks=1)
    assert sum(part.new_chunks.values()) == 1 and sum(part.skipped_chunks.values()) == 2
    rest = collect(tiny(), run, POOL)
    assert sum(rest.new_chunks.values()) == 2 and sum(rest.skipped_chunks.values()) == 3
    again = collect(tiny(), run, POOL)
    assert sum(again.new_chunks.values()) == 0
    m = merge(run)
    got = inputs(load_samples(m.compute)) + inputs(load_samples(m.comm))
    assert m.duplicates == 0 and len(got) == len(set(got)) == 16
    assert got == want


def test_more_samples_later_only_adds_chunks(tmp_path, fake_comm):
    collect(tiny(), tmp_path, POOL)
    before = inputs(load_samples(merge(tmp_path).compute))
    got = collect(tiny(compute={"num_samples": 20}), tmp_path, POOL)
    assert got.new_chunks == {"compute": 2, "comm": 0}
    after = inputs(load_samples(merge(tmp_path).compute))
    assert after[: len(before)] == before and len(after) == 20


def test_mismatching_profile_is_rejected(tmp_path, fake_comm):
    collect(tiny(compute={"num_samples": 4}), tmp_path, POOL)
    with pytest.raises(InputError, match="batch_size"):
        collect(tiny(batch_size=128), tmp_path, POOL)
    with pytest.raises(InputError, match="backend"):
        collect(tiny(backend="torch"), tmp_path, POOL)
    other_pool = [dict(e, rows=e["rows"] + 1) for e in POOL]
    with pytest.raises(InputError, match="pool"):
        collect(tiny(), tmp_path, other_pool)


# ----------------------------------------------------------------------------- ranks
def test_two_ranks_write_disjoint_files_and_merge_to_the_single_rank_set(tmp_path, fake_comm, monkeypatch):
    single = tmp_path / "single"
    collect(tiny(comm={"rank0_only": False}), single, POOL)
    want = inputs(load_samples(merge(single).compute)) + inputs(load_samples(single / "comm.jsonl"))

    both = tmp_path / "ranks"
    files = {}
    for r in (0, 1):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", str(r))
        got = collect(tiny(comm={"rank0_only": False}), both, POOL)
        assert got.rank == r and got.world_size == 2
        files[r] = {p.relative_to(both) for p in both.glob("*/*.jsonl")} - files.get(0, set())
    assert files[0] and files[1] and not (files[0] & files[1])
    assert all(p.name.startswith("rank00-") for p in files[0])
    assert all(p.name.startswith("rank01-") for p in files[1])
    m = merge(both)
    got = inputs(load_samples(m.compute)) + inputs(load_samples(m.comm))
    assert got == want and m.duplicates == 0


def test_comm_chunks_stay_on_rank0_by_default(tmp_path, fake_comm):
    got = collect(tiny(), tmp_path, POOL, rank=1, world_size=2)
    assert got.new_chunks["comm"] == 0 and got.new_chunks["compute"] == 1
    got0 = collect(tiny(), tmp_path, POOL, rank=0, world_size=2)
    assert got0.new_chunks == {"compute": 2, "comm": 2}


# ----------------------------------------------------------------------------- merge / validation
def test_merge_drops_duplicate_samples(tmp_path, fake_comm):
    collect(tiny(), tmp_path, POOL)
    src = sorted((tmp_path / "compute").glob("*.jsonl"))[0]
    shutil.copy(src, src.with_name(src.name.replace("rank00", "rank05")))
    m = merge(tmp_path)
    assert m.num_compute == 12 and m.duplicates == 4
    ids = [s["id"] for s in load_samples(m.compute)]
    assert len(ids) == len(set(ids))


def test_truncated_or_corrupted_data_is_a_one_line_input_error(tmp_path, fake_comm):
    collect(tiny(), tmp_path, POOL)
    chunk = sorted((tmp_path / "compute").glob("*.jsonl"))[1]
    text = chunk.read_text()
    chunk.write_text(text[: len(text) - 40])  # killed mid-write by something non-atomic
    with pytest.raises(InputError, match=rf"{chunk.name}:4: truncated") as e:
        merge(tmp_path)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match=chunk.name):
        collect(tiny(), tmp_path, POOL)  # resuming over a damaged chunk names it
    lines = text.splitlines(keepends=True)
    chunk.write_text(lines[0] + "{not json\n" + "".join(lines[2:]))
    with pytest.raises(InputError, match=rf"{chunk.name}:2: not valid JSON"):
        merge(tmp_path)
    bad = json.loads(lines[0])
    bad["median_ms"] = -1
    chunk.write_text(json.dumps(bad) + "\n" + "".join(lines[1:]))
    with pytest.raises(InputError, match=rf"{chunk.name}:1: bad sample: 'median_ms'"):
        merge(tmp_path)
    chunk.write_text(text)
    m = merge(tmp_path)
    merged = m.comm.read_text().splitlines()
    s = json.loads(merged[1])
    s["forward_ms"] = s["forward_ms"][:-1]
    m.comm.write_text(merged[0] + "\n" + json.dumps(s) + "\n")
    with pytest.raises(InputError, match=r"comm.jsonl:2: bad sample: 'forward_ms' has"):
        load_samples(m.comm)
    with pytest.raises(InputError, match="a compute sample in a comm file"):
        load_samples(m.compute.rename(tmp_path / "x.jsonl").parent / "x.jsonl", kind="comm")
    with pytest.raises(InputError, match="no such sample file"):
        load_samples(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------------- draws, pool, config
def test_augmented_pool_has_every_dim_and_column_halves():
    aug = col.augmented_pool(POOL, dims=[16, 64], tables=["t1", "t2", "t3"], exclude_tables=["t2"])
    assert sorted({t.name for t in aug}) == ["t1", "t3"]
    assert sorted({t.dim for t in aug}) == [8, 16, 32, 64]
    assert len(aug) == 8 and all(t.pooling_factor in (3.0, 5.0) for t in aug)
    assert col.table_dims([4, 8, 16]) == [4, 8, 16]  # 2 is no FBGEMM width
    assert col.table_dims([24], column_halves=False) == [24]
    with pytest.raises(InputError, match="not in the pool"):
        col.augmented_pool(POOL, tables=["nope"])
    with pytest.raises(InputError, match="no pool tables left"):
        col.augmented_pool(POOL, tables=["t1"], exclude_tables=["t1"])


def test_compute_draws_respect_the_cap_and_make_column_pairs():
    rng = np.random.default_rng(0)
    big = [dict(name=f"b{i}", rows=100_000, pooling_factor=1.0) for i in range(30)]
    pairs = 0
    for _ in range(200):
        n = int(rng.integers(1, 16))
        s = col.draw_compute_shard(big, [4, 8, 16, 32, 64, 128], n, 64 << 20, 0.3, rng)
        assert 1 <= len(s) <= n
        assert sum(sh.rows * sh.dim * 4 for _, sh in s) <= 64 << 20
        names = [t.name for t, _ in s]
        for name in set(names):
            same = [(t, sh) for t, sh in s if t.name == name]
            assert len(same) in (1, 2)
            if len(same) == 2:
                pairs += 1
                (a, sa), (b, sb) = same
                assert a is b and sa.dim == sb.dim == a.dim // 2 and {sa.col_offset, sb.col_offset} == {0, a.dim // 2}
    assert pairs > 10


def test_broad_draws_mix_generated_tables_row_blocks_and_the_lookup_cap():
    from embshard.costs.features import with_histogram

    rng = np.random.default_rng(1)
    pool = [dict(name=f"p{i}", rows=50_000, pooling_factor=2.0) for i in range(40)]
    gen = dict(min_rows=1000, max_rows=100_000, max_pooling=50.0, onehot_share=0.1, histogram_share=0.5)
    seen = {"pool": 0, "generated": 0, "row": 0, "no_hist": 0}
    for k in range(60):
        s = col.draw_compute_shard(pool, [8, 16, 32], 12, 1 << 30, 0.0, rng, batch_size=4096, generated=gen,
                                   pool_share=0.3, row_piece_prob=0.3, max_lookups=2e5, prefix=f"g{k}-")
        lookups = sum(t.pooling_factor * sh.rows / t.rows * 4096 for t, sh in s)
        assert lookups <= 2e5 or len(s) == 1
        for t, sh in s:
            seen["pool" if t.name.startswith("p") else "generated"] += 1
            seen["no_hist"] += t.reuse_histogram is None
            if sh.rows < t.rows:
                seen["row"] += 1
                rec = col.piece_record(t, sh, 4096)
                # a row block serves its share of the lookups and keeps the table's histogram
                assert rec["rows"] == sh.rows and rec["pooling_factor"] == pytest.approx(t.pooling_factor * sh.rows / t.rows)
                assert tuple(rec["reuse_histogram"]) == with_histogram(t, 4096)[0].reuse_histogram
                assert rec.get("histogram_imputed", False) == (t.reuse_histogram is None)
    assert min(seen.values()) > 5, seen


def test_comm_draws_cover_many_devices_and_both_placements():
    rng = np.random.default_rng(3)
    spreads = []
    for d in (2, 4, 16):
        for _ in range(50):
            w = col.draw_widths(d, [4, 8, 16, 32, 64, 128], [2.0, 15.0], rng)
            assert len(w) == d and sum(w) >= 8 and all(x % 4 == 0 for x in w)
            spreads.append((max(w) - min(w)) / max(1, np.mean(w)))
            delays = col.draw_delays(d, 20.0, rng)
            assert len(delays) == d and min(delays) == 0.0 and max(delays) < 20.0
    assert min(spreads) < 0.2 and max(spreads) > 1.0  # near-balanced and lopsided both occur


def test_bad_config_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="unknown setting 'batchsize'"):
        collect({"batchsize": 3}, tmp_path, POOL)
    with pytest.raises(InputError, match="compute: unknown setting"):
        collect({"compute": {"tables": 3}}, tmp_path, POOL)
    with pytest.raises(InputError, match="min_devices"):
        collect(tiny(comm={"min_devices": 1}), tmp_path, POOL)
    with pytest.raises(InputError, match="dims"):
        collect(tiny(compute={"dims": [6]}), tmp_path, POOL)
    with pytest.raises(InputError, match="no table pool"):
        collect(tiny(), tmp_path)
    with pytest.raises(InputError, match="not in a world"):
        collect(tiny(), tmp_path, POOL, rank=2, world_size=2)
    with pytest.raises(InputError, match="no cost-data profile"):
        merge(tmp_path / "empty")


def test_shipped_configs_resolve():
    from hydra import compose, initialize_config_dir

    # `collect=NAME` when train.yaml lists the group in its defaults, else `+collect=NAME`
    plus = "" if "- collect:" in (ROOT / "conf" / "train.yaml").read_text() else "+"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        got = {name: col.resolve_config(compose(config_name="train", overrides=[f"{plus}collect={name}"]).collect)
               for name in ("cpu", "gpu", "tiny")}
    assert got["cpu"] == col.resolve_config({}), "DEFAULTS and conf/collect/cpu.yaml disagree"
    assert got["gpu"]["comm"]["backend"] == "nccl" and got["gpu"]["batch_size"] == 65536
    assert got["tiny"]["batch_size"] == 256 and got["tiny"]["comm"]["max_devices"] == 3


def test_waiting_for_ranks_needs_torchrun_only_with_several_ranks(tmp_path, fake_comm, monkeypatch):
    got = collect(tiny(compute={"num_samples": 4}), tmp_path, POOL)
    col.wait_for_ranks(got)  # one rank: returns at once
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(InputError, match="MASTER_ADDR"):
        col.wait_for_ranks(got._replace(world_size=2))
