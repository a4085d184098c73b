"""Exceptions that the command-line entry points turn into one-line errors.

Every error a user can cause by handing us bad input derives from `EmbshardError`, so
`shard.py` and `train.py` can print `error: <message>` and exit non-zero without a
traceback, while genuine bugs still surface with one.
"""

from __future__ import annotations


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
