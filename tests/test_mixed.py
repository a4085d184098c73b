"""A task of pooled and sequence tables given to a planner of pooled tables (embshard.search.mixed):
planned in two parts in one memory budget by embshard.plan and EmbShardPlanner, with the
sequence tables on the devices the pooled plan left light, a fallback that says why, and the
errors of a task no plan fits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import embshard
from embshard import InfeasibleError, Plan, Shard, Table, Task, validate
from embshard.api import plan_with_info
from embshard.search.baselines import GreedySharder
from embshard.search.mixed import SEQUENCE_PLANNER, shard_mixed

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _pooled_only(task: Task) -> Task:
    return dataclasses.replace(task, tables=tuple(t for t in task.tables if not t.is_sequence))


def test_example_task_neuroshard_plans_its_pooled_table_and_the_sequence_tables_fill_the_light_devices():
    task = Task.load(ROOT / "examples" / "tasks" / "sequence.json")  # user_id pooled; two sequence tables
    plan = embshard.plan(task, algorithm="neuroshard")
    validate(task, plan)
    assert plan.algorithm == "neuroshard" and {s.table for s in plan.shards} == {t.name for t in task.tables}
    # the pooled part is NeuroShard's own plan of the pooled tables in the memory left beside the
    # sequence tables' reservation (the most any device's sequence tables take)
    _, info = plan_with_info(task, embshard.api.searcher("neuroshard"), "neuroshard")
    # both sequence tables in TorchRec's row blocks, one per device
    blocks = [Shard("clicked_items", d, 0, 32, 125_000 * d, 125_000) for d in range(4)] + [
        Shard("searched_terms", d, 0, 16, 20_000 * d, 20_000) for d in range(4)]
    step1 = Plan(task.name, "x", blocks)
    assert info == {"sequence_planner": SEQUENCE_PLANNER, "sequence_tables": 2, "pooled_tables": 1,
                    "reserved_bytes": max(step1.memory_bytes(task)), "row_split": ["clicked_items", "searched_terms"]}
    assert sorted(map(repr, (s for s in plan.shards if s.table != "user_id"))) == sorted(map(repr, blocks))
    pooled = embshard.plan(dataclasses.replace(_pooled_only(task), device_memory_bytes=task.device_memory_bytes
                                               - info["reserved_bytes"]), algorithm="neuroshard")
    assert sorted(map(repr, (s for s in plan.shards if s.table == "user_id"))) == sorted(map(repr, pooled.shards))


def test_every_sequence_table_is_cut_into_row_blocks_unless_its_types_leave_out_row_wise():
    """TorchRec's row blocks, one per device, for each sequence table row_wise is allowed for;
    one whose sharding_types leave it out is placed whole by work beside the blocks."""
    tables = (Table("p0", 800, 16, 2.0), Table("s0", 1000, 32, 30.0, kind="sequence"),
              Table("s1", 600, 8, 4.0, kind="sequence"), Table("p1", 300, 8, 1.0))
    task = Task("cut", 2, 64 * MiB, 256, tables)
    got = shard_mixed(task, GreedySharder("lookup", name="lookup_greedy").shard, "lookup_greedy")
    validate(task, got.plan)
    assert got.row_split == ("s0", "s1") and got.info()["row_split"] == ["s0", "s1"]
    assert sorted((s.table, s.device, s.row_offset, s.rows) for s in got.plan.shards if s.table in ("s0", "s1")) == [
        ("s0", 0, 0, 500), ("s0", 1, 500, 500), ("s1", 0, 0, 300), ("s1", 1, 300, 300)]
    # s1 table_wise only: whole, on the device the pooled plan and the blocks left lighter
    # (lookup_greedy: p0, 256 x 2 x 16, on device 0; p1, 256 x 1 x 8, on device 1)
    tw = dataclasses.replace(task, tables=tuple(dataclasses.replace(t, sharding_types=("table_wise",)) if t.name == "s1"
                                               else t for t in tables))
    got = shard_mixed(tw, GreedySharder("lookup", name="lookup_greedy").shard, "lookup_greedy")
    validate(tw, got.plan)
    assert got.row_split == ("s0",)
    assert {s.table: s.device for s in got.plan.shards if s.table != "s0"} == {"p0": 0, "p1": 1, "s1": 1}
    # a table of fewer rows than devices gives some device no block: whole
    few = dataclasses.replace(task, tables=tuple(dataclasses.replace(t, rows=1) if t.name == "s1" else t for t in tables))
    assert shard_mixed(few, GreedySharder("lookup", name="lookup_greedy").shard, "x").row_split == ("s0",)


def test_sequence_tables_go_largest_first_to_the_least_worked_device_with_room():
    # 3 devices; the pooled heuristic puts p0 (heavy) on device 0 and p1 (light) on device 1
    # (sequence tables that may only be table_wise: not cut into row blocks)
    tw = ("table_wise",)
    tables = (Table("p0", 1000, 64, 10.0), Table("p1", 1000, 16, 2.0),
              Table("s0", 1000, 32, 8.0, kind="sequence", sharding_types=tw),
              Table("s1", 1000, 32, 4.0, kind="sequence", sharding_types=tw),
              Table("s2", 1000, 8, 1.0, kind="sequence", sharding_types=tw))
    task = Task("mix", 3, 64 * MiB, 256, tables)
    pooled = GreedySharder("lookup", name="lookup_greedy")
    got = shard_mixed(task, pooled.shard, "lookup_greedy")
    where = {s.table: s.device for s in got.plan.shards}
    assert (where["p0"], where["p1"]) == (0, 1)
    # work = batch x pooling x dim x 4 bytes: p0 163,840 x 4, p1 8,192 x 4; s0 65,536 x 4 goes to the
    # empty device 2, then s1 (32,768 x 4) to device 1 (8,192), then s2 (2,048 x 4) to device 1 (40,960)
    # again, below device 2's 65,536 and device 0's 163,840
    assert (where["s0"], where["s1"], where["s2"]) == (2, 1, 1)
    assert got.fallback is None and got.plan.algorithm == "lookup_greedy"
    validate(task, got.plan)


def test_a_sequence_table_not_placed_whole_keeps_the_sequence_heuristics_placement():
    # s0 may only be column_wise (never cut by rows here): the heuristic's constraint shaping cuts it into
    # column slices; the sequence tables are kept as that step placed them
    tables = (Table("p0", 1000, 64, 10.0), Table("s0", 1000, 32, 8.0, kind="sequence", sharding_types=["column_wise"],
                                                 min_partition=16),
              Table("s1", 1000, 32, 4.0, kind="sequence", sharding_types=["table_wise"]))
    task = Task("mixcw", 2, 64 * MiB, 256, tables)
    plan = embshard.plan(task, algorithm="neuroshard")
    validate(task, plan)  # the constraint included
    from embshard.search.constrained import shard_constrained
    seq_alone = shard_constrained(GreedySharder("size_lookup", name=SEQUENCE_PLANNER), dataclasses.replace(
        task, tables=tables[1:]))
    assert sorted(map(repr, (s for s in plan.shards if s.table != "p0"))) == sorted(map(repr, seq_alone.shards))
    assert len([s for s in plan.shards if s.table == "s0"]) > 1


def test_pooled_tables_that_do_not_fit_beside_the_reservation_fall_back_to_the_heuristic_and_say_so(caplog):
    # 2 devices of 10 MiB: s0 (6.1 MiB) reserves 6.1 MiB on both, so p0 (6.1 MiB, table_wise only) has no room
    # beside it; the whole task by size_lookup_greedy puts them on different devices
    row = 64 * 4
    # (s0 table_wise only: its row blocks would leave p0 room)
    tables = (Table("p0", 25_000, 64, 1.0, sharding_types=["table_wise"]),
              Table("s0", 25_000, 64, 1.0, kind="sequence", sharding_types=["table_wise"]))
    task = Task("fb", 2, 10 * MiB, 8, tables)
    assert all(task.table_memory_bytes(t) > 25_000 * row for t in tables)
    with caplog.at_level("WARNING", logger="embshard.search.mixed"):
        plan, info = plan_with_info(task, embshard.api.searcher("neuroshard"), "neuroshard")
    validate(task, plan)
    assert plan.algorithm == "neuroshard" and {s.device for s in plan.shards} == {0, 1}
    assert info["fallback"].startswith("neuroshard: the pooled tables do not fit beside the sequence tables' "
                                       f"reservation of {info['reserved_bytes']} bytes per device (table 'p0'")
    assert info["fallback"].endswith(f"the whole task planned by {SEQUENCE_PLANNER}")
    assert "\n" not in info["fallback"] and info["fallback"] in caplog.text


def test_a_sequence_table_that_fits_no_device_is_the_sequence_heuristics_one_line_error():
    tables = (Table("p0", 25_000, 64, 1.0), Table("s0", 40_000, 64, 1.0, kind="sequence", sharding_types=["table_wise"]))
    with pytest.raises(InfeasibleError, match=r"^table 's0' needs \d+ bytes but the most free memory on any device is "
                       r"\d+ bytes \(device 0\): short by \d+ bytes$") as e:
        embshard.plan(Task("nofit", 2, 8 * MiB, 8, tables), algorithm="neuroshard")
    assert e.value.table == "s0" and e.value.shortfall_bytes > 0
    # where it may be cut by rows, its two blocks fit
    cut = embshard.plan(Task("fit", 2, 8 * MiB, 8, (tables[0], Table("s0", 40_000, 64, 1.0, kind="sequence"))),
                        algorithm="neuroshard")
    assert sorted(s.rows for s in cut.shards if s.table == "s0") == [20_000, 20_000]


def test_a_task_no_plan_fits_names_the_heuristics_table_and_the_planners_own_error():
    # one device of 10 MiB: s0 fits alone (the reservation), p0 not beside it, and not the two together
    tables = (Table("p0", 25_000, 64, 1.0, sharding_types=["table_wise"]), Table("s0", 25_000, 64, 1.0, kind="sequence"))
    with pytest.raises(InfeasibleError, match=r"short by \d+ bytes \(size_lookup_greedy on the whole task, "
                       r"after neuroshard found no plan of the pooled tables beside the sequence tables' reservation "
                       r"of \d+ bytes per device: table 'p0'") as e:
        embshard.plan(Task("nofit1", 1, 10 * MiB, 8, tables), algorithm="neuroshard")
    assert "\n" not in str(e.value) and e.value.table in ("p0", "s0") and e.value.shortfall_bytes > 0


def test_sequence_tables_that_fill_a_device_leave_the_whole_task_to_the_heuristic():
    # 2 devices, each exactly as large as the sequence table: its reservation leaves no memory for a
    # pooled task, so the whole task goes to size_lookup_greedy (which puts p0 on the other device)
    s0 = Table("s0", 1000, 8, 1.0, kind="sequence", sharding_types=["table_wise"])  # (its row blocks would leave room)
    probe = Task("edge", 2, 1 << 30, 8, (Table("p0", 100, 8, 1.0), s0))
    task = dataclasses.replace(probe, device_memory_bytes=probe.table_memory_bytes(s0))
    plan, info = plan_with_info(task, embshard.api.searcher("neuroshard"), "neuroshard")
    validate(task, plan)
    assert info["reserved_bytes"] == task.device_memory_bytes
    assert info["fallback"].startswith("neuroshard: the pooled tables do not fit beside the sequence tables' "
                                       "reservation") and "take all" in info["fallback"]


def test_embshard_planner_plans_a_model_of_both_collections_with_neuroshard():
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import Topology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    meta = torch.device("meta")
    model = torch.nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"b{k}", num_embeddings=2000 * (k + 1),
                                                                  embedding_dim=16 * (k + 1), feature_names=[f"f{k}"])
                                               for k in range(4)], device=meta)
    model.ec = EmbeddingCollection(tables=[EmbeddingConfig(name=f"s{k}", num_embeddings=3000, embedding_dim=16,
                                                           feature_names=[f"g{k}"]) for k in range(2)], device=meta)
    planner = embshard.EmbShardPlanner(topology=Topology(world_size=2, compute_device="cpu", local_world_size=2),
                                       batch_size=64, algorithm="neuroshard")
    sharding = planner.plan(model, [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])
    assert set(sharding.plan) == {"ebc", "ec"}
    assert set(sharding.plan["ebc"]) == {"b0", "b1", "b2", "b3"} and set(sharding.plan["ec"]) == {"s0", "s1"}
    validate(planner.last_task, planner.last_plan)
    assert planner.last_mixed["pooled_tables"] == 4 and planner.last_mixed["sequence_tables"] == 2
    assert "4 pooled table(s) by neuroshard, 2 sequence table(s) by size_lookup_greedy" in planner.last_summary


@pytest.mark.parametrize("types, device", [(None, 1), (["column_wise"], 0)], ids=["free", "column_wise_only"])
def test_a_sequence_table_whose_types_leave_out_table_wise_is_not_placed_again(types, device):
    # the sequence heuristic alone puts s0 (the heavier) on device 0; placed again by work it goes to
    # device 1, away from the pooled p0, unless its sharding_types leave out table_wise (then step 1 stands)
    tables = (Table("p0", 1000, 64, 10.0), Table("s0", 1000, 32, 8.0, kind="sequence", sharding_types=types),
              Table("s1", 1000, 32, 4.0, kind="sequence"))
    task = Task("mixtypes", 2, 64 * MiB, 256, tables)
    got = shard_mixed(task, GreedySharder("lookup").shard, "lookup_greedy")
    assert {s.table: s.device for s in got.plan.shards}["s0"] == device
    validate(task, got.plan)
