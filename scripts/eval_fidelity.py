"""Fidelity where it matters: the cost models' predictions on the plans the search and the
baselines actually produce, against the hardware.

    python scripts/eval_fidelity.py experiments/user_eval/runs/report.json [more reports ...] [--by-algorithm]

Reads shard.py reports made with `evaluate=measured` and the neural cost model as the
estimate (`cost_model=neural`, the default), and prints, per report (a set of held-out
tasks) and over all of them:

* per-device compute, predicted vs measured: MAPE and Kendall τ over every non-empty device
  of every distinct plan;
* plan cost: Kendall τ between predicted and measured plan cost among the plans of one task
  (the ranking a search relies on), averaged over tasks, and MAPE;
* how many device shards were outside the models' training envelope;
* the level: median measured / predicted per device, compute and backward comm (1.00: the
  models, rescaled to the session's speed probe, are of the measurement's size).

The aims (issue "Trustworthy learned costs"): compute MAPE <= 5%, τ >= 0.95; plan-cost τ >= 0.9.

`--calibration CKPT`: score the reports' estimates as a calibrated checkpoint
(`scripts/calibrate_cost_models.py`) would have made them: the models are the same, only
scaled, so every estimate follows exactly from the report's own (compute × s_c; forward comm:
the time beyond the wait × s_f plus the wait between the scaled computes; backward × s_b).

`--at-measured-speed`: the reports' estimates were rescaled to the session's probe, timed
before planning; the machine's speed moves within a session (other jobs start and stop). Put
each plan's compute estimate on the probe tracked inside its own measurement instead (the
probe's kernels interleaved with the plan's: `measured_probe` in report.json), compute ×
(tracked / session probe), the same way as above. This separates what the model gets wrong
from how fast the machine ran at that moment. Comm has no tracked probe and stays as estimated.

`--without-comm-rescale`: undo the comm models' rescale to the session's probe (the all-to-all
ratio in report.json's `cost_model.rescale.scales`), the same way: what the comm estimates
would have been had only the compute model been carried to the session's speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from embshard.costs.base import DeviceCosts
from embshard.costs.neural import forward_wait_ms
from embshard.costs.pretrain import per_task_kendall_taus, regression_metrics


def distinct_results(report: dict) -> list[dict]:
    """Valid, measured and estimated results, one per distinct plan of a task (a guarded
    searcher's pick, or heuristics that agree, are the same plan measured once)."""
    out, seen = [], set()
    for r in report["results"]:
        if not (r["valid"] and r.get("measured_device_costs") and r.get("estimated_device_costs")):
            continue
        key = (r["task"], json.dumps(r["measured_device_costs"]["compute_ms"]), json.dumps(r["estimated_device_costs"]["compute_ms"]))
        if key in seen:
            continue
        seen.add(key)
        out.append(r)
    return out


def calibrated(result: dict, scale: dict[str, float]) -> dict:
    """`result` with its estimates rescaled as a calibrated checkpoint would predict them."""
    e = result["estimated_device_costs"]
    c = np.asarray(e["compute_ms"], np.float64)
    c2 = c * scale["compute"]
    fw = (np.asarray(e["forward_comm_ms"], np.float64) - forward_wait_ms(c)) * scale["forward_comm"] + forward_wait_ms(c2)
    costs = DeviceCosts(compute_ms=c2.tolist(), forward_comm_ms=fw.tolist(),
                        backward_comm_ms=(np.asarray(e["backward_comm_ms"], np.float64) * scale["backward_comm"]).tolist())
    est = {**e, "compute_ms": costs.compute_ms, "forward_comm_ms": costs.forward_comm_ms, "backward_comm_ms": costs.backward_comm_ms}
    return {**result, "estimated_device_costs": est, "estimated_cost_ms": costs.plan_cost_ms}


def at_measured_speed(result: dict, session: dict) -> dict:
    """`result` with its compute estimates moved from the session's probe to the probe tracked
    inside its measurement (unchanged where the report has no tracked probe)."""
    from embshard.hardware.probe import Probe

    tracked = result.get("measured_probe")
    if not tracked:
        return result
    ratio = Probe.from_dict(tracked).speed_vs(Probe.from_dict(session))["compute"]
    return calibrated(result, {"compute": ratio, "forward_comm": 1.0, "backward_comm": 1.0})


def fidelity(results: list[dict]) -> dict:
    pred, meas, comm_ratio = [], [], []
    for r in results:
        for p, m in zip(r["estimated_device_costs"]["compute_ms"], r["measured_device_costs"]["compute_ms"]):
            if m > 0:
                pred.append(p)
                meas.append(m)
        for p, m in zip(r["estimated_device_costs"]["backward_comm_ms"], r["measured_device_costs"]["backward_comm_ms"]):
            if p > 0 and m > 0:
                comm_ratio.append(m / p)
    both = [(m, p) for m, p in zip(meas, pred) if p > 0]
    compute = regression_metrics(np.array(meas), np.array(pred))
    taus = per_task_kendall_taus(results, "measured_cost_ms", "estimated_cost_ms")
    plan = regression_metrics(np.array([r["measured_cost_ms"] for r in results]), np.array([r["estimated_cost_ms"] for r in results]))
    env = [r["envelope"] for r in results if r.get("envelope")]
    return {
        "tasks": len({r["task"] for r in results}),
        "plans": len(results),
        "devices": compute.get("n", 0),
        "compute_mape_pct": compute.get("mape_pct"),
        "compute_kendall_tau": compute.get("kendall_tau"),
        "plan_tau_per_task": float(np.mean(taus)) if taus else None,
        "plan_mape_pct": plan.get("mape_pct"),
        "out_of_envelope": f"{sum(e['out_of_envelope_devices'] for e in env)}/{sum(e['devices'] for e in env)}" if env else "-",
        # the level: median measured / predicted (1.0: the rescaled models are of the measurement's size)
        "compute_level": float(np.median([m / p for m, p in both])) if both else None,
        "comm_level": float(np.median(comm_ratio)) if comm_ratio else None,
    }


def _f(x, pattern: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else pattern.format(x)


def table(rows: list[tuple[str, dict]]) -> str:
    lines = ["| held-out set | tasks | distinct plans | devices | compute MAPE | compute τ | plan-cost τ (per task) | "
             "plan-cost MAPE | measured ÷ predicted, compute / backward comm (median) | out of envelope |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in rows:
        lines.append(f"| {name} | {f['tasks']} | {f['plans']} | {f['devices']} | {_f(f['compute_mape_pct'], '{:.1f}%')} | "
                     f"{_f(f['compute_kendall_tau'], '{:.3f}')} | {_f(f['plan_tau_per_task'], '{:.3f}')} | "
                     f"{_f(f['plan_mape_pct'], '{:.1f}%')} | {_f(f['compute_level'], '{:.2f}')} / "
                     f"{_f(f['comm_level'], '{:.2f}')} | {f['out_of_envelope']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="shard.py report.json files (evaluate=measured, cost_model=neural)")
    ap.add_argument("--by-algorithm", action="store_true", help="also one row per algorithm (over all reports)")
    ap.add_argument("--calibration", default=None, help="a calibrated cost_models.pt: score its (rescaled) estimates")
    ap.add_argument("--at-measured-speed", action="store_true",
                    help="compute estimates on the probe tracked inside each plan's measurement (measured_probe)")
    ap.add_argument("--without-comm-rescale", action="store_true",
                    help="undo the comm models' rescale to the session's probe (cost_model.rescale.scales)")
    args = ap.parse_args(argv)
    scale = None
    if args.calibration:
        from embshard.costs.neural import NeuralCostModels
        from embshard.errors import EmbshardError

        try:
            models = NeuralCostModels.load(args.calibration)
        except EmbshardError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not models.calibration:
            print(f"error: {args.calibration}: not a calibrated checkpoint (no calibration entry)", file=sys.stderr)
            return 2
        if models.calibration.get("compute_terms"):
            print(f"error: {args.calibration}: calibrates kinds of compute work (compute_terms), so its estimates do not "
                  "follow from the reports' by one scale; evaluate with it instead (cost_model.path=...)", file=sys.stderr)
            return 2
        scale = models.scale
    every: list[dict] = []
    rows = []
    for i, path in enumerate(args.reports):
        p = Path(path)
        try:
            report = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            print(f"error: {p}: cannot read a report ({e})", file=sys.stderr)
            return 2
        if report.get("evaluate") != "measured":
            print(f"error: {p}: not a measured report (evaluate={report.get('evaluate')!r})", file=sys.stderr)
            return 2
        # Tasks of different reports may share a name (4dev/ and 8dev/ of one pool): key them
        # by report too, so a plan-cost τ never mixes two tasks.
        res = [{**r, "task": (i, r["task"])} for r in distinct_results(report)]
        if scale is not None:
            res = [calibrated(r, scale) for r in res]
        if args.at_measured_speed:
            if not report.get("probe") or not any(r.get("measured_probe") for r in res):
                print(f"error: {p}: --at-measured-speed needs the session's probe and the tracked probes "
                      "(measured_probe) of a shard.py run with measure.probe=true", file=sys.stderr)
                return 2
            res = [at_measured_speed(r, report["probe"]) for r in res]
        if args.without_comm_rescale:
            rescale = (report.get("cost_model") or {}).get("rescale") or {}
            if not rescale.get("applied"):
                print(f"error: {p}: --without-comm-rescale needs a report whose cost model was rescaled "
                      f"({rescale.get('reason', 'no cost_model.rescale')})", file=sys.stderr)
                return 2
            undo = {"compute": 1.0, **{k: 1.0 / rescale["scales"][k] for k in ("forward_comm", "backward_comm")}}
            res = [calibrated(r, undo) for r in res]
        if not res:
            print(f"error: {p}: no plan with both an estimate and a measurement", file=sys.stderr)
            return 2
        every += res
        label = p.stem if p.name != "report.json" else (
            p.parent.name if p.parent.name != "runs" else f"{p.parent.parent.name}/{p.parent.name}")
        rows.append((label, fidelity(res)))
    if len(rows) > 1:
        rows.append(("all", fidelity(every)))
    if args.by_algorithm:
        for alg in sorted({r["algorithm"] for r in every}):
            rows.append((f"plans of {alg}", fidelity([r for r in every if r["algorithm"] == alg])))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
