"""Statistics and a chart for the end-to-end throughput benchmark of sharding plans.

The benchmark trains the same DLRM under several sharding plans, interleaved in rounds
(every plan once per round), and records the wall seconds of each timed step on each rank:

    {"round": int, "plan": str, "rank_step_seconds": [[s, s, ...], ...]}   # [rank][step]

Definitions used here:

* A round's throughput of a plan is ``global_batch * steps / max_rank(sum of that rank's step
  seconds)``: ranks synchronise in the all-to-all, so the slowest rank decides.
* The ratio to the reference is paired per round (plan throughput / reference throughput in the
  same round), which cancels drift of the machine between rounds.
* Means over rounds get a percentile bootstrap interval (`embshard.stats.bootstrap_mean_ci`);
  with fewer than two rounds there is no spread estimate, so ``std``, ``ci_low`` and
  ``ci_high`` are ``None``.

Pure logic and plotting; no distributed code.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any, Sequence

from embshard.errors import InputError
from embshard.io import save_png
from embshard.stats import bootstrap_mean_ci

__all__ = ["summarize_throughput", "format_summary", "plot_throughput"]


def _mean_ci(values: Sequence[float], confidence: float) -> tuple[float, float | None, float | None, float | None]:
    """(mean, sample std, ci_low, ci_high): the bootstrap interval of the mean over rounds
    (`embshard.stats`, the one interval every comparison uses); the last three None with
    fewer than two values."""
    n = len(values)
    m = math.fsum(values) / n
    if n < 2:
        return m, None, None, None
    sd = statistics.stdev(values, xbar=m)
    _, lo, hi = bootstrap_mean_ci(values, confidence)
    return m, sd, lo, hi


# ----------------------------------------------------------------------------- validation


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate(records: Any, reference: Any, global_batch: Any, confidence: Any) -> tuple[list[int], list[str]]:
    """Check the input; return the sorted round ids and the plan names (first-seen order)."""
    if not _is_int(global_batch) or global_batch <= 0:
        raise InputError(f"global_batch must be a positive integer, got {global_batch!r}")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise InputError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")
    if not isinstance(records, (list, tuple)) or not records:
        raise InputError("no throughput records: expected a non-empty list of {round, plan, rank_step_seconds}")
    n_ranks: int | None = None
    seen: dict[int, set[str]] = {}
    plans: dict[str, None] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not {"round", "plan", "rank_step_seconds"} <= rec.keys():
            raise InputError(f"record {i} must be a dict with keys round, plan, rank_step_seconds")
        rnd, plan, ranks = rec["round"], rec["plan"], rec["rank_step_seconds"]
        where = f"record {i} (round {rnd!r}, plan {plan!r})"
        if not _is_int(rnd):
            raise InputError(f"{where}: round must be an integer")
        if not isinstance(plan, str) or not plan:
            raise InputError(f"{where}: plan must be a non-empty string")
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise InputError(f"{where}: rank_step_seconds must be a non-empty list of per-rank step lists")
        if n_ranks is None:
            n_ranks = len(ranks)
        elif len(ranks) != n_ranks:
            raise InputError(f"{where}: {len(ranks)} ranks, but earlier records have {n_ranks}")
        n_steps: int | None = None
        for r, steps in enumerate(ranks):
            if not isinstance(steps, (list, tuple)) or not steps:
                raise InputError(f"{where}: rank {r} has no timed steps")
            if n_steps is None:
                n_steps = len(steps)
            elif len(steps) != n_steps:
                raise InputError(f"{where}: rank {r} timed {len(steps)} steps, rank 0 timed {n_steps}")
            for s, sec in enumerate(steps):
                if isinstance(sec, bool) or not isinstance(sec, (int, float)) or not math.isfinite(sec) or sec <= 0:
                    raise InputError(f"{where}: rank {r} step {s} has non-positive or non-finite time {sec!r}")
        if plan in seen.setdefault(rnd, set()):
            raise InputError(f"{where}: plan appears twice in the round")
        seen[rnd].add(plan)
        plans.setdefault(plan, None)
    if reference not in plans:
        raise InputError(f"unknown reference plan {reference!r}; plans: {', '.join(plans)}")
    for rnd in sorted(seen):
        missing = [p for p in plans if p not in seen[rnd]]
        if missing:
            raise InputError(f"round {rnd} lacks plan(s) {', '.join(map(repr, missing))}; every plan must run once per round")
    return sorted(seen), list(plans)


# ----------------------------------------------------------------------------- summary


def summarize_throughput(records: list[dict], reference: str, global_batch: int, confidence: float = 0.95) -> dict:
    """Throughput (samples/s), paired ratio to `reference` and step times of each plan.

    Returns a JSON-serialisable dict (see the module docstring for the definitions):

        {"reference", "global_batch", "confidence", "rounds",
         "plans": {name: {"samples_per_s": {mean, std, ci_low, ci_high, per_round},
                          "step_ms": {mean, median, per_rank_mean, per_rank_median},
                          "ratio_to_reference": {mean, ci_low, ci_high, per_round},
                          "steps_timed"}},
         "order": [plan names, fastest mean samples/s first]}

    ``per_round`` lists follow ascending round id. ``steps_timed`` counts the timed steps of
    one rank over all rounds (every rank times the same steps). ``std``, ``ci_low`` and
    ``ci_high`` are None with one round. Raises InputError on malformed input.
    """
    rounds, plans = _validate(records, reference, global_batch, confidence)
    by_key = {(rec["round"], rec["plan"]): rec["rank_step_seconds"] for rec in records}
    n_ranks = len(records[0]["rank_step_seconds"])

    throughput: dict[str, list[float]] = {}
    for plan in plans:
        per_round = []
        for rnd in rounds:
            ranks = by_key[(rnd, plan)]
            slowest = max(math.fsum(steps) for steps in ranks)
            per_round.append(global_batch * len(ranks[0]) / slowest)
        throughput[plan] = per_round

    out_plans: dict[str, Any] = {}
    for plan in plans:
        tp = throughput[plan]
        mean, sd, lo, hi = _mean_ci(tp, confidence)
        if plan == reference:
            ratios = [1.0] * len(rounds)
            r_mean = 1.0
            r_lo, r_hi = (1.0, 1.0) if len(rounds) >= 2 else (None, None)
        else:
            ratios = [a / b for a, b in zip(tp, throughput[reference])]
            r_mean, _, r_lo, r_hi = _mean_ci(ratios, confidence)
        rank_ms = [
            [1000.0 * float(s) for rnd in rounds for s in by_key[(rnd, plan)][r]] for r in range(n_ranks)
        ]
        all_ms = [s for r in rank_ms for s in r]
        out_plans[plan] = {
            "samples_per_s": {"mean": mean, "std": sd, "ci_low": lo, "ci_high": hi, "per_round": tp},
            "step_ms": {
                "mean": math.fsum(all_ms) / len(all_ms),
                "median": float(statistics.median(all_ms)),
                "per_rank_mean": [math.fsum(r) / len(r) for r in rank_ms],
                "per_rank_median": [float(statistics.median(r)) for r in rank_ms],
            },
            "ratio_to_reference": {"mean": r_mean, "ci_low": r_lo, "ci_high": r_hi, "per_round": ratios},
            "steps_timed": len(rank_ms[0]),
        }
    order = sorted(plans, key=lambda p: -out_plans[p]["samples_per_s"]["mean"])  # stable: ties keep input order
    return {
        "reference": reference,
        "global_batch": global_batch,
        "confidence": float(confidence),
        "rounds": len(rounds),
        "plans": out_plans,
        "order": order,
    }


# ----------------------------------------------------------------------------- text table


def _half_width(block: dict) -> float | None:
    if block.get("ci_low") is None or block.get("ci_high") is None:
        return None
    return (block["ci_high"] - block["ci_low"]) / 2.0


def _ratio_text(summary: dict, plan: str) -> str:
    r = summary["plans"][plan]["ratio_to_reference"]
    if r["ci_low"] is None:
        return f"{r['mean']:.3f}x"
    return f"{r['mean']:.3f}x [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"


def format_summary(summary: dict) -> str:
    """A fixed-width text table of a `summarize_throughput` result, fastest plan first."""
    conf = round(100 * summary["confidence"], 1)
    conf_txt = f"{conf:g}%"
    header = ["plan", "samples/s", f"± {conf_txt} CI", f"vs {summary['reference']} [{conf_txt} CI]", "step ms per rank"]
    lines = []
    for plan in summary["order"]:
        p = summary["plans"][plan]
        half = _half_width(p["samples_per_s"])
        lines.append(
            [
                plan + (" (ref)" if plan == summary["reference"] else ""),
                f"{p['samples_per_s']['mean']:.1f}",
                "-" if half is None else f"{half:.1f}",
                _ratio_text(summary, plan),
                " / ".join(f"{ms:.2f}" for ms in p["step_ms"]["per_rank_mean"]),
            ]
        )
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(header)]
    right = {1, 2}  # numbers right-aligned
    fmt = lambda cells: "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [
        f"{summary['rounds']} round(s), global batch {summary['global_batch']}; step ms = mean per rank over all rounds",
        fmt(header).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    out += [fmt(l).rstrip() for l in lines]
    return "\n".join(out)


# ----------------------------------------------------------------------------- chart


def plot_throughput(summary: dict, path: str | os.PathLike, title: str | None = None) -> None:
    """One PNG: samples/s per plan with CI error bars and the ratio to the reference (left),
    mean step ms per rank per plan as grouped bars (right). Fastest plan first; written
    atomically (temporary file, then rename)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["order"])
    if not names:
        raise InputError("summary has no plans to plot")
    plans = summary["plans"]
    conf_txt = f"{round(100 * summary['confidence'], 1):g}%"
    means = [plans[n]["samples_per_s"]["mean"] for n in names]
    err_lo = [0.0 if plans[n]["samples_per_s"]["ci_low"] is None else means[i] - plans[n]["samples_per_s"]["ci_low"]
              for i, n in enumerate(names)]
    err_hi = [0.0 if plans[n]["samples_per_s"]["ci_high"] is None else plans[n]["samples_per_s"]["ci_high"] - means[i]
              for i, n in enumerate(names)]
    n_ranks = len(plans[names[0]]["step_ms"]["per_rank_mean"])

    fig, (ax_tp, ax_ms) = plt.subplots(
        1, 2, figsize=(max(10.0, 1.6 * len(names) + 0.35 * len(names) * n_ranks), 4.6)
    )
    x = list(range(len(names)))
    colors = ["#55A868" if n == summary["reference"] else "#4C72B0" for n in names]
    ax_tp.bar(x, means, yerr=[err_lo, err_hi], capsize=4, color=colors, alpha=0.85)
    top = max(m + e for m, e in zip(means, err_hi))
    for i, n in enumerate(names):
        label = "reference" if n == summary["reference"] else _ratio_text(summary, n)
        ax_tp.text(i, means[i] + err_hi[i] + 0.02 * top, label, ha="center", va="bottom", fontsize=8)
        per_round = plans[n]["samples_per_s"]["per_round"]
        ax_tp.scatter([i] * len(per_round), per_round, color="black", s=10, zorder=3,
                      label="one round" if i == 0 else None)
    ax_tp.set_ylim(0, top * 1.15)
    ax_tp.set_xticks(x, names, rotation=30, ha="right")
    ax_tp.set_ylabel("samples/s (higher is better)")
    ax_tp.set_title(f"Throughput, mean over {summary['rounds']} round(s) ± {conf_txt} CI;\n"
                    f"label: paired ratio to {summary['reference']}", fontsize=10)
    ax_tp.legend(loc="lower right", fontsize=8)

    width = 0.8 / n_ranks
    cmap = plt.get_cmap("tab10" if n_ranks <= 10 else "viridis")
    for r in range(n_ranks):
        offs = [i - 0.4 + width * (r + 0.5) for i in x]
        ax_ms.bar(offs, [plans[n]["step_ms"]["per_rank_mean"][r] for n in names], width=width,
                  color=cmap(r if n_ranks <= 10 else r / max(1, n_ranks - 1)), alpha=0.9,
                  label=f"rank {r}" if n_ranks <= 16 else None)
    ax_ms.set_xticks(x, names, rotation=30, ha="right")
    ax_ms.set_ylabel("mean step time (ms, lower is better)")
    ax_ms.set_title("Mean step time per rank over all rounds", fontsize=10)
    if n_ranks <= 16:
        ax_ms.legend(loc="best", fontsize=8, ncol=2 if n_ranks > 4 else 1)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_png(fig, path)
