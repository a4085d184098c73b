"""Exceptions that the command-line entry points turn into one-line errors.

Every error a user can cause by handing us bad input derives from `EmbshardError`, so
`shard.py` and `train.py` can print `error: <message>` and exit non-zero without a
traceback, while genuine bugs still surface with one.
"""

from __future__ import annotations

import difflib
from typing import Any, Collection, Iterable


class EmbshardError(Exception):
    """Base class for errors caused by user input or by an impossible request."""


class InputError(EmbshardError):
    """Malformed or out-of-range input: task JSON, plan JSON, dataset files, config."""


class PlanError(EmbshardError):
    """A plan breaks a rule: a table uncovered or covered twice, memory exceeded, bad split."""


class InfeasibleError(PlanError):
    """No valid plan can be produced; the message names the table and the shortfall in bytes."""

    def __init__(self, message: str, table: str | None = None, shortfall_bytes: int | None = None):
        super().__init__(message)
        self.table = table
        self.shortfall_bytes = shortfall_bytes


def nearest_name(word: str, known: Iterable[str]) -> str | None:
    """The known name a misspelt `word` most likely meant, or None: a name that starts with the
    word (`pooling` → `pooling_factor`) or that the word starts with, the closest of those by
    length; else difflib's closest match."""
    names = sorted(str(k) for k in known)
    stems = [k for k in names if word and (k.startswith(word) or word.startswith(k))]
    if stems:
        return min(stems, key=lambda k: (abs(len(k) - len(word)), k))
    near = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return near[0] if near else None


def check_keys(given: Iterable[Any], known: Collection[str], where: str, what: str = "field") -> None:
    """Raise one InputError line naming every key of `given` not in `known`, each with the
    nearest known key as a did-you-mean (`nearest_name`), so a misspelt key is never dropped silently."""
    unknown = sorted(str(k) for k in given if k not in known)
    if not unknown:
        return
    parts = []
    for key in unknown:
        near = nearest_name(key, known)
        parts.append(f"{key!r}" + (f" (did you mean {near!r}?)" if near else ""))
    raise InputError(f"{where}: unknown {what}{'s' if len(unknown) > 1 else ''} {', '.join(parts)}; "
                     f"known: {', '.join(sorted(known))}")
