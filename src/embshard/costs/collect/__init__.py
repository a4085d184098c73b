"""Cost-data collection for the learned cost models (NeuroShard's "pre-train" data).

Two kinds of samples, both measured on real hardware:

* **compute**: a random shard of 1..N tables drawn from an *augmented* table pool (every
  pool table at every dim of a dim set, plus the column halves d/2 that column-wise splits
  produce; optionally both halves of one table on the same device), under a cap on the
  shard's weight bytes. Label: the fused forward+backward (fused optimizer update) time of
  ONE kernel holding the shard (`hardware.compute.measure_compute`: median, IQR, samples).
* **comm**: random per-device embedding widths for D devices (D drawn per chunk from a
  range), each device's width the sum of some random tables' dims, placed somewhere between
  balanced and random, and random per-device compute delays (0..max ms, the smallest one
  0). Labels: per-device forward all-to-all time (from the device's own entry, so it
  includes waiting for the slowest) and backward time, between D real processes
  (`hardware.comm.measure_comm`, one spawn per chunk).

Layout of an output folder::

    profile.json                       hardware profile + collection config (checked on resume)
    compute/rank00-chunk000012.jsonl   one JSON object per line, written atomically per chunk
    comm/rank00-chunk000003.jsonl
    compute.jsonl, comm.jsonl          `merge`: all chunks, validated, deduplicated, in order

Work is cut into chunks of `chunk_size` samples. Chunk c of a kind is a pure function of
(seed, kind, c): its random draws use the seed [seed, kind code, c]. Chunk c belongs to rank
c mod WORLD_SIZE (torchrun's RANK / WORLD_SIZE; comm chunks to rank 0 only when
`comm.rank0_only`), so the *inputs* of a collection do not depend on how many ranks ran it.
A chunk whose file exists (under any rank's name) is skipped: a killed run, restarted with
the same command, continues where it stopped. `num_samples` is rounded up to whole chunks,
so raising it later only adds chunks.

Every sample carries `id` ("<kind>-<chunk>-<index>", unique within a folder) and `split`
("train", or "test" when it was drawn from held-out tables; see `holdout`); every table of a
compute sample keeps its pool `name`, so a trainer can also hold out by table name itself.

The package, one module per role: `config` (the settings and their checks), `draws` (the
table pool and what is measured), `profile` (profile.json: host, versions, the match block
checked on resume), `records` (sample records, validation, chunk files, merge), `ranks`
(torchrun helpers) and `run` (`collect` itself).
"""

from embshard.costs.collect.config import DEFAULTS, resolve_config
from embshard.costs.collect.draws import (
                                          augmented_pool,
                                          draw_compute_shard,
                                          draw_delays,
                                          draw_widths,
                                          select_pool,
                                          table_dims,
)
from embshard.costs.collect.profile import (
                                          device_name,
                                          hardware_profile,
                                          library_versions,
                                          read_profile,
)
from embshard.costs.collect.ranks import chunk_owner, env_int, rank_info, wait_for_ranks
from embshard.costs.collect.records import (
                                          FORMAT_VERSION,
                                          KINDS,
                                          PROFILE,
                                          Merged,
                                          chunk_path,
                                          comm_record,
                                          compute_record,
                                          load_samples,
                                          merge,
                                          piece_record,
)
from embshard.costs.collect.run import Collected, collect

__all__ = [
    "DEFAULTS", "resolve_config", "augmented_pool", "draw_compute_shard", "draw_delays", "draw_widths", "select_pool",
    "table_dims", "device_name", "hardware_profile", "library_versions", "read_profile", "chunk_owner", "env_int",
    "rank_info", "wait_for_ranks", "FORMAT_VERSION", "KINDS", "PROFILE", "Merged", "chunk_path", "comm_record",
    "compute_record", "load_samples", "merge", "piece_record", "Collected", "collect",
]
