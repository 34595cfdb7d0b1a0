"""Configuration of a ParallelWrapper: a frozen, validated dataclass and the fluent builder.

Config is data. Runtime objects (the model, the optimizer class, the loss function, listeners)
are handed to the `Builder` and travel beside the config, never inside it, so a config can be
printed, compared and stored in a checkpoint.
"""

from __future__ import annotations

import enum
import io
import os
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .wrapper import ParallelWrapper


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
    devices: tuple[str, ...] | None = None  # None: one GPU per worker when there are enough, else CPU
    backend: str = "auto"  # auto: NCCL when every worker has its own GPU, else gloo
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
        if self.devices is not None:
            if len(self.devices) != self.workers:
                raise ValueError(
                    f"devices names {len(self.devices)} devices for {self.workers} workers; "
                    f"give one device per worker, e.g. .devices({['cpu'] * self.workers})"
                )
            for d in self.devices:
                try:
                    torch.device(d)
                except RuntimeError as e:
                    raise ValueError(f"devices: {d!r} is not a torch device ({e})") from None
        for device in self.resolved_devices():
            dev = torch.device(device)
            if dev.type == "cuda":
                count = torch.cuda.device_count()
                if (dev.index or 0) >= count:
                    raise ValueError(f"devices: {device} does not exist, this machine has {count} CUDA devices")
        if self.resolved_backend() == "nccl":
            cuda = [torch.device(d) for d in self.resolved_devices()]
            gpus = torch.cuda.device_count()
            if any(d.type != "cuda" for d in cuda) or len({d.index for d in cuda}) < self.workers:
                raise ValueError(
                    f"backend 'nccl' needs one CUDA device per worker: {self.workers} workers, "
                    f"devices {list(self.resolved_devices())}, {gpus} GPUs here. "
                    f"Use .workers({max(gpus, 1)}) or .backend('gloo')"
                )

    def resolved_devices(self) -> tuple[str, ...]:
        """One device per worker: the explicit list, else cuda:i when there are GPUs, else cpu."""
        if self.devices is not None:
            return self.devices
        gpus = torch.cuda.device_count()
        if gpus == 0:
            return ("cpu",) * self.workers
        return tuple(f"cuda:{i % gpus}" for i in range(self.workers))

    def resolved_backend(self) -> str:
        """NCCL when every worker has a GPU of its own, gloo otherwise."""
        if self.backend != "auto":
            return self.backend
        devices = [torch.device(d) for d in self.resolved_devices()]
        own_gpu = all(d.type == "cuda" for d in devices) and len({d.index for d in devices}) == len(devices)
        return "nccl" if own_gpu else "gloo"

    def shares_gpus(self) -> bool:
        """True when workers outnumber the GPUs they run on (gloo then, and a warning)."""
        devices = [torch.device(d) for d in self.resolved_devices()]
        cuda = [d for d in devices if d.type == "cuda"]
        return bool(cuda) and len({d.index for d in cuda}) < len(cuda)


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


class Builder:
    """Fluent configuration of a ParallelWrapper, after DL4J's `ParallelWrapper.Builder`.

    Every setter returns the builder; `build()` validates everything and raises `ValueError`
    naming the option and the fix.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"ParallelWrapper.builder() takes a torch.nn.Module, got {type(model).__name__}")
        self._model = model
        self._options: dict[str, Any] = {}
        self._optimizer_cls: type[torch.optim.Optimizer] = torch.optim.SGD
        self._optimizer_kwargs: dict[str, Any] = {"lr": 0.01}
        self._loss_fn: LossFn | None = torch.nn.functional.cross_entropy
        self._training_step: TrainingStep | None = None
        self._listeners: list[Any] = []

    def optimizer(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> Builder:
        """Any `torch.optim` optimizer class and its keyword arguments. Default: SGD, lr=0.01."""
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(
                f"optimizer takes an optimizer class and its kwargs, e.g. .optimizer(torch.optim.SGD, lr=0.01); "
                f"got {optimizer_cls!r}"
            )
        self._optimizer_cls, self._optimizer_kwargs = optimizer_cls, dict(kwargs)
        return self

    def loss_fn(self, fn: LossFn) -> Builder:
        """`fn(model(inputs), targets) -> scalar loss` for `(inputs, targets)` batches. Default: cross_entropy."""
        self._loss_fn, self._training_step = fn, None
        return self

    def training_step(self, fn: TrainingStep) -> Builder:
        """`fn(model, batch) -> scalar loss`, for batches that are not `(inputs, targets)`."""
        self._training_step, self._loss_fn = fn, None
        return self

    def listeners(self, *listeners: Any) -> Builder:
        """Objects with any of `on_fit_start`, `on_score`, `on_epoch_end`, `on_fit_end`, or plain
        callables, which receive each averaged `Score`. They run in the main process."""
        self._listeners.extend(listeners)
        return self

    def workers(self, n: int) -> Builder:
        """Number of workers, one process and device each. Default: 2. One worker on the CPU is
        the caller's own process: nothing is spawned, and batches are not copied."""
        return self._set("workers", n)

    def prefetch_buffer(self, n: int) -> Builder:
        """Batches read ahead into the spawned workers' shared queue. Default: 24."""
        return self._set("prefetch_buffer", n)

    def averaging_frequency(self, k: int) -> Builder:
        """Local iterations per worker between two averagings. Default: 1."""
        return self._set("averaging_frequency", k)

    def report_score_after_averaging(self, flag: bool) -> Builder:
        """Report the averaged score after every averaging (True) or once per epoch. Default: True."""
        return self._set("report_score_after_averaging", bool(flag))

    def average_updaters(self, flag: bool) -> Builder:
        """Average optimizer state (momentum, Adam moments, step) with the parameters. Default: True."""
        return self._set("average_updaters", bool(flag))

    def overlap_averaging(self, flag: bool = True) -> Builder:
        """Run each averaging in the background while the workers take the next round's steps,
        then add each worker's steps since to the average: no worker waits for a slower one or
        for the network, and the model a worker trains on is one round behind the average.
        Replicas are equal again at every epoch's end, checkpoint and stop. Default: False."""
        return self._set("overlap_averaging", bool(flag))

    def training_mode(self, mode: TrainingMode | str) -> Builder:
        """TrainingMode.AVERAGING (default) or TrainingMode.SHARED_GRADIENTS."""
        return self._set("training_mode", _enum(TrainingMode, mode, "training_mode"))

    def deterministic(self, flag: bool = True) -> Builder:
        """Deal batch i to worker i mod N instead of first-come, so two runs give the same model.
        Default: False."""
        return self._set("deterministic", bool(flag))

    def seed(self, n: int) -> Builder:
        """Seed of worker i's RNGs is `n + i`. Default: 0."""
        return self._set("seed", n)

    def devices(self, devices: Sequence[str | torch.device]) -> Builder:
        """One device per worker, e.g. ["cuda:0", "cuda:1"]. Default: a GPU each if there are
        enough, else the CPU."""
        if isinstance(devices, (str, torch.device)):
            raise ValueError(f"devices takes one device per worker, e.g. .devices(['cpu', 'cpu']); got {devices!r}")
        return self._set("devices", tuple(str(d) for d in devices))

    def backend(self, name: str) -> Builder:
        """"auto" (default), "gloo" or "nccl"."""
        return self._set("backend", name)

    def stall_timeout(self, seconds: float) -> Builder:
        """How long a spawned worker may go without progress (a batch, a step, an averaging) before fit()
        fails naming it and where it was. Default: 300 s."""
        return self._set("stall_timeout_s", float(seconds))

    def checkpoint(self, directory: str | os.PathLike[str], every: int = 50) -> Builder:
        """Save a checkpoint to `directory` every `every` rounds, at each epoch's end, and on
        Ctrl-C. Resume with `fit(..., resume=directory)`. Default: no checkpoints."""
        self._set("checkpoint_every", every)
        return self._set("checkpoint_dir", os.fspath(directory))

    def nan_policy(self, policy: NanPolicy | str) -> Builder:
        """NanPolicy.RAISE (default) fails fit(); NanPolicy.SKIP drops that worker from the round."""
        return self._set("nan_policy", _enum(NanPolicy, policy, "nan_policy"))

    def threads_per_worker(self, n: int) -> Builder:
        """torch threads in each worker. Default: the machine's cores divided among the workers."""
        return self._set("threads_per_worker", n)

    def _set(self, name: str, value: Any) -> Builder:
        self._options[name] = value
        return self

    def build(self) -> ParallelWrapper:
        from .launch import in_torchrun
        from .wrapper import ParallelWrapper

        config = Config(**self._options)
        job = Job(self._model, self._optimizer_cls, self._optimizer_kwargs, self._loss_fn, self._training_step)
        try:
            job.make_optimizer(self._model)
        except Exception as e:  # noqa: BLE001 - any failure here is a bad optimizer argument
            raise ValueError(f"optimizer: {self._optimizer_cls.__name__}(**{self._optimizer_kwargs}) failed: {e}") from e
        for i, listener in enumerate(self._listeners):
            if not callable(listener) and not any(hasattr(listener, m) for m in LISTENER_METHODS):
                raise ValueError(f"listeners[{i}] ({listener!r}) is neither callable nor has any of {LISTENER_METHODS}")
        if not in_torchrun():
            _check_sendable(job)
        return ParallelWrapper(config, job, list(self._listeners))


LISTENER_METHODS = ("on_fit_start", "on_score", "on_epoch_end", "on_fit_end")


def _enum(cls: type[enum.Enum], value: Any, name: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        choices = [m.value for m in cls]
        raise ValueError(f"{name} must be one of {choices} or a {cls.__name__}, got {value!r}") from None


class _NullWriter(io.RawIOBase):
    """Counts nothing, keeps nothing: pickling into it checks picklability without a copy."""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return len(b)


def _check_sendable(job: Job) -> None:
    """Workers are spawned processes: everything they rebuild must pickle."""
    parts: Iterable[tuple[str, object]] = [
        ("model", job.model),
        ("optimizer", (job.optimizer_cls, job.optimizer_kwargs)),
        ("loss_fn", job.loss_fn),
        ("training_step", job.training_step),
    ]
    for name, obj in parts:
        try:
            pickle.Pickler(_NullWriter(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as e:  # noqa: BLE001 - pickle raises many types
            raise ValueError(
                f"{name} cannot be sent to a spawned worker process ({type(e).__name__}: {e}). "
                f"Define functions and classes at module level (not lambdas or local functions), "
                f"and guard the script's entry point with `if __name__ == '__main__':`"
            ) from e


__all__ = ["Builder", "Config", "Job", "NanPolicy", "TrainingMode"]
