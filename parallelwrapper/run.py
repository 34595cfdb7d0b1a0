"""One training run on MNIST: the plain function behind `pw-fit`, usable from Python.

    summary = train_mnist(RunOptions(workers=2, epochs=1, data_dir=Path("../shared/data/mnist")))

It builds the model from a seed, configures a `ParallelWrapper` from the options (which mirror
the builder's) and fits all epochs in one `fit()`, each epoch's batches shuffled by seed + epoch.
The workers score the averaged model on the test set at each epoch's end (and every `val_every`
averagings, for early stopping), as the builder's validation. With `out`, it writes
`metrics.jsonl` (one record per averaged score, validation and epoch), `summary.json` and the
trained model's `model.pt`.

Defaults follow DL4J's multi-GPU MNIST example: LeNet, batch 128, prefetch 24, 2 workers,
averaging every 3 iterations, Nesterov momentum, seed 123.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import checkpoint
from .config import PRECISIONS, TrainingMode, check_int
from .env import gpu_count, gpu_devices
from .data.mnist import MnistSplit, load_mnist
from .listeners import EarlyStopping, EpochEnd, JsonlWriter, ProgressBar, Score, Validation
from .models import MODEL_NAMES, build_model
from .wrapper import Builder, ParallelWrapper

Batch = tuple[torch.Tensor, torch.Tensor]  # images (B, 1, 28, 28) float32, labels (B,) int64


@dataclass(frozen=True)
class OptimizerChoice:
    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    default_lr: float

    def make(self, params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
        factory: Callable[..., torch.optim.Optimizer] = self.cls
        return factory(params, lr=lr, **self.kwargs)


# DL4J's example uses Updater.NESTEROVS (momentum 0.9): "nesterov" is the default.
OPTIMIZERS: dict[str, OptimizerChoice] = {
    "nesterov": OptimizerChoice(torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, 0.04),
    "sgd": OptimizerChoice(torch.optim.SGD, {}, 0.1),
    "adam": OptimizerChoice(torch.optim.Adam, {}, 1e-3),
    "adamw": OptimizerChoice(torch.optim.AdamW, {}, 1e-3),
}
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class RunOptions:
    """Everything a run needs, validated on construction. The first six mirror the builder's
    options, which the builder validates again when the wrapper is built."""

    workers: int = 2
    prefetch_buffer: int = 24
    averaging_frequency: int = 3
    report_score_after_averaging: bool = True
    average_updaters: bool = True
    mode: TrainingMode = TrainingMode.AVERAGING
    epochs: int = 1
    batch_size: int = 128  # per worker step
    lr: float | None = None  # None: the optimizer's default in OPTIMIZERS
    optimizer: str = "nesterov"
    model: str = "lenet"
    device: str = "auto"  # auto: a GPU per worker when there are enough, else the CPU
    seed: int = 123  # model init, shuffling and the workers' RNGs
    data_dir: Path | None = None  # None: the loader's cache dir (downloads what is missing)
    download: bool = True
    out: Path | None = None
    train_samples: int | None = None  # the first N training images only: for smoke tests
    test_samples: int | None = None  # the first N test images only: for smoke tests
    overlap_averaging: bool = False  # averaging during the next round's steps (Builder.overlap_averaging)
    deterministic: bool = False  # batch i to worker i mod N (reproducible, see Builder.deterministic)
    checkpoint_dir: Path | None = None  # save here every `checkpoint_every` rounds and each epoch
    checkpoint_every: int = 50
    resume: Path | None = None  # a checkpoint directory to continue from (and to keep saving to)
    precision: str = "32"  # or "bf16-mixed" (Builder.precision)
    clip_grad_norm: float | None = None  # Builder.gradient_clipping(max_norm)
    val_every: int = 0  # validate on the test set every N averagings too (0: at epoch ends only)
    early_stopping_patience: int | None = None  # stop after this many validations without a better val_loss

    def __post_init__(self) -> None:
        if not isinstance(self.mode, TrainingMode):
            raise ValueError(f"mode must be one of {[m.value for m in TrainingMode]}, got {self.mode!r}")
        check_int("epochs", self.epochs)
        check_int("batch_size", self.batch_size)
        check_int("checkpoint_every", self.checkpoint_every)
        check_int("val_every", self.val_every, 0)
        if self.early_stopping_patience is not None:
            check_int("early_stopping_patience", self.early_stopping_patience)
            if self.val_every == 0:
                raise ValueError(
                    "early stopping watches the validation loss, which only periodic validations give it: "
                    "add --val-every N (val_every=N) to --early-stopping-patience"
                )
        for name in ("train_samples", "test_samples"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.model not in MODEL_NAMES:
            raise ValueError(f"model must be one of {list(MODEL_NAMES)}, got {self.model!r}")
        if self.clip_grad_norm is not None and not (self.clip_grad_norm > 0 and math.isfinite(self.clip_grad_norm)):
            raise ValueError(f"clip_grad_norm must be a positive number, got {self.clip_grad_norm!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and gpu_count() == 0:
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device here; use device 'cpu' or 'auto'")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else OPTIMIZERS[self.optimizer].default_lr

    def worker_devices(self) -> tuple[str, ...] | None:
        """One device per worker, or None to let the config choose (auto)."""
        if self.device == "cpu":
            return ("cpu",) * self.workers
        if self.device == "cuda":
            return gpu_devices(self.workers, gpu_count())
        return None


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
    averaging_frequency: int
    mode: str
    samples: int  # training samples seen, all workers together, since the run began (a resumed run's too)
    session_samples: int  # of which this session trained
    iterations: int  # batches trained, all workers together
    rounds: int  # averagings (shared-gradients: optimizer steps)
    final_epoch_loss: float | None  # mean training loss over the last whole epoch
    last_round_score: float | None  # the last averaging's score: its round's mean loss
    stopped_early_at_round: int | None = None  # where early stopping ended the run
    epoch_accuracies: list[float] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        train = f"{self.train_samples_per_second:,.0f}" if self.train_samples_per_second is not None else "n/a"
        stopped = f"early stopping ended the run at averaging {self.stopped_early_at_round}\n" if self.stopped_early_at_round else ""
        return (
            f"{stopped}test accuracy {self.test_accuracy:.4f}, test loss {self.test_loss:.4f}\n"
            f"{train} samples/s while training (start-up and validation excluded), "
            f"{self.wall_samples_per_second:,.0f} samples/s over the wall time of {self.wall_seconds:.1f} s (all included)"
        )


def options_json(options: RunOptions) -> dict[str, Any]:
    """The options as JSON-ready data (enum by value, paths as strings, the lr resolved)."""
    out = dataclasses.asdict(options)
    out["mode"] = options.mode.value
    out["lr"] = options.learning_rate
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


# -- the pieces, shared with compare.py and the examples -------------------------------------------


def load_splits(options: RunOptions) -> tuple[MnistSplit, MnistSplit]:
    """The train and test splits, cut to `train_samples` / `test_samples` when set.
    Raises `MnistError` (whose message names --data-dir) when files are missing or bad."""
    train = load_mnist(options.data_dir, "train", download=options.download)
    test = load_mnist(options.data_dir, "test", download=options.download)
    return _head(train, options.train_samples), _head(test, options.test_samples)


def _head(split: MnistSplit, n: int | None) -> MnistSplit:
    return split if n is None or n >= len(split) else MnistSplit(split.images[:n], split.labels[:n])


def initial_model(options: RunOptions) -> torch.nn.Module:
    """The model, initialised from the seed: the same weights on every call."""
    torch.manual_seed(options.seed)
    return build_model(options.model)


def builder(model: torch.nn.Module, options: RunOptions, listeners: Sequence[Any] = ()) -> Builder:
    """A builder configured from the options."""
    choice = OPTIMIZERS[options.optimizer]
    b = (
        ParallelWrapper.builder(model)
        .workers(options.workers)
        .prefetch_buffer(options.prefetch_buffer)
        .averaging_frequency(options.averaging_frequency)
        .report_score_after_averaging(options.report_score_after_averaging)
        .average_updaters(options.average_updaters)
        .training_mode(options.mode)
        .optimizer(choice.cls, lr=options.learning_rate, **choice.kwargs)
        .overlap_averaging(options.overlap_averaging)
        .deterministic(options.deterministic)
        .seed(options.seed)
        .precision(options.precision)
        .listeners(*listeners)
    )
    if options.clip_grad_norm is not None:
        b = b.gradient_clipping(options.clip_grad_norm)
    checkpoints = options.checkpoint_dir or options.resume
    if checkpoints is not None:
        b = b.checkpoint(checkpoints, every=options.checkpoint_every)
    devices = options.worker_devices()
    return b.devices(devices) if devices is not None else b


def epoch_batches(train: MnistSplit, options: RunOptions, epoch: int) -> list[Batch]:
    """The training batches of one epoch, shuffled by seed + epoch: the same order in every run."""
    return train.batches(options.batch_size, shuffle=True, seed=options.seed + epoch)


def eval_batches(test: MnistSplit, batch_size: int = 1000) -> list[Batch]:
    """The test split in large batches, unshuffled, each its own tensors: as validation data they
    are pickled to every worker, and a view of the whole split would carry all of it each time."""
    return [(x.clone(), y.clone()) for x, y in test.batches(batch_size)]


# -- what a run reports -----------------------------------------------------------------------------


class RunLog:
    """A listener that keeps a run's record: a line per epoch through `echo` (its mean training
    loss and the epoch-end validation's test metrics), `metrics.jsonl` when given a path, and the
    training clock.

    `metrics.jsonl` has a "score" record per averaged score (the round's mean loss), a "validation"
    record per validation (val_loss, val_accuracy) and an "epoch" record per epoch (epoch_loss,
    test_loss, test_accuracy), each with step, iteration, samples, epoch and seconds since `start`.

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

    def _tick(self, seconds: float, samples: int) -> None:
        if self._last is not None and samples > self._last[1]:
            self.train_seconds += seconds - self._last[0]
            self.train_samples += samples - self._last[1]
        self._last = (seconds, samples)

    def _write(self, kind: str, at: Score | Validation | EpochEnd, **fields: float) -> None:
        if self.path is None:
            return
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")  # this run's records, not appended to an older run's
            self._writer = JsonlWriter(self.path)
        step = at.round if not isinstance(at, EpochEnd) else self._step
        record = {"step": step, "iteration": at.iteration, "samples": at.samples, "epoch": at.epoch}
        self._writer.write(kind, {**record, **fields, "seconds": time.perf_counter() - self._start})

    def on_score(self, score: Score) -> None:
        self._tick(score.seconds, score.samples)
        self._step = score.round
        self._write("score", score, score=score.score)

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

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


# -- the run ---------------------------------------------------------------------------------------

# pw-fit validates at every epoch's end: that is its test accuracy per epoch. Without --val-every,
# at epoch ends only: no run has this many averagings.
_EPOCH_ENDS_ONLY = sys.maxsize


def train_mnist(options: RunOptions, *, progress: bool = True, echo: Callable[[str], None] = print) -> Summary:
    """Train `options.model` on MNIST with a ParallelWrapper, validating on the test set at each
    epoch's end (and every `val_every` averagings).

    `progress` shows where the workers run, a bar with the averaged score and a line per epoch
    (through `echo`).
    """
    start = time.perf_counter()
    model = initial_model(options)
    train, test = load_splits(options)
    # Resuming: fit() counts `epochs` from the run's start and goes on from the checkpoint's place.
    restored = checkpoint.peek(options.resume) if options.resume is not None else {"epoch": 0, "samples": 0}
    if restored["epoch"] >= options.epochs:
        raise ValueError(
            f"the checkpoint in {options.resume} has trained {restored['epoch']} epochs already: pass --epochs > {restored['epoch']}"
        )
    log = RunLog(start, echo if progress else None, options.out / "metrics.jsonl" if options.out is not None else None)
    listeners: list[Any] = [ProgressBar(math.ceil(len(train) / options.batch_size))] if progress else []
    stopper = EarlyStopping("val_loss", options.early_stopping_patience) if options.early_stopping_patience else None
    listeners += [log] if stopper is None else [log, stopper]
    wrapper = builder(model, options, listeners).validation(eval_batches(test), every=options.val_every or _EPOCH_ENDS_ONLY).build()
    if progress:
        echo(f"{options.model} on {len(train):,} MNIST training images: {wrapper.placement}")
    epochs = iter(range(restored["epoch"], options.epochs))
    try:
        with wrapper:  # fit() asks for each epoch's batches in turn
            history = wrapper.fit(lambda: epoch_batches(train, options, next(epochs)), epochs=options.epochs, resume=options.resume)
    finally:
        log.close()
    final = history.validations[-1].metrics  # the trained model's: at the last epoch's end, or where it stopped
    wall = time.perf_counter() - start
    session_samples = wrapper.samples - restored["samples"]
    summary = Summary(
        test_accuracy=final["val_accuracy"],
        test_loss=final["val_loss"],
        train_samples_per_second=log.train_samples / log.train_seconds if log.train_seconds > 0 else None,
        wall_samples_per_second=session_samples / wall,
        train_seconds=log.train_seconds,
        wall_seconds=wall,
        epochs=options.epochs,
        workers=options.workers,
        averaging_frequency=options.averaging_frequency,
        mode=options.mode.value,
        samples=wrapper.samples,
        session_samples=session_samples,
        iterations=wrapper.iterations,
        rounds=wrapper.rounds,
        final_epoch_loss=history.epochs[-1].score if history.epochs else None,
        last_round_score=history.scores[-1].score if history.scores else None,
        stopped_early_at_round=stopper.stopped_round if stopper is not None else None,
        epoch_accuracies=log.epoch_accuracies,
        options=options_json(options),
    )
    if options.out is not None:
        (options.out / "summary.json").write_text(json.dumps(summary.to_json(), indent=2) + "\n")
        torch.save(model.state_dict(), options.out / "model.pt")
    return summary


__all__ = [
    "DEVICES",
    "OPTIMIZERS",
    "RunLog",
    "RunOptions",
    "Summary",
    "builder",
    "epoch_batches",
    "eval_batches",
    "initial_model",
    "load_splits",
    "train_mnist",
]
