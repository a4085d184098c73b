"""The forward passes of the torch nets (`embshard.costs.neural.nets`) in numpy, for fast
inference on a search's many small batches: the same weights, the same arithmetic
(`tests/test_roles.py` checks that they agree with the torch nets)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from embshard.costs.features import NUM_INTENSIVE
from embshard.costs.neural.features import NUM_RATES, _RATE_IDX
from embshard.costs.neural.nets import CONTEXT_RANGE, RATE_RANGE


def _linears(state: dict[str, torch.Tensor], prefix: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(W^T, b)] of the nn.Linear layers under `prefix` (Sequential order), float32."""
    idx = sorted({int(k[len(prefix) + 1 :].split(".")[0]) for k in state if k.startswith(prefix + ".") and k.endswith(".weight")})
    return [
        (state[f"{prefix}.{i}.weight"].detach().cpu().float().numpy().T.copy(), state[f"{prefix}.{i}.bias"].detach().cpu().float().numpy().copy())
        for i in idx
    ]


def _mlp(x: np.ndarray, layers: Sequence[tuple[np.ndarray, np.ndarray]], relu_last: bool) -> np.ndarray:
    for i, (w, b) in enumerate(layers):
        x = x @ w + b
        if i < len(layers) - 1 or relu_last:
            np.maximum(x, 0.0, out=x)
    return x


def _bexp(z: np.ndarray, swing: float) -> np.ndarray:
    return np.exp(swing * np.tanh(z / swing))


def _np(state: dict[str, torch.Tensor], key: str) -> np.ndarray:
    return state[key].detach().cpu().double().numpy().copy()


class NumpyComputeNet:
    """`ComputeNet` split at its sum: `encode` gives each piece's terms and work (what a shard
    sums), `head` a shard's ms from its summed encoding. `head(encode(x).sum(0))` is
    `ComputeNet.forward` on the shard's pieces."""

    def __init__(self, state: dict[str, torch.Tensor]):
        # float64, as the features they meet: numpy would cast float32 weights on every call
        self.rates = [(w.astype(np.float64), b.astype(np.float64)) for w, b in _linears(state, "rates")]
        self.context = [(w.astype(np.float64), b.astype(np.float64)) for w, b in _linears(state, "context")]
        self.x_mean, self.x_std = _np(state, "x_mean"), _np(state, "x_std")
        self.x_lo, self.x_hi = _np(state, "x_lo"), _np(state, "x_hi")
        self.ctx_mean, self.ctx_std = _np(state, "ctx_mean"), _np(state, "ctx_std")
        self.ctx_lo, self.ctx_hi = _np(state, "ctx_lo"), _np(state, "ctx_hi")
        self.rate_scale, self.base_ms = _np(state, "rate_scale"), float(_np(state, "base_ms"))

    def encode(self, feats: np.ndarray) -> np.ndarray:
        """[N, R + E] per-piece encodings of raw features [N, F]: its ms per kind of work,
        then its raw work."""
        xi = (np.clip(feats[:, :NUM_INTENSIVE], self.x_lo, self.x_hi) - self.x_mean) / self.x_std
        rate = self.rate_scale * _bexp(_mlp(xi, self.rates, relu_last=False), RATE_RANGE)
        work = feats[:, NUM_INTENSIVE:].astype(np.float64)
        return np.concatenate([rate * work[:, _RATE_IDX], work], axis=1)

    def _multipliers(self, work: np.ndarray) -> np.ndarray:
        # np.minimum(np.maximum(...)) is np.clip's arithmetic without its per-call overhead, and
        # one _bexp over every column: a search calls this per placement, tens of thousands of times
        lw = np.minimum(np.maximum(np.log1p(np.maximum(work, 0.0)), self.ctx_lo), self.ctx_hi)
        return _bexp(_mlp((lw - self.ctx_mean) / self.ctx_std, self.context, relu_last=False), CONTEXT_RANGE)

    def head(self, pooled: np.ndarray) -> np.ndarray:
        """[n] ms of shards from their summed encodings [n, R + E]."""
        parts, base = self.head_parts(pooled)
        return parts.sum(1) + base

    def head_parts(self, pooled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`head` before its sum: [n, R] ms per kind of work (terms x their context's
        multipliers) and [n] the base; `head` = parts summed + base."""
        pooled = np.asarray(pooled, np.float64)
        b = self._multipliers(pooled[:, NUM_RATES:])
        return pooled[:, :NUM_RATES] * b[:, :-1], self.base_ms * b[:, -1]


class NumpyCommNet:
    """`CommNet.forward` without padding: [n, D, F] z-scored features -> [n, D] outputs."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.phi = _linears(state, "phi")
        self.rho = _linears(state, "rho")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        h = _mlp(x, self.phi, relu_last=True)  # [n, D, E]
        ctx = np.concatenate([h.mean(1), h.max(1)], axis=-1)[:, None, :]
        z = np.concatenate([x, h, np.broadcast_to(ctx, h.shape[:2] + ctx.shape[2:])], axis=-1)
        return _mlp(z, self.rho, relu_last=False)[..., 0]
