"""What the training step pays for embeddings, measured on TorchRec's own sharded module.

The kernel-and-all-to-all measurement (`hardware.compute`, `hardware.comm`) times the fused
embedding kernel of each device and the all-to-all of pooled embeddings. A training step under
TorchRec's DistributedModelParallel pays more, and differently per sharding type: the
all-to-all of the input ids (`input_dist`: a KeyedJaggedTensor split by feature, and for
row-wise tables bucketized by row block first, every id sent to the rank that holds its row),
the lookups, the output distribution (an all-to-all of pooled embeddings; a reduce-scatter of
full-width partial sums for row-wise tables), and the backward of all of it with the fused
optimizer update.

`measure_dmp_steps` times exactly that. D gloo processes (D = the task's devices) each wrap
the task's collections in DistributedModelParallel once per plan: an EmbeddingBagCollection of
its pooled tables and, for its sequence tables, an EmbeddingCollection per width (one vector per
id; `torchrec_bridge.task_to_collections`), with TorchRec's EmbeddingBagCollectionSharder and
EmbeddingCollectionSharder and the task's optimizer fused into backward; then, under the
measurement protocol (pinned ranks, one thread, caching allocator), visit the plans in
interleaved order; each timed step starts from a barrier and records, per rank:

* `input_dist_ms`: the sharded modules' `input_dist(...)` until their ids have arrived;
* `forward_ms`: `compute_and_output_dist(...)` until the embeddings are ready (lookups, output
  all-to-all or reduce-scatter, and waiting for the slowest rank);
* `backward_ms`: one backward from all the embeddings (output distributions' backward, the
  kernels' backward, the fused update).

Every rank feeds its own share of the global batch (ids drawn per table from seeds fixed per
rank and repetition, so plans and sessions see the same ids). The step cost of a plan is, per
repetition, the slowest rank's sum (ranks meet in every all-to-all), then the protocol's
statistic over repetitions.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from embshard.errors import PlanError
from embshard.hardware.protocol import MeasurementProtocol, Timing, allowed_cores
from embshard.hardware.spawn import run_ranks
from embshard.plan import Plan
from embshard.task import Task

PHASES = ("input_dist", "forward", "backward")


@dataclass
class DmpStep:
    """One plan's DMP embedding step: per rank and phase, the protocol's statistic (ms), and
    the plan's step cost (per repetition the slowest rank's total; then the statistic)."""

    input_dist_ms: list[float]
    forward_ms: list[float]
    backward_ms: list[float]
    step_ms: float
    step_noise: float
    step_samples_ms: list[float] = field(default_factory=list)
    #: per rank, its total of the phases in each repetition (visit-major, as `step_samples_ms`)
    rank_samples_ms: list[list[float]] = field(default_factory=list)

    @property
    def rank_total_ms(self) -> list[float]:
        return [a + b + c for a, b, c in zip(self.input_dist_ms, self.forward_ms, self.backward_ms)]


def measure_dmp_steps(task: Task, plans: Sequence[Plan], protocol: MeasurementProtocol | None = None,
                      seed: int = 0, timeout_s: float | None = None, progress: bool = False,
                      cores: Sequence[int] | None = None) -> list[DmpStep]:
    """Time every plan's embedding step on DistributedModelParallel, interleaved (module docstring).

    Raises:
        RuntimeError: a rank failed (its traceback in the message); TimeoutError.
    """
    protocol = protocol or MeasurementProtocol()
    plans = list(plans)
    if not plans:
        return []
    from embshard.plan import validate
    from embshard.torchrec_bridge import collections_plan, task_to_collections

    tables = task.table_by_name
    for p in plans:
        validate(task, p)
        copied = sorted({s.table for s in p.shards if s.replica and tables[s.table].is_sequence})
        if copied:  # TorchRec 1.8's data-parallel EmbeddingCollection on CPU splits its outputs wrongly and fails
            raise PlanError(f"plan {p.algorithm!r} replicates sequence table(s) {copied[:3]}, which TorchRec's "
                            "EmbeddingCollection cannot run data-parallel in DMP's CPU step here (its output "
                            "split fails): measure the kernels (hardware=fbgemm_cpu) or leave the plan out")
        # a plan TorchRec cannot train fails here, in one line
        collections_plan(task, p, task_to_collections(task, device="meta"), world_size=task.num_devices)
    d = task.num_devices
    cores = list(cores) if cores is not None else allowed_cores(idlest_first=True)
    if timeout_s is None:
        timeout_s = 300.0 + 60.0 * len(plans) * protocol.visits * max(1.0, d / max(1, len(cores)))
    task_dict, plan_dicts = task.to_dict(), [pl.to_dict() for pl in plans]
    per_rank = run_ranks(_worker, d, lambda rank, store, results: (
        rank, d, store, task_dict, plan_dicts, protocol.to_dict(), cores, seed, results, progress, float(timeout_s)),
        timeout_s, "DMP step")

    out = []
    for k in range(len(plans)):
        # samples[rank][phase][visit][rep]
        phases = {ph: [protocol.summarize(per_rank[r][k][i], seed=r) for r in range(d)] for i, ph in enumerate(PHASES)}
        n_visits = len(per_rank[0][k][0])
        per_visit, totals = [], [[] for _ in range(d)]
        for v in range(n_visits):
            reps = len(per_rank[0][k][0][v])
            rank_reps = [[sum(per_rank[r][k][i][v][j] for i in range(len(PHASES))) for j in range(reps)]
                         for r in range(d)]
            for r in range(d):
                totals[r] += rank_reps[r]
            per_visit.append([max(rank_reps[r][j] for r in range(d)) for j in range(reps)])
        step: Timing = protocol.summarize(per_visit)
        out.append(DmpStep([t.median_ms for t in phases["input_dist"]], [t.median_ms for t in phases["forward"]],
                           [t.median_ms for t in phases["backward"]], step.median_ms, step.noise,
                           list(step.samples_ms), totals))
    return out


def local_batch(task: Task, rank: int, world: int, rng: np.random.Generator, tables: Sequence[str] | None = None):
    """This rank's KeyedJaggedTensor: its share of the global batch, ids of every table (of
    `tables` only, in the task's order, when given)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard.data.indices import batch_indices
    from embshard.hardware.comm import batch_split

    b = batch_split(task.batch_size, world)[rank]
    keep = [t for t in task.tables if tables is None or t.name in set(tables)]
    lengths, values = [], []
    for t in keep:
        idx, off = batch_indices(t, b, rng)
        lengths.append(off[1:] - off[:-1])
        values.append(idx)
    return KeyedJaggedTensor.from_lengths_sync(keys=[t.name for t in keep], values=torch.cat(values),
                                               lengths=torch.cat(lengths).to(torch.int64))


def local_world_size(task_dict: dict, world: int) -> int:
    """The ranks per host TorchRec shards by (its LOCAL_WORLD_SIZE): the task's devices per host,
    as `plan_to_torchrec` lays the plan out, not every rank on one host (table_row_wise blocks
    over 2 ranks read with 4 on a host were an IndexError inside DMP), and not whatever the
    caller's environment says (torchrun sets it for its own ranks)."""
    return int(task_dict.get("devices_per_host") or world)


def _worker(rank, world, store_path, task_dict, plan_dicts, protocol_dict, cores, seed, results, progress,
            timeout_s) -> None:
    try:
        import datetime

        import torch.distributed as dist

        from embshard.hardware.protocol import set_worker_process

        protocol = MeasurementProtocol.from_config(protocol_dict)
        set_worker_process(protocol, rank, cores, threads=protocol.threads or 1)
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size(task_dict, world))
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # no barrier after an error: the other ranks may be inside a collective this rank will
        # never join, so it would wait for them forever (it did, until the parent's timeout); the
        # error goes to the parent at once, which stops every rank
        out = _measure(rank, world, Task.from_dict(task_dict), [Plan.from_dict(p) for p in plan_dicts], protocol,
                       seed, progress)
        dist.barrier()
        dist.destroy_process_group()
        results.put(("ok", rank, out))
    except BaseException:  # noqa: BLE001 - report everything to the parent, then die
        results.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1)


def _measure(rank: int, world: int, task: Task, plans: list[Plan], protocol: MeasurementProtocol, seed: int,
             progress: bool) -> list:
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from embshard.search.torchrec_planner import fused_optimizer_class
    from embshard.torchrec_bridge import collections_plan, task_to_collections

    # one model per plan: the task's collections (an EmbeddingBagCollection of its pooled tables,
    # an EmbeddingCollection per width of its sequence tables) under one module, as a model holds them
    models = []  # per plan: [(sharded collection, its tables)]
    for plan in plans:
        parts = task_to_collections(task, device="meta")
        holder = torch.nn.Module()
        for name, module in parts.items():
            holder.add_module(name, module)
        apply_optimizer_in_backward(fused_optimizer_class(task.optimizer), holder.parameters(), {"lr": 0.01})
        dmp = DistributedModelParallel(module=holder, device=torch.device("cpu"),
                                       plan=collections_plan(task, plan, parts, world_size=world, device_type="cpu"),
                                       sharders=[EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])
        models.append([(getattr(dmp.module, name), _names(module)) for name, module in parts.items()])
    n_batches = protocol.warmups + protocol.repetitions
    # per batch, one KeyedJaggedTensor per collection (drawn from one generator, table by table)
    batches = []
    for j in range(n_batches):
        rng = np.random.default_rng([seed, rank, j])
        batches.append([local_batch(task, rank, world, rng, names) for _, names in models[0]])
    grads: dict[tuple, torch.Tensor] = {}
    samples = [[[] for _ in PHASES] for _ in plans]  # [plan][phase][visit][rep]
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=protocol.visits * len(plans), desc=f"DMP steps x{world}", leave=False)

    def step(collections, kjts) -> tuple[float, float, float]:
        """One step of every collection: their input dists, then their lookups and output
        dists, then one backward through all their outputs."""
        dist.barrier()
        t0 = time.perf_counter()
        ctxs = [sm.create_context() for sm, _ in collections]
        inputs = [sm.input_dist(ctx, kjt).wait().wait() for (sm, _), ctx, kjt in zip(collections, ctxs, kjts)]
        t1 = time.perf_counter()
        values = []
        for (sm, _), ctx, x in zip(collections, ctxs, inputs):
            out = sm.compute_and_output_dist(ctx, x)
            out = out.wait() if hasattr(out, "wait") else out
            # pooled: a KeyedTensor; sequence: {feature: JaggedTensor}, one vector per id
            values += [out.values()] if hasattr(out, "values") and not isinstance(out, dict) else \
                [jt.values() for jt in out.values()]
        t2 = time.perf_counter()
        gs = []
        for i, v in enumerate(values):
            g = grads.get((i, v.shape))
            if g is None:
                g = grads[(i, v.shape)] = torch.full_like(v, 1e-3)
            gs.append(g)
        torch.autograd.backward(values, gs)
        t3 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3

    for v in range(protocol.visits):
        for k, collections in enumerate(models):
            for b in batches[: protocol.warmups]:
                step(collections, b)
            timed = [step(collections, b) for b in batches[protocol.warmups:]]
            for i in range(len(PHASES)):
                samples[k][i].append([t[i] for t in timed])
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return samples


def _names(module) -> list[str]:
    """The table names of a TorchRec collection (EmbeddingBagCollection or EmbeddingCollection)."""
    configs = module.embedding_bag_configs() if hasattr(module, "embedding_bag_configs") else module.embedding_configs()
    return [c.name for c in configs]
