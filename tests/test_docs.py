"""The docs a newcomer reads: the README stays a short quick start, every link in it and in
docs/ resolves to a file a clone has, no page cites as a file an output a clone does not have
(experiments/ is git-ignored: outputs are named only inside the commands that write them, or
committed under docs/), and nothing points to a DESIGN.md the repository does not hold."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*```")
CODE_SPAN = re.compile(r"`([^`]+)`")
#: an inline code span that is a command or an override (it may name the outputs it writes)
COMMAND = re.compile(r"^\s*(\$ )?(python|\.venv/bin/python|torchrun|make|cp|cat|bash|\.ci/)|^[\w.+@/-]+=\S|^--")
IGNORED_OUTPUTS = re.compile(r"(?<![\w./-])(experiments/[^\s`'\")\],;]*)")


def _ignored(paths: list[Path]) -> set[Path]:
    """Of `paths`, those git ignores (a clone does not have them); empty without git."""
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"],
                              input="\n".join(str(p) for p in paths), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {Path(line) for line in proc.stdout.splitlines() if line}


def _prose_lines(page: Path):
    """(line number, text) of the lines outside fenced code blocks."""
    fenced = False
    for no, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield no, line


def test_readme_is_a_short_quick_start():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for must in ("make demo", "make test", "EmbShardPlanner", "collective_plan", "docs/torchrec.md",
                 "docs/contracts.md", "## Headline results"):
        assert must in text, must


def test_every_link_resolves_to_a_file_a_clone_has():
    broken, targets = [], []
    for page in PAGES:
        for no, line in _prose_lines(page):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                    continue
                path = (page.parent / target.split("#", 1)[0]).resolve()
                where = f"{page.relative_to(ROOT)}:{no}: {target}"
                if not path.exists():
                    broken.append(f"{where} (no such file)")
                elif ROOT not in path.parents and path != ROOT:
                    broken.append(f"{where} (outside the repository)")
                else:
                    targets.append((where, path))
    ignored = _ignored([p for _, p in targets])
    broken += [f"{where} (git-ignored: a clone does not have it)" for where, p in targets if p in ignored]
    assert not broken, "\n".join(broken)


def test_no_page_cites_an_output_a_clone_does_not_have():
    cited = []
    for page in PAGES:
        for no, line in _prose_lines(page):
            commands = [span for span in CODE_SPAN.findall(line) if COMMAND.search(span)]
            rest = line
            for span in commands:
                rest = rest.replace(f"`{span}`", " ")
            for path in IGNORED_OUTPUTS.findall(rest):
                cited.append(f"{page.relative_to(ROOT)}:{no}: {path}")
    assert not cited, ("outputs under experiments/ are git-ignored: name them only in the command that writes "
                       "them, or commit a copy under docs/ and cite that:\n" + "\n".join(cited))


@pytest.mark.parametrize("where", ["README.md", "docs", "src", "conf", "scripts", "examples", "Makefile"])
def test_nothing_points_to_a_design_document_the_repository_lacks(where):
    hits = []
    base = ROOT / where
    for path in ([base] if base.is_file() else sorted(base.rglob("*"))):
        if path.is_file() and path.suffix in ("", ".md", ".py", ".yaml", ".txt") and "egg-info" not in str(path):
            for no, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
                if "DESIGN.md" in line or "DEVELOPERS.md" in line:
                    hits.append(f"{path.relative_to(ROOT)}:{no}")
    assert not hits, hits
