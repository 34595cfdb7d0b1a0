"""One worker's training loop: pull batches, step, and run the round protocol of DESIGN.md.

The same loop runs in a spawned worker process (batches from the shared queue) and in a torchrun
process (batches from its own shard); it sees a `BatchSource`, a `Reporter` and `Hooks`, never a
queue or a file.

A round, in both modes:
    local work   AVERAGING: up to k steps; SHARED_GRADIENTS: one forward/backward
    payload      AVERAGING: params | buffers | optimizer state; SHARED_GRADIENTS: grads | buffers,
                 one all-reduce per dtype, with the header (samples, loss, finished and stop
                 flags) in the first; SHARED_GRADIENTS then steps with the same gradients
    bookkeeping  counters, score report, checkpoint, stop

With overlap_averaging (AVERAGING only), a round's payload is sent without waiting and lands after
the next round's steps, which are kept on top of the average (_overlapped_epoch).
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
    DeltaAverager,
    FlatAverager,
    RoundTotals,
    agree_on_optimizer_layout,
    make_header,
    optimizer_signature,
    optimizer_state_tensors,
    read_header,
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


class Budget(Protocol):
    """How many batches a round may have in all (feed.RoundBudget), when not k per worker."""

    def take(self, round_index: int) -> bool: ...

    def untake(self, round_index: int) -> None: ...

    def landed(self, round_index: int) -> None: ...


class Checkpointing(Protocol):
    def __call__(self, replica: Replica, final: bool) -> None: ...

    def due(self, rounds: int) -> bool: ...


class Hooks:
    """What the loop may ask of its host. The defaults do nothing but checkpoint, when given a
    checkpointer: a torchrun worker, a test."""

    def __init__(self, checkpointer: Checkpointing | None = None) -> None:
        self._checkpointer = checkpointer

    def progress(self, phase: Phase, epoch: int, index: int, step: int) -> None:
        """Called on every change of phase (cheap: a few writes to shared memory)."""

    def stop_requested(self) -> bool:
        """True when the main process wants training to stop after the current round."""
        return False

    def checkpoint_due(self, rounds: int) -> bool:
        """Whether a periodic checkpoint falls at the end of round number `rounds`."""
        return self._checkpointer is not None and self._checkpointer.due(rounds)

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
        budget: Budget | None = None,
    ) -> None:
        self.model, self.optimizer, self.job, self.config = model, optimizer, job, config
        self.device, self.rank, self.world_size, self.group = device, rank, world_size, group
        self.hooks = hooks or Hooks()
        self._budget = budget  # overlap_averaging, first-come feed: N·k batches a round in all
        self._round = 0  # rounds launched in this fit(), the same count on every worker
        self.counters = Counters()
        self.local_steps = 0  # optimizer steps this worker has taken, for error messages
        self._payload: FlatAverager | None = None
        self._delta: DeltaAverager | None = None  # overlap_averaging's buffers
        # Σw of the last round that trained, the same on every worker: the payload goes out with
        # the header, pre-scaled by w / _reference, on the guess that this round's Σw is the same.
        self._reference = 0.0
        self._finished = False
        self._ahead: tuple[int, Any] | None = None  # a batch taken, not yet trained

    # -- state ----------------------------------------------------------------------------------

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """Start from the main process's model and optimizer (every fit() starts from them)."""
        self.model.load_state_dict(model_state)
        # Every worker receives the same shared-memory tensors, and an optimizer keeps the tensors
        # it loads when they already have the right device and dtype (Adam's step is increased
        # in place): without a copy, the workers would step one shared counter.
        self.optimizer.load_state_dict(to_cpu(optimizer_state))
        self._payload = self._delta = None  # the tensors were replaced
        self._reference = 0.0

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

    def _next(self, epoch: int, round_index: int) -> tuple[int, Any] | None:
        """The next batch, or None at this worker's end of the epoch or, with a budget, when
        round `round_index` has all its batches. A batch is counted against the round it is
        taken for (a batch looked ahead at, against the next); the end of the epoch is not, or
        the next epoch's first round would have a batch less."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            return ahead
        if self._finished or (self._budget is not None and not self._budget.take(round_index)):
            return None
        self.hooks.progress(Phase.WAITING, epoch, -1, self.local_steps)
        item = self._source.next_batch()
        if isinstance(item, EndOfEpoch):
            self._finished = True
            if self._budget is not None:
                self._budget.untake(round_index)
            return None
        return item

    # -- the two modes' local work and payload ----------------------------------------------------

    def _local_steps(self, epoch: int) -> _Work:
        """AVERAGING: up to k independent steps."""
        work = _Work(first_step=self.local_steps)
        most = self.config.averaging_frequency if self._budget is None else math.inf  # else: what the round has
        while len(work.losses) < most:
            item = self._next(epoch, self._round)
            if item is None:
                break
            self.optimizer.zero_grad(set_to_none=True)
            loss, n = self.forward_backward(item[0], epoch, item[1])
            self.optimizer.step()
            self.local_steps += 1
            work.losses.append(loss)
            work.samples += n
        self._look_ahead(epoch, work)
        return work

    def _look_ahead(self, epoch: int, work: _Work) -> None:
        """Take the next batch now, so that the round that trains a worker's last batch already
        says it has finished: the epoch then ends with that round, without one more round whose
        payload (zeros) would cross the network."""
        if work.losses:
            self._ahead = self._next(epoch, self._round + 1)

    def _one_gradient(self, epoch: int) -> _Work:
        """SHARED_GRADIENTS: one forward/backward; the step waits for the averaged gradients."""
        work = _Work(first_step=self.local_steps)
        self._gradient_payload()  # allocates zero gradients before the first backward
        self.optimizer.zero_grad(set_to_none=False)
        item = self._next(epoch, self._round)
        if item is not None:
            loss, work.samples = self.forward_backward(item[0], epoch, item[1])
            work.losses.append(loss)
        self._look_ahead(epoch, work)
        return work

    def _layout_hash(self) -> int:
        """Hash of the optimizer state layout (created lazily by the optimizer)."""
        if self.config.training_mode is TrainingMode.SHARED_GRADIENTS or not self.config.average_updaters:
            return 0
        return signature_hash(optimizer_signature(self.optimizer))

    def _layout_to_send(self, built: int | None) -> int | None:
        """The layout hash for the header, or None (stale) when the optimizer has created state
        since the buffers in use were built for layout `built` (None: no buffers yet): every
        worker then learns that the layout must be agreed again."""
        layout = self._layout_hash()
        return None if built is not None and layout != built else layout

    def _averaged_tensors(self) -> list[torch.Tensor]:
        """AVERAGING's state: params | buffers | optimizer state (with average_updaters)."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        if self.config.average_updaters:
            tensors += optimizer_state_tensors(self.optimizer)
        return tensors

    def _gradient_payload(self) -> FlatAverager:
        if self._payload is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params if p.grad is not None]  # all of them, just allocated
            self._payload = FlatAverager(grads + list(self.model.buffers()), self.device)
        return self._payload

    # -- the round protocol ---------------------------------------------------------------------

    def fit(self, until_epoch: int, source: BatchSource, report: Reporter) -> None:
        """Train from `self.counters` to the end of epoch `until_epoch - 1`."""
        self.model.train()
        self._source, self._ahead = source, None  # a batch looked ahead at before a stop is not trained
        self._round = 0
        try:
            while self.counters.epoch < until_epoch:
                self._epoch(report)
        finally:
            if self._payload is not None:  # between fits, the model's tensors own their storage
                self._payload.release()
                self._payload = None
            self.hooks.progress(Phase.IDLE, self.counters.epoch, -1, self.local_steps)

    def _epoch(self, report: Reporter) -> None:
        epoch = self.counters.epoch
        # SHARED_GRADIENTS reports every k steps, AVERAGING every averaging.
        book = _Book(
            report,
            every=1 if self.config.training_mode is TrainingMode.AVERAGING else self.config.averaging_frequency,
            rounds=self.config.report_score_after_averaging,
        )
        self._finished = False
        if self.config.overlap_averaging:
            self._overlapped_epoch(epoch, book)
            return
        local_work = self._local_steps if self.config.training_mode is TrainingMode.AVERAGING else self._one_gradient
        while True:
            work = local_work(epoch)
            if self._synchronous_round(epoch, work, book):
                return

    def _synchronous_round(self, epoch: int, work: _Work, book: _Book) -> bool:
        """Header and payload, then bookkeeping; True at the epoch's end."""
        loss_sum, skipped = self._checked_loss(work)
        self.hooks.progress(Phase.AVERAGING, epoch, -1, self.local_steps)
        totals = self._exchange(work, loss_sum, skipped)
        epoch_done = self._settle(totals, book)
        self._after_landing(totals, epoch_done)
        return epoch_done

    def _exchange(self, work: _Work, loss_sum: float, skipped: bool) -> RoundTotals:
        """One round's payload and header; every replica ends it holding the average.

        Once the buffers exist and a round has trained, the header rides in the payload: one
        all-reduce per dtype, sent without waiting for anyone's Σw. The payload is pre-scaled by
        w / _reference, the last round's Σw (the same on every worker); when this round's Σw is
        the same, as it is but at an epoch's end, the sum is the average, so a round costs no pass
        over memory but the one that scales it; otherwise one more scales it by _reference / Σw.
        A worker that did not train sends zeros; when nobody did, every worker drops the sums.

        The first round of a fit() sends the header alone and builds the buffers. Their layout
        changes only when every worker knows it must: after a round where some worker's optimizer
        had created state they lack; then all agree on the new layout and average it all again.
        """
        payload = self._gradient_payload() if self.config.training_mode is TrainingMode.SHARED_GRADIENTS else self._payload
        layout_sent = self._layout_to_send(None if payload is None else payload.layout)
        header = make_header(layout=layout_sent, **self._header_fields(work, loss_sum, skipped))
        weight = 0.0 if skipped else float(work.samples)
        if payload is not None and self._reference > 0:
            reference = self._reference
            payload.send(weight / reference, header, self.group)
            totals = read_header(payload.wait(), layout_sent, self.world_size)
        else:
            totals = read_header(reduce_header(header, self.device, self.group), layout_sent, self.world_size)
            reference = totals.samples
            if payload is not None and totals.samples > 0:
                payload.send(weight / reference, group=self.group)
                payload.wait()
        if totals.samples == 0:
            self._check_diverged(totals)
            return totals
        if payload is not None:
            payload.apply(reference / totals.samples)
        if self.config.training_mode is TrainingMode.SHARED_GRADIENTS:
            self.optimizer.step()  # the same averaged gradients on every worker
            self.local_steps += 1
        elif payload is None or not totals.layouts_agree:
            if not totals.layouts_agree:
                agree_on_optimizer_layout(self.optimizer, self.group)
            self._payload = FlatAverager(self._averaged_tensors(), self.device, self._layout_hash())
            self._payload.average(weight / totals.samples, self.group)
        self._reference = totals.samples
        return totals

    def _after_landing(self, totals: RoundTotals, epoch_done: bool) -> None:
        """After a round every replica holds the average of: checkpoint (when due, or at an
        epoch's end or a stop), then stop if asked."""
        if epoch_done or totals.samples > 0 or totals.stop:
            self.hooks.checkpoint(self, final=epoch_done or totals.stop > 0)
        if totals.stop:
            raise Stopped(f"stopped at round {self.counters.rounds}, as the main process asked")

    def _overlapped_epoch(self, epoch: int, book: _Book) -> None:
        """Rounds whose averaging runs while the next round's steps are taken.

        Round r's header and payload go out together after r's steps, without waiting; they land
        (DeltaAverager.land) after round r + 1's steps, and r + 1 goes out. Every worker sends the
        same collectives in the same order; only when it waits differs. When the totals of a
        landed round ask for a stop, or a checkpoint falls due, the next round lands at once:
        nobody steps in between, so every replica lands exactly on the average. The epoch ends
        the same way: when every worker had finished in the landed round, nobody stepped since.
        """
        if self._delta is None:  # every replica holds the same state here: fit() or an epoch starts
            self._delta = DeltaAverager(self._averaged_tensors(), self.device, self._layout_hash())
        in_flight: _InFlight | None = None
        while True:
            work = self._local_steps(epoch)
            loss_sum, skipped = self._checked_loss(work)
            self.hooks.progress(Phase.AVERAGING, epoch, -1, self.local_steps)
            land_now = False
            if in_flight is not None:
                totals = self._land(in_flight, skipped)
                in_flight = None
                if self._settle(totals, book):
                    self._after_landing(totals, epoch_done=True)
                    return
                land_now = totals.stop > 0 or self.hooks.checkpoint_due(self.counters.rounds + 1)
            in_flight = self._launch(work, loss_sum, skipped)
            if land_now:
                totals = self._land(in_flight, skipped)
                in_flight = None
                epoch_done = self._settle(totals, book)
                self._after_landing(totals, epoch_done)
                if epoch_done:
                    return

    def _launch(self, work: _Work, loss_sum: float, skipped: bool) -> _InFlight:
        """Send this round's payload, with its header; do not wait."""
        assert self._delta is not None
        sent = self._layout_to_send(self._delta.layout)
        weight = 0.0 if skipped else float(work.samples)
        self._delta.launch(weight, make_header(layout=sent, **self._header_fields(work, loss_sum, skipped)), self.group)
        self._round += 1
        return _InFlight(sent, weight, skipped, self.local_steps, self._round - 1)

    def _land(self, in_flight: _InFlight, skipped_since: bool) -> RoundTotals:
        """Wait for a launched round and move the state by its average (DeltaAverager.land).

        A worker adopts the average outright when its progress since is worthless (a non-finite
        loss then or since) or nil (no step since). When some worker's optimizer created state
        the buffers lack, the buffers still matched (they keep their layout), so the average
        applies; then every worker agrees on the new layout and averages it all once, at once.
        """
        assert self._delta is not None
        totals = read_header(self._delta.wait(), in_flight.layout, self.world_size)
        if self._budget is not None:
            self._budget.landed(in_flight.round_index)
        self._check_diverged(totals)
        worthless = in_flight.skipped or skipped_since
        self._delta.land(totals.samples, adopt=worthless or self.local_steps == in_flight.local_steps)
        if not totals.layouts_agree:
            agree_on_optimizer_layout(self.optimizer, self.group)
            share = in_flight.weight / totals.samples if totals.samples > 0 else 1.0 / self.world_size
            layout = self._layout_hash()
            self._payload = FlatAverager(self._averaged_tensors(), self.device, layout)  # released after fit()
            self._payload.average(0.0 if worthless else share, self.group)
            self._delta = DeltaAverager(self._averaged_tensors(), self.device, layout)
        return totals

    def _header_fields(self, work: _Work, loss_sum: float, skipped: bool) -> dict[str, Any]:
        return {
            "samples": 0 if skipped else work.samples,
            "loss_sum": 0.0 if skipped else loss_sum,
            "batches": len(work.losses),
            "finished": self._finished,
            "skipped": skipped,
            "stop": self.hooks.stop_requested(),
        }

    def _check_diverged(self, totals: RoundTotals) -> None:
        if totals.samples == 0 and totals.skipped > 0:
            raise FloatingPointError(
                f"the loss of every worker that trained in this round was non-finite ({totals.skipped} "
                f"workers): training has diverged; lower the learning rate"
            )

    def _settle(self, totals: RoundTotals, book: _Book) -> bool:
        """Counters and score reports for a round's totals; True when it ended the epoch."""
        epoch_done = totals.finished == self.world_size
        c = self.counters
        if totals.samples > 0:
            c.rounds, c.iterations, c.samples = c.rounds + 1, c.iterations + totals.batches, c.samples + int(totals.samples)
            c.position += totals.batches
            book.add(totals, c, end_of_epoch=epoch_done)
        if epoch_done:
            c.epoch, c.position = c.epoch + 1, 0
            book.report(EpochReport(dataclasses.replace(c), c.epoch - 1, book.whole.score))
        return epoch_done

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


class _Book:
    """The score windows of an epoch and the reports they make."""

    def __init__(self, report: Reporter, every: int, rounds: bool) -> None:
        self.report, self._every, self._rounds = report, every, rounds
        self.window, self.whole = _Window(), _Window()  # since the last report; the whole epoch

    def add(self, totals: RoundTotals, counters: Counters, end_of_epoch: bool) -> None:
        self.window.add(totals)
        self.whole.add(totals)
        if self._rounds and (self.window.rounds == self._every or end_of_epoch):
            self.report(RoundReport(dataclasses.replace(counters), self.window.score, self.window.skipped))
            self.window = _Window()


@dataclass
class _InFlight:
    """A launched round of the overlapped protocol, still being summed."""

    layout: int | None  # as sent
    weight: float  # this worker's weight in the payload
    skipped: bool  # this worker's contribution was dropped: its state is not worth keeping
    local_steps: int  # Replica.local_steps at the launch
    round_index: int  # Replica._round of the round launched


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
