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

Modules: `features` (inputs and their z-scoring), `nets` (the torch networks),
`numpy_nets` (their forward passes in numpy, for inference), `samples` (typed cost data),
`training` (tensors and the Lightning module; `embshard.costs.pretrain` runs it),
`calibration` and `models` (the loaded bundle, with its checkpoint checks).

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

from embshard.costs.neural.calibration import MODEL_KEYS, check_calibration, fit_calibration, fit_term_scales
from embshard.costs.neural.features import (BACKWARD_COMM_FEATURES, COMM_FEATURE_NAMES, COMPUTE_FEATURE_NAMES,
                                            LOG_FLOOR_MS, NUM_RATES, RATE_TERMS, TARGETS, Normalization,
                                            comm_features, compute_features, forward_wait_ms)
from embshard.costs.neural.models import FORMAT_VERSION, BatchCostModels, NeuralCostModels
from embshard.costs.neural.nets import CONTEXT_RANGE, RATE_RANGE, CommNet, ComputeNet, build_net
from embshard.costs.neural.numpy_nets import NumpyCommNet, NumpyComputeNet
from embshard.costs.neural.samples import (CommSample, ComputeSample, load_comm_samples, load_compute_samples,
                                           most_common_batch, normalize_to_probe, read_jsonl)
from embshard.costs.neural.training import comm_arrays, comm_tensors, compute_arrays, compute_tensors, make_module

__all__ = [
    "BACKWARD_COMM_FEATURES", "COMM_FEATURE_NAMES", "COMPUTE_FEATURE_NAMES", "CONTEXT_RANGE", "FORMAT_VERSION",
    "LOG_FLOOR_MS", "MODEL_KEYS", "NUM_RATES", "RATE_RANGE", "RATE_TERMS", "TARGETS", "BatchCostModels", "CommNet",
    "CommSample", "ComputeNet", "ComputeSample", "NeuralCostModels", "Normalization", "NumpyCommNet",
    "NumpyComputeNet", "build_net", "check_calibration", "comm_arrays", "comm_features", "comm_tensors",
    "compute_arrays", "compute_features", "compute_tensors", "fit_calibration", "fit_term_scales", "forward_wait_ms",
    "load_comm_samples", "load_compute_samples", "make_module", "most_common_batch", "normalize_to_probe",
    "read_jsonl",
]
