"""The loaded bundle: `NeuralCostModels` (a checkpoint's three models, checked and rescaled)
and `BatchCostModels` (the predictor at one batch size the search talks to)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from embshard.costs.analytic import analytic_allreduce_ms
from embshard.costs.base import DeviceCosts
from embshard.costs.envelope import Envelope
from embshard.costs.features import NUM_EXTENSIVE, planning_view
from embshard.costs.neural.calibration import MODEL_KEYS, check_calibration, term_scales
from embshard.costs.neural.features import (BACKWARD_COMM_FEATURES, COMM_FEATURE_NAMES, COMPUTE_FEATURE_NAMES,
                                            NUM_RATES, Normalization, comm_features, compute_features,
                                            forward_wait_ms)
from embshard.costs.neural.nets import build_net
from embshard.costs.neural.numpy_nets import NumpyCommNet, NumpyComputeNet
from embshard.errors import InputError
from embshard.plan import device_pieces
from embshard.tables import Table

FORMAT_VERSION = 2
_REPO_ROOT = Path(__file__).resolve().parents[4]
#: a comm prediction more than this many times above or below the analytic model's for the
#: same all-to-all is not reported: the analytic model's is (on the plans of the evaluation
#: tasks, inside the envelope, the two stay within 4.1x of each other; where the comm models
#: extrapolate, 20-1e46x)
FAR_FACTOR = 10.0


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
            self.calibration = check_calibration(bundle.get("calibration"), source)
            from embshard.hardware.probe import Probe

            self.probe = Probe.from_dict(bundle["probe"], source=f"{source}: probe") if bundle.get("probe") else None
        except InputError:
            raise
        except Exception as e:  # KeyError, TypeError, RuntimeError from load_state_dict, ...
            msg = str(e).splitlines()[0] if str(e) else ""
            raise InputError(f"{source}: not a valid cost-model checkpoint ({type(e).__name__}: {msg[:200]})") from None
        self._raw_compute = states["compute"]
        terms = term_scales(self.calibration)
        if (terms != 1.0).any():  # calibrated kinds of work: every rate of that kind, in both nets
            c = dict(states["compute"])
            c["rate_scale"] = c["rate_scale"] * torch.as_tensor(terms, dtype=c["rate_scale"].dtype)
            states["compute"] = c
        self._states = states
        self._compute = NumpyComputeNet(states["compute"])
        self.scale = {k: float((self.calibration or {}).get(k, 1.0)) for k in MODEL_KEYS}
        #: what `rescale_to` did (report.json's `rescale`): None until it is called
        self.rescale: dict[str, Any] | None = None
        from embshard.hardware.probe import current_probe

        if current_probe() is not None:
            self.rescale_to(current_probe())
        self._comm = {k: NumpyCommNet(states[k]) for k in ("forward_comm", "backward_comm")}
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

    def raw_state(self, kind: str) -> dict[str, Any]:
        """A model's weights as trained, before any calibration of its kinds of work."""
        return self._raw_compute if kind == "compute" else self._states[kind]

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
        return self._compute.encode(feats)

    def head_ms(self, pooled: np.ndarray) -> np.ndarray:
        """[n] predicted ms of shards from their summed encodings [n, R + E]."""
        return self._compute.head(pooled) * self.scale["compute"]

    def _comm_net(self, kind: str, x: np.ndarray) -> np.ndarray:
        return self._comm[kind](x)

    # ------------------------------------------------------------------ plans
    def device_costs(self, task, plan) -> DeviceCosts:
        """Simulated per-device costs of `plan` (the CostModel protocol), as the hardware
        evaluator defines them, at the task's batch: compute per device; delay = compute −
        min over devices; backward comm from widths (plus the analytic all-reduce of the
        data-parallel tables' gradients); forward comm from widths and delays.
        Tables without a reuse histogram get their imputed one."""
        view, _ = planning_view(task)
        p = self.at_batch(task.batch_size)
        compute = p.compute_ms(device_pieces(view, plan))
        widths = np.array(plan.device_widths(task.num_devices, task.table_by_name), dtype=np.float64)
        fw, bw = p.comm_ms(widths, compute - compute.min())
        # data-parallel gradients: the analytic all-reduce (the comm models never saw one)
        ar = analytic_allreduce_ms(plan.data_parallel_floats(task.num_devices, task.table_by_name), task.num_devices)
        return DeviceCosts(compute_ms=[float(x) for x in compute], forward_comm_ms=[float(x) for x in fw],
                           backward_comm_ms=[float(x) + ar for x in bw])

    def envelope_report(self, task, plan) -> dict[str, Any]:
        """How much of `plan` the models never saw: device shards outside the training
        envelope (with the reasons), the all-to-all's, and the tables whose reuse histogram
        was imputed."""
        view, imputed = planning_view(task)
        p = self.at_batch(task.batch_size)
        per_device = p.envelope_reasons(device_pieces(view, plan))
        compute = p.compute_ms(device_pieces(view, plan))
        comm = self.envelope.check_comm(plan.device_widths(task.num_devices, task.table_by_name), list(compute - compute.min()), task.batch_size)
        widths = np.array([plan.device_widths(task.num_devices, task.table_by_name)], dtype=np.float64)
        fallback = p.comm_fallback_reasons(widths, (compute - compute.min())[None])[0]
        out = {d: r for d, r in enumerate(per_device) if r}
        return {
            "out_of_envelope_devices": len(out),
            "devices": task.num_devices,
            "reasons": {str(d): r for d, r in out.items()},
            "comm_out_of_envelope": bool(comm),
            "comm_reasons": comm,
            # who estimated the all-to-alls: the comm models, or the analytic model where the
            # comm models would extrapolate (with the reason)
            "comm_estimate": "analytic" if fallback else "neural",
            "comm_fallback_reason": fallback or None,
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
        #: comm configurations whose times came from the analytic model, by reason
        self.fallbacks: Counter[str] = Counter()

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
        slowest device, whose lead is given by `delays_ms`. A configuration the comm models
        cannot be trusted on (`comm_fallback_reasons`) gets the analytic model's times
        instead; `fallbacks` counts them by reason.
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
        fw, bw, reasons = self._comm_checked(w, dl)
        for r in reasons:
            if r:
                self.fallbacks[r] += 1
        return (fw[0], bw[0]) if squeeze else (fw, bw)

    def comm_fallback_reasons(self, widths: np.ndarray, delays_ms: np.ndarray) -> list[str]:
        """Per configuration ([n, D] widths and delays), why its all-to-all times come from the
        analytic model ("" where the comm models' are used)."""
        w = np.asarray(widths, dtype=np.float64)
        if w.shape[1] <= 1:
            return [""] * w.shape[0]
        return self._comm_checked(w, np.asarray(delays_ms, dtype=np.float64))[2]

    def _comm_checked(self, w: np.ndarray, dl: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[str]]:
        from embshard.costs.predictor import AnalyticPredictor

        afw, abw = AnalyticPredictor(batch_size=self.batch_size).comm_ms(w, dl)
        wait = forward_wait_ms(dl)
        outside = self.envelope.comm_untrusted(w.shape[1], self.batch_size)
        if outside:
            return afw, abw, [f"analytic: {outside}"] * w.shape[0]
        m = self.models
        xf = m.norm["forward_comm"].x(comm_features(w, dl, self.batch_size, with_delays=True))
        xb = m.norm["backward_comm"].x(comm_features(w, None, self.batch_size, with_delays=False))
        fw_beyond = m.norm["forward_comm"].to_ms(m._comm_net("forward_comm", xf)) * m.scale["forward_comm"]
        bw = m.norm["backward_comm"].to_ms(m._comm_net("backward_comm", xb)) * m.scale["backward_comm"]
        fw = fw_beyond + wait
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratio = np.concatenate([bw / abw, fw_beyond / np.maximum(afw - wait, 1e-9)], axis=1)
        far = ~np.all((ratio <= FAR_FACTOR) & (ratio >= 1.0 / FAR_FACTOR), axis=1)
        reasons = [""] * w.shape[0]
        for i in np.flatnonzero(far):
            fw[i], bw[i] = afw[i], abw[i]
            reasons[i] = f"analytic: the comm models' estimate is over {FAR_FACTOR:g}x off the analytic model's"
        return fw, bw, reasons

    def envelope_reasons(self, shards: Sequence[Sequence[Table]]) -> list[list[str]]:
        """Per shard, why it lies outside the training envelope ([] when inside)."""
        return [self.envelope.check_shard(compute_features(list(s), self.batch_size), self.batch_size) if s else []
                for s in shards]
