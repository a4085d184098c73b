"""One rank of tests/test_flexshard_data_path.py: ShardedSequenceEmbedding under several plans.

Usage: python _flexshard_worker.py RANK WORLD_SIZE DIR   (rendezvous through DIR/rendezvous, a file)

DIR holds task.json, plans/<name>.json, inputs.pt (full weights, the global batch per table,
a fixed projection per id) written by the test. For each plan this rank embeds its slice of
the batch, backpropagates the global loss's share sum(out * projection), syncs replicas, and
saves outputs, local gradients (by original row id) and the bytes it sent per purpose and
peer; then trains the first plan for a few SGD steps and saves the loss curve. DIR/rank{R}.pt.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta


def main(rank: int, world: int, folder: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    run(rank, world, folder)
    # every rank done with its collectives before any tears gloo down: a rank leaving while a
    # peer's gloo threads still talk to it aborted with "terminate called without an active exception"
    dist.barrier()
    dist.destroy_process_group()


def run(rank: int, world: int, folder: str) -> None:
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from dlrm.sequence_embedding import ShardedSequenceEmbedding
    from embshard.hardware.comm import batch_split
    from embshard.plan import Plan
    from embshard.task import Task

    folder = Path(folder)
    task = Task.load(folder / "task.json")
    inputs = torch.load(folder / "inputs.pt", weights_only=True)
    names = inputs["plans"]
    sizes = batch_split(task.batch_size, world)
    first = sum(sizes[:rank])
    mine, proj = {}, {}
    for t in task.tables:
        lengths = inputs["lengths"][t.name]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        a, b = int(offsets[first]), int(offsets[first + sizes[rank]])
        mine[t.name] = inputs["ids"][t.name][a:b]
        proj[t.name] = inputs["projection"][t.name][a:b]
    result = {"plans": {}}
    for name in names:
        plan = Plan.load(folder / "plans" / f"{name}.json")
        module = ShardedSequenceEmbedding(task, plan, rank, world, weights=inputs["weights"])
        out = module(mine)
        loss = sum((out[t.name] * proj[t.name]).sum() for t in task.tables)
        loss.backward()
        module.sync_replica_grads()
        grads = {}
        for t in task.tables:
            grads[t.name] = [(rows, p.grad.to_dense().clone()) for p, rows in module.local_rows(t.name)]
        result["plans"][name] = {
            "out": {k: v.detach() for k, v in out.items()},
            "grads": grads,
            "pair_bytes": {k: torch.from_numpy(v) for k, v in module.ledger.pair_bytes.items()},
        }
    # training under the first plan lowers the loss (planted target per row)
    plan = Plan.load(folder / "plans" / f"{names[0]}.json")
    module = ShardedSequenceEmbedding(task, plan, rank, world, weights=inputs["weights"])
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    curve = []
    for step in range(10):
        opt.zero_grad()
        out = module(mine)
        loss = sum(((out[t.name] * inputs["readout"][t.name]).sum(1) - inputs["target"][t.name][mine[t.name]]).pow(2).mean()
                   for t in task.tables)
        loss.backward()
        module.sync_replica_grads()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        curve.append(float(total) / world)
    result["curve"] = curve
    torch.save(result, folder / f"rank{rank}.pt")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
