"""The Python API: plan a task with any searcher of this project, by its config name.

    import embshard
    task = embshard.Task.load("examples/tasks/dlrm_small.json")   # or Task.from_module(model, topology, ...)
    plan = embshard.plan(task, algorithm="neuroshard")            # our Plan, validated
    plan = embshard.plan(task, algorithm="neuroshard", checkpoint=None, beam_width=1)   # overrides

`algorithm` is a name of conf/searchers/all.yaml (what `shard.py algorithms=[...]` takes); the
searcher is built from its conf/search/ config exactly as shard.py builds it, with the
keyword overrides applied as `searchers.<name>.<key>=<value>` would be.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from embshard.errors import InputError, nearest_name
from embshard.plan import Plan, validate
from embshard.task import Task

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"


def algorithms() -> dict[str, str]:
    """Every searcher name (conf/searchers/all.yaml) -> its conf/search/ config file name."""
    from omegaconf import OmegaConf

    out: dict[str, str] = {}
    for entry in OmegaConf.load(CONF / "searchers" / "all.yaml").defaults:
        (key, value), = entry.items()
        out[str(key).split("@", 1)[1]] = str(value)
    return out


def _config(group: str, name: str, **context: Any):
    """A conf/<group>/<name>.yaml node with the top-level keys it interpolates (`context`)."""
    from omegaconf import OmegaConf

    root = OmegaConf.create({**context, "node": OmegaConf.load(CONF / group / f"{name}.yaml")})
    return root


def searcher(algorithm: str, seed: int = 0, **overrides: Any) -> Any:
    """The searcher (a `Sharder`) named `algorithm`, built from its config with `overrides`.

    Raises:
        InputError: unknown algorithm or override key (with the nearest known one).
    """
    from hydra.utils import get_class, instantiate
    from omegaconf import OmegaConf

    known = algorithms()
    if algorithm not in known:
        near = nearest_name(str(algorithm), known)
        hint = f" (did you mean {near!r}?)" if near else ""
        raise InputError(f"unknown algorithm {algorithm!r}{hint}; known: {', '.join(known)}")
    root = _config("search", known[algorithm], seed=seed)
    # the other planners' configs, as conf/searchers/all.yaml gives them to shard.py: a planner of
    # planners (the portfolio) takes its members from them
    root.searchers = {n: OmegaConf.load(CONF / "search" / f"{f}.yaml") for n, f in known.items()
                      if f != known[algorithm]}
    node = root.node
    target = get_class(node._target_)
    params = set(inspect.signature(target).parameters) - {"self"}
    unknown = sorted(k for k in overrides if k not in node and k not in params)
    if unknown:
        near = [m for m in (nearest_name(k, params | set(node)) for k in unknown) if m]
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise InputError(f"{algorithm}: unknown override(s) {unknown}{hint}; it takes "
                         f"{', '.join(sorted(k for k in params if not k.startswith('_')))}")
    for key, value in overrides.items():
        OmegaConf.update(root, f"node.{key}", value, merge=False, force_add=True)
    return instantiate(root.node)


def hardware(name: str = "fbgemm_cpu", measure: str = "cpu", seed: int = 0) -> Any:
    """The evaluator of conf/hardware/<name>.yaml under the protocol conf/measure/<measure>.yaml."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from embshard.hardware.protocol import load_protocol

    if not (CONF / "hardware" / f"{name}.yaml").is_file():
        options = sorted(p.stem for p in (CONF / "hardware").glob("*.yaml"))
        raise InputError(f"unknown hardware {name!r}; known: {', '.join(options)}")
    protocol = load_protocol(measure).to_dict()  # its `defaults` chain resolved
    root = _config("hardware", name, seed=seed, progress=False, measure=OmegaConf.create(protocol))
    return instantiate(root.node)


def plan(task: Task, algorithm: str | Any = "neuroshard", hardware: Any = None, seed: int = 0,
         **overrides: Any) -> Plan:
    """Plan `task` with the searcher named `algorithm` (or a Sharder object) and return our
    Plan, validated (every table covered once, memory, the tables' constraints).

    A task of pooled and sequence tables given to a planner of pooled tables only (neuroshard,
    the portfolio, dreamshard, autoshard, torchrec) is planned in two parts in one memory budget:
    the sequence tables by size_lookup_greedy, the pooled ones by the planner
    (`embshard.search.mixed`).

    Args:
        task: a Task (`Task.load`, `Task.from_module`, or built in Python).
        algorithm: a name of conf/searchers/all.yaml (neuroshard, dreamshard, autoshard,
            torchrec, the heuristics size_lookup_greedy, lookup_greedy, ...), or a Sharder.
        hardware: an evaluator (`embshard.api.hardware()`), for a searcher that measures its
            candidates (the measured guard of neuroshard, dreamshard, autoshard and the portfolio,
            `verify`); None: nothing is measured.
        overrides: keys of the searcher's config (`checkpoint=`, `verify=`, `beam_width=` ...).

    Raises:
        InputError: unknown algorithm or key, or a task the algorithm is not meant for.
        InfeasibleError: no plan fits memory (names the table and the shortfall in bytes).
    """
    if isinstance(algorithm, str):
        sharder = searcher(algorithm, seed=seed, **overrides)
        name = algorithm
    else:
        if overrides:
            raise InputError("overrides are for an algorithm given by name; configure a Sharder object directly")
        sharder, name = algorithm, getattr(algorithm, "name", type(algorithm).__name__)
    return plan_with_info(task, sharder, name, hardware)[0]


def plan_with_info(task: Task, sharder: Any, name: str, hardware: Any = None) -> tuple[Plan, dict[str, Any] | None]:
    """`plan` for a Sharder object: (the validated plan, what `embshard.search.mixed` did on a
    task of both kinds for a planner of pooled tables, else None)."""
    from embshard.compare import refusal
    from embshard.search.constrained import shard_constrained
    from embshard.search.mixed import guard_mixed, is_mixed, shard_mixed

    mixed = is_mixed(sharder.capabilities, task)
    reason = None if mixed else refusal(name, sharder.capabilities, task)
    if reason is not None:
        raise InputError(reason)
    if hardware is not None:
        attach = getattr(sharder, "attach_evaluator", None)
        if not callable(attach):
            raise InputError(f"{name} measures nothing while it searches; hardware= is for the measured guards "
                             "(neuroshard, dreamshard, autoshard, portfolio)")
        attach(hardware)
    info = None
    if mixed:
        both = shard_mixed(task, lambda pooled: shard_constrained(sharder, pooled), name)
        info = both.info()
        result, whole_guard = guard_mixed(task, both, sharder, name)
        if whole_guard is not None:  # with hardware: the whole plan measured against the heuristics'
            info["guard"] = whole_guard
    else:
        result = shard_constrained(sharder, task)
    result.algorithm = name
    validate(task, result)
    return result, info
