"""Held-out evaluation of DreamShard and AutoShard: tasks of unseen tables at several device
and table counts, then a summary of shard.py's measured reports.

    python scripts/rl_eval.py tasks --out experiments/rl/eval/tasks        # one folder per setting
    python shard.py task_file=experiments/rl/eval/tasks/<setting> algorithms=[...] out_dir=experiments/rl/eval/runs/<setting>
    python scripts/rl_eval.py summarize experiments/rl/eval/runs --out docs/rl   # table, JSON, chart

(`make rl-eval` runs all three.) Tasks are drawn from the TEST half of the pool split the
training used (`split_pool`, same fraction and seed) and the script refuses to write them
if any of their tables is among a checkpoint's training tables (`check_unseen`). With
`--split validation`, tasks of the validation tables of the three-way split instead (the
held-out half cut in two, `embshard.data.split.TableSplit`): where switches are chosen. Settings: 20-30 tables on
4 devices (the training range and device count, unseen tables), on 2 and on 8 devices
(unseen device counts), 8-12 and 40-48 tables on 4 devices (table counts outside the
training range), and 20-30 tables on 4 devices whose reuse histograms are dropped (a user's
tables: rows, dim, pooling factor only).

The summary gives, per setting and algorithm: mean measured plan cost, the ratio to the
best of the six heuristic baselines on each task (mean with its bootstrap 95% interval over
tasks and verdict; the 25th-75th percentile range in the JSON), how often the algorithm beat
that best heuristic, how many tasks were worse beyond their own paired interval, the mean gap
to the balance reference beside the ratio, and mean search seconds.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import numpy as np

from embshard.data.split import SeenTables, check_unseen, seen_by_checkpoint
from embshard.data.tasks import neuroshard_tasks, split_pool, table_pool_from_dataset, without_histograms, write_tasks
from embshard.errors import InputError
from embshard.io import save_png, write_json_atomic, write_text_atomic
from embshard.report import settings_markdown, summaries_by_setting
from embshard.search.rl.stage import heuristic_baselines

ROOT = Path(__file__).resolve().parents[1]
HEURISTICS = tuple(heuristic_baselines())
#: name -> (min tables, max tables, devices, seed offset, tables keep their reuse histogram);
#: the first is the training range and device count
SETTINGS: dict[str, tuple[int, int, int, int, bool]] = {
    "20-30x4": (20, 30, 4, 11, True),
    "20-30x2": (20, 30, 2, 12, True),
    "20-30x8": (20, 30, 8, 13, True),
    "8-12x4": (8, 12, 4, 14, True),
    "40-48x4": (40, 48, 4, 15, True),
    "20-30x4-nohist": (20, 30, 4, 16, False),
}
#: more settings, written only when named (`tasks --settings`): device counts far from training
EXTRA_SETTINGS: dict[str, tuple[int, int, int, int, bool]] = {
    "20-30x16": (20, 30, 16, 17, True),
    "20-30x32": (20, 30, 32, 18, True),
}
LABELS = {
    "20-30x4": "unseen tables, 4 devices (trained: 4)",
    "20-30x2": "unseen tables, 2 devices",
    "20-30x8": "unseen tables, 8 devices",
    "8-12x4": "8-12 tables (trained: 20-30)",
    "40-48x4": "40-48 tables (trained: 20-30)",
    "20-30x4-nohist": "unseen tables without histograms, 4 devices",
}


def make_tasks(args: argparse.Namespace) -> None:
    import torch

    pool = table_pool_from_dataset(args.dataset)
    train, test = split_pool(pool, args.test_fraction, args.seed)
    seen = [seen_by_checkpoint(c) for c in args.checkpoints]
    if args.split == "validation":  # the choices' tasks: the validation tables of the three-way split
        from embshard.data.split import TableSplit

        held = TableSplit.of_pool(pool, args.test_fraction / 2, args.test_fraction / 2, args.seed)
        # validation tasks hold no train table either (checkpoints count validation tables as seen)
        test, seen = held.entries(pool, "validation"), [SeenTables("the split's train tables", held.seen("validation"))]
    for ckpt in args.checkpoints:
        card = torch.load(ckpt, map_location="cpu", weights_only=True)["data_card"]
        if set(card["train_tables"]) != {e["name"] for e in train}:
            print(f"note: {ckpt} was trained on another split than --seed {args.seed} makes", file=sys.stderr)
    out = Path(args.out)
    known = {**SETTINGS, **EXTRA_SETTINGS}
    unknown = [n for n in args.settings or [] if n not in known]
    if unknown:
        sys.exit(f"error: unknown setting(s) {unknown}; known: {', '.join(known)}")
    for name, (lo, hi, devices, offset, histograms) in ({n: known[n] for n in args.settings} if args.settings
                                                         else SETTINGS).items():
        if hi > len(test):
            print(f"{name}: skipped ({hi} tables; the {args.split} tables are {len(test)})", file=sys.stderr)
            continue
        tasks = neuroshard_tasks(test, args.num_tasks, min_tables=lo, max_tables=hi, dims=[4, 8, 16, 32, 64, 128],
                                 max_total_bytes=args.max_total_bytes, num_devices=devices, batch_size=args.batch_size,
                                 seed=args.seed * 100 + offset, name_prefix=f"rl-{'val' if args.split == 'validation' else 'eval'}-{name}")
        if not histograms:  # what a user brings: rows, dim, pooling factor; no trace either,
            # so the evaluator draws indices from the calibrated synthetic law
            tasks = [without_histograms(t) for t in tasks]
        try:  # no task holds a table any checkpoint was trained or tuned on
            check_unseen(tasks, seen, pool=args.dataset)
        except InputError as e:
            sys.exit(f"error: {e}")
        write_tasks(tasks, out / name)
        print(f"{name}: {len(tasks)} tasks of {min(len(t.tables) for t in tasks)}-{max(len(t.tables) for t in tasks)} "
              f"{'validation' if args.split == 'validation' else 'test'} tables on {devices} devices -> {out / name}")


def summarize(args: argparse.Namespace) -> None:
    runs = Path(args.runs)
    # --extra: a later pass on the same tasks, its algorithms against its own heuristics
    try:
        summary = summaries_by_setting(runs, SETTINGS, args.extra)
    except InputError as e:
        sys.exit(f"error: {e}")
    if not summary:
        sys.exit(f"error: no <setting>/report.json under {runs}")
    out = Path(args.out)
    write_json_atomic(out / f"{args.name}.json", summary)
    table = markdown(summary)
    write_text_atomic(out / f"{args.name}.md", table)
    plot(summary, out / f"{args.name}.png")
    print(table)
    print(f"wrote {out / (args.name + '.json')}, .md, .png")


def markdown(summary: dict) -> str:
    def cell(m: dict) -> str:
        ci = m.get("ratio_ci")
        ratio = (f"{m['mean_ratio']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}] {ci['verdict']}" if ci else
                 f"{m['mean_ratio']:.3f} [{m['ratio_p25']:.2f}-{m['ratio_p75']:.2f}]")
        gap = f"; gap {m['mean_gap_pct']:+.1f}%" if m.get("mean_gap_pct") is not None else ""
        return (f"{m['mean_cost_ms']:.1f}{' †' if 'run' in m else ''} ({ratio}, {m['beats_best_heuristic']}/"
                f"{m['tasks']}{gap})" + (f" {m['invalid']} invalid" if m["invalid"] else ""))

    lines = ["mean measured plan cost (ms); in brackets: ratio to the best heuristic per task, mean [bootstrap 95% "
             "interval over tasks] and verdict (from two tasks up; one task: [25th-75th pct]), tasks better than the best "
             "heuristic; then the mean gap to the balance reference (plan cost above mean device compute + the slowest "
             "device's comm)", ""]
    lines += settings_markdown(summary, cell, [LABELS.get(s, s) for s in summary])
    extra = sorted({m["run"] for s in summary for m in summary[s].values() if "run" in m})
    if extra:
        lines += ["", f"† measured in a separate pass (`--extra {' '.join(extra)}`) on the same tasks with the six heuristics: "
                  "its ratio is to the best heuristic of that pass; its ms are not comparable with the other rows "
                  "(another time on a shared machine)."]
    lines += ["", "mean search seconds per task", ""]
    lines += settings_markdown(summary, lambda m: f"{m['mean_search_seconds']:.3f}")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(summary)
    algorithms = [a for a in dict.fromkeys(a for s in settings for a in summary[s])
                  if any(summary[s].get(a, {}).get("tasks") for s in settings)]
    fig, ax = plt.subplots(figsize=(max(8, 1.9 * len(settings)), 4.2))
    width = 0.8 / len(algorithms)
    for i, a in enumerate(algorithms):
        xs, ys, lo, hi = [], [], [], []
        for j, s in enumerate(settings):
            m = summary[s].get(a)
            if m and m.get("tasks"):
                xs.append(j + (i - (len(algorithms) - 1) / 2) * width)
                ys.append(m["mean_ratio"])
                lo.append(m["mean_ratio"] - m["ratio_p25"])
                hi.append(m["ratio_p75"] - m["mean_ratio"])
        style = {"edgecolor": "black", "linewidth": 1.2} if a in ("dreamshard", "autoshard") else {}
        ax.bar(xs, ys, width, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], capsize=2, label=a,
               color=plt.cm.tab20(i % 20), **style)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.9, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(settings)))
    ax.set_xticklabels([textwrap.fill(LABELS.get(s, s), 22) for s in settings], fontsize=8)
    ax.set_ylabel("measured cost / best heuristic (per task)")
    ax.set_ylim(0.6, max(2.0, ax.get_ylim()[1]) if ax.get_ylim()[1] < 3 else 3)
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("held-out tasks (test tables), measured on FBGEMM CPU + gloo; bars: mean, whiskers: 25-75th pct")
    fig.tight_layout()
    save_png(fig, path)


def estimate(args: argparse.Namespace) -> None:
    """Every policy's plans (and the heuristics') on the tasks of each setting folder, all
    estimated by ONE cost model that none of them trained with (`--estimator`: NeuroShard's
    shipped neural cost models, compute + comm of the whole plan), so the variants are
    compared on the same yardstick without hardware."""
    import torch

    from embshard.costs.neural import NeuralCostModels
    from embshard.search.rl.sharders import AutoShardSharder, DreamShardSharder
    from embshard.task import load_tasks

    models = NeuralCostModels.load(args.estimator)

    class _Judge:
        @staticmethod
        def estimate_plan(task, plan) -> float:
            return models.device_costs(task, plan).plan_cost_ms

    judge = _Judge()
    policies = {}
    for spec in args.policies:  # name=path[:samples]
        name, _, rest = spec.partition("=")
        path, _, samples = rest.partition(":")
        algo = torch.load(path, map_location="cpu", weights_only=True)["algorithm"]
        cls = DreamShardSharder if algo == "dreamshard" else AutoShardSharder
        policies[name] = cls(checkpoint=path, samples=int(samples or 0), seed=0)
    heuristics = heuristic_baselines()
    summary: dict[str, dict] = {}
    for folder in args.tasks:
        setting = Path(folder).name
        ratios: dict[str, list[float]] = {n: [] for n in policies}
        for task in load_tasks(folder):
            with torch.no_grad():
                best = min(judge.estimate_plan(task, h.shard(task)) for h in heuristics.values())
                for n, sharder in policies.items():
                    ratios[n].append(judge.estimate_plan(task, sharder.shard(task)) / best)
        summary[setting] = {n: {"tasks": len(r), "mean_ratio": float(np.mean(r)), "ratio_p25": float(np.percentile(r, 25)),
                                "ratio_p75": float(np.percentile(r, 75)), "ratios": [round(x, 4) for x in r]}
                            for n, r in ratios.items()}
    lines = [f"estimated plan cost / best heuristic's, per task, all by the cost models of `{args.estimator}`: "
             "mean [25th-75th pct]", "", "| policy | " + " | ".join(summary) + " |", "|---" * (len(summary) + 1) + "|"]
    for n in policies:
        lines.append(f"| {n} | " + " | ".join(f"{summary[s][n]['mean_ratio']:.3f} [{summary[s][n]['ratio_p25']:.2f}-"
                                                f"{summary[s][n]['ratio_p75']:.2f}]" for s in summary) + " |")
    table = "\n".join(lines) + "\n"
    out = Path(args.out)
    write_json_atomic(out / f"{args.name}.json", summary)
    write_text_atomic(out / f"{args.name}.md", table)
    print(table)


def agreement(args: argparse.Namespace) -> None:
    """How far each DreamShard policy's own estimate of its plan lies from NeuroShard's cost
    models' and from the analytic model's estimate of the same plan (geometric mean of the
    ratios over a setting's tasks, and the largest): where the network extrapolates."""
    import torch

    from embshard.costs.analytic import AnalyticCostModel
    from embshard.costs.neural import NeuralCostModels
    from embshard.search.rl.checkpoint import load_checkpoint
    from embshard.search.rl.env import best_plan
    from embshard.task import load_tasks

    models, analytic = NeuralCostModels.load(args.estimator), AnalyticCostModel()
    settings = {Path(f).name: load_tasks(f) for f in args.tasks}
    lines = ["the policy's estimate of its argmax plan over NeuroShard's cost models' / over the analytic model's "
             "(geometric mean over tasks; the largest in brackets)", "",
             "| policy | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
    for spec in args.policies:
        name, _, path = spec.partition("=")
        agent, _ = load_checkpoint(path, "dreamshard")
        cells = []
        for tasks in settings.values():
            r_ns, r_an = [], []
            for task in tasks:
                with torch.no_grad():
                    plan, _ = best_plan(agent, task, 0)
                    own = agent.estimate_plan(task, plan)
                r_ns.append(own / models.device_costs(task, plan).plan_cost_ms)
                r_an.append(own / analytic.device_costs(task, plan).plan_cost_ms)
            g = lambda r: float(np.exp(np.mean(np.log(r))))  # noqa: E731
            cells.append(f"{g(r_ns):.3g}x / {g(r_an):.3g}x (max {max(r_an):.3g}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    out = Path(args.out)
    write_text_atomic(out / f"{args.name}.md", table)
    print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tasks", help="write the evaluation tasks, one folder per setting")
    t.add_argument("--dataset", default=str(ROOT / "data" / "synthetic_t128_bs4096_s0.pt"))
    t.add_argument("--checkpoints", nargs="*", default=[str(ROOT / "checkpoints" / "dreamshard_cpu" / "policy.pt"),
                                                         str(ROOT / "checkpoints" / "autoshard_cpu" / "policy.pt")])
    t.add_argument("--out", default=str(ROOT / "experiments" / "rl" / "eval" / "tasks"))
    t.add_argument("--num-tasks", type=int, default=3)
    t.add_argument("--test-fraction", type=float, default=0.5)
    t.add_argument("--seed", type=int, default=0, help="the split's seed (train.py's seed when the policies were trained)")
    t.add_argument("--batch-size", type=int, default=4096)
    t.add_argument("--max-total-bytes", type=int, default=1 << 30)
    t.add_argument("--settings", nargs="*", default=None,
                   help=f"which settings (default: {' '.join(SETTINGS)}; more: {' '.join(EXTRA_SETTINGS)})")
    t.add_argument("--split", choices=("heldout", "validation"), default="heldout",
                   help="heldout: the held-out half of the two-way split (the evaluation); validation: the "
                        "validation quarter of the three-way split (embshard.data.split), where choices are made")
    s = sub.add_parser("summarize", help="summarise shard.py reports, one <setting>/report.json each")
    s.add_argument("runs")
    s.add_argument("--out", default=str(ROOT / "docs" / "rl"))
    s.add_argument("--name", default="heldout", help="output file stem")
    s.add_argument("--extra", nargs="*", default=[], help="more runs folders of the same tasks (e.g. a later NeuroShard "
                   "pass with the heuristics): their other algorithms are added, ratios against their own heuristics")
    e = sub.add_parser("estimate", help="policies' plans on task folders, estimated by one reference cost network")
    e.add_argument("--tasks", nargs="+", required=True, help="setting folders of task JSONs")
    e.add_argument("--policies", nargs="+", required=True, help="name=policy.pt[:samples] (samples: best-of-K, default 0)")
    e.add_argument("--estimator", default="checkpoints/cpu_fbgemm/cost_models.pt",
                   help="NeuroShard cost models (cost_models.pt) that judge every plan")
    e.add_argument("--out", default=str(ROOT / "docs" / "rl"))
    e.add_argument("--name", default="ablation_estimated")
    g = sub.add_parser("agreement", help="DreamShard policies' own estimates against the cost models' and the analytic's")
    g.add_argument("--tasks", nargs="+", required=True, help="setting folders of task JSONs")
    g.add_argument("--policies", nargs="+", required=True, help="name=policy.pt (DreamShard)")
    g.add_argument("--estimator", default="checkpoints/cpu_fbgemm/cost_models.pt")
    g.add_argument("--out", default=str(ROOT / "docs" / "rl"))
    g.add_argument("--name", default="agreement")
    args = ap.parse_args()
    {"tasks": make_tasks, "summarize": summarize, "estimate": estimate, "agreement": agreement}[args.cmd](args)


if __name__ == "__main__":
    main()
