"""Rewrite cost data collected before 2026-11-27 so its traced pieces carry their replay's histogram.

    python scripts/replay_cost_data.py DATA_DIR OUT_DIR --pool data/synthetic_t512_bs4096_s1.pt

The collector measures a pool table by replaying the sample's batch of bags drawn with replacement
from the table's trace, and since 2026-11-27 records the reuse histogram of that replay
(`embshard.costs.features.replayed_table`), the one the cost models now see at planning time.
Data collected before recorded the trace's own histogram. This copies DATA_DIR to OUT_DIR (the
compute and comm samples, probes and profile) with every compute piece of a `--pool` table whose
histogram was not imputed given the replay's histogram at the sample's batch
(`features.replay_histogram`, ratio = batch / the pool's bags). Generated tables are drawn, not
replayed, and are left as they are. OUT_DIR appears whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from embshard.costs.features import replay_histogram  # noqa: E402
from embshard.costs.neural.samples import read_jsonl  # noqa: E402
from embshard.data.dlrm_datasets import open_cached  # noqa: E402
from embshard.errors import InputError  # noqa: E402


def rewrite(data_dir: Path, out_dir: Path, pool: Path) -> dict[str, int]:
    records = read_jsonl(data_dir / "compute.jsonl")
    if out_dir.exists():
        raise InputError(f"{out_dir} exists; give a new folder")
    ds = open_cached(pool)
    names = {f"t{i}" for i in range(ds.num_tables)}  # the pool's table names (`DlrmDataset.pool_entries`)
    bags = ds.batch_size
    counts = {"samples": 0, "pieces": 0, "replayed": 0}
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        lines = []
        for _, rec in records:
            counts["samples"] += 1
            for t in rec.get("tables", []) if rec.get("kind", "compute") == "compute" else []:
                counts["pieces"] += 1
                if t.get("name") in names and t.get("reuse_histogram") and not t.get("histogram_imputed"):
                    t["reuse_histogram"] = list(replay_histogram(t["reuse_histogram"], rec["batch_size"] / bags))
                    counts["replayed"] += 1
            lines.append(json.dumps(rec, separators=(",", ":")))
        (tmp / "compute.jsonl").write_text("\n".join(lines) + "\n")
        for extra in ("comm.jsonl", "profile.json", "probes"):
            p = data_dir / extra
            if p.is_dir():
                shutil.copytree(p, tmp / extra)
            elif p.is_file():
                shutil.copy2(p, tmp / extra)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--pool", type=Path, required=True, help="the dlrm_datasets file the collector's pool tables came from")
    args = ap.parse_args(argv)
    try:
        c = rewrite(args.data_dir, args.out_dir, args.pool)
    except InputError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir}: {c['samples']} samples, {c['replayed']} of {c['pieces']} pieces given their replay's histogram")
    return 0


if __name__ == "__main__":
    sys.exit(main())
