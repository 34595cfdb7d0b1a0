"""One training run on MNIST: the plain function behind `pw-fit`, usable from Python.

    summary = train_mnist(RunOptions(workers=2, epochs=1, data_dir=Path("../shared/data/mnist")))

It builds the model from a seed, configures a `ParallelWrapper` from the options (which mirror
the builder's), fits one epoch at a time (the workers live across `fit()` calls) and evaluates the
averaged model on the test set after each epoch. With `out`, it writes `metrics.jsonl` (one record
per averaged score and per epoch), `summary.json` and the trained model's `model.pt`.

Defaults follow DL4J's multi-GPU MNIST example: LeNet, batch 128, prefetch 24, 2 workers,
averaging every 3 iterations, Nesterov momentum, seed 123.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
from .listeners import JsonlWriter, ProgressBar, Score
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

    def __post_init__(self) -> None:
        if not isinstance(self.mode, TrainingMode):
            raise ValueError(f"mode must be one of {[m.value for m in TrainingMode]}, got {self.mode!r}")
        check_int("epochs", self.epochs)
        check_int("batch_size", self.batch_size)
        check_int("checkpoint_every", self.checkpoint_every)
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

    test_accuracy: float
    test_loss: float
    samples_per_second: float  # training samples / seconds inside fit() (worker start-up included)
    wall_seconds: float  # the whole run: data loading, training, evaluation
    train_seconds: float
    epochs: int
    workers: int
    averaging_frequency: int
    mode: str
    samples: int  # training samples seen, all workers together
    iterations: int  # batches trained, all workers together
    rounds: int  # averagings (shared-gradients: optimizer steps)
    final_score: float  # mean training loss of the last epoch
    epoch_accuracies: list[float] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return (
            f"test accuracy {self.test_accuracy:.4f}, {self.samples_per_second:.0f} samples/s, "
            f"wall time {self.wall_seconds:.1f} s"
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
    """The test split in large batches, unshuffled: evaluation only."""
    return test.batches(batch_size)


# -- metrics.jsonl ---------------------------------------------------------------------------------


class MetricsLog:
    """`metrics.jsonl`: a "score" record per averaged score and an "epoch" record per epoch,
    every record with step, iteration, samples, epoch, score and seconds since the run started;
    epoch records add test_accuracy and test_loss. A listener for the scores; the epoch records
    are written after evaluation, by `epoch()`."""

    def __init__(self, path: Path, start: float) -> None:
        self.path, self._start = path, start
        # Opened at the first record: a run that fails before training leaves no empty file.
        self._writer: JsonlWriter | None = None

    def _write(self, kind: str, record: dict[str, Any]) -> None:
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")  # this run's record, not appended to an older run's
            self._writer = JsonlWriter(self.path)
        self._writer.write(kind, record)

    def on_score(self, score: Score) -> None:
        self._write("score", self._record(score.round, score.iteration, score.samples, score.epoch, score.score))

    def epoch(self, wrapper: ParallelWrapper, epoch: int, score: float, evaluation: dict[str, float]) -> None:
        record = self._record(wrapper.rounds, wrapper.iterations, wrapper.samples, epoch, score)
        self._write("epoch", {**record, "test_accuracy": evaluation["accuracy"], "test_loss": evaluation["loss"]})

    def _record(self, step: int, iteration: int, samples: int, epoch: int, score: float) -> dict[str, Any]:
        seconds = time.perf_counter() - self._start
        return {"step": step, "iteration": iteration, "samples": samples, "epoch": epoch, "score": score, "seconds": seconds}

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


# -- the run ---------------------------------------------------------------------------------------


def train_mnist(options: RunOptions, *, progress: bool = True, echo: Callable[[str], None] = print) -> Summary:
    """Train `options.model` on MNIST with a ParallelWrapper and evaluate it after every epoch.

    `progress` shows a bar with the averaged score and a line per epoch (through `echo`).
    """
    start = time.perf_counter()
    model = initial_model(options)
    metrics = MetricsLog(options.out / "metrics.jsonl", start) if options.out is not None else None
    train, test = load_splits(options)
    batches_per_epoch = math.ceil(len(train) / options.batch_size)
    listeners: list[Any] = [ProgressBar(batches_per_epoch)] if progress else []
    if metrics is not None:
        listeners.append(metrics)
    wrapper = builder(model, options, listeners).build()
    test_data = eval_batches(test)
    accuracies: list[float] = []
    train_seconds = 0.0
    final_score = math.nan
    evaluation: dict[str, float] = {}
    # Resuming: finish the checkpoint's epoch first (fit counts `epochs` from the run's start).
    first = checkpoint.peek(options.resume)["epoch"] if options.resume is not None else 0
    if first >= options.epochs:
        raise ValueError(f"the checkpoint in {options.resume} has trained {first} epochs already: pass --epochs > {first}")
    try:
        with wrapper:
            for epoch in range(first, options.epochs):
                fit_start = time.perf_counter()
                batches = epoch_batches(train, options, epoch)
                if epoch == first and options.resume is not None:
                    history = wrapper.fit(batches, epochs=epoch + 1, resume=options.resume)
                else:
                    history = wrapper.fit(batches, epochs=1)
                train_seconds += time.perf_counter() - fit_start
                final_score = history.final_score
                evaluation = wrapper.evaluate(test_data)
                accuracies.append(evaluation["accuracy"])
                if metrics is not None:
                    metrics.epoch(wrapper, epoch, final_score, evaluation)
                if progress:
                    echo(f"epoch {epoch}: test accuracy {evaluation['accuracy']:.4f}, test loss {evaluation['loss']:.4f}")
    finally:
        if metrics is not None:
            metrics.close()
    summary = Summary(
        test_accuracy=evaluation["accuracy"],
        test_loss=evaluation["loss"],
        samples_per_second=wrapper.samples / train_seconds,
        wall_seconds=time.perf_counter() - start,
        train_seconds=train_seconds,
        epochs=options.epochs,
        workers=options.workers,
        averaging_frequency=options.averaging_frequency,
        mode=options.mode.value,
        samples=wrapper.samples,
        iterations=wrapper.iterations,
        rounds=wrapper.rounds,
        final_score=final_score,
        epoch_accuracies=accuracies,
        options=options_json(options),
    )
    if options.out is not None:
        (options.out / "summary.json").write_text(json.dumps(summary.to_json(), indent=2) + "\n")
        torch.save(model.state_dict(), options.out / "model.pt")
    return summary


__all__ = [
    "DEVICES",
    "OPTIMIZERS",
    "MetricsLog",
    "RunOptions",
    "Summary",
    "builder",
    "epoch_batches",
    "eval_batches",
    "initial_model",
    "load_splits",
    "train_mnist",
]
