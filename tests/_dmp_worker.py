"""One rank of the DistributedModelParallel check in test_torchrec_bridge.py.

Usage: python _dmp_worker.py RANK WORLD_SIZE PORT TASK_JSON PLAN_JSON OUT_DIR

Builds the unsharded EmbeddingBagCollection for the task from a fixed seed (the reference),
shards a second copy with DistributedModelParallel (gloo, CPU, fused FBGEMM kernel) under
`plan_to_torchrec(plan)`, copies the reference weights into the local shards, runs the
same rank-specific KeyedJaggedTensor batch through both, and saves both pooled outputs to
OUT_DIR/rank{RANK}.pt for the test to compare.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def main(rank: int, world_size: int, port: int, task_path: str, plan_path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        run(rank, world_size, task_path, plan_path, out_dir)
    finally:
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

    sharding_plan = plan_to_torchrec(task, plan, world_size=world_size, device_type="cpu")
    model = DistributedModelParallel(
        module=task_to_ebc(task, device="meta"),
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

    g = torch.Generator().manual_seed(100 + rank)
    batch = 5
    lengths, values = [], []
    for t in task.tables:
        ls = torch.randint(0, 4, (batch,), generator=g)
        lengths.append(ls)
        values.append(torch.randint(0, t.rows, (int(ls.sum()),), generator=g))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[t.name for t in task.tables], values=torch.cat(values), lengths=torch.cat(lengths)
    )
    with torch.no_grad():
        sharded = model(kjt)
        if hasattr(sharded, "wait"):
            sharded = sharded.wait()
        expected = reference(kjt)
    torch.save(
        {
            "keys": sharded.keys(),
            "sharded": sharded.to_dict(),
            "expected": expected.to_dict(),
            "copied_cells": copied,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    r, w, port, task_path, plan_path, out_dir = sys.argv[1:7]
    main(int(r), int(w), int(port), task_path, plan_path, out_dir)
