"""The wheel ships what a user's type checker needs: `parallelwrapper/py.typed` (PEP 561), so that
mypy reads the package's annotations instead of treating it as Any, and the metadata says so.

Builds a wheel from a copy of the sources (the working tree gets no build/ or egg-info of it) and
runs mypy on a small user script against the unpacked wheel: about 15 s, mostly mypy reading torch.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = """\
from parallelwrapper import ParallelWrapper
from parallelwrapper.app.models import LeNet

builder = ParallelWrapper.builder(LeNet())
reveal_type(builder)
builder.workers("two")
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "parallelwrapper", src / "parallelwrapper", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out)]
    result = subprocess.run(command, cwd=src, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("parallelwrapper-*.whl")
    return built


def test_the_wheel_ships_py_typed_and_says_it_is_typed(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(z.read(metadata_name))
    assert "parallelwrapper/py.typed" in names
    classifiers = metadata.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert {"Programming Language :: Python :: 3.10", "Programming Language :: Python :: 3.11"} <= set(classifiers)
    assert metadata["Requires-Python"] == ">=3.10"
    assert metadata["Author"] == "parallelwrapper developers"


def mypy(script: Path, site: Path) -> str:
    """mypy on `script`, with the unpacked wheel on the interpreter's path (as site-packages would be:
    a package found there is read only if it has py.typed); a cache of its own, and a config that
    leaves torch's and numpy's own sources unread (their types are Any: reading them is 13 s of the
    test's 14, and what is tested is that mypy reads this package's)."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    config = script.parent / "mypy.ini"
    config.write_text("[mypy]\n\n[mypy-torch.*,numpy.*]\nfollow_imports = skip\n")
    command = [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(script.parent / ".mypy_cache"), "--no-error-summary", script.name]
    result = subprocess.run(command, cwd=script.parent, env=env, capture_output=True, text=True, timeout=240)
    return result.stdout + result.stderr


def test_mypy_reads_the_installed_packages_types(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    user = tmp_path / "user"
    user.mkdir()
    (user / "use.py").write_text(USER_SCRIPT)
    out = mypy(user / "use.py", site)
    assert 'use.py:5: note: Revealed type is "parallelwrapper.wrapper.Builder"' in out, out
    assert 'use.py:6: error: Argument 1 to "workers" of ' in out and 'incompatible type "str"; expected "int"' in out, out
    # Without the marker, the same package is Any to mypy: py.typed is what made the difference.
    (site / "parallelwrapper" / "py.typed").unlink()
    shutil.rmtree(user / ".mypy_cache")
    out = mypy(user / "use.py", site)
    assert "missing library stubs or py.typed marker" in out and 'Revealed type is "Any"' in out, out
