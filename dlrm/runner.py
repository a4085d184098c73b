"""Distributed DLRM training under sharding plans: Lightning Fabric around TorchRec's DMP.

Why Fabric and not the Lightning Trainer: TorchRec's DistributedModelParallel does its
own distribution — it shards the EmbeddingBagCollection by the plan, wraps the dense part
in DDP itself, and fuses the embedding optimizer into backward — so the Trainer's
strategies (which wrap the whole LightningModule in DDP or FSDP) would double-wrap it.
A throughput run also needs several sharded copies of the model alive in one process
group, stepped in an interleaved order we control, which is a custom loop by nature.
Fabric gives exactly the parts we want and nothing that fights DMP: it reads the
torchrun/SLURM environment, starts the process group (gloo on CPU, NCCL on GPUs), picks
each rank's device, and provides barrier / broadcast / all_gather and rank-zero helpers.
Metrics go to Lightning's CSVLogger and WandbLogger (offline by default) on rank 0.

Launch: `torchrun --nproc_per_node N train.py stage=dlrm ...` (see train.py).
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from embshard.errors import InputError
from embshard.hardware.protocol import MeasurementProtocol
from embshard.plan import Plan
from embshard.task import Task

from dlrm.model import EBC_PATH, ModelConfig, build_model

log = logging.getLogger("dlrm")


# ----------------------------------------------------------------------------- ranks
@dataclass(frozen=True)
class Ranks:
    """This process's place in the run, from torchrun's environment (1 process without it)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @classmethod
    def from_env(cls) -> "Ranks":
        from embshard.costs.collect import env_int, rank_info  # the one reader of torchrun's environment

        rank, world, local_rank = rank_info()
        return cls(rank, local_rank, world, env_int("LOCAL_WORLD_SIZE", world))


def pick_accelerator(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise InputError(f"dlrm.accelerator must be cpu, cuda or auto, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("dlrm.accelerator=cuda but torch sees no GPU")
    return name


# ----------------------------------------------------------------------------- session
class Session:
    """Fabric launched for this run: process group, device, shared run dir, rank-0 loggers."""

    def __init__(self, ranks: Ranks, accelerator: str, backend: str | None, timeout_s: float,
                 protocol: "MeasurementProtocol | None" = None):
        """`protocol`: the measurement protocol's process settings for this rank (local rank k
        pinned to its cores of the allowed set, its thread count, its allocator), as every
        measuring process; None: unpinned, cores / local processes threads on CPU."""
        from lightning_fabric import Fabric
        from lightning_fabric.strategies import DDPStrategy

        from embshard.hardware.protocol import allowed_cores, set_worker_process

        self.ranks = ranks
        self.accelerator = accelerator
        self.backend = backend or ("nccl" if accelerator == "cuda" else "gloo")
        self.process = None
        if protocol is not None:
            self.process = set_worker_process(protocol, ranks.local_rank, allowed_cores())  # same order on every rank
        elif accelerator == "cpu":
            cores = os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // max(1, ranks.local_world_size)))
        self.fabric = Fabric(
            accelerator=accelerator,
            devices=ranks.local_world_size,
            num_nodes=max(1, ranks.world_size // ranks.local_world_size),
            strategy=DDPStrategy(process_group_backend=self.backend, timeout=timedelta(seconds=timeout_s)),
        )
        self.fabric.launch()
        # deprecation notices raised inside TorchRec's DMP on every rank, not actionable here
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.* is deprecated")
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")
        self.device = self.fabric.device
        self.loggers: list = []

    @property
    def is_rank_zero(self) -> bool:
        return self.fabric.global_rank == 0

    def shared_dir(self, out_dir: str | None, default_root: Path) -> Path:
        """The run directory every rank agrees on (rank 0's choice, broadcast)."""
        mine = str(out_dir) if out_dir else str(default_root / datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
        return Path(self.fabric.broadcast(mine, src=0))

    def check_same(self, what: str, value: str) -> None:
        """Raise on every rank unless all ranks hold the same `value` (e.g. plan fingerprints)."""
        values = self.all_gather_object(value)
        if len(set(values)) != 1:
            raise InputError(f"ranks disagree on {what}: {values}")

    def all_gather_object(self, obj: Any) -> list:
        import torch.distributed as dist

        out: list = [None] * self.ranks.world_size
        dist.all_gather_object(out, obj)
        return out

    def mean(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        return float(self.fabric.all_reduce(t, reduce_op="mean").item())

    def sync(self) -> None:
        if self.accelerator == "cuda":
            torch.cuda.synchronize(self.device)

    # -- rank-0 logging
    def open_loggers(self, out_dir: Path, wandb_cfg: Mapping[str, Any], config: Mapping[str, Any], name: str) -> None:
        if not self.is_rank_zero:
            return
        from pytorch_lightning.loggers import CSVLogger

        self.loggers = [CSVLogger(save_dir=str(out_dir), name="logs", version="")]  # logs/metrics.csv, hparams.yaml
        if wandb_cfg.get("enabled", True):
            from pytorch_lightning.loggers import WandbLogger

            os.environ.setdefault("WANDB_MODE", wandb_cfg.get("mode", "offline"))
            os.environ.setdefault("WANDB_SILENT", "true")
            wb = WandbLogger(
                project=wandb_cfg.get("project", "embshard"),
                name=name,
                save_dir=str(out_dir),
                offline=os.environ["WANDB_MODE"] == "offline",
                config=dict(config),
            )
            self.loggers.append(wb)
        for lg in self.loggers:
            lg.log_hyperparams(dict(config))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(dict(metrics), step=step)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("success" if exc_type is None else "failed")

    def close(self, status: str = "success") -> None:
        import torch.distributed as dist

        for lg in self.loggers:
            lg.finalize(status)
            if type(lg).__name__ == "WandbLogger":
                import wandb

                wandb.finish(exit_code=0 if status == "success" else 1)
        self.loggers = []
        if dist.is_available() and dist.is_initialized():
            # the caller has dropped its sharded models by now (the stages `del` them inside the
            # `with`); collect their cycles so the DDP reducer's and the sharded modules' last
            # references to the process group go while it exists, and destroy_process_group
            # below joins gloo's threads instead of the interpreter's exit killing them
            gc.collect()
            # every rank done with its collectives before any tears gloo down: a rank exiting
            # while a peer's gloo threads still talk to it aborts ("terminate called without an
            # active exception", exit -6). After a failure the peers may never arrive: no barrier.
            if status == "success":
                dist.barrier()
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- model
class LookupTimer:
    """Wall time this rank spends in its embedding lookups' forward (FBGEMM's fused kernel
    over the local shards), summed until `take()`. Per-rank step times are all alike, since
    ranks meet in the all-to-all every step; this shows which rank does the work. CPU only:
    kernels run synchronously there (shard_model attaches none on GPUs).
    """

    def __init__(self, dmp: torch.nn.Module) -> None:
        self.total = 0.0
        self._start = 0.0
        ebc = dmp.module.model.sparse_arch.embedding_bag_collection
        for lookup in getattr(ebc, "_lookups", []):
            lookup.register_forward_pre_hook(self._pre)
            lookup.register_forward_hook(self._post)

    def _pre(self, module, args) -> None:
        self._start = time.perf_counter()

    def _post(self, module, args, output) -> None:
        self.total += time.perf_counter() - self._start

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total


@dataclass
class ShardedDLRM:
    """One DLRM sharded by one plan, with its dense optimizer (embeddings update in backward)."""

    label: str
    model: torch.nn.Module
    dense_optimizer: torch.optim.Optimizer
    device: torch.device
    pipeline: Any = None
    lookup_timer: LookupTimer | None = None

    def use_pipeline(self) -> None:
        """Step through TorchRec's TrainPipelineSparseDist: the next batch's copy to the
        device and its input all-to-all overlap the current step (CUDA streams on GPUs)."""
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        self.pipeline = TrainPipelineSparseDist(self.model, self.dense_optimizer, self.device, execute_all_batches=True)

    def step(self, batches: Iterator) -> torch.Tensor:
        """One training step on the next batch of `batches` (host or device tensors):
        forward, backward (embedding update fused in), dense optimizer step.

        Raises StopIteration when `batches` is exhausted.
        """
        if self.pipeline is not None:
            loss = self.pipeline.progress(batches)[0]
            return loss.detach()
        batch = next(batches).to(self.device, non_blocking=True)
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss, _ = self.model(batch)
        loss.backward()
        self.dense_optimizer.step()
        return loss.detach()


def shard_model(
    task: Task,
    plan: Plan,
    label: str,
    model_cfg: ModelConfig,
    session: Session,
    embedding_lr: float,
    dense_optimizer: Callable[..., torch.optim.Optimizer],
    seed: int,
    pipeline: str = "none",
) -> ShardedDLRM:
    """Build the task's DLRM (dense weights from `seed`, the same on every rank and for every
    plan) and wrap it in DistributedModelParallel under `plan`."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from embshard.search.torchrec_planner import fused_optimizer_class
    from embshard.torchrec_bridge import plan_to_torchrec

    torch.manual_seed(seed)
    module = build_model(task, model_cfg, dense_device=session.device, ebc_device="meta")
    # the task's optimizer (validated by Task), fused into FBGEMM's backward by the sharder
    ebc_params = module.model.sparse_arch.embedding_bag_collection.parameters()
    apply_optimizer_in_backward(fused_optimizer_class(task.optimizer), ebc_params, {"lr": embedding_lr})
    sharding_plan = plan_to_torchrec(
        task, plan, world_size=session.ranks.world_size, device_type=session.device.type,
        module_path=EBC_PATH, local_world_size=session.ranks.local_world_size,
    )
    dmp = DistributedModelParallel(
        module=module, device=session.device, plan=sharding_plan, sharders=[EmbeddingBagCollectionSharder()],
    )
    dense_params = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    sharded = ShardedDLRM(label, dmp, dense_optimizer(params=dense_params), session.device,
                          lookup_timer=LookupTimer(dmp) if session.device.type == "cpu" else None)
    if pipeline == "sparse_dist":
        sharded.use_pipeline()
    elif pipeline != "none":
        raise InputError(f"dlrm.pipeline must be none or sparse_dist, got {pipeline!r}")
    return sharded


# ----------------------------------------------------------------------------- data
def make_batches(cfg: Mapping[str, Any], task: Task, local_batch: int, dense_in: int, ranks: Ranks, seed: int):
    """This rank's batch stream: trace replay (default) or Criteo TSV files."""
    kind = cfg.get("data", "trace")
    if kind == "trace":
        from dlrm.data import TraceReplayBatches

        return TraceReplayBatches(task, local_batch, dense_in, rank=ranks.rank, seed=seed)
    if kind == "criteo":
        from dlrm.criteo import CriteoTSVBatches

        files = list(cfg.get("criteo_files") or [])
        if not files:
            raise InputError("dlrm.data=criteo needs dlrm.criteo_files=[day_0.tsv, ...]")
        return _epochs(CriteoTSVBatches(
            files, [t.name for t in task.tables], [t.rows for t in task.tables], local_batch,
            rank=ranks.rank, world_size=ranks.world_size, dense_in_features=dense_in,
        ))
    raise InputError(f"dlrm.data must be trace or criteo, got {kind!r}")


def _epochs(batches) -> Iterator:
    """Pass over `batches` again and again (training runs are counted in steps, not epochs)."""
    while True:
        empty = True
        for batch in batches:
            empty = False
            yield batch
        if empty:
            return


def local_batch_size(task: Task, world_size: int) -> int:
    if task.batch_size % world_size:
        raise InputError(
            f"task {task.name!r}: batch size {task.batch_size} does not split evenly over {world_size} ranks"
        )
    return task.batch_size // world_size


# ----------------------------------------------------------------------------- loops
def train(session: Session, sharded: ShardedDLRM, batches, steps: int, log_every: int, global_batch: int,
          progress: bool = True) -> dict[str, Any]:
    """Train for `steps` steps; rank 0 logs the rank-averaged loss every `log_every` steps.

    Returns the loss curve (step, mean loss over the window and ranks) and samples/s.
    """
    from tqdm import tqdm

    curve: list[tuple[int, float]] = []
    window: list[float] = []
    it: Iterator = iter(batches)
    bar = tqdm(total=steps, desc=f"train [{sharded.label}]", disable=not (progress and session.is_rank_zero))
    start = time.perf_counter()
    window_start, window_steps = start, 0
    for step in range(1, steps + 1):
        try:
            loss = sharded.step(it)
        except StopIteration:
            raise InputError(f"the data ran out after {step - 1} of {steps} steps") from None
        window.append(float(loss))
        window_steps += 1
        bar.update(1)
        if step % log_every == 0 or step == steps:
            session.sync()
            now = time.perf_counter()
            loss = session.mean(sum(window) / len(window))
            rate = global_batch * window_steps / (now - window_start)
            curve.append((step, loss))
            session.log({"train/loss": loss, "train/samples_per_s": rate}, step=step)
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}")
            window, window_start, window_steps = [], now, 0
    bar.close()
    elapsed = time.perf_counter() - start
    return {"loss_curve": curve, "steps": steps, "seconds": elapsed, "samples_per_s": global_batch * steps / elapsed}


def interleaved_throughput(
    session: Session,
    models: Mapping[str, ShardedDLRM],
    batches: list,
    warmup_steps: int,
    rounds: int,
    steps_per_round: int,
    global_batch: int,
    progress: bool = True,
) -> tuple[list[dict], dict[str, list[float]]]:
    """Time every model in `rounds` rounds of `steps_per_round` steps after warm-up.

    The order rotates each round (round r starts at plan r mod P), so no plan always runs
    first or after the same neighbour. Every rank times each of its steps (synchronised
    on GPUs); ranks meet at a barrier before each plan's block, and the step times are
    gathered after it, outside the timed region. All models see the same cached batches.

    Returns:
        records [{"round", "plan", "rank_step_seconds": [[s per step] per rank],
        "rank_lookup_forward_seconds": [s in the block per rank, or None off CPU]}] and the
        rank-averaged loss of each timed block per plan.
    """
    from tqdm import tqdm

    labels = list(models)
    streams = {label: itertools.cycle(batches) for label in labels}  # the same batches, in the same order

    def lookup_seconds(label: str) -> float | None:
        timer = models[label].lookup_timer
        return timer.take() if timer is not None else None

    for label in labels:
        for _ in range(warmup_steps):
            models[label].step(streams[label])
        lookup_seconds(label)
    session.sync()

    records, losses = [], {label: [] for label in labels}
    total = rounds * len(labels)
    bar = tqdm(total=total, desc="throughput rounds", disable=not (progress and session.is_rank_zero))
    for r in range(rounds):
        order = labels[r % len(labels):] + labels[: r % len(labels)]
        for label in order:
            session.fabric.barrier()
            times, block_loss = [], 0.0
            for _ in range(steps_per_round):
                t0 = time.perf_counter()
                loss = models[label].step(streams[label])
                session.sync()
                times.append(time.perf_counter() - t0)
                block_loss += float(loss)
            gathered, lookups = zip(*session.all_gather_object((times, lookup_seconds(label))))
            gathered = list(gathered)
            records.append({"round": r, "plan": label, "rank_step_seconds": gathered,
                            "rank_lookup_forward_seconds": list(lookups)})
            losses[label].append(session.mean(block_loss / steps_per_round))
            block_rate = global_batch * steps_per_round / max(sum(ts) for ts in gathered)
            session.log({f"throughput/{label}/samples_per_s": block_rate, f"throughput/{label}/loss": losses[label][-1]},
                        step=len(records))
            bar.update(1)
    bar.close()
    return records, losses
