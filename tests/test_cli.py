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
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from parallelwrapper import TrainingMode, checkpoint
from parallelwrapper.app import cli
from parallelwrapper.app.communication import estimated_communication
from parallelwrapper.app.compare import CSV_FIELDS, CompareOptions
from parallelwrapper.app.mnist import FILES
from parallelwrapper.app.models import LeNet
from parallelwrapper.app.options import RunOptions, builder, with_lr_schedule
from parallelwrapper.app.run import Summary
from parallelwrapper.config import Pipeline
from test_faults import interruptible

SUMMARY_TYPES: dict[str, type | tuple[type, ...]] = {
    "test_accuracy": float,
    "test_loss": float,
    "train_samples_per_second": float,
    "wall_samples_per_second": float,
    "train_seconds": float,
    "wall_seconds": float,
    "epochs": int,
    "workers": int,
    "averaging_frequency": int,
    "training_mode": str,
    "samples": int,
    "session_samples": int,
    "iterations": int,
    "rounds": int,
    "final_epoch_loss": float,
    "last_round_score": float,
    "exchange_share": float,
    "epoch_accuracies": list,
    "options": dict,
}
RECORD_TYPES: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "step": int,
    "iteration": int,
    "samples": int,
    "epoch": int,
    "seconds": float,
}
FIELDS = {
    "score": {"score": float, "training_s": float, "exchange_s": float},
    "validation": {"val_loss": float, "val_accuracy": float},
    "epoch": {"epoch_loss": float, "test_loss": float, "test_accuracy": float},
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
        return Summary(
            test_accuracy=0.99, test_loss=0.03, train_samples_per_second=1000.0, wall_samples_per_second=500.0,
            train_seconds=1.0, wall_seconds=2.0, epochs=options.epochs, workers=options.config.workers,
            averaging_frequency=options.averaging_frequency, training_mode=options.config.training_mode.value, samples=1000, session_samples=1000,
            iterations=8, rounds=1, final_epoch_loss=0.1, last_round_score=0.09, final_lr=0.04,
        )  # fmt: skip

    def fake_compare(options: CompareOptions) -> list[Any]:
        seen["compare"] = options
        return []

    monkeypatch.setattr(cli, "train_mnist", fake_train)
    monkeypatch.setattr(cli, "compare", fake_compare)
    return seen


def test_defaults_follow_dl4j_example(captured: dict[str, Any]) -> None:
    result = invoke()
    assert result.exit_code == 0, result.output
    assert captured["train"] == RunOptions.of()
    o, c = captured["train"], captured["train"].config
    assert (c.workers, c.prefetch_buffer, c.averaging_frequency, o.batch_size, c.seed, c.validation_every) == (2, 24, 3, 128, 123, None)
    assert c.report_score_after_averaging and c.average_updaters and c.training_mode is TrainingMode.AVERAGING
    assert (o.optimizer, o.model, o.device, o.data.data_dir, o.out) == ("nesterov", "lenet", "auto", None, None)
    assert "test accuracy 0.9900" in result.output
    assert "1,000 samples/s while training (start-up and validation excluded)" in result.output
    assert "500 samples/s over the wall time of 2.0 s (all included)" in result.output


def test_overlap_averaging_reaches_the_run(captured: dict[str, Any]) -> None:
    result = invoke("--overlap-averaging", "--deterministic")
    assert result.exit_code == 0, result.output
    assert captured["train"] == RunOptions.of(overlap_averaging=True, deterministic=True)


def test_every_option_reaches_the_run(captured: dict[str, Any], tmp_path: Path, mnist_dir: Path) -> None:
    result = invoke(
        "--workers", "3", "--prefetch-buffer", "7", "--averaging-frequency", "5",
        "--no-report-score-after-averaging", "--no-average-updaters", "--training-mode", "shared-gradients",
        "--epochs", "4", "--batch-size", "64", "--lr", "0.2", "--optimizer", "adamw", "--model", "mlp",
        "--device", "cpu", "--seed", "9", "--data-dir", str(mnist_dir), "--no-download",
        "--out", str(tmp_path / "o"), "--train-samples", "100", "--test-samples", "50", "--validation-every", "6",
        "--early-stopping-patience", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert captured["train"] == RunOptions.of(
        workers=3, prefetch_buffer=7, averaging_frequency=5, report_score_after_averaging=False,
        average_updaters=False, training_mode=TrainingMode.SHARED_GRADIENTS, epochs=4, batch_size=64, lr=0.2,
        optimizer="adamw", model="mlp", device="cpu", seed=9, data_dir=mnist_dir, download=False,
        out=tmp_path / "o", train_samples=100, test_samples=50, validation_every=6, early_stopping_patience=2,
    )  # fmt: skip


def test_recipe_options_reach_the_run_and_the_builder(captured: dict[str, Any]) -> None:
    result = invoke("--precision", "bf16-mixed", "--gradient-clipping", "0.5")
    assert result.exit_code == 0, result.output
    options = captured["train"]
    assert options == RunOptions.of(precision="bf16-mixed", gradient_clipping=0.5)
    with builder(LeNet(), options).build() as w:
        assert (w.config.precision, w.config.gradient_clipping) == ("bf16-mixed", 0.5)
    assert invoke("--precision", "fp8").exit_code != 0 and invoke("--gradient-clipping", "0").exit_code != 0


@pytest.mark.filterwarnings("ignore:4 processes")
def test_beyond_dl4j_options_reach_the_run_and_the_builder(captured: dict[str, Any]) -> None:
    """Off by default (DL4J's behaviour); --outer-lr turns on an outer SGD, Nesterov where it has momentum."""
    assert invoke().exit_code == 0
    o = captured["train"]
    assert (o.outer_lr, o.outer_momentum, o.config.warmup_sync_steps, o.config.payload_dtype) == (None, 0.0, 0, "float32")
    with builder(LeNet(), o).build() as w:
        assert w.outer_optimizer is None and (w.config.warmup_sync_steps, w.config.payload_dtype) == (0, "float32")
    args = ("--outer-lr", "0.8", "--outer-momentum", "0.5", "--warmup-sync-steps", "20", "--payload-dtype", "int8")
    assert invoke(*args).exit_code == 0
    options = captured["train"]
    assert options == RunOptions.of(outer_lr=0.8, outer_momentum=0.5, warmup_sync_steps=20, payload_dtype="int8")
    with builder(LeNet(), options).build() as w:
        assert (w.config.warmup_sync_steps, w.config.payload_dtype) == (20, "int8")
        assert w.outer_optimizer is not None and type(w.outer_optimizer) is torch.optim.SGD
        group = w.outer_optimizer.param_groups[0]
        assert (group["lr"], group["momentum"], group["nesterov"]) == (0.8, 0.5, True)
    assert invoke("--outer-lr", "1").exit_code == 0
    with builder(LeNet(), captured["train"]).build() as w:
        assert w.outer_optimizer is not None and w.outer_optimizer.param_groups[0]["nesterov"] is False
    assert invoke("--fragments", "3", "--overlap-averaging").exit_code == 0
    with builder(LeNet(), captured["train"]).build() as w:
        assert (w.config.fragments, w.config.overlap_averaging) == (3, True)
    with pytest.raises(ValueError, match=r"fragments\(3\) spreads each round's averaging"):
        builder(LeNet(), RunOptions.of(fragments=3)).build()
    assert invoke("--stages", "2", "--microbatches", "4").exit_code == 0
    with builder(LeNet(), captured["train"]).build() as w:
        assert w.config.pipeline == Pipeline(2, None, 4, "1f1b") and str(w.placement).startswith("2 workers x 2 stages")
    assert invoke("--stages", "2", "--microbatches", "8", "--pipeline-schedule", "zbv").exit_code == 0
    with builder(LeNet(), captured["train"]).build() as w:
        assert w.config.pipeline == Pipeline(2, None, 8, "zbv")


@pytest.mark.parametrize(
    ("name", "optimizer", "scheduler", "settings"),
    [
        ("none", "nesterov", None, {}),
        ("step", "nesterov", torch.optim.lr_scheduler.StepLR, {"step_size": 1, "gamma": 0.7}),
        ("cosine", "nesterov", torch.optim.lr_scheduler.CosineAnnealingLR, {"T_max": 3 * 235, "eta_min": 0.0}),
        ("onecycle", "nesterov", torch.optim.lr_scheduler.OneCycleLR, {"total_steps": 3 * 235, "cycle_momentum": True}),
        ("onecycle", "sgd", torch.optim.lr_scheduler.OneCycleLR, {"total_steps": 3 * 235, "cycle_momentum": False}),
    ],
)
def test_lr_schedule_reaches_the_builder(captured: dict[str, Any], name: str, optimizer: str, scheduler: type | None, settings: dict[str, Any]) -> None:
    """3 epochs of 469 batches on 2 workers: 3 x 235 steps, the counter per-step schedules follow."""
    assert invoke("--lr-schedule", name, "--optimizer", optimizer, "--epochs", "3").exit_code == 0
    options = captured["train"]
    assert options.lr_schedule == name
    with with_lr_schedule(builder(LeNet(), options), options, batches_per_epoch=469).build() as w:
        assert type(w.lr_scheduler) is scheduler if scheduler else w.lr_scheduler is None
        assert {k: getattr(w.lr_scheduler, k) for k in settings} == settings
        if name == "onecycle":  # it peaks at --lr
            assert [group["max_lr"] for group in w.optimizer.param_groups] == [options.learning_rate]


def test_flags_that_make_a_library_option_give_its_value(captured: dict[str, Any]) -> None:
    """--max-replacements N is replacement up to N times; without it a failure ends the run. Early
    stopping without --validation-every watches the validations at epochs' ends (validation_every None)."""
    assert invoke().exit_code == 0 and captured["train"].config.on_worker_failure == "raise"
    assert invoke("--max-replacements", "2", "--early-stopping-patience", "3").exit_code == 0
    o = captured["train"]
    assert (o.config.on_worker_failure, o.config.max_replacements, o.config.validation_every, o.early_stopping_patience) == ("replace", 2, None, 3)


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
    assert options.base == RunOptions.of(workers=4, lr=0.01)
    assert "train" not in captured


def test_auto_is_an_averaging_frequency(captured: dict[str, Any], tmp_path: Path) -> None:
    assert invoke("--averaging-frequency", "auto").exit_code == 0
    assert captured["train"].averaging_frequency == "auto"
    assert invoke("compare", "--frequencies", "4,auto", "--out", str(tmp_path)).exit_code == 0
    assert captured["compare"].frequencies == (4, "auto")
    result = invoke("--averaging-frequency", "fast")
    assert result.exit_code == 2 and "'fast': an averaging frequency is an integer >= 1 or 'auto'" in result.output


def test_compare_defaults(captured: dict[str, Any]) -> None:
    assert invoke("compare").exit_code == 0
    options = captured["compare"]
    assert options.frequencies == (1, 4, 16) and options.shared_gradients
    assert options.out == Path("runs/compare")


# -- errors: usage messages, no tracebacks ------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--training-mode", "bogus"], ["--training-mode", "'bogus' is not one of 'averaging', 'shared-gradients'"]),
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
        (["compare", "--training-mode", "averaging"], ["No such option", "--training-mode"]),
        (["--workers", "3", "compare"], ["--workers given before 'compare'", "pw-fit compare --workers"]),
        (["--early-stopping-patience", "0", "--validation-every", "5"], ["--early-stopping-patience"]),
        (["--validation-every", "-1"], ["--validation-every"]),
        (["--lr-schedule", "linear"], ["--lr-schedule", "'linear' is not one of 'none', 'step', 'cosine', 'onecycle'"]),
        (["compare", "--validation-every", "5"], ["No such option", "--validation-every"]),
        (["--outer-lr", "0"], ["--outer-lr"]),
        (["--outer-lr", "1", "--outer-momentum", "1"], ["--outer-momentum", "0<=x<1"]),
        (["--outer-momentum", "0.5"], ["outer_momentum 0.5 is the outer optimizer's", "--outer-lr LR"]),
        (["--warmup-sync-steps", "-1"], ["--warmup-sync-steps"]),
        (["--payload-dtype", "int16"], ["--payload-dtype", "'int16' is not one of float32, bfloat16, float16, int8, int4, sparse or sparse:D"]),
        (["--payload-dtype", "sparse:0.5"], ["--payload-dtype", "'sparse:0.5' is not one of", "sparse:D (D a density in (0, 0.25], e.g. sparse:0.03125)"]),
        (["compare", "--warmup-sync-steps", "5"], ["drop --warmup-sync-steps"]),
        (["compare", "--outer-lr", "1", "--frequencies", ""], ["give averaging frequencies with --outer-lr"]),
        (["--microbatches", "4"], ["--microbatches 4 shapes a pipeline", "--stages N"]),
        (["--stages", "0"], ["--stages"]),
        (["--pipeline-schedule", "zbv"], ["--pipeline-schedule zbv shapes a pipeline", "--stages N"]),
        (["--stages", "1"], ["--stages", "1 is not in the range x>=2"]),  # no pipeline is no --stages, as no .pipeline()
        (["--max-replacements", "1", "--fragments", "2", "--overlap-averaging"], ['on_worker_failure("replace") restarts every worker']),  # the library's refusal
        (["--stages", "2", "--pipeline-schedule", "interleaved"], ["--pipeline-schedule", "'interleaved' is not one of '1f1b', 'gpipe', 'zbv'"]),
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
    """1,024 images = 8 batches of 128 per epoch; 2 workers x k=2: 2 averagings per epoch, each
    validated (--validation-every 1). Dealt (--deterministic): first-come, a fast worker may look ahead
    at a batch the other needed to fill its round, and the epoch then ends with a round more."""
    out = tmp_path / "run"
    result = invoke(
        "--workers", "2", "--epochs", "2", "--averaging-frequency", "2", "--deterministic", "--data-dir", str(mnist_dir),
        "--train-samples", "1024", "--test-samples", "500", "--out", str(out), "--validation-every", "1", "--lr-schedule", "cosine",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "lenet on 1,024 MNIST training images: 2 workers on cpu with gloo" in result.output
    assert "epoch 0: mean training loss" in result.output and "epoch 1: mean training loss" in result.output
    assert "samples/s while training" in result.output and "wall time" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "model.pt", "summary.json"]

    records = read_jsonl(out / "metrics.jsonl")
    assert [r["kind"] for r in records] == ["score", "validation", "score", "validation", "epoch"] * 2
    for r in records:
        check_types(r, {**RECORD_TYPES, **FIELDS[r["kind"]]})
    scores, validations, epochs = ([r for r in records if r["kind"] == kind] for kind in ("score", "validation", "epoch"))
    assert all(math.isfinite(r["score"]) and r["score"] > 0 for r in scores)
    assert all(0.0 <= r["val_accuracy"] <= 1.0 for r in validations)
    assert [r["step"] for r in scores] == [r["step"] for r in validations] == [1, 2, 3, 4]
    assert [r["samples"] for r in scores] == [512, 1024, 1536, 2048]
    assert [(r["epoch"], r["samples"], r["iteration"], r["step"]) for r in epochs] == [(0, 1024, 8, 2), (1, 2048, 16, 4)]
    # An epoch's test figures are its last validation's; its loss is the mean over its rounds.
    assert [(r["test_loss"], r["test_accuracy"]) for r in epochs] == [(v["val_loss"], v["val_accuracy"]) for v in validations[1::2]]
    assert epochs[0]["epoch_loss"] == pytest.approx((scores[0]["score"] + scores[1]["score"]) / 2)
    seconds = [r["seconds"] for r in records]
    assert seconds == sorted(seconds)

    summary = json.loads((out / "summary.json").read_text())
    check_types(summary, SUMMARY_TYPES)
    assert (summary["epochs"], summary["workers"], summary["averaging_frequency"], summary["training_mode"]) == (2, 2, 2, "averaging")
    assert (summary["samples"], summary["session_samples"], summary["iterations"], summary["rounds"]) == (2048, 2048, 16, 4)
    assert summary["test_accuracy"] == epochs[-1]["test_accuracy"] == summary["epoch_accuracies"][-1]
    assert (summary["final_epoch_loss"], summary["last_round_score"]) == (epochs[-1]["epoch_loss"], scores[-1]["score"])
    assert summary["stopped_early_at_round"] is None
    assert 0 < summary["exchange_share"] < 1 and all(r["training_s"] > 0 and r["exchange_s"] > 0 for r in scores)
    assert summary["final_lr"] == pytest.approx(0.0, abs=1e-12), "cosine over the run's 2 x 4 steps ends at 0"
    assert summary["wall_seconds"] > summary["train_seconds"] > 0
    # Training only: between reports, after the first (start-up) and without validations.
    assert summary["train_seconds"] < scores[-1]["seconds"] - scores[0]["seconds"]
    assert summary["train_samples_per_second"] > summary["wall_samples_per_second"] == pytest.approx(2048 / summary["wall_seconds"])
    assert summary["options"]["lr"] == 0.04 and summary["options"]["data_dir"] == str(mnist_dir)

    model = LeNet()
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    assert not torch.equal(model.fc2.weight, torch.zeros_like(model.fc2.weight))


@pytest.mark.timeout(120)
def test_early_stopping_ends_the_run_when_val_loss_stops_improving(mnist_dir: Path, tmp_path: Path) -> None:
    """A learning rate 12x the default makes the test loss jump after the first averagings:
    with patience 1, the first validation that is no better ends the run, mid-way through 6 epochs."""
    out = tmp_path / "run"
    result = invoke(
        "--epochs", "6", "--averaging-frequency", "1", "--lr", "0.5", "--deterministic", "--data-dir", str(mnist_dir),
        "--train-samples", "512", "--test-samples", "300", "--validation-every", "1", "--early-stopping-patience", "1", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    losses = [r["val_loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "validation"]
    stopped = summary["stopped_early_at_round"]
    assert stopped == summary["rounds"] == len(losses) < 6 * 2, "one validation per averaging, and it stopped early"
    assert losses[-1] >= min(losses[:-1]), "the last validation was no better than the best before it"
    assert f"early stopping ended the run at averaging {stopped}" in result.output


@pytest.mark.timeout(180)
def test_resume_ends_where_an_uninterrupted_run_ends(mnist_dir: Path, tmp_path: Path) -> None:
    """Two epochs straight, against one epoch (checkpointed) then `--resume --epochs 2`; the
    learning rate steps down after each epoch, and the checkpoint carries its schedule."""
    common = [
        "--workers", "2", "--averaging-frequency", "2", "--data-dir", str(mnist_dir), "--deterministic",
        "--train-samples", "1024", "--test-samples", "200", "--checkpoint-every", "1", "--lr-schedule", "step",
    ]  # fmt: skip
    straight = invoke(*common, "--epochs", "2", "--out", str(tmp_path / "straight"))
    assert straight.exit_code == 0, straight.output
    first = invoke(*common, "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert first.exit_code == 0, first.output
    resumed = invoke(*common, "--epochs", "2", "--resume", str(tmp_path / "ckpt"), "--out", str(tmp_path / "resumed"))
    assert resumed.exit_code == 0, resumed.output
    assert "epoch 0:" not in resumed.output and "epoch 1: mean training loss" in resumed.output
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    # Samples per second count this session's samples, not the checkpoint's.
    assert (summary["samples"], summary["session_samples"]) == (2048, 1024)
    assert summary["wall_samples_per_second"] == pytest.approx(1024 / summary["wall_seconds"])
    assert summary["final_lr"] == pytest.approx(0.04 * 0.7**2)
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
        [pw_fit(), "--training-mode", "shared-gradients", "--averaging-frequency", "1", "--data-dir", str(mnist_dir),
         "--train-samples", "512", "--test-samples", "200", "--out", str(out)],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "test accuracy" in proc.stdout and "samples/s" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    # 4 batches, 2 workers in lockstep: 2 steps, a score after each.
    assert (summary["training_mode"], summary["rounds"], summary["iterations"], summary["samples"]) == ("shared-gradients", 2, 4, 512)
    assert len([r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "score"]) == 2


@pytest.mark.timeout(120)
def test_ctrl_c_says_where_the_checkpoint_is_and_the_command_that_resumes(mnist_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C once the first checkpoint is written: the round finishes and is saved, and instead of
    click's "Aborted!" pw-fit names the checkpoint and prints this command with --resume."""
    ckpt = tmp_path / "ckpt"
    args = [
        "--lr", "0.01", "--data-dir", str(mnist_dir), "--train-samples", "30000", "--test-samples", "200",
        "--out", str(tmp_path / "out"), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
    ]  # fmt: skip
    proc = subprocess.Popen([pw_fit(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    try:
        deadline = time.monotonic() + 90
        while not (ckpt / checkpoint.FILENAME).is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Aborted!" not in stderr and "Traceback" not in stderr
    hint = stderr[stderr.index("Interrupted: ") :].splitlines()
    at = checkpoint.checkpoint_counters(ckpt)
    assert at["rounds"] >= 1 and at["epoch"] == 0
    assert hint[0] == f"Interrupted: the checkpoint in {ckpt} holds epoch 0, {at['position']} batches in ({at['rounds']} averagings). Carry on with:"
    assert shlex.split(hint[1]) == ["pw-fit", *args, "--resume", str(ckpt)]


def test_ctrl_c_before_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path: Path) -> None:
    ctx = cli.main.make_context("pw-fit", ["--checkpoint-dir", str(tmp_path)])
    assert cli._resume_hint(ctx, tmp_path).startswith(f"Interrupted before the first checkpoint was saved in {tmp_path}: nothing to resume")


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
    # averaging sends parameters and momentum: twice the gradients' volume, the momentum in one
    # more collective a round (it lands at the next step).
    sg, k1, k2 = (by_run[run][-1] for run in runs)
    assert abs(float(sg["test_accuracy"]) - float(k1["test_accuracy"])) <= 0.01
    assert int(sg["rounds"]) == int(k1["rounds"]) == 4 and int(k2["rounds"]) == 2
    assert int(k1["collectives"]) == int(sg["collectives"]) + int(k1["rounds"])
    assert float(k1["bytes_per_worker"]) == pytest.approx(2 * float(sg["bytes_per_worker"]), rel=1e-3)
    assert float(k2["bytes_per_worker"]) < float(k1["bytes_per_worker"])
    # worker 0's share of time in exchanges, as its scores say: none before training
    assert all(math.isnan(float(r["exchange_share"])) for r in rows[::3]) and all(0 < float(r["exchange_share"]) < 1 for r in rows if int(r["samples"]))

    table = (tmp_path / "compare.md").read_text()
    assert "| run | final test accuracy |" in table and "samples to 30%" in table and "MB sent per worker" in table
    assert all(f"| {run} |" in table for run in runs)
    assert table in result.output
    png = (tmp_path / "compare.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000


@pytest.mark.timeout(120)
def test_outer_optimizer_warmup_and_bfloat16_payload_train(mnist_dir: Path, tmp_path: Path) -> None:
    """1,024 images, 2 workers: 2 shared-gradient steps (4 batches), then rounds of k=2 with an
    outer Nesterov SGD, sent in bfloat16; the options land in summary.json."""
    out = tmp_path / "run"
    result = invoke(
        "--averaging-frequency", "2", "--deterministic", "--data-dir", str(mnist_dir), "--train-samples", "1024",
        "--test-samples", "300", "--out", str(out), "--outer-lr", "0.9", "--outer-momentum", "0.5",
        "--warmup-sync-steps", "2", "--payload-dtype", "bfloat16",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert {k: summary["options"][k] for k in ("outer_lr", "outer_momentum", "warmup_sync_steps", "payload_dtype")} == {
        "outer_lr": 0.9, "outer_momentum": 0.5, "warmup_sync_steps": 2, "payload_dtype": "bfloat16",
    }  # fmt: skip
    assert (summary["samples"], summary["iterations"]) == (1024, 8)
    assert summary["test_accuracy"] > 0.5 and math.isfinite(summary["final_epoch_loss"])


@pytest.mark.filterwarnings("ignore:4 processes")
@pytest.mark.timeout(120)
def test_stages_train_lenet_as_pipelines_to_the_unsplit_workers_scores(mnist_dir: Path, tmp_path: Path) -> None:
    """pw-fit --stages 2 (issue 24): 2 workers x 2 stages of LeNet, 4 microbatches, deterministic,
    end with the test accuracy and loss of 2 unsplit workers."""
    common = ["--deterministic", "--data-dir", str(mnist_dir), "--train-samples", "1024", "--test-samples", "300"]
    summaries = []
    for name, extra in (("unsplit", []), ("stages", ["--stages", "2", "--microbatches", "4"])):
        result = invoke(*common, "--out", str(tmp_path / name), *extra)
        assert result.exit_code == 0, result.output
        summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    unsplit, stages = summaries
    assert (stages["options"]["pipeline"]["stages"], stages["options"]["pipeline"]["microbatches"], stages["samples"]) == (2, 4, 1024)
    assert stages["test_accuracy"] == pytest.approx(unsplit["test_accuracy"], abs=1e-4) and stages["test_accuracy"] > 0.5
    assert stages["test_loss"] == pytest.approx(unsplit["test_loss"], abs=1e-4)


@pytest.mark.timeout(120)
def test_short_compare_run_with_an_outer_optimizer_and_bfloat16(mnist_dir: Path, tmp_path: Path) -> None:
    """k=2 plain and with the outer optimizer, 1,024 images in one fit(): two rounds, the first in
    float32, the second's bfloat16 casts all-gathered. The outer step sends nothing more."""
    result = invoke(
        "compare", "--frequencies", "2", "--no-shared-gradients", "--evals", "1", "--data-dir", str(mnist_dir),
        "--train-samples", "1024", "--test-samples", "300", "--outer-lr", "1", "--outer-momentum", "0.5",
        "--payload-dtype", "bfloat16", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    with (tmp_path / "compare.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["samples"] == "1024"]
    assert [(r["run"], r["outer"], r["rounds"]) for r in rows] == [("averaging k=2", "False", "2"), ("outer k=2", "True", "2")]
    assert rows[0]["bytes_per_worker"] == rows[1]["bytes_per_worker"] and rows[0]["collectives"] == rows[1]["collectives"]
    float32 = estimated_communication(RunOptions.of(averaging_frequency=2)).bytes_per_worker(2, 1)
    assert float(rows[0]["bytes_per_worker"]) == pytest.approx(float32 * 0.75, rel=1e-3)  # a round in full, a round in half
    assert rows[1]["test_accuracy"] != rows[0]["test_accuracy"]
    table = (tmp_path / "compare.md").read_text()
    assert "| outer k=2 |" in table and "outer SGD lr 1 Nesterov momentum 0.5" in table and "sent in bfloat16" in table


def spawned_workers(pid: int) -> tuple[list[int], list[int]]:
    """The pids of the processes a pw-fit process started (children of its forkserver): the
    workers, which hold sockets (the store, gloo), and the standby for replacements, which has
    joined nothing yet. (Not by pid order: pids wrap around on a busy machine.)"""

    def children(parent: int) -> list[int]:
        return [int(c) for c in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]

    servers = [c for c in children(pid) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    ours = [c for server in servers for c in children(server)]

    def sockets(child: int) -> int:
        return sum(1 for fd in Path(f"/proc/{child}/fd").iterdir() if os.readlink(fd).startswith("socket:"))

    return [c for c in ours if sockets(c)], [c for c in ours if not sockets(c)]


@pytest.mark.timeout(150)
def test_max_replacements_survives_a_killed_worker_and_reports_it(mnist_dir: Path, tmp_path: Path) -> None:
    """SIGKILL a worker once the first score is written: the run finishes, the bar's line and the
    summary say a worker was replaced, and metrics.jsonl has its record."""
    out = tmp_path / "out"
    args = [
        "--data-dir", str(mnist_dir), "--train-samples", "6000", "--test-samples", "200", "--batch-size", "64",
        "--max-replacements", "1", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen([pw_fit(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ((out / "metrics.jsonl").is_file() and '"score"' in (out / "metrics.jsonl").read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        workers, standby = spawned_workers(proc.pid)
        assert len(workers) == 2 and len(standby) == 1
        os.kill(workers[1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    replaced_line = next(line for line in stdout.splitlines() if "replaced, round" in line)  # the bar writes it
    assert "killed by SIGKILL" in replaced_line and "1 failed workers replaced" in stdout
    records = read_jsonl(out / "metrics.jsonl")
    replaced = [r for r in records if r["kind"] == "replacement"]
    assert len(replaced) == 1 and "SIGKILL" in replaced[0]["reason"] and replaced[0]["lost_round"] >= 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replacements"] == 1 and summary["samples"] == 6000
