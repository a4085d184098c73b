"""The measured cost of a plan: real kernels per device, real all-to-all between processes.

`HardwareEvaluator` is a CostModel (`device_costs(task, plan) -> DeviceCosts`) and also
measures many plans at once (`measure_many`), interleaved so drift of the machine hits all
alike:

1. compute: every device of every plan runs its fused embedding kernel (forward +
   backward with the fused update), round-robin over plans and devices (A B A B ... per
   visit), under the measurement protocol (`hardware.protocol`: pinned, one thread, CPU
   time of the measuring thread, caching allocator, median over visits);
2. communication: one spawned process group (kept up for the next call: `comm.KeptRanks`)
   measures the forward and backward all-to-all of every plan, each rank first waiting its own measured compute time (less the
   smallest), so the forward comm of a fast device includes waiting for the slowest.

Plan cost = max over devices of (compute + forward comm + backward comm).

`session_probe` times the speed probe (`hardware.probe`) once per evaluator: the run that owns
the measuring session calls it first and records it beside the costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections import Counter
from typing import TYPE_CHECKING, Sequence

import torch

from embshard.costs.base import DeviceCosts
from embshard.errors import InputError
from embshard.hardware.backends import BACKENDS, ShardInput, check_fbgemm_optimizer, check_torch_optimizer
from embshard.hardware.comm import CommConfig, CommResult, measure_comm
from embshard.hardware.compute import measure_compute
from embshard.hardware.protocol import MeasurementProtocol, Timing
from embshard.plan import Plan, validate
from embshard.task import Task

if TYPE_CHECKING:
    from embshard.hardware.probe import Probe


class HardwareEvaluator:
    """Measures plans on this machine's hardware.

    Args:
        backend: "fbgemm" (fused table-batched op) or "torch" (embedding_bag fallback).
        device: "cpu" or "cuda" (all logical devices are timed one after another on it).
        comm_backend: "gloo", "nccl", None (no communication: compute only), or "auto"
            (gloo on CPU, nccl on CUDA).
        protocol: how to time (`MeasurementProtocol`, the Hydra group `measure/`; a dict is
            accepted). Default: the pinned CPU protocol.
        batch_size: override the task's batch size (faster runs); None keeps it.
        seed: seeds the index draws.
        progress: tqdm progress bars.
        comm_timeout_s: kill the comm processes after this long (None: scales with work).
        step: what a plan's cost is measured as: "kernels" (each device's fused kernel and the
            all-to-all of pooled embeddings, in processes of our own) or "dmp" (TorchRec's
            DistributedModelParallel embedding step, `hardware.dmp_step`: the input ids'
            all-to-all, row-wise bucketizing, lookups, output distribution, backward with the
            fused update; CPU and gloo; needs TorchRec).
        cluster: where the all-to-alls run (conf/cluster/): {"kind": "loopback"} (default) or
            {"kind": "emulated", "rate_mbit": auto | Mbit/s, ...}: the task's two hosts as
            network namespaces joined by a tc-shaped link (embshard.hardware.cluster), for each
            measuring call; `network` records what was used.
        max_cached_bytes: device kernels kept alive from one visit to the next within a call
            (`measure_compute`); the rest are built again at every visit. Default 0: every kernel
            is built again, so every plan of a call is timed in the same state. With measure_compute's
            2 GiB, the plans first in a call (a few of the pool's tasks' plans fit) were kept and the
            later ones rebuilt, and two plans' ratio moved with their order in the call: 8.2% on
            average against 4.9% with none kept (16 validation tasks, 2026-12-04, docs/measurement.md).
    """

    def __init__(
        self,
        backend: str = "fbgemm",
        device: str = "cpu",
        comm_backend: str | None = "auto",
        protocol: MeasurementProtocol | dict | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        progress: bool = False,
        comm_timeout_s: float | None = None,
        step: str = "kernels",
        cluster: dict | None = None,
        max_cached_bytes: int = 0,
    ):
        if backend not in BACKENDS:
            raise InputError(f"unknown hardware backend {backend!r}; one of {list(BACKENDS)}")
        if comm_backend == "auto":
            comm_backend = "nccl" if str(device).startswith("cuda") else "gloo"
        if comm_backend not in ("gloo", "nccl", None):
            raise InputError(f"comm_backend must be 'gloo', 'nccl', 'auto' or None, got {comm_backend!r}")
        if batch_size is not None and batch_size < 1:
            raise InputError(f"batch_size must be positive, got {batch_size}")
        self.backend = backend
        self.device = device
        self.comm_backend = comm_backend
        if step not in ("kernels", "dmp"):
            raise InputError(f"hardware.step must be kernels or dmp, got {step!r}")
        if step == "dmp" and (str(device).startswith("cuda") or comm_backend != "gloo"):
            raise InputError("hardware.step=dmp measures on CPU with gloo here (device=cpu, comm_backend=gloo)")
        self.step = step
        if not isinstance(max_cached_bytes, int) or isinstance(max_cached_bytes, bool) or max_cached_bytes < 0:
            raise InputError(f"hardware.max_cached_bytes must be an integer >= 0, got {max_cached_bytes!r}")
        self.max_cached_bytes = max_cached_bytes
        self.cluster = dict(cluster or {"kind": "loopback"})
        if self.cluster.get("kind") not in ("loopback", "emulated"):
            raise InputError(f"hardware.cluster.kind must be loopback or emulated, got {self.cluster.get('kind')!r}")
        if self.cluster["kind"] == "emulated" and (step != "kernels" or comm_backend != "gloo"):
            raise InputError("the emulated cluster measures gloo all-to-alls (hardware.step=kernels, comm_backend=gloo)")
        #: per measuring call, the network its all-to-alls ran on
        self.network: list[dict] = []
        self.protocol = MeasurementProtocol.from_config(protocol)
        self.batch_size = batch_size
        self.seed = seed
        self.progress = progress
        self.comm_timeout_s = comm_timeout_s
        self.probe: "Probe | None" = None
        #: with the protocol's probe: the probe's kernels timed interleaved with each call's
        #: kernels (the machine's speed while they ran), one per `measure_many` call
        self.tracked: list["Probe"] = []

    @property
    def last_tracked(self) -> "Probe | None":
        """The probe tracked inside the last `measure_many` call (None: the protocol has no
        probe, or nothing was measured yet): the machine's speed while those plans ran."""
        return self.tracked[-1] if self.tracked else None

    def session_probe(self, refresh: bool = False) -> "Probe | None":
        """The speed probe of this measuring session: timed on first use (when the protocol
        asks for it), then reused; `refresh` times it again (a new session of a long run)."""
        if (self.probe is None or refresh) and self.protocol.probe:
            from embshard.hardware.probe import run_probe

            self.probe = run_probe(self.protocol, backend=self.backend, device=self.device,
                                   comm_backend=self.comm_backend)
        return self.probe

    def check_task(self, task: Task) -> None:
        """Raise InputError for a task this hardware cannot measure as it is (before planning)."""
        if self.backend == "torch" and self.step == "kernels":
            check_torch_optimizer(task.optimizer, task.name)
        if self.backend == "fbgemm" or self.step == "dmp":  # TorchRec's CPU tables are FBGEMM's kernel too
            check_fbgemm_optimizer(task.optimizer, self.device, task.name)
        if self.step == "dmp":
            self._check_dmp(task)
        free = memory_free_bytes(self.device)
        # every plan puts at least an even share of the tables' training memory on some device
        share = -(-task.tables_memory_bytes() // task.num_devices)
        if free is not None and share > free:
            raise InputError(
                f"measuring task {task.name!r} allocates at least {share} bytes for one device (its tables' training "
                f"memory over {task.num_devices} devices) and this machine has {free} bytes free on {self.device}: "
                "plan it without measuring (evaluate=estimated), or measure a task of smaller tables")

    @staticmethod
    def _check_dmp(task: Task) -> None:
        """What DMP's step on CPU cannot run, whatever the plan: ranks of unequal local batches
        (TorchRec trains every rank on the same one; a row_wise table's backward all-gather fails
        on 820 against 819 samples, a rank with no sample fails sooner), and TorchRec's row blocks
        that leave a rank an empty block (its CPU kernels raise)."""
        from embshard.search.constrained import fixed_kinds
        from embshard.search.pieces import row_splittable

        d = task.num_devices
        if task.batch_size % d:
            b = task.batch_size
            raise InputError(
                f"task {task.name!r}: TorchRec's DMP step gives every rank the same local batch, and batch {b} does not "
                f"split evenly over {d} ranks: give a multiple of {d} (e.g. {b - b % d or d}), or measure the kernels "
                "(hardware=fbgemm_cpu)")
        group = {"row_wise": d, "table_row_wise": task.devices_per_host}
        kinds = fixed_kinds(task)
        for t in task.tables:  # tables every plan lays out by TorchRec's row blocks
            ranks = group.get(kinds.get(t.name, ""), 1)
            if ranks > 1 and not row_splittable(t.rows, ranks):
                raise InputError(
                    f"task {task.name!r}: table {t.name!r} ({t.rows} row{'s' * (t.rows != 1)}) may only be "
                    f"{kinds[t.name]} (its sharding_types), and TorchRec's row blocks over {ranks} ranks leave some rank "
                    "an empty block, which its CPU kernels cannot run in DMP's step: measure the kernels "
                    "(hardware=fbgemm_cpu)")

    def check_fits(self, task: Task, plans: Sequence[Plan]) -> None:
        """Raise InputError, before anything is measured, when one device of a plan needs more
        memory than this machine has free (its kernel would fail to allocate mid-run)."""
        free = memory_free_bytes(self.device)
        if free is None:
            return
        for plan in plans:
            need = plan.memory_bytes(task)  # (an unknown table or device: the validator says so later)
            worst = max(range(task.num_devices), key=need.__getitem__)
            if need[worst] > free:
                raise InputError(
                    f"plan {plan.algorithm!r} of task {task.name!r} puts {need[worst]} bytes on device {worst} and this "
                    f"machine has {free} bytes free on {self.device} to measure it: plan it without measuring "
                    "(evaluate=estimated), or measure a task of smaller tables")

    # ------------------------------------------------------------------ CostModel
    def device_costs(self, task: Task, plan: Plan) -> DeviceCosts:
        return self.measure_many(task, [plan])[0]

    # ------------------------------------------------------------------ batches of plans
    def measure_many(self, task: Task, plans: Sequence[Plan], visits: int | None = None) -> list[DeviceCosts]:
        """Measure every plan of `task`, interleaved; one DeviceCosts per plan, in order.

        `visits` overrides the protocol's number of interleaved visits for this call."""
        plans = list(plans)
        if not plans:
            return []
        protocol = self.protocol if visits is None else self.protocol.replace(visits=int(visits))
        self.check_fits(task, plans)
        if self.step == "dmp":
            return self._measure_dmp(task, plans, protocol)
        d = task.num_devices
        batch = self.batch_size or task.batch_size
        tables = task.table_by_name
        shard_sets: list[list[ShardInput]] = []
        for plan in plans:
            validate(task, plan)  # never measure a plan that breaks a rule
            partial = plan.partly_replicated_pooled(d, tables)
            if partial:  # a pooled copy on some devices only: no sharding type says whose samples it serves
                raise InputError(
                    f"plan {plan.algorithm!r} copies pooled table(s) {partial[:3]} onto some devices but not all, which "
                    "the kernel measurement does not model (data_parallel puts a copy on every device); measure it as "
                    "TorchRec's DMP step: hardware=dmp_cpu")
            # a copy serves its share of the samples (a data-parallel table's on every device: each its
            # own rank's samples; its gradient all-reduce is timed with the backward all-to-all)
            copies = Counter(s.rectangle for s in plan.shards)
            shard_sets.extend([ShardInput(tables[s.table], s, copies[s.rectangle]) for s in on] for on in plan.by_device(d))

        kw = dict(backend=self.backend, device=self.device, optimizer=task.optimizer, protocol=protocol, seed=self.seed,
                  progress=self.progress, max_cached_bytes=self.max_cached_bytes)
        if protocol.probe:
            from embshard.hardware.probe import measure_compute_with_probe

            compute, tracked = measure_compute_with_probe(shard_sets, batch, session=self.probe, **kw)
            self.tracked.append(tracked)
        else:
            compute = measure_compute(shard_sets, batch, **kw)
        per_plan: list[list[Timing]] = [compute[i * d : (i + 1) * d] for i in range(len(plans))]

        if self.comm_backend is None or d == 1:
            comm = [CommResult.zero(d, protocol.comm_repetitions) for _ in plans]
        else:
            configs = []
            for plan, timings in zip(plans, per_plan):
                c = [t.median_ms for t in timings]
                lo = min(c)
                configs.append(CommConfig.make(plan.device_widths(d, tables), [x - lo for x in c],
                                               plan.data_parallel_floats(d, tables)))
            with self._network(task) as cluster:
                comm = measure_comm(
                    configs,
                    batch,
                    protocol=protocol,
                    backend=self.comm_backend,
                    timeout_s=self.comm_timeout_s,
                    progress=self.progress,
                    cluster=cluster,
                    devices_per_host=task.devices_per_host,
                )
        return [_costs(t, c) for t, c in zip(per_plan, comm)]


    @contextlib.contextmanager
    def _network(self, task: Task):
        """The emulated cluster for `task`'s all-to-alls (None: loopback), torn down after."""
        from embshard.hardware.cluster import (ClusterUnavailable, EmulatedCluster, LinkShape, auto_rate_mbit,
                                               intra_host_mbit, teardown_on_signals)

        c = self.cluster
        if c["kind"] != "emulated":
            self.network.append({"kind": "loopback"})
            yield None
            return
        if task.hosts != 2:
            raise InputError(f"hardware.cluster=emulated joins two hosts; task {task.name!r} has {task.hosts}")
        rate = c.get("rate_mbit", "auto")
        cluster = EmulatedCluster(LinkShape(1000.0 if rate == "auto" else float(rate), float(c.get("latency_us", 0.0))))
        with teardown_on_signals():
            try:
                cluster.up()
                info: dict = {"kind": "emulated"}
                if rate == "auto":
                    if task.devices_per_host < 2:
                        raise InputError("hardware.cluster.rate_mbit=auto scales from the intra-host link, which "
                                         "needs 2+ devices per host; set a rate")
                    intra = intra_host_mbit(cluster, task.devices_per_host)
                    cluster.set_rate(auto_rate_mbit(intra, task.intra_host_gbps, task.inter_host_gbps,
                                                    task.devices_per_host))
                    info["intra_host_mbit_per_device"] = intra
            except ClusterUnavailable as e:
                cluster.down()
                if c.get("on_unavailable", "loopback") == "error":
                    raise
                print(f"error: {e}; measuring on loopback instead (every link the same speed)", file=sys.stderr)
                self.network.append({"kind": "loopback", "reason": str(e)})
                yield None
                return
            except BaseException:
                cluster.down()
                raise
            try:
                self.network.append({**info, **cluster.describe()})
                yield cluster
            finally:
                cluster.down()

    def _measure_dmp(self, task: Task, plans: list[Plan], protocol: MeasurementProtocol) -> list[DeviceCosts]:
        from embshard.hardware.dmp_step import measure_dmp_steps

        if self.batch_size is not None and self.batch_size != task.batch_size:
            task = dataclasses.replace(task, batch_size=int(self.batch_size))
        steps = measure_dmp_steps(task, plans, protocol, seed=self.seed, progress=self.progress)
        zero = [0.0] * task.num_devices
        return [DeviceCosts(compute_ms=[f + b for f, b in zip(s.forward_ms, s.backward_ms)], forward_comm_ms=list(zero),
                            backward_comm_ms=list(zero), input_dist_ms=list(s.input_dist_ms),
                            plan_cost_samples_ms=list(s.step_samples_ms), source="dmp_step") for s in steps]


def _costs(compute: Sequence[Timing], comm: CommResult) -> DeviceCosts:
    d = len(compute)
    # Plan cost per repetition: pair the i-th compute sample with the i-th comm samples.
    n = min([len(t.samples_ms) for t in compute] + [len(x) for x in comm.forward_samples_ms + comm.backward_samples_ms])
    spread = None
    per_rep: list[float] = []
    if n > 0:
        per_rep = [
            max(compute[k].samples_ms[i] + comm.forward_samples_ms[k][i] + comm.backward_samples_ms[k][i] for k in range(d))
            for i in range(n)
        ]
        spread = Timing.of(per_rep).spread_ms
    return DeviceCosts(
        compute_ms=[t.median_ms for t in compute],
        forward_comm_ms=list(comm.forward_ms),
        backward_comm_ms=list(comm.backward_ms),
        compute_spread_ms=[t.spread_ms for t in compute],
        forward_comm_spread_ms=list(comm.forward_spread_ms),
        backward_comm_spread_ms=list(comm.backward_spread_ms),
        plan_cost_spread_ms=spread,
        plan_cost_samples_ms=[float(x) for x in per_rep],
    )


def memory_free_bytes(device: str | torch.device) -> int | None:
    """Bytes a measurement can still allocate on `device`: the host's MemAvailable for cpu, the
    GPU's free memory for cuda once this process uses CUDA (never initialised here: measuring
    processes forked later could not use it); None when it cannot be read."""
    dev = torch.device(device)
    try:
        if dev.type == "cuda":
            return int(torch.cuda.mem_get_info(dev)[0]) if torch.cuda.is_initialized() else None
        if dev.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None
    return None
