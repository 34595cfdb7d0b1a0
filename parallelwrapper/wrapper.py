"""ParallelWrapper, the object users hold, and its Builder's `build()` (the setters: settings.py).

It validates, picks a host for the workers and orchestrates; the algorithm lives in rounds/ and
worker.py, the processes in hosts/, the data's way to the workers in feed/, and what the environment means in env.py."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from . import checkpoint, features, replacement
from .autopilot import levers
from .config import Config, refuse, steered
from .env import Placement, torchrun_env
from .errors import WorkerError
from .evaluation import check_validation, job_metrics, metric_sums
from .feed import order
from .feed.data import Batches, check_epochs, epoch_iterable
from .hosts import Host, TorchrunWorker, start_host
from .job import Job, ValidationStep, check_job
from .listeners import History, Recorder, check_listeners, early_stopping_of, notify
from .messages import FitCommand
from .parts import Parts
from .schedule import sizing_warning, steps_per_epoch
from .sendable import check_sendable
from .settings import Settings
from .types import Counters, DataOrder, Report, TrainingState


class ParallelWrapper:
    """Data-parallel training of one model on N workers by periodic averaging.

    Build one with `ParallelWrapper.builder(model)...build()`. Workers start on the first `fit()`
    and live until `close()` (or the end of a `with` block); each `fit()` starts from the state of
    the user's model and `optimizer`, and leaves the averaged result in them. A fit() that fails
    leaves them as they were.
    """

    def __init__(self, config: Config, job: Job, listeners: list[Any], placement: Placement | None = None) -> None:
        self.config = config
        self._feature = features.of(config)  # what the hosts and workers ask of the config's features
        self.placement = placement or features.placement(config, torchrun_env(), feature=self._feature)
        self._parts = Parts(job.model, job, self.placement.world_size)  # the averaged state lands here
        self.model, self.optimizer = job.model, self._parts.optimizer
        self._job = job
        self._listeners = listeners
        self._pool: Host | None = None
        self._closed = False
        self._validation_tried = job.validation_data is None  # check_validation, at the first fit()
        self.counters = Counters()  # as the latest record left them (each record says where they stand after it)

    @property
    def rounds(self) -> int:
        """Averagings so far, over the wrapper's life (checkpoints and resumes included)."""
        return self.counters.rounds

    @property
    def iterations(self) -> int:
        """Batches trained so far, all workers together, over the wrapper's life."""
        return self.counters.iterations

    @property
    def samples(self) -> int:
        """Samples trained so far, all workers together, over the wrapper's life."""
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
        """A `Builder` for a wrapper that trains `model`; `fit()` leaves the averaged state in it."""
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
        """How many workers train: `.workers(n)`, or the torchrun group's size."""
        return self.placement.world_size

    @property
    def is_main(self) -> bool:
        """True in the process that reports to the listeners: the caller's, or rank 0 under torchrun."""
        return self.placement.torchrun is None or self.placement.torchrun.rank == 0

    def fit(
        self, data: Batches, epochs: int = 1, *, resume: str | os.PathLike[str] | None = None, accept_changes: Iterable[str] = ()
    ) -> History:
        """Train on `epochs` passes over `data` and return the averaged scores.

        `data` is an iterable of batches (a DataLoader, a list) or a function returning one, called
        once per epoch. Batches are `(inputs, targets)` unless `.training_step(fn)` was set.

        `resume`: a checkpoint directory (or file) to continue from. Model, optimizer, counters,
        RNG states and the place in the epoch are restored; `epochs` then counts from the start
        of the run that wrote the checkpoint, so the same call finishes an interrupted run. A
        checkpoint of another configuration is refused, naming each field that differs;
        `accept_changes` names those of "optimizer", "lr_scheduler" and "outer_optimizer" you
        changed knowingly (their saved state is loaded into this run's), and "workers" to resume
        with another number of workers (checkpoint.own_states says what each worker takes); a
        group that torchrun restarted with another number of machines resumes so by itself.

        A worker's failure raises WorkerError, whichever host runs the workers; the data's own
        errors raise FeedError. Under torchrun every rank returns the same History; listeners
        run on rank 0."""
        if self._closed:
            raise RuntimeError("this ParallelWrapper is closed; build a new one to train again")
        check_epochs(data, epochs)
        rng, kept = None, {}
        until_epoch = self.counters.epoch + epochs
        if resume is None and self.counters == Counters():
            resume = self._auto_resume()
            accept_changes = [*accept_changes, "workers"] if resume is not None else accept_changes  # torchrun's --nnodes MIN:MAX: a machine fewer or more
        if resume is not None:
            rng = self._restore(resume, accept_changes)
            kept = order.read(resume)  # each epoch's order, where the data shuffles (feed/order.py)
            order.check_resumable(data, kept, self.counters.epoch, self.counters.position, os.fspath(resume))
            until_epoch = epochs
            if until_epoch <= self.counters.epoch:
                raise ValueError(
                    f"the checkpoint has already trained {self.counters.epoch} epochs, fit(epochs={epochs}) "
                    f"asks for no more; pass epochs > {self.counters.epoch} to train on"
                )
        self._check_schedule_length(data, until_epoch)
        if not self._validation_tried:
            check_validation(self._job, self.model, self.config.precision)  # before any worker starts
            self._validation_tried = True
        listeners = self._listeners if self.is_main else []
        recorder, start = Recorder(listeners), time.monotonic()  # the records' seconds count from here
        notify(listeners, "on_fit_start", self.config, until_epoch - self.counters.epoch)

        def on_report(record: Report) -> None:
            self.counters = record.counters
            recorder(record)

        try:
            if self._pool is None:
                self._pool = self._start_host()
            state = self._pool.fit(self._command(until_epoch, rng, start, kept), data, on_report)  # held by no name here
        except BaseException:
            # A failed round leaves the workers' states apart or a collective half done: start
            # afresh next time. The user's model keeps its state from before this fit().
            self._abort()
            raise
        # The host's copy is this process's alone (a spawned worker's, in shared memory, is let go
        # by its sender): the optimizer keeps its tensors rather than a copy of them.
        self._parts.load(state, take=True)
        del state
        stopper = early_stopping_of(listeners)
        if stopper is not None and stopper.restore_best:
            recorder.history.best_round = stopper.best_round  # the workers restored that round's state
        notify(listeners, "on_fit_end", recorder.history)
        return recorder.history

    def steps_per_epoch(self, data: Batches | int) -> int:
        """The optimizer steps each worker takes in an epoch of `data` (batches with a len(), or
        their number): ceil(batches / workers), the global step that a per-step learning-rate
        schedule counts. Size one over a run as `epochs * steps_per_epoch(data)` (the Builder has
        the same method, for use before build())."""
        return steps_per_epoch(batch_count(data, "steps_per_epoch"), self.world_size)

    def _check_schedule_length(self, data: Batches, until_epoch: int) -> None:
        """Warn where a per-step schedule's planned length does not fit the steps this fit takes."""
        schedule, batches = self._parts.schedule, _len(data)
        if schedule is None or batches is None:
            return
        fit_batches = (until_epoch - self.counters.epoch) * batches - self.counters.position
        message = sizing_warning(schedule, self.counters.iterations, fit_batches)
        if message is not None:
            warnings.warn(message, stacklevel=3)

    def _command(self, until_epoch: int, rng: list[dict[str, Any]] | None, start: float, kept: dict[int, dict[str, Any]]) -> FitCommand:
        """What every worker starts this fit from, which began at `start`. Spawned workers get the
        state's own tensors in shared memory (Parts.shipped: no copy); any other host a copy, since
        it trains on what it is given and the user's own model must not change under it. The
        process that draws the data's epochs (this one, rank 0 under torchrun) keeps their orders
        beside the checkpoints; `kept`: those a resume read."""
        spawned = self.placement.torchrun is None and not self.placement.in_process
        state = self._parts.shipped() if spawned else self._parts.state()
        data_order = DataOrder(self.config.checkpoint_dir if self.is_main else None, kept)
        return FitCommand(until_epoch, dataclasses.replace(self.counters), state, rng, start, order=data_order)

    def _start_host(self) -> Host:
        """The host the placement calls for, with the features it asks (and replacement's side of a pool)."""
        return start_host(self.config, self._job, self.placement, self._feature, replacement.replacer(self.config), replacement.survivor(self.config))

    def _auto_resume(self) -> str | None:
        """Under torchrun, a group that torchrun restarted (--max-restarts) resumes its first fit() from
        the last checkpoint, with `.checkpoint(dir)` and `.auto_resume()`: joining the group says so."""
        if not (self.placement.torchrun and self.config.checkpoint_dir and self.config.auto_resume and self._pool is None):
            return None
        host = self._start_host()
        self._pool = host
        return host.resume_point if isinstance(host, TorchrunWorker) else None

    def _restore(self, location: str | os.PathLike[str], accept: Iterable[str] = ()) -> list[dict[str, Any]]:
        """Load a checkpoint into the model, optimizer, schedule and counters; return each worker's own state."""
        payload = checkpoint.load(location, checkpoint.fingerprint(self.config, self._job, self.world_size, self._feature.fingerprint()), accept)
        try:
            self._parts.load(TrainingState(payload["model"], payload["optimizer"], payload.get("lr_scheduler"), payload.get("outer_optimizer")))
        except (ValueError, KeyError, RuntimeError) as e:  # an accepted change that does not fit the saved state
            cause = (str(e).strip().splitlines() or [""])[0][:300]
            raise checkpoint.CheckpointError(
                f"{checkpoint.path_of(location)}: its state does not load into this run's optimizer, schedule or outer optimizer "
                f"({type(e).__name__}: {cause}); resume with the ones that wrote it, or start afresh without resume"
            ) from None
        self.counters = Counters(**payload["counters"])
        saved, per_worker = list(payload["rng"]), self.placement.per_worker
        if len(saved) != self.world_size * per_worker:
            if self.is_main:
                warnings.warn(
                    f"resumed from {checkpoint.path_of(location)} with {self.world_size} workers, where it was written with "
                    f"{len(saved) // per_worker}: the model and optimizer are the average, as they were; each worker's own state "
                    "(its RNG, what a coded payload had yet to send) is its own up to the old number, worker 0's beyond it",
                    stacklevel=3,
                )
            saved = checkpoint.own_states(saved, self.world_size, per_worker)
        return saved

    def evaluate(self, data: Batches, *, device: str | torch.device | None = None, step: ValidationStep | None = None) -> dict[str, float]:
        """The averaged model's mean metrics over `data`, in this process, on `device` (default:
        where the model's parameters are), with the number of samples: by default the loss (NaN
        without a loss function) and the accuracy of `(inputs, targets)` batches, or, built with
        `.loss_from_output()`, the model's own loss (and accuracy where its output has logits and
        the batch labels); or whatever `step(model, batch) -> {name: batch mean}` returns. Scored
        as the workers' validation scores, in eval mode without gradients."""
        home = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        device = home if device is None else torch.device(device)
        # Elsewhere (the workers trained on a GPU, the model came back to the CPU): a copy goes
        # there, and the user's model stays where it is.
        model = self.model if device == home else copy.deepcopy(self.model).to(device)
        sums, count = metric_sums(model, epoch_iterable(data)(), step or job_metrics(self._job), device)
        if count == 0:
            raise ValueError("evaluate() got no batches")
        means = {name: total / count for name, total in sums.items()}
        if step is None:
            means = {"loss": math.nan, **means}  # without a loss function, the accuracy alone
        return {**means, "samples": float(count)}


def _len(data: Batches) -> int | None:
    """How many batches an epoch of `data` has, where it says (a function's epochs do not)."""
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


def batch_count(data: Batches | int, where: str) -> int:
    """Batches in an epoch of `data`, or a ValueError naming `where` for data without a length:
    what it lacks and the count to pass instead."""
    count = data if isinstance(data, int) else _len(data)
    if count is not None and count >= 0:
        return count
    instead = f"the number of batches an epoch yields, e.g. {where}(1000)"
    if isinstance(data, torch.utils.data.DataLoader) and isinstance(data.dataset, torch.utils.data.IterableDataset):
        raise ValueError(f"{where}(data): this DataLoader reads an IterableDataset, which has no len(); pass {instead}")
    lacks = f"got {count}, a negative count" if isinstance(data, int) else f"a {type(data).__name__} has no len()"
    raise ValueError(f"{where}(data): {lacks}; pass batches with a len() (a list, a map-style DataLoader) or {instead}")


class Builder(Settings):
    """Fluent configuration of a ParallelWrapper, after DL4J's `ParallelWrapper.Builder`.

    Every setter (settings.py) returns the builder; `build()` validates everything and raises
    `ValueError` naming the option and the fix.
    """

    def _config(self) -> Config:
        """The options as a Config: the autopilot's levers those the user left free (autopilot.levers)
        that run with the rest (config.steered)."""
        return steered(Config(**levers(self._options)))

    def build(self) -> ParallelWrapper:
        """Check every option and make the wrapper; a bad option raises `ValueError` naming it
        and the fix. No worker starts until the first `fit()`."""
        config = self._config()
        job = Job(
            self._model, self._optimizer_cls, self._optimizer_kwargs, self._loss_fn, self._training_step,
            self._optimizer_fn, self._before_step, self._validation, self._validation_step, early_stopping_of(self._listeners),
            self._lr_scheduler, self._outer,
        )  # fmt: skip
        refuse(config, job)
        torchrun = torchrun_env()
        feature = features.of(config)
        placement = features.placement(config, torchrun, feature=feature, explicit=self._options.keys())
        notes = check_job(job, placement.world_size)
        feature.check(job)
        if torchrun is None:  # under torchrun nothing travels
            check_sendable(job)
        check_listeners(self._listeners)
        for note in [*notes, *placement.notes]:
            warnings.warn(note, stacklevel=2)
        return ParallelWrapper(config, job, list(self._listeners), placement)

    def steps_per_epoch(self, data: Batches | int) -> int:
        """The optimizer steps each worker will take in an epoch of `data` (batches with a len(),
        or their number) with the workers set so far (or torchrun's): ceil(batches / workers),
        the global step that a per-step schedule counts. For sizing one before build(), e.g.
        `.lr_scheduler(OneCycleLR, interval="step", max_lr=0.1, total_steps=epochs * builder.steps_per_epoch(train))`."""
        placement = features.placement(self._config(), torchrun_env(), explicit=self._options.keys())
        return steps_per_epoch(batch_count(data, "steps_per_epoch"), placement.world_size)


__all__ = ["Builder", "ParallelWrapper", "WorkerError"]
