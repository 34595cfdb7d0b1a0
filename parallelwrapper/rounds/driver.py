"""The drivers of the round protocol: one worker's side of a synchronous or an overlapped round,
from its local work to the bookkeeping after the average lands (see the package's docstring)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..averaging import DeltaAverager, FlatAverager, Shards, agree_on_optimizer_layout, all_reduce_values
from ..config import Config, TrainingMode
from ..types import BatchSource, Counters, EpochReport, Hooks, Phase, Reporter, Stopped
from .cut import RoundCut
from .header import HEADER_LEN, RoundTotals, make_header, read_header
from .node import Node, NodeSteps
from .state import averaged_tensors, gradient_tensors, state_layout
from .scores import ScoreBook, validate
from .trainer import Trainer


class _EarlyStop(Exception):
    """Early stopping's verdict, the same on every worker after the same round."""


@dataclass
class _Work:
    """One worker's local work in a round."""

    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)  # loss·n per step
    samples: int = 0
    batches: int = 0
    first_step: int = 0
    loss_sum: float = 0.0
    skipped: bool = False  # dropped by the NaN policy
    finished: bool = False  # this worker (with a hierarchy: its node) has no batch left in the epoch

    @property
    def weight(self) -> float:
        return 0.0 if self.skipped else float(self.samples)


@dataclass
class _InFlight:
    """A launched round of the overlapped protocol, still being summed."""

    layout: int | None  # as sent
    weight: float  # this worker's weight in the payload
    skipped: bool  # this worker's contribution was dropped: its state is not worth keeping
    local_steps: int  # Trainer.local_steps at the launch


class Rounds:
    """One worker's side of the round protocol over a process group (None: the default group)."""

    def __init__(
        self,
        trainer: Trainer,
        config: Config,
        device: torch.device,
        rank: int,
        world_size: int,
        *,
        group: dist.ProcessGroup | None,
        hooks: Hooks,
        node: Node | None = None,
    ) -> None:
        self.trainer, self.config, self.device, self.hooks = trainer, config, device, hooks
        self.rank, self.world_size, self.group = rank, world_size, group  # with a node: one rank per node
        self._node = None if node is None else NodeSteps(node, trainer, device)
        self._shards = None if node is None else Shards(node.group, node.size, node.index)  # the state, across nodes
        self.counters = Counters()
        self._averages_state = config.training_mode is TrainingMode.AVERAGING  # after any warm-up
        self._gradients_in_payload = False  # the payload holds gradients (SHARED_GRADIENTS, a warm-up)
        self._payload: FlatAverager | None = None
        self._payload_layout: int | None = None  # the state layout the payload was built for
        self._delta: DeltaAverager | None = None  # overlap_averaging's buffers ...
        self._delta_layout = 0  # ... and their layout
        self._reference = 0.0  # Σw of the last round that trained, the same on every worker
        self.seq = 0  # rounds started over this worker's life, the same on every worker: Hooks' tags
        self._cut = RoundCut(world_size * (1 if node is None else node.size))  # which batches each round trains, and their steps

    @property
    def _averaging(self) -> bool:
        """This round averages the state, not the gradients: AVERAGING, once the warm-up's
        `warmup_sync_steps` synchronous steps (rounds, over the wrapper's life) are done."""
        return self._averages_state and self.counters.rounds >= self.config.warmup_sync_steps

    def reset(self) -> None:
        """The trainer's tensors were replaced (a fit() loads new state): build buffers afresh."""
        self._payload = self._delta = None
        self._gradients_in_payload, self._reference = False, 0.0

    def run(self, until_epoch: int, source: BatchSource, report: Reporter) -> None:
        """Train from `self.counters` to the end of epoch `until_epoch - 1`."""
        self._cut.fit_starts(source)
        try:
            while self.counters.epoch < until_epoch:
                self._epoch(report)
        except _EarlyStop:
            pass  # every worker stopped after the same round: the fit ends there, normally
        finally:
            if self._payload is not None:  # between fits, the model's tensors own their storage
                self._payload.release()
                self._payload, self._gradients_in_payload = None, False
            if self._node is not None:
                self._node.release()
            self.hooks.progress(Phase.IDLE, self.counters.epoch, -1, self.trainer.local_steps)

    def _epoch(self, report: Reporter) -> None:
        # SHARED_GRADIENTS reports every k steps, AVERAGING every averaging.
        every = 1 if self._averaging else self.config.averaging_frequency
        book = ScoreBook(report, every, self.config.report_score_after_averaging)
        self._cut.epoch_starts(self.counters)
        if self.config.overlap_averaging:
            self._overlapped_epoch(book)
            return
        while True:
            work = self._local_work()
            totals = self._exchange(work)
            epoch_done = self._settle(totals, book)
            self._after_landing(totals, epoch_done, book)
            if epoch_done:
                return

    # -- local work ------------------------------------------------------------------------------

    def _next(self) -> tuple[int, Any] | None:
        """The round's next batch for this worker (cut.py), or None."""

        def waiting() -> None:
            self.hooks.progress(Phase.WAITING, self.counters.epoch, -1, self.trainer.local_steps)

        return self._cut.next(waiting, lambda later: self.hooks.took_ahead(self.seq + later))

    def _batches_per_round(self) -> int:
        """AVERAGING: k for every rank; SHARED_GRADIENTS (and a warm-up): one each."""
        return self._cut.ranks * (self.config.averaging_frequency if self._averaging else 1)

    def _local_work(self) -> _Work:
        """AVERAGING: an independent step on each of this worker's batches of the round (k, or
        with the first-come feed as many as it takes first). SHARED_GRADIENTS: one
        forward/backward; the step waits for the averaged gradients."""
        epoch, trainer = self.counters.epoch, self.trainer
        self.seq += 1
        self._cut.round_starts(self._batches_per_round())
        self.hooks.round_starts(self.seq, epoch, self._cut.finished)
        work = _Work(first_step=trainer.local_steps)
        if self._averaging and self._gradients_in_payload:  # the warm-up is over: seamlessly, at a round's start
            assert self._payload is not None
            self._payload.release()
            self._payload, self._gradients_in_payload = None, False
        if self._averaging and self._node is not None:
            return self._node_work(work)
        if self._averaging:
            most, step = math.inf, trainer.train_step
        else:
            self._gradient_payload()  # allocates zero gradients before the first backward
            trainer.optimizer.zero_grad(set_to_none=False)
            most, step = 1, trainer.accumulate
        while len(work.losses) < most:
            item = self._next()
            if item is None:
                break
            if self._averaging:
                trainer.at_step(self._cut.step_of(item[0]))
            loss, n = step(epoch, *item)
            work.losses.append(loss)
            work.samples, work.batches = work.samples + n, work.batches + 1
        work.loss_sum, work.skipped = trainer.checked_loss(work.losses, work.first_step, epoch)
        work.finished = self._cut.finished
        self.hooks.progress(Phase.AVERAGING, epoch, -1, trainer.local_steps)
        return work

    def _node_work(self, work: _Work) -> _Work:
        """With a hierarchy: k lockstep steps with the node's other ranks (node.py); the work is
        the node's. The round after a node's last batch finds it finished."""
        assert self._node is not None
        first = self._cut.step_of(self._cut.start)
        node = self._node.run(self.config.averaging_frequency, first, self.counters.epoch, self._next, lambda: self._cut.finished)
        work.samples, work.batches, work.finished = node.samples, node.batches, node.finished
        loss = [torch.tensor(node.loss_sum)] if node.batches else []
        work.loss_sum, work.skipped = self.trainer.checked_loss(loss, work.first_step, self.counters.epoch)
        self.hooks.progress(Phase.AVERAGING, self.counters.epoch, -1, self.trainer.local_steps)
        return work

    # -- payloads and headers --------------------------------------------------------------------

    def _layout(self) -> int:
        return state_layout(self.trainer.optimizer, self.config.average_updaters) if self._averaging else 0

    def _header(self, work: _Work, built: int | None) -> tuple[list[float], int | None]:
        """The round's header, and the layout it declares: stale (None) when the optimizer has
        created state since the buffers in use were built for layout `built` (None: no buffers
        yet), so that every worker learns that the layout must be agreed again."""
        layout: int | None = self._layout()
        if built is not None and layout != built:
            layout = None
        header = make_header(
            samples=0 if work.skipped else work.samples,
            loss_sum=0.0 if work.skipped else work.loss_sum,
            batches=work.batches,
            finished=work.finished,
            skipped=work.skipped,
            stop=self.hooks.stop_requested(),
            layout=layout,
        )
        return header, layout

    def _averaged_tensors(self) -> list[torch.Tensor]:
        return averaged_tensors(self.trainer.model, self.trainer.optimizer, self.config.average_updaters)

    def _gradient_payload(self) -> FlatAverager:
        if self._payload is None:
            self._payload = FlatAverager(gradient_tensors(self.trainer.model), self.device, HEADER_LEN)
            self._payload_layout, self._gradients_in_payload = 0, True
        return self._payload

    def _average_anew(self, share: float, agree: bool) -> None:
        """Build the payload and average all of the state at once: on the first round of a fit(),
        and after a round whose layouts disagreed (some optimizer created state the buffers lack),
        where every worker first takes the union of the layouts (`agree`)."""
        if agree and self.config.average_updaters:  # else only the still groups changed
            agree_on_optimizer_layout(self.trainer.optimizer, self.group)
        self._payload_layout = self._layout()
        self._payload = FlatAverager(self._averaged_tensors(), self.device, HEADER_LEN, self.config.wire_dtype, self._shards)  # released after fit()
        self._payload.average(share, self.group)

    def _exchange(self, work: _Work) -> RoundTotals:
        """One synchronous round's header and payload; every replica ends it holding the average
        (SHARED_GRADIENTS: the averaged gradients, then its step).

        Once the buffers exist and a round has trained, the header rides in the payload's trailer,
        pre-scaled by w / _reference; else the header goes alone, then the payload when anyone
        trained. A worker that did not train sends zeros; when nobody did, every worker drops the
        sums. The first round of a fit() builds the buffers, averaging as it does so."""
        payload = self._payload if self._averaging else self._gradient_payload()
        header, layout = self._header(work, None if payload is None else self._payload_layout)
        if payload is not None and self._reference > 0:
            reference = self._reference
            payload.send(work.weight / reference, header, self.group)
            totals = read_header(payload.wait(), layout, self.world_size)
        else:
            totals = read_header(all_reduce_values(header, self.device, self.group), layout, self.world_size)
            reference = totals.samples
            if payload is not None and totals.samples > 0:
                payload.send(work.weight / reference, group=self.group)
                payload.wait()
        if totals.samples == 0:
            self._check_diverged(totals)
            if payload is not None and self._reference > 0:
                payload.discard()  # every worker sent zeros: nothing to apply
            return totals
        if payload is not None:
            payload.apply(reference / totals.samples)
        if not self._averaging:  # the same averaged gradients on every worker, at the same step
            self.trainer.at_step(self._cut.step_of(self._cut.start))
            self.trainer.step()
        else:
            if payload is None or not totals.layouts_agree:
                self._average_anew(work.weight / totals.samples, agree=not totals.layouts_agree)
            self.trainer.averaged()
        self._reference = totals.samples
        return totals

    # -- the overlapped protocol -----------------------------------------------------------------

    def _overlapped_epoch(self, book: ScoreBook) -> None:
        """Rounds whose averaging runs while the next round's steps are taken.

        Round r's header and payload go out together after r's steps, without waiting; they land
        (DeltaAverager.land) after round r + 1's steps, and r + 1 goes out. Every worker sends the
        same collectives in the same order; only when it waits differs. When the totals of a
        landed round ask for a stop, or a checkpoint falls due, the next round lands at once:
        nobody steps in between, so every replica lands exactly on the average. The epoch ends
        the same way: when every worker had finished in the landed round, nobody stepped since.
        """
        if self._delta is None:  # every replica holds the same state here: fit() or an epoch starts
            self._delta_layout = self._layout()
            self._delta = DeltaAverager(self._averaged_tensors(), self.device, HEADER_LEN)
        in_flight: _InFlight | None = None
        while True:
            work = self._local_work()
            land_now = False
            if in_flight is not None:
                totals = self._land(in_flight, work.skipped)
                if self._settle(totals, book):
                    self._after_landing(totals, True, book)
                    return
                upcoming = self.counters.rounds + 1
                land_now = totals.stop > 0 or self.hooks.checkpoint_due(upcoming) or self._validation_due(upcoming)
            in_flight = self._launch(work)
            if land_now:
                totals = self._land(in_flight, work.skipped)
                in_flight = None
                epoch_done = self._settle(totals, book)
                self._after_landing(totals, epoch_done, book)
                if epoch_done:
                    return

    def _launch(self, work: _Work) -> _InFlight:
        """Send this round's payload, with its header; do not wait."""
        assert self._delta is not None
        header, layout = self._header(work, self._delta_layout)
        self._delta.launch(work.weight, header, self.group)
        return _InFlight(layout, work.weight, work.skipped, self.trainer.local_steps)

    def _land(self, in_flight: _InFlight, skipped_since: bool) -> RoundTotals:
        """Wait for a launched round and move the state by its average (DeltaAverager.land).

        A worker adopts the average outright when its progress since is worthless (a non-finite
        loss then or since) or nil (no step since). When the layouts disagreed, the buffers still
        matched (they keep their layout), so the average applies; then the state is averaged anew.
        """
        assert self._delta is not None
        totals = read_header(self._delta.wait(), in_flight.layout, self.world_size)
        self._check_diverged(totals)
        worthless = in_flight.skipped or skipped_since
        self._delta.land(totals.samples, adopt=worthless or self.trainer.local_steps == in_flight.local_steps)
        if not totals.layouts_agree:
            share = in_flight.weight / totals.samples if totals.samples > 0 else 1.0 / self.world_size
            self._average_anew(0.0 if worthless else share, agree=True)
            self._delta_layout = self._layout()
            self._delta = DeltaAverager(self._averaged_tensors(), self.device, HEADER_LEN)
        return totals

    # -- after a round ---------------------------------------------------------------------------

    def _check_diverged(self, totals: RoundTotals) -> None:
        if totals.samples == 0 and totals.skipped > 0:
            raise FloatingPointError(
                f"the loss of every worker that trained in this round was non-finite ({totals.skipped} "
                f"workers): training has diverged; lower the learning rate"
            )

    def _settle(self, totals: RoundTotals, book: ScoreBook) -> bool:
        """Counters and score reports for a round's totals; True when it ended the epoch."""
        epoch_done = totals.finished == self.world_size
        c = self.counters
        if totals.samples > 0:
            c.rounds, c.iterations, c.samples = c.rounds + 1, c.iterations + totals.batches, c.samples + int(totals.samples)
            c.position += totals.batches
            book.add(totals, c, end_of_epoch=epoch_done)
        if epoch_done:
            c.epoch, c.position = c.epoch + 1, 0
        self.trainer.landed(c, book.whole.score if epoch_done else totals.score, epoch_done)
        return epoch_done

    def _validation_due(self, rounds: int) -> bool:
        every = self.config.validation_every
        return self.trainer.validates and every is not None and rounds % every == 0

    def _after_landing(self, totals: RoundTotals, epoch_done: bool, book: ScoreBook) -> None:
        """After a round every replica holds the average: validate when due and at an epoch's
        end, then report the epoch's end; checkpoint when due, at an epoch's end and at a stop
        (every worker gives its own state, RNG and loss scale, and rank 0 writes); then stop if
        any worker was asked to."""
        trained = totals.samples > 0
        early = self.trainer.validates and (epoch_done or (trained and self._validation_due(self.counters.rounds)))
        early = early and validate(self.trainer, self.counters, book.report, self.group, self.rank, self.world_size)
        final = epoch_done or totals.stop > 0 or early
        if epoch_done:
            book.report(EpochReport(dataclasses.replace(self.counters), self.counters.epoch - 1, book.whole.score))
        if self.hooks.checkpointer is not None and (final or (trained and self.hooks.checkpoint_due(self.counters.rounds))):
            if self._node is None:
                everyone, size, writes = self.group, self.world_size, self.rank == 0
            else:  # with a hierarchy, every rank of every node: the default group
                everyone, size, writes = None, dist.get_world_size(), dist.get_rank() == 0
            own: list[Any] = [None] * size
            dist.all_gather_object(own, self.trainer.own_state(), group=everyone)
            if writes:
                self.hooks.checkpointer.save(self.trainer.state_dicts(), dataclasses.replace(self.counters), own)
        if totals.stop:
            raise Stopped(f"stopped at round {self.counters.rounds}, as the host asked")
        if early:
            raise _EarlyStop
