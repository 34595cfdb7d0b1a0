"""A feature that lives in a folder of its own plugs in through the functions its package
offers: no module outside the folder names one of the feature's classes (an import of it, an
`isinstance` on it, an attribute `feature.Class`). Fast tier: reads the source, runs none of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parents[1] / "parallelwrapper"
# Folders of the package that are one feature each, and classes each is known to hold (so that
# the test fails if its classes are not found where they are).
FEATURES = {
    "pipeline": {"StageReplica", "RelaySource", "Position"},
    "replacement": {"Keeper", "Kept", "Replacer", "Regroup", "Ledger"},
    "hierarchy": {"Node", "NodeSteps"},
}


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
