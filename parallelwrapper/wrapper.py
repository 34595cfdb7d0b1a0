"""ParallelWrapper: the object users hold. It orchestrates; the algorithm lives in worker.py and
averaging.py, the processes in launch.py, the data in feed.py."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint
from .config import Builder, Config, Job
from .feed import Batches, ShardSource, check_epochs, epoch_iterable
from .inprocess import InProcessWorker, runs_in_process
from .launch import FitCommand, WorkerError, WorkerPool, join_torchrun, make_checkpointer, torchrun_env
from .listeners import EpochEnd, History, Score, notify
from .worker import Counters, EpochReport, Hooks, Replica, RoundReport, to_cpu


class ParallelWrapper:
    """Data-parallel training of one model on N workers by periodic averaging.

    Build one with `ParallelWrapper.builder(model)...build()`. Workers start on the first `fit()`
    and live until `close()` (or the end of a `with` block); each `fit()` starts from the state of
    the user's model and `optimizer`, and leaves the averaged result in them.
    """

    def __init__(self, config: Config, job: Job, listeners: list[Any]) -> None:
        self.config = config
        self.model = job.model
        self.optimizer = job.make_optimizer(job.model)  # holds the averaged optimizer state
        self._job = job
        self._listeners = listeners
        self._pool: WorkerPool | InProcessWorker | None = None
        self._replica: Replica | None = None  # torchrun: this process is a worker
        self._owns_group = False  # torchrun: we created the process group, so we destroy it
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
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

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
        env = torchrun_env()
        return env.world_size if env else self.config.workers

    @property
    def is_main(self) -> bool:
        """True in the process that reports: the caller's, or rank 0 under torchrun."""
        env = torchrun_env()
        return env is None or env.rank == 0

    def fit(self, data: Batches, epochs: int = 1, *, resume: str | os.PathLike[str] | None = None) -> History:
        """Train on `epochs` passes over `data` and return the averaged scores.

        `data` is an iterable of batches (a DataLoader, a list) or a function returning one, called
        once per epoch. Batches are `(inputs, targets)` unless `.training_step(fn)` was set.

        `resume`: a checkpoint directory (or file) to continue from. Model, optimizer, counters,
        RNG states and the place in the epoch are restored; `epochs` then counts from the start
        of the run that wrote the checkpoint, so the same call finishes an interrupted run.
        """
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
        history = History()
        start = time.monotonic()  # reports carry the system-wide monotonic time they were made
        notify(self._listeners, "on_fit_start", self.config, until_epoch - self.counters.epoch)

        def on_report(report: RoundReport | EpochReport) -> None:
            self.counters = report.counters
            c, seconds = report.counters, report.at - start
            if isinstance(report, RoundReport):
                score = Score(c.rounds, c.iterations, c.samples, c.epoch, report.score, seconds, report.skipped)
                history.scores.append(score)
                notify(self._listeners, "on_score", score)
            else:
                end = EpochEnd(report.epoch, c.iterations, c.samples, report.score, seconds)
                history.epochs.append(end)
                notify(self._listeners, "on_epoch_end", end)

        if torchrun_env() is not None:
            self._fit_torchrun(data, until_epoch, rng, on_report)
        else:
            self._fit_local(data, until_epoch, rng, on_report)
        notify(self._listeners, "on_fit_end", history)
        return history

    def _restore(self, location: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """Load a checkpoint into the model, optimizer and counters; return the workers' RNG states."""
        payload = checkpoint.load(location, checkpoint.fingerprint(self.config, self._job, self.world_size))
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.counters = Counters(**payload["counters"])
        rng: list[dict[str, Any]] = payload["rng"]
        return rng

    def _fit_local(self, data: Batches, until_epoch: int, rng: list[dict[str, Any]] | None, on_report: Any) -> None:
        """Spawned workers, or with one worker on the CPU this process (inprocess.py)."""
        try:
            if self._pool is None:
                in_process = runs_in_process(self.config)
                self._pool = (InProcessWorker if in_process else WorkerPool)(self.config, self._job)
            # Copies: sending a tensor moves its storage into shared memory, and the user's own
            # model must not be changed under them.
            command = FitCommand(
                until_epoch,
                dataclasses.replace(self.counters),
                to_cpu(self.model.state_dict()),
                to_cpu(self.optimizer.state_dict()),
                rng,
            )
            model_state, optimizer_state = self._pool.fit(command, data, on_report)
        except BaseException:
            # A failed round leaves the workers' states apart or a collective half done: start
            # afresh next time. The user's model keeps its state from before this fit().
            self._abort()
            raise
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)

    def _fit_torchrun(self, data: Batches, until_epoch: int, rng: list[dict[str, Any]] | None, on_report: Any) -> None:
        if self._replica is None:
            env, device, self._owns_group = join_torchrun(self.config)
            self.model.to(device)
            hooks = Hooks(make_checkpointer(self.config, self._job, env.world_size))
            self._replica = Replica(
                self.model, self.optimizer, self._job, self.config, device, env.rank, env.world_size, hooks=hooks
            )
        replica = self._replica
        replica.counters = dataclasses.replace(self.counters)
        if rng is not None:
            checkpoint.set_rng_state(rng[replica.rank])
        source = ShardSource(data, replica.rank, replica.world_size, self.counters.epoch, self.counters.position)
        replica.fit(until_epoch, source, on_report if self.is_main else self._keep_counters)
        self.counters = dataclasses.replace(replica.counters)

    def _keep_counters(self, report: RoundReport | EpochReport) -> None:
        """Non-reporting torchrun ranks keep their counters in step all the same."""
        self.counters = report.counters

    @torch.no_grad()
    def evaluate(self, data: Batches, *, device: str | torch.device = "cpu") -> dict[str, float]:
        """Mean loss and accuracy of the averaged model over `(inputs, targets)` batches, in this
        process. Accuracy is the share of argmax(outputs) == targets."""
        model = self.model
        was_training = model.training
        model.eval()
        loss_sum, correct, count = 0.0, 0, 0
        try:
            for inputs, targets in epoch_iterable(data)():
                inputs, targets = inputs.to(device), targets.to(device)
                outputs = model(inputs)
                n = targets.shape[0]
                if self._job.loss_fn is not None:
                    loss_sum += float(self._job.loss_fn(outputs, targets)) * n
                correct += int((outputs.argmax(dim=1) == targets).sum())
                count += n
        finally:
            model.train(was_training)
        if count == 0:
            raise ValueError("evaluate() got no batches")
        return {"loss": loss_sum / count, "accuracy": correct / count, "samples": float(count)}


__all__ = ["ParallelWrapper", "WorkerError"]
