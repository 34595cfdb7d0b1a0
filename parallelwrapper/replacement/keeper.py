"""A replaceable worker's side: its takes recorded, the state each round starts from kept, its park after a loss, its regroup.

Its process (hosts/process.py) builds it from what the main process gave every worker
(`WorkerSide`), makes it the round loop's observer (hooks.RoundObserver) and asks it at a fit's
edges and at a loss:
- at each round's start it keeps a copy of the state a redo of the oldest round not landed would
  start from (`Kept`): every replica holds the same average there, so any survivor's copy will do;
  and it hands the feeder back the slots of the rounds landed since (the ledger, ledger.py);
- at a loss it reports it, leaves the process group (every peer's collective ends at once) and
  parks, saying which round it kept (`lost`);
- at the main process's Regroup it joins the new generation (regroup.py), receives the source's
  kept state by broadcast and returns the fit that redoes that round (`fit_of`).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Protocol, cast

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]

from ..errors import WorkerError
from ..feed.queue import END_SLOT, QueueSource
from ..messages import FitCommand, Message
from ..rounds import Rounds
from ..types import Counters, EpochEnd, Report, StateDict, TrainingState
from ..worker import Replica
from .ledger import Ledger
from .regroup import Join, Regroup, join


class Replaceable(Protocol):
    """A worker as its keeper sees it (hosts/runtime.Worker is one): its replica and round loop,
    its own state, and its failures as WorkerErrors. A replacement imports nothing of the hosts."""

    @property
    def replica(self) -> Replica: ...

    @property
    def rounds(self) -> Rounds: ...

    def own_state(self) -> StateDict: ...

    def load_own_state(self, own: StateDict) -> None: ...

    def failure(self, error: BaseException) -> WorkerError: ...


@dataclass(frozen=True)
class Kept:
    """The state a round started from, kept to go back to if the round is lost."""

    state: TrainingState
    counters: Counters
    seq: int  # the round, counted over the worker's life (Rounds.seq)
    own: StateDict  # this worker's own: its RNG state, loss scale and its rounds' (Rounds.own_state)


@dataclass(frozen=True)
class WorkerSide:
    """What the main process gives every replaceable worker's process: the workers' ledgers
    (rank r's is ledgers[r]), the processes of a group and its collective timeout."""

    ledgers: list[Ledger]
    members: int
    timeout: datetime.timedelta

    def taking(self, rank: int) -> Ledger:
        """What records the takes of worker `rank` from its queue (feed/queue.QueueSource's ledger)."""
        return self.ledgers[rank]

    def survivor(self, rank: int, worker: Replaceable, source: QueueSource, results: Queue[Message], store: Store, into: Join) -> Keeper:
        """Worker `rank`'s side, reading `source` with its ledger, reporting on `results`, and
        joining a regroup's generation over `store` by `into`."""
        return Keeper(worker, source, self.ledgers[rank], rank, results, lambda generation: join(store, generation, self.members, self.timeout, into))


class Keep:
    """The state each round starts from, kept in every replica (any survivor's copy will do), and
    a regroup's redo from one: what a lost round goes back to under every host that redoes one
    (a spawned worker's Keeper, a fleet's member). Its host makes it the round loop's observer."""

    wants_averages = True  # an overlapped landing's average is what a round started from
    worker: Replaceable  # set by the subclass; a fleet's member swaps in the worker it builds for each new group

    def __init__(self) -> None:
        self.kept: Kept | None = None  # the state a redo of the oldest round not landed starts from
        self._begun: tuple[StateDict | None, StateDict] | None = None  # at the last round's start: its schedule and RNG
        self._average: TrainingState | None = None  # held at an overlapped landing (`average_landed`)
        self._redo: Kept | None = None  # a regroup's round, kept once its fit has started

    # -- the round loop's events (hooks.RoundObserver) --------------------------------------------

    def held_for(self, tag: int) -> None:
        """Nothing to record: the Keeper records its takes."""

    def round_starts(self, tag: int, epoch: int, finished: bool, landed: int) -> None:
        """Round `tag` starts, rounds up to `landed` have landed: this worker keeps what a redo
        of round `landed + 1` starts from. When that is this round, the worker holds the last
        average; with the previous round in flight, the average was held when round `landed`
        landed (or the kept state is still the one it started from), with the schedule and RNG
        of round `landed + 1`'s start."""
        r, rounds = self.worker.replica, self.worker.rounds
        # The kept state a new one replaces goes first: two at once are twice the model and its
        # optimizer's state, for a moment at every round.
        if landed == tag - 1:
            self.kept = None
            self.kept = Kept(r.state_dicts(), dataclasses.replace(rounds.counters), tag, rounds.own_state())
        elif self._average is not None and self._begun is not None:
            self.kept = None
            state = dataclasses.replace(self._average, lr_scheduler=self._begun[0])
            self.kept = Kept(state, dataclasses.replace(rounds.counters), landed + 1, self._begun[1])
        self._average, self._begun = None, None
        if landed < tag - 1:  # a redo of this round will start from the average of the one in flight
            self._begun = (None if r.schedule is None else copy.deepcopy(r.schedule.state_dict()), rounds.own_state())

    def average_landed(self) -> None:
        """The replica holds a landed average, for this call only (overlap_averaging)."""
        self._average = self.worker.replica.state_dicts()

    # -- its host's calls --------------------------------------------------------------------------

    @property
    def round(self) -> tuple[int, Counters] | None:
        """(round, counters) of the round kept, which a redo starts from; None before any."""
        return None if self.kept is None else (self.kept.seq, self.kept.counters)

    def started(self) -> None:
        """The fit has loaded its state: a regroup's round is kept again, so that a loss before
        the round's start redoes it, not an older one whose batches have landed."""
        if self._redo is not None:
            self.kept, self._redo = self._redo, None

    def receive(self, source: int) -> Kept:
        """In a new process group that this worker has joined: the kept state of its process
        `source`, by broadcast (a failure here is one more loss)."""
        box = [self.kept if dist.get_rank() == source else None]
        dist.broadcast_object_list(box, src=source)
        assert box[0] is not None, "the source of a regroup kept a round"
        return box[0]

    def redo(self, kept: Kept, until_epoch: int, start: float) -> FitCommand:
        """The fit that redoes the round `kept` (`receive`'s) began, until `until_epoch`, in the
        fit begun at `start`. What this worker kept goes: the fit loads a state of its own."""
        mine, self.kept = self.kept, None
        # A survivor that kept the same round goes back to its RNG from then; one whose last round
        # landed for the others only (the failure cut its collective) has the RNG it would have.
        if mine is not None and mine.seq == kept.seq:
            self.worker.load_own_state(mine.own)
        self.worker.rounds.regrouped(kept.own)  # the policy's choices, the same on every worker (a fresh one has none)
        self.worker.rounds.seq = kept.seq - 1  # the redone round starts as `kept.seq` again
        redo = FitCommand(until_epoch, dataclasses.replace(kept.counters), kept.state, None, start)
        # What this worker keeps while it redoes the round, until the round's start keeps it anew:
        # a loss before then goes back to this round, its own RNG with it (not the source's).
        self._redo = dataclasses.replace(kept, own=self.worker.own_state())
        return redo


class Keeper(Keep):
    """A replaceable spawned worker's side: records its takes, keeps each round's starting state
    (Keep), parks after a failure and regroups at the main process's word. Its host makes it the
    round loop's observer."""

    def __init__(self, worker: Replaceable, source: QueueSource, ledger: Ledger, rank: int, results: Queue[Message], join: Callable[[int], None]) -> None:
        super().__init__()
        self.worker, self.source, self.ledger, self.rank, self._results, self._join = worker, source, ledger, rank, results, join

    def held_for(self, tag: int) -> None:
        self.ledger.retag_last(tag)

    def round_starts(self, tag: int, epoch: int, finished: bool, landed: int) -> None:
        """Round `tag` starts, rounds up to `landed` have landed: the slots of their batches go
        back to the feeder, and this worker keeps what a redo of round `landed + 1` starts from."""
        self.source.release(self.ledger.cut(tag, epoch, finished, landed))
        super().round_starts(tag, epoch, finished, landed)

    def fit_of(self, command: object) -> FitCommand:
        """The fit that `command` stands for: a fit as it is; a Regroup's, the redo of its source's
        kept round. What this worker kept goes: the fit loads a state of its own (a regroup's
        round is kept again once it has: `started`)."""
        fit = command if isinstance(command, FitCommand) else self._regroup(cast(Regroup, command))
        self.kept = None
        return fit

    def lost(self, error: WorkerError) -> None:
        """Report the failure, leave the process group (every peer's collective ends) and say
        which round's state this worker kept."""
        self._results.put(("error", self.rank, error))
        if dist.is_initialized():
            dist.destroy_process_group()
        # With its pid: a message read late, from a process put down since, is told from its successor's.
        self._results.put(("parked", self.rank, (os.getpid(), self.round)))

    def fit_ended(self) -> None:
        """Every round of the fit landed: free what is still held (a batch taken ahead before an
        early stop; the ledger keeps no end of epoch past its fit)."""
        self.source.release([e.slot for e in self.ledger.entries() if e.slot != END_SLOT])
        self.ledger.clear()

    def report(self, report: Report) -> None:
        """A worker other than rank 0 sends its epochs' ends too (the main process passes on the
        first of each): rank 0 lost after an epoch's last round landed, before its report left,
        would take the epoch's end with it, and the epoch is not redone."""
        if isinstance(report, EpochEnd):
            reports: list[Report] = [report]
            self._results.put(("reports", self.rank, reports))

    def _regroup(self, command: Regroup) -> FitCommand:
        """Join generation `command.generation` and return the fit that redoes the source's kept
        round. A failure (a member lost as the group forms, or before the state reached every
        one) is a WorkerError at no batch, which parks this worker as any other loss does."""
        try:
            if not dist.is_initialized():
                self._join(command.generation)
            kept = self.receive(command.source)
        except Exception as e:  # noqa: BLE001 - gloo's refusals, a store's timeout, a group given up: one more loss
            failed = self.worker.failure(e)  # its summary and traceback
            raise WorkerError(
                self.rank,
                f"lost its peers while regrouping (process group generation {command.generation}): {failed.summary}; "
                "another worker was lost as the group formed, and the main process starts the regroup again without it",
                failed.details,
            ) from None
        return self.redo(kept, command.until_epoch, command.start)


__all__ = ["Keep", "Keeper", "Kept", "Replaceable", "WorkerSide"]
