"""A feature that lives in a folder of its own plugs in as an object behind one interface
(feature.Feature, which features.of builds): no module outside the folder names one of the
feature's classes (an import of it, an `isinstance` on it, an attribute `feature.Class`), and none
but config.py, which declares and checks them, reads one of its options. Fast tier: reads the
source, runs none of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parents[1] / "parallelwrapper"
# Folders of the package that are one feature each, and classes each is known to hold (so that
# the test fails if its classes are not found where they are).
FEATURES = {
    "pipeline": {"Stages", "StageReplica", "RelaySource", "Position"},
    "replacement": {"Replaces", "Keeper", "Kept", "Replacer", "Regroup", "Ledger"},
    "hierarchy": {"Nodes", "Node", "NodeSteps"},
}
# Each feature's options, which only its folder and config.py read (an attribute of that name
# read on anything). A call of one is a builder setter's (`.pipeline(stages=2)`), which sets it.
OPTIONS = {
    "pipeline": {"pipeline"},
    "replacement": {"on_worker_failure", "max_replacements"},
    "hierarchy": {"hierarchy"},
}
# Where a read is allowed, and why: config.py declares the options and refuses those that do not
# go together; the application (app/) is the library's user, which sets options through the
# builder and reads only its own (RunOptions) of those names (tests/test_architecture.py holds
# it to the public API).
READERS = [PACKAGE / "config.py", PACKAGE / "app"]


def classes_of(feature: str) -> set[str]:
    return {node.name for path in (PACKAGE / feature).rglob("*.py") for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def named_classes(path: Path, feature: str, classes: set[str]) -> list[str]:
    """Where module `path` names one of `classes` of `feature`: by import from the feature's
    package or its modules, or as an attribute of a name bound to it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None and feature in node.module.split("."):
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name in classes]
        elif isinstance(node, ast.Attribute) and node.attr in classes and isinstance(node.value, ast.Name) and node.value.id == feature:
            found.append(f"line {node.lineno}: {feature}.{node.attr}")
    return found


@pytest.mark.parametrize("feature", FEATURES)
def test_no_module_outside_a_feature_names_its_classes(feature: str) -> None:
    classes = classes_of(feature)
    assert FEATURES[feature] <= classes
    outside = [p for p in PACKAGE.rglob("*.py") if (PACKAGE / feature) not in p.parents]
    leaks = {str(p.relative_to(PACKAGE)): where for p in outside if (where := named_classes(p, feature, classes))}
    assert not leaks, f"modules outside {feature}/ name its classes (ask its package's functions instead): {leaks}"


def option_reads(source: str, options: set[str]) -> list[str]:
    """Where `source` reads one of `options`: an attribute of that name that is not called."""
    tree = ast.parse(source)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    reads = (n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in options and id(n) not in called)
    return [f"line {n.lineno}: .{n.attr}" for n in reads]


@pytest.mark.parametrize("feature", OPTIONS)
def test_no_module_outside_a_feature_reads_its_options(feature: str) -> None:
    allowed = [PACKAGE / feature, *READERS]
    outside = [p for p in PACKAGE.rglob("*.py") if not any(a == p or a in p.parents for a in allowed)]
    reads = {str(p.relative_to(PACKAGE)): where for p in outside if (where := option_reads(p.read_text(), OPTIONS[feature]))}
    assert not reads, f"modules outside {feature}/ read its options (ask the feature object, feature.Feature, instead): {reads}"


def test_a_read_is_found_and_a_setter_call_is_not() -> None:
    """The check fails on a read planted in any module's source, and passes a builder's setter call."""
    assert option_reads("if config.pipeline is None: pass", OPTIONS["pipeline"]) == ["line 1: .pipeline"]
    assert option_reads("x = self.config.on_worker_failure == 'replace'", OPTIONS["replacement"]) == ["line 1: .on_worker_failure"]
    assert option_reads("b = b.hierarchy('node').pipeline(stages=2)", OPTIONS["hierarchy"] | OPTIONS["pipeline"]) == []
    planted = (PACKAGE / "rounds" / "engine.py").read_text() + "\nSPLIT = Config().pipeline\n"
    assert option_reads(planted, OPTIONS["pipeline"]) == [f"line {planted.count(chr(10))}: .pipeline"]


def test_replacement_imports_nothing_of_the_hosts() -> None:
    """It sees the pool as replacer.Pool and a worker as keeper.Replaceable, which the hosts implement."""
    found = [
        f"{p.name} line {node.lineno}"
        for p in (PACKAGE / "replacement").rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module is not None and "hosts" in node.module.split(".")
    ]
    assert not found, f"replacement/ imports the hosts: {found}"
