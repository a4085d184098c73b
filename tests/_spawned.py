"""Targets of test_measurement's spawned processes, in a module of their own: a spawned child
imports the module its target lives in, and these need only the measuring protocol (and torch,
for the allocator check), not everything the test module imports."""

from __future__ import annotations

import os
import resource
import statistics


def report_affinity(index, cores, q):
    from embshard.hardware.protocol import MeasurementProtocol, set_worker_process

    set_worker_process(MeasurementProtocol(threads=1), index, cores)
    q.put((index, sorted(os.sched_getaffinity(0))))


def _faults_per_alloc() -> float:
    import torch

    # warm-up steps, as the protocol's: the heap grows until freed blocks are reused (glibc's
    # per-thread cache first holds the tensors' small allocations between the big blocks, so
    # this takes up to about 8 steps here)
    for _ in range(16):
        x = torch.empty(64 << 20, dtype=torch.uint8)
        x.fill_(1)
        del x
    counts = []
    for _ in range(5):
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(64 << 20, dtype=torch.uint8)
        x.fill_(1)
        del x
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
    return float(statistics.median(counts))


def report_page_faults(q):
    """(faults per 64 MiB step with glibc's default allocator, with the protocol's caching one),
    in a fresh process: a process that already measured with malloc="cache" keeps freed 64 MiB
    blocks in its heap, and its default allocator then reuses them without faulting."""
    from embshard.hardware.protocol import MeasurementProtocol, measuring_process

    default = _faults_per_alloc()  # glibc mmaps a 64 MiB block afresh each time: one fault per page
    with measuring_process(MeasurementProtocol(pin="none", threads=None, malloc="cache")):
        cached = _faults_per_alloc()
    q.put((default, cached))
