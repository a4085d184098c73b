"""The target of test_measurement's spawned workers, in a module of its own: a spawned child
imports the module its target lives in, and this one needs only the measuring protocol (the test
module would bring torch and the cost models into every child)."""

from __future__ import annotations

import os

from embshard.hardware.protocol import MeasurementProtocol, set_worker_process


def report_affinity(index, cores, q):
    set_worker_process(MeasurementProtocol(threads=1), index, cores)
    q.put((index, sorted(os.sched_getaffinity(0))))
