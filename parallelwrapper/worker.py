"""One worker's training loop: pull batches, step, and run the round protocol of DESIGN.md.

The same loop runs in a spawned worker process (batches from the shared queue) and in a torchrun
process (batches from its own shard); it sees a `BatchSource` and a `Reporter`, never a queue.
"""

from __future__ import annotations

import math
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


@dataclass(frozen=True)
class RoundReport:
    """What rank 0 tells the main process after a round: totals over all workers."""

    epoch: int
    rounds: int  # averagings (or gradient steps) so far in this epoch, this one included
    batches: int  # batches trained in this round, all workers
    samples: int
    score: float  # sample-weighted mean loss of the round
    skipped: int


@dataclass(frozen=True)
class EpochReport:
    epoch: int
    rounds: int
    batches: int
    samples: int
    score: float  # sample-weighted mean loss of the epoch


Reporter = Callable[[RoundReport | EpochReport], None]


class TrainingError(RuntimeError):
    """A worker could not train on a batch; the message names the worker, epoch and batch."""


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
        if t.dim() == 0:
            break
        return int(t.shape[0])
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


class Replica:
    """One worker's model and optimizer, and how to take a step on a batch."""

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
    ) -> None:
        self.model, self.optimizer, self.job, self.config = model, optimizer, job, config
        self.device, self.rank, self.world_size, self.group = device, rank, world_size, group
        self.local_steps = 0  # optimizer steps this worker has taken, for error messages
        self._state_averager: FlatAverager | None = None
        self._grad_averager: FlatAverager | None = None
        self._layout = 0

    # -- state ---------------------------------------------------------------------------------

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """Start from the main process's model and optimizer (every fit() starts from them)."""
        self.model.load_state_dict(model_state)
        # Every worker receives the same shared-memory tensors, and an optimizer keeps the tensors
        # it loads when they already have the right device and dtype (Adam's step is increased
        # in place): without a copy, the workers would step one shared counter.
        self.optimizer.load_state_dict(_to_cpu(optimizer_state))
        self._state_averager = self._grad_averager = None  # the tensors were replaced

    def state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and optimizer's state on the CPU, to send to the main process."""
        return _to_cpu(self.model.state_dict()), _to_cpu(self.optimizer.state_dict())

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
        """Loss (detached, on device) and sample count; gradients accumulated in .grad."""
        try:
            n = batch_size(batch)
            batch = move_to(batch, self.device)
            loss = self.loss(batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TrainingError(f"the loss must be a scalar tensor, got {describe(loss)}")
            loss.backward()
        except Exception as e:
            raise TrainingError(
                f"worker {self.rank} failed on batch {index} of epoch {epoch} {describe(batch)} "
                f"(local step {self.local_steps}): {type(e).__name__}: {e}"
            ) from e
        return loss.detach().reshape(()), n

    # -- AVERAGING ------------------------------------------------------------------------------

    def _averager(self) -> FlatAverager:
        if self._state_averager is None:
            tensors = list(self.model.parameters()) + list(self.model.buffers())
            if self.config.average_updaters:
                tensors += optimizer_state_tensors(self.optimizer)
            self._state_averager = FlatAverager(tensors, self.device)
        return self._state_averager

    def _check_layout(self) -> int:
        """Hash of the optimizer state layout; a change drops the averager built for the old one."""
        if not self.config.average_updaters:
            return 0
        layout = signature_hash(optimizer_signature(self.optimizer))
        if layout != self._layout:
            self._layout, self._state_averager = layout, None
        return layout

    def train_epoch(self, epoch: int, source: BatchSource, report: Reporter) -> EpochReport:
        """AVERAGING: rounds of up to k local steps, each ending in one averaging."""
        k = self.config.averaging_frequency
        finished = False
        rounds = epoch_batches = epoch_samples = 0
        epoch_loss = 0.0
        while True:
            losses: list[torch.Tensor] = []
            samples = 0
            first_step = self.local_steps
            while not finished and len(losses) < k:
                item = source.next_batch()
                if isinstance(item, EndOfEpoch):
                    finished = True
                    break
                index, batch = item
                self.optimizer.zero_grad(set_to_none=True)
                loss, n = self.forward_backward(index, epoch, batch)
                self.optimizer.step()
                self.local_steps += 1
                losses.append(loss * n)
                samples += n
            loss_sum, skipped = self._checked_loss(losses, first_step)
            totals = reduce_header(
                samples=0 if skipped else samples,
                loss_sum=0.0 if skipped else loss_sum,
                batches=len(losses),
                finished=finished,
                skipped=skipped,
                layout=self._check_layout(),
                device=self.device,
                world_size=self.world_size,
                group=self.group,
            )
            _check_not_all_skipped(totals)
            if totals.samples > 0:
                if not totals.layouts_agree:
                    agree_on_optimizer_layout(self.optimizer, self.group)
                    self._check_layout()
                share = 0.0 if skipped else samples / totals.samples
                self._averager().average(share, self.group)
                rounds += 1
                epoch_batches += totals.batches
                epoch_samples += int(totals.samples)
                epoch_loss += totals.loss_sum
                if self.config.report_score_after_averaging:
                    report(RoundReport(epoch, rounds, totals.batches, int(totals.samples), totals.score, totals.skipped))
            if totals.finished == self.world_size:
                break
        summary = EpochReport(epoch, rounds, epoch_batches, epoch_samples, _mean(epoch_loss, epoch_samples))
        report(summary)
        return summary

    def _checked_loss(self, losses: list[torch.Tensor], first_step: int) -> tuple[float, bool]:
        """Σ loss·n of the round, one device sync per round; applies the NaN policy."""
        if not losses:
            return 0.0, False
        stacked = torch.stack(losses)  # (steps,)
        total = float(stacked.sum())
        if math.isfinite(total):
            return total, False
        bad = int((~torch.isfinite(stacked)).nonzero()[0])
        if self.config.nan_policy is NanPolicy.SKIP:
            return 0.0, True
        raise FloatingPointError(
            f"worker {self.rank}: loss is {float(stacked[bad])} at local step {first_step + bad}; "
            f"lower the learning rate, or use .nan_policy('skip') to drop such a worker from its round"
        )

    # -- SHARED_GRADIENTS -----------------------------------------------------------------------

    def _gradients(self) -> FlatAverager:
        if self._grad_averager is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._grad_averager = FlatAverager([p.grad for p in params] + list(self.model.buffers()), self.device)
        return self._grad_averager

    def train_epoch_shared_gradients(self, epoch: int, source: BatchSource, report: Reporter) -> EpochReport:
        """SHARED_GRADIENTS: every step reduces sample-weighted gradients (and buffers); every
        worker applies the same average, so replicas stay equal without averaging state."""
        k = self.config.averaging_frequency
        grads = self._gradients()
        finished = False
        steps = epoch_batches = epoch_samples = 0
        epoch_loss = window_loss = 0.0
        window_batches = window_samples = window_skipped = 0
        while True:
            self.optimizer.zero_grad(set_to_none=False)
            losses: list[torch.Tensor] = []
            n = 0
            if not finished:
                item = source.next_batch()
                if isinstance(item, EndOfEpoch):
                    finished = True
                else:
                    loss, n = self.forward_backward(item[0], epoch, item[1])
                    losses.append(loss * n)
            loss_sum, skipped = self._checked_loss(losses, self.local_steps)
            totals = reduce_header(
                samples=0 if skipped else n,
                loss_sum=0.0 if skipped else loss_sum,
                batches=len(losses),
                finished=finished,
                skipped=skipped,
                layout=0,
                device=self.device,
                world_size=self.world_size,
                group=self.group,
            )
            _check_not_all_skipped(totals)
            if totals.samples > 0:
                grads.average(0.0 if skipped else n / totals.samples, self.group)
                self.optimizer.step()
                self.local_steps += 1
                steps += 1
                epoch_batches += totals.batches
                epoch_samples += int(totals.samples)
                epoch_loss += totals.loss_sum
                window_loss += totals.loss_sum
                window_batches += totals.batches
                window_samples += int(totals.samples)
                window_skipped += totals.skipped
            done = totals.finished == self.world_size
            if self.config.report_score_after_averaging and window_samples and (steps % k == 0 or done):
                score = _mean(window_loss, window_samples)
                report(RoundReport(epoch, steps, window_batches, window_samples, score, window_skipped))
                window_loss, window_batches, window_samples, window_skipped = 0.0, 0, 0, 0
            if done:
                break
        summary = EpochReport(epoch, steps, epoch_batches, epoch_samples, _mean(epoch_loss, epoch_samples))
        report(summary)
        return summary

    def fit(self, epochs: int, first_epoch: int, source: BatchSource, report: Reporter) -> None:
        self.model.train()
        run = (
            self.train_epoch
            if self.config.training_mode is TrainingMode.AVERAGING
            else self.train_epoch_shared_gradients
        )
        for epoch in range(first_epoch, first_epoch + epochs):
            run(epoch, source, report)


def _check_not_all_skipped(totals: RoundTotals) -> None:
    if totals.samples == 0 and totals.skipped > 0:
        raise FloatingPointError(
            f"the loss of every worker that trained in this round was non-finite ({totals.skipped} workers); "
            f"training has diverged: lower the learning rate"
        )


def _mean(total: float, count: int) -> float:
    return total / count if count else float("nan")



def _to_cpu(state: Any) -> Any:
    """A deep copy with every tensor on the CPU (clones: the sender keeps training on its own)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_cpu(v) for v in state]
    return state
