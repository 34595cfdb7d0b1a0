"""One training run on MNIST: the plain function behind `pw-fit`, usable from Python.

    summary = train_mnist(RunOptions(workers=2, epochs=1, data_dir=Path("../shared/data/mnist")))

It builds the model from a seed, configures a `ParallelWrapper` from the options (the library's
travel as its own `Config`) and fits all epochs in one `fit()`, each epoch's batches shuffled by seed + epoch.
The workers score the averaged model on the test set at each epoch's end (and every `validation_every`
averagings, for early stopping), as the builder's validation. With `out`, it writes
`metrics.jsonl` (one record per averaged score, validation and epoch), `summary.json` and the
trained model's `model.pt`.

The options, and the data, model and builder they make, are `options.py`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parallelwrapper import EarlyStopping, EpochEnd, JsonlWriter, ProgressBar, Score, TensorBoardLogger, Validation, WorkerError, autopilot_changes, checkpoint_counters, exchange_share

from .options import RunOptions, builder, epoch_batches, eval_batches, initial_model, load_splits, options_json, with_lr_schedule


@dataclass(frozen=True)
class Summary:
    """The outcome of a run; `summary.json` is `to_json()`."""

    test_accuracy: float  # the trained model on the test set (its last validation)
    test_loss: float
    train_samples_per_second: float | None  # samples / train_seconds (None: no two reports apart)
    wall_samples_per_second: float  # this session's samples / wall_seconds
    train_seconds: float  # between reports across which samples were trained: no start-up, no validation
    wall_seconds: float  # the whole run: data loading, worker start-up, training, validation
    epochs: int
    workers: int
    averaging_frequency: int | str  # or "auto"
    training_mode: str
    samples: int  # training samples seen, all workers together, since the run began (a resumed run's too)
    session_samples: int  # of which this session trained
    iterations: int  # batches trained, all workers together
    rounds: int  # averagings (shared-gradients: optimizer steps)
    final_epoch_loss: float | None  # mean training loss over the last whole epoch
    last_round_score: float | None  # the last averaging's score: its round's mean loss
    final_lr: float  # the learning rate at the end (it moves with --lr-schedule)
    stopped_early_at_round: int | None = None  # where early stopping ended the run
    replacements: int = 0  # workers replaced after a failure (--max-replacements)
    encoded_bytes_per_worker: float | None = None  # --gradient-threshold: the bytes each worker sent, on average, as the scores say
    final_threshold: float | None = None  # --gradient-threshold: τ at the end
    exchange_share: float | None = None  # of rank 0's time in the scores' rounds, the share in exchanges (Score.exchange_s)
    epoch_accuracies: list[float] = field(default_factory=list)
    autopilot_changes: list[dict[str, Any]] = field(default_factory=list)  # --averaging-frequency auto: each change of k, payload or period, and why
    options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        train = f"{self.train_samples_per_second:,.0f}" if self.train_samples_per_second is not None else "n/a"
        stopped = f"early stopping ended the run at averaging {self.stopped_early_at_round}\n" if self.stopped_early_at_round else ""
        replaced = f"{self.replacements} failed workers replaced (see metrics.jsonl's replacement records)\n" if self.replacements else ""
        encoded = (
            f"encoded shared gradients: {self.encoded_bytes_per_worker / 1e6:,.2f} MB sent per worker, τ now {self.final_threshold:.3g}\n"
            if self.encoded_bytes_per_worker is not None and self.final_threshold is not None else ""
        )  # fmt: skip
        exchange = f"{self.exchange_share:.1%} of worker 0's training time went to exchanges, waiting for the others included\n" if self.exchange_share is not None else ""
        return (
            f"{stopped}{replaced}{encoded}{exchange}test accuracy {self.test_accuracy:.4f}, test loss {self.test_loss:.4f}\n"
            f"{train} samples/s while training (start-up and validation excluded), "
            f"{self.wall_samples_per_second:,.0f} samples/s over the wall time of {self.wall_seconds:.1f} s (all included)"
        )


# -- what a run reports -----------------------------------------------------------------------------


class RunLog:
    """A listener that keeps a run's record: a line per epoch through `echo` (its mean training
    loss and the epoch-end validation's test metrics), `metrics.jsonl` when given a path, and the
    training clock.

    `metrics.jsonl` has a "score" record per averaged score (the round's mean loss, worker 0's
    training_s and exchange_s since the last, the k, payload and updaters_every it ran with,
    step_s and link_s per step and exchange, and the autopilot's `why` after a change; encoded:
    τ, density, bytes_sent), a "validation"
    record per validation (val_loss, val_accuracy) and an "epoch" record per epoch (epoch_loss,
    test_loss, test_accuracy), each with step, iteration, samples, epoch and seconds since `start`;
    with --max-replacements, a "replacement" record (rank, lost_round, reason) per replaced worker.

    The clock counts the time between two reports across which samples were trained: not the
    start-up before the first report, nor the time a validation takes."""

    def __init__(self, start: float, echo: Callable[[str], None] | None = None, path: Path | None = None) -> None:
        self._start, self._echo, self.path = start, echo, path
        self._writer: JsonlWriter | None = None  # opened at the first record: a failed start leaves no file
        self._validation: dict[str, float] = {}
        self._step = 0  # averagings so far, as the last score or validation said
        self._last: tuple[float, int] | None = None
        self.train_seconds, self.train_samples = 0.0, 0
        self.epoch_accuracies: list[float] = []
        self.replacements = 0

    def _tick(self, seconds: float, samples: int) -> None:
        if self._last is not None and samples > self._last[1]:
            self.train_seconds += seconds - self._last[0]
            self.train_samples += samples - self._last[1]
        self._last = (seconds, samples)

    def _write(self, kind: str, at: Score | Validation | EpochEnd | None, **fields: Any) -> None:
        if self.path is None:
            return
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")  # this run's records, not appended to an older run's
            self._writer = JsonlWriter(self.path)
        record = {}
        if at is not None:
            step = at.round if not isinstance(at, EpochEnd) else self._step
            record = {"step": step, "iteration": at.iteration, "samples": at.samples, "epoch": at.epoch}
        self._writer.write(kind, {**record, **fields, "seconds": time.perf_counter() - self._start})

    def on_score(self, score: Score) -> None:
        self._tick(score.seconds, score.samples)
        self._step = score.round
        encoding = {} if score.encoding is None else {"threshold": score.encoding.threshold, "density": score.encoding.density, "bytes_sent": score.encoding.bytes_sent}
        ran = {"k": score.k, "payload": score.payload, "updaters_every": score.updaters_every, "step_s": score.step_s, "link_s": score.link_s}
        self._write("score", score, score=score.score, training_s=score.training_s, exchange_s=score.exchange_s, **ran, **encoding, **({"why": score.why} if score.why else {}))

    def on_validation(self, validation: Validation) -> None:
        self._tick(validation.seconds, validation.samples)
        self._validation, self._step = validation.metrics, validation.round
        self._write("validation", validation, **validation.metrics)

    def on_epoch_end(self, epoch: EpochEnd) -> None:
        self._tick(epoch.seconds, epoch.samples)
        test = {"test_loss": self._validation["val_loss"], "test_accuracy": self._validation["val_accuracy"]}
        self.epoch_accuracies.append(test["test_accuracy"])
        self._write("epoch", epoch, epoch_loss=epoch.score, **test)
        if self._echo is not None:
            self._echo(
                f"epoch {epoch.epoch}: mean training loss {epoch.score:.4f}, "
                f"test accuracy {test['test_accuracy']:.4f}, test loss {test['test_loss']:.4f}"
            )

    def on_worker_replaced(self, rank: int, reason: WorkerError, lost_round: int) -> None:
        self.replacements += 1
        self._write("replacement", None, rank=rank, lost_round=lost_round, reason=reason.summary)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


# -- the run ---------------------------------------------------------------------------------------

def train_mnist(options: RunOptions, *, progress: bool = True, echo: Callable[[str], None] = print) -> Summary:
    """Train `options.model` on MNIST with a ParallelWrapper, validating on the test set at each
    epoch's end (and every `validation_every` averagings).

    `progress` shows where the workers run, a bar with the averaged score and a line per epoch
    (through `echo`).
    """
    start = time.perf_counter()
    model = initial_model(options)
    train, test = load_splits(options)
    # Resuming: fit() counts `epochs` from the run's start and goes on from the checkpoint's place.
    restored = checkpoint_counters(options.resume) if options.resume is not None else {"epoch": 0, "samples": 0}
    if restored["epoch"] >= options.epochs:
        raise ValueError(
            f"the checkpoint in {options.resume} has trained {restored['epoch']} epochs already: pass --epochs > {restored['epoch']}"
        )
    log = RunLog(start, echo if progress else None, options.out / "metrics.jsonl" if options.out is not None else None)
    batches_per_epoch = math.ceil(len(train) / options.batch_size)
    listeners: list[Any] = [ProgressBar(batches_per_epoch)] if progress else []
    stopper = EarlyStopping("val_loss", options.early_stopping_patience) if options.early_stopping_patience else None
    listeners += [log] if stopper is None else [log, stopper]
    board = TensorBoardLogger(options.tensorboard) if options.tensorboard is not None else None
    listeners += [board] if board is not None else []
    # pw-fit validates at every epoch's end (its test accuracy per epoch), and every validation_every averagings.
    b = builder(model, options, listeners).validation(eval_batches(test), every=options.config.validation_every)
    wrapper = with_lr_schedule(b, options, batches_per_epoch).build()
    if progress:
        echo(f"{options.model} on {len(train):,} MNIST training images: {wrapper.placement}")
    epochs = iter(range(restored["epoch"], options.epochs))
    try:
        with wrapper:  # fit() asks for each epoch's batches in turn
            history = wrapper.fit(lambda: epoch_batches(train, options, next(epochs)), epochs=options.epochs, resume=options.resume)
    finally:
        log.close()
        if board is not None:
            board.close()
    final = history.validations[-1].metrics  # the trained model's: at the last epoch's end, or where it stopped
    wall = time.perf_counter() - start
    session_samples = wrapper.samples - restored["samples"]
    encodings = [s.encoding for s in history.scores if s.encoding is not None]
    share = exchange_share(history.scores)
    summary = Summary(
        test_accuracy=final["val_accuracy"],
        test_loss=final["val_loss"],
        train_samples_per_second=log.train_samples / log.train_seconds if log.train_seconds > 0 else None,
        wall_samples_per_second=session_samples / wall,
        train_seconds=log.train_seconds,
        wall_seconds=wall,
        epochs=options.epochs,
        workers=options.config.workers,
        averaging_frequency=options.averaging_frequency,
        training_mode=options.config.training_mode.value,
        samples=wrapper.samples,
        session_samples=session_samples,
        iterations=wrapper.iterations,
        rounds=wrapper.rounds,
        final_epoch_loss=history.epochs[-1].score if history.epochs else None,
        last_round_score=history.scores[-1].score if history.scores else None,
        final_lr=wrapper.optimizer.param_groups[0]["lr"],
        stopped_early_at_round=stopper.stopped_round if stopper is not None else None,
        replacements=log.replacements,
        encoded_bytes_per_worker=sum(e.bytes_sent for e in encodings) if encodings else None,
        final_threshold=encodings[-1].threshold if encodings else None,
        exchange_share=share if math.isfinite(share) else None,
        epoch_accuracies=log.epoch_accuracies,
        autopilot_changes=autopilot_changes(history.scores),
        options=options_json(options),
    )
    if options.out is not None:
        (options.out / "summary.json").write_text(json.dumps(summary.to_json(), indent=2) + "\n")
        torch.save(model.state_dict(), options.out / "model.pt")
    return summary


__all__ = ["RunLog", "Summary", "train_mnist"]
