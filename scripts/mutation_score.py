"""The mutation score per module from a finished `mutmut run` (`make mutation`).

    python scripts/mutation_score.py [--survivors]

Reads mutmut's per-file results (mutants/**/*.py.meta). A mutant is *killed* when a test
failed on it, *timed out* when its tests ran past the limit (a mutant that makes a loop
endless: detected, counted with the killed), *survived* when every test passed, *no tests*
when no selected test executes the mutated function. Score = (killed + timed out) / all
mutants of the module. --survivors lists the survivors' names (`mutmut show NAME` shows one).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILLED, TIMEOUT, SURVIVED, NO_TESTS = "killed", "timeout", "survived", "no tests"
STATUS = {1: KILLED, 3: KILLED, 0: SURVIVED, 5: NO_TESTS, 33: NO_TESTS, 36: TIMEOUT, 24: TIMEOUT, -24: TIMEOUT,
          152: TIMEOUT, 255: TIMEOUT, None: "not checked"}


def module_results(mutants: Path) -> dict[str, dict[str, str]]:
    """module path (src/...) -> {mutant name: status}."""
    out = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        out[str(meta.relative_to(mutants))[: -len(".meta")]] = {k: STATUS.get(v, "suspicious") for k, v in codes.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", default=str(ROOT / "mutants"))
    ap.add_argument("--survivors", action="store_true", help="list the surviving mutants")
    args = ap.parse_args(argv)
    results = module_results(Path(args.mutants))
    if not results:
        print(f"error: no mutmut results under {args.mutants} (run `make mutation`)", file=sys.stderr)
        return 2
    print(f"{'module':38s} {'mutants':>8s} {'killed':>7s} {'timeout':>8s} {'survived':>9s} {'no tests':>9s} {'score':>7s}")
    total: Counter = Counter()
    for module, by_name in results.items():
        c = Counter(by_name.values())
        total.update(c)
        n = len(by_name)
        score = (c[KILLED] + c[TIMEOUT]) / n if n else float("nan")
        print(f"{module:38s} {n:8d} {c[KILLED]:7d} {c[TIMEOUT]:8d} {c[SURVIVED]:9d} {c[NO_TESTS]:9d} {score:7.1%}")
    n = sum(total.values())
    print(f"{'all':38s} {n:8d} {total[KILLED]:7d} {total[TIMEOUT]:8d} {total[SURVIVED]:9d} {total[NO_TESTS]:9d} "
          f"{(total[KILLED] + total[TIMEOUT]) / n:7.1%}")
    unchecked = total["not checked"]
    if unchecked:
        print(f"({unchecked} mutants not checked yet: the run did not finish)")
    if args.survivors:
        for module, by_name in results.items():
            for name, status in by_name.items():
                if status in (SURVIVED, NO_TESTS):
                    print(f"{status:9s} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
