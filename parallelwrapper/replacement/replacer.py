"""The main process's side of a replacement: the lost worker put down, its round fed again, a fresh process in its place, and every worker regrouped.

A replacement goes, generation g after generation g − 1 (regroup.py):
1. A worker that fails (or that a peer's failure reaches through a collective, or that the main
   process calls away from its wait for a batch: `call_away`) reports it, leaves the process
   group, which ends every peer's collective at once, and parks: it reports the round it kept the
   state of (keeper.py). The main process kills the worker that failed first, whichever it was.
2. The main process pauses the feed and puts back in front of every queue the batches it had
   fed from the round in progress on that the queue no longer holds, whoever took them, and
   frees the slots of the landed ones (refeed.py); then a fresh process takes the lost rank (the
   standby spawned ahead, its imports done).
3. Every worker joins generation g. The survivor that kept the latest round sends its state to
   all (a survivor holds it: nothing goes through the disk or the main process), and every
   worker redoes that round from it. So each batch counts once.
A batch on which two workers failed is not fed a third time: fit() raises naming it (`Account`).

A loss while generation g forms (a member killed or stopped, the fresh process among them) is
one more loss: the main process gives g up (regroup.abandon), every member parks again, and it
starts over from step 1 with the members still alive, each loss counted against max_replacements.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from multiprocessing.context import BaseContext
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Protocol, TypeVar

from torch.distributed import Store  # type: ignore[attr-defined]

from ..config import Config
from ..env import Placement, collective_timeout
from ..errors import WorkerError
from ..feed.queue import CallAway, Feeder, Item
from ..hooks import Phase
from ..messages import Message
from ..processes import START_TIMEOUT_S
from ..types import Counters, EpochEnd, Replacement, Report, Reporter
from .keeper import WorkerSide
from .ledger import Ledger
from .refeed import refeed
from .regroup import Regroup, abandon

P = TypeVar("P")  # a gathered message's payload


class Board(Protocol):
    """The workers' progress board (hosts/supervisor.ProgressBoard), as a replacement marks a rank idle."""

    def write(self, rank: int, phase: Phase, epoch: int, index: int, step: int) -> None: ...


class Pool(Protocol):
    """The spawned host as a replacement sees it (hosts/spawned.WorkerPool is one): its context,
    store, queues and their free slots, abort event and board, its processes by rank, and its own
    ways with them. A replacement imports nothing of the hosts."""

    ctx: BaseContext
    store: Store
    data_queues: list[Queue[Item]]
    free_slots: Queue[int]
    abort: Event
    board: Board

    def pid(self, rank: int) -> int | None:
        """The process id of `rank`'s process as it is now."""
        ...

    def command(self, word: Regroup) -> None:
        """Put `word` on every process's command queue."""

    def spawn_standby(self) -> None:
        """Spawn a process ahead (its imports done), unless there is one."""

    def put_down(self, rank: int) -> None:
        """Kill `rank`'s process, which its supervisor then passes over."""

    def occupy(self, rank: int) -> None:
        """Have a fresh process take `rank` (the standby when there is one), to join the group at the next Regroup."""


class Watch(Protocol):
    """The host's watch over its workers (hosts/supervisor.Supervisor), as a replacement waits on them."""

    gone: set[int]

    def gather(
        self, kind: str, ranks: set[int], timeout_s: float, on_other: Callable[[Message], None], stage: str, echoes: bool = False, pid: bool = False,
        got: dict[int, P] | None = None,
    ) -> dict[int, P]: ...


class _Ended(Exception):
    """A worker ended the fit while another was being replaced."""


class Replacer:
    """The main process's side of `.on_worker_failure("replace")` for a pool of spawned workers:
    its ledgers and account, the generation of the workers' process group, and the epochs' ends
    that workers other than rank 0 send (rank 0's may be lost with it)."""

    def __init__(self, config: Config, placement: Placement, pool: Pool) -> None:
        """`pool`: the spawned host, as the replacement sees it, whose processes it replaces."""
        n = placement.world_size
        self._config, self._pool, self._processes = config, pool, placement.processes
        self._queues: Sequence[Queue[Item]] = pool.data_queues
        self._readers = n // len(self._queues)
        # A replaceable worker keeps a round's slots until it lands (ledger.py): all together they
        # hold the round's N·k batches (two rounds' with overlap_averaging, the one in flight too)
        # and one taken ahead each, beyond the prefetched ones. One worker may take all of a round
        # (first-come), then one ahead and an end of epoch.
        # The autopilot's rounds may grow to its k_max, and land late once it overlaps.
        pilot = config.autopilot
        k = config.averaging_frequency if pilot is None else pilot.k_max
        in_flight = 2 if config.overlap_averaging or (pilot is not None and pilot.overlap) else 1
        self.slots = n * (in_flight * k + 1)  # the slots its workers hold beyond the prefetched ones
        ledgers = [Ledger(pool.ctx, in_flight * (k if config.deterministic else n * k) + 2) for _ in range(n)]
        self.worker_side = WorkerSide(ledgers, placement.processes, collective_timeout(config))  # what each worker's process is given
        self._account = Account(config.max_replacements)
        self._generation = 0
        self._start = 0.0  # when the fit() began (FitCommand.start): a replacement's record counts seconds from it
        self._spare_ends: dict[int, EpochEnd] = {}  # epoch -> its end, from a worker other than rank 0
        self._ended: set[int] = set()  # this fit's epochs whose end was passed on

    def started(self) -> None:
        """The pool's first processes are spawned: a standby goes ahead, for the first replacement."""
        if self._account.left > 0:
            self._pool.spawn_standby()

    def fit_starts(self, start: float) -> None:
        """A fit() that began at `start` starts: no epoch of it has ended yet."""
        self._start = start
        self._spare_ends.clear()
        self._ended.clear()

    def passes(self, rank: int, report: Report) -> bool:
        """Whether worker `rank`'s `report` goes on to the fit's listeners. Rank 0 reports; every
        other worker sends its epochs' ends too (keeper.py), kept aside until rank 0's comes, or
        until rank 0 is replaced without sending it (`replace`)."""
        if isinstance(report, EpochEnd) and (rank != 0 or report.epoch in self._ended):
            if report.epoch not in self._ended:
                self._spare_ends.setdefault(report.epoch, report)
            return False
        if isinstance(report, EpochEnd):
            self._spare_ends.pop(report.epoch, None)
            self._ended.add(report.epoch)
        return True

    def call_away(self) -> None:
        """A worker failed: every worker leaves its wait for a batch (the abort event), at once
        (feed/queue.CallAway, one for each worker that reads a queue; a full queue has no one waiting).
        refeed drains what no one took."""
        if self._pool.abort.is_set():
            return
        self._pool.abort.set()
        for q in self._queues:
            for _ in range(self._readers):
                try:
                    q.put_nowait(CallAway())
                except queue.Full:
                    break

    def replace(self, error: WorkerError, feeder: Feeder, until_epoch: int, supervisor: Watch, pass_on: Callable[[Message], object], on_report: Reporter) -> None:
        """Replace the worker that failed first, and have every worker redo the round. A loss
        while they regroup (a member killed or stopped as the new group forms, the fresh process
        among them) is one more: that process goes too, the generation is given up, and the
        regroup starts again with the members still alive, each loss within max_replacements.
        Messages other than the workers' answers go to `pass_on`."""
        parked: dict[int, tuple[int, Counters] | None] = {}  # since the last Regroup: the round each kept
        starting: set[int] = set()  # ranks taken by fresh processes
        ready: dict[int, None] = {}  # those that have said they are ready
        lost: list[WorkerError] = []

        def on_other(message: Message) -> None:
            if message[0] == "ready" and message[1] in starting and message[2][0] == self._pool.pid(message[1]):
                ready[message[1]] = None
            elif message[0] in ("done", "stopped"):  # a worker ended the fit: nothing is left to redo it with
                raise _Ended
            else:
                pass_on(message)

        while True:
            self._account.admit(error)  # raises when no replacement is left, or on a poison batch
            lost.append(error)
            self.call_away()
            feeder.pause()
            if self._generation > 0:  # a group that lost a member as it formed: whoever waits for it parks again
                abandon(self._pool.store, self._generation)
            self._pool.put_down(error.rank)
            parked.pop(error.rank, None)
            starting.discard(error.rank)
            ready.pop(error.rank, None)
            others = set(range(self._processes)) - supervisor.gone
            try:
                recovering = f"recovering from worker {lost[0].rank}'s failure"
                supervisor.gather("parked", others, self._config.stall_timeout, on_other, recovering, echoes=True, pid=True, got=parked)
            except WorkerError as again:  # one more loss, while the others park
                error = again
                continue
            except _Ended:
                raise lost[0] from None
            source, seq, counters = newest(parked, lost)
            front = refeed(self.worker_side.ledgers, seq, counters, feeder.take_back(), self._queues, self._pool.free_slots)
            self._generation += 1
            for rank in sorted(supervisor.gone):
                self._pool.board.write(rank, Phase.IDLE, counters.epoch, -1, 0)
                self._pool.occupy(rank)
                starting.add(rank)
            self._pool.abort.clear()
            self._pool.command(Regroup(self._generation, source, until_epoch, self._start))
            parked = {}  # from here, a loss parks every member again
            feeder.resume(front)
            try:
                supervisor.gather("ready", starting, START_TIMEOUT_S, on_other, "starting", pid=True, got=ready)
            except WorkerError as again:
                error = again
                continue
            except _Ended:
                raise lost[0] from None
            break
        for epoch in sorted(e for e in self._spare_ends if e < counters.epoch):  # ended, and rank 0's report of it lost with it
            self._ended.add(epoch)
            on_report(self._spare_ends.pop(epoch))
        for e in lost:
            on_report(Replacement(e.rank, e, counters.rounds + 1, time.monotonic() - self._start, counters=counters))
        if self._account.left > 0:
            self._pool.spawn_standby()  # for the next one


class Account:
    """The main process's account: replacements left, and the batches workers failed on."""

    def __init__(self, max_replacements: int) -> None:
        self.left = max_replacements
        self._failed: dict[tuple[int, int], WorkerError] = {}

    def admit(self, error: WorkerError) -> None:
        """Raise `error` when no replacement is left; raise a poison-batch error when this is the
        second failure on the same batch."""
        if error.batch is not None and error.epoch is not None:
            first = self._failed.setdefault((error.epoch, error.batch), error)
            if first is not error:
                raise WorkerError(
                    error.rank,
                    f"batch {error.batch} of epoch {error.epoch} failed on two workers in turn (first on worker "
                    f"{first.rank}: {first.summary}); it fails wherever it goes: fix or drop that batch. {error.summary}",
                    error.details,
                    error.where,
                )
        if self.left <= 0:
            raise error
        self.left -= 1


def newest(parked: dict[int, tuple[int, Counters] | None], lost: Sequence[WorkerError]) -> tuple[int, int, Counters]:
    """(source rank, round, counters) of the latest round a survivor kept: the one every worker
    redoes. None kept one: the first loss raises when no survivor had started a round; after
    losses during the regroup, the last survivor that held the state was among them."""
    kept = {r: v for r, v in parked.items() if v is not None}
    if not kept and len(lost) == 1:
        raise lost[0]  # no survivor had started a round: nothing to go back to
    if not kept:
        last = lost[-1]
        raise WorkerError(
            last.rank,
            f"{last.summary}; it was the last worker that held the state to redo the round from ({len(lost)} losses in one "
            f"replacement, the first worker {lost[0].rank}'s: {lost[0].summary}): fit() cannot go on; "
            "with .checkpoint(dir) a new fit() resumes from the last checkpoint",
            last.details,
            last.where,
        )
    source = max(kept, key=lambda r: (kept[r][0], -r))
    seq, counters = kept[source]
    return source, seq, counters


__all__ = ["Account", "Board", "Pool", "Replacer", "Watch", "newest"]
