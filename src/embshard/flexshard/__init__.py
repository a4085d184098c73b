"""FlexShard (Sethi et al., 2023): row-level, tiered sharding of sequence embedding tables.

* `stats`: per-row access counts from traces, fitted on earlier batches, evaluated on later ones.
* `rowmap`: the compact row remap of a row-level plan (rows moved to the front of a table).
* `routing`: where each id of each device is looked up under a plan, and the replica sync schedule.
* `traffic`: replay of held-out batches: bytes per link class and purpose, modeled comm time.
* `tiers`: the tier cuts FlexShard chooses (replicated / per-host / split) under a memory cap.
* `baselines`: table_wise, row_wise(_dedup), table_row_wise, data_parallel, hugectr_hybrid.
"""
