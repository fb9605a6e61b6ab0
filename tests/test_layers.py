"""Layers point down: bus_schemas < forecasting < actors < ops < runners.

Walks every module's imports (lazy ones inside functions included) and fails on an edge
that points up, e.g. an actor importing `ops.export`."""

from __future__ import annotations

import ast
import subprocess
import sys
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


# --- the config schema is a leaf ------------------------------------------------------------
SCHEMA = ROOT / "actors" / "config_schema.py"
ABOVE_THE_SCHEMA = ("actors.engine", "actors.environment", "forecasting", "actors.config.", "ops", "runners")


def imported_names(path: Path, root: Path = ROOT) -> set[tuple[str, int]]:
    """(dotted name, line) for every import in a module, lazy ones included: `import a.b` gives
    a.b, `from a.b import c` gives a.b.c, relative ones resolved against the package of `path`."""
    package = path.relative_to(root).parent.parts
    out: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {(a.name, node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            out |= {(f"{module}.{a.name}", node.lineno) for a in node.names}
    return out


def reaches_above_the_schema(names: set[tuple[str, int]]) -> list[str]:
    return sorted(f"{line}: {name}" for name, line in names if f"{name}.".startswith(ABOVE_THE_SCHEMA))


def test_the_config_schema_imports_only_the_stdlib_msgspec_and_bus_schemas():
    names = imported_names(SCHEMA)
    assert reaches_above_the_schema(names) == []
    ours = {name.split(".")[0] for name, _ in names} & {*LAYERS, "msgspec"}
    assert ours <= {"bus_schemas", "msgspec"}, f"actors/config_schema.py imports {sorted(ours)}"


def test_importing_the_config_schema_loads_no_engine_environment_or_forecasting_module():
    code = "import sys, actors.config_schema; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert "actors.config_schema" in loaded and "msgspec" in loaded
    assert [m for m in loaded if f"{m}.".startswith(ABOVE_THE_SCHEMA) or m == "actors.config"] == []


def test_the_schema_check_sees_each_way_up(tmp_path):
    module = tmp_path / "actors" / "m.py"
    module.parent.mkdir()
    module.write_text(
        "import msgspec\nfrom bus_schemas.control import Role\nfrom actors.config_schema import Config\n"
        "def f():\n    from actors.engine.emulated.costmodel import PRESETS\n"
        "    import forecasting.models\n    from .environment import workloads\n    from actors import config\n"
        "    from actors.config import load_config\n"
    )
    assert reaches_above_the_schema(imported_names(module, tmp_path)) == [
        "5: actors.engine.emulated.costmodel.PRESETS",
        "6: forecasting.models",
        "7: actors.environment.workloads",
        "8: actors.config",
        "9: actors.config.load_config",
    ]
