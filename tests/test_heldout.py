"""The ratio to the best heuristic read on held-out rounds (`embshard.heldout`,
scripts/heldout_baseline.py): the in-sample baseline, the held-out pick, and what is left out."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embshard.heldout import heldout_ratios

ROOT = Path(__file__).resolve().parents[1]


def row(task: str, algorithm: str, samples: list[float], measured: float | None = None) -> dict:
    return {"task": task, "algorithm": algorithm, "valid": True,
            "measured_cost_ms": measured if measured is not None else sorted(samples)[len(samples) // 2],
            "measured_device_costs": {"plan_cost_samples_ms": samples}}


def report() -> dict:
    # round 1 | round 2 (two repetitions each): size_greedy is cheapest on round 1, lookup_greedy on round 2
    return {"results": [
        row("t1", "size_greedy", [10, 10, 12, 12], measured=11.0),
        row("t1", "lookup_greedy", [11, 11, 11, 11], measured=11.5),
        row("t1", "planner", [10, 10, 10, 10], measured=10.0),
        row("t2", "size_greedy", [10, 10, 10]),  # one round only: the task is left out
        row("t2", "lookup_greedy", [11, 11, 11]),
        row("t2", "planner", [9, 9, 9]),
        row("t3", "size_greedy", [10, 10, 10, 10]),  # one heuristic: no baseline to pick
        row("t3", "planner", [9, 9, 9, 9]),
    ]}


def test_each_round_picks_the_heuristic_the_other_round_reads():
    rows, skipped = heldout_ratios(report(), ["planner"])
    assert skipped == ["t2", "t3"]
    (r,) = rows
    assert r["task"] == "t1" and r["report"] == pytest.approx(10 / 11)
    # pick on round 1 (size_greedy), read round 2; pick on round 2 (lookup_greedy), read round 1
    assert r["in_sample"] == pytest.approx((10 / 11 + 10 / 10) / 2)
    assert r["held_out"] == pytest.approx((10 / 12 + 10 / 11) / 2)
    assert r["selection"] == pytest.approx((11 / 12 + 10 / 11) / 2)
    # a heuristic's own rows: lookup_greedy is the cheapest in round 2, but held out it is read
    # against size_greedy there (picked on round 1)
    lg = next(x for x in heldout_ratios(report())[0] if x["algorithm"] == "lookup_greedy")
    assert lg["held_out"] == pytest.approx((11 / 12 + 11 / 11) / 2) and lg["in_sample"] == pytest.approx((1 + 11 / 10) / 2)


def test_the_script_writes_both_readings_and_names_the_tasks_left_out(tmp_path):
    (tmp_path / "runs" / "20-30x2").mkdir(parents=True)
    (tmp_path / "runs" / "20-30x2" / "report.json").write_text(json.dumps(report()))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "heldout_baseline.py"), str(tmp_path / "runs"),
                        "--algorithms", "planner", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    data = json.loads((out / "heldout.json").read_text())
    assert data["skipped"] == ["1:t2", "1:t3"] and data["summary"]["planner"]["20-30x2"]["tasks"] == 1
    assert data["summary"]["selection"]["all"]["bound"][0] == pytest.approx((11 / 12 + 10 / 11) / 2)
    md = (out / "heldout.md").read_text()
    assert "| planner | 20-30x2 | 1 |" in md and "Left out (2" in md


def test_the_script_refuses_a_folder_without_reports(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "heldout_baseline.py"), str(tmp_path),
                        "--algorithms", "planner", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and p.stderr.strip().startswith("error:") and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_round_noise_is_the_spread_between_rounds_that_differs_between_a_tasks_plans():
    from embshard.heldout import round_noise

    # size_greedy reads 10% higher on round 1 than on round 2, lookup_greedy the same on both: the
    # log differences are log 1.1 and 0, their spread about their mean log(1.1)/2 each, so one
    # round's spread is log(1.1) / 2 (a difference of two rounds has twice a round's variance)
    one = {"results": [row("t", "size_greedy", [11, 11, 10, 10]), row("t", "lookup_greedy", [10, 10, 10, 10])]}
    assert round_noise([one]) == pytest.approx(math.log(1.1) / 2)
    # a second round slower for every plan of the task alike changes nothing
    same_shift = {"results": [row("t", "size_greedy", [11, 11, 10 * 1.3, 10 * 1.3]),
                              row("t", "lookup_greedy", [10, 10, 10 * 1.3, 10 * 1.3])]}
    assert round_noise([same_shift]) == pytest.approx(math.log(1.1) / 2)
    with pytest.raises(ValueError):
        round_noise([{"results": [row("t", "size_greedy", [10, 10, 10, 10])]}])


def test_expected_selection_is_one_without_noise_and_the_minimum_of_two_draws_with_it():
    from embshard.heldout import expected_selection

    two = {"results": [row("t", "size_greedy", [10, 10, 10, 10], 10.0), row("t", "lookup_greedy", [10] * 4, 10.0),
                       row("t", "planner", [5] * 4, 5.0)]}  # not a heuristic: not part of the baseline
    assert expected_selection(two, noise=0.0) == {"t": pytest.approx(1.0)}
    # two tied heuristics, each read with a spread s: the mean of the smaller of two draws is
    # about 1 - s / sqrt(pi) (normal approximation), s = 0.07 / sqrt(2) over two rounds
    s = 0.07 / math.sqrt(2)
    assert expected_selection(two, noise=0.07, draws=40000)["t"] == pytest.approx(1 - s / math.sqrt(math.pi), abs=0.002)
    far = {"results": [row("t", "size_greedy", [10] * 4, 10.0), row("t", "lookup_greedy", [20] * 4, 20.0)]}
    assert expected_selection(far, noise=0.07)["t"] == pytest.approx(1.0, abs=0.003)  # no close rival: no effect


def test_repetition_spread_is_the_median_distance_from_each_rounds_median():
    from embshard.heldout import repetition_spread

    # round 1 of size_greedy: 10 and 11 around their median 10.5... (even rounds of 2: both differ from it)
    one = {"results": [row("t", "size_greedy", [10, 12, 11, 11]), row("t", "lookup_greedy", [20, 20, 20, 20])]}
    # distances: |log(10/11)|, |log(12/11)| (round 1 of size_greedy); round 2 and lookup_greedy: all equal their median
    assert repetition_spread([one]) == pytest.approx(float(np.median([abs(math.log(10 / 11)), abs(math.log(12 / 11))])))
