"""The module map holds: the Layout table of the design guide (docs/design.md) is the real import
order (every import, even inside a function or behind TYPE_CHECKING, points down it, so there is no
cycle), and its concept column is each module's docstring's first line; `naming`, `errors`,
`batches`, `registry` and `payloads` import nothing of the package (`autopilot` and `codec` only
`payloads`, `types` only `errors`, `config` only `registry`, `autopilot` and `payloads`, `job` only `naming`), `averaging` knows nothing of the
protocol, the round engine names no autopilot (it asks a policy); the library never imports the
application (parallelwrapper/app/), which imports the library only through
`parallelwrapper.__all__`, and only the application imports click or matplotlib.
Fast tier: reads the source, runs none of it (one `import parallelwrapper` in a subprocess)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parents[1] / "parallelwrapper"
DESIGN = PACKAGE.parent / "docs" / "design.md"


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


@pytest.mark.parametrize("leaf", ["naming", "errors", "batches", "payloads", "app.models", "app.mnist"])
def test_bottom_modules_import_nothing_of_the_package(leaf: str) -> None:
    assert GRAPH[f"parallelwrapper.{leaf}"] == set()


def test_config_imports_only_the_registry_and_the_autopilots_bounds() -> None:
    assert GRAPH["parallelwrapper.config"] <= {"parallelwrapper.registry", "parallelwrapper.autopilot", "parallelwrapper.payloads"}
    assert GRAPH["parallelwrapper.job"] <= {"parallelwrapper.naming"}
    assert GRAPH["parallelwrapper.types"] == {"parallelwrapper.errors"}  # a Replacement carries its WorkerError
    assert GRAPH["parallelwrapper.autopilot"] == GRAPH["parallelwrapper.codec"] == {"parallelwrapper.payloads"}  # payload names and bits
    assert GRAPH["parallelwrapper.registry"] == set()


def test_averaging_imports_only_the_codecs_and_their_exchange() -> None:
    assert GRAPH["parallelwrapper.averaging"] <= {"parallelwrapper.codec", "parallelwrapper.wire"}
    assert GRAPH["parallelwrapper.delta_averaging"] <= {"parallelwrapper.averaging", "parallelwrapper.codec", "parallelwrapper.wire"}
    assert GRAPH["parallelwrapper.wire"] <= {"parallelwrapper.codec"}


@pytest.mark.parametrize("module", ["averaging", "delta_averaging"])
def test_averaging_knows_no_protocol_flag(module: str) -> None:
    source = MODULES[f"parallelwrapper.{module}"].read_text()
    for word in ("finished", "skipped", "stop", "header", "HEADER", "samples"):
        assert not re.search(rf"\b{word}\b", source), word


def test_the_round_loop_knows_its_policy_only_through_the_seam() -> None:
    """The loop asks a `rounds.policy.Policy` once per landed round; which policy runs (a fixed k,
    the autopilot) and how it measures are no concern of the engine (issue 51)."""
    assert "parallelwrapper.autopilot" not in GRAPH["parallelwrapper.rounds.engine"]
    assert not re.search("pilot", MODULES["parallelwrapper.rounds.engine"].read_text(), re.IGNORECASE)


ROW = re.compile(r"^\| ([^|]*) \| `(parallelwrapper/[^`]+\.py)` \| (.+) \|$")

# Modules whose docstring's first sentence runs onto its second line: the map names the sentence.
# Theirs to make one line (issue 36's options step); drop each once its first line is its sentence.
FIRST_SENTENCE_ON_TWO_LINES: set[str] = set()


def layout() -> list[tuple[str, str, str]]:
    """The Layout table of docs/design.md, top to bottom: (layer, module, concept) a row."""
    text = DESIGN.read_text()
    section = text[text.index("## Layout") :].split("\n## ")[0]
    rows, layer = [], ""
    for line in section.splitlines():
        if row := ROW.match(line):
            layer = row[1].strip() or layer  # a layer's first row names it
            rows.append((layer, module_name(PACKAGE.parent / row[2]), row[3].strip().replace("\\|", "|")))
    return rows


def concept(name: str) -> str:
    """A module's concept: the first sentence of its docstring, whitespace collapsed."""
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    end = re.search(r"\.(\s|$)", paragraph + " ")
    return paragraph[: end.start() + 1] if end else paragraph


def test_the_layout_names_every_module_once() -> None:
    named = [name for _, name, _ in layout()]
    assert not {n for n in named if named.count(n) > 1}, "named twice in docs/design.md's Layout table"
    assert not set(MODULES) - set(named), f"docs/design.md's Layout table does not name: {sorted(set(MODULES) - set(named))}"
    assert not set(named) - set(MODULES), f"docs/design.md's Layout table names modules that do not exist: {sorted(set(named) - set(MODULES))}"


def test_imports_point_down_the_layout_only() -> None:
    rows = layout()
    row = {name: i for i, (_, name, _) in enumerate(rows)}
    up = [
        f"{name} ({rows[row[name]][0]}) imports {target} ({rows[row[target]][0]}), listed above it"
        for name in MODULES
        for target in sorted(GRAPH[name])
        if name in row and target in row and row[target] <= row[name]  # a module the table lacks: the test above
    ]
    assert not up, "imports that point up docs/design.md's Layout table:\n" + "\n".join(up)


def test_the_application_is_the_top_layer() -> None:
    rows = layout()
    top = [name for layer, name, _ in rows if layer == rows[0][0]]
    assert sorted(top) == sorted(name for name in MODULES if (name + ".").startswith("parallelwrapper.app."))


def test_the_module_map_names_each_modules_concept_as_its_docstring_does() -> None:
    wrong = [f"{name}:\n  map:       {text}\n  docstring: {concept(name)}" for _, name, text in layout() if name in MODULES and text != concept(name)]
    assert not wrong, "docs/design.md's module map and the docstrings disagree:\n" + "\n".join(wrong)


def test_each_modules_first_docstring_line_says_its_concept() -> None:
    def first_line(name: str) -> str:
        return (ast.get_docstring(ast.parse(MODULES[name].read_text())) or "").split("\n")[0].strip()

    long = sorted(name for name in MODULES if first_line(name) != concept(name))
    assert set(long) <= FIRST_SENTENCE_ON_TWO_LINES, f"a docstring's first sentence runs past its first line: {sorted(set(long) - FIRST_SENTENCE_ON_TWO_LINES)}"
    assert not FIRST_SENTENCE_ON_TWO_LINES - set(long), f"one line now, drop from FIRST_SENTENCE_ON_TWO_LINES: {sorted(FIRST_SENTENCE_ON_TWO_LINES - set(long))}"


# The application (parallelwrapper/app/: pw-fit, its runs, compare, predict, MNIST, models) on the
# library's public API. The private names it may still import, each with why.
APP = "parallelwrapper.app"
PRIVATE_IMPORTS: dict[str, str] = {}


def public_names() -> set[str]:
    """`parallelwrapper.__all__`, read from the source."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("parallelwrapper/__init__.py has no __all__")


def library_names_imported(name: str) -> set[str]:
    """What app module `name` imports from outside the app: `parallelwrapper.X` for a public name,
    `parallelwrapper.module.X` (or the module) otherwise."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "parallelwrapper" and not a.name.startswith(APP))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] == "parallelwrapper" and not (base + ".").startswith(APP + "."):
                found.update(f"{base}.{a.name}" for a in node.names)
    return found


def test_the_library_never_imports_the_application() -> None:
    wrong = {name: sorted(t for t in targets if (t + ".").startswith(APP + ".")) for name, targets in GRAPH.items() if not (name + ".").startswith(APP + ".")}
    assert not {k: v for k, v in wrong.items() if v}, "library modules that import parallelwrapper.app"


def test_the_application_imports_only_the_public_api() -> None:
    public = {f"parallelwrapper.{n}" for n in public_names()}
    app = [name for name in MODULES if (name + ".").startswith(APP + ".")]
    assert "parallelwrapper.app.cli" in app
    private = {name: sorted(library_names_imported(name) - public - PRIVATE_IMPORTS.keys()) for name in app}
    assert not {k: v for k, v in private.items() if v}, "app modules importing what parallelwrapper.__all__ does not export"
    used = set().union(*(library_names_imported(name) for name in app))
    assert PRIVATE_IMPORTS.keys() <= used, f"allowed but no longer imported (drop them): {sorted(PRIVATE_IMPORTS.keys() - used)}"


def test_only_the_application_imports_click_or_matplotlib() -> None:
    def imports_ui(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n.split(".")[0] in ("click", "matplotlib") for n in names):
                return True
        return False

    users = {name for name, path in MODULES.items() if imports_ui(path)}
    assert "parallelwrapper.app.cli" in users
    assert {name for name in users if not (name + ".").startswith(APP + ".")} == set()


def test_importing_the_library_loads_neither_click_nor_matplotlib_nor_torchs_pipelining() -> None:
    """Nor torch.distributed.pipelining, which imports torch._dynamo and sympy: 2 s of the start of
    a process that makes no optimizer (`pw-fit --help`, `pw-fit predict`), where torch itself takes
    2.2 s. A pipeline's module imports it, for a config that asks for one (pipeline/stages.py)."""
    heavy = ("click", "matplotlib", "torch.distributed.pipelining", "torch._dynamo", "sympy")
    loaded = f"sorted(m for m in sys.modules if m.startswith({heavy}) or m.startswith('parallelwrapper.app'))"
    code = f"import sys, parallelwrapper; print({loaded})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=PACKAGE.parent, check=True).stdout
    assert out.strip() == "[]"
