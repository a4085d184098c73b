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
    #: The plan cost of each repetition, when measured: repetition i of every plan measured in
    #: one interleaved batch ran in the same visit, so two plans' samples pair by index.
    plan_cost_samples_ms: list[float] = field(default_factory=list)
    #: Per device, the all-to-all of the input ids before the lookups (TorchRec's input_dist,
    #: with row-wise bucketizing); empty where it was not measured or estimated (counts 0).
    input_dist_ms: list[float] = field(default_factory=list)
    #: What was timed: "kernels" (fused kernel per device + pooled all-to-all), "dmp_step"
    #: (DistributedModelParallel's embedding step: compute_ms is then the forward (lookups and
    #: output distribution) plus the backward, per rank), or "estimate".
    source: str = "kernels"

    @property
    def total_ms(self) -> list[float]:
        ids = self.input_dist_ms or [0.0] * len(self.compute_ms)
        return [c + f + b + i for c, f, b, i in zip(self.compute_ms, self.forward_comm_ms, self.backward_comm_ms, ids)]

    @property
    def plan_cost_ms(self) -> float:
        """Max over devices of compute + forward comm + backward comm (+ the input ids' all-to-all
        where it was timed) (docs/contracts.md)."""
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


@runtime_checkable
class EnvelopeReporting(CostModel, Protocol):
    """A learned cost model that says how much of a plan lies outside what it was trained on
    (report.json: `envelope` per plan; `embshard.costs.neural.NeuralCostModels`)."""

    def envelope_report(self, task: Task, plan: Plan) -> dict[str, Any]: ...
