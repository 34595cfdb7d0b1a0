"""Each script in examples/ runs at a tiny size (`--tiny`), on the real MNIST files where it uses
MNIST, as a user would run it: a subprocess from the repository root, with a timeout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, timeout: float = 110) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--tiny", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == [
        "compare_convergence.py",
        "custom_data.py",
        "custom_training_step.py",
        "mnist_multi_gpu.py",
    ]


@pytest.mark.timeout(120)
def test_dl4j_mnist_tutorial(mnist_dir: Path) -> None:
    out = run_example("mnist_multi_gpu.py", "--data-dir", str(mnist_dir))
    assert "epoch 0: test accuracy" in out
    assert "1024 samples" in out and "averagings; final test accuracy" in out


@pytest.mark.timeout(120)
def test_custom_dataset_and_dataloader() -> None:
    out = run_example("custom_data.py")
    line = next(ln for ln in out.splitlines() if "test accuracy" in ln)
    before, after = (float(x) for x in line.split("test accuracy ")[1].split(" -> "))
    assert before < 0.5 < 0.8 < after, "the MLP did not learn the teacher's classes"


@pytest.mark.timeout(120)
def test_custom_training_step(mnist_dir: Path) -> None:
    out = run_example("custom_training_step.py", "--data-dir", str(mnist_dir))
    line = next(ln for ln in out.splitlines() if "test reconstruction MSE" in ln)
    before, after = (float(x) for x in line.split("MSE ")[1].split(" -> "))
    assert after < before, "the autoencoder did not learn"


@pytest.mark.timeout(150)
def test_convergence_comparison(mnist_dir: Path, tmp_path: Path) -> None:
    out = run_example("compare_convergence.py", "--data-dir", str(mnist_dir), "--out", str(tmp_path), timeout=140)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare.csv", "compare.md", "compare.png"]
    for label in ("shared gradients", "averaging k=1", "averaging k=4"):
        assert f"| {label} |" in out
    assert "collectives" in out and "MB sent per worker" in out
