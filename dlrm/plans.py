"""The plans an end-to-end run trains under: plan files from shard.py, or named planners.

Everything here runs before the process group exists, on every rank alike, so a plan
that cannot work (missing or malformed file, tables that are not the model's, a device
count that is not the world size, a layout TorchRec cannot train) stops every rank with
the same one-line error instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from embshard.errors import InputError, PlanError
from embshard.plan import Plan
from embshard.task import Task


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".json") or "/" in spec or "\\" in spec


def resolve_plans(
    specs: Sequence[str],
    task: Task,
    world_size: int,
    make_sharder: Callable[[str], Any] | None = None,
    known_planners: Sequence[str] = (),
    device_type: str = "cpu",
    local_world_size: int | None = None,
) -> dict[str, Plan]:
    """{label: Plan} for every spec, each checked against the task and the world size.

    Args:
        specs: plan JSON paths (anything ending in .json or containing a '/'), or names of
            planners (`known_planners`), run here on the task.
        make_sharder: builds the named planner (e.g. Hydra-instantiates conf/search/<name>).
        device_type: "cpu" or "cuda": the export to TorchRec is tried for this device.

    Labels are planner names, or plan file stems ("-2", "-3" appended on clashes).

    Raises:
        InputError: no specs, unknown planner, missing or malformed plan file.
        PlanError: the plan does not fit the task (other tables, devices out of range,
            overlaps or gaps, memory) or cannot be expressed as a TorchRec plan.
    """
    from embshard.torchrec_bridge import plan_to_torchrec
    from dlrm.model import EBC_PATH

    if not specs:
        raise InputError("no plans given: set dlrm.plans=[<plan.json or planner name>, ...]")
    loaded: list[tuple[str, str, Plan | str]] = []  # planners run after the cheap checks
    for spec in specs:
        spec = str(spec)
        if _is_file_spec(spec):
            path = Path(spec)
            if not path.is_file():
                raise InputError(f"plan file {spec} not found")
            plan = Plan.load(path)
            label, where = path.stem, f"plan file {spec}"
        else:
            if spec not in known_planners or make_sharder is None:
                raise InputError(
                    f"unknown planner {spec!r}: give a plan JSON path or one of {', '.join(known_planners)}"
                )
            plan, label, where = spec, spec, f"planner {spec}"
        loaded.append((label, where, plan))
    if world_size != task.num_devices:
        raise PlanError(
            f"task {task.name!r} is planned for {task.num_devices} devices but the run has "
            f"{world_size} process(es); start torchrun with --nproc_per_node {task.num_devices} "
            "(or set num_devices in the task)"
        )
    plans: dict[str, Plan] = {}
    for label, where, plan in loaded:
        if isinstance(plan, str):
            plan = make_sharder(plan).shard(task)
        try:
            # validates (coverage, alignment, memory), then tries the export TorchRec will run
            plan_to_torchrec(task, plan, world_size=world_size, device_type=device_type,
                             module_path=EBC_PATH, local_world_size=local_world_size)
        except PlanError as e:
            raise PlanError(f"{where} does not fit the model's task {task.name!r}: {e}") from None
        base, k = label, 2
        while label in plans:
            label, k = f"{base}-{k}", k + 1
        plans[label] = plan
    return plans


def fingerprint(plans: Mapping[str, Plan]) -> str:
    """A short hash of the plans, compared across ranks after the process group is up."""
    blob = json.dumps({k: p.to_dict() for k, p in plans.items()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
