"""The DLRM of a task: TorchRec's DLRM (or its DCN variant) with the task's embedding tables.

TorchRec's `DLRM` and `DLRM_DCN` require every table to have the interaction dimension D
(the last dense-arch layer). Sharding tasks mix widths (4..128), so when a task's dims are
not all D the model is `ProjectedDLRM`: TorchRec's own DenseArch, interaction arch and
OverArch, with a sparse arch that projects each pooled embedding of width != D to D by a
per-table linear map (no bias). The projection runs after the embedding all-to-all, on
the data-parallel side, so the sharded embedding work is exactly the task's tables. When
all dims equal D the model *is* `torchrec.models.dlrm.DLRM` / `DLRM_DCN`.

Either way the model is wrapped in `torchrec.models.dlrm.DLRMTrain` (BCE-with-logits loss),
so the EmbeddingBagCollection sits at `EBC_PATH`, the module path a sharding plan is keyed by.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
from torch import nn

from embshard.errors import InputError
from embshard.task import Task
from embshard.torchrec_bridge import task_to_ebc

#: Where the EmbeddingBagCollection lives inside DLRMTrain (the ShardingPlan's module key).
EBC_PATH = "model.sparse_arch.embedding_bag_collection"
ARCHS = ("dlrm", "dcn")


@dataclass(frozen=True)
class ModelConfig:
    """Dense/over-arch sizes of the DLRM; the embedding tables come from the task.

    Args:
        arch: "dlrm" (dot interaction) or "dcn" (TorchRec's DLRM_DCN: low-rank cross net).
        dense_in_features: width of the dense input.
        dense_arch_layer_sizes: bottom MLP; the last size is the interaction dim D.
        over_arch_layer_sizes: top MLP; must end in 1 (one logit).
        dcn_num_layers, dcn_low_rank_dim: the cross net of arch="dcn".
    """

    arch: str = "dlrm"
    dense_in_features: int = 13
    dense_arch_layer_sizes: tuple[int, ...] = (64, 32)
    over_arch_layer_sizes: tuple[int, ...] = (64, 1)
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 16

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise InputError(f"model.arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        sizes = {
            "dense_in_features": [self.dense_in_features],
            "dense_arch_layer_sizes": list(self.dense_arch_layer_sizes),
            "over_arch_layer_sizes": list(self.over_arch_layer_sizes),
        }
        for name, values in sizes.items():
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in values):
                raise InputError(f"model.{name} must be positive integers, got {values}")
        if self.over_arch_layer_sizes[-1] != 1:
            raise InputError(f"model.over_arch_layer_sizes must end in 1 (one logit), got {list(self.over_arch_layer_sizes)}")
        if self.arch == "dcn" and (self.dcn_num_layers <= 0 or self.dcn_low_rank_dim <= 0):
            raise InputError("model.dcn_num_layers and model.dcn_low_rank_dim must be positive")

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise InputError(f"unknown model option(s) {unknown}; known: {sorted(known)}")
        d = dict(cfg)
        for k in ("dense_arch_layer_sizes", "over_arch_layer_sizes"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)

    @property
    def interaction_dim(self) -> int:
        return self.dense_arch_layer_sizes[-1]


class ProjectedSparseArch(nn.Module):
    """TorchRec's SparseArch for mixed widths: pooled embeddings projected to width D.

    Output: (B, F, D), features in the EBC's order, like `torchrec.models.dlrm.SparseArch`.
    """

    def __init__(self, embedding_bag_collection, dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        self.D = dim
        self._names: list[str] = []
        self.projections = nn.ModuleDict()
        for cfg in embedding_bag_collection.embedding_bag_configs():
            for feature in cfg.feature_names:
                self._names.append(feature)
                if cfg.embedding_dim != dim:
                    self.projections[feature] = nn.Linear(cfg.embedding_dim, dim, bias=False, device=device)
        self.F = len(self._names)

    @property
    def sparse_feature_names(self) -> list[str]:
        return self._names

    def forward(self, features) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features).to_dict()
        values = [
            self.projections[name](pooled[name]) if name in self.projections else pooled[name]
            for name in self._names
        ]
        return torch.stack(values, dim=1)


class ProjectedDLRM(nn.Module):
    """TorchRec's DLRM / DLRM_DCN arch blocks around a `ProjectedSparseArch`."""

    def __init__(self, ebc, cfg: ModelConfig, dense_device: torch.device | None = None) -> None:
        super().__init__()
        from torchrec.models.dlrm import DenseArch, InteractionArch, InteractionDCNArch, OverArch, choose
        from torchrec.modules.crossnet import LowRankCrossNet

        D = cfg.interaction_dim
        self.sparse_arch = ProjectedSparseArch(ebc, D, device=dense_device)
        F = self.sparse_arch.F
        self.dense_arch = DenseArch(cfg.dense_in_features, list(cfg.dense_arch_layer_sizes), device=dense_device)
        if cfg.arch == "dcn":
            crossnet = LowRankCrossNet(in_features=(F + 1) * D, num_layers=cfg.dcn_num_layers, low_rank=cfg.dcn_low_rank_dim)
            self.inter_arch = InteractionDCNArch(num_sparse_features=F, crossnet=crossnet)
            over_in = (F + 1) * D
        else:
            self.inter_arch = InteractionArch(num_sparse_features=F)
            over_in = D + choose(F, 2) + F
        self.over_arch = OverArch(over_in, list(cfg.over_arch_layer_sizes), device=dense_device)

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse))


def build_model(task: Task, cfg: ModelConfig, dense_device: str | torch.device = "cpu", ebc_device: str | torch.device = "meta"):
    """`DLRMTrain` around the task's DLRM; the EBC on `ebc_device` (meta: DMP materialises shards).

    Dense parameters are initialised from torch's global RNG: seed it identically on every
    rank (DistributedModelParallel also broadcasts them from rank 0).
    """
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain

    ebc = task_to_ebc(task, device=ebc_device)
    dense_device = torch.device(dense_device)
    uniform = all(t.dim == cfg.interaction_dim for t in task.tables)
    dense, over = list(cfg.dense_arch_layer_sizes), list(cfg.over_arch_layer_sizes)
    with dense_device:  # modules TorchRec builds without a device argument (the cross net)
        if uniform and cfg.arch == "dlrm":
            model = DLRM(ebc, cfg.dense_in_features, dense, over, dense_device=dense_device)
        elif uniform:
            model = DLRM_DCN(
                ebc, cfg.dense_in_features, dense, over,
                dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim, dense_device=dense_device,
            )
        else:
            model = ProjectedDLRM(ebc, cfg, dense_device=dense_device)
        return DLRMTrain(model)
