"""What a shard cost model offers a search: the predictor protocols, and the analytic model
behind them.

Three small protocols, each a role a caller needs, stated here instead of being probed for
on the object:

* `ShardPredictor`: costs at ONE batch size. `compute_ms(shards)` is the fused
  forward+backward kernel time of each shard (a shard is a list of `Table`s whose rows / dim
  are those of the pieces on one device); `comm_ms(widths, delays_ms)` the per-device forward
  (including the wait for the slowest device) and backward all-to-all time of `[n, D]`
  widths and compute delays. `batch_size` is the batch the predictions are for (None: not
  tied to one; a caller scales linearly from it to a task's batch, `batch_ratio`).
* `EncodingPredictor`: a `ShardPredictor` whose shard compute is `head_ms(reduce(table
  encodings))` with an additive `reduction` ("sum", or "sum_max": the sum and the
  element-wise max, concatenated). A search keeps running per-device reductions and adds a
  piece without re-predicting the whole shard (`embshard.search.accumulators`).
* `PredictorFamily`: cost models not tied to one batch size; `at_batch(b)` binds one. The
  neural bundle (`embshard.costs.neural.NeuralCostModels`) is one; `AnalyticFamily` the
  analytic one; `FixedFamily` holds one bound predictor (tests, notebooks).

`AnalyticPredictor` adapts the closed-form `AnalyticCostModel` to the predictor protocols: a
stand-in for tests, and what NeuroShard searches against when asked to (checkpoint=None).
`load_models(checkpoint, owner)` is how a planner gets its models: the neural bundle of a
checkpoint, or the analytic family on purpose; a missing or unreadable checkpoint is an
InputError, never a quiet switch to the analytic model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from embshard.costs.analytic import BYTES_PER_FLOAT, AnalyticCostModel
from embshard.errors import InputError
from embshard.tables import Table
from embshard.task import Task

#: the reductions an `EncodingPredictor` may declare
REDUCTIONS = ("sum", "sum_max")


@runtime_checkable
class ShardPredictor(Protocol):
    """Per-shard compute and per-device all-to-all costs at one batch size."""

    #: The batch size the predictions are for (None: not tied to one).
    batch_size: int | None

    def compute_ms(self, shards: Sequence[Sequence[Table]]) -> np.ndarray:
        """Predicted fused fw+bw kernel ms of each shard (empty shard -> 0)."""
        ...

    def comm_ms(self, widths: np.ndarray, delays_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n, D] widths and compute delays -> ([n, D] forward ms, [n, D] backward ms)."""
        ...


@runtime_checkable
class EncodingPredictor(ShardPredictor, Protocol):
    """A predictor whose shard compute is `head_ms(reduce(table_encodings(shard)))`."""

    #: "sum" (the encodings summed) or "sum_max" (the sum and the element-wise max, concatenated)
    reduction: str

    def table_encodings(self, tables: Sequence[Table]) -> np.ndarray:
        """[N, E] one encoding per table (piece)."""
        ...

    def head_ms(self, pooled: np.ndarray) -> np.ndarray:
        """[n] compute ms of shards from their reduced encodings [n, E] (sum) or [n, 2E] (sum_max)."""
        ...


@runtime_checkable
class PredictorFamily(Protocol):
    """Cost models for any batch size."""

    def at_batch(self, batch_size: int) -> ShardPredictor:
        """The predictor at `batch_size` (cached by the family)."""
        ...


def supports_incremental(predictor: ShardPredictor) -> bool:
    """Whether a predictor states an additive encoding (`EncodingPredictor` with a reduction of
    `REDUCTIONS`), so a search can keep running per-device reductions."""
    return isinstance(predictor, EncodingPredictor) and predictor.reduction in REDUCTIONS


def batch_ratio(predictor: ShardPredictor, task: Task) -> float:
    """Linear scale from the predictor's batch to the task's (1 when not tied to one)."""
    b = predictor.batch_size
    return task.batch_size / b if b else 1.0


# ----------------------------------------------------------------------------- analytic adapter
class AnalyticPredictor:
    """`AnalyticCostModel` behind the predictor protocols, vectorised.

    Args:
        model: the analytic model (default parameters when None).
        batch_size: batch the predictions are for; None: the model's, else 4096.

    Compute is the model's formula written as a head over a SUM of per-table encodings
    (1, weight bytes, row bytes read, lookups, width), so it is an `EncodingPredictor`, like
    the neural bundle. Communication: backward = the model's transfer time; forward =
    transfer + wait for the slowest device (max delay − own delay), as measured.
    """

    reduction = "sum"

    def __init__(self, model: AnalyticCostModel | None = None, batch_size: int | None = None):
        self.model = model or AnalyticCostModel()
        self.batch_size = int(batch_size or self.model.batch_size or 4096)
        self._coef = self.model._coefficients() * (1.0 + self.model.backward_factor)
        self._enc: dict[int, tuple[Table, tuple[float, ...]]] = {}

    def _encode(self, t: Table) -> tuple[float, ...]:
        # keyed by identity (hashing a Table hashes its 17-bin histogram); the entry holds
        # the table so its id is not reused while cached
        got = self._enc.get(id(t))
        if got is None or got[0] is not t:
            n = self.batch_size * t.pooling_factor
            got = (t, (1.0, float(t.rows * t.dim * t.bytes_per_element), n * t.dim * t.bytes_per_element, n, float(t.dim)))
            self._enc[id(t)] = got
        return got[1]

    def table_encodings(self, tables: Sequence[Table]) -> np.ndarray:
        """[N, 5] per-table terms: 1, weight bytes, row bytes read, lookups, width."""
        if not tables:
            return np.zeros((0, 5))
        return np.array([self._encode(t) for t in tables], dtype=np.float64)

    def head_ms(self, pooled: np.ndarray) -> np.ndarray:
        """[n] fw+bw ms of shards from their summed encodings."""
        pooled = np.asarray(pooled, dtype=np.float64)
        size = pooled[:, 1]
        miss = np.maximum(0.0, 1.0 - self.model.cache_bytes / np.where(size > 0, size, np.inf))
        feats = np.stack([
            (pooled[:, 0] > 0).astype(np.float64), pooled[:, 0], pooled[:, 2], pooled[:, 3] * miss,
            self.batch_size * pooled[:, 4] * BYTES_PER_FLOAT,
        ], axis=1)
        return feats @ self._coef

    def compute_ms(self, shards: Sequence[Sequence[Table]]) -> np.ndarray:
        out = np.zeros(len(shards))
        sizes = np.array([len(s) for s in shards], dtype=np.int64)
        nonempty = np.flatnonzero(sizes)
        if nonempty.size == 0:
            return out
        enc = self.table_encodings([t for s in shards for t in s])
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))[nonempty]
        out[nonempty] = self.head_ms(np.add.reduceat(enc, starts, axis=0))
        return out

    def comm_ms(self, widths: np.ndarray, delays_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = np.asarray(widths, dtype=np.float64)
        delays = np.asarray(delays_ms, dtype=np.float64)
        n, d = w.shape
        if d <= 1:
            return np.zeros_like(w), np.zeros_like(w)
        base, extra = divmod(self.batch_size, d)
        b = base + (np.arange(d) < extra)
        total = w.sum(axis=1, keepdims=True)
        nbytes = BYTES_PER_FLOAT * ((self.batch_size - b) * w + b * (total - w))
        bw = self.model.comm_latency_ms + nbytes * 1e-6 / self.model.net_bandwidth_gbps
        fw = bw + (delays.max(axis=1, keepdims=True) - delays)
        return fw, bw


class AnalyticFamily:
    """The analytic model at any batch size (`PredictorFamily`)."""

    def __init__(self, model: AnalyticCostModel | None = None):
        self.model = model
        self._bound: dict[int, AnalyticPredictor] = {}

    def at_batch(self, batch_size: int) -> AnalyticPredictor:
        b = int(batch_size)
        if b not in self._bound:
            self._bound[b] = AnalyticPredictor(self.model, batch_size=b)
        return self._bound[b]


class FixedFamily:
    """One bound predictor for every batch (`PredictorFamily`): a caller scales its costs to
    the task's batch (`batch_ratio`)."""

    def __init__(self, predictor: ShardPredictor):
        self.predictor = predictor

    def at_batch(self, batch_size: int) -> ShardPredictor:
        return self.predictor


# ----------------------------------------------------------------------------- loading
ROOT = Path(__file__).resolve().parents[3]
#: how a missing neural checkpoint is built
BUILD_COMMAND = "python train.py stage=pretrain"
#: the shipped cost models (relative to the project root)
DEFAULT_CHECKPOINT = "checkpoints/cpu_fbgemm/cost_models.pt"


def resolve_path(path: str | os.PathLike) -> Path:
    """Relative inputs resolve against the project root, not the working directory."""
    p = Path(os.path.expanduser(str(path)))
    return p if p.is_absolute() else ROOT / p


@dataclass
class LoadedModels:
    """Cost models a planner searches against, and what report.json says about them.

    `neural` is the loaded bundle (None: the analytic model, on purpose); `info` holds
    `cost_model` ("neural" | "analytic" | a class name), `checkpoint` and, for a neural bundle,
    `rescale` (what the speed probe did)."""

    family: PredictorFamily
    info: dict[str, Any]
    neural: Any = None


def load_models(checkpoint: str | os.PathLike | None, owner: str) -> LoadedModels:
    """The neural models of `checkpoint`, or the analytic model when it is None.

    Raises:
        InputError: the checkpoint is missing or cannot be loaded (one line, naming `owner`):
            a planner never quietly searches against another model than it was asked to.
    """
    if checkpoint in (None, ""):
        return LoadedModels(AnalyticFamily(), {"cost_model": "analytic", "checkpoint": None})
    path = resolve_path(checkpoint)
    if not path.is_file():
        raise InputError(f"{owner}: cost-model checkpoint {path} not found; build it with `{BUILD_COMMAND}`, "
                         "or set checkpoint=null to search against the analytic cost model")
    from embshard.costs.neural import NeuralCostModels

    try:
        models = NeuralCostModels.load(path)
    except InputError as e:
        raise InputError(f"{owner}: {str(e).splitlines()[0]}") from None
    return LoadedModels(models, {"cost_model": "neural", "checkpoint": str(path), "rescale": models.rescale}, models)
