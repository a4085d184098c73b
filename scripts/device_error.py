"""How well a compute model tells the devices of one plan apart, on plans already measured.

    python scripts/device_error.py RUN_DIR [RUN_DIR ...] [--checkpoint PATH] [--histograms replay|given]

A RUN_DIR is what `scripts/portfolio_eval.py` lays out (or `make checkpoint-compare` writes):
`runs/<setting>/report.json` of `shard.py evaluate=measured` with `runs/<setting>/plans/<task>/<algorithm>.json`,
and the tasks in `tasks/<setting>/<task>.json`. Nothing is measured: every measured device of
every plan is predicted again with the checkpoint, and the log error log(measured / predicted)
is taken **within each plan** (minus the plan's mean), because a plan's cost is set by how its
devices compare, while a constant factor (the machine's speed that day) is not the model's to
know. Printed, and written as JSON with `--out`: the within-plan standard deviation overall,
per setting and per batch size, and its correlation with the devices' lookup-weighted share of
touched rows (a sign of reuse the features get wrong).

`--histograms given` predicts with a traced table's histogram as the task gives it (the trace's
own), instead of as its replay at the task's batch (`embshard.costs.features.replayed_table`,
what the cost models see): the comparison shows what the replay view is worth.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from embshard.costs import features as F  # noqa: E402
from embshard.costs.neural import NeuralCostModels  # noqa: E402
from embshard.errors import InputError  # noqa: E402
from embshard.io import write_json_atomic  # noqa: E402
from embshard.report import measured_plan_devices  # noqa: E402
from embshard.stats import centred_within  # noqa: E402
from embshard.task import Task  # noqa: E402

_TOUCHED = F.INTENSIVE_NAMES.index("touched_row_share")
_LOOKUPS = F.NUM_INTENSIVE + F.EXTENSIVE_NAMES.index("lookups_1e4")


def device_errors(run_dirs: list[Path], models: NeuralCostModels, histograms: str) -> list[dict]:
    rows = []
    for root in run_dirs:
        reports = sorted(root.glob("runs/*/report.json"))
        if not reports:
            raise InputError(f"{root}: no runs/<setting>/report.json")
        for rep in reports:
            setting = rep.parent.name
            tasks = root / "tasks" / setting
            for r, task, pieces, meas in measured_plan_devices(rep.parent, lambda name: Task.load(tasks / f"{name}.json"),
                                                               replay_traces=histograms == "replay"):
                pred = models.at_batch(task.batch_size).compute_ms(pieces)
                for d, (pc, m, p) in enumerate(zip(pieces, meas, pred)):
                    if not pc or m <= 0 or p <= 0:
                        continue
                    f = F.shard_features(pc, task.batch_size)
                    w = f[:, _LOOKUPS] / max(float(f[:, _LOOKUPS].sum()), 1e-12)
                    rows.append({"plan": f"{root}/{setting}/{r['task']}/{r['algorithm']}", "setting": setting,
                                 "batch": task.batch_size, "device": d, "log_error": float(np.log(m / p)),
                                 "touched_share": float(w @ f[:, _TOUCHED])})
    return rows


def summarize(rows: list[dict]) -> dict:
    by = defaultdict(list)
    for i, r in enumerate(rows):
        by[r["plan"]].append(i)
    e = np.array([r["log_error"] for r in rows])
    t = np.array([r["touched_share"] for r in rows])
    ed, td = centred_within(e, list(by.values())), centred_within(t, list(by.values()))

    def part(mask):
        return {"devices": int(mask.sum()), "within_plan_sd": round(float(ed[mask].std()), 4)}

    out = {"devices": len(rows), "plans": len(by), "mean_log_error": round(float(e.mean()), 4),
           "within_plan_sd": round(float(ed.std()), 4),
           "corr_touched_share": round(float(np.corrcoef(ed, td)[0, 1]), 3) if td.std() > 0 else None,
           "settings": {s: part(np.array([r["setting"] == s for r in rows])) for s in sorted({r["setting"] for r in rows})},
           "batches": {str(b): part(np.array([r["batch"] == b for r in rows])) for b in sorted({r["batch"] for r in rows})}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "cpu_fbgemm" / "cost_models.pt"))
    ap.add_argument("--histograms", choices=("replay", "given"), default="replay")
    ap.add_argument("--out", type=Path, default=None, help="write the summary here (JSON)")
    args = ap.parse_args(argv)
    try:
        rows = device_errors(args.run_dirs, NeuralCostModels.load(args.checkpoint), args.histograms)
        if not rows:
            raise InputError("no measured device with a plan file in " + ", ".join(map(str, args.run_dirs)))
    except InputError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    s = {"checkpoint": args.checkpoint, "histograms": args.histograms, **summarize(rows)}
    print(f"{s['devices']} devices of {s['plans']} measured plans, histograms {args.histograms}: "
          f"within-plan sd of log(measured/predicted) {s['within_plan_sd']:.3f}, mean {s['mean_log_error']:+.3f}, "
          f"corr with touched share {s['corr_touched_share']}")
    for k in ("settings", "batches"):
        print("  " + ", ".join(f"{n} {v['within_plan_sd']:.3f} ({v['devices']})" for n, v in s[k].items()))
    if args.out:
        write_json_atomic(args.out, s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
