"""One worker's training loop: pull batches, step, and run the round protocol of DESIGN.md.

The same loop runs in a spawned worker process (batches from the shared queue) and in a torchrun
process (batches from its own shard); it sees a `BatchSource`, a `Reporter` and `Hooks`, never a
queue or a file.

A round, in both modes:
    local work   AVERAGING: up to k steps; SHARED_GRADIENTS: one forward/backward
    header       all-reduce of samples, loss, finished and stop flags (averaging.reduce_header)
    payload      AVERAGING: params | buffers | optimizer state; SHARED_GRADIENTS: grads | buffers,
                 then the optimizer step every worker takes with the same gradients
    bookkeeping  counters, score report, checkpoint, stop
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .averaging import (
    FlatAverager,
    RoundTotals,
    agree_on_optimizer_layout,
    optimizer_signature,
    optimizer_state_tensors,
    reduce_header,
    signature_hash,
)
from .config import Config, Job, NanPolicy, TrainingMode


class EndOfEpoch:
    """The sentinel a batch source returns when this worker's share of the epoch is done."""


END = EndOfEpoch()


class BatchSource(Protocol):
    def next_batch(self) -> tuple[int, Any] | EndOfEpoch:
        """(batch index in the epoch, batch) or END."""
        ...


class Phase(enum.IntEnum):
    """Where a worker is, for the supervisor's stall watchdog."""

    IDLE = 0
    WAITING = 1  # for a batch
    TRAINING = 2
    AVERAGING = 3


@dataclass
class Counters:
    """Progress over the wrapper's life; identical on every worker after each round."""

    rounds: int = 0  # averagings (SHARED_GRADIENTS: steps)
    iterations: int = 0  # batches trained, all workers
    samples: int = 0  # samples trained, all workers
    epoch: int = 0  # the epoch in progress (= epochs completed, between epochs)
    position: int = 0  # batches of `epoch` trained in completed rounds: where a resumed feed starts


@dataclass(frozen=True)
class RoundReport:
    """Rank 0's word to the main process after a round (or k steps): totals over all workers."""

    counters: Counters
    score: float  # sample-weighted mean loss over the reported rounds
    skipped: int
    at: float = dataclasses.field(default_factory=time.monotonic)  # when (system-wide clock)


@dataclass(frozen=True)
class EpochReport:
    counters: Counters
    epoch: int
    score: float  # sample-weighted mean loss of the epoch
    at: float = dataclasses.field(default_factory=time.monotonic)


Reporter = Callable[[RoundReport | EpochReport], None]


class Hooks:
    """What the loop may ask of its host. The defaults do nothing but checkpoint, when given a
    checkpointer: a torchrun worker, a test."""

    def __init__(self, checkpointer: Callable[[Replica, bool], None] | None = None) -> None:
        self._checkpointer = checkpointer

    def progress(self, phase: Phase, epoch: int, index: int, step: int) -> None:
        """Called on every change of phase (cheap: a few writes to shared memory)."""

    def stop_requested(self) -> bool:
        """True when the main process wants training to stop after the current round."""
        return False

    def checkpoint(self, replica: Replica, final: bool) -> None:
        """Called on every worker at the same rounds (a collective may run inside); `final`
        means save now (an epoch's end, a stop), else save if one is due."""
        if self._checkpointer is not None:
            self._checkpointer(replica, final)


class TrainingError(RuntimeError):
    """A worker could not train on a batch; the message names the worker, epoch and batch."""


class Stopped(Exception):
    """Training stopped early, at a round boundary, because the main process asked."""


def move_to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [move_to(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


def batch_size(batch: Any) -> int:
    """Samples in a batch: dim 0 of its first tensor."""
    for t in _tensors(batch):
        if t.dim() > 0:
            return int(t.shape[0])
        break
    raise TrainingError(f"cannot count the samples of batch {describe(batch)}: it holds no tensor with a batch dimension")


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            yield from _tensors(b)
    elif isinstance(batch, dict):
        for b in batch.values():
            yield from _tensors(b)


def describe(batch: Any) -> str:
    """A short, readable shape of a batch for error messages: (float32[128, 1, 28, 28], int64[128])."""
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if isinstance(batch, (list, tuple)):
        return "(" + ", ".join(describe(b) for b in batch) + ")"
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in batch.items()) + "}"
    return type(batch).__name__


@dataclass
class _Work:
    """One worker's local work in a round."""

    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)  # loss·n per step
    samples: int = 0
    first_step: int = 0


class Replica:
    """One worker's model and optimizer, and the round protocol."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        job: Job,
        config: Config,
        device: torch.device,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        self.model, self.optimizer, self.job, self.config = model, optimizer, job, config
        self.device, self.rank, self.world_size, self.group = device, rank, world_size, group
        self.hooks = hooks or Hooks()
        self.counters = Counters()
        self.local_steps = 0  # optimizer steps this worker has taken, for error messages
        self._payload: FlatAverager | None = None
        self._layout = 0
        self._finished = False

    # -- state ----------------------------------------------------------------------------------

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """Start from the main process's model and optimizer (every fit() starts from them)."""
        self.model.load_state_dict(model_state)
        # Every worker receives the same shared-memory tensors, and an optimizer keeps the tensors
        # it loads when they already have the right device and dtype (Adam's step is increased
        # in place): without a copy, the workers would step one shared counter.
        self.optimizer.load_state_dict(to_cpu(optimizer_state))
        self._payload = None  # the tensors were replaced

    def state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and optimizer's state on the CPU, to send to the main process."""
        return to_cpu(self.model.state_dict()), to_cpu(self.optimizer.state_dict())

    # -- one step -------------------------------------------------------------------------------

    def loss(self, batch: Any) -> torch.Tensor:
        if self.job.training_step is not None:
            return self.job.training_step(self.model, batch)
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            raise TrainingError(
                f"expected an (inputs, targets) batch, got {describe(batch)}; "
                f"for other batches use .training_step(fn) with fn(model, batch) -> loss"
            )
        inputs, targets = batch
        assert self.job.loss_fn is not None
        return self.job.loss_fn(self.model(inputs), targets)

    def forward_backward(self, index: int, epoch: int, batch: Any) -> tuple[torch.Tensor, int]:
        """Loss·n (detached, on device) and sample count n; gradients accumulated in .grad."""
        self.hooks.progress(Phase.TRAINING, epoch, index, self.local_steps)
        try:
            n = batch_size(batch)
            batch = move_to(batch, self.device)
            loss = self.loss(batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TrainingError(f"the loss must be a scalar tensor, got {describe(loss)}")
            loss.backward()  # type: ignore[no-untyped-call]
        except Exception as e:
            raise TrainingError(
                f"worker {self.rank} failed on batch {index} of epoch {epoch} {describe(batch)} "
                f"(local step {self.local_steps}): {type(e).__name__}: {e}"
            ) from e
        return loss.detach().reshape(()) * n, n

    def _next(self, epoch: int) -> tuple[int, Any] | None:
        """The next batch, or None at this worker's end of the epoch."""
        if self._finished:
            return None
        self.hooks.progress(Phase.WAITING, epoch, -1, self.local_steps)
        item = self._source.next_batch()
        if isinstance(item, EndOfEpoch):
            self._finished = True
            return None
        return item

    # -- the two modes' local work and payload ----------------------------------------------------

    def _local_steps(self, epoch: int) -> _Work:
        """AVERAGING: up to k independent steps."""
        work = _Work(first_step=self.local_steps)
        while len(work.losses) < self.config.averaging_frequency:
            item = self._next(epoch)
            if item is None:
                break
            self.optimizer.zero_grad(set_to_none=True)
            loss, n = self.forward_backward(item[0], epoch, item[1])
            self.optimizer.step()
            self.local_steps += 1
            work.losses.append(loss)
            work.samples += n
        return work

    def _one_gradient(self, epoch: int) -> _Work:
        """SHARED_GRADIENTS: one forward/backward; the step waits for the averaged gradients."""
        work = _Work(first_step=self.local_steps)
        self._gradient_payload()  # allocates zero gradients before the first backward
        self.optimizer.zero_grad(set_to_none=False)
        item = self._next(epoch)
        if item is not None:
            loss, work.samples = self.forward_backward(item[0], epoch, item[1])
            work.losses.append(loss)
        return work

    def _layout_hash(self) -> int:
        """Hash of the optimizer state layout (created lazily by the optimizer); a change drops
        the flat buffers built for the old layout."""
        if self.config.training_mode is TrainingMode.SHARED_GRADIENTS or not self.config.average_updaters:
            return 0
        layout = signature_hash(optimizer_signature(self.optimizer))
        if layout != self._layout:
            self._layout, self._payload = layout, None
        return layout

    def _state_payload(self) -> FlatAverager:
        if self._payload is None:
            tensors = list(self.model.parameters()) + list(self.model.buffers())
            if self.config.average_updaters:
                tensors += optimizer_state_tensors(self.optimizer)
            self._payload = FlatAverager(tensors, self.device)
        return self._payload

    def _gradient_payload(self) -> FlatAverager:
        if self._payload is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params if p.grad is not None]  # all of them, just allocated
            self._payload = FlatAverager(grads + list(self.model.buffers()), self.device)
        return self._payload

    def _apply(self, totals: RoundTotals, share: float) -> None:
        if self.config.training_mode is TrainingMode.AVERAGING:
            if not totals.layouts_agree:
                agree_on_optimizer_layout(self.optimizer, self.group)
                self._layout_hash()
            self._state_payload().average(share, self.group)
        else:
            self._gradient_payload().average(share, self.group)
            self.optimizer.step()  # the same averaged gradients on every worker
            self.local_steps += 1

    # -- the round protocol ---------------------------------------------------------------------

    def fit(self, until_epoch: int, source: BatchSource, report: Reporter) -> None:
        """Train from `self.counters` to the end of epoch `until_epoch - 1`."""
        self.model.train()
        self._source = source
        try:
            while self.counters.epoch < until_epoch:
                self._epoch(report)
        finally:
            self.hooks.progress(Phase.IDLE, self.counters.epoch, -1, self.local_steps)

    def _epoch(self, report: Reporter) -> None:
        epoch = self.counters.epoch
        local_work = self._local_steps if self.config.training_mode is TrainingMode.AVERAGING else self._one_gradient
        # SHARED_GRADIENTS reports every k steps, AVERAGING every averaging.
        report_every = 1 if self.config.training_mode is TrainingMode.AVERAGING else self.config.averaging_frequency
        window, whole = _Window(), _Window()  # since the last report; the whole epoch
        self._finished = False
        while True:
            work = local_work(epoch)
            loss_sum, skipped = self._checked_loss(work)
            self.hooks.progress(Phase.AVERAGING, epoch, -1, self.local_steps)
            totals = reduce_header(
                samples=0 if skipped else work.samples,
                loss_sum=0.0 if skipped else loss_sum,
                batches=len(work.losses),
                finished=self._finished,
                skipped=skipped,
                stop=self.hooks.stop_requested(),
                layout=self._layout_hash(),
                device=self.device,
                world_size=self.world_size,
                group=self.group,
            )
            if totals.samples == 0 and totals.skipped > 0:
                raise FloatingPointError(
                    f"the loss of every worker that trained in this round was non-finite ({totals.skipped} "
                    f"workers): training has diverged; lower the learning rate"
                )
            epoch_done = totals.finished == self.world_size
            if totals.samples > 0:
                self._apply(totals, 0.0 if skipped else work.samples / totals.samples)
                c = self.counters
                c.rounds, c.iterations, c.samples = c.rounds + 1, c.iterations + totals.batches, c.samples + int(totals.samples)
                c.position += totals.batches
                window.add(totals)
                whole.add(totals)
                if self.config.report_score_after_averaging and (window.rounds == report_every or epoch_done):
                    report(RoundReport(dataclasses.replace(c), window.score, window.skipped))
                    window = _Window()
            if epoch_done:
                self.counters.epoch, self.counters.position = epoch + 1, 0
                report(EpochReport(dataclasses.replace(self.counters), epoch, whole.score))
                self.hooks.checkpoint(self, final=True)
            elif totals.samples > 0 or totals.stop:
                self.hooks.checkpoint(self, final=totals.stop > 0)
            if totals.stop:
                raise Stopped(f"stopped at round {self.counters.rounds}, as the main process asked")
            if epoch_done:
                return

    def _checked_loss(self, work: _Work) -> tuple[float, bool]:
        """Σ loss·n of the round, one device sync per round; applies the NaN policy."""
        if not work.losses:
            return 0.0, False
        stacked = torch.stack(work.losses)  # (steps,)
        total = float(stacked.sum())
        if math.isfinite(total):
            return total, False
        if self.config.nan_policy is NanPolicy.SKIP:
            return 0.0, True
        bad = int((~torch.isfinite(stacked)).nonzero()[0])
        raise FloatingPointError(
            f"worker {self.rank}: loss is {float(stacked[bad])} at local step {work.first_step + bad} "
            f"(epoch {self.counters.epoch}); lower the learning rate, or use .nan_policy('skip') to drop "
            f"such a worker from its round"
        )


@dataclass
class _Window:
    """Totals of a run of rounds: since the last score report, or over an epoch."""

    rounds: int = 0
    loss_sum: float = 0.0
    samples: int = 0
    skipped: int = 0

    def add(self, totals: RoundTotals) -> None:
        self.rounds += 1
        self.loss_sum += totals.loss_sum
        self.samples += int(totals.samples)
        self.skipped += totals.skipped

    @property
    def score(self) -> float:
        return _mean(self.loss_sum, self.samples)


def _mean(total: float, count: int) -> float:
    return total / count if count else float("nan")


def to_cpu(state: Any) -> Any:
    """A deep copy with every tensor on the CPU (clones: the sender keeps training on its own)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [to_cpu(v) for v in state]
    return state
