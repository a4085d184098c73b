"""Baselines for (sequence) tables, by TorchRec's and HugeCTR's names.

* `row_wise`: every table split over all devices in TorchRec's row blocks (rank = id //
  ceil(rows / world)), as TorchRec's row_wise sharding (rw_sequence_sharding for sequence
  tables); `dedup_ids=True` adds TorchRec's use_index_dedup (each distinct id sent once per
  device and table before the input all-to-all).
* `table_row_wise`: each table on one host, its rows split over that host's devices in row
  blocks (TorchRec's EmbeddingCollection has no TWRW; the data path here runs it).
* `data_parallel`: every table on every device, gradients all-reduced.
* `hugectr_hybrid`: HugeCTR's hybrid embedding: rows whose access count passes its
  all-reduce-vs-all-to-all break-even threshold are data-parallel (on every device, dense
  all-reduce of their gradients), the rest model-parallel over all devices.
  (`table_wise` is embshard.search.baselines.GreedySharder with key "lookup": conf/search/table_wise.yaml.)

Every baseline is memory-checked: a plan that does not fit raises InfeasibleError naming the
device, a table and the shortfall.
"""

from __future__ import annotations

import math

import numpy as np

from embshard.errors import InfeasibleError
from embshard.flexshard.layout import Tiers, block_shards, check_fits, host_devices, tier_layout
from embshard.flexshard.stats import BatchSplit, task_access_stats
from embshard.plan import Plan, Shard
from embshard.search.base import Capabilities
from embshard.task import Task

#: HugeCTR's defaults for the hybrid embedding's threshold (HugeCTR/src/parsers/create_embedding.cpp:
#: p_dup_max 1/100, max_all_reduce_bandwidth 1.3e11, max_all_to_all_bandwidth 1.9e11,
#: efficiency_bandwidth_ratio 1.0; communication_type IB_NVLink unless set).
HUGECTR_P_DUP_MAX = 0.01
HUGECTR_ALL_REDUCE_BANDWIDTH = 1.3e11
HUGECTR_ALL_TO_ALL_BANDWIDTH = 1.9e11
HUGECTR_EFFICIENCY_BANDWIDTH_RATIO = 1.0


class RowWiseSharder:
    """Every table in TorchRec's row blocks over all devices."""

    capabilities = Capabilities(("sequence",), splits_tables=True)

    def __init__(self, dedup_ids: bool = False, name: str = "row_wise"):
        self.dedup_ids, self.name = dedup_ids, name

    def shard(self, task: Task) -> Plan:
        shards = [s for t in task.tables for s in block_shards(t, 0, t.rows, range(task.num_devices))]
        return check_fits(task, Plan(task.name, self.name, shards, dedup_ids=self.dedup_ids))


class TableRowWiseSharder:
    """Each table on one host (largest dim x pooling factor first, onto the host with the least
    so far that has room on all its devices), rows in blocks over the host's devices."""

    capabilities = Capabilities(("sequence",), splits_tables=True)

    def __init__(self, name: str = "table_row_wise"):
        self.name = name

    def shard(self, task: Task) -> Plan:
        free = np.full(task.num_devices, task.device_memory_bytes, dtype=np.int64)
        load = np.zeros(task.hosts)
        shards: list[Shard] = []
        for t in sorted(task.tables, key=lambda t: (-t.dim * t.pooling_factor, t.name)):
            best, short = None, None
            for h in sorted(range(task.hosts), key=lambda h: (load[h], h)):
                pieces = block_shards(t, 0, t.rows, host_devices(task, h))
                need = {s.device: task.shard_memory_bytes(t, s.rows, s.dim) for s in pieces}
                gap = max(need[d] - free[d] for d in need)
                if gap <= 0:
                    best = (h, pieces, need)
                    break
                short = gap if short is None else min(short, gap)
            if best is None:
                raise InfeasibleError(
                    f"table {t.name!r} fits on no host split over its {task.devices_per_host} devices: short by {short} bytes",
                    table=t.name, shortfall_bytes=int(short),
                )
            h, pieces, need = best
            for d, b in need.items():
                free[d] -= b
            load[h] += t.dim * t.pooling_factor
            shards += pieces
        return check_fits(task, Plan(task.name, self.name, shards))


class DataParallelSharder:
    """Every table replicated on every device (replica k on device k)."""

    capabilities = Capabilities(("sequence",), splits_tables=False)

    def __init__(self, name: str = "data_parallel"):
        self.name = name

    def shard(self, task: Task) -> Plan:
        shards = [Shard(t.name, d, 0, t.dim, 0, t.rows, replica=d) for t in task.tables for d in range(task.num_devices)]
        return check_fits(task, Plan(task.name, self.name, shards))


def hugectr_threshold_per_step(task: Task) -> float:
    """HugeCTR's frequent-category count threshold, per training step.

    From HugeCTR's hybrid embedding (ModelInitializationFunctors::calculate_threshold in
    HugeCTR/src/embeddings/hybrid_embedding/calibration_data.cu), whose counts are over
    `num_iterations` batches; divided by them here:
    * several nodes (IB_NVLink): nodes * (all-to-all bw / all-reduce bw) * efficiency ratio
      * nodes / (nodes - 1): a category used more often than this is cheaper all-reduced;
    * one node (NVLink_SingleNode): batch * sqrt(2 p_dup_max / (M (M - 1))), M = batch /
      devices: the count at which a category is duplicated within a device's samples with
      probability p_dup_max.
    """
    n = task.hosts
    if n > 1:
        return n * HUGECTR_ALL_TO_ALL_BANDWIDTH / HUGECTR_ALL_REDUCE_BANDWIDTH * HUGECTR_EFFICIENCY_BANDWIDTH_RATIO * n / (n - 1)
    m = task.batch_size / task.num_devices
    if m <= 1:
        return 0.0
    return task.batch_size * math.sqrt(2.0 * HUGECTR_P_DUP_MAX / (m * (m - 1)))


class HugeCTRHybridSharder:
    """HugeCTR's hybrid embedding on a task (see the module docstring).

    Frequent rows: accessed at least `hugectr_threshold_per_step` times per step on the fit
    batches, rounded up per table to a multiple of the device count (HugeCTR rounds its
    frequent set so). Where they do not all fit the memory cap, the least frequent are
    dropped (the threshold is raised) until the plan fits; `last_search_info` says so.
    The rest of each table is split over all devices in row blocks (HugeCTR spreads its
    infrequent categories round-robin over all GPUs).
    """

    capabilities = Capabilities(("sequence",), splits_tables=True)

    def __init__(self, fit_batches: int = 4, seed: int = 0, name: str = "hugectr_hybrid"):
        self.split = BatchSplit(fit_batches, 1, seed)
        self.name = name
        self.last_search_info: dict = {}

    def shard(self, task: Task) -> Plan:
        stats = task_access_stats(task, self.split)
        threshold = hugectr_threshold_per_step(task)
        D = task.num_devices

        def plan_at(min_count_per_step: float) -> Plan:
            shards, row_maps = [], {}
            for t in task.tables:
                st = stats[t.name]
                frequent = int(np.searchsorted(-st.per_step, -min_count_per_step, side="right"))
                if frequent:
                    frequent = min(-(-frequent // D) * D, st.ids.size)
                front, pieces = tier_layout(task, t, st.ids, Tiers(frequent, 0))
                shards += pieces
                if frequent:
                    row_maps[t.name] = front
            return Plan(task.name, self.name, shards, row_maps)

        plan = plan_at(threshold)
        raised = threshold
        if max(plan.memory_bytes(task)) > task.device_memory_bytes:
            counts = np.unique(np.concatenate([s.per_step for s in stats.values()]))
            lo, hi = int(np.searchsorted(counts, threshold)), counts.size  # hi: nothing frequent
            while lo < hi:  # the lowest count threshold >= HugeCTR's whose plan fits
                mid = (lo + hi) // 2
                if max(plan_at(counts[mid]).memory_bytes(task)) <= task.device_memory_bytes:
                    hi = mid
                else:
                    lo = mid + 1
            raised = float(counts[lo]) if lo < counts.size else math.inf
            plan = plan_at(raised)
        self.last_search_info = {
            "fit_batches": self.split.fit_batches,
            "threshold_accesses_per_step": threshold,
            "threshold_used_per_step": raised,
            "replicated_rows": int(sum(len(v) for v in plan.row_maps.values())),
        }
        return check_fits(task, plan)
