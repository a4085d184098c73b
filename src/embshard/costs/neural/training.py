"""Training inputs (padded tensors) and the Lightning module that trains one cost network."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from embshard.costs.features import NUM_FEATURES
from embshard.costs.neural.features import (LOG_FLOOR_MS, Normalization, comm_features, compute_features,
                                            forward_wait_ms)
from embshard.costs.neural.nets import build_net
from embshard.costs.neural.samples import CommSample, ComputeSample

# ---------------------------------------------------------------------------------------
# Tensors for training: padded
# ---------------------------------------------------------------------------------------
def compute_arrays(samples: Sequence[ComputeSample]) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-sample raw feature matrices (at the sample's own batch) and labels (ms)."""
    feats = [compute_features(s.tables, s.batch_size) for s in samples]
    return feats, np.array([s.ms for s in samples], dtype=np.float64)


def compute_tensors(feats: Sequence[np.ndarray], y_ms: np.ndarray) -> tuple[torch.Tensor, ...]:
    """(x [N,K,F] raw, mask [N,K], y [N] ms) with K the most pieces of any sample."""
    k = max(f.shape[0] for f in feats)
    x = np.zeros((len(feats), k, NUM_FEATURES), np.float32)
    mask = np.zeros((len(feats), k), np.float32)
    for i, f in enumerate(feats):
        x[i, : len(f)] = f
        mask[i, : len(f)] = 1.0
    return torch.from_numpy(x), torch.from_numpy(mask), torch.from_numpy(np.asarray(y_ms, np.float32))


def comm_arrays(samples: Sequence[CommSample], direction: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-sample [D, F] features (at the sample's own batch) and [D] labels (ms) of one
    direction. Forward labels are the time beyond the wait (`forward_wait_ms`), which is
    known exactly: the forward model adds it back (so it holds for waits longer than any
    trained on)."""
    feats, ys = [], []
    for s in samples:
        f = comm_features(np.array([s.widths]), np.array([s.delays_ms]), s.batch_size,
                          with_delays=direction == "forward")[0]
        feats.append(f)
        if direction == "forward":  # the model learns the time beyond waiting for the slowest device
            ys.append(np.maximum(np.asarray(s.forward_ms, np.float64) - forward_wait_ms(s.delays_ms), 0.0))
        else:
            ys.append(np.asarray(s.backward_ms, np.float64))
    return feats, ys


def comm_tensors(feats: Sequence[np.ndarray], ys: Sequence[np.ndarray], norm: Normalization) -> tuple[torch.Tensor, ...]:
    """(x [N,D,F], mask [N,D], y [N,D], ymask [N,D]) padded to the largest D."""
    d = max(f.shape[0] for f in feats)
    nf = feats[0].shape[1]
    x = np.zeros((len(feats), d, nf), np.float32)
    mask = np.zeros((len(feats), d), np.float32)
    y = np.zeros((len(feats), d), np.float32)
    for i, (f, t) in enumerate(zip(feats, ys)):
        x[i, : len(f)] = norm.x(f)
        mask[i, : len(f)] = 1.0
        y[i, : len(f)] = norm.y(t)
    m = torch.from_numpy(mask)
    return torch.from_numpy(x), m, torch.from_numpy(y), m.clone()


# ---------------------------------------------------------------------------------------
# Lightning module
# ---------------------------------------------------------------------------------------
def make_module(kind: str, net_hparams: dict[str, Any], lr: float = 1e-3, weight_decay: float = 0.0):
    """A LightningModule training one cost network: the compute net on the squared log
    error of its ms (relative error), comm nets on standardised targets (masked MSE)."""
    import pytorch_lightning as pl

    class CostRegressor(pl.LightningModule):
        def __init__(self, kind: str, net_hparams: dict[str, Any], lr: float, weight_decay: float):
            super().__init__()
            self.save_hyperparameters()
            self.kind = kind
            self.net = build_net(kind, dict(net_hparams))

        def _loss(self, batch):
            if self.kind == "compute":
                x, mask, y = batch
                return ((torch.log(self.net(x, mask)) - torch.log(y.clamp_min(LOG_FLOOR_MS))) ** 2).mean()
            x, mask, y, ymask = batch
            err = (self.net(x, mask) - y) ** 2 * ymask
            return err.sum() / (ymask > 0).sum().clamp_min(1)

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log(f"{self.kind}/train_loss", loss, on_step=False, on_epoch=True, prog_bar=True,
                     batch_size=batch[0].shape[0])
            return loss

        def validation_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log(f"{self.kind}/val_loss", loss, on_step=False, on_epoch=True, prog_bar=True,
                     batch_size=batch[0].shape[0])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    return CostRegressor(kind, dict(net_hparams), float(lr), float(weight_decay))


