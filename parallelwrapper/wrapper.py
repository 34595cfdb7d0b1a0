"""ParallelWrapper, the object users hold, and its Builder. It validates, picks a host for the
workers and orchestrates; the algorithm lives in rounds.py and worker.py, the processes in
hosts/, the data in feed.py, and what the environment means in env.py."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import checkpoint
from .config import BeforeStep, Config, Job, LossFn, NanPolicy, OptimizerFn, OuterSpec, SchedulerSpec, TrainingMode, TrainingStep
from .config import ValidationStep, check_job, parse_enum
from .env import Placement, resolve, torchrun_env
from .evaluation import classification_metrics, metric_sums
from .feed import Batches, check_epochs, compact, epoch_iterable
from .hosts import Host, start_host
from .listeners import History, Recorder, check_listeners, early_stopping_of, notify
from .parts import Parts
from .types import Counters, FitCommand, Report, TrainingState, WorkerError


class ParallelWrapper:
    """Data-parallel training of one model on N workers by periodic averaging.

    Build one with `ParallelWrapper.builder(model)...build()`. Workers start on the first `fit()`
    and live until `close()` (or the end of a `with` block); each `fit()` starts from the state of
    the user's model and `optimizer`, and leaves the averaged result in them. A fit() that fails
    leaves them as they were.
    """

    def __init__(self, config: Config, job: Job, listeners: list[Any], placement: Placement | None = None) -> None:
        self.config = config
        self.placement = placement or resolve(config, torchrun_env())
        self._parts = Parts(job.model, job, self.placement.world_size)  # the averaged state lands here
        self.model, self.optimizer = job.model, self._parts.optimizer
        self._job = job
        self._listeners = listeners
        self._pool: Host | None = None
        self._closed = False
        self.counters = Counters()  # as the workers report them after each round

    @property
    def rounds(self) -> int:
        return self.counters.rounds

    @property
    def iterations(self) -> int:
        return self.counters.iterations

    @property
    def samples(self) -> int:
        return self.counters.samples

    @property
    def lr_scheduler(self) -> Any:
        """The scheduler of `.lr_scheduler(...)` on `optimizer`, in step with it after each fit()
        (None without one). A fit() starts from its state, so a second fit() continues it."""
        return None if self._parts.schedule is None else self._parts.schedule.scheduler

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        """The outer optimizer of `.outer_optimizer(...)` after the last fit(), or None."""
        return None if self._parts.outer is None else self._parts.outer.optimizer

    @staticmethod
    def builder(model: torch.nn.Module) -> Builder:
        return Builder(model)

    # -- life cycle -----------------------------------------------------------------------------

    def __enter__(self) -> ParallelWrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers. Safe to call twice; the wrapper cannot fit after it."""
        self._closed = True
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()

    def _abort(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.kill()

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._abort()

    # -- training -------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def is_main(self) -> bool:
        """True in the process that reports to the listeners: the caller's, or rank 0 under torchrun."""
        return self.placement.torchrun is None or self.placement.torchrun.rank == 0

    def fit(self, data: Batches, epochs: int = 1, *, resume: str | os.PathLike[str] | None = None) -> History:
        """Train on `epochs` passes over `data` and return the averaged scores.

        `data` is an iterable of batches (a DataLoader, a list) or a function returning one, called
        once per epoch. Batches are `(inputs, targets)` unless `.training_step(fn)` was set.

        `resume`: a checkpoint directory (or file) to continue from. Model, optimizer, counters,
        RNG states and the place in the epoch are restored; `epochs` then counts from the start
        of the run that wrote the checkpoint, so the same call finishes an interrupted run.

        A worker's failure raises WorkerError, whichever host runs the workers; the data's own
        errors raise FeedError. Under torchrun every rank returns the same History; listeners
        run on rank 0."""
        if self._closed:
            raise RuntimeError("this ParallelWrapper is closed; build a new one to train again")
        check_epochs(data, epochs)
        rng = None
        until_epoch = self.counters.epoch + epochs
        if resume is not None:
            rng = self._restore(resume)
            until_epoch = epochs
            if until_epoch <= self.counters.epoch:
                raise ValueError(
                    f"the checkpoint has already trained {self.counters.epoch} epochs, fit(epochs={epochs}) "
                    f"asks for no more; pass epochs > {self.counters.epoch} to train on"
                )
        listeners = self._listeners if self.is_main else []
        recorder = Recorder(listeners, time.monotonic())
        notify(listeners, "on_fit_start", self.config, until_epoch - self.counters.epoch)

        def on_report(report: Report) -> None:
            self.counters = report.counters
            recorder(report)

        try:
            if self._pool is None:
                self._pool = start_host(self.config, self._job, self.placement)
            # Copies: sending a tensor moves its storage into shared memory, and the user's own
            # model must not be changed under them.
            command = FitCommand(until_epoch, dataclasses.replace(self.counters), self._parts.state(), rng)
            state = self._pool.fit(command, data, on_report)
        except BaseException:
            # A failed round leaves the workers' states apart or a collective half done: start
            # afresh next time. The user's model keeps its state from before this fit().
            self._abort()
            raise
        self._parts.load(state)
        notify(listeners, "on_fit_end", recorder.history)
        return recorder.history

    def _restore(self, location: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """Load a checkpoint into the model, optimizer, schedule and counters; return each worker's own state."""
        payload = checkpoint.load(location, checkpoint.fingerprint(self.config, self._job, self.world_size))
        self._parts.load(TrainingState(payload["model"], payload["optimizer"], payload.get("lr_scheduler"), payload.get("outer_optimizer")))
        self.counters = Counters(**payload["counters"])
        return list(payload["rng"])

    def evaluate(self, data: Batches, *, device: str | torch.device | None = None) -> dict[str, float]:
        """Mean loss (NaN without a loss function) and accuracy (argmax(outputs) == targets) of the
        averaged model over `(inputs, targets)` batches, in this process, on `device` (default:
        where the model's parameters are), scored as the workers' validation scores them."""
        if device is None:
            device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        metrics = functools.partial(classification_metrics, loss_fn=self._job.loss_fn)
        sums, count = metric_sums(self.model, epoch_iterable(data)(), metrics, torch.device(device))
        if count == 0:
            raise ValueError("evaluate() got no batches")
        return {"loss": sums.get("loss", math.nan) / count, "accuracy": sums["accuracy"] / count, "samples": float(count)}


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
        self._optimizer_fn: OptimizerFn | None = None
        self._before_step: BeforeStep | None = None
        self._lr_scheduler: SchedulerSpec | None = None
        self._outer: OuterSpec | None = None
        self._validation: Batches | None = None
        self._validation_step: ValidationStep | None = None
        self._loss_fn: LossFn | None = torch.nn.functional.cross_entropy
        self._training_step: TrainingStep | None = None
        self._listeners: list[Any] = []

    def optimizer(self, optimizer: type[torch.optim.Optimizer] | OptimizerFn, **kwargs: Any) -> Builder:
        """Any `torch.optim` optimizer class and its keyword arguments (default: SGD, lr=0.01), or
        a function `model -> optimizer`, for parameter groups: each worker calls it on its own
        copy of the model. Define the function at module level, so that it reaches the workers."""
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            if "params" in kwargs:
                raise ValueError(
                    "optimizer: params= would hold this process's tensors, not a worker's; for parameter "
                    "groups pass a function instead, e.g. .optimizer(make_optimizer) with "
                    "`def make_optimizer(model): return torch.optim.AdamW([{'params': [...], 'weight_decay': 0.1}, ...])`"
                )
            self._optimizer_cls, self._optimizer_kwargs, self._optimizer_fn = optimizer, dict(kwargs), None
        elif callable(optimizer) and not isinstance(optimizer, (type, torch.optim.Optimizer)) and not kwargs:
            self._optimizer_fn = optimizer
        else:
            got = f"an instance of {type(optimizer).__name__}" if isinstance(optimizer, torch.optim.Optimizer) else repr(optimizer)
            extra = " with keyword arguments (a function takes none: it builds the whole optimizer)" if kwargs else ""
            raise ValueError(
                f"optimizer takes an optimizer class and its kwargs, e.g. .optimizer(torch.optim.SGD, lr=0.01), "
                f"or a function model -> optimizer; got {got}{extra}"
            )
        return self

    def lr_scheduler(self, scheduler: Callable[..., Any], *, interval: str = "epoch", monitor: str | None = None, **kwargs: Any) -> Builder:
        """A torch.optim.lr_scheduler class and its keyword arguments, or a function optimizer ->
        scheduler; each worker builds one on its own optimizer, all step in lockstep: `interval`
        "epoch" (default) at each epoch's end, "step" by ceil(batches trained by all workers / N)
        after each averaging. ReduceLROnPlateau steps on `monitor` (default val_loss) at each
        validation, or on the averaged loss without validation data. See README."""
        self._lr_scheduler = SchedulerSpec(scheduler, dict(kwargs), interval, monitor)
        return self

    def outer_optimizer(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> Builder:
        """DiLoCo / SlowMo: after each averaging every worker steps `cls(**kwargs)`, e.g. SGD(lr=0.7,
        momentum=0.9, nesterov=True), on Δ = θ_start − average(θ). Default: none (keep the average)."""
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"outer_optimizer takes a torch.optim optimizer class and its kwargs, e.g. .outer_optimizer(torch.optim.SGD, lr=0.7); got {cls!r}")
        self._outer = OuterSpec(cls, dict(kwargs))
        return self

    def warmup_sync_steps(self, n: int) -> Builder:
        """Post-local SGD: the first `n` steps (over the wrapper's life) average gradients every
        step, as SHARED_GRADIENTS does, then the averaging rounds begin. Default: 0."""
        return self._set("warmup_sync_steps", n)

    def payload_dtype(self, dtype: torch.dtype | str) -> Builder:
        """torch.bfloat16 or torch.float16: each averaging sends the floats' change since the last
        average in that dtype, what the cast loses going with the next round. Default: float32."""
        return self._set("payload_dtype", str(dtype).removeprefix("torch."))

    def hierarchy(self, level: str) -> Builder:
        """"node": under torchrun with several processes per node, a node's ranks average their
        gradients every step and the nodes average every k steps. Default: "none"."""
        return self._set("hierarchy", level)

    def gradient_clipping(self, max_norm: float) -> Builder:
        """Clip each step's gradients to a total norm of `max_norm` (clip_grad_norm_), after
        backward and `before_step`, before the optimizer's step; in SHARED_GRADIENTS, the averaged
        gradients. Default: no clipping."""
        return self._set("gradient_clip_norm", max_norm)

    def precision(self, name: str) -> Builder:
        """"32" (default), "bf16-mixed" or "16-mixed": each worker's forward and loss under autocast
        to bfloat16 or float16; 16-mixed scales the loss with each worker's own GradScaler (a step
        it skips still joins its round). Parameters, gradients, optimizer state and averaging stay float32."""
        return self._set("precision", name)

    def validation(self, data: Batches, every: int | None = 50, step: ValidationStep | None = None) -> Builder:
        """Score the averaged model on `data` every `every` averagings (None: never) and at each
        epoch's end, each worker its share (batch i on worker i mod N). Metrics: val_loss and
        val_accuracy, or `step(model, batch) -> {name: batch mean}`; to `on_validation`, History."""
        self._validation, self._validation_step = compact(data), step
        return self._set("validation_every", every)

    def before_step(self, fn: BeforeStep) -> Builder:
        """`fn(model, optimizer)` on each worker after backward, before the step (and before
        clipping): any gradient work, where a parameter hook would not reach the workers. In
        SHARED_GRADIENTS it sees the averaged gradients. Define it at module level."""
        if not callable(fn):
            raise ValueError(f"before_step takes a function fn(model, optimizer), got {type(fn).__name__}")
        self._before_step = fn
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
        the caller's own process: nothing is spawned, and batches are not copied. Ignored under
        torchrun, whose --nnodes and --nproc-per-node decide (with a warning)."""
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
        return self._set("training_mode", parse_enum(TrainingMode, mode, "training_mode"))

    def deterministic(self, flag: bool = True) -> Builder:
        """Deal batch i to worker i mod N instead of first-come, so two runs give the same model.
        Default: False."""
        return self._set("deterministic", bool(flag))

    def seed(self, n: int) -> Builder:
        """Seed of worker i's RNGs is `n + i`. Default: 0."""
        return self._set("seed", n)

    def devices(self, devices: Sequence[str | torch.device]) -> Builder:
        """One device per worker, e.g. ["cuda:0", "cuda:1"]. Default: cuda:i for worker i when
        there are GPUs (shared round-robin when workers outnumber them), else the CPU. Ignored
        under torchrun, where LOCAL_RANK picks the GPU (with a warning)."""
        if isinstance(devices, (str, torch.device)):
            raise ValueError(f"devices takes one device per worker, e.g. .devices(['cpu', 'cpu']); got {devices!r}")
        return self._set("devices", tuple(str(d) for d in devices))

    def backend(self, name: str) -> Builder:
        """"auto" (default): NCCL when every worker has a GPU of its own, else gloo; or "gloo", or
        "nccl", which build() refuses without a GPU per worker."""
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
        return self._set("nan_policy", parse_enum(NanPolicy, policy, "nan_policy"))

    def threads_per_worker(self, n: int) -> Builder:
        """torch threads in each worker. Default: the machine's cores divided among the workers."""
        return self._set("threads_per_worker", n)

    def _set(self, name: str, value: Any) -> Builder:
        self._options[name] = value
        return self

    def build(self) -> ParallelWrapper:
        config = Config(**self._options)
        job = Job(
            self._model, self._optimizer_cls, self._optimizer_kwargs, self._loss_fn, self._training_step,
            self._optimizer_fn, self._before_step, self._validation, self._validation_step, early_stopping_of(self._listeners),
            self._lr_scheduler, self._outer,
        )  # fmt: skip
        torchrun = torchrun_env()
        notes = check_job(job, config, sendable=torchrun is None)  # under torchrun nothing travels
        check_listeners(self._listeners)
        placement = resolve(config, torchrun, explicit=self._options.keys())
        for note in [*notes, *placement.notes]:
            warnings.warn(note, stacklevel=2)
        return ParallelWrapper(config, job, list(self._listeners), placement)


__all__ = ["Builder", "ParallelWrapper", "WorkerError"]
