"""Generated parts of the docs: the subjects table of `docs/architecture.md` comes from
`bus_schemas/subjects.py`, so the page cannot drift from the code.

    python -m ops.docs            # rewrite the generated blocks in docs/
    python -m ops.docs --check    # exit 1 if a generated block is stale (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

from bus_schemas import subjects

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "architecture.md"
BEGIN, END = "<!-- generated: subjects (python -m ops.docs) -->", "<!-- end generated: subjects -->"
_HELPERS = {"has_wildcard", "matches"}  # subject matching, not subjects
_SECTION = re.compile(r"^# --- (.+?) -+$")


def _sections() -> dict[str, str]:
    """Function name -> the `# --- section ---` comment above it in subjects.py."""
    section, found = "", {}
    for line in inspect.getsource(subjects).splitlines():
        if m := _SECTION.match(line):
            section = m.group(1)
        elif m := re.match(r"^def ([a-z]\w*)\(", line):
            found[m.group(1)] = section
    return found


def _pattern(fn) -> str:
    """The subject `fn` builds, each id shown as <name> (an optional id in brackets)."""
    params = list(inspect.signature(fn).parameters.values())
    subject = fn(*(p.name for p in params if p.default is inspect.Parameter.empty))
    for p in params:
        if p.default is inspect.Parameter.empty:
            subject = re.sub(rf"(?<=\.){p.name}(?=\.|$)", f"<{p.name}>", subject)
        else:
            subject += f"[.<{p.name}>]"
    return subject


def subjects_table() -> str:
    """A Markdown table of every subject builder: section, function, subject, meaning."""
    sections = _sections()
    rows = ["| area | function | subject | meaning |", "| --- | --- | --- | --- |"]
    for name, section in sections.items():
        if name in _HELPERS:
            continue
        fn = getattr(subjects, name)
        pattern = _pattern(fn)
        doc = " ".join((inspect.getdoc(fn) or "").split()).replace("``", "`").replace("|", "\\|")
        if not doc and subjects.has_wildcard(pattern):
            doc = "Subscription pattern over the subjects above."
        rows.append(f"| {section} | `subjects.{name}()` | `{pattern}` | {doc} |")
    return "\n".join(rows)


def render(text: str) -> str:
    """`text` with its generated block replaced by the current table."""
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + subjects_table() + "\n" + text[stop:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.docs")
    parser.add_argument("--check", action="store_true", help="fail if a generated block is stale")
    args = parser.parse_args(argv)
    text = ARCHITECTURE.read_text()
    fresh = render(text)
    if args.check:
        if fresh != text:
            print(f"{ARCHITECTURE} is stale: run python -m ops.docs", file=sys.stderr)
            return 1
        return 0
    ARCHITECTURE.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
