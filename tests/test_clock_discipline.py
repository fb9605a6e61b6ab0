"""One clock: actors read time, deadlines and the model↔wall scale only from the injected
clock (`actors/base/clock.py`). An AST walk over `actors/` fails on any other way in:

* `time.time`, `time.monotonic`, `time.perf_counter` (and their `_ns` forms), however imported;
* `asyncio.sleep` with any argument but a literal 0 (a zero sleep is a yield, not a wait);
* the event loop's own time (`loop.time()`, `asyncio.get_running_loop().time()`);
* `<config>.run.time_scale`: the scale comes from `clock.time_scale`.

Only the clock modules may do these: `actors/base/clock.py`, `actors/base/virtual.py`, and
the in-process bus (`actors/base/inproc*.py`), which stands in for nats-server and keeps
its timeouts on the loop's time as nats-server keeps them on its own. `actors/config.py`
defines the scale and `actors/base/runtime.py` builds the clock from it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACTORS = ROOT / "actors"

CLOCK_MODULES = {"actors/base/clock.py", "actors/base/virtual.py", "actors/base/inproc.py", "actors/base/inproc_store.py"}
SCALE_OWNERS = {"actors/config.py", "actors/base/runtime.py"}
# Pending: directories still moving their own wall-clock reads onto the clock (none left: the
# torch engine's deadlines and step/transfer timings read the injected clock since issue 13).
PENDING: set[str] = set()

WALL_FUNCS = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"}
LOOP_GETTERS = {"get_running_loop", "get_event_loop"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    elif isinstance(node, ast.Call):
        parts.append(_dotted(node.func) + "()")
    return ".".join(reversed(parts))


def violations(source: str, rel: str) -> list[str]:
    """Every way `source` reads time other than through the clock, as 'file:line: what'."""
    found = []
    tree = ast.parse(source)
    time_aliases: set[str] = set()
    wall_names: set[str] = set()
    sleep_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "time":
                    time_aliases.add(a.asname or "time")
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio"):
            for a in node.names:
                if node.module == "time" and a.name in WALL_FUNCS:
                    wall_names.add(a.asname or a.name)
                    found.append(f"{rel}:{node.lineno}: from time import {a.name}")
                if node.module == "asyncio" and a.name == "sleep":
                    sleep_names.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if isinstance(node.value, ast.Name) and node.value.id in time_aliases and node.attr in WALL_FUNCS:
                found.append(f"{rel}:{node.lineno}: {dotted}")
            elif (
                node.attr == "time_scale" and isinstance(node.value, ast.Attribute) and node.value.attr == "run" and rel not in SCALE_OWNERS
            ):
                found.append(f"{rel}:{node.lineno}: {dotted} (the scale comes from clock.time_scale)")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        is_sleep = (isinstance(func, ast.Attribute) and func.attr == "sleep" and _dotted(func.value) == "asyncio") or (
            isinstance(func, ast.Name) and func.id in sleep_names
        )
        if is_sleep:
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Constant) and arg.value == 0):
                found.append(
                    f"{rel}:{node.lineno}: asyncio.sleep({ast.unparse(arg) if arg else ''})"
                )  # barrier-ok: names the call in a message
        elif isinstance(func, ast.Name) and func.id in wall_names:
            found.append(f"{rel}:{node.lineno}: {func.id}()")
        elif isinstance(func, ast.Attribute) and func.attr == "time" and not node.args:
            owner = func.value
            if (isinstance(owner, ast.Name) and owner.id == "loop") or (
                isinstance(owner, ast.Call)
                and isinstance(owner.func, ast.Attribute | ast.Name)
                and getattr(owner.func, "attr", getattr(owner.func, "id", "")) in LOOP_GETTERS
            ):
                found.append(f"{rel}:{node.lineno}: {_dotted(func)}() (the loop's time)")
    return found


def _actor_files() -> list[tuple[str, Path]]:
    return sorted((p.relative_to(ROOT).as_posix(), p) for p in ACTORS.rglob("*.py"))


def test_no_actor_reads_time_outside_the_clock():
    found = []
    for rel, path in _actor_files():
        if rel in CLOCK_MODULES or any(rel.startswith(prefix) for prefix in PENDING):
            continue
        found += violations(path.read_text(), rel)
    assert not found, "time read outside the injected clock (use self.clock):\n" + "\n".join(found)


def test_pending_allowlist_is_still_needed():
    """The allowlist must shrink: a pending directory that has become clean fails here."""
    for prefix in PENDING:
        left = [v for rel, path in _actor_files() if rel.startswith(prefix) for v in violations(path.read_text(), rel)]
        assert left, f"{prefix} reads time only through the clock now: remove it from PENDING"


@pytest.mark.parametrize(
    "source",
    [
        "import time\nx = time.monotonic()",
        "import time as t\nx = t.perf_counter()",
        "from time import perf_counter\nx = perf_counter()",
        "import asyncio\nasync def f():\n    await asyncio.sleep(0.1)",  # barrier-ok: source text the walk must flag, not a wait
        "from asyncio import sleep\nasync def f():\n    await sleep(1)",  # barrier-ok: source text the walk must flag
        "import asyncio\nx = asyncio.get_running_loop().time()",
        "def f(loop):\n    return loop.time()",
        "def f(self):\n    return self.config.run.time_scale",
    ],
)
def test_the_walk_catches_each_way_in(source):
    assert violations(source, "actors/x.py")


def test_the_walk_allows_the_clock_and_a_yield():
    ok = "import asyncio\nasync def f(self):\n    await asyncio.sleep(0)\n    await self.clock.sleep(1)\n    return self.clock.now_s() * self.clock.time_scale"  # barrier-ok: source text
    assert violations(ok, "actors/x.py") == []
