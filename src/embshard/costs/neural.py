"""NeuroShard's neural cost models: networks, Lightning modules, data sets, the loaded bundle.

Three models, trained by `embshard.costs.pretrain.pretrain` on measured cost data:

* **compute**: fused forward+backward kernel time of one device's shard set. A per-table
  encoder MLP (24 → 128 → 32, ReLU) on z-scored `table_features` + lookup bytes, a permutation-invariant
  reduction over the shard's tables (``sum``, or ``sum_max`` = sum ‖ max), and a head MLP
  (→ 64 → 1). By default it predicts standardised ms with a squared error (``target: ms``,
  ``loss: mse``): a shard's time is close to a sum of per-table terms, so a sum reduction
  with an ms output stays near-additive and extrapolates to more tables, and the plan cost
  (a max over devices) is decided by absolute ms on the big shards. On held-out tables of
  the test data this beat a log-ms target (R² 0.99 vs 0.50, same τ) whose head must learn
  log-of-a-sum. ``target: log_ms`` and ``loss: relative`` ((y_std/y)²-weighted) are options.
* **forward / backward comm**: one time per device for ANY device count D. A DeepSets
  network: each device's features (its width, the bytes it moves in the all-to-all, its
  delay and wait, and global context: D, sum/mean/max/min of widths and delays, batch)
  go through an encoder φ; the mean and max of φ over the sample's devices are concatenated
  to each device's own features and encoding, and a head ρ gives that device's time (ms,
  standardised: comm time is close to linear in bytes and in waiting, and a ReLU MLP on
  ms extrapolates linearly). The backward model sees no delays (the backward all-to-all
  starts from a barrier).

`NeuralCostModels` is the loaded bundle the search uses: numpy inference, per-table
encodings cached, one batched call for many shards or many comm configurations, and
`device_costs(task, plan)` (the CostModel protocol) simulating a plan like the hardware
evaluator measures it.

Checkpoint (`cost_models.pt`, plain data, loads with ``torch.load(weights_only=True)``)::

    {"format_version": 1,
     "compute" | "forward_comm" | "backward_comm": {"state_dict": {...}, "hparams": {...}},
     "normalization": {"compute" | "forward_comm" | "backward_comm":
                          {"x_mean": [...], "x_std": [...], "y_mean": float, "y_std": float,
                           "target": "log_ms" | "ms"}},
     "profile": {...hardware profile...}, "batch_size": int, "metrics": {...}, "data": {...}}
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from embshard.costs.base import DeviceCosts
from embshard.costs.features import FEATURE_NAMES, table_features
from embshard.errors import InputError
from embshard.tables import Table

FORMAT_VERSION = 1
MODEL_KEYS = ("compute", "forward_comm", "backward_comm")
TARGETS = ("log_ms", "ms")
REDUCTIONS = ("sum", "sum_max")
#: floor of a label before taking its log (ms)
LOG_FLOOR_MS = 1e-3
_REPO_ROOT = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------------------------------
# Compute features
# ---------------------------------------------------------------------------------------
#: `table_features` plus one derived column that is LINEAR in the kernel's main work, the
#: bytes a bag lookup reads (pooling factor × dim × bytes per element, in kB): the 23 raw
#: features hold it only as a log or as a product of two columns, which a ReLU MLP fits
#: poorly outside the training range, and a shard's time is close to a sum of such terms.
COMPUTE_FEATURE_NAMES: tuple[str, ...] = (*FEATURE_NAMES, "lookup_kbytes")
NUM_FEATURES = len(COMPUTE_FEATURE_NAMES)
_I_DIM, _I_PF = FEATURE_NAMES.index("dim"), FEATURE_NAMES.index("pooling_factor")


def compute_features(tables: Sequence[Table]) -> np.ndarray:
    """[len(tables), NUM_FEATURES] raw features of the compute model (float32)."""
    if not tables:
        return np.zeros((0, NUM_FEATURES), np.float32)
    base = np.stack([table_features(t) for t in tables])
    bpe = np.array([t.bytes_per_element for t in tables], np.float32)
    extra = base[:, _I_PF] * base[:, _I_DIM] * bpe / 1e3
    return np.concatenate([base, extra[:, None]], axis=1).astype(np.float32)


# ---------------------------------------------------------------------------------------
# Communication features
# ---------------------------------------------------------------------------------------
#: Per-device features of one all-to-all (raw, before z-scoring). Bytes per rank follow
#: `hardware/comm.py`: with the global batch B split evenly, rank r sends B(D-1)/D × w_r
#: floats and receives B/D × (W - w_r): 4·B/D·((D-2)·w_r + W) bytes in all.
COMM_FEATURE_NAMES: tuple[str, ...] = (
    "width",
    "log1p_width",
    "total_width",
    "mean_width",
    "max_width",
    "min_width",
    "num_devices",
    "inv_num_devices",
    "volume_mb",
    "max_volume_mb",
    "mean_volume_mb",
    "log2_batch",
    "delay_ms",
    "max_delay_ms",
    "mean_delay_ms",
    "wait_ms",
)
_NUM_DELAY_FEATURES = 4
#: the backward model sees the same features without the delays
BACKWARD_COMM_FEATURES = COMM_FEATURE_NAMES[: len(COMM_FEATURE_NAMES) - _NUM_DELAY_FEATURES]


def comm_features(widths: np.ndarray, delays_ms: np.ndarray | None, batch_size: float, with_delays: bool = True) -> np.ndarray:
    """[n, D, F] per-device features of n all-to-alls of D devices each (float32)."""
    w = np.asarray(widths, dtype=np.float64)
    if w.ndim != 2:
        raise InputError(f"widths must be [n, D], got shape {w.shape}")
    n, d = w.shape
    total = w.sum(1, keepdims=True)
    vol = 4.0 * batch_size / d * ((d - 2) * w + total) / 1e6
    cols = [
        w,
        np.log1p(w),
        np.broadcast_to(total, w.shape),
        np.broadcast_to(total / d, w.shape),
        np.broadcast_to(w.max(1, keepdims=True), w.shape),
        np.broadcast_to(w.min(1, keepdims=True), w.shape),
        np.full(w.shape, float(d)),
        np.full(w.shape, 1.0 / d),
        vol,
        np.broadcast_to(vol.max(1, keepdims=True), w.shape),
        np.broadcast_to(vol.mean(1, keepdims=True), w.shape),
        np.full(w.shape, math.log2(batch_size)),
    ]
    if with_delays:
        dl = np.zeros_like(w) if delays_ms is None else np.asarray(delays_ms, dtype=np.float64)
        if dl.shape != w.shape:
            raise InputError(f"delays_ms shape {dl.shape} differs from widths shape {w.shape}")
        mx = dl.max(1, keepdims=True)
        cols += [dl, np.broadcast_to(mx, w.shape), np.broadcast_to(dl.mean(1, keepdims=True), w.shape), mx - dl]
    return np.stack(cols, axis=-1).astype(np.float32)


# ---------------------------------------------------------------------------------------
# Networks
# ---------------------------------------------------------------------------------------
class ComputeNet(nn.Module):
    """Per-table encoder → masked reduction over the shard → head (one output per shard).

    Input: x [B, K, F] z-scored table features (K = most tables in a shard of the batch),
    mask [B, K] (1 = a real table, 0 = padding).
    """

    def __init__(self, in_features: int = NUM_FEATURES, encoder_hidden: int = 128, encoder_out: int = 32,
                 head_hidden: int = 64, reduction: str = "sum", additive: bool = False):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise InputError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction
        self.encoder = nn.Sequential(
            nn.Linear(in_features, encoder_hidden), nn.ReLU(), nn.Linear(encoder_hidden, encoder_out), nn.ReLU()
        )
        pooled = encoder_out * (2 if reduction == "sum_max" else 1)
        self.head = nn.Sequential(nn.Linear(pooled, head_hidden), nn.ReLU(), nn.Linear(head_hidden, 1))
        # additive: every table also adds its own non-negative cost (softplus), summed over the
        # shard; the head models only what fusion changes. A shard of more tables then never
        # predicts less, and unseen tables extrapolate through their own term.
        self.additive = nn.Sequential(nn.Linear(encoder_out, 1)) if additive else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x) * mask.unsqueeze(-1)  # encodings are >= 0 (ReLU): padding at 0 is neutral for max
        pooled = h.sum(1)
        if self.reduction == "sum_max":
            pooled = torch.cat([pooled, h.max(1).values], dim=-1)
        out = self.head(pooled).squeeze(-1)
        if self.additive is not None:
            out = out + (nn.functional.softplus(self.additive(h)).squeeze(-1) * mask).sum(1)
        return out


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


# ---------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------
@dataclass
class Normalization:
    """z-scoring of inputs and of the (possibly log) target, from training data only."""

    x_mean: np.ndarray
    x_std: np.ndarray
    y_mean: float
    y_std: float
    target: str = "log_ms"

    @classmethod
    def fit(cls, x: np.ndarray, y_ms: np.ndarray, target: str) -> "Normalization":
        if target not in TARGETS:
            raise InputError(f"target must be one of {TARGETS}, got {target!r}")
        x = np.asarray(x, dtype=np.float64)
        std = x.std(0)
        yt = _transform(np.asarray(y_ms, dtype=np.float64), target)
        return cls(
            x_mean=x.mean(0).astype(np.float32),
            x_std=np.where(std > 1e-6, std, 1.0).astype(np.float32),
            y_mean=float(yt.mean()),
            y_std=float(yt.std()) if yt.std() > 1e-9 else 1.0,
            target=target,
        )

    def x(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.x_mean) / self.x_std).astype(np.float32)

    def y(self, y_ms: np.ndarray) -> np.ndarray:
        return ((_transform(np.asarray(y_ms, dtype=np.float64), self.target) - self.y_mean) / self.y_std).astype(np.float32)

    def to_ms(self, out: np.ndarray) -> np.ndarray:
        v = np.asarray(out, dtype=np.float64) * self.y_std + self.y_mean
        return np.exp(v) if self.target == "log_ms" else np.maximum(v, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"x_mean": self.x_mean.tolist(), "x_std": self.x_std.tolist(), "y_mean": self.y_mean,
                "y_std": self.y_std, "target": self.target}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Normalization":
        return cls(np.asarray(d["x_mean"], np.float32), np.asarray(d["x_std"], np.float32),
                   float(d["y_mean"]), float(d["y_std"]), str(d["target"]))


def _transform(y_ms: np.ndarray, target: str) -> np.ndarray:
    return np.log(np.maximum(y_ms, LOG_FLOOR_MS)) if target == "log_ms" else y_ms


# ---------------------------------------------------------------------------------------
# Cost data: JSON Lines samples from the collector
# ---------------------------------------------------------------------------------------
_TABLE_KEYS = ("name", "rows", "dim", "pooling_factor", "reuse_histogram", "bytes_per_element")


@dataclass
class ComputeSample:
    tables: list[Table]
    batch_size: int
    ms: float
    #: the collector's split ("train", or "test" when drawn from its held-out tables)
    split: str | None = None


@dataclass
class CommSample:
    widths: list[int]
    delays_ms: list[float]
    batch_size: int
    forward_ms: list[float]
    backward_ms: list[float]

    @property
    def num_devices(self) -> int:
        return len(self.widths)


def read_jsonl(path: str | os.PathLike) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line; InputError naming file:line otherwise."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"cost data file {path} not found")
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{no}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{no}: expected a JSON object, got {type(obj).__name__}")
            out.append((no, obj))
    return out


def load_compute_samples(path: str | os.PathLike) -> list[ComputeSample]:
    samples = []
    for no, obj in read_jsonl(path):
        if obj.get("kind", "compute") != "compute":
            continue
        where = f"{path}:{no}"
        try:
            tables = [Table.from_dict({k: t[k] for k in _TABLE_KEYS if k in t}) for t in obj["tables"]]
            ms = float(obj["median_ms"])
            batch = int(obj["batch_size"])
        except InputError as e:
            raise InputError(f"{where}: {str(e).splitlines()[0]}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: bad compute sample ({type(e).__name__}: {e})") from None
        if not tables or not math.isfinite(ms) or ms <= 0 or batch <= 0:
            raise InputError(f"{where}: compute sample needs >= 1 table, a positive median_ms and batch_size")
        split = obj.get("split")
        samples.append(ComputeSample(tables, batch, ms, str(split) if split is not None else None))
    if not samples:
        raise InputError(f"{path}: no compute samples")
    return samples


def load_comm_samples(path: str | os.PathLike) -> list[CommSample]:
    samples = []
    for no, obj in read_jsonl(path):
        if obj.get("kind", "comm") != "comm":
            continue
        where = f"{path}:{no}"
        try:
            widths = [int(w) for w in obj["widths"]]
            delays = [float(x) for x in obj.get("delays_ms") or [0.0] * len(widths)]
            fw = [float(x) for x in obj["forward_ms"]]
            bw = [float(x) for x in obj["backward_ms"]]
            batch = int(obj["batch_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: bad comm sample ({type(e).__name__}: {e})") from None
        d = len(widths)
        if d < 2 or not (len(delays) == len(fw) == len(bw) == d) or int(obj.get("num_devices", d)) != d:
            raise InputError(f"{where}: comm sample needs D >= 2 and D widths, delays, forward and backward times")
        vals = delays + fw + bw
        if batch <= 0 or any(w < 0 for w in widths) or any(not math.isfinite(v) or v < 0 for v in vals):
            raise InputError(f"{where}: comm sample has a negative or non-finite value")
        samples.append(CommSample(widths, delays, batch, fw, bw))
    if not samples:
        raise InputError(f"{path}: no comm samples")
    return samples


def most_common_batch(batches: Iterable[int]) -> int:
    return Counter(batches).most_common(1)[0][0]


# ---------------------------------------------------------------------------------------
# Tensors for training: padded, pre-normalised
# ---------------------------------------------------------------------------------------
def compute_arrays(samples: Sequence[ComputeSample], batch_size: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-sample raw feature matrices and labels (ms, scaled linearly to `batch_size`)."""
    feats = [compute_features(s.tables) for s in samples]
    y = np.array([s.ms * batch_size / s.batch_size for s in samples], dtype=np.float64)
    return feats, y


def loss_weights(y_ms: np.ndarray, norm: Normalization, loss: str) -> np.ndarray:
    """Per-label weights of the squared error on standardised targets.

    ``mse``: 1. ``relative`` (for the ``ms`` target): (y_std / y)², so the loss is the squared
    relative error, like a log target, while the network still predicts ms (labels below
    5% of y_std weigh as if they were 5% of it)."""
    y = np.asarray(y_ms, np.float64)
    if loss == "mse" or norm.target == "log_ms":
        return np.ones(y.shape, np.float32)
    if loss != "relative":
        raise InputError(f"loss must be 'mse' or 'relative', got {loss!r}")
    return ((norm.y_std / np.maximum(y, 0.05 * norm.y_std)) ** 2).astype(np.float32)


def compute_tensors(feats: Sequence[np.ndarray], y_ms: np.ndarray, norm: Normalization, loss: str = "mse") -> tuple[torch.Tensor, ...]:
    """(x [N,K,F], mask [N,K], y [N], weight [N]) with K the most tables of any sample."""
    k = max(f.shape[0] for f in feats)
    x = np.zeros((len(feats), k, NUM_FEATURES), np.float32)
    mask = np.zeros((len(feats), k), np.float32)
    for i, f in enumerate(feats):
        x[i, : len(f)] = norm.x(f)
        mask[i, : len(f)] = 1.0
    y = norm.y(y_ms)
    return torch.from_numpy(x), torch.from_numpy(mask), torch.from_numpy(y), torch.from_numpy(loss_weights(y_ms, norm, loss))


def comm_arrays(samples: Sequence[CommSample], batch_size: int, direction: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-sample [D, F] features and [D] labels (ms, scaled to `batch_size`) of one direction."""
    feats, ys = [], []
    for s in samples:
        ratio = batch_size / s.batch_size
        f = comm_features(np.array([s.widths]), np.array([s.delays_ms]) * ratio, batch_size,
                          with_delays=direction == "forward")[0]
        feats.append(f)
        ys.append(np.asarray(s.forward_ms if direction == "forward" else s.backward_ms, np.float64) * ratio)
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
def _lightning():
    import pytorch_lightning as pl

    return pl


def make_module(kind: str, net_hparams: dict[str, Any], lr: float = 1e-3, weight_decay: float = 0.0):
    """A LightningModule training one cost network on standardised targets (masked MSE)."""
    pl = _lightning()

    class CostRegressor(pl.LightningModule):
        def __init__(self, kind: str, net_hparams: dict[str, Any], lr: float, weight_decay: float):
            super().__init__()
            self.save_hyperparameters()
            self.kind = kind
            self.net = build_net(kind, dict(net_hparams))

        def forward(self, x, mask):
            return self.net(x, mask)

        def _loss(self, batch):
            x, mask, y, ymask = batch
            # ymask: 0 for padding, else the label's loss weight
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


# ---------------------------------------------------------------------------------------
# numpy inference
# ---------------------------------------------------------------------------------------
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


class NeuralCostModels:
    """The three pre-trained cost models, loaded for fast inference (numpy, float32).

    Attributes:
        batch_size: the batch size the models were trained at.
        profile: the hardware profile the cost data was measured on.
        metrics, data: what pre-training reported (held-out metrics, sample counts, tables).
    """

    def __init__(self, bundle: dict[str, Any], source: str = "<memory>"):
        self.source = source
        try:
            if int(bundle["format_version"]) != FORMAT_VERSION:
                raise InputError(f"{source}: checkpoint format {bundle['format_version']!r}, expected {FORMAT_VERSION}")
            self.batch_size = int(bundle["batch_size"])
            self.profile = dict(bundle.get("profile") or {})
            self.metrics = dict(bundle.get("metrics") or {})
            self.data = dict(bundle.get("data") or {})
            self.norm = {k: Normalization.from_dict(bundle["normalization"][k]) for k in MODEL_KEYS}
            expected = {"compute": COMPUTE_FEATURE_NAMES, "forward_comm": COMM_FEATURE_NAMES,
                        "backward_comm": BACKWARD_COMM_FEATURES}
            for k in MODEL_KEYS:
                names = bundle["normalization"][k].get("feature_names")
                if names is not None and tuple(names) != tuple(expected[k]):
                    raise InputError(f"{source}: the {k} model was trained on other features than this code computes "
                                     f"({len(names)} vs {len(expected[k])}); retrain it")
            self.hparams = {k: dict(bundle[k]["hparams"]) for k in MODEL_KEYS}
            states = {k: dict(bundle[k]["state_dict"]) for k in MODEL_KEYS}
            for k in MODEL_KEYS:  # the torch nets must accept the weights (shapes, names)
                build_net(k, self.hparams[k]).load_state_dict(states[k], strict=True)
        except InputError:
            raise
        except Exception as e:  # KeyError, TypeError, RuntimeError from load_state_dict, ...
            msg = str(e).splitlines()[0] if str(e) else ""
            raise InputError(f"{source}: not a valid cost-model checkpoint ({type(e).__name__}: {msg[:200]})") from None
        self._states = states
        self.reduction = self.hparams["compute"].get("reduction", "sum")
        self._enc = _linears(states["compute"], "encoder")
        self._head = _linears(states["compute"], "head")
        # additive models carry each table's own cost as one extra encoding column, so a
        # shard is still head(sum of encodings): the search's running sums work unchanged
        self._add = _linears(states["compute"], "additive") or None
        self._enc_width = self._enc[-1][0].shape[1]
        self._comm_layers = {k: (_linears(states[k], "phi"), _linears(states[k], "rho")) for k in ("forward_comm", "backward_comm")}
        self._cache: dict[Table, np.ndarray] = {}
        self._warned_batch = False

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | os.PathLike, **_ignored: Any) -> "NeuralCostModels":
        """Load `cost_models.pt` (weights_only=True). Relative paths: cwd, then the repo root.

        Extra keyword arguments (a Hydra config's training fields) are ignored.
        """
        p = Path(path)
        if not p.is_absolute() and not p.exists() and (_REPO_ROOT / p).exists():
            p = _REPO_ROOT / p
        if not p.is_file():
            raise InputError(f"cost-model checkpoint {p} not found (run: python train.py stage=pretrain ...)")
        try:
            bundle = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else ""
            raise InputError(f"{p}: not a readable cost-model checkpoint ({type(e).__name__}: {msg[:200]})") from None
        if not isinstance(bundle, dict):
            raise InputError(f"{p}: not a cost-model checkpoint (top level is {type(bundle).__name__})")
        return cls(bundle, source=str(p))

    def net(self, kind: str) -> nn.Module:
        """The torch network of one model (for inspection or gradient-based use)."""
        net = build_net(kind, self.hparams[kind])
        net.load_state_dict(self._states[kind])
        return net.eval()

    # ------------------------------------------------------------------ compute
    def table_encodings(self, tables: Sequence[Table]) -> np.ndarray:
        """[N, E] per-table encodings (cached per Table). A shard's prediction is
        `head_ms(pool(encodings of its tables))`, so a search can add and remove tables
        from a device's running sum without re-encoding anything."""
        out = np.empty((len(tables), self._enc_width + (1 if self._add else 0)), np.float32)
        missing = [i for i, t in enumerate(tables) if t not in self._cache]
        if missing:
            if len(self._cache) > 1_000_000:
                self._cache.clear()
            feats = compute_features([tables[i] for i in missing])
            enc = _mlp(self.norm["compute"].x(feats), self._enc, relu_last=True)
            if self._add:
                own = np.logaddexp(0.0, _mlp(enc, self._add, relu_last=False))  # softplus
                enc = np.concatenate([enc, own.astype(np.float32)], axis=1)
            for i, e in zip(missing, enc):
                self._cache[tables[i]] = e
        for i, t in enumerate(tables):
            out[i] = self._cache[t]
        return out

    def pool(self, encodings: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Reduce flat [N, E] encodings into [n, P] per shard; shard i = rows offsets[i]:offsets[i+1]."""
        counts = np.diff(offsets)
        n = len(counts)
        e = encodings.shape[1]
        pooled = np.zeros((n, e * (2 if self.reduction == "sum_max" else 1)), np.float32)
        nz = counts > 0
        if nz.any():
            starts = offsets[:-1][nz]
            pooled[nz, :e] = np.add.reduceat(encodings, starts, axis=0)
            if self.reduction == "sum_max":
                pooled[nz, e:] = np.maximum.reduceat(encodings, starts, axis=0)
        return pooled

    def head_ms(self, pooled: np.ndarray) -> np.ndarray:
        """[n] predicted ms of shards from their pooled encodings (at `self.batch_size`)."""
        pooled = np.asarray(pooled, np.float32)
        if self._add:  # layout: [sum of (E + 1) columns] (+ [max of (E + 1) columns] for sum_max)
            e = self._enc_width
            own = pooled[:, e]
            parts = [pooled[:, :e]] + ([pooled[:, e + 1 : 2 * e + 1]] if self.reduction == "sum_max" else [])
            out = _mlp(np.concatenate(parts, axis=1), self._head, relu_last=False)[:, 0] + own
        else:
            out = _mlp(pooled, self._head, relu_last=False)[:, 0]
        return self.norm["compute"].to_ms(out)

    def compute_ms(self, shards: Sequence[Sequence[Table]]) -> np.ndarray:
        """Predicted fused forward+backward ms of each shard set (empty set → 0)."""
        flat = [t for s in shards for t in s]
        counts = np.array([len(s) for s in shards], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        if not flat:
            return np.zeros(len(shards))
        pooled = self.pool(self.table_encodings(flat), offsets)
        ms = self.head_ms(pooled)
        ms[counts == 0] = 0.0
        return ms

    # ------------------------------------------------------------------ comm
    def _comm_net(self, kind: str, x: np.ndarray) -> np.ndarray:
        phi, rho = self._comm_layers[kind]
        h = _mlp(x, phi, relu_last=True)  # [n, D, E]
        ctx = np.concatenate([h.mean(1), h.max(1)], axis=-1)[:, None, :]
        z = np.concatenate([x, h, np.broadcast_to(ctx, h.shape[:2] + ctx.shape[2:])], axis=-1)
        return _mlp(z, rho, relu_last=False)[..., 0]

    def comm_ms(self, widths: np.ndarray, delays_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-device (forward, backward) all-to-all ms of n configurations of D devices.

        `widths` and `delays_ms` are [n, D] (a [D] vector is one configuration); D is any
        count >= 1 (D = 1 has no all-to-all: zeros). Forward includes waiting for the
        slowest device, whose lead is given by `delays_ms`.
        """
        w = np.asarray(widths, dtype=np.float64)
        dl = np.asarray(delays_ms, dtype=np.float64)
        squeeze = w.ndim == 1
        if squeeze:
            w, dl = w[None], dl[None]
        if w.shape != dl.shape or w.ndim != 2:
            raise InputError(f"widths {w.shape} and delays_ms {dl.shape} must both be [n, D]")
        if w.shape[1] <= 1 or w.shape[0] == 0:
            z = np.zeros(w.shape)
            return (z[0], z[0].copy()) if squeeze else (z, z.copy())
        xf = self.norm["forward_comm"].x(comm_features(w, dl, self.batch_size, with_delays=True))
        xb = self.norm["backward_comm"].x(comm_features(w, None, self.batch_size, with_delays=False))
        fw = self.norm["forward_comm"].to_ms(self._comm_net("forward_comm", xf))
        bw = self.norm["backward_comm"].to_ms(self._comm_net("backward_comm", xb))
        return (fw[0], bw[0]) if squeeze else (fw, bw)

    # ------------------------------------------------------------------ simulator
    def shard_table(self, table: Table, rows: int, dim: int) -> Table:
        """A shard as the compute model sees it: the table at the shard's rows and width.
        A row shard keeps its share of the lookups (pooling factor × rows share), as the
        hardware backends feed it only the indices that fall in its rows."""
        if rows == table.rows and dim == table.dim:
            return table
        pf = table.pooling_factor * (rows / table.rows)
        return Table(name=table.name, rows=rows, dim=dim, pooling_factor=pf,
                     reuse_histogram=table.reuse_histogram, bytes_per_element=table.bytes_per_element)

    def device_costs(self, task, plan) -> DeviceCosts:
        """Simulated per-device costs of `plan` (the CostModel protocol), as the hardware
        evaluator defines them: compute per device; delay = compute − min over devices;
        backward comm from widths; forward comm from widths and delays. Times are scaled
        linearly when the task's batch size differs from the models'."""
        d = task.num_devices
        tables = task.table_by_name
        shards = [[self.shard_table(tables[s.table], s.rows, s.dim) for s in plan.shards_on(k)] for k in range(d)]
        compute = self.compute_ms(shards)
        widths = np.array(plan.device_widths(d), dtype=np.float64)
        fw, bw = self.comm_ms(widths, compute - compute.min())
        ratio = self.batch_ratio(task.batch_size)
        return DeviceCosts(
            compute_ms=[float(x) for x in compute * ratio],
            forward_comm_ms=[float(x) for x in fw * ratio],
            backward_comm_ms=[float(x) for x in bw * ratio],
        )

    def batch_ratio(self, batch_size: int) -> float:
        """Linear scale from the models' batch size to `batch_size` (warns once if != 1)."""
        if batch_size != self.batch_size and not self._warned_batch:
            warnings.warn(
                f"neural cost models were trained at batch {self.batch_size}; scaling their times linearly "
                f"to batch {batch_size}", stacklevel=3)
            self._warned_batch = True
        return batch_size / self.batch_size
