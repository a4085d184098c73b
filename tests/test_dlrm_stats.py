"""Throughput statistics and chart of the end-to-end DLRM benchmark (dlrm/stats.py)."""

from __future__ import annotations

import json
import math
import random

import pytest

from dlrm.stats import format_summary, plot_throughput, summarize_throughput
from embshard.errors import InputError

GB = 100

# Two rounds, two ranks, two plans, two timed steps per rank. Hand-computed:
#   round 0  A: rank sums 0.2, 0.4 -> slowest 0.4 -> 100*2/0.4 = 500 samples/s
#            B: rank sums 0.2, 0.25 -> 100*2/0.25 = 800
#   round 1  A: rank sums 0.5, 0.4 -> slowest is rank 0 now -> 100*2/0.5 = 400
#            B: rank sums 0.25, 0.2 -> 800
# Paired ratio B/A per round: 1.6, 2.0 -> mean 1.8 (the unpaired 800/450 would be 1.777...).
RECORDS = [
    {"round": 0, "plan": "A", "rank_step_seconds": [[0.1, 0.1], [0.2, 0.2]]},
    {"round": 0, "plan": "B", "rank_step_seconds": [[0.1, 0.1], [0.1, 0.15]]},
    {"round": 1, "plan": "B", "rank_step_seconds": [[0.125, 0.125], [0.1, 0.1]]},
    {"round": 1, "plan": "A", "rank_step_seconds": [[0.25, 0.25], [0.2, 0.2]]},
]


def _noisy(n_rounds: int, noise: float, seed: int = 0, plans=("ref", "fast", "slow"), ranks: int = 2, steps: int = 5):
    """Synthetic records: base step time per plan, multiplicative per-round machine drift + noise."""
    base = {"ref": 0.010, "fast": 0.008, "slow": 0.0125}
    rng = random.Random(seed)
    out = []
    for rnd in range(n_rounds):
        drift = 1.0 + rng.uniform(-0.2, 0.2)  # same for every plan in the round
        for p in plans:
            out.append({
                "round": rnd, "plan": p,
                "rank_step_seconds": [[base[p] * drift * (1.0 + rng.uniform(-noise, noise)) for _ in range(steps)]
                                      for _ in range(ranks)],
            })
    return out


# ----------------------------------------------------------------------------- numbers


def test_hand_computed_throughput_ratio_and_steps():
    s = summarize_throughput(RECORDS, reference="A", global_batch=GB)
    assert s["reference"] == "A" and s["global_batch"] == GB and s["rounds"] == 2 and s["confidence"] == 0.95
    a, b = s["plans"]["A"], s["plans"]["B"]
    assert a["samples_per_s"]["per_round"] == pytest.approx([500.0, 400.0])
    assert b["samples_per_s"]["per_round"] == pytest.approx([800.0, 800.0])
    assert a["samples_per_s"]["mean"] == pytest.approx(450.0)
    assert a["samples_per_s"]["std"] == pytest.approx(50.0 * math.sqrt(2))
    # the bootstrap of two values: resampled means are x, (x+y)/2, y with probability 1/4, 1/2,
    # 1/4, so the 2.5% and 97.5% points are the two values themselves
    assert a["samples_per_s"]["ci_low"] == pytest.approx(400.0)
    assert a["samples_per_s"]["ci_high"] == pytest.approx(500.0)
    assert b["samples_per_s"]["std"] == pytest.approx(0.0, abs=1e-9)
    assert b["ratio_to_reference"]["per_round"] == pytest.approx([1.6, 2.0])
    assert b["ratio_to_reference"]["mean"] == pytest.approx(1.8)
    assert b["ratio_to_reference"]["ci_low"] == pytest.approx(1.6)
    assert b["ratio_to_reference"]["ci_high"] == pytest.approx(2.0)
    # step ms over all steps of all rounds
    assert a["step_ms"]["per_rank_mean"] == pytest.approx([175.0, 200.0])
    assert a["step_ms"]["per_rank_median"] == pytest.approx([175.0, 200.0])
    assert a["step_ms"]["mean"] == pytest.approx(187.5)
    assert a["step_ms"]["median"] == pytest.approx(200.0)
    assert b["step_ms"]["per_rank_mean"] == pytest.approx([112.5, 112.5])
    assert b["step_ms"]["per_rank_median"] == pytest.approx([112.5, 100.0])
    assert b["step_ms"]["median"] == pytest.approx(100.0)
    assert a["steps_timed"] == 4 and b["steps_timed"] == 4
    assert s["order"] == ["B", "A"]


def test_reference_ratio_is_exactly_one():
    s = summarize_throughput(_noisy(5, 0.1), reference="ref", global_batch=512)
    r = s["plans"]["ref"]["ratio_to_reference"]
    assert r["mean"] == 1.0 and r["per_round"] == [1.0] * 5
    assert r["ci_low"] == 1.0 and r["ci_high"] == 1.0
    s2 = summarize_throughput(RECORDS, reference="B", global_batch=GB)
    assert s2["plans"]["B"]["ratio_to_reference"]["per_round"] == [1.0, 1.0]
    assert s2["plans"]["A"]["ratio_to_reference"]["per_round"] == pytest.approx([500 / 800, 400 / 800])


def test_paired_ratio_cancels_drift_between_rounds():
    # "fast" is exactly 1.25x "ref" in every round, while the machine drifts by +-20 %.
    recs = _noisy(6, 0.0, plans=("ref", "fast"))
    s = summarize_throughput(recs, reference="ref", global_batch=64)
    r = s["plans"]["fast"]["ratio_to_reference"]
    assert r["per_round"] == pytest.approx([1.25] * 6)
    assert r["ci_high"] - r["ci_low"] == pytest.approx(0.0, abs=1e-9)
    tp = s["plans"]["fast"]["samples_per_s"]
    assert tp["ci_high"] - tp["ci_low"] > 0.05 * tp["mean"]  # the raw throughput does see the drift


def test_ci_contains_mean_and_narrows_with_lower_variance():
    wide = summarize_throughput(_noisy(8, 0.3, seed=1), reference="ref", global_batch=128)
    narrow = summarize_throughput(_noisy(8, 0.02, seed=1), reference="ref", global_batch=128)
    for s in (wide, narrow):
        for p in s["plans"].values():
            for key in ("samples_per_s", "ratio_to_reference"):
                blk = p[key]
                assert blk["ci_low"] <= blk["mean"] <= blk["ci_high"]
    for plan in ("fast", "slow"):
        w = wide["plans"][plan]["ratio_to_reference"]
        n = narrow["plans"][plan]["ratio_to_reference"]
        assert n["ci_high"] - n["ci_low"] < w["ci_high"] - w["ci_low"]


def test_higher_confidence_gives_wider_interval():
    recs = _noisy(5, 0.1, seed=3)
    lo = summarize_throughput(recs, reference="ref", global_batch=1, confidence=0.8)
    hi = summarize_throughput(recs, reference="ref", global_batch=1, confidence=0.99)
    a, b = lo["plans"]["fast"]["samples_per_s"], hi["plans"]["fast"]["samples_per_s"]
    assert a["mean"] == b["mean"]
    assert b["ci_high"] - b["ci_low"] > a["ci_high"] - a["ci_low"]


def test_one_round_has_no_interval():
    s = summarize_throughput(RECORDS[:2], reference="A", global_batch=GB)
    assert s["rounds"] == 1
    for p in s["plans"].values():
        assert p["samples_per_s"]["ci_low"] is None and p["samples_per_s"]["ci_high"] is None
        assert p["samples_per_s"]["std"] is None
        assert p["ratio_to_reference"]["ci_low"] is None and p["ratio_to_reference"]["ci_high"] is None
    assert s["plans"]["B"]["ratio_to_reference"]["mean"] == pytest.approx(1.6)
    assert s["plans"]["A"]["ratio_to_reference"]["mean"] == 1.0
    assert "-" in format_summary(s)


def test_order_fastest_first_and_json_serialisable():
    s = summarize_throughput(_noisy(4, 0.01, seed=2), reference="ref", global_batch=256)
    assert s["order"] == ["fast", "ref", "slow"]
    means = [s["plans"][p]["samples_per_s"]["mean"] for p in s["order"]]
    assert means == sorted(means, reverse=True)
    back = json.loads(json.dumps(s, allow_nan=False))
    assert back == s


# ----------------------------------------------------------------------------- validation


def _copy(recs):
    return json.loads(json.dumps(recs))


def test_validation_errors():
    with pytest.raises(InputError, match="no throughput records"):
        summarize_throughput([], reference="A", global_batch=GB)
    with pytest.raises(InputError, match="unknown reference"):
        summarize_throughput(RECORDS, reference="C", global_batch=GB)
    with pytest.raises(InputError, match="round 1 lacks plan"):
        summarize_throughput(RECORDS[:3], reference="A", global_batch=GB)
    recs = _copy(RECORDS)
    recs[3]["rank_step_seconds"].append([0.1, 0.1])
    with pytest.raises(InputError, match="3 ranks"):
        summarize_throughput(recs, reference="A", global_batch=GB)
    for bad in (0.0, -0.1, float("nan")):
        recs = _copy(RECORDS)
        recs[1]["rank_step_seconds"][1][0] = bad
        with pytest.raises(InputError, match="non-positive"):
            summarize_throughput(recs, reference="A", global_batch=GB)
    for gb in (0, -8, 1.5, True):
        with pytest.raises(InputError, match="global_batch"):
            summarize_throughput(RECORDS, reference="A", global_batch=gb)
    with pytest.raises(InputError, match="twice"):
        summarize_throughput(RECORDS + [RECORDS[0]], reference="A", global_batch=GB)
    with pytest.raises(InputError, match="confidence"):
        summarize_throughput(RECORDS, reference="A", global_batch=GB, confidence=1.0)
    recs = _copy(RECORDS)
    recs[0]["rank_step_seconds"][1] = [0.1]
    with pytest.raises(InputError, match="timed 1 steps"):
        summarize_throughput(recs, reference="A", global_batch=GB)
    recs = _copy(RECORDS)
    recs[0]["rank_step_seconds"][0] = []
    with pytest.raises(InputError, match="no timed steps"):
        summarize_throughput(recs, reference="A", global_batch=GB)
    with pytest.raises(InputError, match="keys"):
        summarize_throughput([{"round": 0, "plan": "A"}], reference="A", global_batch=GB)


def test_error_messages_are_one_line():
    cases = [
        dict(records=[], reference="A", global_batch=GB),
        dict(records=RECORDS, reference="nope", global_batch=GB),
        dict(records=RECORDS[:3], reference="A", global_batch=GB),
    ]
    for kw in cases:
        with pytest.raises(InputError) as e:
            summarize_throughput(**kw)
        assert "\n" not in str(e.value) and str(e.value)


# ----------------------------------------------------------------------------- text and chart


def test_format_summary_table():
    s = summarize_throughput(RECORDS, reference="A", global_batch=GB)
    text = format_summary(s)
    lines = text.splitlines()
    body = lines[3:]
    assert len(body) == 2
    assert body[0].startswith("B ") and body[1].startswith("A (ref)")
    assert " 50.0 " in body[1]  # A: 500 and 400 samples/s; the bootstrap interval of two rounds is [400, 500]
    assert "1.800x [" in body[0] and "1.000x [1.000, 1.000]" in body[1]
    assert "175.00 / 200.00" in body[1]
    assert set(lines[2]) <= {"-", " "}
    assert lines[0].startswith("2 round(s), global batch 100")


def test_plot_writes_png_and_leaves_no_temp_files(tmp_path):
    s = summarize_throughput(_noisy(4, 0.05, ranks=4), reference="ref", global_batch=256)
    out = tmp_path / "charts" / "throughput.png"
    plot_throughput(s, out, title="DLRM throughput")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert sorted(p.name for p in out.parent.iterdir()) == ["throughput.png"]
    # one round (no CI) plots too
    one = summarize_throughput(RECORDS[:2], reference="A", global_batch=GB)
    plot_throughput(one, str(tmp_path / "one.png"))
    assert (tmp_path / "one.png").stat().st_size > 1000


def test_plot_failure_leaves_nothing_half_written(tmp_path):
    s = summarize_throughput(RECORDS, reference="A", global_batch=GB)
    target = tmp_path / "taken"
    target.mkdir()
    (target / "x").write_text("keep")  # a non-empty folder where the PNG should go: rename fails
    with pytest.raises(OSError):
        plot_throughput(s, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert sorted(p.name for p in target.iterdir()) == ["x"]
