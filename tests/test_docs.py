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
