"""Pointers from code into the docs resolve: every `docs/<page>.md#<anchor>` in a .py file names
a heading of that page (GitHub's anchors: lowercase, spaces to '-', punctuation dropped, a
repeated heading gets '-1', '-2'), and every `docs/<page>.md, "Heading"` names one by its text.
The calibration points' sources (runners/calibration.py) are the first users."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["actors", "bus_schemas", "forecasting", "ops", "runners", "tests"]

ANCHOR = re.compile(r"\bdocs/([\w.-]+\.md)#([\w-]+)")
NAMED = re.compile(r"""\bdocs/([\w.-]+\.md),? (?:"([^"\n]+)"|'([^'\n]+)')""")


def headings(markdown: str) -> list[str]:
    """The page's headings as text (outside code fences), links reduced to their text."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            out.append(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)))
    return out


def anchors(markdown: str) -> set[str]:
    """GitHub's anchor of each heading."""
    seen: dict[str, int] = {}
    out = set()
    for text in headings(markdown):
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_pointers(source: str, rel: str, pages: dict[str, str]) -> list[str]:
    """Each pointer in `source` into a page of `pages` (name -> markdown) that names no heading."""
    bad = []
    for lineno, line in enumerate(source.splitlines(), 1):
        for page, anchor in ANCHOR.findall(line):
            if page not in pages:
                bad.append(f"{rel}:{lineno}: docs/{page} does not exist")
            elif anchor not in anchors(pages[page]):
                bad.append(f"{rel}:{lineno}: docs/{page}#{anchor} is no heading of that page")
        for page, double, single in NAMED.findall(line):
            title = double or single
            if page in pages and title.lower() not in {h.lower() for h in headings(pages[page])}:
                bad.append(f'{rel}:{lineno}: docs/{page} has no heading "{title}"')
    return bad


def _pages() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}


def test_every_docs_pointer_in_the_code_names_a_heading():
    pages = _pages()
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != "tests/test_doc_anchors.py":  # its planted pointers below
                bad += broken_pointers(path.read_text(), rel, pages)
    assert not bad, "pointers into the docs that resolve to no heading:\n" + "\n".join(bad)


def test_the_calibration_sources_point_at_calibration_headings():
    text = (ROOT / "runners" / "calibration.py").read_text()
    pointed = ANCHOR.findall(text)
    assert pointed, "runners/calibration.py points into docs/calibration.md by anchor"
    assert {page for page, _ in pointed} == {"calibration.md"}
    assert {anchor for _, anchor in pointed} <= anchors(_pages()["calibration.md"])


def test_github_anchors():
    page = "# Title\n## Efficiencies and per-iteration costs\n```\n# not a heading\n```\n## Admission: KV reserved for decode growth\n"
    page += "### DeepSeek-V3\n## `η_bw` [link](x.md) & more\n## Notes\n## Notes\n"
    assert anchors(page) == {
        "title",
        "efficiencies-and-per-iteration-costs",
        "admission-kv-reserved-for-decode-growth",
        "deepseek-v3",
        "η_bw-link--more",
        "notes",
        "notes-1",
    }


def test_a_pointer_to_a_missing_heading_fails():
    pages = {"calibration.md": "# Calibration\n## Constants\n### DeepSeek-V3\n"}
    source = (
        'SOURCES = ["docs/calibration.md#deepseek-v3", "docs/calibration.md#constants"]\n'
        "# docs/calibration.md \"Constants\" and docs/calibration.md, 'DeepSeek-V3'\n"
        'BAD = ["docs/calibration.md#section-0", "docs/nowhere.md#constants"]\n'
        '# docs/calibration.md, "7.1 sanity check"\n'
    )
    assert broken_pointers(source, "runners/x.py", pages) == [
        "runners/x.py:3: docs/calibration.md#section-0 is no heading of that page",
        "runners/x.py:3: docs/nowhere.md does not exist",
        'runners/x.py:4: docs/calibration.md has no heading "7.1 sanity check"',
    ]
