"""The project documents itself: every reference into ``docs/`` resolves, and nothing cites design notes
that live outside the repository.

* Every ``docs/<page>.md`` and ``docs/<page>.md#<anchor>`` written in a .py, .yaml or .md file names an
  existing page and, with an anchor, a heading of that page (GitHub's anchor rules).
* Every relative link inside ``docs/*.md`` (``[text](models.md#x)``, ``(../BENCHMARKS.md#y)``, ``(#z)``)
  resolves the same way.
* No file cites ``ALGORITHMS.md`` / ``ENVIRONMENT.md`` or the ``shared/design`` folder they came from.
"""
from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
DOCS = ROOT / "docs"

SCANNED = (".py", ".yaml", ".yml", ".md")
CITATION_SCANNED = SCANNED + (".toml", ".cfg", ".ini", ".txt", ".sh")
SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".cache",
             "mlruns", "runs", "node_modules", ".venv", "venv", ".tox", ".eggs"}
SKIP_PATHS = {ROOT / "benchmarks" / "results"}
#: files allowed to mention the old design notes (this test, which names them)
CITATION_EXEMPT = {THIS}

# docs/<page>.md with an optional #anchor; not part of a longer path or word (``mydocs/``, ``x.mdx``)
DOC_REF = re.compile(r"(?<![\w\-])docs/([\w\-./]+?\.md)(?![\w])(?:#([\w\-]+))?")
MD_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
OLD_NOTES = re.compile(r"\b(?:ALGORITHMS|ENVIRONMENT)\.md\b|shared/design\b")


def repo_files(suffixes: tuple[str, ...]) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")
                             and here / d not in SKIP_PATHS)
        out += [here / f for f in sorted(filenames) if f.endswith(suffixes)]
    return out


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# ------------------------------------------------------------------------------------------ anchors
def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: rendered text, lowercased, every character that is not a letter,
    a mark, a decimal digit, a connector (``_``), a hyphen or a space removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in "- " or unicodedata.category(c)[0] in "LM"
                   or unicodedata.category(c) in ("Nd", "Pc"))
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Anchors of a Markdown file: its ATX headings outside code fences (repeats get -1, -2, as on
    GitHub) and explicit ``id=``/``name=`` HTML anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fence = None
    for line in read(path).splitlines():
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker:
            if fence is None:
                fence = marker.group(1)[0]
            elif stripped.startswith(fence * 3):
                fence = None
            continue
        if fence is not None:
            continue
        m = re.match(r" {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
        if m:
            slug = github_anchor(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return found


_ANCHOR_CACHE: dict[Path, set[str]] = {}


def check_target(page: Path, anchor: str | None) -> str | None:
    """Why ``page#anchor`` does not resolve, or None."""
    if not page.is_file():
        return f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page} does not exist"
    if anchor:
        known = _ANCHOR_CACHE.setdefault(page, anchors(page))
        if anchor not in known:
            return f"no heading with anchor #{anchor} in {page.relative_to(ROOT)} (anchors: {sorted(known)})"
    return None


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("heading, anchor", [
    ("Steps and metrics", "steps-and-metrics"),
    ("Block drafters and lattice rescoring", "block-drafters-and-lattice-rescoring"),
    ("bf16 and greedy identity", "bf16-and-greedy-identity"),
    ("SD² steering overhead per step (2026-11-22)", "sd-steering-overhead-per-step-2026-11-22"),
    ("Spec-Bench subset, run 10: run 9's drafters at temperature 1 (2026-11-22)",
     "spec-bench-subset-run-10-run-9s-drafters-at-temperature-1-2026-11-22"),
    ("The `rsd_c` mode", "the-rsd_c-mode"),
    ("See [the cache](models.md#x)", "see-the-cache"),
])
def test_github_anchor(heading, anchor):
    assert github_anchor(heading) == anchor


def test_docs_pages_exist():
    for page in ("README.md", "algorithms.md", "models.md"):
        assert (DOCS / page).is_file(), f"docs/{page} is missing"


def test_every_docs_reference_resolves():
    problems, count = [], 0
    for path in repo_files(SCANNED):
        if path == THIS:
            continue
        for n, line in enumerate(read(path).splitlines(), 1):
            for m in DOC_REF.finditer(line):
                count += 1
                why = check_target(DOCS / m.group(1), m.group(2))
                if why:
                    problems.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)}: {why}")
    assert not problems, "broken references into docs/:\n" + "\n".join(problems)
    assert count > 0, "no docs/ reference found at all: is the scan looking in the right place?"


#: the pages a user reads besides docs/: their links are checked the same way
TOP_PAGES = ("README.md", "BENCHMARKS.md", "benchmarks/history.md", "experiments/RESULTS.md")


def test_links_inside_docs_resolve():
    problems = []
    for path in sorted(DOCS.glob("**/*.md")) + [ROOT / page for page in TOP_PAGES]:
        for n, line in enumerate(read(path).splitlines(), 1):
            for m in MD_LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                page = (path.parent / file_part).resolve() if file_part else path
                if page.is_dir():
                    continue
                why = check_target(page, anchor or None)
                if why:
                    problems.append(f"{path.relative_to(ROOT)}:{n}: ({target}): {why}")
    assert not problems, "broken links in docs/:\n" + "\n".join(problems)


def test_nothing_cites_design_notes_outside_the_repository():
    hits = []
    for path in repo_files(CITATION_SCANNED):
        if path in CITATION_EXEMPT:
            continue
        for n, line in enumerate(read(path).splitlines(), 1):
            if OLD_NOTES.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, ("these cite design notes outside the repository; cite docs/algorithms.md#... or "
                      "docs/models.md#... instead:\n" + "\n".join(hits))
