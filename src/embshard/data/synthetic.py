"""Synthetic embedding-bag traces in Meta's dlrm_datasets file format.

The generator writes the same tuple `(indices, offsets, lengths)` that the real
`fbgemm_t856_bs65536.pt(.gz)` holds, so everything downstream (the reader, table pools,
tasks, trace replay in the benchmarks) cannot tell the difference.

The model, per table `t`:

* a hash size `rows_t` (a mixture: a share of small tables, log-uniform over 10^2..10^4,
  and a log-normal bulk reaching tens of millions);
* a pooling factor `L_t` (a share of one-hot features with `L <= 1`, the rest log-normal
  with a tail past 100); bag lengths are Bernoulli(L) for one-hot tables and
  negative-binomial (a Gamma-Poisson mixture) with mean `L_t` for multi-hot ones;
* a popularity law over ranks: the rank of an access is `floor(X)` where `X` has density
  proportional to `(x + q)^-s_t` on `[0, rows_t)` (a continuous Zipf-Mandelbrot law with a
  per-table exponent `s_t`, correlated with the table's size); ranks are then scattered
  over row ids by a fixed per-table affine permutation, so hot rows are not all at the
  start of the table (that matters for row-wise shards).

The mixture's hyper-parameters (`SyntheticParams`) were fitted so that an 856-table batch
of 65,536 samples reproduces the published aggregate statistics of
`fbgemm_t856_bs65536.pt`; `scripts/calibrate_synthetic.py` checks that claim (and refits
with `--fit`). Because the model is explicit, its *expected* statistics at any batch size
can be computed without sampling (`expected_stats`), which is also how trace-less tables
get indices that follow their reuse histogram (`embshard.data.indices`).
"""

from __future__ import annotations

import argparse
import gzip
import math
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from embshard.errors import EmbshardError, InputError
from embshard.io import atomic_path

#: The published target: fbgemm_t856_bs65536.pt (2021_locality_stats.txt, first block).
FULL_NUM_TABLES = 856
FULL_BATCH_SIZE = 65536
TARGET_NUM_INDICES = 887_017_990
TARGET_NUM_UNIQUE = 128_435_723
TARGET_POOLING_FACTOR = TARGET_NUM_INDICES / (FULL_NUM_TABLES * FULL_BATCH_SIZE)  # ≈ 15.81
#: "Histogram of col sizes": share of unique rows per reuse bin.
TARGET_ROW_HISTOGRAM = (
    0.473, 0.152, 0.139, 0.112, 0.072, 0.032, 0.011, 0.005, 0.002,
    0.001, 0.000, 0.000, 0.000, 0.000, 0.000, 0.000, 0.000,
)
#: "Ratio of index distribution at different column sizes": share of accesses per reuse bin.
TARGET_ACCESS_HISTOGRAM = (
    0.069, 0.044, 0.068, 0.101, 0.121, 0.104, 0.073, 0.058, 0.052,
    0.050, 0.049, 0.048, 0.048, 0.043, 0.031, 0.023, 0.019,
)

#: Multiplier of the per-table rank -> row permutation (a prime: coprime with any hash size
#: below it, which every realistic hash size is).
_PERM_MULT = 2654435761
MAX_ROWS = 60_000_000


@dataclass(frozen=True)
class SyntheticParams:
    """Hyper-parameters of the table mixture (see the module docstring).

    The defaults are the calibrated values (scripts/calibrate_synthetic.py --fit).
    """

    small_fraction: float = 0.1843  # share of tables with rows log-uniform in [1e2, 1e4]
    log10_rows_mean: float = 5.5261  # log-normal bulk of hash sizes
    log10_rows_std: float = 0.9627
    onehot_fraction: float = 0.2871  # share of bulk tables with pooling factor <= 1
    small_onehot_fraction: float = 0.4449  # share of small tables with pooling factor <= 1
    log_pooling_std: float = 0.7482  # spread of multi-hot pooling factors (natural log)
    zipf_mean: float = 0.4227  # per-table exponent s ~ N(mean + corr*z_rows, std)
    zipf_std: float = 0.3237
    zipf_rows_corr: float = 0.5075
    log_q: float = 0.5318  # Zipf-Mandelbrot offset q = exp(log_q)
    nb_shape: float = 2.0  # shape of the Gamma mixing bag lengths (multi-hot)
    pooling_factor: float = TARGET_POOLING_FACTOR  # mean bag length over all tables

    def validate(self) -> None:
        for name in ("small_fraction", "onehot_fraction", "small_onehot_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise InputError(f"synthetic parameter {name} must be in [0, 1], got {v}")
        for name in ("log10_rows_std", "log_pooling_std", "zipf_std", "nb_shape", "pooling_factor"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise InputError(f"synthetic parameter {name} must be finite and >= 0, got {v}")
        if self.nb_shape <= 0 or self.pooling_factor <= 0:
            raise InputError("synthetic parameters nb_shape and pooling_factor must be > 0")


DEFAULT_PARAMS = SyntheticParams()
#: The Zipf-Mandelbrot offset of every synthetic table.
DEFAULT_Q = math.exp(DEFAULT_PARAMS.log_q)


def _rows_z(log10_rows: np.ndarray | float, params: SyntheticParams) -> np.ndarray | float:
    """How many standard deviations a table's log10 hash size lies from the bulk's mean."""
    return (log10_rows - params.log10_rows_mean) / max(params.log10_rows_std, 1e-9)


def expected_zipf(rows: int, params: SyntheticParams = DEFAULT_PARAMS) -> float:
    """The mixture's expected Zipf exponent for a table of `rows` rows (its mean given the
    size, without the per-table noise): what a table with no reuse histogram is given."""
    z = float(np.clip(_rows_z(math.log10(max(int(rows), 1)), params), -3, 3))
    return float(np.clip(params.zipf_mean + params.zipf_rows_corr * z, 0.0, 3.0))


@dataclass(frozen=True)
class TableSpec:
    """The model of one synthetic table."""

    rows: int
    pooling_factor: float
    zipf: float
    q: float
    seed: int  # drives the rank -> row permutation

    @property
    def onehot(self) -> bool:
        return self.pooling_factor <= 1.0


# ----------------------------------------------------------------------------- popularity
def _h(y: np.ndarray | float, t: float) -> np.ndarray:
    """Antiderivative of y^-s with t = 1 - s, continuous through s = 1."""
    ly = np.log(y)
    if abs(t) < 1e-12:
        return ly
    return np.expm1(t * ly) / t


def _h_inv(v: np.ndarray, t: float) -> np.ndarray:
    if abs(t) < 1e-12:
        return np.exp(v)
    return np.exp(np.log1p(t * v) / t)


def rank_cdf(x: np.ndarray, rows: int, s: float, q: float) -> np.ndarray:
    """P(rank < x) for the continuous Zipf-Mandelbrot law on [0, rows)."""
    t = 1.0 - s
    lo = _h(q, t)
    hi = _h(rows + q, t)
    x = np.clip(np.asarray(x, dtype=np.float64), 0.0, rows)
    return (_h(x + q, t) - lo) / (hi - lo)


def sample_ranks(n: int, rows: int, s: float, q: float, rng: np.random.Generator) -> np.ndarray:
    """`n` ranks in [0, rows): floor of an inverse-CDF draw from the Zipf-Mandelbrot law."""
    t = 1.0 - s
    lo = _h(q, t)
    hi = _h(rows + q, t)
    u = rng.random(n)
    u *= hi - lo
    u += lo
    x = _h_inv(u, t)
    x -= q
    ranks = x.astype(np.int64)
    np.clip(ranks, 0, rows - 1, out=ranks)
    return ranks


def rank_to_row(ranks: np.ndarray, rows: int, seed: int) -> np.ndarray:
    """A fixed per-table permutation of [0, rows): hot ranks land on scattered row ids."""
    mult = _PERM_MULT % rows if rows > 1 else 0
    if rows > 1 and math.gcd(mult, rows) != 1:
        mult = 1
    out = ranks * mult  # int64; ranks < 6e7 and mult < 2.7e9 cannot overflow
    out += seed % rows if rows > 0 else 0
    out %= rows
    return out


def table_seed(name: str) -> int:
    """Stable per-table seed (zlib.crc32; Python's hash() differs per process)."""
    return zlib.crc32(name.encode())


# ----------------------------------------------------------------------------- table draw
def draw_table_specs(
    num_tables: int, seed: int = 0, params: SyntheticParams = DEFAULT_PARAMS
) -> list[TableSpec]:
    """The per-table model parameters of a synthetic dataset (seeded)."""
    if not isinstance(num_tables, (int, np.integer)) or num_tables <= 0:
        raise InputError(f"num_tables must be a positive integer, got {num_tables!r}")
    params.validate()
    rng = np.random.default_rng([int(seed), 0x5EED])
    z = rng.standard_normal((4, num_tables))
    u = rng.random((4, num_tables))

    # Hash sizes: small tables log-uniform in [1e2, 1e4], the rest log-normal.
    small = u[0] < params.small_fraction
    log10_rows = np.where(
        small, 2.0 + 2.0 * u[1], params.log10_rows_mean + params.log10_rows_std * z[0]
    )
    log10_rows = np.clip(log10_rows, 2.0, math.log10(MAX_ROWS))
    rows = np.round(10.0**log10_rows).astype(np.int64)
    z_rows = _rows_z(log10_rows, params)

    # Pooling factors: one-hot features (0.5 .. 1], multi-hot log-normal, rescaled so the
    # mean over tables equals the target (the realised draw, not just its expectation).
    onehot = np.where(small, u[3] < params.small_onehot_fraction, u[2] < params.onehot_fraction)
    pf_one = 0.5 + 0.5 * rng.random(num_tables)
    pf_multi = np.exp(params.log_pooling_std * z[1])
    multi_target = params.pooling_factor * num_tables - pf_one[onehot].sum()
    if (~onehot).any():
        for _ in range(20):  # rescale, clip to [1, 500], repeat until the mean is hit
            cur = pf_multi[~onehot].sum()
            pf_multi[~onehot] *= max(multi_target, 1e-9) / cur
            np.clip(pf_multi, 1.0, 500.0, out=pf_multi)
        pf = np.where(onehot, pf_one, pf_multi)
    else:
        pf = pf_one

    zipf = params.zipf_mean + params.zipf_rows_corr * np.clip(z_rows, -3, 3) + params.zipf_std * z[2]
    zipf = np.clip(zipf, 0.0, 3.0)
    q = math.exp(params.log_q)
    seeds = rng.integers(0, 2**31 - 1, size=num_tables)
    return [
        TableSpec(int(r), float(p), float(s), q, int(sd))
        for r, p, s, sd in zip(rows, pf, zipf, seeds)
    ]


def draw_lengths(spec: TableSpec, batch_size: int, rng: np.random.Generator, nb_shape: float) -> np.ndarray:
    """Bag lengths with mean `spec.pooling_factor`."""
    if spec.onehot:
        return (rng.random(batch_size) < spec.pooling_factor).astype(np.int64)
    lam = rng.gamma(nb_shape, spec.pooling_factor / nb_shape, size=batch_size)
    return rng.poisson(lam).astype(np.int64)


def table_trace(
    spec: TableSpec,
    batch_size: int,
    rng: np.random.Generator,
    nb_shape: float = DEFAULT_PARAMS.nb_shape,
) -> tuple[np.ndarray, np.ndarray]:
    """(lengths [batch_size], indices) of one synthetic table."""
    lengths = draw_lengths(spec, batch_size, rng, nb_shape)
    ranks = sample_ranks(int(lengths.sum()), spec.rows, spec.zipf, spec.q, rng)
    return lengths, rank_to_row(ranks, spec.rows, spec.seed)


def iter_synthetic_tables(
    num_tables: int,
    batch_size: int,
    seed: int = 0,
    params: SyntheticParams = DEFAULT_PARAMS,
) -> Iterator[tuple[TableSpec, np.ndarray, np.ndarray]]:
    """(spec, lengths, indices) per table, one table at a time (constant memory)."""
    _check_positive(batch_size=batch_size)
    specs = draw_table_specs(num_tables, seed, params)
    for t, spec in enumerate(specs):
        rng = np.random.default_rng([int(seed), 1, t])
        lengths, idx = table_trace(spec, batch_size, rng, params.nb_shape)
        yield spec, lengths, idx


# ----------------------------------------------------------------------------- file output
def generate_synthetic(
    path: str | Path,
    num_tables: int = 64,
    batch_size: int = 4096,
    seed: int = 0,
    *,
    scale: float | None = None,
    params: SyntheticParams = DEFAULT_PARAMS,
    compress: bool | None = None,
    compresslevel: int = 1,
) -> list[TableSpec]:
    """Write a dlrm_datasets-format file `(indices, offsets, lengths)` atomically.

    Args:
        path: output file; gzip-compressed when it ends in `.gz` (or `compress=True`).
        num_tables, batch_size: shape of the batch (ignored where `scale` is given).
        seed: everything is a function of the seed.
        scale: if given, `num_tables = round(856 * scale)` and `batch_size =
            round(65536 * scale)` (at least 1 each): a shrunken copy of the real file.
            The calibration holds per table at batch 65,536; at a smaller batch every
            table sees proportionally fewer accesses, so unique rows and the reuse
            histograms shift toward low counts (see `expected_stats`).
        params: mixture hyper-parameters (default: the calibrated ones).
    Returns:
        The per-table model parameters (hash sizes etc.), in table order.
    """
    if scale is not None:
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and 0 < scale <= 1):
            raise InputError(f"scale must be in (0, 1], got {scale!r}")
        num_tables = max(1, round(FULL_NUM_TABLES * scale))
        batch_size = max(1, round(FULL_BATCH_SIZE * scale))
    _check_positive(num_tables=num_tables, batch_size=batch_size)
    path = Path(path)
    if compress is None:
        compress = path.suffix == ".gz"
    specs = draw_table_specs(num_tables, seed, params)

    # Lengths first (cheap), so indices can be written in place without a second copy.
    all_lengths = np.empty((num_tables, batch_size), dtype=np.int64)
    rngs = [np.random.default_rng([int(seed), 1, t]) for t in range(num_tables)]
    for t, spec in enumerate(specs):
        all_lengths[t] = draw_lengths(spec, batch_size, rngs[t], params.nb_shape)
    offsets = np.zeros(num_tables * batch_size + 1, dtype=np.int64)
    np.cumsum(all_lengths.reshape(-1), out=offsets[1:])
    indices = np.empty(int(offsets[-1]), dtype=np.int64)
    for t, spec in enumerate(specs):
        a, b = offsets[t * batch_size], offsets[(t + 1) * batch_size]
        ranks = sample_ranks(int(b - a), spec.rows, spec.zipf, spec.q, rngs[t])
        indices[a:b] = rank_to_row(ranks, spec.rows, spec.seed)
        del ranks
    obj = (torch.from_numpy(indices), torch.from_numpy(offsets), torch.from_numpy(all_lengths))
    with atomic_path(path) as tmp:
        if compress:
            with gzip.open(tmp, "wb", compresslevel=compresslevel) as f:
                torch.save(obj, f)
        else:
            torch.save(obj, tmp)
    return specs


def _check_positive(**kw: object) -> None:
    for k, v in kw.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise InputError(f"{k} must be a positive integer, got {v!r}")


# ----------------------------------------------------------------------------- expectations
_BIN_HI = np.array([2**k for k in range(16)], dtype=np.float64)  # upper edges of bins 0..15
_BIN_LO = np.concatenate([[0.0], _BIN_HI[:-1]])


def _rank_groups(rows: int, s: float, q: float, exact: int = 256, ratio: float = 1.04):
    """Ranks grouped geometrically: (group sizes, probability of one rank in each group)."""
    k = min(rows, exact)
    edges = [np.arange(k + 1, dtype=np.float64)]
    if rows > k:
        n = int(math.ceil(math.log(rows / k) / math.log(ratio)))
        geo = np.unique(np.round(k * ratio ** np.arange(1, n + 1)))
        geo = geo[(geo > k) & (geo < rows)]
        edges.append(np.concatenate([geo, [rows]]))
    e = np.concatenate(edges)
    cdf = rank_cdf(e, rows, s, q)
    size = np.diff(e)
    return size, np.diff(cdf) / size


_EDGES = np.concatenate([[0.0], _BIN_HI])  # C(k) = P(X <= k) is taken at 0, 1, 2, 4, ..., 32768


def _below_negligible(a: float, log_eps: float = math.log(1e-40)) -> float:
    """The rate below which P(Poisson(rate) >= a) is under 1e-40 by the Chernoff bound
    exp(-rate + a (1 + ln rate - ln a)) (increasing in rate below a), a little low for safety:
    there P(X <= a - 1) is 1 to double precision."""
    lo, hi = 0.0, float(a)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= 0.0 or -mid + a * (1.0 + math.log(mid) - math.log(a)) < log_eps:
            lo = mid
        else:
            hi = mid
    return lo * (1.0 - 1e-9)


#: per edge e of _EDGES, the rates below which P(X <= e) is 1 to double precision (ascending)
_NEGLIGIBLE_BELOW = np.array([_below_negligible(e + 1.0) for e in _EDGES])


def _poisson_cdf_at_edges(lam: np.ndarray) -> torch.Tensor:
    """[len(lam), 17] P(Poisson(lam) <= e) at the edges e of `_EDGES`: the regularised upper
    incomplete gamma function Q(e + 1, lam), evaluated only where it is not 1 to double
    precision (above about twice the rate; there it is 1.0 exactly, as the function returns
    it): for a task's thousands of tables more than half the entries, and the same values."""
    lam = np.asarray(lam, dtype=np.float64)
    known = np.searchsorted(_NEGLIGIBLE_BELOW, lam, side="right")  # edges not negligible: a prefix
    order = np.argsort(known, kind="stable")  # rows by how many edges they need, in blocks
    bounds = np.searchsorted(known[order], np.arange(len(_EDGES) + 2))
    lam_sorted = torch.as_tensor(lam[order])
    a = torch.as_tensor(_EDGES + 1.0, dtype=torch.float64)
    block = torch.ones((len(lam), len(_EDGES)), dtype=torch.float64)
    for k in range(1, len(_EDGES) + 1):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        if hi > lo:
            block[lo:hi, :k] = torch.special.gammaincc(a[None, :k].expand(hi - lo, -1),
                                                       lam_sorted[lo:hi, None].expand(-1, k))
    out = torch.empty_like(block)
    out[torch.as_tensor(order)] = block
    return out


def _poisson_bin_moments(lam: np.ndarray, access: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """For Poisson(lam): P(count in bin k) and E[count; count in bin k], shape [len(lam), 17]
    (the second is None when not `access`: it costs as much again)."""
    lam_t = torch.as_tensor(lam, dtype=torch.float64)[:, None]
    # C(k) = P(X <= k) = Q(k + 1, lam); edges 0, 1, 2, 4, ..., 32768, inf.
    edges = torch.as_tensor(_EDGES, dtype=torch.float64)[None, :]

    def cdf(k: torch.Tensor) -> torch.Tensor:
        return torch.special.gammaincc(k + 1.0, lam_t.expand(-1, k.shape[1]))

    c = _poisson_cdf_at_edges(lam)                        # P(X <= e)
    rows = torch.cat([c[:, 1:] - c[:, :-1], 1.0 - c[:, -1:]], dim=1)
    if not access:
        return rows.numpy(), None
    cm = cdf(edges - 1.0)                                 # P(X <= e - 1)
    cm[:, 0] = 0.0                                        # P(X <= -1)
    acc = lam_t * torch.cat([cm[:, 1:] - cm[:, :-1], 1.0 - cm[:, -1:]], dim=1)
    return rows.numpy(), acc.numpy()


def expected_table_bins(
    rows: int, s: float, q: float, num_accesses: float, ratio: float = 1.04
) -> tuple[np.ndarray, np.ndarray]:
    """Expected (unique rows per reuse bin, accesses per reuse bin) of one table.

    Counts are Poisson(num_accesses * p_rank) per rank (the Poissonised multinomial).
    """
    size, p = _rank_groups(rows, s, q, ratio=ratio)
    r, a = _poisson_bin_moments(num_accesses * p)
    return (size[:, None] * r).sum(0), (size[:, None] * a).sum(0)


def expected_row_bins_many(
    tables: Sequence[tuple[int, float, float, float]], ratio: float = 1.04, chunk: int = 1 << 17
) -> list[np.ndarray]:
    """`expected_table_bins(rows, s, q, num_accesses, ratio)[0]` for each (rows, s, q,
    num_accesses) of `tables`, with the Poisson moments of many tables in one call per `chunk`
    rank groups (the per-call cost dominates for one table) and without the access moments.
    Equal, element for element, to the one-table function."""
    groups = [_rank_groups(int(rows), s, q, ratio=ratio) for rows, s, q, _ in tables]
    out: list[np.ndarray] = []
    i = 0
    while i < len(groups):
        j, n = i, 0
        while j < len(groups) and (j == i or n + len(groups[j][0]) <= chunk):
            n += len(groups[j][0])
            j += 1
        lam = np.concatenate([p * tables[k][3] for k, (_, p) in enumerate(groups[i:j], start=i)])
        r, _ = _poisson_bin_moments(lam, access=False)
        at = 0
        for size, _ in groups[i:j]:
            out.append((size[:, None] * r[at : at + len(size)]).sum(0))
            at += len(size)
        i = j
    return out


@dataclass
class AggregateStats:
    """Aggregate statistics of a batch over many tables (the published quantities)."""

    num_tables: int
    batch_size: int
    num_indices: float
    num_unique: float
    row_bins: np.ndarray     # unique rows per reuse bin
    access_bins: np.ndarray  # accesses per reuse bin

    @property
    def indices_per_bag(self) -> float:
        return self.num_indices / (self.num_tables * self.batch_size)

    @property
    def row_histogram(self) -> np.ndarray:
        return self.row_bins / max(self.row_bins.sum(), 1e-300)

    @property
    def access_histogram(self) -> np.ndarray:
        return self.access_bins / max(self.access_bins.sum(), 1e-300)

    @property
    def avg_reuse(self) -> float:
        return self.num_indices / max(self.num_unique, 1e-300)


def expected_stats(
    specs: Sequence[TableSpec], batch_size: int, ratio: float = 1.04
) -> AggregateStats:
    """Expected aggregate statistics of `specs` at `batch_size`, without sampling."""
    sizes, lams = [], []
    for spec in specs:
        size, p = _rank_groups(spec.rows, spec.zipf, spec.q, ratio=ratio)
        sizes.append(size)
        lams.append(p * spec.pooling_factor * batch_size)
    size = np.concatenate(sizes)
    r, a = _poisson_bin_moments(np.concatenate(lams))
    row_bins = (size[:, None] * r).sum(0)
    access_bins = (size[:, None] * a).sum(0)
    n = float(sum(s.pooling_factor for s in specs) * batch_size)
    return AggregateStats(len(specs), batch_size, n, float(row_bins.sum()), row_bins, access_bins)


def histogram_distances(got: Sequence[float], want: Sequence[float]) -> tuple[float, float]:
    """(total variation distance, max absolute bin difference) between two histograms."""
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    g = g / g.sum() if g.sum() > 0 else g
    w = w / w.sum() if w.sum() > 0 else w
    d = np.abs(g - w)
    return float(0.5 * d.sum()), float(d.max())


# ----------------------------------------------------------------------------- fitting a table
def fit_zipf(
    rows: int,
    pooling_factor: float,
    batch_size: int,
    reuse_histogram: Sequence[float] | None,
    q: float = DEFAULT_Q,
) -> float:
    """The Zipf exponent whose expected unique-row reuse histogram at `batch_size` is
    closest (L1) to `reuse_histogram`; where there is none, the calibrated mixture's expected
    exponent for `rows` (`expected_zipf`), the same one `features.imputed_histogram` uses."""
    if reuse_histogram is None or sum(reuse_histogram) <= 0 or pooling_factor <= 0:
        return expected_zipf(rows)
    want = np.asarray(reuse_histogram, dtype=np.float64)
    want = want / want.sum()
    grid = np.linspace(0.0, 2.5, 51)
    best, best_d = DEFAULT_PARAMS.zipf_mean, math.inf
    n = pooling_factor * batch_size
    for s in grid:
        r, _ = expected_table_bins(rows, float(s), q, n, ratio=1.15)
        tot = r.sum()
        if tot <= 0:
            continue
        d = float(np.abs(r / tot - want).sum())
        if d < best_d - 1e-12:
            best, best_d = float(s), d
    return best


# ----------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m embshard.data.synthetic",
        description="Write a synthetic dlrm_datasets-format embedding-bag file.",
    )
    ap.add_argument("out", help="output file (.pt, or .pt.gz for gzip)")
    ap.add_argument("--num-tables", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--scale", type=float, default=None,
                    help="fraction of the real file's 856 tables and 65,536 batch (overrides both)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        specs = generate_synthetic(
            args.out, args.num_tables, args.batch_size, args.seed, scale=args.scale
        )
    except EmbshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(specs)} tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
