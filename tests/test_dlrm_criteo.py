"""dlrm.criteo: Criteo TSV reader yielding TorchRec batches."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm.criteo import NUM_DENSE, NUM_SPARSE, CriteoTSVBatches
from embshard.errors import InputError

NAMES = [f"t{i}" for i in range(NUM_SPARSE)]


def line(label="0", dense=None, cats=None) -> str:
    """One Criteo line (no newline); dense/cats default to all-present simple values."""
    dense = [str(i) for i in range(NUM_DENSE)] if dense is None else dense
    cats = [f"{i:08x}" for i in range(NUM_SPARSE)] if cats is None else cats
    assert len(dense) == NUM_DENSE and len(cats) == NUM_SPARSE
    return "\t".join([label, *dense, *cats])


def write(path: Path, lines: list[str], trailing_newline: bool = True) -> Path:
    text = "\n".join(lines) + ("\n" if trailing_newline else "")
    path.write_text(text)
    return path


def numbered(n: int) -> list[str]:
    """n lines whose first dense value is the line index (identifies the sample)."""
    return [line(str(i % 2), [str(i)] + ["0"] * (NUM_DENSE - 1)) for i in range(n)]


def sample_ids(batches) -> list[int]:
    """Recovers the line index from dense column 0 (log1p undone)."""
    out = []
    for b in batches:
        out += [round(math.expm1(v)) for v in b.dense_features[:, 0].tolist()]
    return out


@pytest.fixture
def three(tmp_path: Path) -> Path:
    """Hand-written 3-line file: negatives, missing fields, big hex, no final newline."""
    l0 = line(
        "1",
        ["0", "1", "-1", "-2", "", "9", "99", "1000", "5", "", "3", "7", "2"],
        ["68fd1e64", "00000000", "ffffffff", *[f"{i:08x}" for i in range(3, NUM_SPARSE)]],
    )
    l1 = line(
        "0",
        [""] * NUM_DENSE,
        ["", "0000000a", "", *[""] * (NUM_SPARSE - 3)],
    )
    l2 = line("0", [str(i) for i in range(NUM_DENSE)], ["80000001"] * NUM_SPARSE)
    return write(tmp_path / "day_0.tsv", [l0, l1, l2], trailing_newline=False)


def test_dense_transform_hashing_and_kjt(three: Path):
    rows = [1000, 7, 13] + [5] * (NUM_SPARSE - 3)
    batches = list(CriteoTSVBatches(three, NAMES, rows, batch_size=3))
    assert len(batches) == 1
    b = batches[0]
    assert isinstance(b, Batch)
    assert isinstance(b.sparse_features, KeyedJaggedTensor)

    # labels: int32 [B], like torchrec.datasets.criteo
    assert b.labels.dtype == torch.int32
    assert b.labels.tolist() == [1, 0, 0]

    # dense: float32 [B, 13], log(max(x, 0) + 1), missing -> 0
    assert b.dense_features.dtype == torch.float32
    assert b.dense_features.shape == (3, 13)
    raw0 = [0, 1, 0, 0, 0, 9, 99, 1000, 5, 0, 3, 7, 2]
    expect = torch.tensor(
        [
            [math.log(x + 1) for x in raw0],
            [0.0] * 13,
            [math.log(x + 1) for x in range(13)],
        ],
        dtype=torch.float32,
    )
    torch.testing.assert_close(b.dense_features, expect)
    assert b.dense_features[0, 7].item() == pytest.approx(6.908754, rel=1e-6)

    kjt = b.sparse_features
    assert kjt.keys() == NAMES
    assert kjt.stride() == 3
    assert kjt.values().dtype == torch.int64
    assert kjt.lengths().dtype == torch.int32
    # key-major: per table the 3 samples' bag lengths
    lengths = kjt.lengths().view(NUM_SPARSE, 3)
    assert lengths[0].tolist() == [1, 0, 1]
    assert lengths[1].tolist() == [1, 1, 1]
    assert lengths[2].tolist() == [1, 0, 1]
    assert lengths[3:].sum().item() == 2 * (NUM_SPARSE - 3)
    assert (lengths[3:, 1] == 0).all()

    jt = kjt.to_dict()
    # 0x68fd1e64 = 1761418852; % 1000 = 852. 0x80000001 = 2147483649; % 1000 = 649
    assert jt["t0"].values().tolist() == [0x68FD1E64 % 1000, 0x80000001 % 1000]
    assert jt["t0"].values().tolist() == [852, 649]
    assert jt["t1"].values().tolist() == [0, 10 % 7, 0x80000001 % 7]
    assert jt["t2"].values().tolist() == [0xFFFFFFFF % 13, 0x80000001 % 13]
    assert jt["t5"].values().tolist() == [5 % 5, 0x80000001 % 5]
    assert jt["t3"].values().tolist() == [3, 0x80000001 % 5]
    # the flat values are laid out table after table
    assert kjt.values()[:5].tolist() == [852, 649, 0, 3, 0x80000001 % 7]


def test_fewer_tables_and_dense_features(three: Path):
    ds = CriteoTSVBatches(three, ["a", "b"], [1000, 7], batch_size=2, dense_in_features=4,
                          drop_last=False)
    batches = list(ds)
    assert [len(b.labels) for b in batches] == [2, 1]
    b0 = batches[0]
    assert b0.dense_features.shape == (2, 4)
    torch.testing.assert_close(
        b0.dense_features[0], torch.tensor([0.0, math.log(2), 0.0, 0.0])
    )
    kjt = b0.sparse_features
    assert kjt.keys() == ["a", "b"]
    assert kjt.lengths().tolist() == [1, 0, 1, 1]
    assert kjt.values().tolist() == [852, 0, 3]
    last = batches[1].sparse_features
    assert last.lengths().tolist() == [1, 1]
    assert last.values().tolist() == [649, 0x80000001 % 7]


def test_drop_last(tmp_path: Path):
    p = write(tmp_path / "d.tsv", numbered(7))
    assert [len(b.labels) for b in CriteoTSVBatches(p, NAMES, [10] * 26, 3)] == [3, 3]
    got = list(CriteoTSVBatches(p, NAMES, [10] * 26, 3, drop_last=False))
    assert [len(b.labels) for b in got] == [3, 3, 1]
    assert sample_ids(got) == list(range(7))
    assert got[2].sparse_features.stride() == 1


def test_rank_split_disjoint_and_covering(tmp_path: Path):
    a = write(tmp_path / "a.tsv", numbered(5))
    # second file continues the global line index (5..10)
    b = write(tmp_path / "b.tsv", [l for l in numbered(11)[5:]], trailing_newline=False)
    seen = []
    for rank in range(2):
        ds = CriteoTSVBatches([a, str(b)], NAMES, [10] * 26, batch_size=2, rank=rank,
                              world_size=2, drop_last=False)
        ids = sample_ids(ds)
        assert all(i % 2 == rank for i in ids)
        seen.append(ids)
    assert seen[0] == [0, 2, 4, 6, 8, 10]
    assert seen[1] == [1, 3, 5, 7, 9]
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(11))


def test_rank_split_three_ranks_uneven_files(tmp_path: Path):
    ids = numbered(9)
    a = write(tmp_path / "a.tsv", ids[:4])
    empty = write(tmp_path / "e.tsv", [], trailing_newline=False)
    b = write(tmp_path / "b.tsv", ids[4:], trailing_newline=False)
    got = [
        sample_ids(CriteoTSVBatches([a, empty, b], NAMES, [10] * 26, batch_size=1, rank=r,
                                    world_size=3))
        for r in range(3)
    ]
    assert got == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_rank_split_drop_last_per_rank(tmp_path: Path):
    p = write(tmp_path / "d.tsv", numbered(9))
    ds = CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=2, rank=2, world_size=3)
    assert sample_ids(ds) == [2, 5]  # 8 dropped: partial batch


def test_gzip(tmp_path: Path):
    p = tmp_path / "day_1.tsv.gz"
    with gzip.open(p, "wt") as f:
        f.write("\n".join(numbered(4)) + "\n")
    batches = list(CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=2))
    assert sample_ids(batches) == [0, 1, 2, 3]
    assert batches[1].labels.tolist() == [0, 1]


def test_reiterable(tmp_path: Path):
    p = write(tmp_path / "d.tsv", numbered(4))
    ds = CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=2)
    assert sample_ids(ds) == sample_ids(ds) == [0, 1, 2, 3]


def test_crlf_line_endings(tmp_path: Path):
    p = tmp_path / "d.tsv"
    p.write_bytes(("\r\n".join(numbered(2)) + "\r\n").encode())
    (b,) = CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=2)
    assert sample_ids([b]) == [0, 1]
    assert b.sparse_features.lengths().sum().item() == 2 * NUM_SPARSE


GOOD = line()


@pytest.mark.parametrize(
    "bad, message",
    [
        ("\t".join(GOOD.split("\t")[:12]), "expected 40 tab-separated fields, got 12"),
        (GOOD + "\t", "expected 40 tab-separated fields, got 41"),
        ("", "expected 40 tab-separated fields, got 1"),
        ("2" + GOOD[1:], "label must be 0 or 1, got '2'"),
        ("\t" + GOOD[2:], "label must be 0 or 1, got ''"),
        (line(dense=["1.5"] + ["0"] * 12), "dense field I1 is not an integer: '1.5'"),
        (line(dense=["0"] * 12 + ["abc"]), "dense field I13 is not an integer: 'abc'"),
        (line(cats=["zz123456"] + ["0"] * 25), "categorical field C1 is not hex: 'zz123456'"),
        (line(cats=["0"] * 25 + ["68fd1e6g"]), "categorical field C26 is not hex: '68fd1e6g'"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad: str, message: str):
    p = write(tmp_path / "day_0.tsv", [GOOD, GOOD, bad, GOOD])
    ds = CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=1)
    with pytest.raises(InputError) as e:
        list(ds)
    assert str(e.value) == f"{p}:3: {message}"
    assert "\n" not in str(e.value)


def test_malformed_line_in_second_file_counts_lines_per_file(tmp_path: Path):
    a = write(tmp_path / "a.tsv", [GOOD] * 3)
    b = write(tmp_path / "b.tsv", [GOOD, "1\t2"])
    for bs in (1, 5):  # bs=5: one batch spans both files
        with pytest.raises(InputError, match=r"b\.tsv:2: expected 40 tab-separated fields, got 2$"):
            list(CriteoTSVBatches([a, b], NAMES, [10] * 26, batch_size=bs))
    # the first bad line in file order wins, even when a later line of the batch is also bad
    c = write(tmp_path / "c.tsv", [GOOD, "2" + GOOD[1:], "x"])
    with pytest.raises(InputError, match=r"c\.tsv:2: label must be 0 or 1, got '2'$"):
        list(CriteoTSVBatches(c, NAMES, [10] * 26, batch_size=3))


def test_huge_dense_value_raises(tmp_path: Path):
    p = write(tmp_path / "d.tsv", [GOOD, line(dense=["9" * 400] + ["0"] * 12)])
    with pytest.raises(InputError, match=r"d\.tsv:2: dense field I1 is too large"):
        list(CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=2))


def test_malformed_line_in_dropped_partial_batch_still_raises(tmp_path: Path):
    p = write(tmp_path / "d.tsv", [GOOD, GOOD, GOOD, "0\t1"])
    with pytest.raises(InputError, match=r"d\.tsv:4: expected 40 tab-separated fields, got 2$"):
        list(CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=2))


def test_malformed_line_reported_by_owning_rank(tmp_path: Path):
    p = write(tmp_path / "d.tsv", [GOOD, "bad", GOOD, GOOD])
    with pytest.raises(InputError, match=r"d\.tsv:2: "):
        list(CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=1, rank=1, world_size=2))
    # rank 0 owns lines 1 and 3 only
    assert len(list(CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=1, world_size=2))) == 2


def test_missing_file(tmp_path: Path):
    with pytest.raises(InputError, match="nope.tsv: Criteo file not found"):
        CriteoTSVBatches(tmp_path / "nope.tsv", NAMES, [10] * 26, batch_size=1)


def test_corrupt_gzip(tmp_path: Path):
    p = tmp_path / "x.tsv.gz"
    p.write_bytes(b"not gzip at all")
    with pytest.raises(InputError, match=r"x\.tsv\.gz: cannot read Criteo file: "):
        list(CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=1))


@pytest.mark.parametrize(
    "names, rows, kwargs, match",
    [
        ([f"t{i}" for i in range(27)], [10] * 27, {}, "got 27 tables, need 1 to 26"),
        ([], [], {}, "got 0 tables, need 1 to 26"),
        (["a", "b"], [10], {}, "2 table names but 1 row counts"),
        (["a", "a"], [10, 10], {}, "duplicate table names"),
        (["a"], [0], {}, "table 'a' needs rows >= 1"),
        (["a"], [10], {"dense_in_features": 14}, "dense_in_features must be 1 to 13"),
        (["a"], [10], {"batch_size": 0}, "batch_size must be >= 1"),
        (["a"], [10], {"rank": 2, "world_size": 2}, "need 0 <= rank < world_size"),
    ],
)
def test_bad_arguments(tmp_path: Path, names, rows, kwargs, match):
    p = write(tmp_path / "d.tsv", [GOOD])
    kwargs = {"batch_size": 1, **kwargs}
    with pytest.raises(InputError, match=match) as e:
        CriteoTSVBatches(p, names, rows, **kwargs)
    assert "\n" not in str(e.value)


def test_no_full_batch_raises(tmp_path: Path):
    p = write(tmp_path / "small.tsv", numbered(3))
    with pytest.raises(InputError, match=r"small\.tsv: no full batch of 4 samples for rank 0 of 1"):
        list(CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=4))
    # rank 1 of 2 owns a single line: no batch of 2
    with pytest.raises(InputError, match="no full batch of 2 samples for rank 1 of 2"):
        list(CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=2, rank=1, world_size=2))
    empty = write(tmp_path / "empty.tsv", [], trailing_newline=False)
    with pytest.raises(InputError, match="no full batch"):
        list(CriteoTSVBatches(empty, NAMES, [10] * 26, batch_size=1, drop_last=False))
    # without drop_last the partial batch counts
    ds = CriteoTSVBatches(p, NAMES, [10] * 26, batch_size=4, drop_last=False)
    assert sample_ids(ds) == [0, 1, 2]


def test_feeds_torchrec_embedding_bags(three: Path):
    """The KJT is consumable by an EmbeddingBagCollection keyed by the table names."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    rows = [1000, 7, 13]
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=r, feature_names=[n])
            for n, r in zip(["a", "b", "c"], rows)
        ]
    )
    (b,) = CriteoTSVBatches(three, ["a", "b", "c"], rows, batch_size=3)
    out = ebc(b.sparse_features).to_dict()
    assert out["a"].shape == (3, 4)
    assert torch.equal(out["a"][1], torch.zeros(4))  # empty bag pools to zero
    w = ebc.embedding_bags["a"].weight
    torch.testing.assert_close(out["a"][0], w[852])
