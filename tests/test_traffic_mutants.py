"""evaluate=traffic (embshard.flexshard.traffic), byte by byte: hand-counted steps on tiny
batches, and a naive second counter (plain loops over samples and ids, written from the
module's docstring) for replayed held-out steps.

Byte widths are this file's own: an id is an int64 (8 bytes), an embedding element an fp32
(4 bytes); they are not read from traffic.py's constants.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from embshard import InputError, Plan, Shard, Table, Task
from embshard.flexshard.stats import step_batch
from embshard.flexshard.traffic import (
    ALL_TO_ALL_PURPOSES,
    PURPOSES,
    TrafficEvaluator,
    TrafficModel,
    global_batches,
    phase_ms,
    summarize_steps,
)

ID = 8      # bytes of an int64 id
FLOAT = 4   # bytes of an fp32 element
#: GiB/s that make 1 byte per ms (GiB = 2**30 bytes): phases then last as many ms as they move bytes
ONE_BYTE_PER_MS = 1e3 / 2**30


def two_device_task(devices_per_host=2, **kw) -> Task:
    tables = (Table("p", 10, 8, 1.5), Table("s", 10, 4, 1.0, kind="sequence"))
    return Task("tr", 2, 1 << 30, 4, tables, devices_per_host=devices_per_host,
                intra_host_gbps=ONE_BYTE_PER_MS, inter_host_gbps=2 * ONE_BYTE_PER_MS, **kw)


def batch(**tables) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """table -> per-sample id lists (4 samples: 0 and 1 live on device 0, 2 and 3 on device 1)."""
    return {name: (np.array([i for bag in bags for i in bag], dtype=np.int64), np.array([len(b) for b in bags]))
            for name, bags in tables.items()}


PLAN = Plan("tr", "x", [Shard("p", 1, 0, 8, 0, 10), Shard("s", 0, 0, 4, 0, 10)])
# p on device 1: device 0 sends ids 5, 1, 1 (3 ids); s on device 0: device 1 sends ids 4, 4 (2 ids)
BATCH = batch(p=[[5], [1, 1], [], [2, 2, 9]], s=[[3, 3], [], [4], [4]])


def test_one_step_by_hand():
    model = TrafficModel(two_device_task(), PLAN)
    step = model.step(BATCH)
    # ids: every pair exchanges the split counts first, one int64 per table (2 tables): 16 bytes;
    # then device 0 -> 1: 3 ids of p; device 1 -> 0: 2 ids of s
    assert step.phases["ids"].tolist() == [[0, 2 * ID + 3 * ID], [2 * ID + 2 * ID, 0]]
    # embeddings: p (pooled, 8 wide) sends device 0's 2 samples their pooled sums: 2 x 8 x 4 = 64 bytes
    # from device 1 to 0; s (sequence, 4 wide) returns one vector per id: 2 x 4 x 4 = 32 bytes from 0 to 1
    assert step.phases["embeddings_fw"].tolist() == [[0, 2 * 4 * FLOAT], [2 * 8 * FLOAT, 0]]
    assert step.phases["gradients_bw"].tolist() == [[0, 2 * 8 * FLOAT], [2 * 4 * FLOAT, 0]]
    for p in ("intra_reduce_scatter", "inter_reduce_scatter", "inter_all_gather", "intra_all_gather"):
        assert not step.phases[p].any()
    assert not step.purpose_matrix("replica_sync").any()
    # one host at 1 byte/ms: a phase lasts as long as its busiest device's larger direction
    ms = model.step_ms(step)
    assert ms["ids"] == pytest.approx(40.0)            # device 0 sends 40, device 1 sends 32
    assert ms["embeddings_fw"] == pytest.approx(64.0)
    assert ms["gradients_bw"] == pytest.approx(64.0)


def test_dedup_sends_each_distinct_id_once_per_device_and_table():
    plan = Plan("tr", "x", PLAN.shards, dedup_ids=True)
    step = TrafficModel(two_device_task(), plan).step(BATCH)
    # device 0 sends p's distinct ids {5, 1}; device 1 sends s's distinct {4}: one vector back
    assert step.phases["ids"][0, 1] == 2 * ID + 2 * ID and step.phases["ids"][1, 0] == 2 * ID + 1 * ID
    assert step.phases["embeddings_fw"].tolist() == [[0, 1 * 4 * FLOAT], [2 * 8 * FLOAT, 0]]


def test_two_hosts_use_the_inter_host_link():
    model = TrafficModel(two_device_task(devices_per_host=1), PLAN)
    step = model.step(BATCH)
    ms = model.step_ms(step)
    assert ms["ids"] == pytest.approx(40.0 / 2)  # 2 bytes/ms between hosts
    report = summarize_steps(model, [step])
    ids = report.bytes_by_purpose["ids"]
    assert (ids["intra_host"], ids["inter_host"], ids["total"]) == (0.0, 72.0, 72.0)
    one_host = summarize_steps(TrafficModel(two_device_task(), PLAN), [step])
    assert one_host.bytes_by_purpose["ids"] == {"intra_host": 72.0, "inter_host": 0.0, "total": 72.0}


def test_phase_time_by_hand():
    # 4 devices, 2 per host; intra 10 bytes/ms, inter 1 byte/ms
    intra = np.array([[True, True, False, False], [True, True, False, False],
                      [False, False, True, True], [False, False, True, True]])
    m = np.zeros((4, 4))
    m[0, 1] = 100.0    # intra: device 0 sends 100, device 1 receives 100 -> 10 ms
    m[2, 3] = 30.0
    m[3, 2] = 50.0     # intra on host 1: device 3 sends 50 and receives 30 -> 5 ms
    m[0, 2] = 4.0      # inter: device 0 sends 4 + 3 = 7 -> 7 ms
    m[0, 3] = 3.0
    m[1, 2] = 2.0      # device 2 receives 4 + 2 = 6 -> 6 ms
    assert phase_ms(m, intra, 10.0, 1.0) == pytest.approx(10.0)
    assert phase_ms(m, intra, 100.0, 1.0) == pytest.approx(7.0)   # now the inter-host link is the slower
    assert phase_ms(m.T, intra, 100.0, 1.0) == pytest.approx(7.0)  # received counts like sent
    assert phase_ms(np.zeros((4, 4)), intra, 1.0, 1.0) == 0.0


def test_replicated_rows_are_synchronised_and_looked_up_locally():
    t = Table("r", 4, 4, 2.0)
    task = Task("rep", 2, 1 << 30, 4, (t,), intra_host_gbps=ONE_BYTE_PER_MS)
    plan = Plan("rep", "x", [Shard("r", 0, 0, 4, 0, 4), Shard("r", 1, 0, 4, 0, 4, replica=1)])
    model = TrafficModel(task, plan)
    step = model.step(batch(r=[[0, 1], [2], [3], [0, 3]]))
    # every device holds every row: only the split counts (one int64 per table) cross
    assert step.phases["ids"].tolist() == [[0, ID], [ID, 0]]
    assert not step.phases["embeddings_fw"].any() and not step.phases["gradients_bw"].any()
    # the gradient (4 rows x 4 = 16 floats) is all-reduced between the two copies on one host:
    # reduce-scatter, each sends the other's half (8 floats = 32 bytes), then all-gather the same
    assert step.phases["intra_reduce_scatter"].tolist() == [[0, 32], [32, 0]]
    assert step.phases["intra_all_gather"].tolist() == [[0, 32], [32, 0]]
    assert step.purpose_matrix("replica_sync").tolist() == [[0, 64], [64, 0]]
    report = summarize_steps(model, [step])
    assert report.bytes_by_purpose["replica_sync"]["total"] == 128.0
    assert report.modeled_phase_ms["replica_sync"] == pytest.approx(32.0 + 32.0)  # two phases of 32 ms
    assert report.modeled_comm_ms == pytest.approx(8.0 + 0 + 0 + 64.0)


def test_two_replicated_tables_add_their_synchronisation():
    # two tables, each held whole on both devices: each all-reduces its own gradient, and the
    # bytes of both go over the same pair of devices in the same phases
    t, u = Table("r", 4, 4, 2.0), Table("q", 2, 8, 1.0)
    task = Task("rep", 2, 1 << 30, 4, (t, u), intra_host_gbps=ONE_BYTE_PER_MS)
    plan = Plan("rep", "x", [Shard("r", 0, 0, 4, 0, 4), Shard("r", 1, 0, 4, 0, 4, replica=1),
                             Shard("q", 1, 0, 8, 0, 2), Shard("q", 0, 0, 8, 0, 2, replica=1)])
    step = TrafficModel(task, plan).step(batch(r=[[0], [], [], []], q=[[], [1], [], []]))
    # r: 16 floats, halves of 8 (32 bytes) each way; q: 16 floats likewise: 64 bytes each way per phase
    assert step.phases["intra_reduce_scatter"].tolist() == [[0, 64], [64, 0]]
    assert step.phases["intra_all_gather"].tolist() == [[0, 64], [64, 0]]


def test_tables_beyond_the_lookup_table_limit_route_by_search():
    from embshard.flexshard.traffic import LUT_MAX_ROWS

    rows = LUT_MAX_ROWS + 8  # no per-row segment table for this one: ids are routed by binary search
    half = rows // 2
    big = Table("big", rows, 4, 1.0)
    task = Task("big", 2, 1 << 40, 4, (big,), intra_host_gbps=ONE_BYTE_PER_MS)
    plan = Plan("big", "x", [Shard("big", 0, 0, 4, 0, half), Shard("big", 1, 0, 4, half, rows - half)])
    ids = [[0], [half], [half - 1, rows - 1], [5]]  # device 0 asks device 1 for one id; device 1 asks 0 for two
    step = TrafficModel(task, plan).step(batch(big=ids))
    assert step.phases["ids"].tolist() == [[0, ID + 1 * ID], [ID + 2 * ID, 0]]
    # pooled row-wise: each row block sends every requester's samples their partial sums
    assert step.phases["embeddings_fw"].tolist() == [[0, 2 * 4 * FLOAT], [2 * 4 * FLOAT, 0]]


def test_summary_over_steps_by_hand():
    model = TrafficModel(two_device_task(), PLAN)
    first = model.step(BATCH)
    second = model.step(batch(p=[[1], [], [], []], s=[[], [], [], []]))
    # second step: ids 16 + 8 from device 0, 16 from device 1; p's 2 samples' sums (64 bytes) from 1 to 0
    assert second.phases["ids"].tolist() == [[0, 24], [16, 0]]
    r = summarize_steps(model, [first, second])
    assert r.steps == 2
    assert r.bytes_by_purpose["ids"]["total"] == pytest.approx((72 + 40) / 2)
    assert r.bytes_by_purpose["embeddings_fw"]["total"] == pytest.approx((96 + 64) / 2)
    assert r.bytes_by_purpose["gradients_bw"]["total"] == pytest.approx((96 + 64) / 2)
    assert r.bytes_by_purpose["replica_sync"] == {"intra_host": 0.0, "inter_host": 0.0, "total": 0.0}
    # device 0 sends: ids (40 + 24)/2, embeddings of s (32 + 0)/2, gradients of p (64 + 64)/2;
    # device 1: ids (32 + 16)/2, embeddings of p (64 + 64)/2, gradients of s (32 + 0)/2
    assert r.device_sent_bytes == pytest.approx([32 + 16 + 64, 24 + 64 + 16])
    assert r.device_received_bytes == pytest.approx([24 + 64 + 16, 32 + 16 + 64])
    assert r.pair_bytes == [[0.0, 112.0], [104.0, 0.0]]
    assert r.busiest_device_bytes == pytest.approx(112.0)
    # modeled ms: ids (40 + 24)/2 = 32, embeddings (64 + 64)/2 = 64, gradients 64, no sync
    assert r.modeled_phase_ms == pytest.approx({"ids": 32.0, "embeddings_fw": 64.0, "gradients_bw": 64.0,
                                                "replica_sync": 0.0})
    assert r.modeled_comm_ms == pytest.approx(160.0)
    assert r.traffic_bytes == pytest.approx({"intra_host": 216.0, "inter_host": 0.0, "total": 216.0})  # 56 + 80 + 80
    assert r.all_to_all_bytes == r.traffic_bytes
    d = r.to_dict()
    assert set(d) == {"steps", "traffic_bytes", "all_to_all_bytes", "bytes_by_purpose", "busiest_device_bytes",
                      "device_sent_bytes", "device_received_bytes", "modeled_comm_ms", "modeled_phase_ms"}
    assert d["steps"] == 2 and d["busiest_device_bytes"] == r.busiest_device_bytes
    assert d["modeled_comm_ms"] == r.modeled_comm_ms and d["device_sent_bytes"] == r.device_sent_bytes
    assert d["traffic_bytes"] == r.traffic_bytes and d["all_to_all_bytes"] == r.all_to_all_bytes
    assert PURPOSES == ("ids", "embeddings_fw", "gradients_bw", "replica_sync")
    assert ALL_TO_ALL_PURPOSES == PURPOSES[:3]


def test_bad_batches_are_input_errors():
    model = TrafficModel(two_device_task(), PLAN)
    with pytest.raises(InputError, match=r"^no batch for table 'p'$"):
        model.step({"s": BATCH["s"]})
    short = dict(BATCH, s=(np.array([1]), np.array([1, 0, 0])))
    with pytest.raises(InputError, match=r"^table 's': batch of 3 samples, the task's is 4$"):
        model.step(short)


# ----------------------------------------------------------------------------- a second counter
def naive_step_bytes(task: Task, plan: Plan, tables_batch) -> np.ndarray:
    """All purposes' bytes [src, dst] of one step, counted sample by sample and id by id from
    the module docstring (no replicas): split counts, ids to the holder of their row, embeddings
    back (per id for sequence tables, per sample and holder for pooled ones), gradients alike."""
    d = task.num_devices
    per_device = [task.batch_size // d + (1 if r < task.batch_size % d else 0) for r in range(d)]
    owner = [r for r in range(d) for _ in range(per_device[r])]
    pieces = {}
    for s in plan.shards:
        pieces.setdefault(s.table, []).append(s)
    columns = sum(len({(s.col_offset, s.dim) for s in ps}) for ps in pieces.values())
    out = np.zeros((d, d))
    for a in range(d):
        for b in range(d):
            if a != b:
                out[a, b] += ID * columns
    for t in task.tables:
        ids, lengths = tables_batch[t.name]
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for (col, width) in sorted({(s.col_offset, s.dim) for s in pieces[t.name]}):
            blocks = [s for s in pieces[t.name] if (s.col_offset, s.dim) == (col, width)]
            sent = set()
            for sample in range(task.batch_size):
                src = owner[sample]
                for i in ids[starts[sample]:starts[sample + 1]]:
                    dst = next(s.device for s in blocks if s.row_offset <= i < s.row_offset + s.rows)
                    if plan.dedup_ids and (src, int(i)) in sent:
                        continue
                    sent.add((src, int(i)))
                    if dst != src:
                        out[src, dst] += ID
                        if t.is_sequence:
                            out[dst, src] += FLOAT * width   # the vector
                            out[src, dst] += FLOAT * width   # its gradient
            if not t.is_sequence:
                for src in range(d):
                    for dst in {s.device for s in blocks}:
                        if dst != src:
                            out[dst, src] += FLOAT * width * per_device[src]
                            out[src, dst] += FLOAT * width * per_device[src]
    return out


@pytest.mark.parametrize("dedup", [False, True])
def test_replayed_steps_match_a_naive_count(dedup):
    tables = (Table("a", 300, 16, 4.0), Table("b", 50, 8, 2.0, kind="sequence"), Table("c", 1000, 12, 3.0))
    task = Task("nv", 3, 1 << 30, 7, tables, devices_per_host=3)
    # a: column halves on devices 0 and 2; b: row blocks 0-20 on 1 and 20-50 on 2; c: whole on 1
    plan = Plan("nv", "x", [Shard("a", 0, 0, 8, 0, 300), Shard("a", 2, 8, 8, 0, 300), Shard("b", 1, 0, 8, 0, 20),
                            Shard("b", 2, 0, 8, 20, 30), Shard("c", 1, 0, 12, 0, 1000)], dedup_ids=dedup)
    evaluator = TrafficEvaluator(fit_batches=2, eval_batches=2, seed=3)
    [report] = evaluator.evaluate(task, [plan], fitted_on=[2])
    batches = global_batches(task, range(2, 4), seed=3)
    assert batches[0]["a"][0].tolist() == step_batch(tables[0], 7, 2, 3)[0].tolist()
    naive = sum(naive_step_bytes(task, plan, b) for b in batches) / 2
    assert report.steps == 2
    assert np.allclose(report.pair_bytes, naive)
    assert report.traffic_bytes["total"] == pytest.approx(naive.sum())


def test_evaluator_refuses_plans_fitted_on_evaluation_steps_and_short_traces(tmp_path):
    task = two_device_task()
    ev = TrafficEvaluator(fit_batches=2, eval_batches=3)
    ev.evaluate(task, [PLAN, PLAN], fitted_on=[2, None])  # fitted on steps 0-1: fine
    msg = "x was fitted on steps 0..2, which overlap the evaluation steps 2..4; raise traffic.fit_batches to 3"
    with pytest.raises(InputError, match="^" + re.escape(msg) + "$"):
        ev.evaluate(task, [PLAN], fitted_on=[3])
    import torch

    from embshard.tables import TraceRef

    trace = tmp_path / "trace.pt"
    # one table of 10 samples (offsets 0..10, one id each): 2 fit + 3 held-out steps of 4 need 20
    torch.save((torch.zeros(10, dtype=torch.int64), torch.arange(11, dtype=torch.int64), torch.ones(1, 10, dtype=torch.int64)), trace)
    traced = Task("tr", 2, 1 << 30, 4, (Table("p", 10, 8, 1.0, trace=TraceRef(str(trace), 0)),))
    msg = ("task 'tr', table 'p': its trace has 10 samples but 2 fit + 3 held-out steps of batch 4 need 20")
    with pytest.raises(InputError, match="^" + re.escape(msg) + "$"):
        ev.check_task(traced)
    TrafficEvaluator(fit_batches=1, eval_batches=1).check_task(traced)  # 8 samples needed: fine
    exact = tmp_path / "exact.pt"  # 20 samples: exactly what 2 fit + 3 held-out steps of 4 need
    torch.save((torch.zeros(20, dtype=torch.int64), torch.arange(21, dtype=torch.int64),
                torch.ones(1, 20, dtype=torch.int64)), exact)
    ev.check_task(Task("tr", 2, 1 << 30, 4, (Table("p", 10, 8, 1.0, trace=TraceRef(str(exact), 0)),)))
    default = TrafficEvaluator()
    assert (default.split.fit_batches, default.split.eval_batches, default.split.seed) == (4, 4, 0)
    t = task.tables[0]
    assert global_batches(task, [1])[0]["p"][0].tolist() == step_batch(t, 4, 1, 0)[0].tolist()  # seed 0 by default
    ev.check_task(task)  # untraced tables are drawn: nothing to check
