"""The measured guard's verdicts replayed under another interval rule, on the rounds the guard
recorded in report.json, with the evaluation's own measurements of every plan it could keep.

    python scripts/guard_replay.py extract experiments/pe_b3/runs experiments/pe_b4/runs ... \\
        --out docs/portfolio/eval/guard_records.json
    python scripts/guard_replay.py replay docs/portfolio/eval/guard_records.json --out docs/portfolio/eval/guard_replay_t
    python scripts/guard_replay.py replay docs/portfolio/eval/guard_records.json --method bootstrap --min-gain 0.01 --out <dir>

`extract` keeps, per task of each `<runs>/<setting>/report.json`, what the replay needs: each
guarded algorithm's decision and measuring rounds, and every algorithm's ratio to the best
heuristic with its per-task verdict (the evaluation's interleaved measurement). `replay`
decides each guard again from the same rounds by the guard's rule with the given interval
(`--method`: by default Student t, the guard's alternative; `bootstrap`, the guard's default and
what the recorded guards ran, reproduces their verdicts, a self-check; `--min-gain`: a searched
plan kept only where it is shown better by at least that share) and
looks the kept plan up among the evaluated ones: a heuristic under its own name; a portfolio
member under its unguarded name (`neuroshard` -> `neuroshard_pick`); NeuroShard's search pick
(`neuroshard#1`) as `neuroshard_pick`.

What a replay cannot do: the live guard measures more rounds while its interval straddles 1
(up to `verify_max_rounds` / `verify_budget_s`), so a decision the replay leaves "not resolved"
on the recorded rounds might have resolved either way with more of them. A replayed "not
resolved" keeps the heuristic, as the live guard does when out of rounds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GUARDED = ("neuroshard", "portfolio")
#: a guard candidate's label -> the evaluated algorithm with the same plan
MEMBER_RESULT = {"neuroshard": "neuroshard_pick", "neuroshard#1": "neuroshard_pick"}


def extract(args: argparse.Namespace) -> None:
    import json

    from embshard.io import write_json_atomic

    records = []
    for runs in map(Path, args.runs):
        reports = sorted(runs.glob("*/report.json"))
        if not reports:
            sys.exit(f"error: no <setting>/report.json under {runs}")
        for path in reports:
            try:
                rep = json.loads(path.read_text())
                results = rep["results"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                sys.exit(f"error: {path}: not a shard.py report ({e})")
            for task in sorted({r["task"] for r in results}):
                rec: dict = {"pass": runs.parent.name, "setting": path.parent.name, "task": task, "ratio": {},
                             "worse": {}, "guards": {}}
                for r in results:
                    if r["task"] != task or not r.get("vs_best_heuristic"):
                        continue
                    vs = r["vs_best_heuristic"]
                    rec["ratio"][r["algorithm"]] = round(float(vs["ratio"]), 6)
                    rec["worse"][r["algorithm"]] = bool(vs.get("interval") and vs["interval"]["verdict"] == "worse")
                    g = r.get("guard")
                    if r["algorithm"] in GUARDED and g:
                        rec["guards"][r["algorithm"]] = {
                            "decision": {k: g["decision"].get(k) for k in ("verdict", "kept", "search", "heuristic",
                                                                          "contenders", "rounds", "interval")},
                            "rounds": [{k: round(float(v), 4) for k, v in rnd.items()} for rnd in g["rounds"]]}
                records.append(rec)
    write_json_atomic(Path(args.out), {"records": records})
    print(f"wrote {args.out}: {len(records)} tasks, "
          f"{sum(len(r['guards']) for r in records)} guard decisions")


def replay_decision(g: dict, method: str, min_rounds: int = 3, min_gain: float = 0.0) -> tuple[str, str]:
    """(verdict, kept label) of one recorded guard decision under `method`, on its rounds, by the
    guard's own rule (`embshard.search.guard.decide`). `min_gain` > 0: the searched plan is kept
    only where the interval's upper end lies below 1 - min_gain (a "better" by less is replayed
    as "not resolved" and keeps the heuristic), a stricter rule the live guard does not have."""
    from embshard.search.guard import decide

    d = g["decision"]
    if d["verdict"] not in ("better", "worse", "not resolved"):
        return d["verdict"], d["kept"]
    verdict, h, summary = decide(g["rounds"], d["search"], d["contenders"], min_rounds, method)
    if verdict == "better" and not summary.high < 1.0 - min_gain:
        verdict = "not resolved"
    return verdict, (d["search"] if verdict == "better" else h)


def replay(args: argparse.Namespace) -> None:
    import json

    from embshard.io import write_json_atomic, write_text_atomic
    from embshard.stats import paired_ratio_summary

    try:
        records = json.loads(Path(args.records).read_text())["records"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: {args.records}: not a guard_replay.py extract ({e})")
    settings = list(dict.fromkeys(r["setting"] for r in records))
    out: dict = {"method": args.method, "min_gain": args.min_gain, "tasks": len(records), "algorithms": {}}
    gain = f", a searched plan kept only where the interval ends below {1 - args.min_gain:g}" if args.min_gain else ""
    lines = [f"Guard verdicts replayed with the `{args.method}` interval{gain} on the recorded rounds of "
             f"{len(records)} tasks ({', '.join(sorted({r['pass'] for r in records}))}).", "",
             "| algorithm | setting | tasks | decisions changed | recorded ratio | replayed ratio | "
             "replayed / recorded, per task | worse beyond interval: recorded -> replayed |",
             "|---|---|---|---|---|---|---|---|"]
    for alg in GUARDED:
        per: dict = {}
        for scope in [*settings, "all"]:
            recs = [r for r in records if alg in r["guards"] and (scope == "all" or r["setting"] == scope)]
            if not recs:
                continue
            old, new, worse_old, worse_new, changed, missing = [], [], 0, 0, [], 0
            for r in recs:
                g = r["guards"][alg]
                verdict, kept = replay_decision(g, args.method, min_gain=args.min_gain)
                o = r["ratio"][alg]
                wo = r["worse"][alg]
                if kept == g["decision"]["kept"]:
                    n, wn = o, wo
                else:
                    key = MEMBER_RESULT.get(kept, kept)
                    if key not in r["ratio"]:
                        missing += 1  # the plan kept was not evaluated on its own: the recorded one stays
                        n, wn = o, wo
                    else:
                        n, wn = r["ratio"][key], r["worse"][key]
                        changed.append(f"{r['task']}: {g['decision']['kept']} -> {kept} ({o:.3f} -> {n:.3f})")
                old.append(o)
                new.append(n)
                worse_old += wo
                worse_new += wn
            so, sn = paired_ratio_summary(old), paired_ratio_summary(new)
            pair = paired_ratio_summary([a / b for a, b in zip(new, old)])
            per[scope] = {"tasks": len(recs), "changed": changed, "not_evaluated": missing,
                          "recorded": so.to_dict(), "replayed": sn.to_dict(), "replayed_over_recorded": pair.to_dict(),
                          "worse_recorded": worse_old, "worse_replayed": worse_new}
            lines.append(f"| {alg} | {scope} | {len(recs)} | {len(changed)}"
                         f"{f' ({missing} not evaluated)' if missing else ''} | {so.text()} | {sn.text()} | "
                         f"{pair.text()} | {worse_old} -> {worse_new} |")
        out["algorithms"][alg] = per
    lines += ["", "Decisions changed:"]
    for alg, per in out["algorithms"].items():
        lines += [f"- {alg}: {c}" for c in per.get("all", {}).get("changed", [])]
    text = "\n".join(lines) + "\n"
    dest = Path(args.out)
    write_json_atomic(dest / "replay.json", out)
    write_text_atomic(dest / "replay.md", text)
    print(text)
    print(f"wrote {dest / 'replay.json'}, {dest / 'replay.md'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract", help="keep what the replay needs from shard.py reports")
    e.add_argument("runs", nargs="+", help="folders of <setting>/report.json")
    e.add_argument("--out", required=True)
    r = sub.add_parser("replay", help="decide every recorded guard again")
    r.add_argument("records")
    r.add_argument("--method", choices=("t", "bootstrap"), default="t")
    r.add_argument("--min-gain", type=float, default=0.0,
                   help="keep a searched plan only where its interval ends below 1 - this (default 0: the guard's rule)")
    r.add_argument("--out", required=True)
    args = ap.parse_args()
    {"extract": extract, "replay": replay}[args.cmd](args)


if __name__ == "__main__":
    main()
