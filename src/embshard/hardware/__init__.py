"""Ground truth: measured costs of plans on real kernels and real processes.

The names below load on first use (PEP 562), so a light module of this package (the
measurement protocol, the emulated cluster's link test) starts without importing torch.
"""

from importlib import import_module
from typing import Any

_WHERE = {
    "available_backends": "backends", "make_kernel": "backends",
    "CommConfig": "comm", "CommResult": "comm", "measure_comm": "comm",
    "measure_compute": "compute", "HardwareEvaluator": "evaluator",
    "MeasurementProtocol": "protocol", "Stopwatch": "protocol", "Timing": "protocol", "measuring_process": "protocol",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'embshard.hardware' has no attribute {name!r}")
    return getattr(import_module(f"embshard.hardware.{_WHERE[name]}"), name)
