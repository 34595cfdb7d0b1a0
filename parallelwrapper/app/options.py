"""pw-fit's options, validated, and what they make: MNIST batches, the seeded model and the configured builder.

Shared by `run.py` (one run) and `compare.py`.

Defaults follow DL4J's multi-GPU MNIST example: LeNet, batch 128, prefetch 24, 2 workers,
averaging every 3 iterations, Nesterov momentum, seed 123.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallelwrapper import Builder, ParallelWrapper, TrainingMode, check_option

from .mnist import MnistSplit, load_mnist
from .models import MODEL_NAMES, build_model

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
# The builder's options a run sets as they are, under their own names (parallelwrapper.OPTIONS).
_MIRRORED = (
    "workers", "prefetch_buffer", "report_score_after_averaging", "average_updaters", "average_updaters_every", "training_mode",
    "seed", "overlap_averaging", "deterministic", "checkpoint_every", "precision", "gradient_clipping", "warmup_sync_steps",
    "payload_dtype", "fragments", "accumulate",
)  # fmt: skip
LR_SCHEDULES: tuple[str, ...] = ("none", "step", "cosine", "onecycle")


@dataclass(frozen=True)
class RunOptions:
    """Everything a run needs, validated on construction. The first six mirror the builder's
    options, which the builder validates again when the wrapper is built."""

    workers: int = 2
    prefetch_buffer: int = 24
    averaging_frequency: int | str = 3  # or "auto": the autopilot chooses (Builder.averaging_frequency("auto"))
    report_score_after_averaging: bool = True
    average_updaters: bool = True
    average_updaters_every: int = 1  # with average_updaters: the optimizer state travels every m-th round (Builder.average_updaters(every=m))
    training_mode: TrainingMode = TrainingMode.AVERAGING
    epochs: int = 1
    batch_size: int = 128  # per worker step
    lr: float | None = None  # None: the optimizer's default in OPTIMIZERS
    optimizer: str = "nesterov"
    model: str = "lenet"
    device: str = "auto"  # auto: the GPUs when there are any (shared when outnumbered), else the CPU
    seed: int = 123  # model init, shuffling and the workers' RNGs
    data_dir: Path | None = None  # None: the loader's cache dir (downloads what is missing)
    download: bool = True
    out: Path | None = None
    tensorboard: Path | None = None  # None: no TensorBoard scalars; a directory: TensorBoardLogger writes there
    train_samples: int | None = None  # the first N training images only: for smoke tests
    test_samples: int | None = None  # the first N test images only: for smoke tests
    overlap_averaging: bool = False  # averaging during the next round's steps (Builder.overlap_averaging)
    deterministic: bool = False  # batch i to worker i mod N (reproducible, see Builder.deterministic)
    checkpoint_dir: Path | None = None  # save here every `checkpoint_every` rounds and each epoch
    checkpoint_every: int = 50
    resume: Path | None = None  # a checkpoint directory to continue from (and to keep saving to)
    precision: str = "32"  # or "bf16-mixed" (Builder.precision)
    gradient_clipping: float | None = None  # Builder.gradient_clipping(max_norm)
    accumulate: int = 1  # each batch a step of N micro-batches (Builder.accumulate)
    validation_every: int = 0  # validate on the test set every N averagings too (0: at epoch ends only)
    early_stopping_patience: int | None = None  # stop after this many validations without a better val_loss
    lr_schedule: str = "none"  # or step, cosine, onecycle (see with_lr_schedule)
    outer_lr: float | None = None  # an outer SGD with Nesterov momentum after each averaging (None: none)
    outer_momentum: float = 0.0  # its momentum (Builder.outer_optimizer)
    warmup_sync_steps: int = 0  # shared gradients for the first N steps, then averaging (Builder.warmup_sync_steps)
    payload_dtype: str = "float32"  # or bfloat16, float16, int8, int4, sparse: what an averaging sends (Builder.payload_dtype)
    fragments: int = 1  # with overlap_averaging: the state averaged in n fragments through the round (Builder.fragments)
    max_replacements: int = 0  # replace a failed worker up to N times (Builder.on_worker_failure("replace", max_replacements=N)); 0: a failure ends the run
    gradient_threshold: float | None = None  # shared gradients threshold-encoded, τ starting here (Builder.gradient_encoding); None: dense
    stages: int = 1  # each worker a pipeline of this many stage processes (Builder.pipeline); 1: none
    microbatches: int = 1  # with stages > 1: each batch cut into this many for the pipeline's schedule
    pipeline_schedule: str = "1f1b"  # with stages > 1: the pipeline's schedule (Builder.pipeline(schedule=...))

    def __post_init__(self) -> None:
        for name in _MIRRORED:  # as the builder will check them, but before the data loads
            check_option(name, getattr(self, name))
        if self.averaging_frequency != "auto":
            check_option("averaging_frequency", self.averaging_frequency)
        check_int("epochs", self.epochs)
        check_int("batch_size", self.batch_size)
        check_int("validation_every", self.validation_every, 0)
        check_int("max_replacements", self.max_replacements, 0)
        check_int("stages", self.stages)
        check_int("microbatches", self.microbatches)
        if self.microbatches > 1 and self.stages == 1:
            raise ValueError(f"microbatches {self.microbatches} cut a pipeline's batches, which --stages N (stages=N) of 2 or more makes: add it")
        if self.pipeline_schedule != "1f1b" and self.stages == 1:
            raise ValueError(f"pipeline_schedule {self.pipeline_schedule!r} runs a pipeline, which --stages N (stages=N) of 2 or more makes: add it")
        if self.early_stopping_patience is not None:
            check_int("early_stopping_patience", self.early_stopping_patience)
            if self.validation_every == 0:
                raise ValueError(
                    "early stopping watches the validation loss, which only periodic validations give it: "
                    "add --validation-every N (validation_every=N) to --early-stopping-patience"
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
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {list(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.outer_lr is not None and not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            raise ValueError(f"outer_lr must be a positive number, e.g. 1.0; got {self.outer_lr!r}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), e.g. 0.5; got {self.outer_momentum!r}")
        if self.outer_momentum and self.outer_lr is None:
            raise ValueError(f"outer_momentum {self.outer_momentum:g} is the outer optimizer's, which --outer-lr LR (outer_lr) turns on: add it")
        if self.gradient_threshold is not None and not (self.gradient_threshold > 0 and math.isfinite(self.gradient_threshold)):
            raise ValueError(f"gradient_threshold must be a positive number, e.g. 1e-3; got {self.gradient_threshold!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and torch.cuda.device_count() == 0:
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device here; use device 'cpu' or 'auto'")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else OPTIMIZERS[self.optimizer].default_lr

    def worker_devices(self) -> tuple[str, ...] | None:
        """One device per worker, or None to let the config choose (auto)."""
        if self.device == "cpu":
            return ("cpu",) * self.workers
        if self.device == "cuda":
            gpus = torch.cuda.device_count()  # shared round-robin when the workers outnumber them
            return tuple(f"cuda:{i % gpus}" for i in range(self.workers))
        return None


def check_int(name: str, value: object, minimum: int = 1, hint: str = "") -> None:
    """A ValueError naming the option unless `value` is an int (not a bool) >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}" + (f"; {hint}" if hint else ""))


def options_json(options: RunOptions) -> dict[str, Any]:
    """The options as JSON-ready data (enum by value, paths as strings, the lr resolved)."""
    out = dataclasses.asdict(options)
    out["training_mode"] = options.training_mode.value
    out["lr"] = options.learning_rate
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}



# -- what the options make ------------------------------------------------------------------------


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
        .training_mode(options.training_mode)
        .optimizer(choice.cls, lr=options.learning_rate, **choice.kwargs)
        .deterministic(options.deterministic)
        .seed(options.seed)
        .precision(options.precision)
        .warmup_sync_steps(options.warmup_sync_steps)
        .fragments(options.fragments)
        .accumulate(options.accumulate)
        .listeners(*listeners)
    )
    # With "auto" the autopilot chooses the payload, the optimizer state's period and overlap,
    # unless they are other than their defaults (a builder's option set is kept).
    auto = options.averaging_frequency == "auto"
    if not auto or options.overlap_averaging:
        b = b.overlap_averaging(options.overlap_averaging)
    if not auto or options.payload_dtype != "float32":
        b = b.payload_dtype(options.payload_dtype)
    if not auto or (options.average_updaters, options.average_updaters_every) != (True, 1):
        b = b.average_updaters(options.average_updaters, every=options.average_updaters_every)
    if options.outer_lr is not None:
        # Nesterov only where there is momentum: torch's SGD refuses it without.
        nesterov = options.outer_momentum > 0
        b = b.outer_optimizer(torch.optim.SGD, lr=options.outer_lr, momentum=options.outer_momentum, nesterov=nesterov, foreach=True)
    if options.gradient_clipping is not None:
        b = b.gradient_clipping(options.gradient_clipping)
    if options.max_replacements:
        b = b.on_worker_failure("replace", max_replacements=options.max_replacements)
    if options.gradient_threshold is not None:
        b = b.gradient_encoding(options.gradient_threshold)
    if options.stages > 1:
        b = b.pipeline(stages=options.stages, microbatches=options.microbatches, schedule=options.pipeline_schedule)
    checkpoints = options.checkpoint_dir or options.resume
    if checkpoints is not None:
        b = b.checkpoint(checkpoints, every=options.checkpoint_every)
    devices = options.worker_devices()
    return b.devices(devices) if devices is not None else b


def with_lr_schedule(b: Builder, options: RunOptions, batches_per_epoch: int) -> Builder:
    """The builder with `options.lr_schedule`: "step" multiplies the learning rate by 0.7 after
    each epoch; "cosine" anneals it to 0 and "onecycle" warms it up to `lr` and down again, both
    over the run's synchronous-equivalent steps, ceil(batches / workers) an epoch (under
    torchrun, its ranks), the counter the workers step schedules by."""
    steps = options.epochs * b.steps_per_epoch(batches_per_epoch)
    schedulers = torch.optim.lr_scheduler
    if options.lr_schedule == "step":
        return b.lr_scheduler(schedulers.StepLR, step_size=1, gamma=0.7)
    if options.lr_schedule == "cosine":
        return b.lr_scheduler(schedulers.CosineAnnealingLR, interval="step", T_max=steps)
    if options.lr_schedule == "onecycle":
        # Momentum cycles with the rate, where the optimizer has any (plain SGD has none).
        momentum = options.optimizer != "sgd"
        return b.lr_scheduler(schedulers.OneCycleLR, interval="step", max_lr=options.learning_rate, total_steps=steps, cycle_momentum=momentum)
    return b


def epoch_batches(train: MnistSplit, options: RunOptions, epoch: int) -> list[Batch]:
    """The training batches of one epoch, shuffled by seed + epoch: the same order in every run."""
    return train.batches(options.batch_size, shuffle=True, seed=options.seed + epoch)


def eval_batches(test: MnistSplit, batch_size: int = 1000) -> list[Batch]:
    """The test split in large batches, unshuffled, each its own tensors: as validation data they
    are pickled to every worker, and a view of the whole split would carry all of it each time."""
    return [(x.clone(), y.clone()) for x, y in test.batches(batch_size)]


__all__ = [
    "DEVICES",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "Batch",
    "OptimizerChoice",
    "RunOptions",
    "builder",
    "epoch_batches",
    "eval_batches",
    "initial_model",
    "load_splits",
    "options_json",
    "with_lr_schedule",
]
