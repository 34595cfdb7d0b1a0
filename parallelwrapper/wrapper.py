"""ParallelWrapper: the object users hold. It orchestrates; the algorithm lives in worker.py and
averaging.py, the processes in launch.py, the data in feed.py."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from .config import Builder, Config, Job
from .feed import Batches, Feeder, ShardSource, check_epochs
from .launch import WorkerError, WorkerPool, join_torchrun, torchrun_env
from .listeners import EpochEnd, History, Score, notify
from .worker import EpochReport, Replica, RoundReport


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
        self._job = Job(job.model, job.optimizer_cls, job.optimizer_kwargs, job.loss_fn, job.training_step)
        self._listeners = listeners
        self._pool: WorkerPool | None = None
        self._replica: Replica | None = None  # torchrun: this process is a worker
        self._owns_group = False  # torchrun: we created the process group, so we destroy it
        self._closed = False
        self.rounds = self.iterations = self.samples = self.epochs_done = 0

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

    def fit(self, data: Batches, epochs: int = 1) -> History:
        """Train on `epochs` passes over `data` and return the averaged scores.

        `data` is an iterable of batches (a DataLoader, a list) or a function returning one, called
        once per epoch. Batches are `(inputs, targets)` unless `.training_step(fn)` was set.
        """
        if self._closed:
            raise RuntimeError("this ParallelWrapper is closed; build a new one to train again")
        check_epochs(data, epochs)
        history = History()
        start = time.perf_counter()
        notify(self._listeners, "on_fit_start", self.config, epochs)

        def on_report(report: RoundReport | EpochReport) -> None:
            seconds = time.perf_counter() - start
            if isinstance(report, RoundReport):
                self._advance(1, report.batches, report.samples)
                score = Score(self.rounds, self.iterations, self.samples, report.epoch, report.score, seconds, report.skipped)
                history.scores.append(score)
                notify(self._listeners, "on_score", score)
                return
            if not self.config.report_score_after_averaging:  # no round reports came: count here
                self._advance(report.rounds, report.batches, report.samples)
            self.epochs_done += 1
            end = EpochEnd(report.epoch, self.iterations, self.samples, report.score, seconds)
            history.epochs.append(end)
            notify(self._listeners, "on_epoch_end", end)

        if torchrun_env() is not None:
            self._fit_torchrun(data, epochs, on_report)
        else:
            self._fit_spawned(data, epochs, on_report)
        notify(self._listeners, "on_fit_end", history)
        return history

    def _fit_spawned(self, data: Batches, epochs: int, on_report: Any) -> None:
        try:
            if self._pool is None:
                self._pool = WorkerPool(self.config, self._job)
            feeder = Feeder(data, epochs, self.epochs_done, self._pool.data_queues, self.config.workers)
            state = (_clone(self.model.state_dict()), _clone(self.optimizer.state_dict()))
            model_state, optimizer_state = self._pool.fit(epochs, self.epochs_done, state, feeder, on_report)
        except BaseException:
            # A failed round leaves the workers' states apart or a collective half done: start
            # afresh next time. The user's model keeps its state from before this fit().
            self._abort()
            raise
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)

    def _fit_torchrun(self, data: Batches, epochs: int, on_report: Any) -> None:
        if self._replica is None:
            env, device, self._owns_group = join_torchrun(self.config)
            self.model.to(device)
            self._replica = Replica(self.model, self.optimizer, self._job, self.config, device, env.rank, env.world_size)
            torch.manual_seed(self.config.seed + env.rank)
        replica = self._replica
        source = ShardSource(data, replica.rank, replica.world_size)
        replica.fit(epochs, self.epochs_done, source, on_report if self.is_main else _count_epochs(self))

    def _advance(self, rounds: int, batches: int, samples: int) -> None:
        self.rounds += rounds
        self.iterations += batches
        self.samples += samples

    @torch.no_grad()
    def evaluate(self, data: Batches, *, device: str | torch.device = "cpu") -> dict[str, float]:
        """Mean loss and accuracy of the averaged model over `(inputs, targets)` batches, in this
        process. Accuracy is the share of argmax(outputs) == targets."""
        from .feed import epoch_iterable

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


def _count_epochs(wrapper: ParallelWrapper) -> Any:
    """Non-reporting torchrun ranks still keep the epoch counter in step."""

    def on_report(report: RoundReport | EpochReport) -> None:
        if isinstance(report, EpochReport):
            wrapper.epochs_done += 1

    return on_report


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    """Copies of the state's tensors: sending a tensor to a worker moves its storage to shared
    memory, and the user's own model must not be changed under them."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
        elif isinstance(v, dict):
            out[k] = _clone(v)
        else:
            out[k] = v
    return out


__all__ = ["ParallelWrapper", "WorkerError"]
