"""The torch networks of the neural cost models (what pre-training trains and checkpoints hold)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from embshard.costs.features import NUM_EXTENSIVE, NUM_INTENSIVE
from embshard.costs.neural.features import COMM_FEATURE_NAMES, LOG_FLOOR_MS, NUM_RATES, _RATE_IDX
from embshard.errors import InputError

#: bounded swings of the learned log-rates and log-multipliers around their fitted scales
RATE_RANGE = 4.0
CONTEXT_RANGE = 2.0


def _bounded_exp(z: torch.Tensor, swing: float) -> torch.Tensor:
    return torch.exp(swing * torch.tanh(z / swing))


class ComputeNet(nn.Module):
    """Rates × work, summed over the shard, scaled by its context (module docstring).

    Input: x [B, K, NUM_FEATURES] RAW piece features (K = most pieces in a shard of the
    batch), mask [B, K] (1 = a real piece, 0 = padding). Output: ms [B], always > 0.
    Normalisation statistics and the fitted scales are buffers, so the state dict is the
    whole model (`init_from_data` sets them before training).
    """

    def __init__(self, in_features: int = NUM_INTENSIVE, hidden: int = 128, hidden2: int = 64,
                 context_hidden: int = 32, num_extensive: int = NUM_EXTENSIVE, num_rates: int = NUM_RATES):
        super().__init__()
        if in_features != NUM_INTENSIVE or num_extensive != NUM_EXTENSIVE or num_rates != NUM_RATES:
            raise InputError(f"compute net sizes ({in_features}, {num_extensive}, {num_rates}) differ from this code's "
                             f"features ({NUM_INTENSIVE}, {NUM_EXTENSIVE}, {NUM_RATES}); retrain it")
        self.rates = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden2), nn.ReLU(),
                                   nn.Linear(hidden2, num_rates))
        self.context = nn.Sequential(nn.Linear(num_extensive, context_hidden), nn.ReLU(),
                                     nn.Linear(context_hidden, num_rates + 1))
        with torch.no_grad():  # start at the fitted scales: rates and multipliers of 1 (×scale)
            self.rates[-1].weight.mul_(0.01)
            self.rates[-1].bias.zero_()
            self.context[-1].weight.zero_()
            self.context[-1].bias.zero_()
        self.register_buffer("x_mean", torch.zeros(in_features))
        self.register_buffer("x_std", torch.ones(in_features))
        self.register_buffer("x_lo", torch.full((in_features,), -1e30))
        self.register_buffer("x_hi", torch.full((in_features,), 1e30))
        self.register_buffer("ctx_mean", torch.zeros(num_extensive))
        self.register_buffer("ctx_std", torch.ones(num_extensive))
        self.register_buffer("ctx_lo", torch.full((num_extensive,), -1e30))
        self.register_buffer("ctx_hi", torch.full((num_extensive,), 1e30))
        self.register_buffer("rate_scale", torch.ones(num_rates))
        self.register_buffer("base_ms", torch.tensor(0.1))
        self.register_buffer("rate_idx", torch.tensor(_RATE_IDX, dtype=torch.long))

    def piece_terms(self, x: torch.Tensor) -> torch.Tensor:
        """[..., NUM_RATES] ms each piece brings per kind of work (before the context)."""
        # intensive features are held to the range trained on: outside it a rate stays at the
        # edge's value instead of extrapolating; work (extensive) still scales time linearly
        xi = (torch.minimum(torch.maximum(x[..., :NUM_INTENSIVE], self.x_lo), self.x_hi) - self.x_mean) / self.x_std
        rate = self.rate_scale * _bounded_exp(self.rates(xi), RATE_RANGE)
        return rate * x[..., NUM_INTENSIVE:].index_select(-1, self.rate_idx)

    def head(self, terms: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
        """ms of shards from their summed piece terms [B, R] and summed work [B, E]."""
        lw = torch.minimum(torch.maximum(torch.log1p(work), self.ctx_lo), self.ctx_hi)
        h = self.context((lw - self.ctx_mean) / self.ctx_std)
        scale = _bounded_exp(h[:, :-1], CONTEXT_RANGE)
        return (terms * scale).sum(-1) + self.base_ms * _bounded_exp(h[:, -1], CONTEXT_RANGE)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1)
        terms = (self.piece_terms(x) * m).sum(1)
        work = (x[..., NUM_INTENSIVE:] * m).sum(1)
        return self.head(terms, work)

    @torch.no_grad()
    def init_from_data(self, feats: Sequence[np.ndarray], y_ms: np.ndarray, steps: int = 400) -> None:
        """Normalisation statistics and the work scales from training data: the rates that
        best fit the labels as a plain weighted sum of work (log error), which the network
        then refines per piece and per context."""
        allf = np.concatenate(feats).astype(np.float64)
        xi = allf[:, :NUM_INTENSIVE]
        std = xi.std(0)
        work = np.stack([f[:, NUM_INTENSIVE:].sum(0) for f in feats]).astype(np.float64)
        lw = np.log1p(work)
        cstd = lw.std(0)
        self.x_mean.copy_(torch.from_numpy(xi.mean(0)).float())
        self.x_std.copy_(torch.from_numpy(np.where(std > 1e-6, std, 1.0)).float())
        self.x_lo.copy_(torch.from_numpy(xi.min(0)).float())
        self.x_hi.copy_(torch.from_numpy(xi.max(0)).float())
        self.ctx_mean.copy_(torch.from_numpy(lw.mean(0)).float())
        self.ctx_std.copy_(torch.from_numpy(np.where(cstd > 1e-6, cstd, 1.0)).float())
        self.ctx_lo.copy_(torch.from_numpy(lw.min(0)).float())
        self.ctx_hi.copy_(torch.from_numpy(lw.max(0)).float())
        s = torch.from_numpy(work[:, _RATE_IDX])
        ly = torch.log(torch.from_numpy(np.maximum(np.asarray(y_ms, np.float64), LOG_FLOOR_MS)))
        # start every rate at "its work alone explains the mean label", then fit
        theta = torch.log(ly.exp().mean() / s.mean(0).clamp_min(1e-9)) - math.log(NUM_RATES + 1)
        theta = torch.cat([theta, torch.log(ly.exp().min().clamp_min(1e-3)).reshape(1)]).clone().requires_grad_()
        opt = torch.optim.Adam([theta], lr=0.05)
        with torch.enable_grad():
            for _ in range(steps):
                opt.zero_grad()
                a = theta.exp()
                pred = s @ a[:-1] + a[-1]
                loss = ((torch.log(pred) - ly) ** 2).mean()
                loss.backward()
                opt.step()
        a = theta.detach().exp()
        floor = 1e-4 * float(a[:-1].max())
        self.rate_scale.copy_(a[:-1].clamp_min(floor).float())
        self.base_ms.copy_(a[-1].float())


class CommNet(nn.Module):
    """DeepSets over the devices of one all-to-all: one output per device, any D.

    Input: x [B, D, F] z-scored per-device features, mask [B, D] (padding devices = 0).
    """

    def __init__(self, in_features: int = len(COMM_FEATURE_NAMES), hidden: int = 64, embed: int = 32):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, embed), nn.ReLU())
        self.rho = nn.Sequential(
            nn.Linear(in_features + 3 * embed, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1)
        h = self.phi(x) * m
        mean = h.sum(1) / m.sum(1).clamp_min(1.0)
        mx = h.max(1).values
        ctx = torch.cat([mean, mx], dim=-1).unsqueeze(1).expand(-1, x.shape[1], -1)
        return self.rho(torch.cat([x, h, ctx], dim=-1)).squeeze(-1)


def build_net(kind: str, hparams: dict[str, Any]) -> nn.Module:
    if kind == "compute":
        return ComputeNet(**hparams)
    if kind in ("forward_comm", "backward_comm"):
        return CommNet(**hparams)
    raise InputError(f"unknown cost model kind {kind!r}")


