"""Ground truth: measured costs of plans on real kernels and real processes."""

from embshard.hardware.backends import available_backends, make_kernel
from embshard.hardware.comm import CommConfig, CommResult, measure_comm
from embshard.hardware.compute import measure_compute
from embshard.hardware.evaluator import HardwareEvaluator
from embshard.hardware.timing import Timing, measure, time_call

__all__ = [
    "available_backends", "make_kernel", "CommConfig", "CommResult", "measure_comm",
    "measure_compute", "HardwareEvaluator", "Timing", "measure", "time_call",
]
