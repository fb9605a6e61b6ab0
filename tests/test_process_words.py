"""The repository talks about the software, not about how it was built: no build-process words
in the README, the docs, the code, the tests or the configs. `process_words` fails on

* a work stop cited by number (the word "stop" or "stops", then a number; also across a
  line break);
* a tracker issue or PR cited by number (with or without "#", or a range of them), unless the
  citation is another project's: a URL, an owner/repo, or a project's name (`PROJECTS`) on
  its line or the line before, as hardware.py cites its sources;
* a commit hash: a word of 7 to 40 hex digits with a digit and a letter, not inside a longer
  identifier or a number (a 0x literal, a float such as 1979e12); legitimate hex is allowed
  by file and string in `ALLOWED_HEX`, each with its reason;
* the folder of a past run (under runs/, named s, a number and a dash);
* the phrases in `PHRASES`.

This file is scanned too: its literals are split so that it does not match itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["actors", "bus_schemas", "forecasting", "runners", "ops", "tests"]

PHRASES = ["this " + "machine", "busy " + "cores", "this " + "session"]
STOP = re.compile(r"\bstops?(?:[ \t]+|[ \t]*\n[ \t]*(?:#[ \t]*)?)\d+\b", re.IGNORECASE)
ISSUE = re.compile(r"\b(?:(?i:issues?)|PRs?|(?i:pull requests?))[ \t]+#?\d+(?:[ \t]*[-–][ \t]*\d+)?")
HEX = re.compile(r"(?<![\w.#])[0-9a-fA-F]{7,40}(?!\w)")
RUN_FOLDER = re.compile(r"\bruns/s\d+-")
PHRASE = re.compile("|".join(re.escape(p) for p in PHRASES), re.IGNORECASE)

# other projects, whose issues and PRs are cited as sources
PROJECTS = ["SGLang", "vLLM", "xLLM", "DeepEP", "NCCL", "NVIDIA", "PyTorch", "Mooncake", "LMSYS", "TensorRT-LLM", "nats-server"]
EXTERNAL = re.compile(r"https?://|\bgithub\.com/|\bgitea\.|\bgitlab\.|(?<![\w-])(?:" + "|".join(map(re.escape, PROJECTS)) + r")(?![\w-])")
OWNER_REPO = re.compile(r"[\w.-]+/[\w.-]+[ \t]+$")  # "sgl-project/sglang " right before the citation

# (file, string) -> why that hex is no commit hash (strings split so this file stays clean)
ALLOWED_HEX: dict[tuple[str, str], str] = {
    ("tests/test_torch_units.py", "e306" + "9283"): "CRC-32C check value of b'123456789', the standard test vector",
    ("tests/test_torch_units.py", "cbf4" + "3926"): "CRC-32 check value of b'123456789', the standard test vector",
}


def sources() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *(p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))),
        *sorted((ROOT / "configs").glob("*.toml")),
        ROOT / "pyproject.toml",
    ]


def _is_hash(word: str) -> bool:
    return bool(re.search(r"\d", word) and re.search(r"[a-fA-F]", word) and not re.fullmatch(r"\d+[eE]\d+", word))


def _external(text: str, start: int) -> bool:
    """The citation at `start` is another project's: named on its line (or the line before) up to it."""
    line_start = text.rfind("\n", 0, start) + 1
    context = text[text.rfind("\n", 0, max(line_start - 1, 0)) + 1 : start]
    return bool(EXTERNAL.search(context) or OWNER_REPO.search(text[line_start:start]))


def process_words(text: str, rel: str) -> list[str]:
    """Every build-process word in `text` (the file `rel`), as 'rel:line: match'."""
    found: list[tuple[int, str]] = []
    for pattern in (STOP, ISSUE, HEX, RUN_FOLDER, PHRASE):
        for m in pattern.finditer(text):
            word = m.group(0)
            if pattern is ISSUE and _external(text, m.start()):
                continue
            if pattern is HEX and (not _is_hash(word) or (rel, word) in ALLOWED_HEX):
                continue
            found.append((m.start(), " ".join(word.split())))
    return [f"{rel}:{text.count(chr(10), 0, start) + 1}: {word}" for start, word in sorted(found)]


def test_no_build_process_words_anywhere():
    found = [hit for path in sources() for hit in process_words(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert not found, "build-process words (describe the behaviour instead):\n" + "\n".join(found)


def test_every_allowed_hex_string_is_still_there():
    stale = [f"{rel}: {word}" for rel, word in ALLOWED_HEX if word not in (ROOT / rel).read_text()]
    assert not stale, "ALLOWED_HEX entries no longer needed:\n" + "\n".join(stale)


PAGE = "# Operations\n\nThe launcher starts every actor.\n{}\nIt exports the log at the end.\n"
# the words split, so this file stays clean
N = "1" + "2"
STOP_W, ISSUE_W, PR_W, RUNS_W = "st" + "op", "is" + "sue", "P" + "R", "ru" + "ns/s"
HASH_7 = "3f2a" + "9c1"
HASH_40 = "9fceb2" + "d41a7e" + "3c9f0d" + "1b2a3c" + "4d5e6f" + "7a8b9c" + "0d1e"


@pytest.mark.parametrize(
    "planted, match",
    [
        (f"As built at {STOP_W} {N}, the split holds.", f"{STOP_W} {N}"),
        (f"Both {STOP_W}s {N} and 13 moved it.", f"{STOP_W}s {N}"),
        (f"Measured at {STOP_W}\n{N}: faster.", f"{STOP_W} {N}"),
        (f"The split ({ISSUE_W} {N}) holds.", f"{ISSUE_W} {N}"),
        (f"See {ISSUE_W} #{N} for the plan.", f"{ISSUE_W} #{N}"),
        (f"Done in {ISSUE_W}s 22-24.", f"{ISSUE_W}s 22-24"),
        (f"Landed in {PR_W} #{N}.", f"{PR_W} #{N}"),
        (f"Reverted in {HASH_7} after the bench.", HASH_7),
        (f"commit {HASH_40}", HASH_40),
        (f"Figures in {RUNS_W}{N}-moe/summary.json.", f"{RUNS_W}{N}-"),
        (f"It is slow on {PHRASES[0]}.", PHRASES[0]),
        (f"With two {PHRASES[1]} it lags.", PHRASES[1]),
        (f"Measured in {PHRASES[2].title()}.", PHRASES[2].title()),
    ],
)
def test_the_checker_fails_on_a_word_planted_in_a_docs_page(planted, match):
    assert process_words(PAGE.format(planted), "docs/operations.md") == [f"docs/operations.md:4: {' '.join(match.split())}"]


@pytest.mark.parametrize(
    "cited",
    [
        "square BF16 matmul (github.com/zzc0721/torch-performance-test-data issue #" + "79)",
        "NCCL maintainer, github.com/NVIDIA/nccl-tests issue #" + "212",
        "configs quoted in sgl-project/sglang issue #" + "11045",
        "unit benchmark (SGLang PR #" + "2904)",
        "vLLM piecewise vs full graph: MoE 1.47x (PR #" + "25444)",
        "vLLM piecewise vs full graph: MoE 1.47x,\n# Kimi-K2.6 TP8 1.11x (PR #" + "42885)",
        "the communication time on H20, DeepEP issue #" + "144",
        "https://example.org/tracker issue " + N,
    ],
)
def test_other_projects_issues_and_prs_are_citations(cited):
    assert process_words(cited, "actors/engine/emulated/hardware.py") == []


@pytest.mark.parametrize(
    "text",
    [
        "x = 0x1f2e" + "3d4c",  # a hex literal
        "PEAK_FLOPS = 1979" + "e12",  # a float
        "key = kv_1a2b" + "3c4d5e",  # inside an identifier
        "colour = '#1f77" + "b4cc'",  # a colour
        "cafe" + "babe",  # letters only
        "1234" + "5678",  # digits only
        "stop_after = 3; stop(1" + "2); stops: " + N + " s",  # code, not a cited stop
        "the issue is that 2 engines stop",
    ],
)
def test_legitimate_text_passes(text):
    assert process_words(text, "actors/x.py") == []


def test_allowed_hex_is_allowed_only_in_its_file():
    (rel, word), _ = next(iter(ALLOWED_HEX.items()))
    assert process_words(f'assert digest == "crc32c:{word}"', rel) == []
    assert process_words(f'assert digest == "crc32c:{word}"', "tests/test_other.py") == [f"tests/test_other.py:1: {word}"]
