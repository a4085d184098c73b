"""What the Hydra entry points share: user errors become one line on stderr and exit 2."""

from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

from omegaconf.errors import MissingMandatoryValue

from embshard.errors import EmbshardError

T = TypeVar("T")


def one_line_errors(run: Callable[[Any], T], cfg: Any) -> T:
    """Call `run(cfg)`; an error the user caused prints `error: <first line>` and exits 2."""
    try:
        return run(cfg)
    except (EmbshardError, MissingMandatoryValue) as e:
        # one write, not print's two (text, then newline): ranks of a torchrun share stderr, and
        # two writes each let their lines interleave
        sys.stderr.write(f"error: {str(e).splitlines()[0]}\n")
        sys.stderr.flush()
        sys.exit(2)
