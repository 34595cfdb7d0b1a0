"""`pw-fit` and `pw-fit compare`: option parsing, error messages, output files and their schema.

Parsing tests replace the library call and start no process. The real runs train on a few
batches of the real MNIST files (`--train-samples`, `--test-samples`): one in this process
through click's CliRunner, one through the installed `pw-fit` entry point in a subprocess, and a
short compare run.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from parallelwrapper import TrainingMode, cli, run
from parallelwrapper.compare import CSV_FIELDS, CompareOptions
from parallelwrapper.data.mnist import FILES
from parallelwrapper.models import LeNet
from parallelwrapper.run import RunOptions, Summary

SUMMARY_TYPES: dict[str, type | tuple[type, ...]] = {
    "test_accuracy": float,
    "test_loss": float,
    "samples_per_second": float,
    "wall_seconds": float,
    "train_seconds": float,
    "epochs": int,
    "workers": int,
    "averaging_frequency": int,
    "mode": str,
    "samples": int,
    "iterations": int,
    "rounds": int,
    "final_score": float,
    "epoch_accuracies": list,
    "options": dict,
}
RECORD_TYPES: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "step": int,
    "iteration": int,
    "samples": int,
    "epoch": int,
    "score": float,
    "seconds": float,
}


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args), prog_name="pw-fit")


def assert_usage_error(result: Result, *fragments: str) -> None:
    """Exit code 2, a click usage message containing every fragment, and no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


# -- parsing: the library call replaced -------------------------------------------------------------


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace the library calls behind the commands; record what they were given."""
    seen: dict[str, Any] = {}

    def fake_train(options: RunOptions) -> Summary:
        seen["train"] = options
        return Summary(0.99, 0.03, 1000.0, 2.0, 1.0, options.epochs, options.workers, options.averaging_frequency, options.mode.value, 10, 1, 1, 0.1)

    def fake_compare(options: CompareOptions) -> list[Any]:
        seen["compare"] = options
        return []

    monkeypatch.setattr(cli, "train_mnist", fake_train)
    monkeypatch.setattr(cli, "compare", fake_compare)
    return seen


def test_defaults_follow_dl4j_example(captured: dict[str, Any]) -> None:
    result = invoke()
    assert result.exit_code == 0, result.output
    assert captured["train"] == RunOptions()
    o = captured["train"]
    assert (o.workers, o.prefetch_buffer, o.averaging_frequency, o.batch_size, o.seed) == (2, 24, 3, 128, 123)
    assert o.report_score_after_averaging and o.average_updaters and o.mode is TrainingMode.AVERAGING
    assert (o.optimizer, o.model, o.device, o.data_dir, o.out) == ("nesterov", "lenet", "auto", None, None)
    assert "test accuracy 0.9900" in result.output and "samples/s" in result.output and "wall time" in result.output


def test_overlap_averaging_reaches_the_run(captured: dict[str, Any]) -> None:
    result = invoke("--overlap-averaging", "--deterministic")
    assert result.exit_code == 0, result.output
    assert captured["train"] == RunOptions(overlap_averaging=True, deterministic=True)


def test_every_option_reaches_the_run(captured: dict[str, Any], tmp_path: Path, mnist_dir: Path) -> None:
    result = invoke(
        "--workers", "3", "--prefetch-buffer", "7", "--averaging-frequency", "5",
        "--no-report-score-after-averaging", "--no-average-updaters", "--mode", "shared-gradients",
        "--epochs", "4", "--batch-size", "64", "--lr", "0.2", "--optimizer", "adamw", "--model", "mlp",
        "--device", "cpu", "--seed", "9", "--data-dir", str(mnist_dir), "--no-download",
        "--out", str(tmp_path / "o"), "--train-samples", "100", "--test-samples", "50",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert captured["train"] == RunOptions(
        workers=3, prefetch_buffer=7, averaging_frequency=5, report_score_after_averaging=False,
        average_updaters=False, mode=TrainingMode.SHARED_GRADIENTS, epochs=4, batch_size=64, lr=0.2,
        optimizer="adamw", model="mlp", device="cpu", seed=9, data_dir=mnist_dir, download=False,
        out=tmp_path / "o", train_samples=100, test_samples=50,
    )  # fmt: skip


def test_recipe_options_reach_the_run_and_the_builder(captured: dict[str, Any]) -> None:
    result = invoke("--precision", "bf16-mixed", "--clip-grad-norm", "0.5")
    assert result.exit_code == 0, result.output
    options = captured["train"]
    assert options == RunOptions(precision="bf16-mixed", clip_grad_norm=0.5)
    with run.builder(LeNet(), options).build() as w:
        assert (w.config.precision, w.config.gradient_clip_norm) == ("bf16-mixed", 0.5)
    assert invoke("--precision", "fp8").exit_code != 0 and invoke("--clip-grad-norm", "0").exit_code != 0


def test_lr_defaults_per_optimizer(captured: dict[str, Any]) -> None:
    assert invoke("--optimizer", "adam").exit_code == 0
    assert captured["train"].lr is None and captured["train"].learning_rate == 1e-3
    assert invoke().exit_code == 0 and captured["train"].learning_rate == 0.04


def test_compare_options(captured: dict[str, Any], tmp_path: Path) -> None:
    result = invoke(
        "compare", "--frequencies", "2, 8,32", "--no-shared-gradients", "--evals", "3", "--target", "0.9",
        "--workers", "4", "--lr", "0.01", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    options = captured["compare"]
    assert options.frequencies == (2, 8, 32) and not options.shared_gradients
    assert (options.evals_per_epoch, options.target_accuracy, options.out) == (3, 0.9, tmp_path)
    assert options.base == RunOptions(workers=4, lr=0.01)
    assert "train" not in captured


def test_compare_defaults(captured: dict[str, Any]) -> None:
    assert invoke("compare").exit_code == 0
    options = captured["compare"]
    assert options.frequencies == (1, 4, 16) and options.shared_gradients
    assert options.out == Path("runs/compare")


# -- errors: usage messages, no tracebacks ------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--mode", "bogus"], ["--mode", "'bogus' is not one of 'averaging', 'shared-gradients'"]),
        (["--optimizer", "rmsprop"], ["--optimizer", "'rmsprop' is not one of"]),
        (["--model", "resnet"], ["--model"]),
        (["--device", "tpu"], ["--device"]),
        (["--workers", "0"], ["--workers", "0 is not in the range x>=1"]),
        (["--averaging-frequency", "0"], ["--averaging-frequency"]),
        (["--lr", "0"], ["--lr"]),
        (["--data-dir", "/nonexistent/mnist"], ["--data-dir", "'/nonexistent/mnist' does not exist"]),
        (["compare", "--frequencies", "1,x"], ["--frequencies", "not a comma-separated list of integers"]),
        (["compare", "--frequencies", "0,4"], ["--frequencies", "integers >= 1"]),
        (["compare", "--frequencies", "4,4"], ["--frequencies", "distinct"]),
        (["compare", "--frequencies", "", "--no-shared-gradients"], ["nothing to compare"]),
        (["compare", "--target", "1.5"], ["--target"]),
        (["compare", "--mode", "averaging"], ["No such option", "--mode"]),
        (["--workers", "3", "compare"], ["--workers given before 'compare'", "pw-fit compare --workers"]),
    ],
)
def test_bad_input_is_a_usage_error(captured: dict[str, Any], args: list[str], fragments: list[str]) -> None:
    assert_usage_error(invoke(*args), *fragments)
    assert not captured, "nothing may run after a usage error"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu(captured: dict[str, Any]) -> None:
    assert_usage_error(invoke("--device", "cuda"), "no CUDA device", "'cpu' or 'auto'")


def test_missing_mnist_files_name_data_dir(tmp_path: Path) -> None:
    result = invoke("--data-dir", str(tmp_path), "--no-download")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    first = result.output.splitlines()[0]
    assert first.startswith(f"Error: MNIST files missing from {tmp_path}: train-images-idx3-ubyte[.gz]")
    assert "--data-dir DIR (or set $PW_DATA_DIR=DIR)" in first and "drop --no-download" in first
    assert all(name in first for name in FILES) and "load_mnist" not in result.output
    assert not list(tmp_path.iterdir()), "a failed run leaves no files behind"


# -- real runs ---------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_types(record: dict[str, Any], types: dict[str, type | tuple[type, ...]]) -> None:
    for key, kind in types.items():
        assert key in record, f"{key} missing from {record}"
        expected = (int, float) if kind is float else kind  # JSON writes 2.0 as 2.0, but be lenient
        assert isinstance(record[key], expected) and not isinstance(record[key], bool), (key, record[key])


@pytest.mark.timeout(120)
def test_fit_writes_metrics_summary_and_model(mnist_dir: Path, tmp_path: Path) -> None:
    """1,024 images = 8 batches of 128 per epoch; 2 workers x k=2: 2 averagings per epoch. Dealt
    (--deterministic): first-come, a fast worker may look ahead at a batch the other needed to
    fill its round, and the epoch then ends with a round more."""
    out = tmp_path / "run"
    result = invoke(
        "--workers", "2", "--epochs", "2", "--averaging-frequency", "2", "--deterministic", "--data-dir", str(mnist_dir),
        "--train-samples", "1024", "--test-samples", "500", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "epoch 0: test accuracy" in result.output and "epoch 1: test accuracy" in result.output
    assert "samples/s" in result.output and "wall time" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "model.pt", "summary.json"]

    records = read_jsonl(out / "metrics.jsonl")
    scores = [r for r in records if r["kind"] == "score"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(scores) == 4 and len(epochs) == 2
    for r in records:
        check_types(r, RECORD_TYPES)
        assert math.isfinite(r["score"]) and r["score"] > 0
    for r in epochs:
        check_types(r, {"test_accuracy": float, "test_loss": float})
        assert 0.0 <= r["test_accuracy"] <= 1.0
    assert [r["step"] for r in scores] == [1, 2, 3, 4]
    assert [r["samples"] for r in scores] == [512, 1024, 1536, 2048]
    assert [(r["epoch"], r["samples"], r["iteration"]) for r in epochs] == [(0, 1024, 8), (1, 2048, 16)]
    seconds = [r["seconds"] for r in records]
    assert seconds == sorted(seconds)

    summary = json.loads((out / "summary.json").read_text())
    check_types(summary, SUMMARY_TYPES)
    assert (summary["epochs"], summary["workers"], summary["averaging_frequency"], summary["mode"]) == (2, 2, 2, "averaging")
    assert (summary["samples"], summary["iterations"], summary["rounds"]) == (2048, 16, 4)
    assert summary["test_accuracy"] == epochs[-1]["test_accuracy"] == summary["epoch_accuracies"][-1]
    assert summary["samples_per_second"] > 0 and summary["wall_seconds"] >= summary["train_seconds"] > 0
    assert summary["options"]["lr"] == 0.04 and summary["options"]["data_dir"] == str(mnist_dir)

    model = LeNet()
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    assert not torch.equal(model.fc2.weight, torch.zeros_like(model.fc2.weight))


@pytest.mark.timeout(180)
def test_resume_ends_where_an_uninterrupted_run_ends(mnist_dir: Path, tmp_path: Path) -> None:
    """Two epochs straight, against one epoch (checkpointed) then `--resume --epochs 2`."""
    common = [
        "--workers", "2", "--averaging-frequency", "2", "--data-dir", str(mnist_dir), "--deterministic",
        "--train-samples", "1024", "--test-samples", "200", "--checkpoint-every", "1",
    ]  # fmt: skip
    straight = invoke(*common, "--epochs", "2", "--out", str(tmp_path / "straight"))
    assert straight.exit_code == 0, straight.output
    first = invoke(*common, "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert first.exit_code == 0, first.output
    resumed = invoke(*common, "--epochs", "2", "--resume", str(tmp_path / "ckpt"), "--out", str(tmp_path / "resumed"))
    assert resumed.exit_code == 0, resumed.output
    assert "epoch 0:" not in resumed.output and "epoch 1: test accuracy" in resumed.output
    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    done = invoke(*common, "--epochs", "2", "--resume", str(tmp_path / "ckpt"))
    assert done.exit_code != 0 and "has trained 2 epochs already: pass --epochs > 2" in done.output
    other = invoke(*common, "--epochs", "3", "--averaging-frequency", "3", "--resume", str(tmp_path / "ckpt"))
    assert other.exit_code != 0 and "averaging_frequency: checkpoint has 2, this run has 3" in other.output


def pw_fit() -> str:
    """The installed console script, beside this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "pw-fit"
    found = str(beside) if beside.is_file() else shutil.which("pw-fit")
    if found is None:
        pytest.fail("the pw-fit entry point is not installed; run `pip install -e .`")
    return found


@pytest.mark.timeout(120)
def test_installed_entry_point_trains_with_shared_gradients(mnist_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sg"
    proc = subprocess.run(
        [pw_fit(), "--mode", "shared-gradients", "--averaging-frequency", "1", "--data-dir", str(mnist_dir),
         "--train-samples", "512", "--test-samples", "200", "--out", str(out)],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "test accuracy" in proc.stdout and "samples/s" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    # 4 batches, 2 workers in lockstep: 2 steps, a score after each.
    assert (summary["mode"], summary["rounds"], summary["iterations"], summary["samples"]) == ("shared-gradients", 2, 4, 512)
    assert len([r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "score"]) == 2


@pytest.mark.timeout(60)
def test_installed_entry_point_reports_missing_files_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [pw_fit(), "--data-dir", str(tmp_path), "--no-download"], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "--data-dir" in proc.stderr


@pytest.mark.timeout(150)
def test_short_compare_run(mnist_dir: Path, tmp_path: Path) -> None:
    """1,024 images, 3 runs (shared gradients, k=1, k=2), evaluated at 0, 512 and 1,024 samples."""
    result = invoke(
        "compare", "--frequencies", "1,2", "--evals", "2", "--data-dir", str(mnist_dir),
        "--train-samples", "1024", "--test-samples", "300", "--target", "0.3", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare.csv", "compare.md", "compare.png"]

    with (tmp_path / "compare.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_FIELDS
        rows = list(reader)
    runs = ["shared gradients", "averaging k=1", "averaging k=2"]
    assert [r["run"] for r in rows] == [run for run in runs for _ in range(3)]
    assert [int(r["samples"]) for r in rows] == [0, 512, 1024] * 3
    by_run = {run: [r for r in rows if r["run"] == run] for run in runs}
    for run_rows in by_run.values():
        assert float(run_rows[0]["seconds"]) == 0.0 and float(run_rows[-1]["seconds"]) > 0
    # All three start from the same weights: the same accuracy before training.
    assert len({by_run[run][0]["test_accuracy"] for run in runs}) == 1
    # Shared gradients and averaging with k=1 are the same training (to rounding), but
    # averaging sends parameters and momentum: twice the gradients' volume, in as many collectives.
    sg, k1, k2 = (by_run[run][-1] for run in runs)
    assert abs(float(sg["test_accuracy"]) - float(k1["test_accuracy"])) <= 0.01
    assert int(sg["rounds"]) == int(k1["rounds"]) == 4 and int(k2["rounds"]) == 2
    assert int(sg["collectives"]) == int(k1["collectives"])
    assert float(k1["bytes_per_worker"]) == pytest.approx(2 * float(sg["bytes_per_worker"]), rel=1e-3)
    assert float(k2["bytes_per_worker"]) < float(k1["bytes_per_worker"])

    table = (tmp_path / "compare.md").read_text()
    assert "| run | final test accuracy |" in table and "samples to 30%" in table and "MB sent per worker" in table
    assert all(f"| {run} |" in table for run in runs)
    assert table in result.output
    png = (tmp_path / "compare.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
