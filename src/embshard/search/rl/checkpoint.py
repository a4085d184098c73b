"""RL checkpoints: one file of plain data (`torch.load(weights_only=True)`), and its data card.

Contents: format and algorithm, the input normalisation (feature names, train-pool mean and
std), network hyperparameters and switches, state dicts, the data card (tables, tasks,
device counts, batch, hardware, measurements, training time) and training metrics. Every
way a file can be wrong (missing, truncated, not ours, another algorithm's, trained on
other features than this code computes, weights that do not fit) is one InputError line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from embshard.errors import InputError
from embshard.io import atomic_path
from embshard.search.rl.agents import AutoShardAgent, DreamShardAgent
from embshard.search.rl.features import FeatureNorm, feature_names
from embshard.search.rl.nets import AutoShardNet, DreamShardCostNet, DreamShardPolicy

FORMAT = "embshard-rl-policy"
FORMAT_VERSION = 1
ALGORITHMS = ("dreamshard", "autoshard")
ROOT = Path(__file__).resolve().parents[4]
BUILD_COMMAND = "make rl-checkpoints"


def build_agent(algorithm: str, norm: FeatureNorm, hparams: dict[str, Any], switches: dict[str, Any]):
    """A fresh (untrained) agent of `algorithm`."""
    f = norm.num_features
    if algorithm == "dreamshard":
        # the pooled-output MB column, for a structured-comm cost network (un-normalised inside)
        col = norm.names.index("output_mb")
        costnet = DreamShardCostNet(f, **hparams["costnet"], volume=(col, float(norm.mean[col]), float(norm.std[col])))
        policy = DreamShardPolicy(f, encode_table=bool(switches["encode_table"]), **hparams["policy"])
        return DreamShardAgent(norm, costnet, policy, reward_comm=bool(switches["reward_comm"]),
                               estimate=str(switches.get("estimate", "overall")))
    if algorithm == "autoshard":
        return AutoShardAgent(norm, AutoShardNet(f, **hparams["net"]))
    raise InputError(f"unknown RL algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")


def save_checkpoint(path: str | os.PathLike, agent: Any, hparams: dict[str, Any], switches: dict[str, Any],
                    data_card: dict[str, Any], metrics: dict[str, Any]) -> None:
    bundle = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "algorithm": agent.algorithm,
        "normalization": agent.norm.to_dict(),
        "hparams": hparams,
        "switches": switches,
        "state_dicts": {name: {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
                        for name, m in agent.modules().items()},
        "data_card": data_card,
        "metrics": metrics,
    }
    with atomic_path(path) as tmp:
        torch.save(bundle, tmp)


def resolve_path(path: str | os.PathLike) -> Path:
    """Relative paths resolve against the working directory, then the project root."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_absolute() or p.exists():
        return p
    return ROOT / p


def load_checkpoint(path: str | os.PathLike, algorithm: str) -> tuple[Any, dict[str, Any]]:
    """(agent in eval mode, the raw bundle) from a checkpoint of `algorithm`."""
    p = resolve_path(path)
    if not p.is_file():
        raise InputError(f"{algorithm} checkpoint {p} not found; build it with `{BUILD_COMMAND}`")
    try:
        bundle = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, pickle of arbitrary objects, not a torch file, ...
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise InputError(f"{p}: not a readable {algorithm} checkpoint ({type(e).__name__}: {first})") from None
    if not isinstance(bundle, dict) or bundle.get("format") != FORMAT:
        raise InputError(f"{p}: not an embshard RL policy checkpoint")
    if bundle.get("format_version") != FORMAT_VERSION:
        raise InputError(f"{p}: checkpoint format {bundle.get('format_version')!r}, this code reads {FORMAT_VERSION}; "
                         f"rebuild it with `{BUILD_COMMAND}`")
    if bundle.get("algorithm") != algorithm:
        raise InputError(f"{p}: a {bundle.get('algorithm')!r} checkpoint, not {algorithm!r}")
    try:
        norm = FeatureNorm.from_dict(bundle["normalization"])
        if tuple(norm.names) != feature_names():
            raise InputError(f"{p}: trained on other table features than this code computes "
                             f"({len(norm.names)} vs {len(feature_names())} columns); rebuild it with `{BUILD_COMMAND}`")
        agent = build_agent(algorithm, norm, bundle["hparams"], bundle["switches"])
        for name, module in agent.modules().items():
            module.load_state_dict(bundle["state_dicts"][name], strict=True)
            module.eval()
    except InputError:
        raise
    except Exception as e:  # KeyError, TypeError, size mismatch in load_state_dict, ...
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise InputError(f"{p}: not a valid {algorithm} checkpoint ({type(e).__name__}: {first})") from None
    return agent, bundle


def data_card_markdown(bundle_card: dict[str, Any], metrics: dict[str, Any], algorithm: str, command: str) -> str:
    """The human-readable data card written beside a checkpoint."""
    c = bundle_card
    lines = [
        f"# {algorithm} policy: data card",
        "",
        f"Built {c.get('created')} on host `{c.get('host')}` by `{command}` in {c.get('train_seconds', 0):.0f} s "
        f"(of which {c.get('measure_seconds', 0):.0f} s measuring on hardware).",
        "",
        "| | |",
        "|---|---|",
        f"| tables | {len(c.get('train_tables', []))} train tables of the pool `{c.get('pool')}`; "
        + (f"{len(c.get('validation_tables', []))} validation tables (the validation tasks: every choice is made "
           f"on them); " if c.get("validation_tables") else "")
        + f"{len(c.get('test_tables', []))} test tables never seen (names and keys: `split.json`) |",
        f"| tasks | {c.get('num_train_tasks')} training tasks of {c.get('min_tables')}-{c.get('max_tables')} tables, "
        f"dims {c.get('dims')} |",
        f"| device counts | {c.get('device_counts')} |",
        f"| batch | {c.get('batch_sizes')} |",
        f"| hardware | {c.get('hardware')} |",
        f"| hardware measurements | {c.get('measurements')} plans ({c.get('measured_what')}) |",
        f"| cost data | {c.get('cost_data_samples', 0)} compute samples (batch {c.get('cost_data_batch_sizes', '-')}) from `{c.get('cost_data')}` |",
        f"| switches | {c.get('switches')} |",
        f"| traced tables' histograms | {c.get('trace_histograms', 'given')} |",
        f"| networks | {c.get('nets', '-')} |",
        f"| replayed plans | {c.get('replayed_plans', 0)} measured plans of an earlier run (`{c.get('replay')}`) |",
        f"| seed | {c.get('seed')} |",
        "",
        "## Training curve (per iteration)",
        "",
    ]
    hist = metrics.get("history") or []
    keys = [k for k in ("measured/plan_cost_ms", "measured/estimated_ms", "rl/estimated_cost_ms", "rl/estimated_reward",
                        "cost/loss", "rl/entropy") if any(k in h for h in hist)]
    if hist:
        lines.append("| iteration | " + " | ".join(keys) + " |")
        lines.append("|---" * (len(keys) + 1) + "|")
        for h in hist:
            lines.append(f"| {int(h['iteration'])} | " + " | ".join(f"{h[k]:.4g}" if k in h else "" for k in keys) + " |")
    val = metrics.get("validation") or {}
    if val:
        lines += ["", "## Validation (tasks of the validation tables, at the training device counts and batch sizes)", ""]
        for k, v in val.items():
            lines.append(f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}")
    return "\n".join(lines) + "\n"
