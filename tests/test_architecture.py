"""The module map holds: imports point one way (no cycle, even inside a function or behind
TYPE_CHECKING), `naming`, `types`, `batches` and `autopilot` import nothing of the package (`config` only `naming` and `autopilot`), `averaging` knows
nothing of the protocol, no module outgrows a read, and the Layout table of the design guide (docs/design.md) names every module.
Fast tier: reads the source, runs none of it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parents[1] / "parallelwrapper"
DESIGN = PACKAGE.parent / "docs" / "design.md"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The package's modules that module `name` imports, anywhere in its body."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            targets = submodules or [base]  # `from . import checkpoint` imports checkpoint
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def test_every_module_is_found() -> None:
    assert {"parallelwrapper.config", "parallelwrapper.rounds", "parallelwrapper.hosts.runtime"} <= GRAPH.keys()
    assert "parallelwrapper.types" in GRAPH["parallelwrapper.worker"]  # the walk sees relative imports


def test_the_import_graph_has_no_cycle() -> None:
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name) :] + [name]
            pytest.fail("import cycle: " + " -> ".join(m.removeprefix("parallelwrapper.") for m in cycle))
        if name in done:
            return
        for target in sorted(GRAPH[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(GRAPH):
        visit(name, [])


@pytest.mark.parametrize("leaf", ["naming", "types", "batches", "codec", "models", "data.mnist"])
def test_bottom_modules_import_nothing_of_the_package(leaf: str) -> None:
    assert GRAPH[f"parallelwrapper.{leaf}"] == set()


def test_config_imports_only_how_things_are_named_and_the_autopilots_bounds() -> None:
    assert GRAPH["parallelwrapper.config"] <= {"parallelwrapper.naming", "parallelwrapper.autopilot"}
    assert GRAPH["parallelwrapper.autopilot"] == set()


def test_averaging_imports_only_the_codecs_and_their_exchange() -> None:
    assert GRAPH["parallelwrapper.averaging"] <= {"parallelwrapper.codec", "parallelwrapper.wire"}
    assert GRAPH["parallelwrapper.delta_averaging"] <= {"parallelwrapper.averaging", "parallelwrapper.codec", "parallelwrapper.wire"}
    assert GRAPH["parallelwrapper.wire"] <= {"parallelwrapper.codec"}


@pytest.mark.parametrize("module", ["averaging", "delta_averaging"])
def test_averaging_knows_no_protocol_flag(module: str) -> None:
    source = MODULES[f"parallelwrapper.{module}"].read_text()
    for word in ("finished", "skipped", "stop", "header", "HEADER", "samples"):
        assert not re.search(rf"\b{word}\b", source), word


def test_no_module_is_over_the_limit() -> None:
    long = {name: n for name, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_design_guides_layout_names_every_module() -> None:
    text = DESIGN.read_text()
    layout = text[text.index("## Layout") :].split("\n## ")[0]
    missing = [
        str(path.relative_to(PACKAGE.parent))
        for path in MODULES.values()
        if f"`{path.relative_to(PACKAGE.parent)}`" not in layout and path.name != "__init__.py"
    ]
    assert not missing, f"docs/design.md's Layout table does not name: {missing}"
