"""One rank of the DistributedModelParallel checks in test_torchrec_bridge.py.

Usage: python _dmp_worker.py RANK WORLD_SIZE PORT TASK_JSON PLAN_JSON OUT_DIR [LOCAL_WORLD_SIZE]

Builds the unsharded EmbeddingBagCollection for the task from a fixed seed (the reference),
shards a second copy with DistributedModelParallel (gloo, CPU, fused FBGEMM kernel, the
task's optimizer fused into backward as training does: SGD at lr 0.1 here) under
`plan_to_torchrec(plan)`, copies the reference weights into the local shards, runs the
same rank-specific KeyedJaggedTensor batch through both, and saves both pooled outputs to
OUT_DIR/rank{RANK}.pt for the test to compare.

Then one training step: each rank back-propagates a rank-specific output gradient through
the sharded model (the fused update runs in backward); the reference takes every rank's batch
and gradient through plain autograd (averaged over the ranks, as TorchRec does) and one SGD
step by hand (w - lr x grad). Each rank saves
its updated shards beside the reference's rows and columns of them. LOCAL_WORLD_SIZE (ranks per
host, default WORLD_SIZE) makes several emulated hosts: table-row-wise shards then use the
intra-host process groups.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


LR = 0.1


def main(rank: int, world_size: int, port: int, task_path: str, plan_path: str, out_dir: str,
         local_world_size: int | None = None) -> None:
    local = local_world_size or world_size
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank % local), LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local))
    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    run(rank, world_size, task_path, plan_path, out_dir)
    dist.barrier()  # every rank done before gloo is torn down (tests/_flexshard_worker.py says why)
    dist.destroy_process_group()


def run(rank: int, world_size: int, task_path: str, plan_path: str, out_dir: str) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard.plan import Plan
    from embshard.task import Task
    from embshard.torchrec_bridge import plan_to_torchrec, task_to_ebc

    task, plan = Task.load(task_path), Plan.load(plan_path)
    torch.manual_seed(0)
    reference = task_to_ebc(task, device="cpu")
    with torch.no_grad():
        for p in reference.parameters():
            p.uniform_(-1.0, 1.0)
    full = {k: v.detach().clone() for k, v in reference.state_dict().items()}

    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from embshard.search.torchrec_planner import fused_optimizer_class

    sharding_plan = plan_to_torchrec(task, plan, world_size=world_size, device_type="cpu")
    meta = task_to_ebc(task, device="meta")
    apply_optimizer_in_backward(fused_optimizer_class(task.optimizer), meta.parameters(), {"lr": LR})
    model = DistributedModelParallel(
        module=meta,
        device=torch.device("cpu"),
        plan=sharding_plan,
        sharders=[EmbeddingBagCollectionSharder()],
    )
    # Copy the reference weights into this rank's shards (views into the fused TBE weights).
    copied = 0
    with torch.no_grad():
        for key, value in model.state_dict().items():
            name = key[len("module."):] if key.startswith("module.") else key
            if name not in full:
                continue
            src = full[name]
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(src[r0:r0 + nr, c0:c0 + nc])
                    copied += nr * nc
            else:
                value.copy_(src)
                copied += value.numel()

    batch = 5

    def rank_batch(r: int) -> KeyedJaggedTensor:
        g = torch.Generator().manual_seed(100 + r)
        lengths, values = [], []
        for t in task.tables:
            ls = torch.randint(0, 4, (batch,), generator=g)
            lengths.append(ls)
            values.append(torch.randint(0, t.rows, (int(ls.sum()),), generator=g))
        return KeyedJaggedTensor.from_lengths_sync(
            keys=[t.name for t in task.tables], values=torch.cat(values), lengths=torch.cat(lengths)
        )

    def rank_grad(r: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(200 + r)
        return {t.name: torch.randn(batch, t.dim, generator=g) for t in task.tables}

    def weighted(pooled, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        # by table name: the sharded output may order its tables otherwise than the reference
        return sum((v * grads[k]).sum() for k, v in pooled.to_dict().items())

    kjt = rank_batch(rank)
    with torch.no_grad():
        sharded = model(kjt)
        if hasattr(sharded, "wait"):
            sharded = sharded.wait()
        expected = reference(kjt)

    # one training step: this rank's gradient back through the sharded model (fused update) ...
    out = model(kjt)
    if hasattr(out, "wait"):
        out = out.wait()
    weighted(out, rank_grad(rank)).backward()
    # ... and every rank's batch and gradient through the reference, then SGD by hand. TorchRec
    # averages the embedding gradients over the ranks, as DDP does the dense ones
    # (torchrec/distributed/comm_ops.py: GRADIENT_DIVISION = True), hence the mean over ranks.
    loss = sum(weighted(reference(rank_batch(r)), rank_grad(r)) for r in range(world_size)) / world_size
    loss.backward()
    stepped = {name: (p.detach() - LR * p.grad).float() for name, p in reference.named_parameters()}
    updated = []
    for key, value in model.state_dict().items():
        name = key[len("module."):] if key.startswith("module.") else key
        if name not in full or not isinstance(value, ShardedTensor):
            continue
        table = name.split(".")[1]  # embedding_bags.<table>.weight
        for shard in value.local_shards():
            (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            want = stepped[name]
            updated.append({"table": table, "got": shard.tensor.detach().float().clone(),
                            "want": want[r0:r0 + nr, c0:c0 + nc].clone(),
                            "before": full[name][r0:r0 + nr, c0:c0 + nc].float().clone()})
    torch.save(
        {
            "keys": sharded.keys(),
            "sharded": sharded.to_dict(),
            "expected": expected.to_dict(),
            "copied_cells": copied,
            "updated": updated,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    r, w, port, task_path, plan_path, out_dir = sys.argv[1:7]
    main(int(r), int(w), int(port), task_path, plan_path, out_dir, int(sys.argv[7]) if len(sys.argv) > 7 else None)
