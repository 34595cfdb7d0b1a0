"""The documentation site builds with `mkdocs build --strict` (a broken link, a missing page or
anchor, a warning of any kind fails it), and every object the API reference documents, with its
public methods and properties, has a docstring. The code blocks of its pages run in
tests/test_readme.py. Fast tier: mkdocs builds in this process, in about a second."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import parallelwrapper

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference.md"


def test_the_site_builds_strict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    monkeypatch.chdir(ROOT)  # snippets (the benchmarks page) are read relative to the root
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")  # mkdocs-material sets it, and prints a banner without it
    build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True))
    assert (tmp_path / "site" / "reference" / "index.html").is_file()


def documented() -> dict[str, object]:
    """The objects of the API reference's `::: name` lines, by name."""
    found = {}
    for name in re.findall(r"^::: (\S+)$", REFERENCE.read_text(), re.M):
        module, _, attr = name.rpartition(".")
        found[name] = getattr(importlib.import_module(module), attr)
    return found


def test_the_reference_documents_every_export() -> None:
    missing = set(parallelwrapper.__all__) - {name.rpartition(".")[2] for name in documented()}
    assert not missing, f"docs/reference.md has no `::: parallelwrapper.NAME` line for {sorted(missing)}"


def public_members(cls: type) -> dict[str, object]:
    """The methods and properties a user calls, defined in this package (not torch's, not Enum's)."""
    members = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("parallelwrapper"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in members:
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value) or isinstance(value, property):
                members[name] = value
    return members


def test_every_documented_object_and_member_has_a_docstring() -> None:
    undocumented = []
    for name, obj in documented().items():
        if not (obj.__doc__ or "").strip():
            undocumented.append(name)
        if inspect.isclass(obj):
            undocumented += [f"{name}.{m}" for m, value in public_members(obj).items() if not (value.__doc__ or "").strip()]
    assert not undocumented, f"no docstring (the API reference would show none): {undocumented}"
