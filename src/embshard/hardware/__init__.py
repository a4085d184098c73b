"""Ground truth: measured costs of plans on real kernels and real processes."""

from embshard.hardware.backends import available_backends, make_kernel
from embshard.hardware.comm import CommConfig, CommResult, measure_comm
from embshard.hardware.compute import measure_compute
from embshard.hardware.evaluator import HardwareEvaluator
from embshard.hardware.protocol import (
    MeasurementProtocol,
    Stopwatch,
    Timing,
    measuring_process,
)

__all__ = [
    "available_backends", "make_kernel", "CommConfig", "CommResult", "measure_comm",
    "measure_compute", "HardwareEvaluator", "MeasurementProtocol", "Stopwatch", "Timing", "measuring_process",
]
