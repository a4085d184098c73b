"""The headline tables (embshard.report) and the headroom they show (DeviceCosts.headroom).

Every expected value is worked out by hand in a comment beside it; bootstrap intervals use
ratios whose resampled means are known exactly (constant ratios: a zero-width interval; two
ratios a < b: the resampled means are a, (a+b)/2 and b with chances 1/4, 1/2, 1/4, so the
2.5th and 97.5th percentiles are a and b).
"""

from __future__ import annotations

import math

import pytest

from embshard import report
from embshard.compare import Result
from embshard.costs.base import DeviceCosts
from embshard.errors import InputError
from embshard.report import (
    HEURISTICS,
    best_heuristic,
    format_results,
    format_table,
    paired_samples_ratio,
    per_device,
    plot_costs,
    ratio_text,
    render,
    result_rows,
    summarize,
    vs_best_heuristic,
)
from embshard.tables import Table
from embshard.task import Task


def costs(compute, fw=None, bw=None, samples=(), spread=None) -> DeviceCosts:
    n = len(compute)
    return DeviceCosts(list(compute), list(fw or [0.0] * n), list(bw or [0.0] * n),
                       plan_cost_samples_ms=list(samples), plan_cost_spread_ms=spread)


def measured(task, algorithm, compute, samples=(), spread=None, seconds=None, envelope=None, fw=None, bw=None):
    return Result(task, algorithm, True, measured=costs(compute, fw, bw, samples, spread), search_seconds=seconds,
                  envelope=envelope, pieces=[1] * len(compute), memory_bytes=[2**20] * len(compute))


# ----------------------------------------------------------------------------- headroom
def test_headroom_by_hand():
    # compute 4 and 2 ms (mean 3), device 0 the slowest: reference = 3 + its fw 1 + its bw 0.5 = 4.5;
    # totals 4+1+0.5 = 5.5 and 2+3+0.5 = 5.5: plan cost 5.5, gap 1.0 = 22.2% of 4.5; imbalance 4/3
    h = DeviceCosts([4.0, 2.0], [1.0, 3.0], [0.5, 0.5]).headroom()
    assert h["compute_imbalance"] == pytest.approx(4 / 3)
    assert h["balance_reference_ms"] == pytest.approx(4.5)
    assert h["gap_ms"] == pytest.approx(1.0)
    assert h["gap_pct"] == pytest.approx(100 / 4.5)
    # the slowest device is the one with the most compute, wherever it sits: device 2 here
    h = DeviceCosts([1.0, 2.0, 6.0], [5.0, 4.0, 0.25], [1.0, 1.0, 0.75]).headroom()
    assert h["balance_reference_ms"] == pytest.approx(3.0 + 0.25 + 0.75)  # mean 3 + device 2's comm
    assert h["compute_imbalance"] == pytest.approx(2.0)  # 6 / 3
    assert h["gap_ms"] == pytest.approx(7.0 - 4.0)  # totals 7, 7, 7


def test_headroom_without_compute_or_cost():
    # no compute anywhere: balanced by definition, the reference is device 0's comm
    h = DeviceCosts([0.0, 0.0], [2.0, 1.0], [1.0, 1.0]).headroom()
    assert h["compute_imbalance"] == 1.0 and h["balance_reference_ms"] == pytest.approx(3.0)
    assert h["gap_ms"] == pytest.approx(0.0) and h["gap_pct"] == pytest.approx(0.0)
    zero = DeviceCosts([0.0], [0.0], [0.0]).headroom()
    assert zero == {"compute_imbalance": 1.0, "balance_reference_ms": 0.0, "gap_ms": 0.0, "gap_pct": 0.0}


def test_device_costs_dict_carries_totals_and_input_dist():
    c = DeviceCosts([1.0, 2.0], [0.5, 0.0], [0.25, 0.25], input_dist_ms=[3.0, 0.5])
    d = c.to_dict()
    assert d["total_ms"] == [4.75, 2.75] and d["plan_cost_ms"] == 4.75  # input ids' all-to-all counted
    assert d["headroom"] == c.headroom() and d["source"] == "kernels"


# ----------------------------------------------------------------------------- best heuristic and paired ratios
def test_heuristics_are_the_six_baselines():
    assert HEURISTICS == ("random", "round_robin", "size_greedy", "dim_greedy", "lookup_greedy", "size_lookup_greedy")


def test_best_heuristic_is_the_cheapest_costed_heuristic():
    rs = [measured("a", "neuroshard", [1.0]), measured("a", "size_greedy", [5.0]), measured("a", "random", [4.0]),
          Result("a", "dim_greedy", False), measured("a", "torchrec", [0.5])]
    assert best_heuristic(rs, "measured_cost_ms").algorithm == "random"  # not torchrec/neuroshard: not heuristics
    assert best_heuristic(rs, "estimated_cost_ms") is None  # nothing estimated
    assert best_heuristic([measured("a", "neuroshard", [1.0])], "measured_cost_ms") is None


def test_paired_samples_ratio():
    a = measured("t", "a", [1.0], samples=[2.0, 4.0, 6.0])
    b = measured("t", "b", [1.0], samples=[4.0, 8.0, 12.0])
    s = paired_samples_ratio(a, b)  # every pair 0.5: mean 0.5, zero-width interval, below 1
    assert (s.mean, s.low, s.high, s.n, s.verdict) == (pytest.approx(0.5), pytest.approx(0.5), pytest.approx(0.5), 3,
                                                       "better")
    two = paired_samples_ratio(measured("t", "a", [1.0], samples=[1.0, 1.2]), measured("t", "b", [1.0], samples=[2.0, 2.0]))
    assert (two.low, two.high) == (pytest.approx(0.5), pytest.approx(0.6))  # module docstring: a and b
    assert two.mean == pytest.approx(0.55)
    for sa, sb in (([1.0], [1.0]), ([1.0, 2.0], [1.0, 2.0, 3.0]), ([1.0, 0.0], [1.0, 1.0]), ([1.0, 1.0], [-1.0, 1.0])):
        assert paired_samples_ratio(measured("t", "a", [1.0], samples=sa), measured("t", "b", [1.0], samples=sb)) is None
    assert paired_samples_ratio(Result("t", "a", True), b) is None  # not measured
    assert paired_samples_ratio(b, Result("t", "a", True)) is None


def test_vs_best_heuristic_per_task():
    rs = [
        measured("w", "neuroshard", [1.0]),          # no heuristic on task w: left out, the others still done
        Result("x", "random", False, error="no room"),  # no cost: skipped, the task's others still done
        measured("x", "neuroshard", [3.0], samples=[3.0, 3.0]),
        measured("x", "size_greedy", [6.0], samples=[6.0, 6.0]),
        measured("x", "random", [9.0], samples=[9.0, 9.0]),
        measured("y", "neuroshard", [5.0]),          # no paired samples on task y
        measured("y", "lookup_greedy", [4.0]),
        measured("z", "neuroshard", [1.0]),          # no heuristic on task z: left out
    ]
    v = vs_best_heuristic(rs, "measured_cost_ms")
    assert set(v) == {("x", "neuroshard"), ("x", "size_greedy"), ("x", "random"), ("y", "neuroshard"), ("y", "lookup_greedy")}
    assert v[("x", "neuroshard")]["heuristic"] == "size_greedy" and v[("x", "neuroshard")]["ratio"] == pytest.approx(0.5)
    assert v[("x", "neuroshard")]["interval"]["verdict"] == "better"  # 3/6 in both repetitions
    assert v[("x", "random")]["ratio"] == pytest.approx(1.5) and v[("x", "random")]["interval"]["verdict"] == "worse"
    assert v[("x", "size_greedy")] == {"heuristic": "size_greedy", "ratio": 1.0, "interval": None}  # itself
    assert v[("y", "neuroshard")]["ratio"] == pytest.approx(1.25) and v[("y", "neuroshard")]["interval"] is None
    # an estimated comparison has no paired repetitions, so no interval
    est = [Result("x", "a", True, estimated=costs([2.0]), measured=costs([1.0], samples=[1.0, 1.0])),
           Result("x", "size_greedy", True, estimated=costs([4.0]), measured=costs([1.0], samples=[2.0, 2.0]))]
    e = vs_best_heuristic(est, "estimated_cost_ms")
    assert e[("x", "a")] == {"heuristic": "size_greedy", "ratio": pytest.approx(0.5), "interval": None}


# ----------------------------------------------------------------------------- summarize
def two_task_results():
    """Tasks p and q; neuroshard half the cost of the best heuristic on both."""
    env = {"out_of_envelope_devices": 1, "devices": 2}
    return [
        # task p: neuroshard 2 ms (compute 2 and 1), size_greedy 4 ms, random 5 ms
        measured("p", "neuroshard", [2.0, 1.0], samples=[2.0, 2.0], spread=0.2, seconds=1.0, envelope=env),
        measured("p", "size_greedy", [4.0, 0.0], samples=[4.0, 4.0], spread=0.4, seconds=0.5),
        measured("p", "random", [5.0, 5.0], samples=[5.0, 5.0], spread=0.1, seconds=0.25),
        # task q: neuroshard 3 ms, size_greedy 6 ms, random found no plan
        measured("q", "neuroshard", [3.0, 3.0], samples=[3.0, 3.0], spread=0.4, seconds=3.0, envelope=env),
        measured("q", "size_greedy", [6.0, 2.0], samples=[6.0, 6.0], spread=None, seconds=0.5),
        Result("q", "random", False, error="table 't1' needs 10 bytes", search_seconds=0.75),
    ]


def test_summarize_rows_by_hand():
    rows = {r["algorithm"]: r for r in summarize(two_task_results())}
    assert list(rows) == ["neuroshard", "size_greedy", "random"]  # first-appearance order
    ns, sg, rnd = rows["neuroshard"], rows["size_greedy"], rows["random"]
    assert (ns["valid"], ns["tasks"], sg["valid"], rnd["valid"], rnd["tasks"]) == (2, 2, 2, 1, 2)
    assert ns["mean_measured_cost_ms"] == pytest.approx(2.5)       # (2 + 3) / 2
    assert sg["mean_measured_cost_ms"] == pytest.approx(5.0)       # (4 + 6) / 2
    assert rnd["mean_measured_cost_ms"] == pytest.approx(5.0)      # task p only
    assert ns["mean_ratio_to_best"] == pytest.approx(1.0)          # the best on both
    assert sg["mean_ratio_to_best"] == pytest.approx(2.0)          # 4/2 and 6/3
    assert rnd["mean_ratio_to_best"] == pytest.approx(2.5)         # 5/2, the task it solved
    assert ns["mean_spread_ms"] == pytest.approx(0.3) and sg["mean_spread_ms"] == pytest.approx(0.4)
    # compute imbalance max/mean: neuroshard 2/1.5 on p and 3/3 on q; size_greedy 4/2 and 6/4
    assert ns["mean_compute_imbalance"] == pytest.approx((4 / 3 + 1.0) / 2)
    assert sg["mean_compute_imbalance"] == pytest.approx((2.0 + 1.5) / 2)
    # gap: neuroshard on p: reference 1.5 + 0 comm, cost 2 -> +33.3%; on q: 0% -> mean 16.7%
    assert ns["mean_gap_pct"] == pytest.approx((100 / 3 + 0.0) / 2)
    assert (ns["out_of_envelope_devices"], ns["devices"]) == (2, 4) and sg["devices"] is None
    assert ns["mean_search_seconds"] == pytest.approx(2.0) and rnd["mean_search_seconds"] == pytest.approx(0.5)
    # the best heuristic is size_greedy on both tasks: neuroshard's ratios 0.5 and 0.5 over 2 tasks
    h = ns["vs_best_heuristic"]
    assert (h["mean"], h["low"], h["high"]) == (pytest.approx(0.5), pytest.approx(0.5), pytest.approx(0.5))
    assert (h["verdict"], h["tasks"], h["basis"], h["tasks_worse_beyond_interval"]) == ("better", 2, "tasks", 0)
    r = rnd["vs_best_heuristic"]  # random: 5/4 on p, its only task: that task's own repetitions
    assert r["mean"] == pytest.approx(1.25) and r["tasks"] == 1 and r["basis"] == "repetitions"
    assert r["verdict"] == "worse" and r["low"] == pytest.approx(1.25) and r["high"] == pytest.approx(1.25)


def test_summarize_counts_tasks_worse_beyond_their_interval():
    rs = [measured("p", "a", [6.0], samples=[6.0, 6.0]), measured("p", "size_greedy", [4.0], samples=[4.0, 4.0]),
          measured("q", "a", [3.0], samples=[3.0, 3.1]), measured("q", "size_greedy", [3.0], samples=[3.0, 3.0])]
    row = summarize(rs)[0]
    # ratios 1.5 (p) and 1.0 (q): over tasks the resampled means are 1.5, 1.25 and 1.0
    h = row["vs_best_heuristic"]
    assert (h["low"], h["high"], h["verdict"]) == (pytest.approx(1.0), pytest.approx(1.5), "not resolved")
    # p is worse beyond its own interval (6/4 in both repetitions); q's interval [1.0, 1.033] touches 1
    assert h["tasks_worse_beyond_interval"] == 1


def test_summarize_without_costs_and_one_unpaired_task():
    rs = [Result("p", "a", True, search_seconds=None), Result("p", "b", False, error="x")]
    rows = summarize(rs)
    for r in rows:
        assert r["mean_measured_cost_ms"] is None and r["mean_ratio_to_best"] is None and r["vs_best_heuristic"] is None
        assert r["mean_spread_ms"] is None and r["mean_compute_imbalance"] is None and r["mean_gap_pct"] is None
        assert r["out_of_envelope_devices"] is None and r["mean_search_seconds"] is None
    assert [(r["valid"], r["tasks"]) for r in rows] == [(1, 1), (0, 1)]
    # one task, no paired repetitions: the ratio alone, not resolved
    one = summarize([measured("p", "a", [2.0]), measured("p", "random", [4.0])])[0]["vs_best_heuristic"]
    assert one == {"mean": pytest.approx(0.5), "tasks": 1, "basis": None, "low": None, "high": None,
                   "verdict": "not resolved"}


# ----------------------------------------------------------------------------- text
def test_ratio_text():
    assert ratio_text(None) == "-" and ratio_text({}) == "-"
    assert ratio_text({"mean": 0.9123, "low": 0.87, "high": 0.951, "verdict": "better"}) == "0.912x [0.870, 0.951] better"
    assert ratio_text({"mean": 1.02, "low": None, "verdict": "not resolved"}) == "1.020x not resolved"
    assert ratio_text({"ratio": 1.5, "low": None}) == "1.500x"  # a per-task entry: no verdict


def test_per_device():
    assert per_device([], "{:d}") == "-"
    assert per_device([1, 2, 3], "{:d}") == "1/2/3"
    assert per_device(list(range(8)), "{:d}") == "0/1/2/3/4/5/6/7"  # 8 devices: still each
    assert per_device([5, 1, 9, 3, 4, 4, 4, 4, 2], "{:d}") == "1..9 over 9"
    assert per_device([0.5, 1.25, 2.0], "{:.2f}", show=2) == "0.50..2.00 over 3"


def test_render_pads_drops_empty_columns_and_shows_reasons():
    cols = [report.Column("name", lambda r: r["n"]), report.Column("ok", lambda r: r["ok"]),
            report.Column("cost", lambda r: r["c"]), report.Column("empty", lambda r: "-")]
    rows = [{"n": "alpha", "ok": "yes", "c": "1.5"}, {"n": "b", "ok": "no", "c": "12.25"},
            {"n": "gamma-long", "ok": "no", "c": "-", "why": "does not fit"}]
    text = render(cols, rows, reason=lambda r: r.get("why"))
    assert text.splitlines() == [
        "name        ok   cost",      # widths: name 10 (gamma-long), ok 3, cost 5; "empty" is all "-"
        "----------  ---  -----",
        "alpha       yes  1.5",
        "b           no   12.25",
        "gamma-long  no   does not fit",
    ]
    # without reasons every row is full, and a column that is "-" in every row but has a header
    # among the first two is kept
    assert render(cols[:2], [{"n": "-", "ok": "-"}]).splitlines() == ["name  ok", "----  --", "-     -"]
    # the third column is dropped when empty, like any after it
    assert render([cols[0], cols[1], cols[3]], rows[:2]).splitlines()[0] == "name   ok"


def test_format_table_and_results_by_hand():
    rs = two_task_results()
    table = format_table(summarize(rs), "measured_cost_ms").splitlines()
    assert table[0].split("  ")[0] == "algorithm"
    header = table[0]
    for col in ("valid", "mean measured (ms)", "± spread", "vs best", "vs best heuristic [95% CI]", "imbalance",
                "gap to balance", "out of envelope", "mean search (s)"):
        assert col in header
    ns = table[2]
    assert ns.startswith("neuroshard ") and "2/2" in ns and "2.500" in ns and "1.000x" in ns
    assert "0.500x [0.500, 0.500] better" in ns and "1.17x" in ns and "+16.7%" in ns and "2/4" in ns
    rnd = table[4]
    assert rnd.startswith("random") and "1/2" in rnd and "1.250x [1.250, 1.250] worse" in rnd
    task = Task("q", 2, 3 * 2**20, 64, (Table("t1", 10, 4, 1.0),))
    lines = format_results(task, [r for r in rs if r.task == "q"], "measured_cost_ms").splitlines()
    assert "memory per device (MiB of 3.00)" in lines[0] and "pieces per device" in lines[0]
    assert lines[2].split()[:3] == ["neuroshard", "valid", "3.000"] and "0.500x [0.500, 0.500] better" in lines[2]
    assert "1.00/1.00" in lines[2] and "1/1" in lines[2]  # 1 MiB and one piece on each device
    assert lines[3].split()[:3] == ["size_greedy", "valid", "6.000"] and "1.000x (itself)" in lines[3]
    assert lines[4].split() == ["random", "INVALID", "table", "'t1'", "needs", "10", "bytes"]
    big = Task("q", 2, 3 * 2**30, 64, (Table("t1", 10, 4, 1.0),))
    assert "GiB of 3.00" in format_results(big, rs[3:4], "measured_cost_ms").splitlines()[0]
    # evaluate=none: search time only
    plain = format_table(summarize(rs, "search_seconds"), "search_seconds").splitlines()[0].split()
    assert plain == ["algorithm", "valid", "mean", "search", "(s)"]


SUMMARY_TABLE = """\
algorithm    valid  mean measured (ms)  ± spread  vs best  vs best heuristic [95% CI]          gap to balance  imbalance  out of envelope  mean search (s)
-----------  -----  ------------------  --------  -------  ----------------------------------  --------------  ---------  ---------------  ---------------
neuroshard   2/2    2.500               0.300     1.000x   0.500x [0.500, 0.500] better        +16.7%          1.17x      2/4              2.000
size_greedy  2/2    5.000               0.400     2.000x   1.000x [1.000, 1.000] not resolved  +75.0%          1.75x      -                0.500
random       1/2    5.000               0.100     2.500x   1.250x [1.250, 1.250] worse         +0.0%           1.00x      -                0.500"""

TASK_TABLE = """\
algorithm    plan     measured (ms)  ± spread  vs best  vs best heuristic [95% CI]    gap to balance  imbalance  out of envelope  pieces per device  memory per device (MiB of 3.00)  search (s)
-----------  -------  -------------  --------  -------  ----------------------------  --------------  ---------  ---------------  -----------------  -------------------------------  ----------
neuroshard   valid    3.000          0.400     1.000x   0.500x [0.500, 0.500] better  +0.0%           1.00x      1/2              1/1                1.00/1.00                        3.000
size_greedy  valid    6.000          -         2.000x   1.000x (itself)               +50.0%          1.50x      -                1/1                1.00/1.00                        0.500
random       INVALID  table 't1' needs 10 bytes"""


def test_tables_exactly_as_printed():
    """What shard.py prints, whole. The numbers are those derived in test_summarize_rows_by_hand;
    size_greedy is the best heuristic on both tasks (1.0 twice: not resolved); its imbalance is
    (4/2 + 6/4)/2 = 1.75x and its gap (4/2 - 1 + 6/4 - 1)/2 = +75%; task q's size_greedy has no
    spread; random's search time averages its invalid task's too."""
    rs = two_task_results()
    assert format_table(summarize(rs), "measured_cost_ms") == SUMMARY_TABLE
    task = Task("q", 2, 3 * 2**20, 64, (Table("t1", 10, 4, 1.0),))
    assert format_results(task, [r for r in rs if r.task == "q"], "measured_cost_ms") == TASK_TABLE
    assert format_table(summarize(rs, "search_seconds"), "search_seconds").splitlines() == [
        "algorithm    valid  mean search (s)", "-----------  -----  ---------------",
        "neuroshard   2/2    2.000", "size_greedy  2/2    0.500", "random       1/2    0.500"]
    assert format_results(task, [r for r in rs if r.task == "q"], "search_seconds").splitlines()[0] == (
        "algorithm    plan     pieces per device  memory per device (MiB of 3.00)  search (s)")
    # another metric keeps its own name in the header; memory switches to GiB from 1 GiB exactly
    est = [Result("q", "a", True, estimated=costs([2.0, 1.0]), memory_bytes=[2**29, 2**30], pieces=[1, 2])]
    gib = Task("q", 2, 2**30, 64, (Table("t1", 10, 4, 1.0),))
    assert format_results(gib, est, "estimated_cost_ms").splitlines()[::2] == [
        "algorithm  plan   estimate (ms)  vs best  gap to balance  imbalance  pieces per device  memory per device (GiB of 1.00)",
        "a          valid  2.000          1.000x   +33.3%          1.33x      1/2                0.50/1.00"]  # 2/1.5; (2-1.5)/1.5
    mib = Task("q", 2, 2**30 - 1, 64, (Table("t1", 10, 4, 1.0),))
    assert "memory per device (MiB of 1024.00)" in format_results(mib, est, "estimated_cost_ms")
    assert format_table(summarize(est, "estimated_cost_ms"), "estimated_cost_ms").splitlines()[0] == (
        "algorithm  valid  mean estimate (ms)  vs best  gap to balance  imbalance")
    # a metric without a label is named as it is
    assert [c.header for c in report.summary_columns("other_ms")][:3] == ["algorithm", "valid", "mean other_ms"]
    assert report.result_columns("other_ms", 1)[2].header == "other_ms"


def test_result_rows_by_hand():
    rs = two_task_results()[:3]
    rows = {r["algorithm"]: r for r in result_rows(rs, "measured_cost_ms")}
    assert rows["size_greedy"]["ratio_to_best"] == pytest.approx(2.0) and rows["random"]["ratio_to_best"] == 2.5
    assert rows["neuroshard"]["spread_ms"] == 0.2 and rows["neuroshard"]["compute_imbalance"] == pytest.approx(4 / 3)
    assert rows["neuroshard"]["gap_pct"] == pytest.approx(100 / 3)
    assert rows["neuroshard"]["vs_best_heuristic"]["ratio"] == pytest.approx(0.5)
    assert rows["random"]["pieces"] == [1, 1] and rows["random"]["search_seconds"] == 0.25
    est = result_rows([Result("p", "a", True, estimated=costs([2.0, 2.0]), measured=costs([9.0], spread=1.0))],
                      "estimated_cost_ms")[0]
    assert est["estimated_cost_ms"] == 2.0 and est["spread_ms"] is None and est["compute_imbalance"] == 1.0
    bad = result_rows([Result("p", "a", False, error="no room")], "measured_cost_ms")[0]
    assert bad["ratio_to_best"] is None and bad["compute_imbalance"] is None and bad["error"] == "no room"


def test_heuristic_cell():
    assert report._heur_cell(None) == "-"
    assert report._heur_cell({"ratio": 1.0, "interval": None}) == "1.000x (itself)"
    assert report._heur_cell({"ratio": 0.75, "interval": None}) == "0.750x"
    # the interval is of the mean paired ratio, and is printed beside that mean: the ratio of the
    # two medians (0.75) can lie outside it
    iv = {"mean": 0.72, "low": 0.65, "high": 0.74, "verdict": "better"}
    assert report._heur_cell({"ratio": 0.75, "interval": iv}) == "0.720x [0.650, 0.740] better"
    assert report._fmt(float("nan"), "{:.1f}") == "-" and report._fmt(None, "{:.1f}") == "-"
    assert report._fmt(2, "{:d}") == "2"


# ----------------------------------------------------------------------------- chart
def test_plot_costs_bars_are_the_summary(tmp_path, monkeypatch):
    saved = {}

    def keep(fig, path):
        saved["fig"], saved["path"] = fig, path

    monkeypatch.setattr(report, "save_png", keep)
    rs = two_task_results()
    assert plot_costs(rs, tmp_path / "c.png")
    ax_cost, ax_ratio = saved["fig"].axes
    heights = [p.get_height() for p in ax_cost.patches]
    assert heights == pytest.approx([2.5, 5.0, 5.0])  # mean cost per algorithm (summarize)
    assert [p.get_height() for p in ax_ratio.patches] == pytest.approx([1.0, 2.0, 2.5])
    assert [t.get_text() for t in ax_cost.get_xticklabels()] == ["neuroshard", "size_greedy", "random"]
    # error bars: the mean spread (neuroshard 0.3, size_greedy 0.4, random 0.1) either side of the mean
    from matplotlib.collections import LineCollection

    [bars] = [c for c in ax_cost.collections if isinstance(c, LineCollection)]
    assert [tuple(seg[:, 1]) for seg in bars.get_segments()] == [pytest.approx((2.2, 2.8)), pytest.approx((4.6, 5.4)),
                                                                  pytest.approx((4.9, 5.1))]
    # one dot per task an algorithm solved, at its cost and at its ratio to the task's best
    from matplotlib.collections import PathCollection

    dots = [c.get_offsets().tolist() for c in ax_cost.collections if isinstance(c, PathCollection)]
    assert dots == [[[0, 2.0], [0, 3.0]], [[1, 4.0], [1, 6.0]], [[2, 5.0]]]
    ratios = [c.get_offsets().tolist() for c in ax_ratio.collections if isinstance(c, PathCollection)]
    assert ratios == [[[0, 1.0], [0, 1.0]], [[1, 2.0], [1, 2.0]], [[2, 2.5]]]
    assert ax_cost.get_ylabel().startswith("measured cost (ms") and saved["path"] == tmp_path / "c.png"
    assert plot_costs([measured("p", "a", [1.0])], tmp_path / "d.png")  # no spread: a zero-length error bar
    [bars] = [c for c in saved["fig"].axes[0].collections if isinstance(c, LineCollection)]
    assert [tuple(seg[:, 1]) for seg in bars.get_segments()] == [(1.0, 1.0)]
    assert not plot_costs(rs, tmp_path / "none.png", metric="estimated_cost_ms")  # nothing estimated
    assert "fig" in saved and not (tmp_path / "none.png").exists()


def test_plot_costs_writes_a_png(tmp_path):
    assert plot_costs(two_task_results(), tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert not math.isnan(summarize(two_task_results())[0]["mean_measured_cost_ms"])


def test_summarize_improvement_prints_the_paired_mean_beside_its_interval(tmp_path):
    """Per task: the ratio of the two plans' costs, then the paired per-repetition ratio's mean
    with the interval that belongs to it; a task whose whole interval lies above 1 is worse
    beyond the interval."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    def row(task, algorithm, cost, samples):
        return {"task": task, "algorithm": algorithm, "valid": True, "measured_cost_ms": cost, "memory_bytes": [1, 1],
                "measured_spread_ms": 0.0, "measured_device_costs": {"plan_cost_samples_ms": samples}}

    # task a: medians 9 / 10 (0.900x); per repetition 8/10, 8/10, 9/10, 8/10 -> mean 0.825
    # task b: 12 / 10, every repetition above 1 -> worse
    report = {"results": [row("a", "size_greedy", 10.0, [10.0, 10.0, 10.0, 10.0]),
                          row("a", "neuroshard", 9.0, [8.0, 8.0, 9.0, 8.0]),
                          row("b", "size_greedy", 10.0, [10.0, 10.0, 10.0, 10.0]),
                          row("b", "neuroshard", 12.0, [12.0, 11.0, 12.0, 13.0])]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    script = Path(__file__).resolve().parents[1] / "scripts" / "summarize_improvement.py"
    out = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, check=True,
                         env=dict(os.environ, WANDB_MODE="offline")).stdout
    line_a = next(x for x in out.splitlines() if x.startswith("a "))
    assert "ratio 0.900 (paired 0.825x [" in line_a and "] better)" in line_a and "WORSE" not in line_a
    line_b = next(x for x in out.splitlines() if x.startswith("b "))
    assert "ratio 1.200 (paired 1.200x [" in line_b and "] worse)" in line_b and "WORSE beyond the interval" in line_b
    assert "worse beyond the interval on 1)" in out


def test_summaries_by_setting_orders_settings_and_fills_in_an_extra_runs_algorithms(tmp_path):
    import json

    def row(task, algorithm, cost):
        return {"task": task, "algorithm": algorithm, "valid": True, "measured_cost_ms": cost,
                "memory_bytes": [1, 1], "measured_spread_ms": 0.0, "search_seconds": 0.1}

    def write(run, setting, rows):
        (tmp_path / run / setting).mkdir(parents=True)
        (tmp_path / run / setting / "report.json").write_text(json.dumps({"results": rows}))

    write("main", "zeta", [row("a", "size_greedy", 10.0), row("a", "autoshard", 8.0)])
    write("main", "alpha", [row("b", "size_greedy", 10.0), row("b", "autoshard", 12.0)])
    write("main", "other", [row("c", "size_greedy", 10.0)])
    # the later pass: its own heuristic run beside dreamshard; autoshard there must not replace main's
    write("extra", "zeta", [row("a", "size_greedy", 20.0), row("a", "dreamshard", 15.0), row("a", "autoshard", 1.0)])
    got = report.summaries_by_setting(tmp_path / "main", ["zeta", "alpha", "missing"], [tmp_path / "extra"])
    assert list(got) == ["zeta", "alpha", "other"]  # named ones in order (missing skipped), then the rest
    assert got["zeta"]["autoshard"]["mean_cost_ms"] == 8.0 and "run" not in got["zeta"]["autoshard"]
    assert got["zeta"]["dreamshard"]["run"] == str(tmp_path / "extra")
    assert got["zeta"]["dreamshard"]["mean_ratio"] == pytest.approx(0.75)  # 15 / its own heuristic's 20
    assert "dreamshard" not in got["alpha"]
    # a later batch of other tasks joins the main run's tasks; the same task twice is refused
    write("batch2", "zeta", [row("d", "size_greedy", 10.0), row("d", "autoshard", 6.0)])
    got = report.summaries_by_setting(tmp_path / "main", ["zeta"], more=[tmp_path / "batch2"])
    assert got["zeta"]["autoshard"]["tasks"] == 2 and got["zeta"]["autoshard"]["mean_ratio"] == pytest.approx(0.7)
    assert got["alpha"]["autoshard"]["tasks"] == 1
    # a setting the main run lacks but a later batch holds is not dropped
    write("batch3", "beta", [row("e", "size_greedy", 10.0), row("e", "autoshard", 9.0)])
    got = report.summaries_by_setting(tmp_path / "main", ["zeta", "beta"], more=[tmp_path / "batch2", tmp_path / "batch3"])
    assert list(got) == ["zeta", "beta", "alpha", "other"]
    assert got["beta"]["autoshard"]["tasks"] == 1 and got["beta"]["autoshard"]["mean_ratio"] == pytest.approx(0.9)
    with pytest.raises(InputError, match="task 'a' is also in"):
        report.summaries_by_setting(tmp_path / "main", ["zeta"], more=[tmp_path / "extra"])
    with pytest.raises(InputError, match="batch9: no such runs folder"):
        report.summaries_by_setting(tmp_path / "main", ["zeta"], more=[tmp_path / "batch9"])


def test_settings_markdown_rows_by_first_appearance_and_a_dash_without_tasks():
    summary = {"s1": {"a": {"tasks": 2, "x": 1.0}, "b": {"tasks": 0, "x": 9.0}},
               "s2": {"c": {"tasks": 1, "x": 3.0}, "a": {"tasks": 1, "x": 2.5}}}
    lines = report.settings_markdown(summary, lambda m: f"{m['x']:.1f}", ["S one", "S two"])
    assert lines == ["| algorithm | S one | S two |", "|---|---|---|",
                     "| a | 1.0 | 2.5 |", "| b | - | - |", "| c | - | 3.0 |"]
    assert report.settings_markdown(summary, lambda m: "y", first="seconds")[0] == "| seconds | s1 | s2 |"
