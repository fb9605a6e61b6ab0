"""The docs stay true to the code: generated blocks are current, links resolve."""

from __future__ import annotations

import re

from ops.docs import ARCHITECTURE, REPO, render


def test_the_subjects_table_in_docs_architecture_is_current():
    text = ARCHITECTURE.read_text()
    assert render(text) == text, "docs/architecture.md is stale: run python -m ops.docs"


def test_every_relative_link_in_the_readme_and_docs_resolves():
    missing = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(REPO)} -> {target}")

    assert not missing, "broken links:\n" + "\n".join(missing)


def _table_cells(text: str) -> list[str]:
    """Every cell of every markdown table in `text` (alignment rows left out)."""
    cells = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line):
            cells += [c.strip() for c in line.strip().strip("|").split("|")]
    return cells


def test_the_readme_is_a_short_front_door_with_its_results():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150, "README.md is over 150 lines: move detail into docs/"
    assert "## Results" in text and "vs colocated-best" in text and "python -m runners.bench rollout" in text
    long = [
        c
        for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        for c in _table_cells(page.read_text())
        if len(c.split()) > 40
    ]
    assert not long, "table cells over 40 words:\n" + "\n".join(c[:120] for c in long)


def test_the_cell_check_sees_a_long_cell():
    assert _table_cells("| a | " + "word " * 41 + "|\n| --- | --- |\n") == ["a", ("word " * 41).strip()]
