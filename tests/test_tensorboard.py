"""`pw-fit --tensorboard DIR` writes what the run reports as TensorBoard scalars, and they read
back (tensorboard's EventAccumulator) equal to the run's own metrics.jsonl. One worker trains in
this process (no spawn): 512 real MNIST images, 2 epochs, a learning-rate schedule that moves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from parallelwrapper import TensorBoardLogger, WorkerError
from parallelwrapper.app import cli


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.timeout(60)
def test_pw_fit_tensorboard_scalars_read_back(mnist_dir: Path, tmp_path: Path) -> None:
    out, board = tmp_path / "out", tmp_path / "tb"
    result = CliRunner().invoke(cli.main, [
        "--workers", "1", "--epochs", "2", "--averaging-frequency", "2", "--data-dir", str(mnist_dir),
        "--train-samples", "512", "--test-samples", "256", "--validation-every", "1", "--lr-schedule", "onecycle",
        "--out", str(out), "--tensorboard", str(board),
    ], prog_name="pw-fit")  # fmt: skip
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kinds = {kind: [r for r in records if r["kind"] == kind] for kind in ("score", "validation", "epoch")}
    got = scalars(board)

    # 4 batches an epoch, k = 2: a score and a validation every 2 iterations, along one axis over both epochs
    assert [s for s, _ in got["train/round_loss"]] == [r["iteration"] for r in kinds["score"]] == [2, 4, 6, 8]
    assert [v for _, v in got["train/round_loss"]] == pytest.approx([r["score"] for r in kinds["score"]], rel=1e-6)
    for name in ("val_loss", "val_accuracy"):
        assert got[f"validation/{name}"] == [(r["iteration"], pytest.approx(r[name], rel=1e-6)) for r in kinds["validation"]]
    assert got["epoch/loss"] == [(r["iteration"], pytest.approx(r["epoch_loss"], rel=1e-6)) for r in kinds["epoch"]]
    assert [s for s, _ in got["epoch/seconds"]] == [4, 8]
    assert [v for _, v in got["train/skipped_workers"]] == [0, 0, 0, 0]
    # onecycle over the run's 8 steps, up to --lr (0.04) and down: each round's last step's rate
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.04, momentum=0.9, nesterov=True)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.04, total_steps=8)
    rates = []
    for _ in range(8):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert got["train/lr"] == [(step, pytest.approx(rates[step - 1], rel=1e-6)) for step in (2, 4, 6, 8)]


@pytest.mark.fast
def test_a_replacement_is_two_scalars_at_the_last_step(tmp_path: Path) -> None:
    board = TensorBoardLogger(tmp_path)
    board.on_worker_replaced(1, WorkerError(1, "killed by SIGKILL"), lost_round=3)
    board.on_worker_replaced(0, WorkerError(0, "killed by SIGKILL"), lost_round=5)
    board.close()
    got = scalars(tmp_path)
    assert got["faults/replacements"] == [(0, 1.0), (0, 2.0)]
    assert got["faults/replaced_rank"] == [(0, 1.0), (0, 0.0)]
