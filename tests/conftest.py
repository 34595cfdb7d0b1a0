"""Shared fixtures: the real MNIST files, and hygiene checks that fail a test which leaks a child
process, a process group or an environment variable."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """The directory of the real gzipped MNIST files; $PW_DATA_DIR (the package's own, as pw-fit
    reads it) overrides the default (the shared copy beside the repository). Missing files fail
    the test: no fake data."""
    env = os.environ.get("PW_DATA_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
    if not (path / "train-images-idx3-ubyte.gz").is_file():
        pytest.fail(f"real MNIST files not found in {path}; set PW_DATA_DIR to their directory")
    return path


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    env_before = dict(os.environ)
    yield
    leaked = [p for p in multiprocessing.active_children() if p.name.startswith("parallelwrapper")]
    for p in leaked:
        p.kill()
    assert not leaked, f"test left worker processes running: {leaked}"
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        dist.destroy_process_group()
    assert not initialized, "test left a process group initialized"
    # pytest and torch's compiler set a few of their own on first use; the project sets none.
    keys = {k for k in env_before.keys() | os.environ.keys() if not k.startswith(("PYTEST_", "TORCHINDUCTOR_"))}
    changed = {k for k in keys if env_before.get(k) != os.environ.get(k)}
    for k in changed:
        if k in env_before:
            os.environ[k] = env_before[k]
        else:
            del os.environ[k]
    assert not changed, f"test changed environment variables: {sorted(changed)}"
