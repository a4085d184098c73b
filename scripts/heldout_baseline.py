"""The ratio to the best heuristic per task, read on held-out rounds (`embshard.heldout`): how much
the evaluation's baseline (the cheapest heuristic in the same measurement) flatters itself.

    python scripts/heldout_baseline.py RUN [RUN ...] --algorithms portfolio,neuroshard --out DIR

RUN: a folder of <setting>/report.json (shard.py's, evaluate=measured rounds=2, as every
measured evaluation here), or one report.json. Writes DIR/heldout.md and DIR/heldout.json: per
setting (the report's folder) and over all tasks, the cheapest heuristic on one round over the
one picked on the other (how far, at most, the report's baseline flatters itself: the same for
every algorithm of a task); and per algorithm its mean ratio to the best heuristic as reported,
in-sample on one round and held out (picked on one round, read on the other), each with its
bootstrap 95% interval over tasks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from embshard.errors import EmbshardError, InputError  # noqa: E402
from embshard.heldout import expected_selection, heldout_ratios, repetition_spread, round_noise  # noqa: E402
from embshard.io import write_json_atomic, write_text_atomic  # noqa: E402
from embshard.task import read_json  # noqa: E402
from embshard.stats import bootstrap_mean_ci  # noqa: E402


def reports(paths: list[str]) -> dict[str, dict]:
    """{setting: report} from folders of <setting>/report.json or report.json files; the
    setting is the report's folder name (reports of one name from several runs are pooled, each
    task named `<i>:<task>` by the RUN it came from, the i-th, so two runs of one task stay two tasks)."""
    out: dict[str, dict] = {}
    for i, p in enumerate(map(Path, paths), 1):
        files = [p] if p.is_file() else sorted(p.glob("*/report.json")) or sorted(p.glob("report.json"))
        if not files:
            raise InputError(f"{p}: no report.json in it or in its sub-folders")
        for f in files:
            r = read_json(f)
            out.setdefault(f.parent.name, {"results": []})["results"] += [
                dict(x, task=f"{i}:{x['task']}") for x in r.get("results", [])]
    return out


def cell(values: list[float]) -> str:
    m, lo, hi = bootstrap_mean_ci(values)
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--algorithms", required=True, help="comma-separated, as in report.json")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    algorithms = [a for a in args.algorithms.split(",") if a]
    try:
        by_report = reports(args.runs)
        read = {s: heldout_ratios(r, algorithms) for s, r in by_report.items()}
        noise = round_noise(list(by_report.values()))
        scatter = repetition_spread(list(by_report.values()))
        plugin = {t: v for r in by_report.values() for t, v in expected_selection(r, noise).items()}
    except (EmbshardError, OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    by_setting = {s: rows for s, (rows, _) in read.items()}
    skipped = sorted(t for _, sk in read.values() for t in sk)
    rows = [dict(x, setting=s) for s, xs in by_setting.items() for x in xs]
    if not rows:
        sys.exit("error: no task with two heuristics and per-round samples (shard.py evaluate=measured rounds=2)")
    settings = [*by_setting, "all"]
    lines = ["How far the report's baseline (the cheapest heuristic in the same measurement) sits below the best",
             "heuristic's cost, per setting: at most the cheapest heuristic on one round over the one that was",
             "cheapest on the other round, read on the first (`bound`); about the plug-in estimate (`estimate`:",
             f"each heuristic's measured cost taken as true, one round's spread {noise:.1%} as measured between",
             "the rounds of these reports, two rounds). A ratio to that baseline is pushed up by about the",
             f"inverse. (Within a round, a repetition sits {scatter:.1%} from its round's median, the median over",
             "every plan's rounds here.)", "",
             "| setting | tasks | bound | estimate |", "|---|---|---|---|"]
    summary: dict = {"round_noise": noise, "repetition_spread": scatter, "selection": {}}
    first = algorithms[0]
    for s in settings:
        xs = [x for x in rows if x["algorithm"] == first and (s == "all" or x["setting"] == s)]
        if xs:
            sel, est = [x["selection"] for x in xs], [plugin[x["task"]] for x in xs]
            summary["selection"][s] = {"tasks": len(xs), "bound": bootstrap_mean_ci(sel), "estimate": bootstrap_mean_ci(est)}
            lines.append(f"| {'**all**' if s == 'all' else s} | {len(xs)} | {cell(sel)} | {cell(est)} |")
    lines += ["", "Per algorithm, its ratio to the best heuristic per task: as report.json has it, in-sample on one",
              "round (the report's rule, for comparison) and held out (to the heuristic picked on the other round):", "",
              "| algorithm | setting | tasks | as reported | in-sample (one round) | held out |", "|---|---|---|---|---|---|"]
    for a in algorithms:
        for s in settings:
            xs = [x for x in rows if x["algorithm"] == a and (s == "all" or x["setting"] == s)]
            if not xs:
                continue
            col = {k: [x[k] for x in xs] for k in ("report", "in_sample", "held_out")}
            summary.setdefault(a, {})[s] = {"tasks": len(xs), **{k: bootstrap_mean_ci(v) for k, v in col.items()}}
            name = f"**{s}**" if s == "all" else s
            lines.append(f"| {a} | {name} | {len(xs)} | {cell(col['report'])} | {cell(col['in_sample'])} | "
                         f"{cell(col['held_out'])} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python scripts/heldout_baseline.py " + " ".join(args.runs) + f" --algorithms {args.algorithms} --out {args.out}"
    text = (f"Ratio to the best heuristic per task, as reported and read on held-out rounds "
            f"(`embshard.heldout`), mean [bootstrap 95%] over tasks.\n\n```\n{cmd}\n```\n\n" + "\n".join(lines) + "\n"
            + (f"\nLeft out ({len(skipped)}, as <i-th RUN>:<task>; a plan measured on one round only, or fewer "
               "than two heuristics): "
               + ", ".join(skipped) + "\n" if skipped else ""))
    write_text_atomic(out / "heldout.md", text)
    write_json_atomic(out / "heldout.json", {"command": cmd, "summary": summary, "rows": rows, "skipped": skipped})
    print(text)


if __name__ == "__main__":
    main()
