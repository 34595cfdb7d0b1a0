"""Replacing a lost spawned worker (`.on_worker_failure("replace")`), both sides of it.

A process group cannot take a new member, so a replacement starts a new one, `generation` g:
1. A worker that fails (or that a peer's failure reaches through a collective, or that the main
   process calls away from its wait for a batch) reports it, leaves the process group, which
   ends every peer's collective at once, and parks: it reports the round it kept the state of
   (`Keeper.park`). The main process kills the worker that failed first, whichever it was.
2. The main process pauses the feed and puts back in front of every queue the batches it had
   fed from the round in progress on that the queue no longer holds, whoever took them (what the
   feeder put, feed.Unput), and frees the slots of the landed ones (the workers' ledgers,
   ledger.py; `refeed`); then it spawns a fresh process for the lost rank.
3. Every worker joins generation g. The survivor that kept the latest round sends its state to
   all (a survivor holds it: nothing goes through the disk or the main process), and every
   worker redoes that round from it (`Keeper.regroup`). So each batch counts once.
A batch on which two workers failed is not fed a third time: fit() raises naming it (`Recovery`).

A loss while generation g forms (a member killed or stopped, the fresh process among them) is
one more loss: the main process gives g up (`abandon`), so that no member waits for ever on one
that will not come (`assemble`), every member parks again, and it starts over from step 1 with
the members still alive, each loss counted against max_replacements.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from multiprocessing.synchronize import BoundedSemaphore, Lock
from typing import Protocol, cast

import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

from ..feed import END_SLOT, EndMark, Item, Put, QueueSource, Unput
from ..types import Counters, FitCommand, WorkerError
from .ledger import Ledger, split
from .runtime import Kept, Worker, one_traceback, summary
from .supervisor import Message

FORM_S = 5.0  # the most a regroup's members wait for each other's gloo addresses once all have come (8 form in 0.02 s)
_GO, _GIVEN_UP = "go", "given up"
_SETTLE_S = 0.01  # a queue emptied by refeed: nothing more has come for this long (the workers are parked: the queue's thread is not kept waiting)


@dataclass(frozen=True)
class Regroup:
    """The main process's word to every worker after a replacement: join process group
    `generation`, take the kept state of worker `source`, and redo its round."""

    generation: int
    source: int
    until_epoch: int
    start: float  # when the fit() began (FitCommand.start): a fresh worker's records count from it too


class Keeper:
    """A replaceable worker's side: records its takes, keeps each round's starting state, parks
    after a failure and regroups (hosts call it through their Hooks)."""

    def __init__(self, worker: Worker, source: QueueSource, ledger: Ledger) -> None:
        self.worker, self.source, self.ledger = worker, source, ledger
        self._redo: Kept | None = None  # a regroup's round, kept once its fit has started

    def took_ahead(self, tag: int) -> None:
        self.ledger.retag_last(tag)

    def round_starts(self, tag: int, epoch: int, finished: bool, landed: int) -> None:
        self.source.release(self.ledger.cut(tag, epoch, finished, landed))
        self.worker.keep(tag, landed)

    def fit_ended(self) -> None:
        """Every round of the fit landed: free what is still held (a batch taken ahead before an
        early stop; the ledger keeps no end of epoch past its fit)."""
        self.source.release([e.slot for e in self.ledger.entries() if e.slot != END_SLOT])
        self.ledger.clear()

    def park(self, rank: int, error: WorkerError, results: Queue[Message]) -> None:
        """Report the failure, leave the process group (every peer's collective ends) and say
        which round's state this worker kept."""
        results.put(("error", rank, error))
        if dist.is_initialized():
            dist.destroy_process_group()
        kept = self.worker.kept
        # With its pid: a message read late, from a process put down since, is told from its successor's.
        results.put(("parked", rank, (os.getpid(), None if kept is None else (kept.seq, kept.counters))))

    def regroup(self, command: Regroup, rank: int, join: Callable[[int], None]) -> FitCommand:
        """Join generation `command.generation` and return the fit that redoes the source's kept
        round. A failure (a member lost as the group forms, or before the state reached every
        one) is a WorkerError at no batch, which parks this worker as any other loss does."""
        try:
            if not dist.is_initialized():
                join(command.generation)
            box = [self.worker.kept if rank == command.source else None]
            dist.broadcast_object_list(box, src=command.source)
        except Exception as e:  # noqa: BLE001 - gloo's refusals, a store's timeout, a group given up: one more loss
            raise WorkerError(
                rank,
                f"lost its peers while regrouping (process group generation {command.generation}): {summary(e)}; "
                "another worker was lost as the group formed, and the main process starts the regroup again without it",
                one_traceback(e),
            ) from None
        kept = box[0]
        assert kept is not None, "the source of a regroup kept a round"
        mine = self.worker.kept
        # A survivor that kept the same round goes back to its RNG from then; one whose last round
        # landed for the others only (the failure cut its collective) has the RNG it would have.
        own = mine.own if mine is not None and mine.seq == kept.seq else None
        redo = self.worker.redo(kept, command.until_epoch, command.start, own)
        # What this worker keeps while it redoes the round, until the round's start keeps it anew:
        # a loss before then parks it with this round, its own RNG with it (not the source's).
        self._redo = dataclasses.replace(kept, own=self.worker.own_state())
        return redo

    def started(self) -> None:
        """The fit has loaded its state (Worker.start drops what was kept): a regroup's round is
        kept again, so that a loss before the round's start redoes it, not an older one whose
        batches have landed."""
        if self._redo is not None:
            self.worker.kept, self._redo = self._redo, None


def assemble(store: Store, members: int, generation: int) -> None:
    """Wait until every one of `members` has come to form generation `generation` (`store` is its
    prefix of the store), or until the main process gave it up (`abandon`): a member lost before it
    came would otherwise hold the others in gloo's rendezvous for the collective timeout."""
    if store.add("arrived", 1) == members:
        store.compare_set("formed", "", _GO)  # unless given up first: the first word stays
    store.wait(["formed"])
    if store.get("formed") != _GO.encode():
        raise RuntimeError(f"the main process gave up generation {generation}: a member was lost before every one had come")


def abandon(store: Store, generation: int) -> None:
    """Give up generation `generation` (`store`: the whole store) unless every member came already:
    those waiting in `assemble`, and those yet to come, fail at once and park again."""
    PrefixStore(f"generation-{generation}", store).compare_set("formed", "", _GIVEN_UP)


class Recovery:
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


def refeed(ledgers: Sequence[Ledger], seq: int, counters: Counters, unput: Unput, queues: Sequence[Queue[Item]], free_slots: Queue[int]) -> list[Put]:
    """Empty the queues (the feed is paused, every worker parked or dead) and return what goes
    back into them for a redo of round `seq`, which starts at batch `counters.position` of epoch
    `counters.epoch`: everything the feeder put from that batch on, from what it put (`unput`),
    not from what the workers took or the queues held. Queue by queue, epoch by epoch, the
    batches (by batch number), then the epoch's ends, which is the order the feeder put them in.
    - A worker killed between its take and its ledger's record of it took a batch no ledger names.
    - One killed in the middle of a take may have left a message's bytes in the pipe without its
      length, after which the queue no longer reads (`_discard`).
    - A previous refeed's batches that the feeder had still to put are among them, in their place.
    The feeder's next item (`unput.current`) it puts itself, after these. The ledgers say which
    slots hold landed batches: those go back to the feeder, and every ledger is cleared."""
    for ledger in ledgers:
        _, free = split(ledger.entries(), seq, counters.epoch)
        ledger.clear()
        for slot in free:
            free_slots.put(slot)
    for each in queues:
        _discard(each)
    first = (counters.epoch, counters.position)
    front: list[Put] = []
    for q, queue_ in enumerate(queues):
        current = unput.current[1] if unput.current is not None and unput.current[0] == q else None
        put_next = current[1][0] if isinstance(current, tuple) else None  # its slot
        batches = sorted(
            (epoch, item[0], item)
            for slot, (epoch, target, item) in unput.sent.items()
            if target == q and (epoch, item[0]) >= first and slot != put_next
        )  # fmt: skip
        # No worker can have taken an end of a later epoch: none has landed this epoch's last round.
        epochs = sorted({epoch for epoch, _, _ in batches} | {epoch for target, epoch in unput.ends if target == q and epoch >= counters.epoch})
        for epoch in epochs:
            front += [(queue_, item) for e, _, item in batches if e == epoch]
            front += [(queue_, EndMark(epoch))] * (unput.ends[q, epoch] - (current == EndMark(epoch)))
    return front


class _QueueInsides(Protocol):
    """What `_discard` uses of a multiprocessing Queue's private parts (CPython's queues.py)."""

    _rlock: Lock
    _buffer: collections.deque[object]
    _reader: Connection[object, object]
    _sem: BoundedSemaphore


def _discard(queue_: Queue[Item]) -> None:
    """Empty `q` (a multiprocessing Queue) without reading its items: a worker killed in the middle
    of a get may have read a message's length and not its bytes (a SIGSTOP, then the kill: the
    next get raised EOFError), so its bytes are read off the pipe as they are, until none has come
    for a while (what the feeder put just before its pause may still be flushing), and its count
    of items goes back to none. Its read lock, held by a worker killed while it waited, is
    released: with every worker parked or dead, a lock held is a dead worker's. (multiprocessing
    keeps no public handle on the lock, the pipe or the count.)"""
    q = cast(_QueueInsides, queue_)
    lock = q._rlock
    lock.acquire(False)  # free: now ours; held: by a dead worker. Released either way.
    lock.release()
    while q._buffer:  # the queue's own thread has yet to write these into the pipe
        time.sleep(0.001)
    reader, quiet = q._reader, time.monotonic()
    while time.monotonic() - quiet < _SETTLE_S:
        if reader.poll(_SETTLE_S / 5):
            os.read(reader.fileno(), 1 << 16)
            quiet = time.monotonic()
    while True:  # every item put took one from the count; a get gives it back
        try:
            q._sem.release()
        except ValueError:  # back to the queue's size: empty
            return
