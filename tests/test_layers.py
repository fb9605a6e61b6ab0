"""Layers point down: bus_schemas < forecasting < actors < ops < runners.

Walks every module's imports (lazy ones inside functions included) and fails on an edge
that points up, e.g. an actor importing `ops.export`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["bus_schemas", "forecasting", "actors", "ops", "runners"]


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package of ours, line) for every import in a module."""
    out: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        out |= {(n.split(".")[0], node.lineno) for n in names if n.split(".")[0] in LAYERS}
    return out


def upward_edges() -> list[str]:
    bad = []
    for rank, package in enumerate(LAYERS):
        for path in sorted((ROOT / package).rglob("*.py")):
            for target, line in sorted(imported_packages(path)):
                if LAYERS.index(target) > rank:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} (a layer above {package})")
    return bad


def test_no_layer_imports_a_layer_above_it():
    assert upward_edges() == []


def test_the_walker_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from ops.export import load_events\n    import runners.bench\n")
    assert imported_packages(module) == {("ops", 2), ("runners", 3)}
