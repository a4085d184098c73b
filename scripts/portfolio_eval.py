"""The measured evaluation of issue 18: fresh test tasks of unseen tables, every algorithm
including the portfolio, summarised with bootstrap intervals against the issue's aims.

    python scripts/portfolio_eval.py tasks --out experiments/portfolio_eval/tasks      # one folder per setting
    python shard.py task_file=experiments/portfolio_eval/tasks/<setting> algorithms=[...] out_dir=.../runs/<setting>
    python scripts/portfolio_eval.py summarize experiments/portfolio_eval/runs --out experiments/portfolio_eval

    python scripts/portfolio_eval.py combine <pass 1>/summary.json <pass 2>/summary.json      # disjoint tasks, one table

(`make portfolio-eval` runs the first three.) The tasks come from the TEST tables of a pool's train /
validation / test split (`embshard.data.split.TableSplit`; by default a fresh 512-table
synthetic pool, seed 2, generated under data/ on first use, split 50 / 25 / 25 %, so 128 test
tables), and the script refuses to write them when any holds a table one of the checkpoints
was trained or tuned on (`check_unseen`). Settings, `--num-tasks` tasks each (24 by default),
batch 8192 and 16384 in turn, dims {4..128}, memory 1.5x an even share:

* `20-30x4`: 20-30 unseen tables on 4 devices; `20-30x2`, `20-30x8`: on 2 and 8 devices;
* `8-12x4`, `40-48x4`: 8-12 and 40-48 tables;
* `20-30x4-nohist`: 20-30 tables without reuse histograms or traces (a user's tables).

The summary gives per setting and algorithm the mean measured cost, the ratio to the best of
the six heuristics per task (mean with its bootstrap 95% interval over tasks and verdict),
tasks worse than that heuristic beyond their own paired interval, the mean gap to the balance
reference and search seconds (`embshard.report.summarize_results`), and then the issue's aims
one by one: met, not met, or not resolved (the interval straddles the aim).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = [str(ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt"),
               str(ROOT / "checkpoints" / "dreamshard_cpu" / "policy.pt"),
               str(ROOT / "checkpoints" / "autoshard_cpu" / "policy.pt")]
#: name -> (min tables, max tables, devices, seed offset, tables keep their reuse histogram)
SETTINGS: dict[str, tuple[int, int, int, int, bool]] = {
    "20-30x4": (20, 30, 4, 21, True),
    "20-30x2": (20, 30, 2, 22, True),
    "20-30x8": (20, 30, 8, 23, True),
    "8-12x4": (8, 12, 4, 24, True),
    "40-48x4": (40, 48, 4, 25, True),
    "20-30x4-nohist": (20, 30, 4, 26, False),
}
LABELS = {
    "20-30x4": "unseen tables, 4 devices",
    "20-30x2": "2 devices",
    "20-30x8": "8 devices",
    "8-12x4": "8-12 tables",
    "40-48x4": "40-48 tables",
    "20-30x4-nohist": "no histograms",
}
BATCHES = (8192, 16384)
#: the aims of issue 18 ("Done when"): algorithm -> the mean ratio to the best heuristic it
#: should not exceed in every setting
AIMS = {"dreamshard": 1.0, "autoshard": 0.92, "portfolio": 0.9}
#: the portfolio's mean gap to its balance reference, at most (%)
PORTFOLIO_GAP_PCT = 5.0


def make_tasks(args: argparse.Namespace) -> None:
    from embshard.data.split import TableSplit, check_unseen, seen_by_checkpoint
    from embshard.data.synthetic import generate_synthetic
    from embshard.data.tasks import neuroshard_tasks, without_histograms, write_tasks
    from embshard.errors import InputError

    dataset = Path(args.dataset)
    if not dataset.is_file():
        if not dataset.name.startswith("synthetic_"):
            sys.exit(f"error: {dataset}: no such pool file")
        print(f"generating {dataset} ...", flush=True)
        generate_synthetic(dataset, num_tables=args.pool_tables, batch_size=4096, seed=args.pool_seed)
    try:
        split = TableSplit.of_pool(dataset, args.validation_fraction, args.test_fraction, args.seed)
        test = split.entries(dataset, args.split)
    except InputError as e:
        sys.exit(f"error: {str(e).splitlines()[0]}")
    try:
        seen = [seen_by_checkpoint(c) for c in args.checkpoints]
    except InputError as e:
        sys.exit(f"error: {e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    split.save(out / "split.json")
    # validation tasks: their own names and seeds, so they never coincide with the test tasks
    prefix, seed_offset = ("pv", 50_000) if args.split == "validation" else ("pe", 0)
    for name, (lo, hi, devices, offset, histograms) in SETTINGS.items():
        if hi > len(test):
            sys.exit(f"error: setting {name} needs {hi} tables; the split has {len(test)} {args.split} tables "
                     "(a bigger pool: --pool-tables)")
        tasks = []
        for i in range(args.first_task, args.first_task + args.num_tasks):  # batch 8192 and 16384 in turn
            try:
                (task,) = neuroshard_tasks(test, 1, min_tables=lo, max_tables=hi, dims=[4, 8, 16, 32, 64, 128],
                                           max_total_bytes=args.max_total_bytes, num_devices=devices,
                                           batch_size=BATCHES[i % len(BATCHES)],
                                           seed=args.seed * 1000 + offset * 100 + i + seed_offset,
                                           name_prefix=f"{prefix}-{name}-{i:04d}")
            except InputError as e:
                sys.exit(f"error: setting {name}: {str(e).splitlines()[0]}")
            tasks.append(replace(task, name=f"{prefix}-{name}-{i:04d}"))
        if not histograms:  # what a user brings: rows, dim, pooling factor (the evaluator draws
            # indices from the calibrated synthetic law)
            tasks = [without_histograms(t) for t in tasks]
        try:
            check_unseen(tasks, seen, pool=str(dataset))
        except InputError as e:
            sys.exit(f"error: {e}")
        for stale in (out / name).glob("p[ev]-*.json"):  # a previous run's tasks (another --num-tasks)
            stale.unlink()
        write_tasks(tasks, out / name)
        print(f"{name}: {len(tasks)} tasks of {min(len(t.tables) for t in tasks)}-{max(len(t.tables) for t in tasks)} "
              f"{args.split} tables on {devices} devices, batch {'/'.join(map(str, BATCHES))} -> {out / name}")
    print(f"split: {len(split.tables['train'])} train / {len(split.tables['validation'])} validation / "
          f"{len(split.tables['test'])} test tables of {dataset} -> {out / 'split.json'}")


def parse_pairs(specs: list[str]) -> list[tuple[str, str]]:
    """--pairs A/B ... as (A, B) tuples; a malformed one exits with a one-line error."""
    pairs = []
    for spec in specs:
        a, sep, b = spec.partition("/")
        if not sep or not a or not b:
            sys.exit(f"error: --pairs {spec!r}: write A/B (A's measured cost over B's per task)")
        pairs.append((a, b))
    return pairs


def ratio_cell(mean: float, ci: dict | None) -> str:
    """mean [low, high] verdict (a ratio without an interval: the mean alone)."""
    return f"{mean:.3f}" + (f" [{ci['low']:.3f}, {ci['high']:.3f}] {ci['verdict']}" if ci else "")


def ratios_cell(ratios: list[float]) -> str:
    """`ratio_cell` of paired ratios: their mean and bootstrap interval (none for one ratio)."""
    from embshard.stats import paired_ratio_summary

    s = paired_ratio_summary(ratios)
    return ratio_cell(s.mean, s.to_dict() if len(ratios) > 1 else None)


def summarize(args: argparse.Namespace) -> None:
    from embshard.errors import InputError
    from embshard.io import write_json_atomic, write_text_atomic
    from embshard.report import setting_reports, summarize_results

    runs = Path(args.runs[0])
    try:
        reports = setting_reports(runs, SETTINGS, more=args.runs[1:])
    except InputError as e:
        sys.exit(f"error: {e}")
    summary = {name: summarize_results(report) for name, report in reports.items()}
    if not summary:
        sys.exit(f"error: no <setting>/report.json under {runs}")
    pairs = parse_pairs(args.pairs)
    text = (markdown(summary) + "\n" + aims(summary) + "\n" + balance_line(reports)
            + "\n" + agreement_line(reports, summary) + "\n" + pooled([Path(r) for r in args.runs], pairs))
    out = Path(args.out)
    write_json_atomic(out / "summary.json", summary)
    write_text_atomic(out / "summary.md", text)
    print(text)
    print(f"wrote {out / 'summary.json'}, {out / 'summary.md'}")


def markdown(summary: dict) -> str:
    from embshard.report import settings_markdown

    def cell(m: dict) -> str:
        ci = m.get("ratio_ci")
        ratio = f"{m['mean_ratio']:.3f}" + (f" [{ci['low']:.3f}, {ci['high']:.3f}] {ci['verdict']}" if ci else "")
        gap = f"; gap {m['mean_gap_pct']:+.1f}%" if m.get("mean_gap_pct") is not None else ""
        return (f"{m['mean_cost_ms']:.1f} ({ratio}, {m['worse_beyond_interval']}/{m['tasks']} worse{gap})"
                + (f" {m['invalid']} invalid" if m["invalid"] else ""))

    lines = ["Mean measured plan cost (ms); in brackets the ratio to the best of the six heuristics per task: mean "
             "[bootstrap 95% interval over tasks] verdict, tasks worse beyond their own interval; then the mean gap "
             "to the balance reference.", ""]
    lines += settings_markdown(summary, cell, [f"{LABELS.get(s, s)} ({s})" for s in summary])
    lines += [""] + settings_markdown(summary, lambda m: f"{m['mean_search_seconds']:.2f}", first="mean search seconds")
    return "\n".join(lines) + "\n"


def verdict_against(m: dict, aim: float) -> str:
    """met / NOT met / not resolved: where the bootstrap interval of the mean ratio lies
    against `aim` (one task, no interval: by the mean)."""
    ci = m.get("ratio_ci")
    if ci is None:
        return "met (one task, no interval)" if m["mean_ratio"] <= aim else "NOT met (one task, no interval)"
    if ci["high"] <= aim:
        return "met"
    if ci["low"] > aim:
        return "NOT met"
    return "not resolved"


def aims(summary: dict) -> str:
    lines = ["Aims of issue 18 (per setting; the bootstrap interval of the mean ratio to the best heuristic against "
             "the aim):", ""]
    # a guarded RL planner (verify) has its policy's own plan beside it as <name>_pick: its aim too
    labels = [(a, aim, a) for a, aim in AIMS.items()]
    labels += [(f"{a}_pick", aim, f"{a}_pick (the policy's own plan, before its guard)") for a, aim in AIMS.items()
               if a != "portfolio" and any(f"{a}_pick" in rows for rows in summary.values())]
    for a, aim, title in labels:
        cells = []
        for s, rows in summary.items():
            m = rows.get(a)
            cells.append(f"{s}: {verdict_against(m, aim) if m and m.get('tasks') else 'no data'}")
        lines.append(f"- {title} <= {aim:g}x: " + "; ".join(cells))
    cells = []
    for s, rows in summary.items():
        m = rows.get("portfolio")
        if not m or not m.get("tasks"):
            cells.append(f"{s}: no data")
            continue
        ci = m.get("ratio_ci")
        never_worse = m["worse_beyond_interval"] == 0 and (ci is None or ci["verdict"] != "worse")
        gap = m.get("mean_gap_pct")
        cells.append(f"{s}: {'never worse' if never_worse else 'WORSE on ' + str(m['worse_beyond_interval']) + ' task(s)'}"
                     f", gap {'-' if gap is None else f'{gap:+.1f}%'} "
                     f"({'met' if gap is not None and gap <= PORTFOLIO_GAP_PCT else 'NOT met'})")
    lines.append(f"- portfolio never worse than the best heuristic beyond the interval, mean gap to balance <= "
                 f"{PORTFOLIO_GAP_PCT:g}%: " + "; ".join(cells))
    return "\n".join(lines) + "\n"


def balance_line(reports: dict[str, dict]) -> str:
    """Per setting, `embshard.report.room_left` over its tasks: mean [bootstrap interval]."""
    from embshard.report import room_left
    from embshard.stats import paired_ratio_summary

    cells = []
    for setting, report in reports.items():
        ratios = room_left(report)
        if not ratios:
            continue
        s = paired_ratio_summary(ratios)
        ci = f" [{s.low:.3f}, {s.high:.3f}]" if len(ratios) > 1 else ""
        cells.append(f"{setting}: {s.mean:.3f}{ci} ({len(ratios)} tasks)")
    if not cells:
        return ""
    return ("Room left, per setting: the lowest balance reference of the task's measured plans (mean device "
            "compute + the slowest device's comm) over the best heuristic's cost, mean [bootstrap 95% interval] "
            "over tasks; an aim below it needs a plan better balanced than every plan measured (a reference, "
            "not a bound):\n\n- " + "; ".join(cells) + "\n")


#: a task's final measurement disagrees with its guard's first round above this spread (the sd of
#: the log ratio over the plans both measured; 0.02-0.07 on the quiet tasks of the passes so far)
DISAGREE_SD = 0.1
#: ... or when the final measurement moved the cost ratio of two plans the guard measured in every
#: round by more than this (|log| of the shift; the 90th percentile of the 74 guarded tasks of
#: stops 34-39 was 0.15, the median 0.06)
DISAGREE_PAIR = 0.15


def agreement_line(reports: dict[str, dict], summary: dict) -> str:
    """Per setting, the tasks whose final measurement disagrees with the guard's first round of the
    same plans (`embshard.report.guard_agreement` above DISAGREE_SD), the tasks in which it moved
    two plans the guard paired against each other (`embshard.report.guard_reversals` above
    DISAGREE_PAIR), and whether the portfolio was worse than the best heuristic beyond its interval
    on one of them."""
    from embshard.report import guard_agreement, guard_reversals

    cells, pair_cells, checked, pairs_checked = [], [], 0, 0
    for setting, report in reports.items():
        worse = set(((summary.get(setting) or {}).get("portfolio") or {}).get("worse_tasks") or [])

        def note(task: str) -> str:
            return "; portfolio worse beyond interval" if task in worse else ""

        sds = guard_agreement(report)
        checked += len(sds)
        bad = sorted(t for t, (sd, _) in sds.items() if sd > DISAGREE_SD)
        if bad:
            cells.append(f"{setting}: " + ", ".join(f"{t} ({sds[t][0]:.3f}{note(t)})" for t in bad))
        moved = guard_reversals(report)
        pairs_checked += len(moved)
        bad = sorted(t for t, m in moved.items() if m["shift"] > DISAGREE_PAIR)
        if bad:
            pair_cells.append(f"{setting}: " + ", ".join(
                f"{t} ({'/'.join(moved[t]['pair'])}: guard {moved[t]['guard_ratio']:.3f} over {moved[t]['rounds']} rounds, "
                f"final {moved[t]['final_ratio']:.3f}{note(t)})" for t in bad))
    if not checked and not pairs_checked:
        return ""
    head = (f"Measurement agreement ({checked} tasks with a guard): the final measurement against the guard's first "
            f"round of the same plans, minutes apart, sd of log(final / guard) over the plans; above {DISAGREE_SD:g}, "
            "the machine's state changed between them and plans slowed unevenly")
    text = head + (":\n\n- " + "\n- ".join(cells) + "\n" if cells else ": every task agrees.\n")
    if pairs_checked:
        text += (f"\nPlans that moved against each other ({pairs_checked} tasks with a guard of 2 or more rounds): the pair "
                 "of plans the guard measured in every round whose cost ratio the final measurement moved most, where "
                 f"it moved by more than {DISAGREE_PAIR:g} in log (one plan can move so while the spread above stays "
                 "low; the ranking of the two in that task's final measurement is then in doubt)")
        text += (":\n\n- " + "\n- ".join(pair_cells) + "\n") if pair_cells else ": none.\n"
    return text


#: paired comparisons summarize prints by default: the portfolio over guarded NeuroShard decides
#: `shard.py`'s default
PAIRS = (("portfolio", "neuroshard"),)
NOTES = {("portfolio", "neuroshard"): "the portfolio becomes shard.py's default once this lies below 1"}


def pooled(runs: list[Path], pairs: list[tuple[str, str]] | tuple = PAIRS) -> str:
    """Every setting's tasks together (the settings' own intervals are wide with few tasks): each
    algorithm's measured cost over the best heuristic's per task, then for each pair (A, B) A's
    measured cost over B's per task, on the tasks where both have a valid plan."""
    import json

    from embshard.report import summarize_results

    results = [r for run in runs for f in sorted(run.glob("*/report.json")) for r in json.loads(f.read_text())["results"]]
    if not results:
        return ""
    tasks = list(dict.fromkeys(r["task"] for r in results))
    lines = [f"All settings together ({len(tasks)} tasks): measured cost over the best heuristic's per task, "
             "mean [bootstrap 95% interval over tasks] verdict; tasks:", "",
             "| algorithm | ratio to the best heuristic | tasks |", "|---|---|---|"]
    for a, m in summarize_results({"results": results}).items():  # one report of every task
        lines.append(f"| {a} | {ratio_cell(m['mean_ratio'], m.get('ratio_ci')) if m['tasks'] else '-'} | {m['tasks']} |")
    cost = {(r["task"], r["algorithm"]): r["measured_cost_ms"] for r in results
            if r["valid"] and r.get("measured_cost_ms") is not None}
    for a, b in pairs:
        both = [cost[t, a] / cost[t, b] for t in tasks if (t, a) in cost and (t, b) in cost]
        if not both:
            continue
        name = "NeuroShard (guarded)" if b == "neuroshard" else b
        note = f" ({NOTES[a, b]})" if (a, b) in NOTES else ""
        lines += ["", f"{a} over {name}, per task: {ratios_cell(both)} over {len(both)} tasks{note}"]
    return "\n".join(lines) + "\n"


def combine(args: argparse.Namespace) -> None:
    """Several passes' summary.json (disjoint tasks of the same settings) as one: per setting and
    algorithm the ratios to each pass's best heuristic per task, together, with the bootstrap
    interval over all the tasks; the aims; every setting pooled; and A over B per task (the
    quotient of their ratios, which share the task's best heuristic)."""
    import json

    import numpy as np

    from embshard.io import write_json_atomic, write_text_atomic
    from embshard.stats import paired_ratio_summary

    passes = []
    if len({Path(f).resolve() for f in args.summaries}) < len(args.summaries):
        sys.exit("error: a summary is named twice")
    for f in args.summaries:
        try:
            passes.append((f, json.loads(Path(f).read_text())))
        except (OSError, ValueError) as e:
            sys.exit(f"error: {f}: {e}")
    pairs = parse_pairs(args.pairs)
    unnamed = [f for f, p in passes if any(not m.get("task_names") for rows in p.values() for m in rows.values()
                                            if m.get("tasks"))]
    combined: dict[str, dict[str, dict]] = {}
    per_task: dict[tuple[str, str], list[tuple[str | None, float]]] = {}  # (setting, algorithm) -> (task, ratio)
    for f, summary in passes:
        for setting, rows in summary.items():
            for a, m in rows.items():
                if not m.get("tasks"):
                    continue
                names = m.get("task_names") or [None] * len(m["ratios"])
                if len(names) != len(m["ratios"]):
                    sys.exit(f"error: {f}: {setting}/{a}: {len(names)} task names for {len(m['ratios'])} ratios")
                seen = {t for t, _ in per_task.get((setting, a), []) if t is not None}
                twice = [t for t in names if t is not None and t in seen]
                if twice:
                    sys.exit(f"error: {f}: task {twice[0]} ({setting}, {a}) is in an earlier summary too")
                per_task.setdefault((setting, a), []).extend(zip(names, m["ratios"]))
                c = combined.setdefault(setting, {}).setdefault(
                    a, {"tasks": 0, "invalid": 0, "worse_beyond_interval": 0, "_gap": [], "passes": []})
                c["tasks"] += m["tasks"]
                c["invalid"] += m.get("invalid", 0)
                c["worse_beyond_interval"] += m.get("worse_beyond_interval", 0)
                if m.get("mean_gap_pct") is not None:
                    c["_gap"].append((m["mean_gap_pct"], m["tasks"]))
                c["passes"].append({"summary": str(f), "tasks": m["tasks"]})
    for setting, rows in combined.items():
        for a, c in rows.items():
            r = [x for _, x in per_task[setting, a]]
            gap = c.pop("_gap")
            c.update(mean_ratio=float(np.mean(r)), ratio_ci=paired_ratio_summary(r).to_dict() if len(r) > 1 else None,
                     mean_gap_pct=(sum(g * n for g, n in gap) / sum(n for _, n in gap)) if gap else None,
                     ratios=r, task_names=[t for t, _ in per_task[setting, a]])

    from embshard.report import settings_markdown

    sizes = [f"{f}: {sum(max((m.get('tasks') or 0) for m in rows.values()) for rows in p.values())} tasks"
             for f, p in passes]
    lines = [f"{len(passes)} pass(es) together ({'; '.join(sizes)}). Ratio to each pass's best "
             "heuristic per task: mean [bootstrap 95% interval over tasks] verdict, tasks worse beyond their own "
             "interval; the mean gap to the balance reference.", ""]
    lines += settings_markdown(combined, lambda c: f"{ratio_cell(c['mean_ratio'], c['ratio_ci'])}, "
                               f"{c['worse_beyond_interval']}/{c['tasks']} worse"
                               + (f"; gap {c['mean_gap_pct']:+.1f}%" if c["mean_gap_pct"] is not None else ""),
                               [f"{LABELS.get(s, s)} ({s})" for s in combined])
    lines += ["", aims(combined)]
    algos = list(dict.fromkeys(a for rows in combined.values() for a in rows))
    lines += ["All settings together: ratio to the best heuristic per task, mean [bootstrap 95% interval]; tasks:", "",
              "| algorithm | ratio to the best heuristic | tasks |", "|---|---|---|"]
    for a in algos:
        r = [x for s in combined for _, x in per_task.get((s, a), [])]
        lines.append(f"| {a} | {ratios_cell(r)} | {len(r)} |")
    for a, b in pairs:
        q = []
        for s in combined:
            ra, rb = per_task.get((s, a), []), per_task.get((s, b), [])
            if all(t is not None for t, _ in ra + rb):
                by_b = dict(rb)
                q += [x / by_b[t] for t, x in ra if t in by_b]
            elif len(ra) == len(rb) and not (combined[s][a]["invalid"] or combined[s][b]["invalid"]):
                q += [x / y for (_, x), (_, y) in zip(ra, rb)]  # unnamed: the same tasks in the same order
        if q:
            lines += ["", f"{a} over {b}, per task: {ratios_cell(q)} over {len(q)} tasks"]
    if unnamed:
        lines += ["", "Summaries without task names (written before they were recorded; their tasks cannot be checked "
                      "for overlap, and A over B pairs their ratios in order): " + ", ".join(map(str, unnamed))]
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    write_json_atomic(out / "combined.json", combined)
    write_text_atomic(out / "combined.md", text)
    print(text)
    print(f"wrote {out / 'combined.json'}, {out / 'combined.md'}")


def across(args: argparse.Namespace) -> None:
    """One algorithm in two runs of the same tasks (before and after a change that only it
    sees): its ratio to the best heuristic per task in run A over that in run B, so the day's
    machine speed cancels; the best heuristic's own cost A over B is the control."""
    import json

    from embshard.io import write_text_atomic
    from embshard.report import HEURISTICS
    from embshard.stats import paired_ratio_summary

    def load(run: str) -> dict[str, dict[str, float]]:
        cost: dict[str, dict[str, float]] = {}
        files = sorted(Path(run).glob("*/report.json"))
        if not files:
            sys.exit(f"error: {run}: no <setting>/report.json")
        for f in files:
            for r in json.loads(f.read_text())["results"]:
                if r["valid"] and r.get("measured_cost_ms") is not None:
                    cost.setdefault(f"{f.parent.name}/{r['task']}", {})[r["algorithm"]] = r["measured_cost_ms"]
        return cost

    (run_a, alg_a), (run_b, alg_b) = (x.rsplit(":", 1) for x in (args.a, args.b))
    a, b = load(run_a), load(run_b)
    rows, control = [], []
    for t in sorted(set(a) & set(b)):
        heur = [h for h in HEURISTICS if h in a[t] and h in b[t]]
        if alg_a not in a[t] or alg_b not in b[t] or not heur:
            continue
        best_a, best_b = min(a[t][h] for h in heur), min(b[t][h] for h in heur)
        rows.append((t, a[t][alg_a] / best_a, b[t][alg_b] / best_b))
        control.append(best_a / best_b)
    if not rows:
        sys.exit("error: no task has both algorithms and a heuristic in both runs")
    s = paired_ratio_summary([x / y for _, x, y in rows])
    c = paired_ratio_summary(control)
    lines = [f"{alg_a} in {run_a} against {alg_b} in {run_b}, {len(rows)} tasks measured in both:", "",
             f"- ratio to the best heuristic per task: {sum(x for _, x, _ in rows) / len(rows):.3f} against "
             f"{sum(y for _, _, y in rows) / len(rows):.3f}",
             f"- the first over the second, per task: {s.mean:.3f} [{s.low:.3f}, {s.high:.3f}] {s.verdict}",
             f"- control, the best heuristic's measured cost in the first run over the second: {c.mean:.3f} "
             f"[{c.low:.3f}, {c.high:.3f}]", "", "| setting | tasks | first | second |", "|---|---|---|---|"]
    for setting in sorted({t.split("/")[0] for t, _, _ in rows}):
        r = [(x, y) for t, x, y in rows if t.split("/")[0] == setting]
        lines.append(f"| {setting} | {len(r)} | {sum(x for x, _ in r) / len(r):.3f} | {sum(y for _, y in r) / len(r):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        write_text_atomic(args.out, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tasks", help="write the test tasks, one folder per setting")
    t.add_argument("--dataset", default=str(ROOT / "data" / "synthetic_t512_bs4096_s2.pt"),
                   help="the pool (a synthetic file of this name is generated when missing)")
    t.add_argument("--pool-tables", type=int, default=512, help="tables of a generated pool")
    t.add_argument("--pool-seed", type=int, default=2, help="seed of a generated pool")
    t.add_argument("--split", choices=("test", "validation"), default="test",
                   help="tasks of the split's test tables (the evaluation) or of its validation tables (where a "
                        "checkpoint or a switch is chosen; tasks named pv-*, other seeds)")
    t.add_argument("--checkpoints", nargs="*", default=CHECKPOINTS,
                   help="checkpoints whose train and validation tables no task may hold")
    t.add_argument("--out", default=str(ROOT / "experiments" / "portfolio_eval" / "tasks"))
    t.add_argument("--num-tasks", type=int, default=24)
    t.add_argument("--first-task", type=int, default=0,
                   help="index of the first task per setting (a later batch: tasks are the same for the same index)")
    t.add_argument("--validation-fraction", type=float, default=0.25)
    t.add_argument("--test-fraction", type=float, default=0.25)
    t.add_argument("--seed", type=int, default=0, help="the split's seed")
    t.add_argument("--max-total-bytes", type=int, default=1 << 30)
    s = sub.add_parser("summarize", help="summarise shard.py reports, one <setting>/report.json each")
    s.add_argument("runs", nargs="+", help="the runs folder; more folders add other tasks of the same settings")
    s.add_argument("--pairs", nargs="*", default=[f"{a}/{b}" for a, b in PAIRS],
                   help="A/B: A's measured cost over B's per task, pooled over every setting (default: %(default)s)")
    s.add_argument("--out", default=str(ROOT / "experiments" / "portfolio_eval"))
    c = sub.add_parser("combine", help="several passes' summary.json (disjoint tasks of the same settings) as one")
    c.add_argument("summaries", nargs="+", help="summary.json files of `summarize`")
    c.add_argument("--pairs", nargs="*", default=[f"{a}/{b}" for a, b in PAIRS],
                   help="A/B: A over B per task, every setting together (default: %(default)s)")
    c.add_argument("--out", default=str(ROOT / "experiments" / "portfolio_eval" / "combined"))
    x = sub.add_parser("across", help="one algorithm in two runs of the same tasks (before / after a change)")
    x.add_argument("a", help="RUNS:ALGORITHM, the runs folder (one <setting>/report.json each) and the row")
    x.add_argument("b", help="RUNS:ALGORITHM of the other run")
    x.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args()
    if args.cmd == "tasks" and (args.num_tasks < 1 or args.first_task < 0):
        sys.exit("error: --num-tasks must be at least 1 and --first-task at least 0")
    {"tasks": make_tasks, "summarize": summarize, "combine": combine, "across": across}[args.cmd](args)


if __name__ == "__main__":
    main()
