"""NeuroShard's neural cost models: networks, Lightning modules, data sets, the loaded bundle.

Three models, trained by `embshard.costs.pretrain.pretrain` on measured cost data:

* **compute**: fused forward+backward kernel time of one device's shard set, at any batch
  size. Each piece (a table, or a column / row slice of one) has intensive features (what a
  lookup of it is like) and extensive ones (how much work it brings at this batch: lookups,
  bytes read, bags, pooled output, rows touched; `embshard.costs.features`). A rate network
  maps the intensive features to one positive rate per kind of work, so a piece costs
  Σ_k rate_k × work_k; a shard sums its pieces, and a context network on the shard's total
  work (log-scaled: working set, lookups, pieces) scales each kind of work (caches and
  fusion) and adds a per-step constant:

      ms = Σ_k m_k(context) × Σ_pieces rate_k(piece) × work_k(piece) + c(context)

  Time is linear in work at fixed rates, so the model extrapolates to more lookups, bigger
  batches and more pieces the way the kernel does, instead of the way a ReLU head happens to
  (the previous sum-of-encodings → MLP head did not, and a search found its blind spots).
  Trained on the relative (log) error, the quantity MAPE reports. Intensive features are held
  to the range they were trained on (a rate saturates at the edge of the data instead of
  extrapolating), while work outside it still scales time linearly. Rates and context
  multipliers are bounded swings (× e^±4, × e^±2) around scales fitted to the data before
  training.
* **forward / backward comm**: one time per device for ANY device count D and batch. A
  DeepSets network: each device's features (its width, the bytes it moves in the
  all-to-all at this batch, its delay and wait, and global context: D, sum/mean/max/min of
  widths and delays, batch) go through an encoder φ; the mean and max of φ over the sample's
  devices are concatenated to each device's own features and encoding, and a head ρ gives
  that device's time (standardised log ms by default). The forward model predicts the time
  beyond the device's wait for the slowest one (its lead, known from the delays) and adds the
  wait back, so waits longer than any trained on cost what they cost. The backward model sees
  no delays (the backward all-to-all starts from a barrier).

`NeuralCostModels` is the loaded bundle: `at_batch(b)` gives the predictor the search uses
for one batch size (numpy inference, per-piece encodings cached, one batched call for many
shards or comm configurations); `device_costs(task, plan)` (the CostModel protocol)
simulates a plan like the hardware evaluator measures it; `envelope_report(task, plan)` says
which device shards fall outside the training data (`embshard.costs.envelope`).

Checkpoint (`cost_models.pt`, plain data, loads with ``torch.load(weights_only=True)``)::

    {"format_version": 2,
     "compute" | "forward_comm" | "backward_comm": {"state_dict": {...}, "hparams": {...}},
     "normalization": {"compute": {"feature_names": [...]},
                       "forward_comm" | "backward_comm": {"x_mean": [...], "x_std": [...],
                           "y_mean": float, "y_std": float, "target": "ms" | "log_ms",
                           "feature_names": [...]}},
     "envelope": {...}, "profile": {...}, "metrics": {...}, "data": {...},
     "calibration": {"compute": s_c, "forward_comm": s_f, "backward_comm": s_b, ...}}  # optional

`calibration` (optional; `scripts/calibrate_cost_models.py` writes it) rescales the three
models to the machine as it measures now: compute ms × s_c, forward comm beyond the wait × s_f,
backward comm × s_b, each the median measured / predicted ratio over a few fresh shards and
all-to-alls. A machine measured while other jobs shared it is slower by a constant factor; the
ranking of shards does not change, the absolute ms do.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from embshard.costs.base import DeviceCosts
from embshard.costs.envelope import Envelope
from embshard.costs.features import (EXTENSIVE_NAMES, FEATURE_NAMES, NUM_EXTENSIVE, NUM_FEATURES, NUM_INTENSIVE,
                                     planning_view, shard_features)
from embshard.errors import InputError
from embshard.plan import device_pieces
from embshard.tables import Table

FORMAT_VERSION = 2
MODEL_KEYS = ("compute", "forward_comm", "backward_comm")
TARGETS = ("log_ms", "ms")
#: floor of a label before taking its log (ms)
LOG_FLOOR_MS = 1e-3
_REPO_ROOT = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------------------------------
# Compute features
# ---------------------------------------------------------------------------------------
COMPUTE_FEATURE_NAMES = FEATURE_NAMES
#: The kinds of work a piece is charged for (weight bytes only shape the context: rows that
#: are not looked up cost nothing, but a big working set makes every lookup slower).
RATE_TERMS: tuple[str, ...] = ("lookups_1e4", "lookup_mb", "bags_1e4", "output_mb", "touched_rows_1e4",
                               "touched_mb", "pieces")
_RATE_IDX = [EXTENSIVE_NAMES.index(n) for n in RATE_TERMS]
NUM_RATES = len(RATE_TERMS)
#: bounded swings of the learned log-rates and log-multipliers around their fitted scales
RATE_RANGE = 4.0
CONTEXT_RANGE = 2.0


def compute_features(tables: Sequence[Table], batch_size: int) -> np.ndarray:
    """[len(tables), NUM_FEATURES] raw features of the compute model (float32)."""
    return shard_features(tables, batch_size)


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
    #: where the shard came from: "random" (collector's draw) or "<algorithm>" (a device
    #: shard of a plan the refine stage measured)
    origin: str = "random"
    #: pieces whose reuse histogram was imputed (`features.imputed_histogram`), not measured
    imputed_histograms: int = 0
    #: the speed probe of the session that measured it (the collection's probes/ folder)
    probe: str | None = None


@dataclass
class CommSample:
    widths: list[int]
    delays_ms: list[float]
    batch_size: int
    forward_ms: list[float]
    backward_ms: list[float]
    probe: str | None = None

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
        imputed = sum(1 for t in obj["tables"] if t.get("histogram_imputed") or t.get("reuse_histogram") is None)
        samples.append(ComputeSample(tables, batch, ms, str(split) if split is not None else None,
                                     str(obj.get("origin", "random")), imputed, _probe_id(obj, where)))
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
        samples.append(CommSample(widths, delays, batch, fw, bw, _probe_id(obj, where)))
    if not samples:
        raise InputError(f"{path}: no comm samples")
    return samples


def _probe_id(obj: dict[str, Any], where: str) -> str | None:
    p = obj.get("probe")
    if p is not None and not isinstance(p, str):
        raise InputError(f"{where}: 'probe' must be a probe id (a string), got {p!r}")
    return p


def normalize_to_probe(compute: Sequence[ComputeSample], comm: Sequence[CommSample],
                       probes: dict[str, Any]) -> dict[str, Any] | None:
    """Put every sample's labels on one machine speed, in place: the reference is the median
    of the probes the samples name (`hardware.probe.median_probe`); a sample measured beside a
    probe that ran s× slower than the reference has its compute ms divided by s, its backward
    comm and its forward comm beyond the wait by the comm ratio (the wait is a sleep, the same
    on any machine). Returns what was done (None when no sample names a probe).

    Raises:
        InputError: some samples name a probe and others do not, or a named probe is missing.
    """
    from embshard.hardware.probe import median_probe

    named = [s.probe for s in [*compute, *comm]]
    if all(p is None for p in named):
        return None
    missing = sum(p is None for p in named)
    if missing:
        raise InputError(f"{missing} of {len(named)} cost samples name no speed probe (measured without the "
                         "protocol's probe): re-measure them, or drop them from the data folder")
    unknown = sorted({p for p in named if p not in probes})
    if unknown:
        raise InputError(f"cost samples name probe(s) the data folder's probes/ lacks: {unknown[:3]}")
    used = sorted(set(named))
    reference = median_probe([probes[p] for p in used])
    speed = {p: probes[p].speed_vs(reference) for p in used}
    for s in compute:
        s.ms /= speed[s.probe]["compute"]
    for s in comm:
        wait = forward_wait_ms(s.delays_ms)
        f, b = speed[s.probe]["forward_comm"], speed[s.probe]["backward_comm"]
        s.forward_ms = [float(w + (x - w) / f) if x > w else float(x) for x, w in zip(s.forward_ms, wait)]
        s.backward_ms = [float(x / b) for x in s.backward_ms]
    ratios = [v["compute"] for v in speed.values()]
    return {"reference": reference.to_dict(), "probes": len(used),
            "compute_speed_range": [float(min(ratios)), float(max(ratios))],
            "comm_speed_range": [float(min(v["forward_comm"] for v in speed.values())),
                                 float(max(v["forward_comm"] for v in speed.values()))]}


def most_common_batch(batches: Iterable[int]) -> int:
    return Counter(batches).most_common(1)[0][0]


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


def forward_wait_ms(delays_ms: Any) -> np.ndarray:
    """How long each device waits in the forward all-to-all for the slowest one: its lead."""
    d = np.asarray(delays_ms, np.float64)
    return d.max(-1, keepdims=True) - d


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


def _bexp(z: np.ndarray, swing: float) -> np.ndarray:
    return np.exp(swing * np.tanh(z / swing))


def _np(state: dict[str, torch.Tensor], key: str) -> np.ndarray:
    return state[key].detach().cpu().double().numpy().copy()


def _check_calibration(cal: Any, source: str) -> dict[str, Any] | None:
    """The optional `calibration` entry: positive finite scales for the three models."""
    if cal is None:
        return None
    if not isinstance(cal, dict):
        raise InputError(f"{source}: calibration must be a mapping, got {type(cal).__name__}")
    for k in MODEL_KEYS:
        v = cal.get(k, 1.0)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            raise InputError(f"{source}: calibration.{k} must be a positive number, got {v!r}")
    return dict(cal)


def fit_calibration(models: "NeuralCostModels", compute: Sequence["ComputeSample"],
                    comm: Sequence["CommSample"] = ()) -> dict[str, Any]:
    """Scales that map `models` (their uncalibrated predictions: any calibration they carry is
    divided out) to fresh measurements: per model, the median of measured / predicted (compute:
    per shard; forward comm: time beyond the wait, per device; backward comm: per device). A
    model without samples keeps 1.0."""
    sc = models.scale
    out: dict[str, Any] = {k: 1.0 for k in MODEL_KEYS}
    ratios: dict[str, list[float]] = {k: [] for k in MODEL_KEYS}
    for s in compute:
        pred = float(models.at_batch(s.batch_size).compute_ms([s.tables])[0]) / sc["compute"]
        if pred > 0 and s.ms > 0:
            ratios["compute"].append(s.ms / pred)
    for s in comm:
        if s.num_devices < 2:
            continue
        dl = np.asarray(s.delays_ms, np.float64)
        fw, bw = models.at_batch(s.batch_size).comm_ms(np.asarray(s.widths, np.float64), dl)
        wait = forward_wait_ms(dl)
        fw, bw = (fw - wait) / sc["forward_comm"] + wait, bw / sc["backward_comm"]
        for p, m, w in zip(fw, s.forward_ms, wait):
            if p - w > 0 and m - w > 0:
                ratios["forward_comm"].append((m - w) / (p - w))
        for p, m in zip(bw, s.backward_ms):
            if p > 0 and m > 0:
                ratios["backward_comm"].append(m / p)
    for k, r in ratios.items():
        if r:
            out[k] = float(np.median(r))
    out["samples"] = {k: len(r) for k, r in ratios.items()}
    return out


class NeuralCostModels:
    """The three pre-trained cost models, loaded for fast inference (numpy).

    Attributes:
        envelope: what the models were trained on (`embshard.costs.envelope.Envelope`).
        profile: the hardware profile the cost data was measured on.
        metrics, data: what pre-training reported (held-out metrics, sample counts, tables).
    """

    #: not tied to one batch size: `at_batch` binds one
    batch_size = None

    def __init__(self, bundle: dict[str, Any], source: str = "<memory>"):
        self.source = source
        try:
            if int(bundle["format_version"]) != FORMAT_VERSION:
                raise InputError(f"{source}: checkpoint format {bundle['format_version']!r}, expected {FORMAT_VERSION} "
                                 "(retrain it: python train.py stage=pretrain ...)")
            self.profile = dict(bundle.get("profile") or {})
            self.metrics = dict(bundle.get("metrics") or {})
            self.data = dict(bundle.get("data") or {})
            self.norm = {k: Normalization.from_dict(bundle["normalization"][k]) for k in MODEL_KEYS if k != "compute"}
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
            self.envelope = Envelope.from_dict(bundle["envelope"])
            self.calibration = _check_calibration(bundle.get("calibration"), source)
            from embshard.hardware.probe import Probe

            self.probe = Probe.from_dict(bundle["probe"], source=f"{source}: probe") if bundle.get("probe") else None
        except InputError:
            raise
        except Exception as e:  # KeyError, TypeError, RuntimeError from load_state_dict, ...
            msg = str(e).splitlines()[0] if str(e) else ""
            raise InputError(f"{source}: not a valid cost-model checkpoint ({type(e).__name__}: {msg[:200]})") from None
        self._states = states
        c = states["compute"]
        self._rates = _linears(c, "rates")
        self._context = _linears(c, "context")
        self._x_mean, self._x_std = _np(c, "x_mean"), _np(c, "x_std")
        self._x_lo, self._x_hi = _np(c, "x_lo"), _np(c, "x_hi")
        self._ctx_mean, self._ctx_std = _np(c, "ctx_mean"), _np(c, "ctx_std")
        self._ctx_lo, self._ctx_hi = _np(c, "ctx_lo"), _np(c, "ctx_hi")
        self._rate_scale, self._base_ms = _np(c, "rate_scale"), float(_np(c, "base_ms"))
        self.scale = {k: float((self.calibration or {}).get(k, 1.0)) for k in MODEL_KEYS}
        #: what `rescale_to` did (report.json's `rescale`): None until it is called
        self.rescale: dict[str, Any] | None = None
        from embshard.hardware.probe import current_probe

        if current_probe() is not None:
            self.rescale_to(current_probe())
        self._comm_layers = {k: (_linears(states[k], "phi"), _linears(states[k], "rho")) for k in ("forward_comm", "backward_comm")}
        self._bound: dict[int, BatchCostModels] = {}

    def rescale_to(self, probe: Any) -> dict[str, Any]:
        """Carry the models to the machine `probe` was timed on: each model's predictions
        scaled by how much slower that machine runs the probe than the machine whose probe
        the checkpoint records (per model: compute from the kernels, comm from the
        all-to-all), on top of any calibration. Without a recorded probe nothing changes and
        the summary says why. Returns the summary (also kept in `self.rescale`)."""
        from embshard.hardware.probe import rescale_summary

        summary = rescale_summary(self.probe, probe)
        if summary["applied"]:
            base = {k: float((self.calibration or {}).get(k, 1.0)) for k in MODEL_KEYS}
            self.scale = {k: base[k] * float(summary["scales"][k]) for k in MODEL_KEYS}
        summary["checkpoint"] = self.source
        self.rescale = summary
        return summary

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

    def at_batch(self, batch_size: int) -> "BatchCostModels":
        """The predictor for one batch size (the ShardPredictor the search uses), cached."""
        b = int(batch_size)
        if b <= 0:
            raise InputError(f"batch size must be positive, got {batch_size!r}")
        if b not in self._bound:
            self._bound[b] = BatchCostModels(self, b)
        return self._bound[b]

    # ------------------------------------------------------------------ compute (batch-free parts)
    def _encode(self, feats: np.ndarray) -> np.ndarray:
        """[N, R + E] per-piece encodings: its ms per kind of work, then its raw work."""
        xi = (np.clip(feats[:, :NUM_INTENSIVE], self._x_lo, self._x_hi) - self._x_mean) / self._x_std
        rate = self._rate_scale * _bexp(_mlp(xi, self._rates, relu_last=False), RATE_RANGE)
        work = feats[:, NUM_INTENSIVE:].astype(np.float64)
        return np.concatenate([rate * work[:, _RATE_IDX], work], axis=1)

    def head_ms(self, pooled: np.ndarray) -> np.ndarray:
        """[n] predicted ms of shards from their summed encodings [n, R + E]."""
        pooled = np.asarray(pooled, np.float64)
        terms, work = pooled[:, :NUM_RATES], pooled[:, NUM_RATES:]
        lw = np.clip(np.log1p(np.maximum(work, 0.0)), self._ctx_lo, self._ctx_hi)
        h = _mlp((lw - self._ctx_mean) / self._ctx_std, self._context, relu_last=False)
        ms = (terms * _bexp(h[:, :-1], CONTEXT_RANGE)).sum(1) + self._base_ms * _bexp(h[:, -1], CONTEXT_RANGE)
        return ms * self.scale["compute"]

    def _comm_net(self, kind: str, x: np.ndarray) -> np.ndarray:
        phi, rho = self._comm_layers[kind]
        h = _mlp(x, phi, relu_last=True)  # [n, D, E]
        ctx = np.concatenate([h.mean(1), h.max(1)], axis=-1)[:, None, :]
        z = np.concatenate([x, h, np.broadcast_to(ctx, h.shape[:2] + ctx.shape[2:])], axis=-1)
        return _mlp(z, rho, relu_last=False)[..., 0]

    # ------------------------------------------------------------------ plans
    def device_costs(self, task, plan) -> DeviceCosts:
        """Simulated per-device costs of `plan` (the CostModel protocol), as the hardware
        evaluator defines them, at the task's batch: compute per device; delay = compute −
        min over devices; backward comm from widths; forward comm from widths and delays.
        Tables without a reuse histogram get their imputed one."""
        view, _ = planning_view(task)
        p = self.at_batch(task.batch_size)
        compute = p.compute_ms(device_pieces(view, plan))
        widths = np.array(plan.device_widths(task.num_devices), dtype=np.float64)
        fw, bw = p.comm_ms(widths, compute - compute.min())
        return DeviceCosts(compute_ms=[float(x) for x in compute], forward_comm_ms=[float(x) for x in fw],
                           backward_comm_ms=[float(x) for x in bw])

    def envelope_report(self, task, plan) -> dict[str, Any]:
        """How much of `plan` the models never saw: device shards outside the training
        envelope (with the reasons), the all-to-all's, and the tables whose reuse histogram
        was imputed."""
        view, imputed = planning_view(task)
        p = self.at_batch(task.batch_size)
        per_device = p.envelope_reasons(device_pieces(view, plan))
        compute = p.compute_ms(device_pieces(view, plan))
        comm = self.envelope.check_comm(plan.device_widths(task.num_devices), list(compute - compute.min()), task.batch_size)
        out = {d: r for d, r in enumerate(per_device) if r}
        return {
            "out_of_envelope_devices": len(out),
            "devices": task.num_devices,
            "reasons": {str(d): r for d, r in out.items()},
            "comm_out_of_envelope": bool(comm),
            "comm_reasons": comm,
            "imputed_histograms": len(imputed),
        }


class BatchCostModels:
    """The compute and comm models at one batch size: the `ShardPredictor` the NeuroShard
    search talks to (`compute_ms`, `comm_ms`, and the incremental `table_encodings` /
    `head_ms` over a SUM reduction). Per-piece encodings are cached per Table."""

    reduction = "sum"

    def __init__(self, models: NeuralCostModels, batch_size: int):
        self.models = models
        self.batch_size = int(batch_size)
        self._cache: dict[int, tuple[Table, np.ndarray]] = {}
        self.predictions = 0
        self.out_of_envelope = 0

    @property
    def envelope(self) -> Envelope:
        return self.models.envelope

    def table_encodings(self, tables: Sequence[Table]) -> np.ndarray:
        """[N, R + E] per-piece encodings; a shard's prediction is `head_ms(sum of its
        pieces' encodings)`, so a search adds a piece to a device's running sum without
        re-encoding anything. Cached by identity (hashing a Table hashes its histogram); an
        entry holds its Table, so an id is not reused while cached."""
        cache = self._cache
        missing = {id(t): t for t in tables if cache.get(id(t), (None,))[0] is not t}
        if missing:
            if len(cache) > 1_000_000:
                cache.clear()
            todo = list(missing.values())
            enc = self.models._encode(compute_features(todo, self.batch_size))
            for t, e in zip(todo, enc):
                cache[id(t)] = (t, e)
        if not tables:
            return np.zeros((0, NUM_RATES + NUM_EXTENSIVE))
        return np.stack([cache[id(t)][1] for t in tables])

    def head_ms(self, pooled: np.ndarray) -> np.ndarray:
        return self.models.head_ms(pooled)

    def compute_ms(self, shards: Sequence[Sequence[Table]]) -> np.ndarray:
        """Predicted fused forward+backward ms of each shard (empty shard → 0)."""
        flat = [t for s in shards for t in s]
        counts = np.array([len(s) for s in shards], dtype=np.int64)
        out = np.zeros(len(shards))
        nz = np.flatnonzero(counts)
        if nz.size == 0:
            return out
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])[nz]
        pooled = np.add.reduceat(self.table_encodings(flat), starts, axis=0)
        out[nz] = self.head_ms(pooled)
        self.predictions += len(nz)
        return out

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
        m = self.models
        xf = m.norm["forward_comm"].x(comm_features(w, dl, self.batch_size, with_delays=True))
        xb = m.norm["backward_comm"].x(comm_features(w, None, self.batch_size, with_delays=False))
        fw = m.norm["forward_comm"].to_ms(m._comm_net("forward_comm", xf)) * m.scale["forward_comm"] + forward_wait_ms(dl)
        bw = m.norm["backward_comm"].to_ms(m._comm_net("backward_comm", xb)) * m.scale["backward_comm"]
        return (fw[0], bw[0]) if squeeze else (fw, bw)

    def envelope_reasons(self, shards: Sequence[Sequence[Table]]) -> list[list[str]]:
        """Per shard, why it lies outside the training envelope ([] when inside)."""
        return [self.envelope.check_shard(compute_features(list(s), self.batch_size), self.batch_size) if s else []
                for s in shards]
