"""The package is typed, and mypy --strict (configured in pyproject.toml) agrees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_mypy_strict_is_clean() -> None:
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=root, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
