"""pw-fit's options, validated, and what they make: MNIST batches, the seeded model and the configured builder.

Shared by `run.py` (one run) and `compare.py`.

The library's options travel as the library's own `Config`, which checks each value and refuses
what does not go together (config.CONFLICTS) with its own message; `RunOptions` holds the rest,
what belongs to pw-fit: the data, the recipe the builder's job is made from, and the outputs.
Defaults follow DL4J's multi-GPU MNIST example: LeNet, batch 128, prefetch 24, 2 workers,
averaging every 3 iterations, Nesterov momentum, seed 123.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parallelwrapper import OPTIONS, Builder, Config

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
LR_SCHEDULES: tuple[str, ...] = ("none", "step", "cosine", "onecycle")
# pw-fit's own defaults of the library's options: DL4J's example averages every 3 iterations with
# seed 123, and pw-fit validates on the test set at each epoch's end (None: no periodic validation).
FIT_CONFIG = Config(averaging_frequency=3, seed=123, validation_every=None)


@dataclass(frozen=True)
class Data:
    """Where the MNIST files are and how many of them a run uses."""

    data_dir: Path | None = None  # None: the loader's cache dir (downloads what is missing)
    download: bool = True
    train_samples: int | None = None  # the first N training images only: for smoke tests
    test_samples: int | None = None  # the first N test images only: for smoke tests

    def __post_init__(self) -> None:
        for name in ("train_samples", "test_samples"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))


@dataclass(frozen=True)
class RunOptions:
    """Everything a run needs, validated on construction: the library's options (`config`, which
    validates itself) and pw-fit's own. `RunOptions.of(...)` takes both by name."""

    config: Config = FIT_CONFIG
    epochs: int = 1
    batch_size: int = 128  # per worker step
    lr: float | None = None  # None: the optimizer's default in OPTIMIZERS
    optimizer: str = "nesterov"
    model: str = "lenet"
    device: str = "auto"  # auto: the GPUs when there are any (shared when outnumbered), else the CPU
    data: Data = field(default_factory=Data)
    out: Path | None = None
    tensorboard: Path | None = None  # None: no TensorBoard scalars; a directory: TensorBoardLogger writes there
    resume: Path | None = None  # a checkpoint directory to continue from (and to keep saving to)
    lr_schedule: str = "none"  # or step, cosine, onecycle (see with_lr_schedule)
    outer_lr: float | None = None  # an outer SGD with Nesterov momentum after each averaging (None: none)
    outer_momentum: float = 0.0  # its momentum (Builder.outer_optimizer)
    early_stopping_patience: int | None = None  # stop after this many validations without a better val_loss

    @classmethod
    def of(cls, **values: Any) -> RunOptions:
        """RunOptions from flat names, as pw-fit's flags give them: the library's options (by their
        declared names, parallelwrapper.OPTIONS; an enum's by its value) over pw-fit's defaults
        (FIT_CONFIG), the data's, and the run's own. A ValueError says what the library refuses."""
        library = {k: values.pop(k) for k in list(values) if k in OPTIONS}
        for name, value in library.items():
            default = OPTIONS[name].default
            if isinstance(default, enum.Enum) and not isinstance(value, enum.Enum):
                library[name] = type(default)(value)
        data = {k: values.pop(k) for k in list(values) if k in Data.__dataclass_fields__}
        return cls(dataclasses.replace(FIT_CONFIG, **library), data=Data(**data), **values)

    def __post_init__(self) -> None:
        check_int("epochs", self.epochs)
        check_int("batch_size", self.batch_size)
        if self.early_stopping_patience is not None:
            check_int("early_stopping_patience", self.early_stopping_patience)
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
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and torch.cuda.device_count() == 0:
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device here; use device 'cpu' or 'auto'")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else OPTIMIZERS[self.optimizer].default_lr

    @property
    def averaging_frequency(self) -> int | str:
        """k, or "auto" where the autopilot chooses it."""
        return "auto" if self.config.autopilot is not None else self.config.averaging_frequency

    def worker_devices(self) -> tuple[str, ...] | None:
        """One device per worker, or None to let the config choose (auto)."""
        if self.device == "cpu":
            return ("cpu",) * self.config.workers
        if self.device == "cuda":
            gpus = torch.cuda.device_count()  # shared round-robin when the workers outnumber them
            return tuple(f"cuda:{i % gpus}" for i in range(self.config.workers))
        return None


def check_int(name: str, value: object, minimum: int = 1, hint: str = "") -> None:
    """A ValueError naming the option unless `value` is an int (not a bool) >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}" + (f"; {hint}" if hint else ""))


def options_json(options: RunOptions) -> dict[str, Any]:
    """The options as JSON-ready data, flat: the library's (enums by value), the data's and the
    run's own (paths as strings, the lr resolved)."""
    library = {k: v.value if isinstance(v, enum.Enum) else v for k, v in dataclasses.asdict(options.config).items()}
    own = {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name not in ("config", "data")}
    out = {**library, "averaging_frequency": options.averaging_frequency, **dataclasses.asdict(options.data), **own, "lr": options.learning_rate}
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


# -- what the options make ------------------------------------------------------------------------


def load_splits(options: RunOptions) -> tuple[MnistSplit, MnistSplit]:
    """The train and test splits, cut to `train_samples` / `test_samples` when set.
    Raises `MnistError` (whose message names --data-dir) when files are missing or bad."""
    data = options.data
    train = load_mnist(data.data_dir, "train", download=data.download)
    test = load_mnist(data.data_dir, "test", download=data.download)
    return _head(train, data.train_samples), _head(test, data.test_samples)


def _head(split: MnistSplit, n: int | None) -> MnistSplit:
    return split if n is None or n >= len(split) else MnistSplit(split.images[:n], split.labels[:n])


def initial_model(options: RunOptions) -> torch.nn.Module:
    """The model, initialised from the seed: the same weights on every call."""
    torch.manual_seed(options.config.seed)
    return build_model(options.model)


def builder(model: torch.nn.Module, options: RunOptions, listeners: Sequence[Any] = ()) -> Builder:
    """A builder started from the options' config (the options other than the library's defaults
    count as set, so that the autopilot keeps them), with the optimizer, the outer optimizer, the
    devices and the listeners; a resumed run keeps saving checkpoints where it resumed from."""
    choice = OPTIMIZERS[options.optimizer]
    config = options.config
    if options.resume is not None and config.checkpoint_dir is None:
        config = dataclasses.replace(config, checkpoint_dir=str(options.resume))
    b = Builder(model, config).optimizer(choice.cls, lr=options.learning_rate, **choice.kwargs).listeners(*listeners)
    if options.outer_lr is not None:
        # Nesterov only where there is momentum: torch's SGD refuses it without.
        nesterov = options.outer_momentum > 0
        b = b.outer_optimizer(torch.optim.SGD, lr=options.outer_lr, momentum=options.outer_momentum, nesterov=nesterov, foreach=True)
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
    return train.batches(options.batch_size, shuffle=True, seed=options.config.seed + epoch)


def eval_batches(test: MnistSplit, batch_size: int = 1000) -> list[Batch]:
    """The test split in large batches, unshuffled, each its own tensors: as validation data they
    are pickled to every worker, and a view of the whole split would carry all of it each time."""
    return [(x.clone(), y.clone()) for x, y in test.batches(batch_size)]


__all__ = [
    "DEVICES",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "Batch",
    "Data",
    "FIT_CONFIG",
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
