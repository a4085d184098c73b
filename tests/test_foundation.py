"""The modules every result rests on, rule by rule: tables, tasks, plans and the validator, the
memory ledger, the baselines. Expected values are worked out by hand beside each assertion;
error messages are matched whole, since a user reads them to fix their input.

These tests are also what `make mutation` runs against plan.py, task.py, tables.py and
search/baselines.py (docs/development.md, "Mutation testing").
"""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest

from embshard import InfeasibleError, InputError, Plan, PlanError, Shard, Table, Task, validate
from embshard.plan import (
    MemoryLedger,
    PlanWarning,
    _safe_file_name,
    device_pieces,
    even_row_layout,
    infeasible,
    normalize,
    piece_table,
    pieces_sharing_a_device,
)
from embshard.search.baselines import COST_KEYS, GreedySharder, PileUpSharder, RandomSharder, RoundRobinSharder
from embshard.tables import TraceRef, _is_int, reuse_bin, reuse_histograms
from embshard.task import load_tasks, read_json


def task_of(tables, devices=2, memory=10**9, batch=10, **kw) -> Task:
    return Task("t", devices, memory, batch, tuple(tables), **kw)


def raises(exc, message: str):
    """pytest.raises matching the whole message."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


A = Table("a", 1000, 16, 2.0)
B = Table("b", 500, 8, 1.0)


# ============================================================================= tables
def test_reuse_bins_by_hand():
    # (0,1] -> 0, (1,2] -> 1, (2,4] -> 2, (4,8] -> 3, ..., (16384, 32768] -> 15, above -> 16
    counts = [0, 1, 2, 3, 4, 5, 8, 9, 32768, 32769, 10**9]
    assert reuse_bin(counts).tolist() == [0, 0, 1, 2, 2, 3, 3, 4, 15, 16, 16]


def test_reuse_histograms_by_hand():
    # rows accessed 1, 1, 2, 5 times (and 0: left out): bins 0, 0, 1, 3
    rows, accesses = reuse_histograms(np.array([1, 0, 1, 2, 5]))
    assert rows.tolist() == [0.5, 0.25, 0.0, 0.25] + [0.0] * 13       # 2, 1 and 1 of 4 rows
    assert accesses.tolist() == [2 / 9, 2 / 9, 0.0, 5 / 9] + [0.0] * 13  # 2, 2 and 5 of 9 accesses
    empty_rows, empty_acc = reuse_histograms(np.array([0, 0]))
    assert empty_rows.tolist() == [0.0] * 17 and empty_acc.tolist() == [0.0] * 17


def test_table_size_width_and_json():
    t = Table("a", 1000, 16, 2, reuse_histogram=[1] + [0] * 16, bytes_per_element=2, trace=TraceRef("f.pt", 3),
              kind="sequence")
    assert t.size_bytes == 1000 * 16 * 2 and t.pooling_factor == 2.0 and isinstance(t.pooling_factor, float)
    assert t.reuse_histogram == (1.0,) + (0.0,) * 16 and t.is_sequence
    w = t.with_dim(8)
    assert (w.name, w.rows, w.dim, w.pooling_factor, w.reuse_histogram, w.bytes_per_element, w.trace, w.kind) == (
        "a", 1000, 8, 2.0, t.reuse_histogram, 2, TraceRef("f.pt", 3), "sequence")
    assert t.with_dim(4, name="b").name == "b"
    d = t.to_dict()
    assert d == {"name": "a", "rows": 1000, "dim": 16, "pooling_factor": 2.0, "reuse_histogram": [1.0] + [0.0] * 16,
                 "bytes_per_element": 2, "trace": {"file": "f.pt", "table_index": 3}, "kind": "sequence"}
    assert Table.from_dict(json.loads(json.dumps(d))) == t
    # a pooled table without histogram or trace writes exactly the old keys
    assert Table("b", 5, 4, 1.0).to_dict() == {"name": "b", "rows": 5, "dim": 4, "pooling_factor": 1.0,
                                               "bytes_per_element": 4}
    assert not Table("b", 5, 4, 1.0).is_sequence
    assert Table.from_dict({"name": "b", "rows": 5, "dim": 4, "pooling_factor": 1}) == Table("b", 5, 4, 1.0)


@pytest.mark.parametrize("kw, message", [
    ({"name": ""}, "table name must be a non-empty string, got ''"),
    ({"name": 3}, "table name must be a non-empty string, got 3"),
    ({"rows": 0}, "table 'x': rows must be a positive integer, got 0"),
    ({"rows": 2.0}, "table 'x': rows must be a positive integer, got 2.0"),
    ({"rows": True}, "table 'x': rows must be a positive integer, got True"),
    ({"dim": 0}, "table 'x': dim must be a positive multiple of 4, got 0"),
    ({"dim": 6}, "table 'x': dim must be a positive multiple of 4, got 6"),
    ({"dim": 8.0}, "table 'x': dim must be a positive multiple of 4, got 8.0"),
    ({"pooling_factor": -0.5}, "table 'x': pooling_factor must be a finite number >= 0, got -0.5"),
    ({"pooling_factor": float("inf")}, "table 'x': pooling_factor must be a finite number >= 0, got inf"),
    ({"pooling_factor": "2"}, "table 'x': pooling_factor must be a finite number >= 0, got '2'"),
    ({"bytes_per_element": 3}, "table 'x': bytes_per_element must be 1, 2, 4 or 8, got 3"),
    ({"kind": "jagged"}, "table 'x': kind must be one of pooled, sequence, got 'jagged'"),
    ({"reuse_histogram": [1.0] * 16}, "table 'x': reuse_histogram must be 17 non-negative floats"),
    ({"reuse_histogram": [1.0] * 18}, "table 'x': reuse_histogram must be 17 non-negative floats"),
    ({"reuse_histogram": [-0.1] + [0.0] * 16}, "table 'x': reuse_histogram must be 17 non-negative floats"),
    ({"reuse_histogram": [float("nan")] + [0.0] * 16}, "table 'x': reuse_histogram must be 17 non-negative floats"),
    ({"reuse_histogram": "bogus"}, "table 'x': reuse_histogram must be 17 non-negative floats"),
    ({"reuse_histogram": 3}, "table 'x': reuse_histogram must be 17 non-negative floats"),
    ({"reuse_histogram": ["a"] * 17}, "table 'x': reuse_histogram must be 17 non-negative floats"),
    ({"rows": 2**63}, "table 'x': rows must be at most 2**44, got 9223372036854775808"),
    ({"dim": 2**20}, "table 'x': dim must be at most 65536, got 1048576"),
    ({"pooling_factor": 1e300}, "table 'x': pooling_factor must be at most 1e+06, got 1e+300"),
    ({"bytes_per_element": True}, "table 'x': bytes_per_element must be 1, 2, 4 or 8, got True"),
    ({"kind": ["pooled"]}, "table 'x': kind must be one of pooled, sequence, got ['pooled']"),
    ({"sharding_types": 1.5}, "table 'x': sharding_types must be a non-empty list of data_parallel, table_wise, "
                              "column_wise, table_column_wise, row_wise, table_row_wise, grid_shard; got 1.5"),
    ({"sharding_types": [["row_wise"]]}, "table 'x': sharding_types must be a non-empty list of data_parallel, "
                                         "table_wise, column_wise, table_column_wise, row_wise, table_row_wise, grid_shard; "
                                         "got [['row_wise']]"),
])
def test_bad_table_is_a_one_line_input_error(kw, message):
    args = {"name": "x", "rows": 10, "dim": 4, "pooling_factor": 1.0} | kw
    with raises(InputError, message):
        Table(**args)


def test_table_edges_are_accepted():
    # the smallest valid values: rows 1, dim 4, pooling 0, every allowed element size
    for bpe in (1, 2, 4, 8):
        assert Table("x", 1, 4, 0.0, bytes_per_element=bpe).size_bytes == 4 * bpe
    assert Table("x", np.int64(3), np.int32(4), np.float64(1.5)).rows == 3
    assert _is_int(np.int64(3)) and _is_int(0) and not _is_int(True) and not _is_int(1.0)


@pytest.mark.parametrize("d, message", [
    ([1], "a table must be a JSON object, got list"),
    ({"name": "x", "rows": 1, "dim": 4, "pooling_factor": 1, "hash_size": 9},
     "table 'x': unknown field 'hash_size'; known: bytes_per_element, dim, kind, min_partition, name, num_poolings, pooling_factor, "
     "reuse_histogram, rows, sharding_types, trace"),
    ({"name": "x", "rows": 1}, "table 'x': missing field(s) ['dim', 'pooling_factor']"),
    ({"name": "x", "rows": 1, "dim": 4, "pooling_factor": 1, "trace": "f.pt"},
     "table 'x': trace must be {'file': str, 'table_index': int}"),
    ({"name": "x", "rows": 1, "dim": 4, "pooling_factor": 1, "trace": {"file": "f.pt"}},
     "table 'x': trace must be {'file': str, 'table_index': int}"),
    ({"name": "x", "rows": 1, "dim": 4, "pooling_factor": 1, "trace": {"file": "f", "table_index": 0, "x": 1}},
     "table 'x': trace: unknown field 'x'; known: file, table_index"),
    ({"name": "x", "rows": 1, "dim": 4, "pooling_factor": 1, "trace": {"file": "f", "table_index": "a"}},
     "table 'x': trace must be {'file': str, 'table_index': int}, got {'file': 'f', 'table_index': 'a'}"),
    ({"name": "x", "rows": 1, "dim": 4, "pooling_factor": 1, "trace": {"file": None, "table_index": 0}},
     "table 'x': trace must be {'file': str, 'table_index': int}, got {'file': None, 'table_index': 0}"),
])
def test_bad_table_json(d, message):
    with raises(InputError, message):
        Table.from_dict(d)


def test_table_json_defaults():
    t = Table.from_dict({"name": "x", "rows": 1, "dim": 4, "pooling_factor": 1, "trace": {"file": 7, "table_index": "2"}})
    assert t.trace == TraceRef("7", 2) and t.bytes_per_element == 4 and t.kind == "pooled" and t.reuse_histogram is None


# ============================================================================= tasks
@pytest.mark.parametrize("kw, message", [
    ({"num_devices": 0}, "task 't': num_devices must be a positive integer, got 0"),
    ({"num_devices": True}, "task 't': num_devices must be a positive integer, got True"),
    ({"device_memory_bytes": 0}, "task 't': device_memory_bytes must be a positive integer, got 0"),
    ({"device_memory_bytes": 1.5}, "task 't': device_memory_bytes must be a positive integer, got 1.5"),
    ({"batch_size": 0}, "task 't': batch_size must be a positive integer, got 0"),
    ({"batch_size": "8"}, "task 't': batch_size must be a positive integer, got '8'"),
    ({"optimizer": "lion"}, "task 't': optimizer must be one of ['adagrad', 'adam', 'rowwise_adagrad', 'sgd'], got 'lion'"),
    ({"tables": ()}, "task 't': has no tables"),
    ({"tables": (A, B, A, B.with_dim(4))}, "task 't': duplicate table name(s) ['a', 'b']"),
    ({"devices_per_host": 0}, "task 't': devices_per_host must be a positive integer, got 0"),
    ({"devices_per_host": 1.0}, "task 't': devices_per_host must be a positive integer, got 1.0"),
    # wrong types and sizes beyond any machine: one line, not a TypeError or an int64 overflow later
    ({"optimizer": ["sgd"]}, "task 't': optimizer must be one of ['adagrad', 'adam', 'rowwise_adagrad', 'sgd'], got ['sgd']"),
    ({"num_devices": 2**21}, "task 't': num_devices must be at most 2**20, got 2097152"),
    ({"device_memory_bytes": 10**19}, "task 't': device_memory_bytes must be at most 2**50 (1 PiB), got 10000000000000000000"),
    ({"batch_size": 2**40}, "task 't': batch_size must be at most 2**31, got 1099511627776"),
    ({"tables": (Table("s", 2**40, 16, 1e6, kind="sequence"),), "batch_size": 2**30},
     "task 't': table 's' needs 137509322216177664 bytes in training, more than any plan here handles (2**56); "
     "check its rows, dim and pooling_factor and the batch_size"),
    ({"tables": ({"name": "a"},)}, "task 't': tables must be Table objects, got dict"),
    ({"devices_per_host": 3}, "task 't': devices_per_host (3) does not divide num_devices (4)"),
    ({"hosts": 0}, "task 't': hosts must be a positive integer, got 0"),
    ({"hosts": 3, "devices_per_host": 2}, "task 't': hosts (3) x devices_per_host (2) must equal num_devices (4)"),
    ({"hosts": 2}, "task 't': hosts (2) x devices_per_host (4) must equal num_devices (4)"),
    ({"intra_host_gbps": 0}, "task 't': intra_host_gbps must be a positive number (GiB/s), got 0"),
    ({"inter_host_gbps": -1.0}, "task 't': inter_host_gbps must be a positive number (GiB/s), got -1.0"),
    ({"inter_host_gbps": float("inf")}, "task 't': inter_host_gbps must be a positive number (GiB/s), got inf"),
    ({"intra_host_gbps": True}, "task 't': intra_host_gbps must be a positive number (GiB/s), got True"),
    ({"intra_host_gbps": "fast"}, "task 't': intra_host_gbps must be a positive number (GiB/s), got 'fast'"),
])
def test_bad_task_is_a_one_line_input_error(kw, message):
    args = {"name": "t", "num_devices": 4, "device_memory_bytes": 100, "batch_size": 8, "tables": (A,)} | kw
    with raises(InputError, message):
        Task(**args)


def test_task_topology_and_lookups():
    t = Task("t", 8, 100, 8, [A, B], devices_per_host=4, intra_host_gbps=100, inter_host_gbps=10)
    assert t.tables == (A, B) and t.hosts == 2 and [t.host_of(d) for d in (0, 3, 4, 7)] == [0, 0, 1, 1]
    assert isinstance(t.intra_host_gbps, float) and t.intra_host_gbps == 100.0 and t.inter_host_gbps == 10.0
    assert Task("t", 6, 100, 8, (A,), hosts=3, devices_per_host=2).hosts == 3
    assert type(t.hosts) is int
    assert Task("t", 2, 1, 8, (A,), hosts=1, devices_per_host=2).hosts == 1  # the smallest valid values
    single = Task("t", 3, 100, 8, (A,))
    assert single.devices_per_host == 3 and single.hosts == 1 and single.host_of(2) == 0
    assert single.table("a") is A and single.table_by_name == {"a": A}
    with pytest.raises(KeyError) as e:
        single.table("b")
    assert e.value.args == ("b",)


def test_memory_per_optimizer_by_hand():
    # 1000 rows x 16 dims of fp32 weights = 64000 bytes; pooled I/O: 2 x batch 10 x 16 x 4 = 1280 bytes
    weights, io = 1000 * 16 * 4, 2 * 10 * 16 * 4
    state = {"sgd": 0, "rowwise_adagrad": 1000 * 4, "adagrad": 1000 * 16 * 4, "adam": 1000 * 16 * 8}
    for optimizer, bytes_of_state in state.items():
        task = task_of([A], optimizer=optimizer)
        assert task.table_memory_bytes(A) == weights + bytes_of_state + io, optimizer
    # row-wise Adagrad keeps one fp32 per row, whatever the width: a 250-row slice of 8 columns
    row_wise = task_of([A], optimizer="rowwise_adagrad")
    assert row_wise.shard_memory_bytes(A, 250, 8) == 250 * 8 * 4 + 250 * 4 + 2 * 10 * 8 * 4


def test_memory_of_replicas_and_sequence_pieces_by_hand():
    task = task_of([A], batch=10)
    # two copies of a pooled piece: each serves ceil(10 / 2) = 5 samples
    assert task.shard_memory_bytes(A, 1000, 16, copies=2) == 1000 * 16 * 4 + 2 * 5 * 16 * 4
    assert task.shard_memory_bytes(A, 1000, 16, copies=3) == 1000 * 16 * 4 + 2 * 4 * 16 * 4  # ceil(10/3) = 4
    seq = Table("s", 1000, 8, 3.0, kind="sequence")
    st = task_of([seq], batch=10)
    # ids of the batch: 10 x 3 = 30; a 250-row piece serves 30 x 250/1000 = 7.5 -> 8 ids, each an
    # 8-wide fp32 vector out and its gradient back: 2 x 8 x 8 x 4
    assert st.shard_memory_bytes(seq, 250, 8) == 250 * 8 * 4 + 2 * 8 * 8 * 4
    # the same piece in two copies: 30 x 250 / (1000 x 2) = 3.75 -> 4 ids each
    assert st.shard_memory_bytes(seq, 250, 8, copies=2) == 250 * 8 * 4 + 2 * 4 * 8 * 4
    fp16 = Table("h", 100, 4, 1.0, bytes_per_element=2)
    assert task_of([fp16], batch=1).table_memory_bytes(fp16) == 100 * 4 * 2 + 2 * 1 * 4 * 4  # I/O stays fp32


def test_task_json_writes_topology_only_where_it_differs(tmp_path):
    plain = Task("t", 2, 100, 8, (B,))
    assert plain.to_dict() == {"name": "t", "num_devices": 2, "device_memory_bytes": 100, "batch_size": 8,
                               "optimizer": "sgd", "tables": [B.to_dict()]}
    two = Task("t", 4, 100, 8, (B,), optimizer="adam", devices_per_host=2, intra_host_gbps=300.0, inter_host_gbps=25.0)
    d = two.to_dict()
    assert d["devices_per_host"] == 2 and d["intra_host_gbps"] == 300.0 and d["inter_host_gbps"] == 25.0
    assert d["optimizer"] == "adam" and "hosts" not in d
    two.save(tmp_path / "two.json")
    assert Task.load(tmp_path / "two.json") == two
    only_inter = Task("t", 4, 100, 8, (B,), devices_per_host=2, inter_host_gbps=25.0).to_dict()
    assert "intra_host_gbps" not in only_inter and only_inter["inter_host_gbps"] == 25.0
    explicit = Task.from_dict({**plain.to_dict(), "hosts": 2, "devices_per_host": 1})
    assert explicit.hosts == 2 and explicit.devices_per_host == 1
    with raises(InputError, "task 't': hosts (3) x devices_per_host (1) must equal num_devices (2)"):
        Task.from_dict({**plain.to_dict(), "hosts": 3, "devices_per_host": 1})
    no_optimizer = {k: v for k, v in plain.to_dict().items() if k != "optimizer"}
    assert Task.from_dict(no_optimizer).optimizer == "sgd"
    with raises(InputError, "task: a task must be a JSON object, got str"):  # the default source
        Task.from_dict("t")
    bad = tmp_path / "bad_task.json"
    bad.write_text(json.dumps({"name": "t"}))
    with raises(InputError, f"{bad}: missing field(s) ['batch_size', 'device_memory_bytes', 'num_devices', 'tables']"):
        Task.load(bad)


@pytest.mark.parametrize("d, message", [
    ([1], "x.json: a task must be a JSON object, got list"),
    ({"name": "t", "num_devices": 1, "device_memory_bytes": 1, "batch_size": 1, "tables": [], "optimiser": "sgd"},
     "x.json: task 't': unknown field 'optimiser' (did you mean 'optimizer'?); known: batch_size, "
     "device_memory_bytes, devices_per_host, hosts, inter_host_gbps, intra_host_gbps, name, num_devices, optimizer, tables"),
    ({"name": "t", "num_devices": 1}, "x.json: missing field(s) ['batch_size', 'device_memory_bytes', 'tables']"),
    ({"name": "t", "num_devices": 1, "device_memory_bytes": 1, "batch_size": 1, "tables": {}},
     "x.json: 'tables' must be a list"),
])
def test_bad_task_json(d, message):
    with raises(InputError, message):
        Task.from_dict(d, source="x.json")


def test_read_json_and_load_tasks(tmp_path):
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with raises(InputError, f"{binary}: not a text file"):
        read_json(binary)
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": }')
    with raises(InputError, f"{bad}: malformed JSON (Expecting value at line 1 column 7)"):
        read_json(bad)
    with raises(InputError, f"{tmp_path}: no such file"):
        read_json(tmp_path)
    folder = tmp_path / "tasks"
    Task("b", 1, 100, 8, (B,)).save(folder / "2.json")
    Task("a", 1, 100, 8, (B,)).save(folder / "1.json")
    (folder / "notes.txt").write_text("not a task")
    assert [t.name for t in load_tasks(folder)] == ["a", "b"]  # sorted by path, *.json only
    assert [t.name for t in load_tasks(folder / "2.json")] == ["b"]
    assert [t.name for t in load_tasks(f"{folder}/[12].json")] == ["a", "b"]
    assert [t.name for t in load_tasks(f"{folder}/?.json")] == ["a", "b"]
    assert [t.name for t in load_tasks(f"{folder}/*.json")] == ["a", "b"]
    with raises(InputError, f"{tmp_path / 'Missing_X.json'}: no such file"):  # a plain path, not a pattern
        load_tasks(tmp_path / "Missing_X.json")
    with raises(InputError, f"{tmp_path}/*.nothing: no task JSON files found"):
        load_tasks(f"{tmp_path}/*.nothing")
    with raises(InputError, f"{tmp_path / 'empty'}: no task JSON files found"):
        (tmp_path / "empty").mkdir()
        load_tasks(tmp_path / "empty")
    Task("a", 1, 100, 8, (B,)).save(folder / "3.json")
    with raises(InputError, f"{folder}: duplicate task name(s) ['a']"):
        load_tasks(folder)


# ============================================================================= shards and plan JSON
def test_shard_json():
    s = Shard("a", 1, 4, 8, 100, 200)
    assert s.to_dict() == {"table": "a", "device": 1, "col_offset": 4, "dim": 8, "row_offset": 100, "rows": 200}
    r = Shard("a", 1, 4, 8, 100, 200, replica=2)
    assert r.to_dict()["replica"] == 2 and Shard.from_dict(r.to_dict()) == r and Shard.from_dict(s.to_dict()) == s
    assert Shard.whole(A, 3) == Shard("a", 3, 0, 16, 0, 1000) and s.rectangle == ("a", 100, 200, 4, 8)


@pytest.mark.parametrize("d, message", [
    ("x", "a shard must be a JSON object, got str"),
    ({"table": "a", "device": 0, "col_offset": 0, "dim": 4, "row_offset": 0, "rows": 1, "copy": 1},
     "shard of table 'a': unknown field 'copy'; known: col_offset, device, dim, replica, row_offset, rows, table"),
    ({"table": "a", "device": 0}, "shard of table 'a': missing field(s) ['col_offset', 'dim', 'row_offset', 'rows']"),
    ({"table": "a", "device": 0.0, "col_offset": 0, "dim": 4, "row_offset": 0, "rows": 1},
     "shard of table 'a': device must be an integer, got 0.0"),
    ({"table": "a", "device": 0, "col_offset": 0, "dim": 4, "row_offset": 0, "rows": "1"},
     "shard of table 'a': rows must be an integer, got '1'"),
    ({"table": "a", "device": 0, "col_offset": 0, "dim": 4, "row_offset": 0, "rows": 1, "replica": True},
     "shard of table 'a': replica must be an integer, got True"),
    ({"table": ["a"], "device": 0, "col_offset": 0, "dim": 4, "row_offset": 0, "rows": 1},  # was a TypeError in validate
     "a shard's table must be a table name (a string), got ['a']"),
])
def test_bad_shard_json(d, message):
    with raises(InputError, message):
        Shard.from_dict(d)


@pytest.mark.parametrize("d, message", [
    ([], "p.json: a plan must be a JSON object, got list"),
    ({"task": "t", "algorithm": "x", "shards": [], "notes": 1},
     "p.json: plan: unknown field 'notes'; known: algorithm, dedup_ids, row_maps, shards, sparse_sync, task"),
    ({"task": "t"}, "p.json: missing field(s) ['algorithm', 'shards']"),
    ({"task": "t", "algorithm": "x", "shards": {}}, "p.json: 'shards' must be a list"),
    ({"task": "t", "algorithm": "x", "shards": [], "dedup_ids": 1}, "p.json: 'dedup_ids' must be true or false, got 1"),
    ({"task": "t", "algorithm": "x", "shards": [], "row_maps": []},
     "p.json: 'row_maps' must be an object {table: {file, rows, sha256}}"),
])
def test_bad_plan_json(d, message):
    with raises(InputError, message):
        Plan.from_dict(d, source="p.json")


def test_plan_json_and_row_maps_round_trip(tmp_path):
    plan = Plan("t", "x", [Shard("a", 0, 0, 16, 0, 1000)], row_maps={"a/b c": np.array([5, 1, 0], dtype=np.int32)},
                dedup_ids=True)
    assert Plan("t", "x", []).to_dict() == {"task": "t", "algorithm": "x", "shards": []}
    plan.save(tmp_path / "p.json")
    d = json.loads((tmp_path / "p.json").read_text())
    entry = d["row_maps"]["a/b c"]
    assert d["dedup_ids"] is True and entry["rows"] == 3 and entry["file"] == f"p.rowmaps/{_safe_file_name('a/b c')}.npy"
    data = (tmp_path / entry["file"]).read_bytes()
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert np.load(tmp_path / entry["file"]).dtype == np.int64  # the sidecar holds int64 ids, whatever came in
    back = Plan.load(tmp_path / "p.json")
    assert back.row_maps["a/b c"].tolist() == [5, 1, 0] and back.row_maps["a/b c"].dtype == np.int64
    assert back.dedup_ids and back.shards == plan.shards and (back.task, back.algorithm) == ("t", "x")
    # a plan without row maps resolves nothing, wherever it is read from; dedup_ids defaults to off
    bare = Plan.from_dict({"task": "t", "algorithm": "x", "shards": []})
    assert bare.row_maps == {} and bare.dedup_ids is False
    with raises(InputError, "plan: a plan must be a JSON object, got list"):  # the default source
        Plan.from_dict([])


def test_row_maps_resolve_against_the_working_directory_without_a_base(tmp_path, monkeypatch):
    entry = _write_row_map(tmp_path, np.array([3, 1]))
    monkeypatch.chdir(tmp_path)
    plan = Plan.from_dict({"task": "t", "algorithm": "x", "shards": [], "row_maps": {"a": entry}})
    assert plan.row_maps["a"].tolist() == [3, 1]


def test_plan_load_names_the_file_in_its_errors(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"task": "t", "algorithm": "x"}')
    with raises(InputError, f"{path}: missing field(s) ['shards']"):
        Plan.load(path)


def test_safe_file_names():
    assert _safe_file_name("Big_Table.V2").startswith("Big_Table.V2-")  # letters of either case kept
    assert _safe_file_name("plain_name.1-x") == "plain_name.1-x-" + f"{__import__('zlib').crc32(b'plain_name.1-x'):08x}"
    a, b = _safe_file_name("a/b"), _safe_file_name("a_b")
    assert a.startswith("a_b-") and b.startswith("a_b-") and a != b  # same text, different checksums
    assert len(_safe_file_name("x" * 100)) == 64 + 9


def _write_row_map(tmp_path, ids, name="m.npy") -> dict:
    import io

    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    (tmp_path / name).write_bytes(buf.getvalue())
    return {"file": name, "rows": len(ids), "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}


def test_bad_row_maps_name_the_table_and_the_file(tmp_path):
    def load(entry):
        return Plan.from_dict({"task": "t", "algorithm": "x", "shards": [], "row_maps": {"a": entry}}, source="p",
                              base_dir=tmp_path)

    good = _write_row_map(tmp_path, np.array([2, 0, 1]))
    assert load(good)["a"].tolist() == [2, 0, 1] if isinstance(load(good), dict) else load(good).row_maps["a"].tolist() == [2, 0, 1]
    shape = "must be {'file': str, 'rows': int, 'sha256': str}"
    with raises(InputError, f"p: row map of table 'a' {shape}"):
        load("m.npy")
    with raises(InputError, f"p: row map of table 'a' {shape}"):
        load({"file": 3, "rows": 3})
    with raises(InputError, f"p: row map of table 'a' {shape}"):
        load({"file": "m.npy", "rows": "3"})
    with raises(InputError, "p: row map of table 'a': unknown field 'size'; known: file, rows, sha256"):
        load({**good, "size": 3})
    with raises(InputError, f"p: row map of table 'a': {tmp_path / 'gone.npy'}: no such file"):
        load({**good, "file": "gone.npy"})
    with raises(InputError, f"p: row map of table 'a': {tmp_path / 'm.npy'} does not match its sha256 (changed or truncated)"):
        load({**good, "sha256": "0" * 64})
    no_hash = {k: v for k, v in good.items() if k != "sha256"}
    assert load(no_hash).row_maps["a"].tolist() == [2, 0, 1]  # the checksum is optional
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    with pytest.raises(InputError, match=r"^p: row map of table 'a': .*junk\.npy is not a \.npy array \(.+\)$"):
        load({"file": "junk.npy", "rows": 3})
    floats = _write_row_map(tmp_path, np.array([0.5, 1.0, 2.0]), "f.npy")
    msg = f"p: row map of table 'a': {tmp_path / 'f.npy'} must be a 1-D integer array of 3 ids, got shape (3,) float64"
    with raises(InputError, msg):
        load(floats)
    square = _write_row_map(tmp_path, np.zeros((2, 2), dtype=np.int64), "s.npy")
    with raises(InputError, f"p: row map of table 'a': {tmp_path / 's.npy'} must be a 1-D integer array of 2 ids, "
                            "got shape (2, 2) int64"):
        load(square)
    with raises(InputError, f"p: row map of table 'a': {tmp_path / 'm.npy'} must be a 1-D integer array of 4 ids, "
                            "got shape (3,) int64"):
        load({**good, "rows": 4})
    unsigned = _write_row_map(tmp_path, np.array([1, 0], dtype=np.uint16), "u.npy")
    assert load(unsigned).row_maps["a"].dtype == np.int64


# ============================================================================= helpers of the plan
def test_even_row_layout_by_hand():
    assert even_row_layout(10, 3) == [(0, 4), (4, 4), (8, 2)]          # blocks of ceil(10/3) = 4
    assert even_row_layout(5, 4) == [(0, 2), (2, 2), (4, 1), (5, 0)]   # the last block empty
    assert even_row_layout(8, 2) == [(0, 4), (4, 4)]
    assert even_row_layout(3, 1) == [(0, 3)]


def test_piece_tables_by_hand():
    t = Table("a", 1000, 16, 6.0, reuse_histogram=[1.0] + [0.0] * 16, bytes_per_element=2, trace=TraceRef("f", 1))
    assert piece_table(t, Shard.whole(t, 0)) is t
    col = piece_table(t, Shard("a", 0, 8, 8, 0, 1000))
    assert (col.rows, col.dim, col.pooling_factor) == (1000, 8, 6.0)
    row = piece_table(t, Shard("a", 0, 0, 8, 250, 250))  # a quarter of the rows: a quarter of the lookups
    assert (row.name, row.rows, row.dim, row.pooling_factor) == ("a", 250, 8, 1.5)
    assert row.reuse_histogram == t.reuse_histogram and row.bytes_per_element == 2 and row.trace == t.trace
    task = task_of([t, B], devices=3)
    pieces = device_pieces(task, Plan("t", "x", [Shard("a", 2, 0, 16, 0, 500), Shard("a", 0, 0, 16, 500, 500),
                                                 Shard.whole(B, 2)]))
    assert [[(p.name, p.rows) for p in d] for d in pieces] == [[("a", 500)], [], [("a", 500), ("b", 500)]]


def test_plan_accessors():
    plan = Plan("t", "x", [Shard("a", 1, 0, 8, 0, 1000), Shard("a", 0, 8, 8, 0, 1000), Shard.whole(B, 1)])
    assert plan.shards_on(1) == [plan.shards[0], plan.shards[2]] and plan.shards_on(2) == []
    assert plan.by_device(3) == [plan.shards_on(k) for k in range(3)]
    with pytest.raises(PlanError, match="table 'a' is on device 1, outside 0..0"):
        plan.by_device(1)
    assert plan.device_widths(3) == [8, 16, 0]
    shuffled = Plan("t", "other", plan.shards[::-1])
    assert shuffled.signature() == plan.signature()
    assert Plan("t", "x", [Shard("a", 1, 0, 8, 0, 1000, replica=1)]).signature() != Plan(
        "t", "x", [Shard("a", 1, 0, 8, 0, 1000)]).signature()


def test_memory_bytes_counts_each_replica_on_its_device():
    task = task_of([A, B], devices=3, batch=10)
    plan = Plan("t", "x", [Shard.whole(A, 0), Shard("a", 2, 0, 16, 0, 1000, replica=1), Shard.whole(B, 0),
                           Shard("zz", 1, 0, 4, 0, 1), Shard("a", 7, 0, 16, 0, 500),  # unknown table, bad device: skipped
                           Shard("b", 3, 0, 8, 0, 250)])  # device 3 of 0..2: skipped too
    a_copy = 1000 * 16 * 4 + 2 * 5 * 16 * 4  # two copies of a: each serves 5 of the 10 samples
    b_whole = 500 * 8 * 4 + 2 * 10 * 8 * 4
    assert plan.memory_bytes(task) == [a_copy + b_whole, 0, a_copy]


# ============================================================================= the validator
def make(tables=(A,), devices=2, memory=10**9, batch=10):
    return task_of(list(tables), devices, memory, batch)


@pytest.mark.parametrize("shards, message", [
    ([Shard("zz", 0, 0, 4, 0, 1)], "shard names table 'zz', which task 't' does not have"),
    ([Shard("a", 2, 0, 16, 0, 1000)], "table 'a': device 2 out of range 0..1"),
    ([Shard("a", -1, 0, 16, 0, 1000)], "table 'a': device -1 out of range 0..1"),
    ([Shard("a", 0, 0, 0, 0, 1000)], "table 'a': shard has non-positive size or negative offset: "
                                     "Shard(table='a', device=0, col_offset=0, dim=0, row_offset=0, rows=1000, replica=0)"),
    ([Shard("a", 0, 0, 16, 0, 0)], "table 'a': shard has non-positive size or negative offset: "
                                   "Shard(table='a', device=0, col_offset=0, dim=16, row_offset=0, rows=0, replica=0)"),
    ([Shard("a", 0, -4, 16, 0, 1000)], "table 'a': shard has non-positive size or negative offset: "
                                       "Shard(table='a', device=0, col_offset=-4, dim=16, row_offset=0, rows=1000, replica=0)"),
    ([Shard("a", 0, 0, 16, -1, 1000)], "table 'a': shard has non-positive size or negative offset: "
                                       "Shard(table='a', device=0, col_offset=0, dim=16, row_offset=-1, rows=1000, replica=0)"),
    ([Shard("a", 0, 0, 16, 0, 1000, replica=-1)], "table 'a': shard has non-positive size or negative offset: "
                                                  "Shard(table='a', device=0, col_offset=0, dim=16, row_offset=0, rows=1000, replica=-1)"),
    ([Shard("a", 0, 0, 6, 0, 1000)], "table 'a': column split at offset 0 width 6 is not a multiple of 4"),
    ([Shard("a", 0, 0, 1, 0, 1000)], "table 'a': column split at offset 0 width 1 is not a multiple of 4"),
    ([Shard("a", 0, 2, 4, 0, 1000)], "table 'a': column split at offset 2 width 4 is not a multiple of 4"),
    ([Shard("a", 0, 0, 16, 1, 1000)], "table 'a': shard [1:1001, 0:16] exceeds the table's 1000 × 16"),
    ([Shard("a", 0, 8, 12, 0, 1000)], "table 'a': shard [0:1000, 8:20] exceeds the table's 1000 × 16"),
    ([], "table 'a' is not placed on any device"),
    ([Shard("a", 1, 0, 16, 0, 1000, replica=1)], "table 'a' is not placed on any device"),
    ([Shard("a", 0, 0, 8, 0, 1000)], "table 'a': shards cover 8000 of 16000 cells (8000 uncovered)"),
    ([Shard("a", 0, 0, 16, 0, 600), Shard("a", 1, 0, 16, 600, 300)],
     "table 'a': shards cover 14400 of 16000 cells (1600 uncovered)"),
])
def test_validator_rejects_with_the_exact_reason(shards, message):
    with raises(PlanError, message):
        validate(make(), Plan("t", "x", shards))


def test_validator_names_a_plan_for_another_task():
    with raises(PlanError, "plan is for task 'u', not 't'"):
        validate(make(), Plan("u", "x", [Shard.whole(A, 0)]))


def test_validator_accepts_shards_that_end_exactly_at_the_table_edge():
    validate(make(), Plan("t", "x", [Shard("a", 1, 12, 4, 0, 1000), Shard("a", 0, 0, 12, 999, 1),
                                     Shard("a", 0, 0, 12, 0, 999)]))
    validate(make(devices=1), Plan("t", "x", [Shard("a", 0, 0, 16, 0, 1000)]))  # device 0 of 1


def test_validator_catches_an_overlap_hidden_by_a_gap_of_equal_area():
    """The area check alone would pass these: an overlap and a gap of the same size."""
    # column pieces: A = cols 0-8 all rows (8000 cells), B = cols 4-8 rows 0-500 (2000) overlapping A,
    # C = cols 8-16 rows 0-750 (6000): 16000 cells in all, but cols 8-16 rows 750-1000 are uncovered
    grid = [Shard("a", 0, 0, 8, 0, 1000), Shard("a", 1, 4, 4, 0, 500), Shard("a", 1, 8, 8, 0, 750)]
    with raises(PlanError, f"table 'a' is covered twice: {grid[0]} overlaps {grid[1]}"):
        validate(make(), Plan("t", "x", grid))
    # full-width row blocks: rows 0-600 and 500-900 overlap by 100 rows, rows 900-1000 are missing
    rows = [Shard("a", 1, 0, 16, 500, 400), Shard("a", 0, 0, 16, 0, 600)]
    with raises(PlanError, f"table 'a' is covered twice: {rows[1]} overlaps {rows[0]}"):
        validate(make(), Plan("t", "x", rows))
    # overlapping rows but disjoint columns is no overlap; overlapping columns but disjoint rows neither
    validate(make(), Plan("t", "x", [Shard("a", 0, 0, 8, 0, 600), Shard("a", 1, 8, 8, 0, 600),
                                     Shard("a", 1, 0, 8, 600, 400), Shard("a", 0, 8, 8, 600, 400)]))
    # pieces that only touch at a corner or an edge do not overlap (strict inequalities)
    validate(make(), Plan("t", "x", [Shard("a", 0, 0, 8, 0, 500), Shard("a", 1, 8, 8, 500, 500),
                                     Shard("a", 1, 8, 8, 0, 500), Shard("a", 0, 0, 8, 500, 500)]))


def test_validator_checks_memory_with_the_shortfall():
    need_a = 1000 * 16 * 4 + 2 * 10 * 16 * 4   # 65280
    need_b = 500 * 8 * 4 + 2 * 10 * 8 * 4      # 16640
    exact = make((A, B), devices=2, memory=need_a + need_b)
    validate(exact, Plan("t", "x", [Shard.whole(A, 1), Shard.whole(B, 1)]))  # exactly full is fine
    tight = make((A, B), devices=2, memory=need_a + need_b - 1)
    with raises(PlanError, f"device 1 needs {need_a + need_b} bytes but has {need_a + need_b - 1} (over by 1 bytes); "
                           "tables: a, b"):
        validate(tight, Plan("t", "x", [Shard.whole(B, 1), Shard.whole(A, 1)]))


@pytest.mark.parametrize("shards, message", [
    ([Shard.whole(A, 0), Shard("a", 1, 0, 16, 0, 500, replica=1)],
     "table 'a': replica 1 of rows [0:500] on device 1 copies no replica-0 shard"),
    ([Shard.whole(A, 0), Shard("a", 1, 0, 16, 0, 1000, replica=1), Shard("a", 1, 0, 16, 0, 1000, replica=2)],
     "table 'a': rows [0:1000] have two copies with device 1"),
    ([Shard.whole(A, 0), Shard("a", 1, 0, 16, 0, 1000, replica=1), Shard("a", 2, 0, 16, 0, 1000, replica=1)],
     "table 'a': rows [0:1000] have two copies with replica index 1"),
    ([Shard.whole(A, 0), Shard("a", 0, 0, 16, 0, 1000, replica=1)], "table 'a': rows [0:1000] have two copies with device 0"),
])
def test_validator_replica_rules(shards, message):
    with raises(PlanError, message):
        validate(make(devices=3), Plan("t", "x", shards))


def test_validator_accepts_replicas_and_row_maps():
    plan = Plan("t", "x", [Shard("a", 0, 0, 16, 0, 400), Shard("a", 1, 0, 16, 400, 600),
                           Shard("a", 2, 0, 16, 0, 400, replica=1), Shard("a", 1, 0, 16, 0, 400, replica=2)],
                row_maps={"a": np.array([999, 0, 5])})
    validate(make(devices=3), plan)
    validate(make(), Plan("t", "x", [Shard.whole(A, 0)], row_maps={"a": np.array([], dtype=np.int64)}))


@pytest.mark.parametrize("ids, message", [
    (np.array([[1, 2]]), "table 'a': row map must be a 1-D integer array of at most 1000 ids"),
    (np.array([1.0, 2.0]), "table 'a': row map must be a 1-D integer array of at most 1000 ids"),
    (np.arange(1001), "table 'a': row map must be a 1-D integer array of at most 1000 ids"),
    (np.array([0, 1000]), "table 'a': row map holds ids outside [0, 1000)"),
    (np.array([-1, 3]), "table 'a': row map holds ids outside [0, 1000)"),
    (np.array([3, 4, 3]), "table 'a': row map repeats a row id"),
])
def test_validator_row_map_rules(ids, message):
    with raises(PlanError, message):
        validate(make(), Plan("t", "x", [Shard.whole(A, 0)], row_maps={"a": ids}))


def test_validator_row_map_must_name_a_table():
    with raises(PlanError, "row map names table 'zz', which task 't' does not have"):
        validate(make(), Plan("t", "x", [Shard.whole(A, 0)], row_maps={"zz": np.array([0])}))
    validate(make(), Plan("t", "x", [Shard.whole(A, 0)], row_maps={"a": np.arange(1000)}))  # all rows: fine


# ============================================================================= pieces sharing a device, normalize
def test_two_pieces_on_a_device_warn_and_normalize_merges_columns():
    plan = Plan("t", "x", [Shard("a", 0, 0, 4, 0, 1000), Shard("a", 1, 4, 4, 0, 1000), Shard("a", 0, 8, 8, 0, 1000),
                           Shard.whole(B, 1)])
    assert pieces_sharing_a_device(plan) == [("a", 0, 2)]
    with pytest.warns(PlanWarning, match=r"^plan 'x': table 'a' has 2 pieces on device 0; one kernel then looks each bag "
                                         r"up once per piece \(merge them: embshard.plan.normalize\)$"):
        validate(make((A, B)), plan)
    merged = normalize(make((A, B)), plan)
    # device 0's columns first (4 + 8 = 12 wide), then device 1's 4: contiguous per device
    assert merged.shards == [Shard("a", 0, 0, 12, 0, 1000), Shard("a", 1, 12, 4, 0, 1000), Shard.whole(B, 1)]
    assert merged.algorithm == "x" and merged.task == "t"
    untouched = Plan("t", "x", [Shard.whole(A, 0), Shard.whole(B, 1)])
    assert normalize(make((A, B)), untouched) is untouched


def test_normalize_lays_out_three_devices_columns_contiguously():
    plan = Plan("t", "x", [Shard("a", 2, 0, 4, 0, 1000), Shard("a", 0, 4, 4, 0, 1000), Shard("a", 1, 8, 4, 0, 1000),
                           Shard("a", 2, 12, 4, 0, 1000)])
    # device 2 holds columns 0-4 and 12-16: 8 wide, laid out first; then device 0's 4, device 1's 4
    assert normalize(make(devices=3), plan).shards == [Shard("a", 2, 0, 8, 0, 1000), Shard("a", 0, 8, 4, 0, 1000),
                                                       Shard("a", 1, 12, 4, 0, 1000)]


def test_normalize_merges_adjacent_row_and_grid_pieces():
    # rows 0-300 and 300-600 on device 0 merge; rows 600-1000 on device 1 stay; table b before it stays
    rows = Plan("t", "x", [Shard.whole(B, 1), Shard("a", 0, 0, 16, 300, 300), Shard("a", 1, 0, 16, 600, 400),
                           Shard("a", 0, 0, 16, 0, 300)])
    assert normalize(make((A, B)), rows).shards == [Shard.whole(B, 1), Shard("a", 0, 0, 16, 0, 600),
                                                    Shard("a", 1, 0, 16, 600, 400)]
    # a piece that cannot merge with the first does not stop the search for one that can
    skip = Plan("t", "x", [Shard("a", 0, 0, 16, 0, 200), Shard("a", 0, 0, 16, 600, 200), Shard("a", 0, 0, 16, 200, 200),
                           Shard("a", 1, 0, 16, 400, 200), Shard("a", 1, 0, 16, 800, 200)])
    assert normalize(make(), skip).shards == [Shard("a", 0, 0, 16, 0, 400), Shard("a", 0, 0, 16, 600, 200),
                                              Shard("a", 1, 0, 16, 400, 200), Shard("a", 1, 0, 16, 800, 200)]
    # grid: two column halves of rows 0-500 on device 1 merge side by side; rows 500-1000 stay apart
    grid = Plan("t", "x", [Shard("a", 1, 8, 8, 0, 500), Shard("a", 1, 0, 8, 0, 500), Shard("a", 0, 0, 16, 500, 500)])
    assert normalize(make(), grid).shards == [Shard("a", 1, 0, 16, 0, 500), Shard("a", 0, 0, 16, 500, 500)]
    # same device, neither side by side nor stacked: nothing to merge
    apart = [Shard("a", 0, 0, 8, 0, 500), Shard("a", 0, 8, 8, 500, 500), Shard("a", 1, 8, 8, 0, 500),
             Shard("a", 1, 0, 8, 500, 500)]
    assert normalize(make(), Plan("t", "x", apart)).shards == apart
    # stacked but of different widths, or side by side but of different heights: no merge either
    odd = [Shard("a", 0, 0, 8, 0, 500), Shard("a", 0, 0, 16, 500, 500), Shard("a", 1, 8, 8, 0, 500)]
    assert normalize(make(), Plan("t", "x", odd)).shards == odd
    three = Plan("t", "x", [Shard("a", 0, 0, 16, 0, 200), Shard("a", 0, 0, 16, 400, 600), Shard("a", 0, 0, 16, 200, 200)])
    assert normalize(make(), three).shards == [Shard("a", 0, 0, 16, 0, 1000)]


def test_row_level_plans_are_not_pieces_sharing_a_device():
    replicated = Plan("t", "x", [Shard("a", 0, 0, 16, 0, 500), Shard("a", 0, 0, 16, 500, 500),
                                 Shard("a", 1, 0, 16, 0, 500, replica=1)])
    assert pieces_sharing_a_device(replicated) == []
    mapped = Plan("t", "x", [Shard("a", 0, 0, 16, 0, 500), Shard("a", 0, 0, 16, 500, 500)], row_maps={"a": np.array([1])})
    assert pieces_sharing_a_device(mapped) == []
    both = Plan("t", "x", [Shard("a", 0, 0, 16, 0, 500), Shard("a", 0, 0, 16, 500, 500), Shard.whole(B, 1),
                           Shard("b", 0, 0, 4, 0, 500), Shard("b", 1, 4, 4, 0, 500)])
    assert sorted(pieces_sharing_a_device(both)) == [("a", 0, 2), ("b", 1, 2)]


# ============================================================================= the memory ledger
def test_ledger_takes_and_refuses_with_the_free_bytes():
    led = MemoryLedger(task_of([A], devices=2, memory=100))
    led.take(1, 60)
    led.take(1, 40)  # exactly the rest
    assert led.free == [100, 0]
    with raises(PlanError, "device 1 has 0 bytes free, 1 requested"):
        led.take(1, 1)
    assert led.need(A) == task_of([A]).table_memory_bytes(A)
    assert led.need(A, rows=10) == 10 * 16 * 4 + 2 * 10 * 16 * 4 and led.need(A, dim=4) == 1000 * 4 * 4 + 2 * 10 * 4 * 4
    assert led.need(A, rows=10, dim=4) == 10 * 4 * 4 + 2 * 10 * 4 * 4


def test_ledger_place_prefers_in_order_and_names_the_shortfall():
    led = MemoryLedger(task_of([A], devices=3, memory=100))
    assert led.place(A, 70, [2, 0, 1]) == 2
    assert led.place(A, 40, [2, 0, 1]) == 0       # device 2 has 30 left
    assert led.place(A, 30, [2, 0, 1]) == 2       # exactly fits
    assert led.free == [60, 100, 0]
    with pytest.raises(InfeasibleError) as e:
        led.place(A, 101, [0, 1, 2])
    assert str(e.value) == ("table 'a' needs 101 bytes but the most free memory on any device is 100 bytes (device 1): "
                            "short by 1 bytes")
    assert (e.value.table, e.value.shortfall_bytes) == ("a", 1)
    with pytest.raises(InfeasibleError):
        led.place(A, 70, [0, 2])  # device 1 has room but is not preferred: not taken
    err = infeasible(B, 10, 4, 3, 6)
    assert str(err) == "table 'b' needs 10 bytes but the most free memory on any device is 4 bytes (device 3): short by 6 bytes"
    assert (err.table, err.shortfall_bytes) == ("b", 6)


def test_ledger_nowhere_names_the_device_with_the_most_room():
    led = MemoryLedger(task_of([A], devices=3, memory=100))
    led.take(0, 50)
    led.take(2, 10)
    e = led.nowhere(A, 105)
    assert (e.table, e.shortfall_bytes) == ("a", 5) and "(device 1)" in str(e) and "is 100 bytes" in str(e)
    led.take(1, 30)  # now device 2 (90 free) has the most room
    assert "(device 2)" in str(led.nowhere(A, 95)) and led.nowhere(A, 95).shortfall_bytes == 5


def test_ledger_look_ahead_by_hand():
    # two devices of 10; pending pieces 6, 4, 4 (and the 6 being placed first). Putting the 6 on
    # device 0 leaves 4 + 10: the two 4s pack. Then a 4 on device 0 (4 free) leaves 0 + 10 for
    # the last 4: fine, so device 0 is taken both times.
    led = MemoryLedger(task_of([A], devices=2, memory=10), pending=[4, 6, 4])
    assert led.place(A, 6, [0, 1]) == 0
    assert led.place(A, 4, [0, 1]) == 0
    assert led.place(A, 4, [0, 1]) == 1
    # the case the look-ahead exists for: big 8 still pending, two 3s placed first on a preferred
    # device 0 then 1 would leave 7 + 7: no room for the 8. The ledger keeps one device free.
    led = MemoryLedger(task_of([A], devices=2, memory=10), pending=[3, 3, 8])
    assert led.place(A, 3, [0, 1]) == 0
    assert led.place(A, 3, [1, 0]) == 0   # device 1 preferred, but then the 8 fits nowhere
    assert led.place(A, 8, [0, 1]) == 1
    # when no preferred device keeps the rest packable, the first preferred one with room is taken
    led = MemoryLedger(task_of([A], devices=2, memory=10), pending=[6, 6, 6])
    assert led.place(A, 6, [1, 0]) == 1
    assert led.place(A, 6, [1, 0]) == 0


def test_ledger_forgets_one_pending_piece_of_the_placed_size():
    def pending(led):  # the sizes still pending, largest first
        a = led._ahead
        return sorted((int(n) for n, p in zip(a.needs, a.pending) if p), reverse=True) if a is not None else []

    led = MemoryLedger(task_of([A], devices=1, memory=100), pending=[5, 9, 5, 1])
    assert pending(led) == [9, 5, 5, 1]
    led.forget_pending(5)
    assert pending(led) == [9, 5, 1]   # one 5 only
    led.forget_pending(7)
    assert pending(led) == [9, 5, 1]   # not pending: nothing removed
    led.forget_pending(1)
    led.forget_pending(9)
    assert pending(led) == [5]
    led.forget_pending(5)
    led.forget_pending(5)
    assert pending(led) == []


def test_ledger_pack_check_by_hand():
    led = MemoryLedger(task_of([A], devices=2, memory=10), pending=[5, 5])
    assert led.pending_pack_after(0, 0)           # 10 + 10 hold 5 + 5
    assert led.pending_pack_after(0, 5)           # 5 + 10 hold them
    assert led.pending_pack_after(1, 6)           # 10 + 4: 5 and 5 on device 0
    assert led.pending_pack_after(1, 7)           # 10 + 3: both 5s on device 0
    led2 = MemoryLedger(task_of([A], devices=2, memory=10), pending=[6, 5])
    assert led2.pending_pack_after(0, 4)          # 6 + 10: the 6 on device 0, the 5 on device 1
    assert led2.pending_pack_after(0, 5)          # 5 + 10: the 6 on device 1 (4 left), the 5 on device 0
    led3 = MemoryLedger(task_of([A], devices=2, memory=10), pending=[6, 6])
    assert not led3.pending_pack_after(0, 5)      # 5 + 10: one 6 on device 1, the other fits nowhere
    assert led3.pending_pack_after(0, 4)          # 6 + 10
    assert MemoryLedger(task_of([A], devices=2, memory=10)).pending_pack_after(0, 10)  # nothing pending


# ============================================================================= the baselines, by hand
def test_cost_keys_by_hand():
    t = Table("x", 1000, 8, 2.5)
    assert COST_KEYS["size"](t) == 1000 * 8 * 4 and COST_KEYS["dim"](t) == 8.0
    assert COST_KEYS["lookup"](t) == 20.0 and COST_KEYS["size_lookup"](t) == pytest.approx(20.0 * 3)  # log10 1000
    assert COST_KEYS["size_lookup"](Table("y", 5, 4, 1.0)) == pytest.approx(4.0)  # rows floored at 10: log10 = 1
    with raises(InputError, "unknown greedy key 'speed'; choose from ['dim', 'lookup', 'size', 'size_lookup']"):
        GreedySharder("speed")
    assert GreedySharder("dim").name == "dim_greedy" and GreedySharder("dim", name="mine").name == "mine"
    assert RandomSharder().name == "random" and RandomSharder(name="r2").name == "r2" and RandomSharder().seed == 0
    assert RoundRobinSharder().name == "round_robin" and RoundRobinSharder("rr").name == "rr"
    assert PileUpSharder().name == "pile_up" and PileUpSharder("floor").name == "floor"


def test_greedy_by_hand():
    # lookup costs (dim x pooling): t0 8x1 = 8, t1 8x4 = 32, t2 4x4 = 16, t3 4x2 = 8
    tables = [Table("t0", 100, 8, 1.0), Table("t1", 100, 8, 4.0), Table("t2", 100, 4, 4.0), Table("t3", 100, 4, 2.0)]
    task = task_of(tables, devices=2)
    plan = GreedySharder("lookup").shard(task)
    # order t1 (32), t2 (16), t0 (8, name before t3), t3 (8): t1 -> 0; t2 -> 1 (16 < 32); t0 -> 1 (24); t3 -> 1 (32)?
    # no: after t0 device 1 holds 24 < 32, so t3 goes to device 1 too (32 = 32 would tie with 0; 24 < 32)
    assert [(s.table, s.device) for s in plan.shards] == [("t1", 0), ("t2", 1), ("t0", 1), ("t3", 1)]
    assert plan.algorithm == "lookup_greedy" and plan.task == "t"
    assert all(s == Shard.whole(task.table(s.table), s.device) for s in plan.shards)
    # equal running costs: the device with more free memory, then the lower index
    same = [Table(f"s{i}", 100, 4, 1.0) for i in range(3)]
    plan = GreedySharder("dim").shard(task_of(same, devices=3))
    assert [(s.table, s.device) for s in plan.shards] == [("s0", 0), ("s1", 1), ("s2", 2)]


def test_greedy_accumulates_cost_and_breaks_ties_by_free_memory():
    # lookup costs 10, 6, 6, 6 on 2 devices: 10 -> 0; 6 -> 1; 6 -> 1 (6 < 10, now 12); 6 -> 0 (10 < 12)
    tables = [Table("a", 100, 4, 2.5), Table("b", 100, 4, 1.5), Table("c", 100, 4, 1.5), Table("d", 100, 4, 1.5)]
    plan = GreedySharder("lookup").shard(task_of(tables, devices=2))
    assert [(s.table, s.device) for s in plan.shards] == [("a", 0), ("b", 1), ("c", 1), ("d", 0)]
    # two tables that cost nothing: the first goes to device 0, the second to the device with
    # more free memory (device 1), although both devices' running costs are equal (0)
    free = [Table("m", 5000, 4, 0.0), Table("n", 100, 4, 0.0)]
    plan = GreedySharder("lookup").shard(task_of(free, devices=2))
    assert [(s.table, s.device) for s in plan.shards] == [("m", 0), ("n", 1)]


def test_every_baseline_looks_ahead_instead_of_stranding_a_big_table():
    # 2 devices, each with room for the big table plus two small ones; the 8 small ones are
    # hotter (placed first by the greedy keys) and come first in task order. Spread evenly,
    # 4 + 4, they leave no device room for the big one: the look-ahead keeps one device free.
    small = [Table(f"s{i}", 1000, 4 * 32, 50.0) for i in range(8)]
    big = Table("z_big", 9000, 100 * 4, 0.1)
    probe = task_of([*small, big], batch=1)
    memory = probe.table_memory_bytes(big) + 2 * probe.table_memory_bytes(small[0])
    task = task_of([*small, big], devices=2, memory=memory, batch=1)
    for sharder in (GreedySharder("lookup"), GreedySharder("dim"), RoundRobinSharder(), RandomSharder(seed=0)):
        plan = sharder.shard(task)
        validate(task, plan)
        big_device = next(s.device for s in plan.shards if s.table == "z_big")
        assert sum(s.device == big_device for s in plan.shards) == 3, sharder.name  # big + 2 small
        assert plan.task == "t" and plan.algorithm == sharder.name


def test_pile_up_looks_ahead_too():
    # needs (batch 1, dim 4: 16 x (rows + 2) bytes): two hot tables of 6400, two cold of 9600;
    # 16000 bytes a device. Heaviest first onto device 0 would put both hot ones there (12800)
    # and leave no device room for the second cold one. The only plan: one of each per device.
    hot = [Table(f"h{i}", 398, 4, 10.0) for i in range(2)]
    cold = [Table(f"c{i}", 598, 4, 1.0) for i in range(2)]
    task = task_of([*hot, *cold], devices=2, memory=16000, batch=1)
    assert [task.table_memory_bytes(t) for t in (*hot, *cold)] == [6400, 6400, 9600, 9600]
    plan = PileUpSharder().shard(task)
    assert [(s.table, s.device) for s in plan.shards] == [("h0", 0), ("h1", 1), ("c0", 0), ("c1", 1)]


def test_every_baseline_names_the_table_that_fits_nowhere():
    tables = [Table("small", 10, 4, 1.0), Table("huge", 10_000, 64, 1.0)]
    need = task_of(tables, batch=1).table_memory_bytes(tables[1])
    task = task_of(tables, devices=2, memory=need - 7, batch=1)
    for sharder in (GreedySharder("size"), GreedySharder("lookup"), RoundRobinSharder(), RandomSharder(), PileUpSharder()):
        with pytest.raises(InfeasibleError) as e:
            sharder.shard(task)
        assert e.value.table == "huge" and e.value.shortfall_bytes in (7, 7 + task.table_memory_bytes(tables[0]))
        assert str(e.value).startswith(f"table 'huge' needs {need} bytes")


def test_round_robin_skips_a_full_device_forwards():
    # t0 fills device 0; t3's turn is device 0 again, which has no room: the next device (1)
    t0 = Table("t0", 1000, 16, 1.0)
    rest = [Table(f"t{i}", 10, 4, 1.0) for i in range(1, 6)]
    memory = task_of([t0], batch=1).table_memory_bytes(t0)
    plan = RoundRobinSharder().shard(task_of([t0, *rest], devices=3, memory=memory, batch=1))
    assert [s.device for s in plan.shards] == [0, 1, 2, 1, 2, 1]


def test_round_robin_and_pile_up_by_hand():
    tables = [Table(f"t{i}", 100, 4, float(i)) for i in range(5)]
    rr = RoundRobinSharder().shard(task_of(tables, devices=3))
    assert [s.device for s in rr.shards] == [0, 1, 2, 0, 1] and rr.algorithm == "round_robin"
    # a device without room is skipped and the next table goes to the device after the one used
    need = task_of(tables).table_memory_bytes(tables[0])
    tight = task_of(tables, devices=3, memory=2 * need)
    led_plan = RoundRobinSharder().shard(tight)
    assert [s.device for s in led_plan.shards] == [0, 1, 2, 0, 1]
    pile = PileUpSharder().shard(task_of(tables, devices=3))
    assert {s.device for s in pile.shards} == {0} and [s.table for s in pile.shards] == ["t4", "t3", "t2", "t1", "t0"]
    spill = PileUpSharder().shard(task_of(tables, devices=3, memory=2 * need))
    assert [(s.table, s.device) for s in spill.shards] == [("t4", 0), ("t3", 0), ("t2", 1), ("t1", 1), ("t0", 2)]
    assert spill.algorithm == "pile_up" and spill.task == "t"


def test_random_is_seeded_and_uniform_over_devices_with_room():
    tables = [Table(f"t{i}", 100, 4, 1.0) for i in range(200)]
    task = task_of(tables, devices=4)
    a, b = RandomSharder(seed=1).shard(task), RandomSharder(seed=1).shard(task)
    assert a.shards == b.shards and a.algorithm == "random"
    assert a.shards != RandomSharder(seed=2).shard(task).shards
    counts = np.bincount([s.device for s in a.shards], minlength=4)
    assert counts.min() > 30  # 200 tables over 4 devices: about 50 each, never one device for all
    # the same draws as numpy's permutation with that seed (the first device of each permutation)
    rng = np.random.default_rng(1)
    assert [s.device for s in a.shards[:20]] == [int(rng.permutation(4)[0]) for _ in range(20)]
