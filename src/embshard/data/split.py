"""Train / validation / test tables of a pool, and the check that a test task holds no table a
learned planner was trained or tuned on.

A learned planner is trained on `train` tables, every switch and hyperparameter is chosen on
tasks of `validation` tables, and claims are made on tasks of `test` tables, which nothing
trained or tuned on has seen. `TableSplit.of_pool` splits a pool by a seeded shuffle; its
`train` tables are exactly those of the two-way `embshard.data.tasks.split_pool` with test
fraction `validation_fraction + test_fraction` (the held-out half of the earlier two-way
split is now validation + test), so checkpoints trained on that split keep their meaning.

Tables are compared by identity, not only by name: a pool table keeps its rows and pooling
factor whatever dim a task gives it and whether or not a task drops its histogram, while two
pools both name their tables `t0, t1, …` (`table_key`). Every checkpoint's data card records
the split it was trained under (pool, seed, fractions, names and keys per split; `split.json`
beside it), and `check_unseen` refuses a task of test tables that holds a table of a
checkpoint's train or validation split, with one line naming the task and the table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from embshard.errors import InputError
from embshard.tables import Table
from embshard.task import Task

SPLITS = ("train", "validation", "test")


def table_key(rows: int, pooling_factor: float) -> str:
    """A pool table's identity across tasks: its rows and pooling factor (a task picks its dim
    and may drop its reuse histogram; the name is the pool's index and repeats across pools)."""
    return f"{int(rows)}:{float(pooling_factor):.9g}"


def key_of(table: Table | Mapping[str, Any]) -> str:
    if isinstance(table, Table):
        return table_key(table.rows, table.pooling_factor)
    return table_key(table["rows"], table["pooling_factor"])


@dataclass
class TableSplit:
    """Which tables of a pool are for training, validation and test.

    Attributes:
        pool: the pool it splits (a dataset or pool file; its name, for the data card).
        seed, validation_fraction, test_fraction: how it was drawn.
        tables: split -> table names (the pool's).
        keys: split -> table identities (`table_key`).
    """

    pool: str
    seed: int
    validation_fraction: float
    test_fraction: float
    tables: dict[str, list[str]] = field(default_factory=dict)
    keys: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def of_pool(cls, pool: Any, validation_fraction: float = 0.25, test_fraction: float = 0.25, seed: int = 0,
                pool_name: str | None = None) -> "TableSplit":
        """Split a pool (a file or a list of entries, as `embshard.data.tasks.load_pool`)."""
        from embshard.data.tasks import load_pool, split_pool

        for k, v in (("validation_fraction", validation_fraction), ("test_fraction", test_fraction)):
            if not (isinstance(v, (int, float)) and 0 < v < 1):
                raise InputError(f"{k} must be in (0, 1), got {v!r}")
        if validation_fraction + test_fraction >= 1:
            raise InputError(f"validation_fraction + test_fraction must be < 1, got {validation_fraction + test_fraction}")
        entries = load_pool(pool)
        if len(entries) < 3:
            raise InputError(f"cannot split a pool of {len(entries)} table(s) into train, validation and test")
        train, held = split_pool(entries, validation_fraction + test_fraction, seed)
        name = pool_name if pool_name is not None else (str(pool) if isinstance(pool, (str, os.PathLike)) else "<pool>")
        return cls.from_held_out(train, held, validation_fraction, test_fraction, seed, name)

    @classmethod
    def from_held_out(cls, train: Sequence[Mapping[str, Any]], held: Sequence[Mapping[str, Any]],
                      validation_fraction: float, test_fraction: float, seed: int, pool_name: str) -> "TableSplit":
        """Split the held-out entries of a two-way split into validation and test (a seeded
        shuffle, validation's share `validation_fraction / (validation_fraction + test_fraction)`);
        `of_pool` does this to `split_pool`'s held-out tables, NeuroShard's pre-training
        (`val_by: split`) to the cost-data collector's."""
        share = validation_fraction / (validation_fraction + test_fraction)
        n_val = min(max(1, round(share * len(held))), len(held) - 1) if len(held) > 1 else 0
        perm = np.random.default_rng([int(seed), 0x5A11D]).permutation(len(held))
        val = sorted(perm[:n_val].tolist())
        test = sorted(perm[n_val:].tolist())
        parts = {"train": list(train), "validation": [held[i] for i in val], "test": [held[i] for i in test]}
        return cls(pool_name, int(seed), float(validation_fraction), float(test_fraction),
                   {k: [e["name"] for e in v] for k, v in parts.items()},
                   {k: [key_of(e) for e in v] for k, v in parts.items()})

    def entries(self, pool: Any, which: str) -> list[dict[str, Any]]:
        """The pool entries of one split (the pool this split was made of)."""
        from embshard.data.tasks import load_pool

        if which not in SPLITS:
            raise InputError(f"split must be one of {', '.join(SPLITS)}, got {which!r}")
        names = set(self.tables[which])
        out = [e for e in load_pool(pool) if e["name"] in names]
        if len(out) != len(names) or {key_of(e) for e in out} != set(self.keys[which]):
            raise InputError(f"the pool given is not the one split {self.pool} was made of")
        return out

    def seen(self, before: str = "test") -> set[str]:
        """Keys a task of split `before` must not hold: train (and validation, for test tasks)."""
        return set(self.keys["train"]) | (set(self.keys["validation"]) if before == "test" else set())

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"pool": self.pool, "seed": self.seed, "validation_fraction": self.validation_fraction,
                "test_fraction": self.test_fraction, **{k: self.tables[k] for k in SPLITS},
                "keys": {k: self.keys[k] for k in SPLITS}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "split") -> "TableSplit":
        try:
            return cls(str(d["pool"]), int(d["seed"]), float(d["validation_fraction"]), float(d["test_fraction"]),
                       {k: [str(x) for x in d[k]] for k in SPLITS},
                       {k: [str(x) for x in d["keys"][k]] for k in SPLITS})
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: not a train/validation/test split ({type(e).__name__}: {e})") from None

    def save(self, path: str | os.PathLike) -> None:
        from embshard.io import write_json_atomic

        write_json_atomic(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TableSplit":
        import json

        p = Path(path)
        try:
            return cls.from_dict(json.loads(p.read_text()), str(p))
        except (OSError, ValueError) as e:
            raise InputError(f"{p}: cannot read a split ({type(e).__name__})") from None


@dataclass
class SeenTables:
    """The tables one checkpoint was trained or tuned on: keys (when its data card records
    them), else names within its pool."""

    source: str
    keys: set[str]
    pool: str | None = None
    names: set[str] = field(default_factory=set)


def seen_by_checkpoint(path: str | os.PathLike) -> SeenTables:
    """The train and validation tables a shipped checkpoint records (an RL `policy.pt`: its data
    card; a NeuroShard `cost_models.pt`: the train / val tables of its cost data)."""
    import torch

    p = Path(path)
    try:
        bundle = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise InputError(f"{p}: not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(bundle, dict):
        raise InputError(f"{p}: not a checkpoint")
    if "data_card" in bundle:  # an RL policy
        card = bundle["data_card"] or {}
        split = card.get("split")
        if split:
            s = TableSplit.from_dict(split, f"{p}: data_card.split")
            return SeenTables(str(p), s.seen("test"), s.pool, set(s.tables["train"]) | set(s.tables["validation"]))
        names = set(card.get("train_tables", [])) | set(card.get("validation_tables", []))
        return SeenTables(str(p), _keys_in_pool(card.get("pool"), names), card.get("pool"), names)
    data = bundle.get("data") or {}
    if data.get("split"):  # pre-trained with val_by=split: the pool's train / validation / test tables
        s = TableSplit.from_dict(data["split"], f"{p}: data.split")
        return SeenTables(str(p), s.seen("test"), s.pool, set(s.tables["train"]) | set(s.tables["validation"]))
    tables = data.get("tables") or {}
    keys = set(tables.get("train_keys", [])) | set(tables.get("val_keys", []))
    pool = (bundle.get("profile") or {}).get("pool") or {}
    names = set(tables.get("train", [])) | set(tables.get("val", [])) | set(pool.get("train_tables") or [])
    return SeenTables(str(p), keys or _keys_in_pool(pool.get("source"), names), pool.get("source"), names)


def pool_file(pool: str | os.PathLike | None) -> Path | None:
    """A recorded pool file, when it is here: as recorded, or by its name under the project's
    data/ (where pools are generated); None otherwise."""
    from embshard.data.default import ROOT

    if not pool or not Path(pool).name:
        return None
    for candidate in (Path(pool), ROOT / "data" / Path(pool).name):
        if candidate.is_file():
            return candidate
    return None


def _keys_in_pool(pool: str | None, names: set[str]) -> set[str]:
    """Keys of the named tables of a checkpoint's pool file, when that file is here
    (`pool_file`); empty otherwise (then names decide, within the same pool)."""
    from embshard.data.tasks import load_pool

    found = pool_file(pool)
    if found is None:
        return set()
    try:
        return {key_of(e) for e in load_pool(found) if e["name"] in names}
    except InputError:
        return set()


def check_unseen(tasks: Iterable[Task], seen: Sequence[SeenTables], pool: str | None = None) -> None:
    """Refuse any task holding a table some checkpoint was trained or tuned on.

    A table is seen when its key is among a checkpoint's recorded keys, or, for a checkpoint
    that records only names, when the tasks come from the checkpoint's own pool (same file
    name) and the name is among them.

    Raises:
        InputError: one line naming the task, the table and the checkpoint.
    """
    pool_name = Path(pool).name if pool else None
    for task in tasks:
        for t in task.tables:
            k = key_of(t)
            for s in seen:
                same_pool = pool_name is not None and s.pool is not None and Path(s.pool).name == pool_name
                if k in s.keys or (same_pool and not s.keys and t.name in s.names):
                    raise InputError(f"task {task.name!r}: table {t.name!r} ({k}) was trained or tuned on by "
                                     f"{s.source}: a test task holds unseen tables only")
