"""The round engine: one worker's side of every round, from its local work to what follows the landed average.

A round is its local work, then its exchange launched, then landed: at once (exchange.py), or, with
overlap_averaging, after the next round's local work (streaming.py). When a round lands is the only
thing overlap changes, so every option that shapes the local work (a lockstep group's steps: a
hierarchy's node, a warm-up's synchronous rounds) or what a landing does (an outer step) composes
with it. Every worker sends the same collectives in the same order; only when it waits differs.

When a landed round's totals ask for a stop, or a checkpoint or validation falls due, the next
round lands at once: nobody steps in between, so every replica lands exactly on the average. An
epoch ends the same way: when every worker had finished in the landed round, nobody stepped since.
The last epoch of a fit lands its round's optimizer state before the round's Score: no step of
this fit waits for it. After each averaging round the loop asks its policy (policy.py) what the
next runs with."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import cast

import torch
import torch.distributed as dist

from ..averaging import Starts
from ..config import Config, TrainingMode
from ..errors import Stopped
from ..feed.claims import ClaimSource
from ..feed.protocols import BatchSource
from ..hooks import Hooks, Phase
from ..types import Batch, Counters, Progress, Reporter, Resume, StateDict
from .clock import Clock
from .cut import RoundCut
from .exchange import Sent
from .header import RoundTotals, Work
from .lockstep import Lockstep
from .policy import policy_for
from .scores import ScoreBook, validate
from .streaming import Launched
from .trainer import Trainer
from .transport import Transport


class _EarlyStop(Exception):
    """Early stopping's verdict, the same on every worker after the same round."""


class Rounds:
    """One worker's round loop over a process group (None: the default group): it runs the fits
    of its `trainer` (worker.Replica), which it calls and which never calls it, and holds the
    counters and what of the rounds a worker keeps (its policy, its exchanges' residuals)."""

    def __init__(
        self, trainer: Trainer, config: Config, device: torch.device, rank: int, world_size: int, *,
        group: dist.ProcessGroup | None = None, hooks: Hooks | None = None, lockstep: Lockstep | None = None,
        spread: bool = False, redoes: bool = False, together: dist.ProcessGroup | None = None,
    ) -> None:  # fmt: skip
        """`hooks`: the host's, which the trainer shares (hosts/runtime.Worker builds both).
        `lockstep`: this rank's group of ranks that train as one worker (a hierarchy's node);
        `rank`, `world_size` and `group` are then the groups' (one rank of each in `group`).
        `spread`: a worker is several processes (a pipeline's stages), each with its own state;
        `redoes`: a lost round is redone from a copy of the whole state kept at its start (replacement);
        `together`: the worker's other processes (a pipeline's stages), whose policy chooses with this one's."""
        self.trainer, self.config, self.hooks, self._device = trainer, config, hooks or Hooks(), device
        self.rank, self.world_size, self.group = rank, world_size, group
        self._spread = spread
        self._together = None if lockstep is None else lockstep.steps(trainer, device)
        shards = None if lockstep is None else lockstep.shards  # the state, across the groups
        # A gradient round (a warm-up's) in lockstep groups is every rank's: the default group.
        gradients = (group, world_size) if lockstep is None else (None, world_size * lockstep.size)
        self.clock = Clock()  # the exchanges' seconds, which they measure: for the Scores and the policy
        self._exchange = Transport(trainer, config, device, (group, world_size), gradients, shards, self.clock, redoes)
        self._sync = self._exchange.sync  # every round's but an overlapped averaging's, which the loop settles and releases
        self.counters = Counters()
        self.started = time.monotonic()  # when the fit() began, which the records' seconds count from (begin)
        self._averages_state = config.training_mode is TrainingMode.AVERAGING  # after any warm-up
        self.seq = 0  # rounds started over this worker's life, the same on every worker: the observer's tags (hooks.RoundObserver)
        ranks = world_size * (1 if lockstep is None else lockstep.size)
        self._cut = RoundCut(ranks, config.planned_workers(ranks))  # which batches each round trains, and their steps
        self.policy = policy_for(config, trainer, self.clock, device, group, together)  # what each averaging round runs with (policy.py)
        self._work: Work | None = None  # the local work of the round in flight, until it lands at once
        self._trained: list[int] = []  # the indices of its batches that this worker trained
        self._resuming: Resume | None = None  # the next round is this one, resumed (`resume`)

    @property
    def _averaging(self) -> bool:
        """This round averages the state: AVERAGING, after the warm-up's `warmup_sync_steps` rounds (over the wrapper's life)."""
        return self._averages_state and self.counters.rounds >= self.config.warmup_sync_steps

    def own_state(self) -> StateDict:
        """What a checkpoint holds per worker: the trainer's own (RNG, loss scale), the policy's, the exchanges'."""
        return {**self.trainer.own_state(), **self.policy.state_dict(), **self._exchange.own_state()}

    def load_own_state(self, own: StateDict) -> None:
        """Take `own` (`own_state`'s) as the trainer's and the rounds' own state."""
        self.trainer.load_own_state(own)
        self._exchange.load_own_state(own)
        self._take_policy(own)

    def regrouped(self, own: StateDict) -> None:
        """A regroup redoes a round: take the policy's part of `own`, the own state that the
        regroup's source kept at the round's start (every worker's policy holds the same there), so
        that a fresh replacement's and every survivor's choose alike from it; the last exchange's
        measure goes, being one worker's only."""
        self._take_policy(own)
        self.clock.take()

    def _take_policy(self, own: StateDict) -> None:
        """The policy's part of `own`, if any, and the exchanges sent as its choice says."""
        if self.policy.load_state_dict(own):
            self.config = self._exchange.use(self.policy.choice)

    def progress(self) -> Progress | None:
        """This worker's part of the round in flight, which a fleet's survivors may resume without
        a lost peer (types.Resume): an averaging round landed at once, by a worker alone (no
        lockstep group, no stages), on claimed batches, begun and not landed, whose failed
        exchange left this worker's state as it was (SyncExchange.intact); else None (a round that
        must be redone from its start). A coded round's start goes with it (`starts`)."""
        work, source, cut = self._work, self._cut.source, self._cut
        if (work is None or not self._averaging or self._exchange.overlapped(True) or not self._sync.intact
                or self._together is not None or self._spread or not isinstance(source, ClaimSource)):  # fmt: skip
            return None
        trained = tuple(i - cut.start for i in self._trained)
        taken = list(trained)
        if (held := cut.held()) is not None:  # past the round's end: the next round's
            taken.append(held - cut.start)
        if (later := source.held()) is not None:  # the next epoch's
            taken.append(cut.claim_of(*later))
        losses = tuple(float(x) for x in work.losses)
        return Progress(self.seq, cut.end, trained, max(taken, default=-1) + 1, work.k, work.samples, losses, work.first_step)

    def starts(self) -> Starts | None:
        """With a coded payload, after a failed round that `progress` gives: what its change was
        taken from, which the resumed round's is (SyncExchange.resume)."""
        return self._sync.starts

    def resume(self, resume: Resume) -> None:
        """The next round is `resume`'s: the round a lost peer left, its batches the same, this
        worker's part of it trained already (the fit's state and counters are its start's)."""
        self._resuming = resume
        self._exchange.resume(resume.starts)

    def begin(self, counters: Counters, started: float) -> None:
        """The one way a host sets the loop's counters: a fit() loaded the trainer's state (new
        tensors, so the exchanges build their buffers afresh) and starts at `counters` and `started`."""
        self._exchange.reset()
        self.counters = dataclasses.replace(counters)
        self.started = started

    def run(self, until_epoch: int, source: BatchSource, report: Reporter) -> None:
        """A fit: train from `self.counters` to the end of epoch `until_epoch - 1`, the trainer
        told when it starts and when it has ended (Trainer.fit_starts, fit_ends)."""
        self.trainer.fit_starts()
        self._cut.fit_starts(source)
        failing = False
        try:
            while self.counters.epoch < until_epoch:
                self._epoch(report, last=self.counters.epoch + 1 == until_epoch)
        except _EarlyStop:
            pass  # every worker stopped after the same round: the fit ends there, normally
        except Stopped:
            raise  # at a landed round, as asked: the state is whole
        except BaseException:
            failing = True  # what is still on its way is of no use, and waiting for it could hide the cause
            raise
        finally:
            self._sync.release(settle=not failing)
            if self._together is not None:
                self._together.release()
            self.hooks.progress(Phase.IDLE, self.counters.epoch, -1, self.trainer.local_steps)
        self.trainer.fit_ends()

    def _epoch(self, report: Reporter, last: bool) -> None:
        """The rounds of an epoch, each launched after its local work and landed at once or after
        the next round's (the module's docstring says when); `last`: the fit's last epoch."""
        # SHARED_GRADIENTS reports every k steps, AVERAGING every averaging.
        every = 1 if self._averaging else self.policy.choice.k
        book = ScoreBook(report, every, self.config.report_score_after_averaging, self.started)
        self._cut.epoch_starts(self.counters)
        in_flight: Sent | Launched | None = None  # a round launched and not landed (overlap_averaging)
        flying = Work()  # its local work
        while True:
            started = time.perf_counter()
            work = self._local_work(in_flight is not None)
            work.seconds = time.perf_counter() - started - self.clock.settled_in_step()
            land_now = not self._exchange.overlapped(self._averaging)
            if in_flight is not None:
                totals = self.clock.timed(self._land, in_flight, work)
                if self._settle(totals, book, flying, late=True):
                    self._after_landing(totals, True, book)
                    return
                upcoming = self.counters.rounds + 1
                land_now = totals.stop > 0 or self.hooks.checkpoint_due(upcoming) or self._validation_due(upcoming)
            in_flight, flying = self.clock.timed(self._launch, work), work
            if land_now:
                totals = self.clock.timed(self._land, in_flight, work, True)
                in_flight = None
                if last and totals.epoch_done:
                    # The state still on its way (the optimizer's, FlatAverager's `later` or every
                    # m-th round's moments) is this round's exchange: for its Score and the
                    # policy's measure. Else it landed when the fit let its buffers go, seen by
                    # neither (2.27 s a fit at 200 Mbit/s).
                    self.clock.timed(self._sync.settle)
                epoch_done = self._settle(totals, book, work)
                self._after_landing(totals, epoch_done, book)
                if epoch_done:
                    return

    # -- local work ------------------------------------------------------------------------------

    def _next(self) -> tuple[int, Batch] | None:
        """The round's next batch for this worker (cut.py), or None; the observer told of a batch
        held for the round `later` rounds after this one."""

        def waiting() -> None:
            self.hooks.progress(Phase.WAITING, self.counters.epoch, -1, self.trainer.local_steps)

        def held_for(later: int) -> None:
            if self.hooks.observer is not None:
                self.hooks.observer.held_for(self.seq + later)

        return self._cut.next(waiting, held_for)

    def _local_work(self, behind: bool) -> Work:
        """AVERAGING: an independent step on each of this worker's batches of the round (k, or
        with the first-come feed as many as it takes first). SHARED_GRADIENTS: one
        forward/backward; the step waits for the averaged gradients. `behind`: the last round
        is still being averaged."""
        epoch, trainer = self.counters.epoch, self.trainer
        self.seq += 1
        resuming, self._resuming = self._resuming, None
        if resuming is None:
            k = self.policy.steps(self._cut) if self._averaging else 1  # SHARED_GRADIENTS (and a warm-up): one step each
            self._cut.round_starts(self._cut.ranks * k)
            # Begun before its observer hears of it: a peer lost as the round starts (a fleet's
            # store at rank 0, which it asks) leaves this worker's part of it, nothing trained.
            work = self._work = Work(first_step=trainer.local_steps, k=k)
            self._trained = []
            if self.hooks.observer is not None:
                self.hooks.observer.round_starts(self.seq, epoch, self._cut.finished, self.seq - 1 - behind)
        else:  # a round resumed without a lost peer: its batches, and this worker's part of them, as they were
            done = resuming.progress
            self._cut.round_starts(done.end - self._cut.end)
            losses = [torch.tensor(x, device=self._device) for x in done.losses]
            work = self._work = Work(losses, done.samples, len(done.trained), done.first_step, done.k)
            self._trained = [self._cut.start + i for i in done.trained]
        self._exchange.prepare(self._averaging)
        stream = self._exchange.stream if self._exchange.overlapped(self._averaging) else None  # fragments launch through the round
        if self._averaging and self._together is not None:
            return self._lockstep_work(work)
        most, step = (math.inf, trainer.train_step) if self._averaging else (1, trainer.accumulate)
        while len(work.losses) < most:
            item = self._next()
            if item is None:
                break
            if self._averaging:
                trainer.at_step(self._cut.step_of(item[0]))
            loss, n = step(epoch, *item)
            self._trained.append(item[0])
            if stream is not None:
                stream.stepped(loss, n)
            work.losses.append(loss)
            work.samples, work.batches = work.samples + n, work.batches + 1
        work.steps = work.batches  # one step a batch
        work.loss_sum, work.skipped = trainer.checked_loss(work.losses, work.first_step, epoch)
        work.finished = self._cut.finished
        self.hooks.progress(Phase.AVERAGING, epoch, -1, trainer.local_steps)
        return work

    def _lockstep_work(self, work: Work) -> Work:
        """In a lockstep group (a hierarchy's node): k steps with the group's other ranks
        (lockstep.py); the work is the group's. The round after its last batch finds it finished."""
        assert self._together is not None
        first = self._cut.step_of(self._cut.start)
        taken = self._together.run(work.k, first, self.counters.epoch, self._next, lambda: self._cut.finished)
        work.samples, work.batches, work.steps, work.finished = taken.samples, taken.batches, taken.steps, taken.finished
        loss = [torch.tensor(taken.loss_sum)] if taken.batches else []
        work.loss_sum, work.skipped = self.trainer.checked_loss(loss, work.first_step, self.counters.epoch)
        self.hooks.progress(Phase.AVERAGING, self.counters.epoch, -1, self.trainer.local_steps)
        return work

    # -- the exchange ----------------------------------------------------------------------------

    def _launch(self, work: Work) -> Sent | Launched:
        stop = self.hooks.stop_requested()
        if not self._averaging:  # the step's learning rate, on every worker before it sends (encoding: lr × gradient)
            self.trainer.at_step(self._cut.step_of(self._cut.start))
        else:
            work.policy = self.policy.header(work)
        return self._exchange.launch(work, self._averaging, stop, self._moments_due(), meet=self._averaging and self.policy.meets)

    def _moments_due(self) -> bool:
        """With `.average_updaters(every=m)`: whether the optimizer's state travels in the round
        about to land, by the rounds over the wrapper's life (the same on every worker, and after a
        resume): every m-th, and those after which replicas must be equal: a checkpoint or a
        validation due (an early stop may end the fit there). An epoch's end, a stop and a skipped
        worker the exchange learns from the round's totals."""
        upcoming = self.counters.rounds + 1
        return upcoming % self.config.average_updaters_every == 0 or self.hooks.checkpoint_due(upcoming) or self._validation_due(upcoming)

    def _land(self, launched: Sent | Launched, since: Work, at_once: bool = False) -> RoundTotals:
        """Land a launched round (`since`: the local work done after it, itself when `at_once`);
        a gradient round then takes its step, the same on every worker."""
        totals = self._exchange.land(launched, since.skipped, at_once, self.hooks.observer)
        if at_once:
            self._work = None  # landed: nothing in flight to resume
        if isinstance(launched, Sent) and not launched.averaging and totals.samples > 0:
            self.trainer.step()
        return totals

    # -- after a round ---------------------------------------------------------------------------

    def _settle(self, totals: RoundTotals, book: ScoreBook, work: Work, late: bool = False) -> bool:
        """Counters and score reports for a round's totals (`work`: this worker's local work in it,
        its k and seconds; `late`: landed after the next round's local work); True when it ended
        the epoch."""
        epoch_done = totals.epoch_done
        c, averaged = self.counters, self._averaging  # a warm-up's last gradient round counts before it
        if totals.samples > 0:
            c.rounds, c.iterations, c.samples = c.rounds + 1, c.iterations + totals.batches, c.samples + int(totals.samples)
            c.position += totals.batches
            ran = self._exchange.ran(work.k if averaged else 1)
            # After an averaging round (not a gradient round's), the policy decides what the next runs with.
            before = self.policy.choice.k
            change = self.policy.landed(totals, c.rounds, late) if averaged else None
            if change is not None:
                self.config = self._exchange.use(change.choice, landed=True)
                if change.choice.k != before:
                    self.trainer.rounds_changed(before, change.choice.k)
            seconds, self.clock.unscored = (work.seconds, self.clock.unscored), 0.0  # the policy's own all-reduce included
            ran = dataclasses.replace(ran, why=None if change is None else change.why)
            book.add(totals, c, end_of_epoch=epoch_done, encoding=self._sync.encoded_round(), lr=float(self.trainer.optimizer.param_groups[0]["lr"]), seconds=seconds, ran=ran)
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
        due = self.trainer.validates and (epoch_done or (trained and self._validation_due(self.counters.rounds)))
        if due:
            # The optimizer's averaged state lands first: a best state kept (restore_best) is the
            # whole average. Copied while it landed in place, its momentum was half a worker's own.
            self.clock.timed(self._sync.settle)
        early = due and validate(self.trainer, self.counters, book, self.group, self.rank, self.world_size)
        final = epoch_done or totals.stop > 0 or early
        if epoch_done or early:  # an early stop ends the epoch's part in this fit: its loss too
            epoch = self.counters.epoch - 1 if epoch_done else self.counters.epoch
            book.ended(self.counters, epoch, complete=epoch_done)
        if self.hooks.checkpointer is not None and (final or (trained and self.hooks.checkpoint_due(self.counters.rounds))):
            self._sync.settle()  # the optimizer's state goes in too
            if self._together is None and not self._spread:
                everyone, size, writes = self.group, self.world_size, self.rank == 0
            else:  # in lockstep groups or with a pipeline, every process: the default group
                everyone, size, writes = None, dist.get_world_size(), dist.get_rank() == 0
            own = cast("list[StateDict]", [None] * size)  # all_gather_object fills each
            dist.all_gather_object(own, self.own_state(), group=everyone)
            state = self.trainer.saved_state(writes)
            if state is not None:
                self.hooks.checkpointer.save(state, dataclasses.replace(self.counters), own)
        if totals.stop:
            raise Stopped(f"stopped at round {self.counters.rounds}, as the host asked")
        if early:
            raise _EarlyStop
