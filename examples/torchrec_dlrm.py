"""TorchRec's DLRM trained with DistributedModelParallel, planned by embshard: the only change
to TorchRec's own recipe is the planner line.

    torchrun --standalone --nproc_per_node 2 examples/torchrec_dlrm.py            # gloo, CPU
    torchrun --standalone --nproc_per_node 2 examples/torchrec_dlrm.py --algorithm size_lookup_greedy
    torchrun --standalone --nproc_per_node 2 examples/torchrec_dlrm.py --out-dir runs/dlrm_plan
    # then measure what was planned: python shard.py task_file=runs/dlrm_plan/task.json \
    #     plan_files=[runs/dlrm_plan/plan.json] algorithms=[] evaluate=measured hardware=dmp_cpu

Every rank prints its loss; rank 0 also prints the planner's per-rank summary. Data: TorchRec's
RandomRecDataset (random ids and dense features), as in TorchRec's examples.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os

import torch
import torch.distributed as dist
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from embshard import EmbShardPlanner

HASH_SIZES = [40_000, 12_000, 3_000, 800, 200_000, 25_000, 60, 5_000]
EMBEDDING_DIM = 16
DENSE_FEATURES = 13


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithm", default="neuroshard", help="any searcher of conf/searchers/all.yaml")
    ap.add_argument("--batch-size", type=int, default=256, help="per rank")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out-dir", default=None, help="write the task and plan JSON here (rank 0)")
    args = ap.parse_args()
    logging.basicConfig(format="%(message)s")
    logging.getLogger("embshard").setLevel(logging.INFO)  # the planner's per-rank summary

    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    torch.manual_seed(rank)

    keys = [f"cat_{i}" for i in range(len(HASH_SIZES))]
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=EMBEDDING_DIM, num_embeddings=rows, feature_names=[k])
              for k, rows in zip(keys, HASH_SIZES)]
    model = DLRMTrain(DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=DENSE_FEATURES, dense_arch_layer_sizes=[64, EMBEDDING_DIM],
        over_arch_layer_sizes=[64, 32, 1], dense_device=device))
    # the embedding tables' optimizer runs fused into backward, as in TorchRec's DLRM example
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.02})

    topology = Topology(world_size=world_size, compute_device="cpu",
                        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    constraints = {"t_cat_6": ParameterConstraints(sharding_types=["data_parallel"])}  # a tiny table: replicate it
    sharders = get_default_sharders()
    # TorchRec: planner = EmbeddingShardingPlanner(topology=topology, batch_size=args.batch_size, constraints=constraints)
    planner = EmbShardPlanner(topology=topology, batch_size=args.batch_size, constraints=constraints,
                              algorithm=args.algorithm, out_dir=args.out_dir)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)

    model = DistributedModelParallel(module=model, device=device, plan=plan, sharders=sharders)
    dense_optimizer = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                            lambda params: torch.optim.Adagrad(params, lr=0.02))
    data = iter(RandomRecDataset(keys=keys, batch_size=args.batch_size, hash_sizes=HASH_SIZES, ids_per_feature=3,
                                 num_dense=DENSE_FEATURES, manual_seed=rank))
    for step in range(args.steps):
        batch = next(data).to(device)
        loss, _ = model(batch)
        dense_optimizer.zero_grad()
        loss.backward()
        dense_optimizer.step()
        if step == 0 or step == args.steps - 1:
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        kinds = sorted({ps.sharding_type for mp in plan.plan.values() for ps in mp.values()})
        print(f"trained {args.steps} steps on {world_size} ranks under EmbShardPlanner({args.algorithm!r}): "
              f"{', '.join(kinds)}", flush=True)
    # teardown: release the sharded model (and the DDP reducer of its replicated tables) while
    # the process group still exists, then tear gloo down once every rank is done; a process
    # whose gloo threads outlive the interpreter aborts at exit ("terminate called without an
    # active exception")
    del model, dense_optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
