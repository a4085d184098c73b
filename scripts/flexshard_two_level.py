"""What ids deduplicated per HOST would save FlexShard's plans (an estimate; the data path does
not route this way): a lookup that crosses hosts goes first to the requester's rail proxy (the
device of its own host with the owner's local index), which sends each distinct id once to the
owner and hands the vectors back (and the gradients forward) inside the host.

    python scripts/flexshard_two_level.py experiments/flexshard/heldout/shard/report.json

Reads the plans and the replayed steps of a `shard.py evaluate=traffic` report (its config.yaml)
and prints, per task, the inter-host all-to-all bytes and the modeled communication of
FlexShard's plan (`plans/<task>/flexshard.json`) as routed today (ids deduplicated per device,
embshard.flexshard.traffic) and with the two-level routing, counted by the same model: the
same phases, the all-to-all's inter-host pairs deduplicated per host, plus three intra-host
phases (ids to the proxy, vectors back, gradients to the proxy). The plans stay as fitted for
today's routing; a plan fitted for the other routing could do better.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from embshard.flexshard.traffic import FLOAT_BYTES, ID_BYTES, LUT_MAX_ROWS, Batch, StepTraffic, TrafficModel, phase_ms

ALL_TO_ALL = ("ids", "embeddings_fw", "gradients_bw")


def two_level_step(model: TrafficModel, batch: Batch) -> tuple[StepTraffic, StepTraffic]:
    """(today's step, the same step routed two-level) of a plan that deduplicates ids."""
    if not model.plan.dedup_ids:
        raise ValueError(f"plan {model.plan.algorithm!r} does not deduplicate ids")
    d, per = model.D, model.task.devices_per_host
    host, local = np.arange(d) // per, np.arange(d) % per
    today = model.step(batch)
    ids_m = np.full((d, d), float(ID_BYTES * model.num_columns))  # the split counts, as today
    fw = np.zeros((d, d))
    to_proxy, back = np.zeros((d, d)), np.zeros((d, d))
    sample_src = np.repeat(np.arange(d), model.samples_per_device)
    for name, route in model.routes.items():
        t = route.table
        ids, lengths = batch[name]
        key = np.unique(np.repeat(sample_src, lengths) * t.rows + np.asarray(ids, dtype=np.int64))
        src, ids = key // t.rows, key % t.rows  # per device, each distinct id once
        for col in route.columns:
            if t.rows <= LUT_MAX_ROWS:
                seg = col.segment_lut(route.row_map)[ids]
            else:
                seg = np.searchsorted(col.seg_starts, route.row_map.to_new(torch.from_numpy(ids)).numpy(), side="right") - 1
            dest = col.dest[src, seg]
            cross = host[src] != host[dest]
            n = np.bincount(src[~cross] * d + dest[~cross], minlength=d * d).reshape(d, d).astype(np.float64)
            proxy = host[src[cross]] * per + local[dest[cross]]
            pair = np.unique((proxy * d + dest[cross]) * t.rows + ids[cross]) // t.rows  # per host, once
            n += np.bincount(pair, minlength=d * d).reshape(d, d)
            f = np.bincount(src[cross] * d + proxy, minlength=d * d).reshape(d, d).astype(np.float64)
            np.fill_diagonal(f, 0.0)
            ids_m += ID_BYTES * n
            fw += FLOAT_BYTES * col.dim * n.T
            to_proxy += ID_BYTES * f
            back += FLOAT_BYTES * col.dim * f.T
    np.fill_diagonal(ids_m, 0.0)
    np.fill_diagonal(fw, 0.0)
    phases = dict(today.phases, ids=ids_m, embeddings_fw=fw, gradients_bw=fw.T.copy(), ids_to_proxy=to_proxy,
                  embeddings_from_proxy=back, gradients_to_proxy=back.T.copy())
    return today, StepTraffic(phases)


def inter_host_all_to_all(model: TrafficModel, step: StepTraffic) -> float:
    return float(sum(np.where(model.intra, 0.0, step.phases[p]).sum() for p in ALL_TO_ALL))


def modeled_ms(model: TrafficModel, step: StepTraffic) -> float:
    return sum(phase_ms(m, model.intra, model.intra_bytes_per_ms, model.inter_bytes_per_ms) for m in step.phases.values())


def main() -> None:
    from omegaconf import OmegaConf

    from embshard.flexshard.stats import BatchSplit
    from embshard.flexshard.traffic import global_batches
    from embshard.plan import Plan
    from embshard.task import load_tasks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="report.json of shard.py evaluate=traffic runs that planned flexshard")
    args = ap.parse_args()
    for rep in map(Path, args.reports):
        config = rep.parent / "config.yaml"
        if not config.is_file():
            sys.exit(f"error: {rep}: no config.yaml beside it to name its tasks and replayed steps")
        cfg = OmegaConf.load(config)
        split = BatchSplit(cfg.traffic.fit_batches, cfg.traffic.eval_batches, cfg.traffic.seed)
        for task in load_tasks(cfg.task_file):
            path = rep.parent / "plans" / task.name / "flexshard.json"
            if not path.is_file():
                path = rep.parent / "plans" / "flexshard.json"  # a report of one task
            if not path.is_file():
                sys.exit(f"error: {rep}: no flexshard plan for task {task.name!r}")
            model = TrafficModel(task, Plan.load(path))
            a = b = ia = ib = 0.0
            for batch in global_batches(task, split.eval_steps, split.seed):
                today, two = two_level_step(model, batch)
                a, b = a + modeled_ms(model, today), b + modeled_ms(model, two)
                ia, ib = ia + inter_host_all_to_all(model, today), ib + inter_host_all_to_all(model, two)
            print(f"{task.name}: {task.hosts} hosts; inter-host all-to-all {ia / 2**20:.1f} -> {ib / 2**20:.1f} MB "
                  f"({ib / ia:.3f}x); modeled comm {a:.3f} -> {b:.3f} ms over {len(split.eval_steps)} steps "
                  f"({b / a:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
