"""`collect`: measure this rank's missing chunks of compute and comm samples into a folder."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from embshard.costs.collect.config import resolve_config
from embshard.costs.collect.draws import (
    _chunk_rng,
    _measure_seed,
    _split,
    draw_compute_shard,
    draw_delays,
    draw_widths,
    select_pool,
    table_dims,
)
from embshard.costs.collect.profile import (
    _ensure_profile,
    _match_block,
    _pool_digest,
    hardware_profile,
    save_probe,
)
from embshard.costs.collect.ranks import chunk_owner, rank_info
from embshard.costs.collect.records import (
    FORMAT_VERSION,
    KINDS,
    _existing_chunks,
    _read_jsonl,
    chunk_path,
    comm_record,
    compute_record,
    piece_record,
)
from embshard.errors import InputError
from embshard.hardware.probe import Probe, measure_compute_with_probe, run_probe
from embshard.hardware.protocol import MeasurementProtocol
from embshard.io import atomic_path

log = logging.getLogger("embshard.costs.collect")

class Collected(NamedTuple):
    """What one `collect` call did."""

    out_dir: Path
    rank: int
    world_size: int
    new_chunks: dict[str, int]
    skipped_chunks: dict[str, int]
    new_samples: dict[str, int]
    seconds: dict[str, float]


def collect(
    cfg: Mapping[str, Any] | None,
    out_dir: str | os.PathLike,
    pool: Any = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    max_chunks: int | None = None,
    on_chunk: Callable[[str, int, Path], None] | None = None,
) -> Collected:
    """Collect this rank's missing chunks of compute and comm samples into `out_dir`.

    Args:
        cfg: the `collect` config group (conf/collect/*.yaml), or a dict; unset keys take
            DEFAULTS.
        out_dir: the collection folder; created, or resumed when it holds a matching profile.
        pool: the table pool (dlrm_datasets file, pool JSON or list of table dicts);
            default `cfg.pool`.
        rank, world_size: default torchrun's RANK / WORLD_SIZE (else 0 / 1).
        max_chunks: stop after collecting this many new chunks (None: all).
        on_chunk: called as on_chunk(kind, chunk, path) after each chunk file is written.

    Raises:
        InputError: bad config or pool, or `out_dir` holds data from another setup.
    """
    from embshard.data.tasks import load_pool

    c = resolve_config(cfg)
    pool = pool if pool is not None else c["pool"]
    if pool is None:
        raise InputError("collect: no table pool (set collect.pool or the dataset)")
    all_entries = load_pool(pool)
    exclude = list(c["exclude_tables"] or [])
    if c["exclude_tables_from"]:
        # a task split (split.json of stage=tasks): its test tables never enter pre-training
        from embshard.task import read_json

        split = read_json(c["exclude_tables_from"])
        if not isinstance(split, dict) or not isinstance(split.get("test"), list):
            raise InputError(f"{c['exclude_tables_from']}: expected a split with a 'test' list of table names")
        exclude += [n for n in split["test"] if n not in exclude]
    entries = select_pool(all_entries, c["tables"], exclude)
    train_entries, test_entries = _split(entries, c["holdout"])
    r, w, local_rank = rank_info(rank, world_size)
    device = c["device"]
    if str(device) == "cuda":
        device = f"cuda:{local_rank}"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    hardware = hardware_profile(c | {"device": device})
    pool_info = {
        "source": str(pool) if isinstance(pool, (str, os.PathLike)) else "in-memory list",
        "digest": _pool_digest(all_entries),
        "tables": [e["name"] for e in entries],
        "train_tables": [e["name"] for e in train_entries],
        "test_tables": [e["name"] for e in test_entries],
    }
    profile = {
        "format": FORMAT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware,
        "pool": pool_info,
        "collection": c,
        "match": _match_block(c, hardware, pool_info),
    }
    _ensure_profile(out, profile)

    todo: list[tuple[float, str, int]] = []
    skipped = {k: 0 for k in KINDS}
    for kind in KINDS:
        n_chunks = math.ceil(c[kind]["num_samples"] / c[kind]["chunk_size"])
        existing = _existing_chunks(out, kind)
        for ch, paths in existing.items():
            for p in paths:
                _read_jsonl(p, kind)  # a damaged chunk stops the run here, with its name
        for ch in range(n_chunks):
            if chunk_owner(kind, ch, w, c["comm"]["rank0_only"]) != r:
                continue
            if ch in existing:
                skipped[kind] += 1
                continue
            todo.append(((ch + 0.5) / n_chunks, kind, ch))
    todo.sort()
    if max_chunks is not None:
        todo = todo[: max(0, int(max_chunks))]

    dims = {"compute": table_dims(c["compute"]["dims"], c["compute"]["column_halves"])}
    new_chunks = {k: 0 for k in KINDS}
    new_samples = {k: 0 for k in KINDS}
    seconds = {k: 0.0 for k in KINDS}
    bar = None
    if c["progress"] and todo:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=f"cost data (rank {r}/{w})", unit="chunk")
    protocol = MeasurementProtocol.from_config(c["measure"])
    probe: Probe | None = None
    probe_id: str | None = None
    try:
        for done, (_, kind, ch) in enumerate(todo):
            if protocol.probe and done % c["probe_every_chunks"] == 0:
                # the session's speed probe, first and then every few chunks; comm samples name
                # the one timed closest before them, compute chunks track their own (below), so
                # pre-training can put every sample on one machine speed
                probe = run_probe(protocol, backend=c["backend"], device=device, comm_backend=c["comm"]["backend"])
                probe_id = save_probe(out, probe, r)
            t0 = time.perf_counter()
            if kind == "compute":
                samples = _compute_chunk(c, ch, train_entries, test_entries, dims["compute"], device, protocol, out, r,
                                         probe)
            else:
                samples = _comm_chunk(c, ch, protocol)
                if probe_id is not None:
                    samples = [s | {"probe": probe_id} for s in samples]
            path = chunk_path(out, kind, r, ch)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                tmp.write_text("".join(json.dumps(s, separators=(",", ":")) + "\n" for s in samples))
            seconds[kind] += time.perf_counter() - t0
            new_chunks[kind] += 1
            new_samples[kind] += len(samples)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(compute=new_samples["compute"], comm=new_samples["comm"])
            if on_chunk is not None:
                on_chunk(kind, ch, path)
    finally:
        if bar is not None:
            bar.close()
    for kind in KINDS:
        if new_samples[kind]:
            log.info("rank %d: %d new %s samples in %.0f s (%.1f/min), %d chunks already there",
                     r, new_samples[kind], kind, seconds[kind], 60 * new_samples[kind] / max(seconds[kind], 1e-9),
                     skipped[kind])
    return Collected(out, r, w, new_chunks, skipped, new_samples, seconds)


def _chunk_batch(section: Mapping[str, Any], default: int, rng: np.random.Generator) -> int:
    """The batch size of one chunk: drawn from the section's `batch_sizes`, else `default`."""
    sizes = section.get("batch_sizes")
    return int(rng.choice(np.asarray(sizes))) if sizes else int(default)


def _compute_chunk(c: dict[str, Any], chunk: int, train: list, test: list, dims: list[int],
                   device: str, protocol: MeasurementProtocol, out: Path, rank: int,
                   session: Probe | None) -> list[dict[str, Any]]:
    """One chunk of compute samples. With the protocol's probe, the probe's kernels are timed
    interleaved with the chunk's shards and saved as the chunk's own probe, which its samples
    name (the machine's speed while they were measured)."""
    from embshard.hardware.backends import ShardInput
    from embshard.hardware.compute import measure_compute

    k = c["compute"]
    rng = _chunk_rng(c["seed"], "compute", chunk)
    batch = _chunk_batch(k, c["batch_size"], rng)
    generated = k["generated"] if k["pool_share"] < 1 or not (train or test) else None
    pool_share = k["pool_share"]
    if k["pool_batch_sizes"] is not None and batch not in k["pool_batch_sizes"]:
        # a pool table's histogram (and trace) describe it at the trace's batch only
        pool_share = 0.0
        generated = k["generated"]
    shards, splits = [], []
    for i in range(k["chunk_size"]):
        side = "test" if rng.random() < c["holdout"]["sample_share"] and (test or generated) else "train"
        entries = test if side == "test" else train
        n = int(rng.integers(k["min_tables"], k["max_tables"] + 1))
        cap = None
        if k["max_lookups"] is not None:  # log-uniform in [cap/100, cap]: mostly small shards, some at the cap
            cap = float(k["max_lookups"]) * math.exp(-rng.uniform(0.0, math.log(100.0)))
        drawn = draw_compute_shard(entries, dims, n, k["max_bytes"], k["pair_prob"], rng, batch_size=batch,
                                   generated=generated, pool_share=pool_share, row_piece_prob=k["row_piece_prob"],
                                   row_parts=k["row_parts"], max_lookups=cap, prefix=f"g{chunk:06d}-{i:03d}-")
        if not drawn:
            raise InputError(f"collect: no {side} table fits under compute.max_bytes={k['max_bytes']} at any dim")
        shards.append(drawn)
        splits.append(side)
    sets = [[ShardInput(t, sh) for t, sh in s] for s in shards]
    kw = dict(backend=c["backend"], device=device, optimizer=c["optimizer"], protocol=protocol,
              seed=_measure_seed(c["seed"], "compute", chunk), max_cached_bytes=k["max_cached_bytes"])
    tag: dict[str, Any] = {}
    if protocol.probe:
        timings, tracked = measure_compute_with_probe(sets, batch, session=session, **kw)
        tag = {"probe": save_probe(out, tracked, rank)}
    else:
        timings = measure_compute(sets, batch, **kw)
    return [
        compute_record(f"compute-{chunk:06d}-{i:03d}", side, [piece_record(t, sh, batch) for t, sh in s], batch,
                       tm.median_ms, tm.spread_ms, tm.samples_ms, noise=round(tm.noise, 5), **tag)
        for i, (s, side, tm) in enumerate(zip(shards, splits, timings))
    ]


def _comm_chunk(c: dict[str, Any], chunk: int, protocol: MeasurementProtocol) -> list[dict[str, Any]]:
    from embshard.hardware.comm import CommConfig, measure_comm

    m = c["comm"]
    rng = _chunk_rng(c["seed"], "comm", chunk)
    d = int(rng.integers(m["min_devices"], m["max_devices"] + 1))
    batch = _chunk_batch(m, c["batch_size"], rng)
    max_width = None
    if m["max_mb_per_rank"] is not None:
        # a rank's buffers hold 2 x (batch x its width + its samples x total width) floats;
        # a balanced config of width w per device: 16 x batch x w bytes <= the cap
        max_width = max(4, int(m["max_mb_per_rank"] * 1e6 / (16.0 * batch) / 4) * 4)
    md = m["max_delay_ms"]
    if isinstance(md, list):
        md = float(math.exp(rng.uniform(math.log(md[0]), math.log(md[1]))))
    configs = [
        CommConfig.make(draw_widths(d, m["dims"], m["tables_per_device"], rng, max_width), draw_delays(d, md, rng))
        for _ in range(m["chunk_size"])
    ]
    results = measure_comm(configs, batch, protocol=protocol,
                           backend=m["backend"], timeout_s=m["timeout_s"])
    return [comm_record(f"comm-{chunk:06d}-{i:03d}", batch, cfg.widths, cfg.delays_ms, res.forward_ms, res.backward_ms,
                        res.forward_spread_ms, res.backward_spread_ms,
                        forward_noise=[round(x, 5) for x in res.forward_noise],
                        backward_noise=[round(x, 5) for x in res.backward_noise])
            for i, (cfg, res) in enumerate(zip(configs, results))]
