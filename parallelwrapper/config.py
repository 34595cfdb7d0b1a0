"""Configuration of a ParallelWrapper: a frozen dataclass, validated on construction.

Config is data. Runtime objects (the model, the optimizer class, the loss function, listeners)
are handed to the builder (wrapper.Builder) and travel beside the config in a `Job`, never inside
it, so a config can be printed, compared and stored in a checkpoint. What the config means on this
machine (devices, backend, threads) is env.resolve's to say. Imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class TrainingMode(enum.Enum):
    """How the workers stay in step.

    AVERAGING: each worker trains on its own for `averaging_frequency` iterations, then
    parameters, buffers and (optionally) optimizer state are averaged (local SGD).
    SHARED_GRADIENTS: gradients are averaged every iteration (synchronous data parallelism).
    """

    AVERAGING = "averaging"
    SHARED_GRADIENTS = "shared-gradients"


class NanPolicy(enum.Enum):
    """What a worker does when its loss is NaN or infinite."""

    RAISE = "raise"  # fail fit(), naming the worker and the step
    SKIP = "skip"  # drop this worker's contribution from the round; it receives the average


BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Config:
    """Every option of a ParallelWrapper, with its default. Validated on construction."""

    workers: int = 2
    prefetch_buffer: int = 24
    averaging_frequency: int = 1
    report_score_after_averaging: bool = True
    average_updaters: bool = True
    overlap_averaging: bool = False  # average in the background during the next round's steps
    training_mode: TrainingMode = TrainingMode.AVERAGING
    deterministic: bool = False
    seed: int = 0
    devices: tuple[str, ...] | None = None  # None: a GPU per worker when there are GPUs, else the CPU (env.resolve)
    backend: str = "auto"  # auto: NCCL when every worker has a GPU of its own, else gloo (env.resolve)
    stall_timeout_s: float = 300.0  # a worker without progress this long fails fit(), named
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50  # rounds; a checkpoint is also saved at every epoch's end
    nan_policy: NanPolicy = NanPolicy.RAISE
    threads_per_worker: int | None = None  # None: the machine's cores shared out among workers

    def __post_init__(self) -> None:
        check_int("workers", self.workers, 1, "ParallelWrapper.builder(model).workers(2)")
        check_int("prefetch_buffer", self.prefetch_buffer, 1, "a few batches per worker, e.g. .prefetch_buffer(24)")
        check_int("averaging_frequency", self.averaging_frequency, 1, "1 averages after every iteration, e.g. .averaging_frequency(3)")
        if not isinstance(self.training_mode, TrainingMode):
            raise ValueError(
                f"training_mode must be a TrainingMode, got {self.training_mode!r}; "
                f"use one of {[m.name for m in TrainingMode]}, e.g. .training_mode(TrainingMode.AVERAGING)"
            )
        if self.overlap_averaging and self.training_mode is TrainingMode.SHARED_GRADIENTS:
            raise ValueError(
                "overlap_averaging applies to TrainingMode.AVERAGING only: with SHARED_GRADIENTS every step "
                "needs the averaged gradients before it can be taken; drop .overlap_averaging(True)"
            )
        if not isinstance(self.nan_policy, NanPolicy):
            raise ValueError(f"nan_policy must be one of {[p.value for p in NanPolicy]}, got {self.nan_policy!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0 seconds, got {self.stall_timeout_s}")
        check_int("checkpoint_every", self.checkpoint_every, 1, "the rounds between checkpoints, e.g. .checkpoint(dir, every=50)")
        if self.threads_per_worker is not None:
            check_int("threads_per_worker", self.threads_per_worker, 1, "or leave it unset to share the cores out")
        for d in self.devices or ():  # how many there must be is env.resolve's to check
            try:
                torch.device(d)
            except RuntimeError as e:
                raise ValueError(f"devices: {d!r} is not a torch device ({e})") from None


def check_int(name: str, value: object, minimum: int = 1, hint: str = "") -> None:
    """A ValueError naming the option unless `value` is an int (not a bool) >= `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}" + (f"; {hint}" if hint else ""))


LossFn = Callable[[torch.Tensor, Any], torch.Tensor]
TrainingStep = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class Job:
    """What a worker needs besides the config: the objects it rebuilds in its own process."""

    model: torch.nn.Module
    optimizer_cls: type[torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    loss_fn: LossFn | None
    training_step: TrainingStep | None

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return self.optimizer_cls(model.parameters(), **self.optimizer_kwargs)


def describe_config(config: Config) -> dict[str, Any]:
    """The config as JSON-ready data (enums by value), for checkpoints, summaries and people."""
    out = dataclasses.asdict(config)
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in out.items()}


__all__ = ["Config", "Job", "NanPolicy", "TrainingMode", "check_int", "describe_config"]
