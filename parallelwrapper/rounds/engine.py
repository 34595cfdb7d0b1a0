"""The round engine: one worker's side of every round, from its local work to what follows the landed average.

A round is its local work, then its exchange launched, then landed: at once (exchange.py), or, with
overlap_averaging, after the next round's local work (streaming.py). When a round lands is the only
thing overlap changes, so every option that shapes the local work (a lockstep group's steps: a
hierarchy's node, a warm-up's synchronous rounds) or what a landing does (an outer step) composes
with it."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

import torch
import torch.distributed as dist

from ..autopilot import Change, Choice, Pilot, Sizes, in_config
from ..averaging import Errors, all_reduce_values
from ..config import Config, TrainingMode
from ..errors import Stopped
from ..feed.protocols import BatchSource
from ..hooks import Hooks, Phase
from ..types import Batch, Counters, InForce, Reporter, StateDict
from .cut import RoundCut
from .exchange import Sent, SyncExchange
from .header import RoundTotals, Work
from .lockstep import Lockstep
from .scores import ScoreBook, validate
from .state import optimizer_state_tensors, trained_parameters
from .streaming import Launched, StreamExchange
from .trainer import Trainer

A = ParamSpec("A")  # a timed function's arguments
R = TypeVar("R")  # and what it returns


class _EarlyStop(Exception):
    """Early stopping's verdict, the same on every worker after the same round."""


class Rounds:
    """One worker's round loop over a process group (None: the default group): it runs the fits
    of its `trainer` (worker.Replica), which it calls and which never calls it, and holds the
    counters and what of the rounds a worker keeps (the autopilot, an encoding's residual)."""

    def __init__(
        self,
        trainer: Trainer,
        config: Config,
        device: torch.device,
        rank: int,
        world_size: int,
        *,
        group: dist.ProcessGroup | None = None,
        hooks: Hooks | None = None,
        lockstep: Lockstep | None = None,
        spread: bool = False,
        redoes: bool = False,
    ) -> None:
        """`hooks`: the host's, which the trainer shares (hosts/runtime.Worker builds both).
        `lockstep`: this rank's group of ranks that train as one worker (a hierarchy's node);
        `rank`, `world_size` and `group` are then the groups' (one rank of each in `group`).
        `spread`: a worker is several processes (a pipeline's stages), each with its own state;
        `redoes`: a lost round is redone from a copy of the whole state kept at its start (replacement)."""
        self.trainer, self.config, self.hooks = trainer, config, hooks or Hooks()
        self.rank, self.world_size, self.group = rank, world_size, group
        self._device, self._spread = device, spread
        self._together = None if lockstep is None else lockstep.steps(trainer, device)
        shards = None if lockstep is None else lockstep.shards  # the state, across the groups
        # A gradient round (a warm-up's) in lockstep groups is every rank's: the default group.
        gradients = (group, world_size) if lockstep is None else (None, world_size * lockstep.size)
        self._sync = SyncExchange(trainer, config, device, (group, world_size), gradients, shards, redoes)
        self._stream = StreamExchange(trainer, config, device, group, world_size, redoes) if config.overlap_averaging else None
        self.counters = Counters()
        self.started = time.monotonic()  # when the fit() began, which the records' seconds count from: Worker.start sets it (FitCommand.start)
        self._averages_state = config.training_mode is TrainingMode.AVERAGING  # after any warm-up
        self.seq = 0  # rounds started over this worker's life, the same on every worker: the observer's tags (types.RoundObserver)
        self._cut = RoundCut(world_size * (1 if lockstep is None else lockstep.size))  # which batches each round trains, and their steps
        self._unscored_s = 0.0  # seconds in exchanges since the last round settled: the next Score's (its local work's are its Work's)
        # `.averaging_frequency("auto")`: the autopilot's choice of k and rung is in force (autopilot.py).
        start = Choice(config.averaging_frequency, config.payload_dtype, config.average_updaters_every if config.average_updaters else 0)
        self.pilot = None if config.autopilot is None else Pilot(config.autopilot, start)
        self._exchange_s = 0.0  # the last averaging's seconds, when a fair measure of its rung (the autopilot's)
        self._codec_s = 0.0  # ... of those, its codec's
        self._waited = 0.0  # of this round's exchange, the seconds in the autopilot's barrier: waiting for the others
        self._wait_s = 0.0  # ... the last averaging's, when a fair measure

    @property
    def _averaging(self) -> bool:
        """This round averages the state, not the gradients: AVERAGING, once the warm-up's
        `warmup_sync_steps` synchronous steps (rounds, over the wrapper's life) are done."""
        return self._averages_state and self.counters.rounds >= self.config.warmup_sync_steps

    @property
    def k(self) -> int:
        """The local steps of an averaging round: the autopilot's choice, or averaging_frequency."""
        return self.config.averaging_frequency if self.pilot is None else self.pilot.choice.k

    def own_state(self) -> StateDict:
        """What a checkpoint holds per worker: the trainer's own (its RNG state, its loss scale),
        and the rounds': with gradient encoding, its residual (and τ and the step count, the same
        on every worker); the autopilot's state."""
        own: StateDict = {**self.trainer.own_state()}
        if self.pilot is not None:
            own["autopilot"] = self.pilot.state_dict()
        if self.config.gradient_encoding is not None:
            own["gradient_encoding"] = self._sync.encoding_residual().state_dict()
        errors = self._sync.errors()
        if errors is not None:  # a coded payload's error fed back: what this worker has yet to send
            own["codec_errors"] = errors.state_dict()
        return own

    def load_own_state(self, own: StateDict) -> None:
        """Take `own` (`own_state`'s) as the trainer's and the rounds' own state."""
        self.trainer.load_own_state(own)
        if self.config.gradient_encoding is not None and "gradient_encoding" in own:
            self._sync.encoding_residual().load_state_dict(own["gradient_encoding"])
        if "codec_errors" in own:
            self._sync.keep_errors(Errors.of(own["codec_errors"]))
        if self.pilot is not None and "autopilot" in own:
            self.pilot.load_state_dict(own["autopilot"])
            self._use(self.pilot.choice)

    def reset(self) -> None:
        """The trainer's tensors were replaced (a fit() loads new state): build buffers afresh."""
        self._sync.reset()
        if self._stream is not None:
            self._stream.reset()

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
        """The rounds of an epoch. Each round's exchange is launched after its local work and
        landed at once, or (overlap_averaging, in averaging rounds) after the next round's local
        work. Every worker sends the same collectives in the same order; only when it waits
        differs. When a landed round's totals ask for a stop, or a checkpoint or validation falls
        due, the next round lands at once: nobody steps in between, so every replica lands
        exactly on the average. The epoch ends the same way: when every worker had finished in
        the landed round, nobody stepped since. The `last` epoch of a fit lands its round's
        optimizer state before the round's Score: no step of this fit waits for it."""
        # SHARED_GRADIENTS reports every k steps, AVERAGING every averaging.
        every = 1 if self._averaging else self.k
        book = ScoreBook(report, every, self.config.report_score_after_averaging, self.started)
        self._cut.epoch_starts(self.counters)
        in_flight: Sent | Launched | None = None  # a round launched and not landed (overlap_averaging)
        flying = Work()  # its local work
        while True:
            started = time.perf_counter()
            work = self._local_work(in_flight is not None)
            work.seconds = time.perf_counter() - started - self._count_settled()
            land_now = not (self._stream is not None and self._averaging)
            if in_flight is not None:
                totals = self._timed(self._land, in_flight, work)
                if self._settle(totals, book, flying, late=True):
                    self._after_landing(totals, True, book)
                    return
                upcoming = self.counters.rounds + 1
                land_now = totals.stop > 0 or self.hooks.checkpoint_due(upcoming) or self._validation_due(upcoming)
            in_flight, flying = self._timed(self._launch, work), work
            if land_now:
                totals = self._timed(self._land, in_flight, work, True)
                in_flight = None
                if last and totals.epoch_done:
                    # The state still on its way (the optimizer's, FlatAverager's `later` or every
                    # m-th round's moments) is this round's exchange: for its Score and the
                    # autopilot's measure. Else it landed when the fit let its buffers go, seen by
                    # neither (2.27 s a fit at 200 Mbit/s).
                    self._timed(self._sync.settle)
                epoch_done = self._settle(totals, book, work)
                self._after_landing(totals, epoch_done, book)
                if epoch_done:
                    return

    def _count_settled(self) -> float:
        """The seconds this round's first step waited for the last round's optimizer state to land
        are that round's exchange's, not local work: for the Score, and for the autopilot's measure
        of the exchange (when it has one), which the next header carries. Returns them."""
        moved, self._sync.settled_in_step = self._sync.settled_in_step, 0.0
        self._unscored_s += moved
        if self._exchange_s > 0:
            self._exchange_s += moved
        return moved

    def _timed(self, fn: Callable[A, R], *args: A.args, **kwargs: A.kwargs) -> R:
        """fn(*args), its seconds counted as exchange for the next Score."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._unscored_s += time.perf_counter() - start

    # -- local work ------------------------------------------------------------------------------

    def _next(self) -> tuple[int, Batch] | None:
        """The round's next batch for this worker (cut.py), or None."""

        def waiting() -> None:
            self.hooks.progress(Phase.WAITING, self.counters.epoch, -1, self.trainer.local_steps)

        return self._cut.next(waiting, self._held_for)

    def _held_for(self, later: int) -> None:
        """The batch just taken is held for the round `later` rounds after this one."""
        if self.hooks.observer is not None:
            self.hooks.observer.held_for(self.seq + later)

    def _round_k(self) -> int:
        """The local steps of the averaging round about to start: k; with the autopilot, the
        epoch's rest where the round after would be too short for its exchange (Pilot.steps)."""
        return self.k if self.pilot is None else self.pilot.steps(self._cut.steps_left())

    def _local_work(self, behind: bool) -> Work:
        """AVERAGING: an independent step on each of this worker's batches of the round (k, or
        with the first-come feed as many as it takes first). SHARED_GRADIENTS: one
        forward/backward; the step waits for the averaged gradients. `behind`: the last round
        is still being averaged."""
        epoch, trainer = self.counters.epoch, self.trainer
        self.seq += 1
        k = self._round_k() if self._averaging else 1  # SHARED_GRADIENTS (and a warm-up): one step each
        self._cut.round_starts(self._cut.ranks * k)
        if self.hooks.observer is not None:
            self.hooks.observer.round_starts(self.seq, epoch, self._cut.finished, self.seq - 1 - behind)
        work = Work(first_step=trainer.local_steps, k=k)
        self._sync.prepare(self._averaging)
        if self._averaging and self._stream is not None:
            self._stream.prepare()
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
            if self._averaging and self._stream is not None:
                self._stream.stepped(loss, n)  # fragments launch through the round
            work.losses.append(loss)
            work.samples, work.batches = work.samples + n, work.batches + 1
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
        work.samples, work.batches, work.finished = taken.samples, taken.batches, taken.finished
        loss = [torch.tensor(taken.loss_sum)] if taken.batches else []
        work.loss_sum, work.skipped = self.trainer.checked_loss(loss, work.first_step, self.counters.epoch)
        self.hooks.progress(Phase.AVERAGING, self.counters.epoch, -1, self.trainer.local_steps)
        return work

    # -- the exchange ----------------------------------------------------------------------------

    def exchange(self, work: Work) -> RoundTotals:
        """Launch and land a round at once, after `work`, all of it (benchmarks time this)."""
        totals = self._land(self._launch(work), work, at_once=True)
        self._sync.settle()
        return totals

    def _launch(self, work: Work) -> Sent | Launched:
        stop = self.hooks.stop_requested()
        overlapped = self._stream is not None and self._averaging
        if not self._averaging:  # the step's learning rate, on every worker before it sends (encoding: lr × gradient)
            self.trainer.at_step(self._cut.step_of(self._cut.start))
        elif self.pilot is not None:
            work.pilot = self.pilot.header(work.seconds, self._exchange_s, self._codec_s, self._wait_s, self._sizes())
            if not overlapped:
                # Every worker arrives first: the exchange's seconds after it are the link's and the
                # codec's, not the wait for a slower worker, which no k or payload shortens.
                start = time.perf_counter()
                all_reduce_values([0.0], self._device, self.group)
                self._waited = time.perf_counter() - start
        if overlapped:
            assert self._stream is not None
            return self._stream.launch(work, stop)
        return self._sync.launch(work, self._averaging, stop, self._moments_due())

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
        if not isinstance(launched, Sent):
            assert self._stream is not None
            # A round landed at once is followed by a round's start from its average: seen there.
            observer = self.hooks.observer
            at_average = observer.average_landed if observer is not None and observer.wants_averages and not at_once else None
            return self._stream.land(launched, since.skipped, at_once, at_average)
        totals = self._sync.land(launched)
        if not launched.averaging and totals.samples > 0:
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
            config = self.config
            every = config.average_updaters_every if config.average_updaters else 0
            ran = InForce(work.k if averaged else 1, config.payload_dtype, every, self._stream is not None, config.fragments)
            change = self._steer(totals, self._unscored_s, late) if averaged else None
            seconds, self._unscored_s = (work.seconds, self._unscored_s), 0.0  # the pilot's own all-reduce included
            ran = dataclasses.replace(ran, why=None if change is None else change.why)
            book.add(totals, c, end_of_epoch=epoch_done, encoding=self._sync.encoded_round(), lr=float(self.trainer.optimizer.param_groups[0]["lr"]), seconds=seconds, ran=ran)
        if epoch_done:
            c.epoch, c.position = c.epoch + 1, 0
        self.trainer.landed(c, book.whole.score if epoch_done else totals.score, epoch_done)
        return epoch_done

    def _steer(self, totals: RoundTotals, exchange_s: float, late: bool) -> Change | None:
        """With the autopilot, after an averaging round (a gradient round's header has no pilot's
        part): measure, and decide what the next round runs with (autopilot.py). The
        exchange is a fair measure of its rung when its header rode with the payload, or when the
        header went alone and the payload after it was the rung's own (SyncExchange.alone_s: a
        float32 average anew, or coded in buffers built before the round): then its seconds
        alone; not when it averaged anew for a coded rung. Overlapped, the measure is what a round
        landed `late` still cost, its launch and its wait to land, where it went as every later
        round will (StreamExchange.steady); of one landed at once, none."""
        if self.pilot is None:
            return None
        pilot, sync = self.pilot, self._sync
        change = pilot.landed(totals.pilot, totals.batches, totals.workers, self.counters.rounds, late)
        if self._stream is not None:
            steady = late and self._stream.steady  # not a fit's first round, sent in full precision
            self._exchange_s, self._codec_s, self._wait_s = (exchange_s if steady else 0.0), 0.0, 0.0
        else:
            fair = sync.steady or sync.alone_s > 0
            if fair:
                self._exchange_s, self._wait_s = (exchange_s - self._waited if sync.steady else sync.alone_s), self._waited
                self._codec_s = sync.codec_s
            else:
                self._exchange_s, self._codec_s, self._wait_s = 0.0, 0.0, 0.0
            if change is None and pilot.unmeasured:  # the same on every worker: decided from the sums
                # Too few measures of what is in force to decide on: this exchange's, summed now, and
                # not again in the next header (Pilot.measured).
                # Its seconds are the exchange's, for the Score: a worker whose exchange ended first
                # waits here for the others' (1-2 s a fit at 10 Mbit/s, counted nowhere before).
                summed = self._timed(all_reduce_values, [self._exchange_s, self._codec_s, self._wait_s, float(fair)], self._device, self.group)
                self._exchange_s, self._codec_s, self._wait_s = 0.0, 0.0, 0.0
                change = pilot.measured(summed, totals.workers, self.counters.rounds)
        if change is not None:
            self._use(change.choice, landed=True)
        return change

    def _sizes(self) -> Sizes:
        """The elements a round may carry, for the autopilot's estimate of another rung's bytes."""
        trainer = self.trainer
        parameters = sum(t.numel() for t in trained_parameters(trainer.model, trainer.optimizer))
        return Sizes(parameters, sum(t.numel() for t in optimizer_state_tensors(trainer.optimizer)))

    def _use(self, choice: Choice, landed: bool = False) -> None:
        """Send the next averagings as `choice` says: its payload and optimizer-state period (k is
        read at each round's start); overlapped, each landed after the next round's local work
        (streaming.py). Another rung rebuilds the buffers at the next round. `landed`: a round
        just landed at once, its optimizer state too (SyncExchange.use settles it), so every
        replica holds its average: a switch to overlap builds its buffers and codes from it;
        else (a resumed pilot's choice) they are built at the fit's first step."""
        config = dataclasses.replace(self.config, payload_dtype=choice.payload, **in_config(choice.rung))
        if config != self.config:
            self.config = config
            self._sync.use(self.config)
        if not choice.overlap:
            return
        # The autopilot's last resort: the rung stays, k only lengthens (autopilot.py). The
        # exchanges are given a fixed setting's config, overlapped at that k (which places
        # fragments): the synchronous one lets its buffers go and builds none (no averaging round
        # lands there).
        fixed = dataclasses.replace(config, autopilot=None, averaging_frequency=choice.k, overlap_averaging=True)
        if self._stream is not None:
            self._stream.use(fixed)
            return
        self._sync.use(fixed)
        self._stream = StreamExchange(self.trainer, fixed, self._device, self.group, self.world_size)
        if landed:
            self._stream.start_from_average()

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
            self._timed(self._sync.settle)
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
