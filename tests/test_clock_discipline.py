"""One clock: actors read time, deadlines and the model↔wall scale only from the injected
clock (`actors/base/clock.py`). An AST walk over `actors/` fails on any other way in:

* `time.time`, `time.monotonic`, `time.perf_counter` (and their `_ns` forms), however imported;
* `datetime.now()`, `datetime.utcnow()`, `datetime.today()` and `date.today()`, however
  imported (`import datetime`, `import datetime as dt`, `from datetime import datetime`);
* `asyncio.sleep` with any argument but a literal 0 (a zero sleep is a yield, not a wait);
* an event loop's own time: `.time` on anything named a loop (`loop.time()`, `self.loop.time()`,
  `self._loop.time()`), on `asyncio.get_running_loop()` / `get_event_loop()` /
  `new_event_loop()`, or on a name or attribute assigned from one of those;
* `<config>.run.time_scale`: the scale comes from `clock.time_scale`.

Only the clock modules may do these: `actors/base/clock.py`, `actors/base/virtual.py`, and
the in-process bus (`actors/base/inproc*.py`), which stands in for nats-server and keeps
its timeouts on the loop's time as nats-server keeps them on its own. `actors/config.py`
defines the scale and `actors/base/runtime.py` builds the clock from it. Any other read is
allowed only by file and by name in `ALLOWED`, with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACTORS = ROOT / "actors"

CLOCK_MODULES = {"actors/base/clock.py", "actors/base/virtual.py", "actors/base/inproc.py", "actors/base/inproc_store.py"}
SCALE_OWNERS = {"actors/config.py", "actors/base/runtime.py"}
# (file, the read as the walk names it) -> why that file may read it. Each entry must still be hit
# (test_every_allowed_read_is_still_there), so the list cannot outlive its reason.
ALLOWED: dict[tuple[str, str], str] = {
    ("actors/engine/vllm/kvbus.py", "self._loop.time()"): (
        "the vLLM KV connector runs inside vLLM's engine-core process, which has no Prorsa clock: "
        "held KV's TTL and the fetch timing are wall seconds on the bus thread's own event loop"
    ),
}

WALL_FUNCS = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"}
LOOP_GETTERS = {"get_running_loop", "get_event_loop", "new_event_loop"}
DATETIME_CLASSES = {"datetime", "date"}
DATETIME_NOW = {"now", "utcnow", "today"}


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


def _is_loop_getter_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name) and _dotted(node.func).split(".")[-1] in LOOP_GETTERS
    )


def _reads(source: str) -> list[tuple[int, str, str]]:
    """Every way `source` reads time other than through the clock, as (line, name, note)."""
    found: list[tuple[int, str, str]] = []
    tree = ast.parse(source)
    time_aliases: set[str] = set()  # import time [as t]
    datetime_modules: set[str] = set()  # import datetime [as dt]
    datetime_classes: set[str] = set()  # from datetime import datetime [as D], date [as d]
    wall_names: set[str] = set()  # from time import monotonic [as m]
    sleep_names: set[str] = set()  # from asyncio import sleep [as s]
    loops: set[str] = set()  # names and attributes assigned from a loop getter
    called: set[int] = set()  # ids of the nodes that are a call's function
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "time":
                    time_aliases.add(a.asname or "time")
                elif a.name == "datetime":
                    datetime_modules.add(a.asname or "datetime")
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio", "datetime"):
            for a in node.names:
                if node.module == "time" and a.name in WALL_FUNCS:
                    wall_names.add(a.asname or a.name)
                    found.append((node.lineno, f"from time import {a.name}", ""))
                if node.module == "asyncio" and a.name == "sleep":
                    sleep_names.add(a.asname or a.name)
                if node.module == "datetime" and a.name in DATETIME_CLASSES:
                    datetime_classes.add(a.asname or a.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None and _is_loop_getter_call(node.value):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                loops.add(_dotted(target))
        elif isinstance(node, ast.Call):
            called.add(id(node.func))

    def is_loop(owner: ast.AST) -> bool:
        if _is_loop_getter_call(owner):
            return True
        if isinstance(owner, ast.Name | ast.Attribute):
            name = _dotted(owner)
            return name in loops or name.split(".")[-1].lower().endswith("loop")
        return False

    def is_datetime_class(owner: ast.AST) -> bool:
        return (isinstance(owner, ast.Name) and owner.id in datetime_classes) or (
            isinstance(owner, ast.Attribute)
            and owner.attr in DATETIME_CLASSES
            and isinstance(owner.value, ast.Name)
            and owner.value.id in datetime_modules
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = _dotted(node) + ("()" if id(node) in called else "")
            if isinstance(node.value, ast.Name) and node.value.id in time_aliases and node.attr in WALL_FUNCS:
                found.append((node.lineno, name, ""))
            elif node.attr == "time" and is_loop(node.value):
                found.append((node.lineno, name, " (the loop's time)"))
            elif node.attr in DATETIME_NOW and is_datetime_class(node.value):
                found.append((node.lineno, name, " (the wall clock)"))
            elif node.attr == "time_scale" and isinstance(node.value, ast.Attribute) and node.value.attr == "run":
                found.append((node.lineno, name, " (the scale comes from clock.time_scale)"))
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
                    (node.lineno, f"asyncio.sleep({ast.unparse(arg) if arg else ''})", "")
                )  # barrier-ok: names the call in a message
        elif isinstance(func, ast.Name) and func.id in wall_names:
            found.append((node.lineno, f"{func.id}()", ""))
    return found


def violations(source: str, rel: str) -> list[str]:
    """Every way `source` reads time other than through the clock, as 'file:line: what'."""
    return [
        f"{rel}:{line}: {name}{note}"
        for line, name, note in _reads(source)
        if not (rel in SCALE_OWNERS and name.endswith(".run.time_scale"))
    ]


def unallowed(source: str, rel: str) -> list[str]:
    """`violations`, less the reads `ALLOWED` names for this file."""
    return [
        f"{rel}:{line}: {name}{note}"
        for line, name, note in _reads(source)
        if (rel, name) not in ALLOWED and not (rel in SCALE_OWNERS and name.endswith(".run.time_scale"))
    ]


def _actor_files() -> list[tuple[str, Path]]:
    return sorted((p.relative_to(ROOT).as_posix(), p) for p in ACTORS.rglob("*.py"))


def test_no_actor_reads_time_outside_the_clock():
    found = []
    for rel, path in _actor_files():
        if rel not in CLOCK_MODULES:
            found += unallowed(path.read_text(), rel)
    assert not found, "time read outside the injected clock (use self.clock):\n" + "\n".join(found)


def test_every_allowed_read_is_still_there():
    """The allowlist must shrink: an entry whose file no longer makes that read fails here."""
    hits = {(rel, name) for rel, path in _actor_files() for _, name, _ in _reads(path.read_text())}
    stale = [f"{rel}: {name}" for rel, name in ALLOWED if (rel, name) not in hits]
    assert not stale, "allowed reads no longer made (remove them from ALLOWED):\n" + "\n".join(stale)
    assert all(reason.strip() for reason in ALLOWED.values())


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
        "class A:\n    def f(self):\n        return self._loop.time()",
        "class A:\n    def f(self):\n        return self.loop.time()",
        "class A:\n    def f(self):\n        return self.event_loop.time()",
        "import asyncio\nclass A:\n    def f(self):\n        self.lp = asyncio.new_event_loop()\n        return self.lp.time()",
        "import asyncio\ndef f():\n    lp = asyncio.get_running_loop()\n    now = lp.time\n    return now()",
        "import datetime\nx = datetime.datetime.now()",
        "import datetime as dt\nx = dt.datetime.utcnow()",
        "import datetime\nx = datetime.date.today()",
        "from datetime import datetime\nx = datetime.now()",
        "from datetime import datetime as DT\nx = DT.today()",
        "from datetime import date\nx = date.today()",
        "def f(self):\n    return self.config.run.time_scale",
    ],
)
def test_the_walk_catches_each_way_in(source):
    assert violations(source, "actors/x.py")


# planted in an actor's own source: the checker on that file must fail on it
PLANTED = {
    "loop_time": "\n\nclass Planted:\n    def started(self):\n        return self._loop.time()\n",
    "datetime_now": "\n\ndef started():\n    import datetime\n\n    return datetime.datetime.now().timestamp()\n",
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_the_walk_fails_on_a_read_planted_in_an_actor(planted):
    rel = "actors/engine/actor.py"
    source = (ROOT / rel).read_text()
    assert unallowed(source, rel) == [], "the actor is clean before the plant"
    planted_source = source + PLANTED[planted]
    found = unallowed(planted_source, rel)
    assert len(found) == 1, found
    assert int(found[0].split(":")[1]) == len(planted_source.splitlines()), found  # the planted line, the file's last


def test_an_allowed_read_is_allowed_only_by_its_name_and_file():
    rel, name = next(iter(ALLOWED))
    assert name == "self._loop.time()"
    loop_read = "class A:\n    def f(self):\n        return self._loop.time()"
    assert unallowed(loop_read, rel) == []
    assert unallowed(loop_read, "actors/engine/vllm/actor.py") != []  # same read, another file
    assert unallowed("import time\nx = time.time()", rel) != []  # same file, another read
    assert unallowed("import datetime\nx = datetime.datetime.now()", rel) != []


def test_the_walk_allows_the_clock_and_a_yield():
    ok = (
        "import asyncio\nfrom datetime import datetime, timezone\n"
        "async def f(self):\n    await asyncio.sleep(0)\n    await self.clock.sleep(1)\n"  # barrier-ok: source text
        "    self._step_loop.cancel()\n"
        "    stamp = datetime.fromtimestamp(self.clock.origin_wall_s, timezone.utc)\n"
        "    return self.clock.now_s() * self.clock.time_scale"
    )
    assert violations(ok, "actors/x.py") == []
