"""The CostModel protocol and the per-device costs every cost model returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from embshard.plan import Plan
from embshard.task import Task


@dataclass
class DeviceCosts:
    """Per-device costs of one plan, in milliseconds.

    `forward_comm_ms` includes the time a fast device waits for the slowest one at the
    forward all-to-all. `*_spread_ms` hold the spread (interquartile range) of measured
    values and stay empty for estimates.
    """

    compute_ms: list[float]
    forward_comm_ms: list[float]
    backward_comm_ms: list[float]
    compute_spread_ms: list[float] = field(default_factory=list)
    forward_comm_spread_ms: list[float] = field(default_factory=list)
    backward_comm_spread_ms: list[float] = field(default_factory=list)
    #: Spread of the plan cost itself over repetitions, when measured.
    plan_cost_spread_ms: float | None = None

    @property
    def total_ms(self) -> list[float]:
        return [c + f + b for c, f, b in zip(self.compute_ms, self.forward_comm_ms, self.backward_comm_ms)]

    @property
    def plan_cost_ms(self) -> float:
        """Max over devices of compute + forward comm + backward comm (docs/usage.md, "Contracts")."""
        return max(self.total_ms)

    def headroom(self) -> dict[str, float]:
        """How far the plan is from perfect balance.

        `compute_imbalance`: max / mean of the devices' compute. `balance_reference_ms`: mean
        device compute plus the comm of the slowest device (the one that waits for nobody, so
        its forward comm is transfer only): what the plan would cost were compute perfectly
        balanced. `gap_ms` / `gap_pct`: plan cost above that reference."""
        c = self.compute_ms
        mean = sum(c) / len(c)
        slow = max(range(len(c)), key=lambda i: c[i])
        ref = mean + self.forward_comm_ms[slow] + self.backward_comm_ms[slow]
        gap = self.plan_cost_ms - ref
        return {
            "compute_imbalance": max(c) / mean if mean > 0 else 1.0,
            "balance_reference_ms": ref,
            "gap_ms": gap,
            "gap_pct": 100.0 * gap / ref if ref > 0 else 0.0,
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_ms"] = self.total_ms
        d["plan_cost_ms"] = self.plan_cost_ms
        d["headroom"] = self.headroom()
        return d


@runtime_checkable
class CostModel(Protocol):
    """Anything that can cost a plan: the hardware, a neural model, an analytic model."""

    def device_costs(self, task: Task, plan: Plan) -> DeviceCosts: ...
