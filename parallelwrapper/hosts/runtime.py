"""The one path by which every host runs a worker: build, restore, train, stop, and fail as a `WorkerError`.

The `WorkerError` says who failed, where, and why.

The hosts (spawned.py, inprocess.py, torchrun.py) differ only in where the worker's process is,
how batches reach it, how it is asked to stop and how its reports travel; what a worker does is
written here once. By construction:
- the replica trains a deep copy of the user's model, so a failed fit() leaves theirs as it was
  (a spawned worker trains the model it unpickled, which is its own already: `own_model`);
- a fit's state is loaded (`start`) before the training (`train`) and not kept, so that a host
  that drops its command has that memory back for the fit's length;
- the model moves to its device before any state is loaded, so the optimizer's state (which
  `load_state_dict` casts to the params' device) lands on the worker's device;
- the worker has its own RNG stream (seeded `seed + rank`, carried from fit() to fit(), restored
  from a checkpoint) and its own thread count, swapped in for the fit and out after it, so the
  caller's process is left as it was whichever host it is.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from types import FrameType, TracebackType

import torch
import torch.distributed as dist

from ..checkpoint import make_checkpointer, rng_state, set_rng_state
from ..config import Config
from ..env import Placement
from ..errors import Stopped, TrainingError, WorkerError, summary
from ..feature import Feature, Plain
from ..feed.data import FeedError
from ..feed.protocols import BatchSource
from ..hooks import Hooks
from ..job import Job
from ..messages import FitCommand
from ..rounds import Rounds
from ..types import Report, Reporter, StateDict

# One Ctrl-C reaches a torchrun worker twice, from the terminal and forwarded by torchrun's agent:
# a signal this soon after the first is the same request, not a second press.
_REPEAT_S = 2.0


class Worker:
    """One worker under any host: its replica and the round loop that trains it, side by side, its
    RNG stream and threads, its checkpoints, and its seat in the config's features (feature.py,
    asked once): with a pipeline, the stage of it that this process is; with a hierarchy, its node."""

    def __init__(
        self,
        job: Job,
        config: Config,
        placement: Placement,
        process: int,
        local_rank: int,
        *,
        group: dist.ProcessGroup | None = None,
        hooks: Hooks | None = None,
        feature: Feature | None = None,
        own_model: bool = False,
    ) -> None:
        """Process `process` of the group: worker `process`, or with a pipeline a stage of worker
        `process // S` (a checkpoint's own states go by process). `feature`: the config's
        (features.of; None: Plain), which says what this process trains in which groups.
        `own_model`: `job.model` is this worker's alone (a spawned worker unpickled it), so it
        trains that one instead of a copy; elsewhere it is the user's, which the wrapper holds.
        `hooks` get the checkpointer `.checkpoint(directory)` asks for."""
        self.process, self._threads = process, placement.threads
        feature = feature or Plain()
        hooks = hooks or Hooks()
        hooks.checkpointer = make_checkpointer(config, job, placement.world_size, feature.fingerprint())  # of the whole model
        seat = feature.seat(job, config, placement, process, group)
        self.rank, self.stage, self._relay = seat.rank, seat.stage, seat.relay
        device = placement.device(local_rank)
        model = (seat.job.model if own_model else copy.deepcopy(seat.job.model)).to(device)
        self.replica = seat.make_replica(model, seat.job, config, device, self.rank, placement.world_size, hooks=hooks)
        # In lockstep groups (a hierarchy's nodes) the rounds run across the groups, one rank of each in its group.
        lockstep = seat.lockstep
        across = 1 if lockstep is None else lockstep.size
        self.rounds = Rounds(
            self.replica, config, device, self.rank // across, placement.world_size // across,
            group=seat.group, hooks=hooks, lockstep=lockstep, spread=feature.processes > 1, redoes=feature.redoes, together=seat.together,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed + self.rank)
            self._rng = rng_state()

    def own_state(self) -> StateDict:
        """This worker's own state as it is now: its RNG state and loss scale, and its rounds'
        (Rounds.own_state, with the worker's RNG stream, not the process's)."""
        with self._own_threads_and_rng():
            return self.rounds.own_state()

    def load_own_state(self, own: StateDict) -> None:
        """Take `own` as this worker's own state (`own_state`'s)."""
        self._rng = own
        self.rounds.load_own_state(own)

    def start(self, command: FitCommand) -> int:
        """A fit's first half: load `command`'s state, counters and RNG, and return the epoch to
        train until. Nothing of the command is kept, so a host lets it go before `train` (it is
        a model's size at least, in shared memory for a spawned worker). A failure is a WorkerError."""
        if command.rng is not None:
            self.load_own_state(command.rng[self.process])
        with self._own_threads_and_rng():
            try:
                self.replica.load_state(command.state)
                if command.resume is not None:  # the round's start above, this worker's progress in it here
                    self.replica.resume_state(command.resume.state)
                self.rounds.begin(command.counters, command.start)
                if command.resume is not None:
                    self.rounds.resume(command.resume)
            except Exception as e:  # noqa: BLE001 - any failure is a WorkerError, whose message holds e's traceback: from None prints it once
                raise self.failure(e) from None
        return command.until_epoch

    def train(self, until_epoch: int, source: BatchSource, report: Reporter) -> None:
        """A fit's second half: train from the state `start` loaded to the end of epoch
        `until_epoch - 1` on the batches of `source`, the worker's (with a pipeline, those its
        first stage takes from it and relays). A stop (Stopped) and the data's own errors
        (FeedError) pass through; any other failure is a WorkerError."""
        fed = source if self._relay is None else self._relay(source)
        with self._own_threads_and_rng():
            try:
                self.rounds.run(until_epoch, fed, report)
            except (Stopped, FeedError):
                raise
            except Exception as e:  # noqa: BLE001 - any failure is a WorkerError, whose message holds e's traceback: from None prints it once
                raise self.failure(e) from None

    def failure(self, error: BaseException) -> WorkerError:
        """A WorkerError for `error`, raised in this worker, with its traceback (`one_traceback`)."""
        where = error.where if isinstance(error, TrainingError) and error.where else self.replica.hooks.where
        return WorkerError(self.rank, summary(error), one_traceback(error), where, stage=self.stage)

    @contextlib.contextmanager
    def _own_threads_and_rng(self) -> Iterator[None]:
        threads, caller_rng = torch.get_num_threads(), rng_state()
        torch.set_num_threads(self._threads)
        set_rng_state(self._rng)
        try:
            yield
        finally:
            self._rng = rng_state()
            set_rng_state(caller_rng)
            torch.set_num_threads(threads)


def one_traceback(error: BaseException) -> str:
    """`error`'s traceback, as one. A TrainingError that a step's exception (the model's, the
    loss's) was re-raised as would print as two tracebacks chained, the second repeating the
    first's message: instead, its frames down to the one that caught the step's exception, then
    that exception's frames, type and message. Anything else is formatted as Python prints it."""
    cause = error.__cause__
    if isinstance(error, TrainingError) and cause is not None and cause.__traceback__ is not None:
        caught_in = cause.__traceback__.tb_frame
        outer = [tb.tb_frame for tb in _walk(error.__traceback__)]
        if caught_in in outer:
            one = traceback.TracebackException.from_exception(cause)
            frames = traceback.TracebackException.from_exception(error).stack[: outer.index(caught_in)]
            one.stack = traceback.StackSummary.from_list([*frames, *one.stack])
            return "".join(one.format())
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _walk(tb: TracebackType | None) -> Iterator[TracebackType]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


class SignalHooks(Hooks):
    """Hooks of a worker in a process that the user signals directly (in-process, torchrun): the
    first signal asks for a stop after the round in flight, which is then checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.signalled: int | None = None  # the signal that asked for the stop

    def stop_requested(self) -> bool:
        return self.signalled is not None


@contextlib.contextmanager
def stop_on_signals(hooks: SignalHooks, signals: tuple[signal.Signals, ...], on_report: Reporter) -> Iterator[Reporter]:
    """With checkpoints on, the first of `signals` finishes the round and saves it (a second one,
    `_REPEAT_S` or more later, interrupts at once); then the signal takes effect as it would have:
    KeyboardInterrupt for SIGINT, the previous handler (by default: the end of the process) for
    the others. A stop that another worker asked for ends in KeyboardInterrupt, and so does one
    asked in the fit's last round, which ends the fit anyway. Without checkpoints, nothing changes.

    Yields `on_report` as the worker is to call it: with checkpoints on, a KeyboardInterrupt
    raised in it (a listener's, or a Ctrl-C that came while one ran) is the first SIGINT; left to
    unwind the round loop, it would stop the fit unsaved, with the round's other records unheard.
    Without checkpoints it propagates at once, as a Ctrl-C does."""
    hooks.signalled = None
    if hooks.checkpointer is None or threading.current_thread() is not threading.main_thread():
        yield on_report
        return
    first, again = 0.0, False

    def first_stops_second_interrupts(signum: int, frame: FrameType | None) -> None:
        nonlocal first, again
        if hooks.signalled is None:
            hooks.signalled, first = signum, time.monotonic()
        elif time.monotonic() - first >= _REPEAT_S:
            again = True
            raise KeyboardInterrupt

    def reporting(report: Report) -> None:
        nonlocal first
        try:
            on_report(report)
        except KeyboardInterrupt:
            if again:  # a second signal's, come while a listener ran: at once, as anywhere else
                raise
            if hooks.signalled is None:  # a later one is the same request
                hooks.signalled, first = signal.SIGINT, time.monotonic()

    previous = {s: signal.signal(s, first_stops_second_interrupts) for s in signals}
    try:
        try:
            yield reporting
        except Stopped as stop:
            why = str(stop)
        else:
            if hooks.signalled is None:
                return
            why = "stopped at the end of the fit: the stop was asked in its last round"
        for s, handler in previous.items():
            signal.signal(s, handler)
        previous = {}
        if hooks.signalled not in (None, signal.SIGINT):
            signal.raise_signal(hooks.signalled)  # the checkpoint is saved: now as the signal meant
        raise KeyboardInterrupt(why) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
